"""torch_triton_gemm.bench without a GPU: options, the suites against the benchmark shape list,
tables, summary, CSV, the helpers that build grouped and fp8 inputs, and ``--help`` / ``--list``
in a fresh process with the optional plotting packages blocked. No tgemm kernel runs in those;
the tests marked ``gpu`` measure a few rows on a GPU (the benchmark itself:
``python -m torch_triton_gemm.bench --quick``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from samples import rel_error
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_triton_gemm.bench import (
    cli,
    e2e,
    gemm,
    grouped,
    report,
    scaled,
    sgrouped,
    suites,
    timing,
)
from torch_triton_gemm.bench.results import (
    DEVICE_BUILT_NOTE,
    ColdStartResult,
    E2EResult,
    GemmResult,
    LatencyResult,
    RunResults,
)
from torch_triton_gemm.bench.suites import (
    Case,
    GroupedCase,
    MoECase,
    ScaledCase,
    ScaledGroupedCase,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- options ------------------------------------------------------------------------------------


def test_default_options():
    args = cli.parse_args([])
    assert args.suite == list(suites.DEFAULT_SUITES)
    assert "grouped" not in args.suite and "scaled" not in args.suite
    assert "sgrouped" not in args.suite and "moe" not in args.suite
    assert args.dtypes == ["bf16", "fp16"]
    assert (args.warmup, args.rep, args.rounds, args.calls) == (25, 100, 2, 16)
    assert not (args.quick or args.list or args.markdown)
    assert args.csv is None and args.plot is None and args.out is None


def test_quick_runs_bf16_unless_told_otherwise():
    assert cli.parse_args(["--quick"]).dtypes == ["bf16"]
    assert cli.parse_args(["--quick", "--dtypes", "fp16,bf16"]).dtypes == ["fp16", "bf16"]
    assert cli.parse_args(["--dtypes", "half,float16,bfloat16"]).dtypes == ["fp16", "bf16"]


def test_suite_names_groups_and_run_order():
    assert cli.parse_args(["--suite", "scaled,square"]).suite == ["square", "scaled"]
    assert cli.parse_args(["--suite", "mm"]).suite == list(suites.MM_SUITES)
    assert cli.parse_args(["--suite", "all"]).suite == list(suites.ALL_SUITES)
    assert cli.parse_args(["--suite", "grouped,mm, grouped"]).suite == [
        *suites.MM_SUITES, "grouped"]


def test_planner_suites_and_their_options():
    args = cli.parse_args([])
    assert "sweep" not in args.suite and "classes" not in args.suite  # long: only when named
    assert (args.seed, args.count, args.inductor) == (0, 400, False)
    assert cli.parse_args(["--suite", "all"]).suite[-2:] == ["classes", "sweep"]
    args = cli.parse_args(["--suite", "sweep", "--seed", "7", "--count", "12", "--inductor"])
    assert (args.suite, args.seed, args.count, args.inductor) == (["sweep"], 7, 12, True)
    assert args.dtypes == ["bf16", "fp16"]
    assert cli.parse_args(["--quick"]).count == 40
    assert cli.parse_args(["--quick", "--count", "5"]).count == 5


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "expected a positive integer"),
    (["--suite", "nope"], "unknown suite 'nope'"),
    (["--suite", ","], "no suite given"),
    (["--dtypes", "fp64"], "unknown dtype 'fp64'"),
    (["--rounds", "0"], "expected a positive integer"),
])
def test_bad_options_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert message in capsys.readouterr().err


# --- suites against the shape list --------------------------------------------------------------

# Rows per suite (per dtype for the mm suites) as the benchmark shape list defines them
# ("training" is this benchmark's own: 8 layers, three GEMMs each).
SHAPE_LIST_COUNTS = {"square": 4, "llama": 28, "layouts": 2, "decode": 16, "odd": 4, "deepk": 3,
                     "shallowk": 2, "latency": 2, "e2e": 1, "coldstart": 8, "grouped": 13,
                     "scaled": 95, "sgrouped": 24, "moe": 8, "training": 24, "classes": 21,
                     "sweep": 400}


def test_suite_row_counts_match_the_shape_list():
    assert set(SHAPE_LIST_COUNTS) == set(suites.ALL_SUITES)
    for suite, count in SHAPE_LIST_COUNTS.items():
        assert suites.suite_row_count(suite) == count, suite
        assert 0 < suites.suite_row_count(suite, quick=True) <= count, suite


def _shapes(suite: str) -> set[tuple[int, int, int]]:
    return {(c.m, c.n, c.k) for c in suites.suite_cases(suite)}


def test_mm_suite_shapes():
    layers = {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    for suite, ms in (("llama", {1, 16, 64, 128, 512, 2048, 8192}), ("decode", {2, 4, 8, 32})):
        assert _shapes(suite) == {(m, n, k) for m in ms for n, k in layers}
    assert _shapes("square") == {(s, s, s) for s in (1024, 2048, 4096, 8192)}
    assert _shapes("odd") == {(999, 1003, 1007), (1500,) * 3, (2047, 2049, 2051), (3000,) * 3}
    assert _shapes("deepk") == {(128, 128, 32768), (512, 512, 65536), (1024, 1024, 16384)}
    assert _shapes("shallowk") == {(8192, 8192, 128), (32768, 4096, 32)}
    assert _shapes("latency") == {(64, 64, 64), (1, 6144, 4096)}
    layouts = {(c.a_layout, c.b_layout) for c in suites.suite_cases("layouts")}
    assert layouts == {("row", "row"), ("col", "col")}
    others = [c for s in suites.MM_SUITES if s != "layouts" for c in suites.suite_cases(s)]
    assert all((c.a_layout, c.b_layout) == ("row", "col") for c in others)
    assert suites.build_cases(["odd", "e2e", "square"]) == [
        *suites.suite_cases("square"), *suites.suite_cases("odd")]


def test_training_suite_shapes():
    """Per layer: the forward x @ W.t(), the input gradient dy @ W and the weight gradient
    dy.t() @ x, with the layouts autograd gives them."""
    cases = suites.suite_cases("training")
    fwd, dgrad, wgrad = cases[:3]
    assert (fwd.m, fwd.n, fwd.k, fwd.a_layout, fwd.b_layout) == (4096, 6144, 4096, "row", "col")
    assert (dgrad.m, dgrad.n, dgrad.k, dgrad.b_layout) == (4096, 4096, 6144, "row")
    assert (wgrad.m, wgrad.n, wgrad.k, wgrad.a_layout, wgrad.b_layout) == (
        6144, 4096, 4096, "col", "row")
    assert [c.shape_class for c in cases[:3]] == ["fwd", "dgrad", "wgrad"]
    assert cases[0].label() == "training fwd llama3-8b qkv"
    assert cases[-1].label() == "training wgrad dropin lm_head" and cases[-1].k == 8192
    assert len(suites.suite_cases("training", quick=True)) == 6


def test_classes_suite_shapes():
    expected = {
        "near1000": {(1000, 1000, 1000), (1000, 1024, 1000), (1016, 1000, 1008),
                     (1000, 4096, 1000)},
        "overwave": {(1536, 1536, 1536), (1536, 1664, 1536), (1408, 1664, 2048)},
        "near3000": {(3000, 3000, 3000), (2992, 3008, 3000), (3072, 3000, 3000)},
        "decode32": {(32, 4096, 4096), (32, 12288, 4096), (32, 4096, 11008)},
        "decode1": {(1, 4096, 4096), (1, 12288, 4096), (1, 4096, 11008)},
        "wideN": {(256, 22016, 4096), (256, 28672, 4096)},
        "deepK": {(256, 256, 16384), (128, 128, 8192), (512, 512, 32768)},
    }
    cases = suites.suite_cases("classes")
    found: dict[str, set] = {}
    for c in cases:
        found.setdefault(c.shape_class, set()).add((c.m, c.n, c.k))
    assert found == expected
    assert all((c.a_layout, c.b_layout, c.a_pad, c.b_pad) == ("row", "col", 0, 0) for c in cases)
    # 128x128 tiles just over one wave of 132 SMs.
    assert all(132 < -(-c.m // 128) * -(-c.n // 128) <= 2 * 132
               for c in cases if c.shape_class == "overwave")
    quick = suites.suite_cases("classes", quick=True)
    assert [c.shape_class for c in quick] == list(expected)
    assert quick[0].label() == "classes near1000 1000^3"


def _row_stride(case: Case, operand: str) -> int:
    """Elements between rows of the buffer ``operand`` is sliced from (independently of
    Case.stored)."""
    if operand == "a":
        width = case.k if case.a_layout == "row" else case.m
        return width + case.a_pad
    width = case.k if case.b_layout == "col" else case.n
    return width + case.b_pad


def test_sweep_is_a_pure_function_of_seed_and_count():
    cases = suites.sweep_cases(0, 400)
    assert cases == suites.sweep_cases(0, 400)
    assert cases[:20] == suites.sweep_cases(0, 20)  # a longer sweep starts with a shorter one
    other = suites.sweep_cases(1, 400)
    assert len({(c.m, c.n, c.k) for c in cases} & {(c.m, c.n, c.k) for c in other}) < 40
    assert suites.suite_cases("sweep", seed=3, count=7) == suites.sweep_cases(3, 7)
    assert suites.suite_cases("sweep") == cases
    assert len(suites.suite_cases("sweep", quick=True)) == suites.QUICK_SWEEP_COUNT
    # The same in a fresh process with another hash seed.
    script = ("from torch_triton_gemm.bench import suites\n"
              "print('|'.join(repr(c) for c in suites.sweep_cases(5, 50)))")
    env = dict(os.environ, PYTHONHASHSEED="123")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "|".join(repr(c) for c in suites.sweep_cases(5, 50))


def test_few_row_sets_span_the_transposed_rules_range(monkeypatch):
    """bench.plans' fewrows / scaled-fewrows: seeded products of 2-32 rows against 2048-65536
    weight rows, K 2048-16384, some K not a multiple of 128 or of 16 bytes (16-bit only; fp8
    keeps N and K multiples of 16 for torch._scaled_mm); the same for a seed, and enough of
    them within a wave, from two waves and outside the transposed rule to judge it."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)
    cases = suites.few_row_cases(2026, 144)
    assert cases == suites.few_row_cases(2026, 144) and cases != suites.few_row_cases(1, 144)
    assert plans._cases(["fewrows"], 2026, 144) == cases
    assert all(2 <= c.m <= 32 and 2048 <= c.n <= 65536 and 2048 <= c.k <= 16384
               and c.suite == "fewrows" and (c.a_layout, c.b_layout) == ("row", "col")
               for c in cases)
    assert any(c.k % 8 for c in cases) and any(c.k % 128 for c in cases if c.k % 8 == 0)
    plans_of = [tuning.swap_plan(c.m, c.n, c.k, 2, 132, 4814.3) if c.k % 16 == 0 else None
                for c in cases]
    within = [p for p, c in zip(plans_of, cases) if p and -(-c.n // 64) <= 132]
    assert len(within) >= 20 and sum(p is not None for p in plans_of) - len(within) >= 10
    assert sum(p is None for p in plans_of) >= 40
    scaled = suites.few_row_scaled_cases(2027, 64)
    assert len(scaled) == 256 and all(c.n % 16 == 0 and c.k % 16 == 0 for c in scaled)
    assert {(c.recipe, c.fast) for c in scaled} == {
        (r, f) for r in ("tensorwise", "rowwise") for f in (False, True)}
    assert plans._cases(["scaled-fewrows"], 2027, 64) == scaled


def test_few_row_sets_over_a_range_of_weight_rows(monkeypatch, capsys):
    """bench.plans --few-rows-n LO,HI draws the weights' rows over LO..HI (weights of fewer
    64-row tiles than half a wave: the transposed rule's lower bounds), reaching below and
    above those bounds; a bad range is refused before any GPU is asked for."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    cases = suites.few_row_cases(2040, 96, (2048, 4224))
    assert cases == plans._cases(["fewrows"], 2040, 96, few_rows_n=(2048, 4224))
    assert cases != suites.few_row_cases(2040, 96)
    assert all(2048 <= c.n <= 4224 for c in cases)
    waves = [-(-c.n // 64) / 132 for c in cases]
    assert min(waves) < tuning.SWAP_MIN_WAVES_16_ROWS[1] and max(waves) > tuning.SWAP_MIN_WAVES
    scaled = plans._cases(["scaled-fewrows"], 2041, 8, few_rows_n=(2048, 4224))
    assert len(scaled) == 32 and all(2048 <= c.n <= 4224 and c.n % 16 == 0 for c in scaled)
    mid = plans._cases(["midrows"], 2070, 40)
    assert mid == suites.few_row_cases(2070, 40, m_range=suites.MID_ROWS_M)
    assert all(33 <= c.m <= 512 and c.suite == "midrows" for c in mid)
    assert min(c.m for c in mid) < 100 and max(c.m for c in mid) > 400
    mid_scaled = plans._cases(["scaled-midrows"], 2071, 4)
    assert len(mid_scaled) == 16 and all(33 <= c.m <= 512 for c in mid_scaled)
    for bad in ("4224,2048", "0,10", "2048", "a,b"):
        with pytest.raises(SystemExit) as exit_info:
            plans.main(["--few-rows-n", bad])
        assert exit_info.value.code == 2 and "--few-rows-n" in capsys.readouterr().err
    shapes = plans._cases([], 1, 10, shapes=[(512, 6144, 4040), (64, 64, 64)])
    assert shapes == [suites.Case("shapes", "512x6144x4040", 512, 6144, 4040),
                      suites.Case("shapes", "64^3", 64, 64, 64)]
    assert shapes[0].a_layout == "row" and shapes[0].b_layout == "col"  # x @ W.t()
    both = plans._cases(["classes"], 1, 10, shapes=[(512, 6144, 4040)])
    assert both[-1] == shapes[0] and both[:-1] == plans._cases(["classes"], 1, 10)
    with pytest.raises(SystemExit) as exit_info:
        plans.main(["--shapes", "512x6144", "--csv", "x.csv"])
    assert exit_info.value.code == 2 and "not MxNxK" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sweep_shapes_bounds_classes_and_layouts(seed):
    cases = suites.sweep_cases(seed, 400)
    sizes = [s for c in cases for s in (c.m, c.n, c.k)]
    assert all(1 <= s <= 16384 for s in sizes)
    assert all(2 * c.m * c.n * c.k <= 2**34 for c in cases)
    # Log-uniform: every decade of sizes is there.
    assert min(sizes) < 10 and max(sizes) > 8192
    assert all(any(10**d <= s < 10**(d + 1) for s in sizes) for d in range(4))
    not_16 = sum(s % 16 != 0 for s in sizes) / len(sizes)
    assert 0.3 < not_16 < 0.6
    assert any(s % 8 == 0 and s % 16 != 0 for s in sizes) and any(s % 8 for s in sizes)
    for c in cases:
        expected = ("mult64" if all(s % 64 == 0 for s in (c.m, c.n, c.k)) else
                    "mult8" if all(s % 8 == 0 for s in (c.m, c.n, c.k)) else "arbitrary")
        assert c.shape_class == expected and c.suite == "sweep"
    assert {c.shape_class for c in cases} == {"mult64", "mult8", "arbitrary"}
    other = [c for c in cases if (c.a_layout, c.b_layout, c.a_pad, c.b_pad) != ("row", "col", 0, 0)]
    assert 0.15 < len(other) / len(cases) < 0.35
    assert any(c.a_layout == "col" for c in other) and any(c.b_layout == "row" for c in other)
    sliced = [(c, op) for c in other for op in ("a", "b") if (c.a_pad, c.b_pad)[op == "b"]]
    aligned = [_row_stride(c, op) * 2 % 16 == 0 for c, op in sliced]  # 2-byte elements
    assert any(aligned) and not all(aligned)
    assert {op for _, op in sliced} == {"a", "b"}
    for c in cases:  # the name says what is not nn.Linear's layout
        tags = c.name.split()[1:]
        assert ("a-col" in tags) == (c.a_layout == "col")
        assert ("b-row" in tags) == (c.b_layout == "row")
        assert (f"a-pad{c.a_pad}" in tags) == bool(c.a_pad)
        assert (f"b-pad{c.b_pad}" in tags) == bool(c.b_pad)


@pytest.mark.parametrize("a_layout, b_layout, a_pad, b_pad", [
    ("row", "col", 0, 0), ("col", "row", 0, 0), ("row", "col", 13, 8), ("col", "row", 3, 24),
    ("row", "row", 0, 5), ("col", "col", 16, 0)])
def test_make_operands_builds_the_layouts_and_sliced_views(a_layout, b_layout, a_pad, b_pad):
    m, n, k = 12, 20, 36
    case = Case("t", "t", m, n, k, a_layout, b_layout, a_pad, b_pad)
    a, b = gemm.make_operands(case, torch.float32, torch.device("cpu"))
    assert a.shape == (m, k) and b.shape == (k, n)
    expected_a = (k + a_pad, 1) if a_layout == "row" else (1, m + a_pad)
    expected_b = (1, k + b_pad) if b_layout == "col" else (n + b_pad, 1)
    assert a.stride() == expected_a and b.stride() == expected_b
    for x, pad in ((a, a_pad), (b, b_pad)):
        assert x.storage_offset() == 0  # the buffer's first columns: copies keep the alignment
        stored = x if x.stride()[1] == 1 else x.t()
        assert stored.stride() == (stored.shape[1] + pad, 1)
        # Every element of the buffer is random (no zeros), the pad columns included.
        buffer = torch.as_strided(stored, (stored.shape[0], stored.shape[1] + pad),
                                  (stored.shape[1] + pad, 1))
        assert (buffer != 0).all() and buffer.std() > 0.5
    copy_a, copy_b = timing.operand_copies((a, b), calls=2)[1]
    assert copy_a.stride() == a.stride() and copy_b.stride() == b.stride()
    assert torch.equal(copy_a, a) and torch.equal(copy_b, b)


def test_make_operands_for_every_sweep_case():
    for case in suites.sweep_cases(0, 400):
        a, b = gemm.make_operands(case, torch.bfloat16, torch.device("meta"))
        assert a.shape == (case.m, case.k) and b.shape == (case.k, case.n)
        a_stride, b_stride = _row_stride(case, "a"), _row_stride(case, "b")
        assert a.stride() == ((a_stride, 1) if case.a_layout == "row" else (1, a_stride))
        assert b.stride() == ((1, b_stride) if case.b_layout == "col" else (b_stride, 1))


def test_memory_bound_rows_are_the_skinny_ones():
    bound = {c.label() for s in suites.MM_SUITES for c in suites.suite_cases(s) if c.memory_bound}
    assert all(c.memory_bound for c in suites.suite_cases("decode"))
    assert all(c.memory_bound == (c.m <= 64) for c in suites.suite_cases("llama"))
    assert "shallowk 32768x4096x32" in bound
    assert not any(label.startswith(("square", "odd", "layouts")) for label in bound)


def test_grouped_suite_cases():
    cases = suites.grouped_cases()
    mixtral = [c for c in cases if c.name == "mixtral"]
    assert {(c.form, c.tokens) for c in mixtral} == {
        (f, t) for f in ("fwd", "fwd+bwd", "wgrad") for t in (2048, 8192, 32768)}
    assert all((c.groups, c.k, c.n, c.routing) == (8, 4096, 14336, "balanced") for c in mixtral)
    deepseek = [c for c in cases if c.name == "deepseek"]
    assert {(c.form, c.routing) for c in deepseek} == {
        (f, r) for f in ("fwd", "fwd+bwd") for r in ("balanced", "skewed")}
    assert all((c.groups, c.k, c.n, c.tokens) == (256, 7168, 2048, 32768) for c in deepseek)
    for c in cases:
        assert sum(c.group_sizes()) == c.tokens and len(c.group_sizes()) == c.groups
    assert GroupedCase("m", "fwd+bwd", 8, 2048, 14336, 4096).flops == 3 * 2 * 2048 * 14336 * 4096


def test_skewed_routing_is_zipf_like_with_empty_experts():
    sizes = suites.skewed_sizes(32768, 256)
    assert sizes == suites.skewed_sizes(32768, 256)  # the same on every run
    assert sum(sizes) == 32768 and all(s % suites.GROUP_ALIGN == 0 for s in sizes)
    empty = sum(s == 0 for s in sizes)
    assert 0 < empty < 256 // 4
    assert max(sizes) > 10 * 32768 // 256 and max(sizes) < 32768 // 2
    assert sizes != sorted(sizes, reverse=True)  # shuffled, not in rank order
    assert suites.balanced_sizes(32768, 256) == [128] * 256


def test_scaled_suite_cases():
    cases = suites.scaled_cases()
    shapes = {(c.m, c.n, c.k) for c in cases}
    llama = {(m, n, k) for m in (16, 128, 2048, 8192)
             for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
    assert shapes == {(4096,) * 3, (8192,) * 3, (4096, 18944, 3584)} | llama
    for recipe in ("tensorwise", "rowwise"):  # both accumulation modes
        assert {(c.m, c.n, c.k, c.fast) for c in cases if c.recipe == recipe} == {
            (*shape, fast) for shape in shapes for fast in (False, True)}
    assert {(c.m, c.n, c.k, c.fast) for c in cases if c.recipe == "blockwise"} == {
        (*shape, False) for shape in shapes}
    assert len({c.label() for c in cases}) == len(cases)
    assert all(not c.fast for c in suites.scaled_cases(quick=True))
    # 128x128 blocks tile every weight; torch._scaled_mm wants sizes divisible by 16.
    assert all(c.n % 128 == 0 and c.k % 128 == 0 and c.m % 16 == 0 for c in cases)


def test_sgrouped_suite_cases():
    cases = suites.sgrouped_cases()
    shapes = {("mixtral", "gate_up"): (8, 28672, 4096), ("mixtral", "down"): (8, 4096, 14336),
              ("deepseek", "gate_up"): (256, 4096, 7168), ("deepseek", "down"): (256, 7168, 2048)}
    tokens = {"mixtral": {8192, 32768}, "deepseek": {8192}}  # routed rows: tokens * top-k
    expected = {(name, proj, t, routing, fast) for (name, proj) in shapes for t in tokens[name]
                for routing in ("balanced", "skewed") for fast in (False, True)}
    assert {(c.name, c.proj, c.tokens, c.routing, c.fast_accum) for c in cases} == expected
    assert len(cases) == len(expected)
    for c in cases:
        assert (c.groups, c.n, c.k) == shapes[c.name, c.proj]
        sizes = c.group_sizes()
        # torch's grouped fp8 kernels need every group a multiple of 16 rows.
        assert len(sizes) == c.groups and sum(sizes) == c.tokens
        assert all(size % 16 == 0 for size in sizes)
        assert c.flops == 2 * c.tokens * c.n * c.k
    skewed = next(c for c in cases if c.name == "deepseek" and c.routing == "skewed")
    assert 0 in skewed.group_sizes() and max(skewed.group_sizes()) > 4 * 8192 // 256
    quick = suites.sgrouped_cases(quick=True)
    assert set(quick) < set(cases)
    # Every quick shape in both accumulation modes, each model and projection present.
    assert {(c.name, c.proj) for c in quick} == set(shapes)
    assert all(dataclasses.replace(c, fast_accum=not c.fast_accum) in quick for c in quick)
    assert quick[0].label() == "sgrouped mixtral gate_up balanced T=8192 accum=fp32"


def test_moe_suite_cases():
    cases = suites.moe_cases()
    assert {(c.name, c.form, c.tokens) for c in cases} == {
        (n, f, t) for n in ("mixtral", "qwen3") for f in ("fwd", "fwd+bwd") for t in (4096, 16384)}
    for c in cases:
        want = (8, 2, 4096, 14336) if c.name == "mixtral" else (128, 8, 2048, 768)
        assert (c.experts, c.top_k, c.hidden, c.inter) == want
    assert MoECase("m", "fwd+bwd", 8, 2, 4096, 14336, 4096).flops == (
        3 * 3 * 2 * 4096 * 2 * 4096 * 14336)


def test_moe_section_and_csv_report_peak_memory(tmp_path):
    row = GemmResult(MoECase("qwen3", "fwd", 128, 8, 2048, 768, 4096), "bf16",
                     {"tgemm": 2.0, "torch": 3.0}, {"tgemm": 2.5, "torch": 3.5}, 4e-3,
                     "fp32 loop", 1.0, peak_mib={"tgemm": 100.0, "torch": 900.0},
                     sm_mhz={"tgemm": 1755.0, "torch": 1980.0}, power_w={"tgemm": 699.5})
    results = RunResults(moe=[row])
    (section,) = report.sections(results)
    cells = _cells(section.render(), "qwen3 fwd")
    assert cells[9:15] == ["1.50", "1.40", "100", "900", "1755/1980", "700/n/a"]
    assert _cells(report.summary(results), "moe vs torch")[3:6] == ["bf16", "1", "1.50"]
    path = tmp_path / "moe.csv"
    report.write_csv(str(path), results.records())
    with open(path) as f:
        (record,) = list(csv.DictReader(f))
    assert (float(record["tgemm_peak_mib"]), float(record["torch_peak_mib"])) == (100.0, 900.0)
    assert (float(record["tgemm_sm_mhz"]), float(record["tgemm_power_w"])) == (1755.0, 699.5)
    assert float(record["torch_sm_mhz"]) == 1980.0 and math.isnan(float(record["torch_power_w"]))


def test_clock_samples_are_read_from_nvidia_smi_or_left_unknown(tmp_path, monkeypatch):
    lines = "1980, 310.52\n1755, 699.90\n1740, [N/A]\n[N/A], 700.10\n1770, 698.00\n"
    assert timing.parse_clock_samples(lines) == (1770.0, 698.0)
    assert all(math.isnan(v) for v in timing.parse_clock_samples("No devices were found\n"))
    # A stand-in nvidia-smi: a first sample (taken before the measurement: left out), two
    # more, then it samples on until stopped.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1980, 80.0\\n'\nsleep 0.2\n"
                    "printf '1410, 650.0\\n1590, 690.0\\n'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    with timing.ClockSampler() as sampler:
        time.sleep(0.5)
    assert (sampler.sm_mhz, sampler.power_w) == (1500.0, 670.0)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with timing.ClockSampler() as sampler:
        pass
    assert math.isnan(sampler.sm_mhz) and math.isnan(sampler.power_w)


def _sgrouped_case(proj: str, fast: bool) -> ScaledGroupedCase:
    n, k = (28672, 4096) if proj == "gate_up" else (4096, 14336)
    return ScaledGroupedCase("mixtral", proj, 8, 8192, n, k, "balanced", fast)


def test_sgrouped_section_summary_and_csv(tmp_path):
    rows = [GemmResult(_sgrouped_case("gate_up", False), "fp8", {"tgemm": 2.0, "torch": 3.0},
                       {"tgemm": 2.5, "torch": 3.0}, 3e-3, "fp64 deq", 1.0, peer_diff=0.0,
                       peer_equal=True),
            GemmResult(_sgrouped_case("gate_up", True), "fp8", {"tgemm": 2.0, "torch": 1.0},
                       {"tgemm": 2.0, "torch": 1.0}, 4e-3, "fp64 deq", 1.0, peer_diff=2.5e-3,
                       peer_equal=False),
            GemmResult(_sgrouped_case("down", False), "fp8", {"tgemm": 1.0}, {"tgemm": 1.2},
                       3e-3, "fp64 deq", 1.0,
                       note="torch._scaled_grouped_mm n/a (RuntimeError: x)"),
            GemmResult(_sgrouped_case("down", True), "fp8", error="OutOfMemoryError: oom")]
    results = RunResults(sgrouped=rows)
    (section,) = report.sections(results)
    text = section.render()
    tflops = 2 * 8192 * 28672 * 4096 / 1e12
    assert _cells(text, "mixtral gate_up balanced fp32")[4:] == [
        "8", "8192", "28672", "4096", f"{tflops / 2e-3:.1f}", f"{tflops / 3e-3:.1f}", "1.50",
        "1.20", "3.00e-03", "bitwise"]
    assert _cells(text, "mixtral gate_up balanced fast")[10:] == [
        "0.50", "0.50", "4.00e-03", "2.50e-03"]
    assert _cells(text, "mixtral down balanced fp32")[9:] == ["n/a", "n/a", "n/a", "3.00e-03",
                                                              "n/a"]
    assert _cells(text, "mixtral down balanced fast")[8:] == ["n/a", "n/a", "n/a", "n/a",
                                                              "ERROR"]
    assert "note sgrouped mixtral down balanced T=8192 accum=fp32 fp8: torch." in text
    summary = report.summary(results)
    # Both fp32 rows ran tgemm; the one without torch has no ratio.
    assert _cells(summary, "sgrouped accum=fp32")[2:5] == ["fp8", "2", "1.50"]
    assert _cells(summary, "sgrouped accum=fast")[2:7] == ["fp8", "1", "(1", "failed)", "0.50"]
    path = tmp_path / "sgrouped.csv"
    report.write_csv(str(path), results.records())
    with open(path) as f:
        records = list(csv.DictReader(f))
    assert [r["suite"] for r in records] == ["sgrouped"] * 4
    assert [r["torch_bitwise_equal"] for r in records] == ["True", "False", "", ""]
    assert float(records[1]["torch_diff"]) == 2.5e-3
    assert (records[0]["proj"], records[0]["fast_accum"], records[1]["fast_accum"]) == (
        "gate_up", "False", "True")
    assert float(records[0]["ratio"]) == 1.5


# --- --list -------------------------------------------------------------------------------------

def test_list_prints_suites_and_row_counts(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for suite, count in SHAPE_LIST_COUNTS.items():
        assert any(line.split()[:2] == [suite, str(count)] for line in out.splitlines()), suite
    per_dtype = sum(SHAPE_LIST_COUNTS[s] for s in suites.DEFAULT_SUITES if suites.per_dtype(s))
    # bf16 and fp16, and the latency suite's fp8 rows.
    fixed = SHAPE_LIST_COUNTS["e2e"] + SHAPE_LIST_COUNTS["coldstart"] + SHAPE_LIST_COUNTS["latency"]
    assert f"{2 * per_dtype + fixed} rows would run" in out
    assert any(line.split()[:3] == ["latency", "2", "bf16,fp16,fp8"] for line in out.splitlines())


def test_list_shows_the_sweep_of_a_seed(capsys):
    assert cli.main(["--list", "--suite", "sweep", "--count", "20", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["sweep", "20"] for line in out.splitlines())
    assert "40 rows would run" in out  # 20 shapes, bf16 and fp16
    listed = [line.split() for line in out.splitlines() if line.startswith("sweep  ")]
    cases = suites.sweep_cases(3, 20)
    assert [cells[1:3] for cells in listed[1:]] == [[c.shape_class, c.name.split()[0]]
                                                   for c in cases]
    padded = next(c for c in suites.sweep_cases(3, 400) if c.a_pad)
    assert cli.main(["--list", "--suite", "sweep", "--seed", "3"]) == 0
    assert f"row pad {padded.a_pad}" in capsys.readouterr().out


def test_a_shard_runs_every_nth_case_of_the_mm_suites(capsys):
    """--shard I/N keeps every N-th case of each mm suite from the I-th, so N processes on N
    GPUs cover the suite once between them; a share outside 1..N is refused."""
    cases = suites.sweep_cases(3, 20)
    seen = []
    for index in (1, 2, 3):
        assert cli.main(["--list", "--suite", "sweep,square", "--count", "20", "--seed", "3",
                         "--shard", f"{index}/3"]) == 0
        listed = [line.split() for line in capsys.readouterr().out.splitlines()]
        share, square_share = cases[index - 1::3], suites.suite_cases("square")[index - 1::3]
        counts = {cells[0]: cells[1] for cells in listed if cells[2:3] == ["bf16,fp16"]}
        assert (counts["sweep"], counts["square"]) == (str(len(share)), str(len(square_share)))
        names = [cells[2] for cells in listed
                 if cells[:1] == ["sweep"] and cells[2:3] != ["bf16,fp16"]]
        assert names == [c.name.split()[0] for c in share]
        seen += names
        squares = [cells[1] for cells in listed
                   if cells[:1] == ["square"] and cells[2:3] != ["bf16,fp16"]]
        assert squares == [c.name for c in square_share]
    assert sorted(seen) == sorted(c.name.split()[0] for c in cases)
    for bad in ("0/3", "4/3", "2", "a/b"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--shard", bad])


def test_list_with_suites_shows_their_shapes(capsys):
    assert cli.main(["--list", "--quick", "--suite", "decode,grouped,scaled"]) == 0
    out = capsys.readouterr().out
    assert "decode  gate_up" in out and "empty groups" in out and "blockwise" in out
    quick = (suites.suite_row_count("decode", True) + suites.suite_row_count("grouped", True)
             + suites.suite_row_count("scaled", True))
    assert f"{quick} rows would run (--quick)" in out
    assert cli.main(["--list", "--suite", "sgrouped"]) == 0
    out = capsys.readouterr().out
    assert "24 rows would run" in out
    listed = [line.split() for line in out.splitlines()
              if line.startswith(("mixtral", "deepseek"))]
    assert [cells[:8] for cells in listed] == [
        [c.name, c.proj, c.routing, c.accum, str(c.groups), str(c.tokens), str(c.n), str(c.k)]
        for c in suites.sgrouped_cases()]


# --- tables, summary, CSV -----------------------------------------------------------------------

QKV_M1 = Case("llama", "qkv", 1, 6144, 4096)
O_M16 = Case("llama", "o", 16, 4096, 4096)
SQUARE = Case("square", "4096^3", 4096, 4096, 4096)


def _mm_results() -> list[GemmResult]:
    return [
        GemmResult(QKV_M1, "bf16", {"tgemm": 0.020, "torch": 0.025},
                   {"tgemm": 0.050, "torch": 0.020}, 1.5e-3, "fp64", 0.7),
        GemmResult(O_M16, "bf16", {"tgemm": 0.040, "torch": 0.020},
                   {"tgemm": 0.060, "torch": 0.030}, 1.6e-3, "fp64", 0.1),
        GemmResult(SQUARE, "bf16", {"tgemm": 0.200, "torch": 0.400},
                   {"tgemm": 0.210, "torch": 0.420}, 0.0, "torch", 2.0,
                   note="torch: no CUDA graph (RuntimeError: x)"),
        GemmResult(SQUARE, "fp16", error="OutOfMemoryError: out of memory"),
    ]


def _cells(table: str, first: str) -> list[str]:
    """The cells (split on spaces) of the table line whose first cells are those of ``first``."""
    head = first.split()
    return next(cells for cells in map(str.split, table.splitlines())
                if cells[:len(head)] == head)


def test_mm_table_has_both_ratios_and_bandwidth_on_memory_bound_rows():
    table = report.mm_section(_mm_results(), "mm llama").render()
    headers = table.splitlines()[1]
    for column in ("tgemm TFLOP/s", "torch TFLOP/s", "ratio kernel", "ratio eager",
                   "tgemm GB/s", "torch GB/s", "rel err", "err vs"):
        assert column in headers
    qkv = _cells(table, "llama qkv")
    # 2*1*6144*4096 flops in 20 us; (4096 + 4096*6144 + 6144) * 2 bytes in 20 and 25 us.
    tflops = 2 * 6144 * 4096 / 20e-6 / 1e12
    gbps = (4096 + 4096 * 6144 + 6144) * 2 / 20e-6 / 1e9
    assert qkv[6:12] == [f"{tflops:.2f}", f"{tflops * 0.8:.2f}", "1.25", "0.40",
                         f"{gbps:.0f}", f"{gbps * 0.8:.0f}"]
    square = _cells(table, "square 4096^3 4096 4096 4096 bf16")
    assert square[8:] == ["2.00", "2.00", "0.00e+00", "torch"]  # no GB/s: compute-bound
    assert _cells(table, "square 4096^3 4096 4096 4096 fp16")[6:] == ["n/a"] * 4 + ["ERROR"]
    assert "ERROR square 4096^3 fp16: OutOfMemoryError: out of memory" in table
    assert "note square 4096^3 bf16: torch: no CUDA graph" in table


def test_markdown_table():
    md = report.mm_section(_mm_results()[:1]).render(markdown=True).splitlines()
    assert md[0] == "## mm"
    assert md[2].startswith("| suite | name | M | N | K | dtype | tgemm TFLOP/s |")
    assert md[3].startswith("| :--- | :--- | ---: |")
    assert md[4].startswith("| llama | qkv | 1 | 6144 | 4096 | bf16 |")


def test_summary_counts_rows_whose_captures_built_tma_descriptors_on_the_device():
    """A row whose note says its captured launches built their TMA descriptors on the device
    (timing.compare's note: slower replays) is counted under the summary, named with the
    first three; a run without such rows says nothing of it."""
    assert "TMA descriptors on the device" not in report.summary(_run_results())
    rows = _mm_results()
    for row in rows[:4]:
        row.note = f"tgemm: 16 captured launches of 16 calls {DEVICE_BUILT_NOTE}"
    text = report.summary(dataclasses.replace(_run_results(), mm=rows))
    labels = ", ".join(r.label() for r in rows[:3])
    assert (f"4 rows captured launches that built their TMA descriptors on the device "
            f"(slower replays): {labels} and 1 more") in text


def test_geometric_mean():
    assert report.geometric_mean([0.5, 2.0]) == pytest.approx(1.0)
    assert report.geometric_mean([4.0, math.nan, 0.0, 1.0]) == pytest.approx(2.0)
    assert math.isnan(report.geometric_mean([math.nan]))


def _run_results() -> RunResults:
    return RunResults(
        mm=_mm_results(),
        latency=[LatencyResult(Case("latency", "64^3", 64, 64, 64), "bf16",
                               {"torch.ops.tgemm.mm": 60.0, "tgemm.mm": 30.0, "torch.mm": 10.0}),
                 LatencyResult(Case("latency", "64^3", 64, 64, 64), "fp8",
                               {"torch.ops.tgemm.mm": 26.0, "tgemm.mm": 22.0, "torch.mm": 20.0})],
        grouped=[GemmResult(GroupedCase("mixtral", "fwd", 8, 8192, 14336, 4096), "bf16",
                            {"tgemm": 2.0, "torch": 2.2, "loop": 3.0},
                            {"tgemm": 2.1, "torch": 2.3, "loop": 4.2}, 2e-3, "fp32", 1.0)],
        scaled=[GemmResult(ScaledCase("4096^3", 4096, 4096, 4096, "blockwise"), "fp8",
                           {"tgemm": 0.1}, {"tgemm": 0.12}, 3e-3, "fp32 deq", 1.0,
                           note="torch._scaled_mm n/a (RuntimeError: unsupported)"),
                GemmResult(ScaledCase("4096^3", 4096, 4096, 4096, "rowwise"), "fp8",
                           {"tgemm": 0.1, "torch": 0.09}, {"tgemm": 0.1, "torch": 0.09},
                           3e-3, "fp32 deq", 1.0)],
        e2e=E2EResult("2 Llama blocks", "bf16", 45.0, 50.0, 0.0),
        coldstart=[ColdStartResult("plain", 2.0, 100.0, 20.0, 10.4),
                   ColdStartResult("override, cold caches", 30.0, 101.0, 50.0, 10.4),
                   ColdStartResult("override, warm caches", error="TimeoutExpired: 300 s"),
                   ColdStartResult("override aten, cold caches", 20.0, 99.0, 40.0, 10.4),
                   ColdStartResult("override aten, warm caches", 2.4, 99.0, 21.0, 10.4),
                   ColdStartResult("override, PyTorch while compiling, cold caches", 2.5, 100.0,
                                   30.0, 10.4),
                   ColdStartResult("override, PyTorch while compiling, 8 compile processes, "
                                   "cold caches", 2.6, 100.0, 30.0, 10.4),
                   ColdStartResult("override aten, PyTorch while compiling, 8 compile "
                                   "processes, cold caches", 2.6, 100.0, 30.0, 10.4)],
        notes=["something: skipped (a reason)"],
    )


def test_summary_geomeans_per_suite_and_dtype_and_worst_row():
    text = report.summary(_run_results())
    llama = _cells(text, "llama")
    # kernel-only ratios 1.25 and 0.5, eager 0.4 and 0.5: geometric means 0.79 and 0.45.
    assert llama[:5] == ["llama", "bf16", "2", f"{math.sqrt(1.25 * 0.5):.2f}",
                         f"{math.sqrt(0.4 * 0.5):.2f}"]
    assert llama[5:] == ["llama", "o", "M=16", "0.50"]
    assert _cells(text, "square fp16")[2:6] == ["0", "(1", "failed)", "n/a"]
    assert _cells(text, "grouped vs torch")[3:7] == ["bf16", "1", "1.10", "1.10"]
    assert _cells(text, "grouped vs loop")[3:7] == ["bf16", "1", "1.50", "2.00"]
    assert _cells(text, "scaled rowwise")[3:5] == ["1", "0.90"]
    assert _cells(text, "scaled blockwise")[3:5] == ["1", "n/a"]  # torch cannot: no ratio
    assert "worst row (kernel-only, vs torch): llama o M=16 bf16 0.50x" in text
    assert "latency 64^3 bf16, host time per call: tgemm.mm 30.0 us (3.00x torch.mm)" in text
    assert ("latency 64^3 fp8, host time per call: tgemm.scaled_mm 22.0 us (1.10x "
            "torch._scaled_mm), torch.ops.tgemm.scaled_mm 26.0 us (1.30x), torch._scaled_mm "
            "20.0 us") in text
    assert "e2e: override step 50.0 ms vs plain 45.0 ms: 1.11x the plain time" in text
    assert ("coldstart first step: plain 2.00 s, override, cold caches 30.00 s (15.00x), "
            "override, warm caches n/a (n/a)") in text
    assert "2 rows failed" in text and "something: skipped (a reason)" in text
    assert text.splitlines()[-1].strip() == "something: skipped (a reason)"


def test_every_section_renders():
    results = _run_results()
    titles = [s.title.split(":")[0] for s in report.sections(results)]
    assert titles == ["mm llama", "mm square", "latency", "grouped", "scaled", "e2e",
                      "coldstart"]
    text = "\n".join(s.render() for s in report.sections(results))
    assert _cells(text, "64^3")[5:] == ["60.0", "30.0", "10.0", "6.00", "3.00"]
    assert _cells(text, "mixtral")[7:14] == [
        *(f"{2 * 8192 * 14336 * 4096 / (ms * 1e-3) / 1e12:.1f}" for ms in (2.0, 2.2, 3.0)),
        "1.10", "1.10", "1.50", "2.00"]
    blockwise = _cells(text, "4096^3 4096 4096 4096 blockwise")
    assert blockwise[5] == "precise" and blockwise[7:10] == ["n/a", "n/a", "n/a"]
    assert _cells(text, "override, cold caches")[3:6] == ["30.00", "15.00", "101.0"]
    assert _cells(text, "override aten, warm caches")[4:7] == ["2.40", "1.20", "99.0"]
    doc = report.markdown_report(["GPU X | torch Y"], results)
    assert doc.startswith("# torch_triton_gemm benchmark\n\n- GPU X | torch Y\n\n## mm llama")
    assert "## summary" in doc


def test_csv_has_every_row_at_full_precision(tmp_path):
    path = tmp_path / "out.csv"
    results = _run_results()
    report.write_csv(str(path), results.records())
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 + 2 + 1 + 2 + 1 + 8  # mm, latency (bf16, fp8), grouped, scaled, ...
    qkv = rows[0]
    assert (qkv["suite"], qkv["name"], qkv["M"], qkv["dtype"]) == ("llama", "qkv", "1", "bf16")
    assert float(qkv["ratio"]) == pytest.approx(1.25)
    assert float(qkv["eager_ratio"]) == pytest.approx(0.4)
    assert float(qkv["tgemm_gbps"]) == pytest.approx((4096 + 4096 * 6144 + 6144) * 2 / 20e-6 / 1e9)
    assert rows[3]["error"] == "OutOfMemoryError: out of memory"
    assert rows[3]["tgemm_ms"] == "nan" or rows[3]["tgemm_ms"] == ""
    grouped_row = next(r for r in rows if r["suite"] == "grouped")
    assert float(grouped_row["loop_ratio"]) == pytest.approx(1.5)
    assert grouped_row["G"] == "8" and grouped_row["form"] == "fwd"
    assert next(r for r in rows if r["suite"] == "e2e")["override_ms"] == "50.0"
    assert [r["name"] for r in rows if r["suite"] == "coldstart"] == list(suites.COLDSTART_RUNS)


def test_ratio_stats_match_numpy():
    rng = np.random.default_rng()
    values = list(np.exp(rng.normal(0.0, 0.4, size=97)))
    stats = report.ratio_stats([*values, math.nan, 0.0, math.inf])  # not measured: left out
    assert stats.count == 97
    assert stats.geomean == pytest.approx(statistics.geometric_mean(values))
    assert stats.p5 == pytest.approx(np.percentile(values, 5))
    assert stats.median == pytest.approx(statistics.median(values))
    assert stats.minimum == min(values)
    for threshold in (0.9, 0.5):
        assert stats.below[threshold] == pytest.approx(np.mean(np.array(values) < threshold))
    assert report.percentile([3.0], 5) == 3.0
    assert math.isnan(report.ratio_stats([math.nan]).geomean)


# (upper bound, label) of the summary's M*N*K bands, as the benchmark shape list names them.
BANDS = ((1e7, "MNK < 1e7"), (1e9, "MNK 1e7-1e9"), (1e11, "MNK 1e9-1e11"),
         (math.inf, "MNK >= 1e11"))


def _sweep_results(inductor: bool) -> list[GemmResult]:
    """Random times for 60 sweep shapes in bf16 and fp16; an error row, and with ``inductor``
    Inductor times on most rows (its compile failed on the rest)."""
    rng = random.Random()
    results = []
    for dtype in ("bf16", "fp16"):
        for i, case in enumerate(suites.sweep_cases(rng.randrange(1000), 60)):
            if i == 7:
                results.append(GemmResult(case, dtype, error="OutOfMemoryError: x"))
                continue
            kernel = {"tgemm": rng.uniform(0.01, 1), "torch": rng.uniform(0.01, 1)}
            eager = {impl: ms + rng.uniform(0, 0.02) for impl, ms in kernel.items()}
            if inductor and i % 5:
                kernel["inductor"] = rng.uniform(0.01, 1)
                eager["inductor"] = kernel["inductor"] + 0.01
            results.append(GemmResult(case, dtype, kernel, eager, 1e-3, "fp64", 0.1))
    return results


def _joined_cells(text: str, first: str) -> str:
    return " ".join(_cells(text, first))


@pytest.mark.parametrize("inductor", [False, True])
def test_sweep_distribution_and_groups_match_an_independent_computation(inductor):
    results = _sweep_results(inductor)
    distribution = report.distribution_section("sweep", results).render()
    groups = report.groups_section("sweep", results).render()
    impls = ("tgemm", "inductor") if inductor else ("tgemm",)
    for dtype in ("bf16", "fp16"):
        rows = [r for r in results if r.dtype == dtype and not r.error]
        for impl in impls:
            for kind in ("kernel", "eager"):
                timed = [r for r in rows if impl in r.kernel_ms]
                times = {id(r): (r.kernel_ms if kind == "kernel" else r.eager_ms) for r in timed}
                ratios = [times[id(r)]["torch"] / times[id(r)][impl] for r in timed]
                worst = timed[ratios.index(min(ratios))]
                expected = [dtype, impl, kind, str(len(ratios)),
                            f"{statistics.geometric_mean(ratios):.2f}",
                            f"{np.percentile(ratios, 5):.2f}",
                            f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}",
                            f"{100 * np.mean(np.array(ratios) < 0.9):.1f}%",
                            f"{100 * np.mean(np.array(ratios) < 0.5):.1f}%",
                            *worst.case.display_name.split()]
                assert _cells(distribution, f"{dtype} {impl} {kind}") == expected
        # Geometric means by size class and by M*N*K band.
        by_group: dict[str, list[GemmResult]] = {}
        for r in rows:
            by_group.setdefault(r.case.shape_class, []).append(r)
            volume = r.case.m * r.case.n * r.case.k
            by_group.setdefault(next(label for bound, label in BANDS if volume < bound),
                                []).append(r)
        for name, group in by_group.items():
            cells = [str(len(group))]
            for impl in impls:
                for times in ("kernel_ms", "eager_ms"):
                    ratios = [getattr(r, times)["torch"] / getattr(r, times)[impl]
                              for r in group if impl in r.kernel_ms]
                    cells.append(f"{statistics.geometric_mean(ratios):.2f}" if ratios else "n/a")
            assert _joined_cells(groups, f"{dtype} {name}") == " ".join(
                [dtype, name, *cells]), name
    group_names = [line.split()[1] for line in groups.splitlines()[3:]]
    assert group_names[:3] == ["mult64", "mult8", "arbitrary"]  # classes, then bands


def test_planner_sections_follow_their_rows():
    classes = [GemmResult(c, "bf16", {"tgemm": 1.0, "torch": 1.0 + i % 3},
                          {"tgemm": 2.0, "torch": 2.0}, 1e-3, "fp64", 0.1)
               for i, c in enumerate(suites.suite_cases("classes"))]
    results = RunResults(mm=[*_mm_results(), *classes, *_sweep_results(True)])
    titles = [s.title.split(":")[0] for s in report.sections(results)]
    assert titles == ["mm llama", "mm square", "mm classes", "classes", "mm sweep", "sweep",
                      "sweep"]
    text = "\n".join(s.render() for s in report.sections(results))
    near1000 = [r for r in classes if r.case.shape_class == "near1000"]
    assert _cells(text, "bf16 near1000")[2:] == [
        "4", f"{statistics.geometric_mean([r.ratio() for r in near1000]):.2f}", "1.00"]
    assert _cells(text, "classes near1000 1000^3 1000 1000 1000 bf16")[7:11] == [
        *(f"{2e9 / 1e-3 / 1e12:.2f}",) * 2, "1.00", "1.00"]
    summary = report.summary(results)
    # Inductor times on the 48 rows i % 5 != 0, less the error row (i = 7).
    assert _cells(summary, "sweep inductor bf16")[3:6] == ["47", "(13", "failed)"]
    assert "sweep inductor" not in "".join(_cells(summary, "classes bf16"))
    md = report.markdown_report(["h"], results)
    assert "## sweep: speed / torch speed" in md and "## classes: geometric mean" in md


def test_mm_table_and_csv_with_inductor(tmp_path):
    case = Case("sweep", "1000x24x7 a-pad13", 1000, 24, 7, a_pad=13, shape_class="arbitrary")
    r = GemmResult(case, "fp16", {"tgemm": 0.02, "torch": 0.03, "inductor": 0.06},
                   {"tgemm": 0.04, "torch": 0.05, "inductor": 0.1}, 1e-3, "fp64", 0.1)
    plain = GemmResult(SQUARE, "fp16", {"tgemm": 0.2, "torch": 0.2}, {"tgemm": 0.2, "torch": 0.2})
    table = report.mm_section([r, plain]).render()
    headers = [h.strip() for h in table.splitlines()[1].split("  ") if h.strip()]
    assert headers[8:13] == ["ratio kernel", "ratio eager", "inductor TFLOP/s",
                             "inductor ratio kernel", "inductor ratio eager"]
    row = _cells(table, "sweep arbitrary 1000x24x7 a-pad13")
    assert row[10:13] == ["1.50", "1.25", f"{2 * 1000 * 24 * 7 / 60e-6 / 1e12:.2f}"]
    assert row[13:15] == ["0.50", "0.50"]  # Inductor speed / torch speed
    assert _cells(table, "square 4096^3")[9:12] == ["1.00", "n/a", "n/a"]
    assert "inductor" not in report.mm_section([plain]).render()
    path = tmp_path / "out.csv"
    report.write_csv(str(path), RunResults(mm=[r, plain]).records())
    with open(path, newline="") as f:
        first, second = csv.DictReader(f)
    assert (first["a_pad"], first["b_pad"], first["class"]) == ("13", "0", "arbitrary")
    assert float(first["inductor_ms"]) == 0.06
    assert float(first["inductor_ratio"]) == pytest.approx(3.0)  # tgemm speed / inductor's
    assert float(first["inductor_vs_torch_ratio"]) == pytest.approx(0.5)
    assert float(first["inductor_vs_torch_eager_ratio"]) == pytest.approx(0.5)
    assert second["inductor_ms"] == "" and second["class"] == ""


def test_inductor_config_keeps_the_names_this_torch_has(monkeypatch):
    config = gemm.inductor_config()
    assert config["max_autotune_gemm_backends"] == "TRITON"
    from torch._inductor import config as inductor

    with inductor.patch(config):  # every name it keeps is one patch() accepts
        assert inductor.max_autotune_gemm_backends == "TRITON"
    monkeypatch.setattr(gemm, "INDUCTOR_CONFIG", {
        **gemm.INDUCTOR_CONFIG, "triton.no_such_option": 1, "no_such_option": 2})
    assert gemm.inductor_config() == config


def test_cold_start_result_line_is_parsed():
    out = 'noise\n{"mode": "override", "step_s": [30.5, 0.1, 0.12], "loss": 10.37}\n'
    r = e2e.parse_child_output("override, cold caches", out, 41.0)
    assert (r.first_step_s, r.later_step_ms, r.process_s, r.loss) == pytest.approx(
        (30.5, 110.0, 41.0, 10.37))
    with pytest.raises(ValueError):
        e2e.parse_child_output("plain", "Traceback ...\n", 1.0)


# --- plotting without matplotlib ----------------------------------------------------------------

def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert not report.matplotlib_available()
    path = tmp_path / "plot.png"
    assert report.write_plot(str(path), _mm_results()) is False
    assert 'pip install "torch-triton-gemm[bench]"' in capsys.readouterr().err
    assert report.write_ratio_plot(str(path), _sweep_results(False)) is False
    assert 'pip install "torch-triton-gemm[bench]"' in capsys.readouterr().err
    assert not path.exists()
    # The command line says so before it would start a run (here it then stops: no GPU).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--plot", str(path), "--suite", "square"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "torch-triton-gemm[bench]"' in err and "needs a CUDA GPU" in err


@pytest.mark.parametrize("suites_run, written", [
    (("sweep",), ["plot.png"]),
    (("square", "sweep"), ["plot-sweep.png", "plot.png"]),
    (("square",), ["plot.png"]),
])
def test_plots_of_mm_rows_and_of_the_sweep(suites_run, written, tmp_path):
    pytest.importorskip("matplotlib")  # an optional dependency (the bench extra)
    mm = [r for r in [*_mm_results(), *_sweep_results(True)] if r.case.suite in suites_run]
    cli._write_plots(str(tmp_path / "plot.png"), RunResults(mm=mm))
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    for name in written:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


# --- input builders and row runner (CPU tensors, no kernels) ------------------------------------

def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_quantize_round_trips_within_fp8_precision():
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 256)  # columns of very different scales
    for rows, cols in ((64, 256), (1, 256), (1, 128), (32, 128)):
        q, scale = scaled.quantize(x, rows, cols)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (64 // rows, 256 // cols)
        assert q.float().abs().amax() == scaled.FP8_MAX  # the block maxima map to 448
        assert _rel(scaled.dequantize(q, scale), x) < 0.05


@pytest.mark.parametrize("recipe", list(suites.SCALED_RECIPES))
def test_scaled_inputs_follow_torch_scaled_mm_contract(recipe):
    m, n, k = 32, 256, 384
    (a, b, scale_a, scale_b), ref = scaled.make_inputs(ScaledCase("t", m, n, k, recipe), "cpu")
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous()
    assert b.shape == (k, n) and b.stride() == (1, k)  # W.t() of a row-major W [N, K]
    expected = {"tensorwise": ((), (), None, None),
                "rowwise": ((m, 1), (1, n), (1, 1), (n, 1)),
                "blockwise": ((m, k // 128), (k // 128, n // 128), (1, m), (1, k // 128))}
    shape_a, shape_b, stride_a, stride_b = expected[recipe]
    assert scale_a.shape == shape_a and scale_b.shape == shape_b
    if stride_a is not None:
        assert scale_a.stride() == stride_a and scale_b.stride() == stride_b
    # Dequantized in float64, the inputs reproduce the bench's reference.
    deq_a = a.double() * (scale_a.double().repeat_interleave(128, 1) if recipe == "blockwise"
                          else scale_a.double())
    deq_b = b.double() * (scale_b.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
                          if recipe == "blockwise" else scale_b.double())
    assert _rel(deq_a @ deq_b, ref) < 1e-6
    # The plan sweep's compile workers skip the fp32 reference; the operands are alike.
    torch.manual_seed(0)
    first = scaled.make_inputs(ScaledCase("t", m, n, k, recipe), "cpu")
    torch.manual_seed(0)
    operands, none = scaled.make_inputs(ScaledCase("t", m, n, k, recipe), "cpu", reference=False)
    assert none is None and all(torch.equal(x.float(), y.float())
                                for x, y in zip(first[0], operands, strict=True))
    if recipe != "tensorwise":
        # torch runs row and block scales on recent GPUs only (rowwise on the CPU from torch
        # 2.12); its shape checks run anywhere.
        mode = FakeTensorMode()
        with mode:
            out = torch._scaled_mm(*(mode.from_tensor(t) for t in (a, b, scale_a, scale_b)),
                                   out_dtype=torch.bfloat16)
        assert out.shape == (m, n)
    else:
        out = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
        assert _rel(out, ref) < 1e-2  # torch reads the scales as the reference does


def test_grouped_loops_match_a_float64_reference():
    sizes = [3, 0, 5, 8]
    bounds = [(0, 3), (3, 3), (3, 8), (8, 16)]
    a = torch.randn(16, 24, dtype=torch.bfloat16)
    w = torch.randn(4, 40, 24, dtype=torch.bfloat16)
    b = w.transpose(-2, -1)
    ref = torch.cat([a[s:e].double() @ b[g].double() for g, (s, e) in enumerate(bounds)])
    assert _rel(grouped.loop_forward(a, b, sizes), ref) < 1e-2
    a.requires_grad_()
    out = grouped.loop_forward_autograd(a, b, sizes)
    assert _rel(out, ref) < 1e-2
    grad_a, = torch.autograd.grad(out, a, torch.ones_like(out))
    assert _rel(grad_a, torch.cat([torch.ones(e - s, 40).double() @ b[g].double().t()
                                   for g, (s, e) in enumerate(bounds)])) < 1e-2
    dy = torch.randn(16, 40, dtype=torch.bfloat16)
    x = a.detach()
    out = grouped.loop_wgrad(x.t(), dy, sizes)
    assert out.shape == (4, 24, 40) and torch.equal(out[1], torch.zeros(24, 40))
    wref = torch.stack([x[s:e].t().double() @ dy[s:e].double() for s, e in bounds])
    assert _rel(out, wref) < 1e-2


@pytest.mark.parametrize("form", list(suites.GROUPED_FORMS))
def test_grouped_inputs(form):
    case = GroupedCase("t", form, groups=4, tokens=64, n=48, k=32, routing="skewed")
    args = grouped.make_inputs(case, torch.device("cpu"))
    offs = args[2]
    assert offs.dtype == torch.int32 and offs.tolist()[-1] == 64
    if form == "wgrad":
        x_t, dy = args[:2]
        assert x_t.shape == (32, 64) and x_t.stride() == (1, 32) and dy.shape == (64, 48)
    elif form == "fwd":
        a, b = args[:2]
        assert a.shape == (64, 32) and b.shape == (4, 32, 48) and b.stride() == (48 * 32, 1, 32)
    else:
        a, w, _, grad_out = args
        assert a.requires_grad and w.requires_grad and w.shape == (4, 48, 32)
        assert grad_out.shape == (64, 48)


SGROUPED_TINY = ScaledGroupedCase("t", "gate_up", groups=4, tokens=96, n=48, k=32,
                                  routing="skewed", fast_accum=False)


def _sgrouped_float64(args: tuple) -> torch.Tensor:
    """The product of the dequantized operands in float64, group by group (independently of
    sgrouped.reference_error)."""
    a, b, scale_a, scale_b, offs = args
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    x = a.double() * scale_a.double()[:, None]
    return torch.cat([x[s:e] @ (b[g].double() * scale_b[g].double()[None, :])
                      for g, (s, e) in enumerate(zip(starts, ends))])


def test_sgrouped_inputs_follow_torch_scaled_grouped_mm_contract():
    case = SGROUPED_TINY
    args = sgrouped.make_inputs(case, "cpu")
    a, b, scale_a, scale_b, offs = args
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == (96, 32) and a.is_contiguous()
    # b: the expert weights [G, N, K] transposed, column-major per expert.
    assert b.shape == (4, 32, 48) and b.stride() == (48 * 32, 1, 32)
    assert scale_a.shape == (96,) and scale_b.shape == (4, 48)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert offs.dtype == torch.int32 and offs.tolist() == list(
        itertools.accumulate(case.group_sizes()))
    # Rowwise amax quantization: every row of a and every output channel of each expert's
    # weight reaches e4m3's largest value.
    assert torch.all(a.float().abs().amax(1) == scaled.FP8_MAX)
    assert torch.all(b.float().abs().amax(1) == scaled.FP8_MAX)
    # torch takes these operands: its shape checks run anywhere (its kernels on sm_90+ only).
    mode = FakeTensorMode()
    with mode:
        out = torch._scaled_grouped_mm(*(mode.from_tensor(t) for t in args),
                                       out_dtype=torch.bfloat16, use_fast_accum=True)
    assert out.shape == (96, 48) and out.dtype == torch.bfloat16


def test_sgrouped_reference_samples_and_catches_wrong_rows():
    case = dataclasses.replace(SGROUPED_TINY, groups=40, tokens=40 * 96, routing="balanced")
    blocks = sgrouped.reference_rows(case)
    # Every third of the 40 experts: at most REF_GROUPS of them, from the first to the last.
    assert sorted({g for g, _, _ in blocks}) == list(range(0, 40, 3))
    for g, start, end in blocks:  # inside its expert's rows, first and last rows of each
        assert g * 96 <= start < end <= (g + 1) * 96
    assert {(start - g * 96, end - g * 96) for g, start, end in blocks} == {
        (0, sgrouped.REF_ROWS // 2), (96 - sgrouped.REF_ROWS // 2, 96)}
    args = sgrouped.make_inputs(SGROUPED_TINY, "cpu")
    ref = _sgrouped_float64(args)
    assert sgrouped.reference_error(SGROUPED_TINY, args, ref.to(torch.bfloat16)) < 1e-2
    assert sgrouped.reference_error(SGROUPED_TINY, args, ref) < 1e-12
    # A row of a sampled group computed with another group's weight is seen.
    g, start, _ = sgrouped.reference_rows(SGROUPED_TINY)[-1]
    wrong = ref.clone()
    wrong[start] = (args[0][start].double() * args[2][start].double()) @ (
        args[1][g - 1].double() * args[3][g - 1].double())
    assert sgrouped.reference_error(SGROUPED_TINY, args, wrong) > 1e-2


def test_sgrouped_compares_outputs_bitwise():
    out = torch.randn(10, 6).to(torch.bfloat16)
    assert sgrouped.compare_with_peer(out, out.clone()) == (0.0, True)
    other = out.clone()
    other[3, 2] = -other[3, 2] if other[3, 2] != 0 else 1.0
    diff, equal = sgrouped.compare_with_peer(out, other)
    assert not equal and diff > 0
    zeros = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert sgrouped.compare_with_peer(zeros, -zeros)[1] is False  # -0.0: equal, not bitwise


@pytest.mark.parametrize("fast", [False, True])
def test_sgrouped_row_inputs_through_tgemm(fast, device):
    """The suite's operands through tgemm.scaled_grouped_mm (Triton's interpreter without a
    GPU), checked by the suite's reference and by an independent float64 product."""
    case = dataclasses.replace(SGROUPED_TINY, fast_accum=fast)
    args = sgrouped.make_inputs(case, device)
    out = sgrouped._ops(fast)["tgemm"](*args)
    assert out.dtype == torch.bfloat16 and out.shape == (96, 48)
    assert sgrouped.reference_error(case, args, out) < 1e-2
    assert _rel(out, _sgrouped_float64(args)) < 1e-2


def test_sgrouped_suite_skips_with_a_reason(monkeypatch):
    """Without torch._scaled_grouped_mm, without a GPU, or on a GPU before sm_90, the suite is
    skipped with a note saying why, and no row is built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in sgrouped.missing_reason()
    args = cli.parse_args(["--suite", "sgrouped"])
    results = cli.run_suites(args, torch.device("cpu"))
    assert results.sgrouped == [] and len(results.notes) == 1
    assert results.notes[0].startswith("sgrouped: skipped (no CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "sm_80" in sgrouped.missing_reason()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sgrouped.missing_reason() is None
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert "no torch._scaled_grouped_mm" in sgrouped.missing_reason()


def test_operand_copies_keep_layout_and_rotate(monkeypatch):
    monkeypatch.setattr(timing, "ROTATE_BYTES", 20 * 1024)
    a = torch.randn(64, 32)
    b = torch.randn(16, 32).t().requires_grad_()
    copies = timing.operand_copies((a, b, "none"), calls=8)
    assert len(copies) == 2  # a and b hold 10 KiB: two sets span the 20 KiB asked for
    for x, y, flag in copies[1:]:
        assert flag == "none" and torch.equal(x, a) and torch.equal(y, b)
        assert y.stride() == b.stride() and y.requires_grad and y.data_ptr() != b.data_ptr()
    assert len(timing.operand_copies((a, b), calls=1)) == 1


def test_timings_wait_for_background_compiles_first(monkeypatch):
    """quiet_host drains tgemm's compile pool when it has unfinished jobs (they would share the
    host with the timed calls) and says how many there were; an idle pool is left alone."""
    from torch_triton_gemm.ops import compile_pool

    class Pool:
        def __init__(self, unfinished: int) -> None:
            self.unfinished, self.drains = unfinished, 0

        def drain(self, timeout: float | None = None) -> None:
            assert timeout == timing.QUIET_HOST_WAIT_S  # bounded
            self.drains += 1
            self.unfinished = 0

    busy, idle = Pool(3), Pool(0)
    monkeypatch.setattr(compile_pool, "POOL", busy)
    assert timing.quiet_host() == 3 and busy.drains == 1 and busy.unfinished == 0
    monkeypatch.setattr(compile_pool, "POOL", idle)
    assert timing.quiet_host() == 0 and idle.drains == 0


def test_rows_that_fail_become_error_rows(capsys):
    def boom() -> str:
        raise RuntimeError("first line\nsecond line")

    rows = [timing.Row("good", lambda: "ok", lambda m: f"error {m}"),
            timing.Row("bad", boom, lambda m: f"error {m}")]
    assert timing.run_rows(rows) == ["ok", "error RuntimeError: first line"]
    assert "Traceback" in capsys.readouterr().err


@pytest.fixture
def fresh_stop(monkeypatch):
    stop = timing.Stop()
    monkeypatch.setattr(timing, "STOP", stop)
    return stop


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_keeps_the_rows_measured_before_it(how, fresh_stop, capsys):
    measured = []

    def stop() -> str:
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # a time limit's signal, as the command line
        time.sleep(5)                          # handles it: delivered before this returns
        return "not reached"

    def row(label, measure):
        return timing.Row(label, measure, lambda m: f"error {m}")

    previous = signal.signal(signal.SIGTERM, cli._interrupt)
    try:
        rows = [row("first", lambda: measured.append(1) or "ok"), row("stop", stop),
                row("after", lambda: measured.append(3) or "late")]
        assert timing.run_rows(rows) == ["ok"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert measured == [1] and fresh_stop.requested
    assert "interrupted" in capsys.readouterr().err
    # Nothing starts after the stop: neither the next suite's rows nor the next suite.
    assert timing.run_rows([row("next suite", lambda: measured.append(4) or "x")]) == []
    ran = []
    cli._run_suite(RunResults(), "e2e", lambda: ran.append(1))
    assert ran == [] and measured == [1]


def test_each_measured_row_reaches_the_csvs_at_once(tmp_path, fresh_stop, monkeypatch):
    """The command line's row writer (timing.ON_ROW) rewrites --csv and --out's results.csv
    after every row, so a run killed outright, past its SIGTERM handler, still leaves what it
    measured; results without CSV fields are passed over and no partial file stays."""
    import argparse

    class Measured:
        def __init__(self, name: str) -> None:
            self.name = name

        def record(self) -> dict[str, object]:
            return {"name": self.name, "ratio": 1.5}

    args = argparse.Namespace(csv=str(tmp_path / "rows.csv"), out=str(tmp_path / "out"))
    paths = cli._csv_paths(args)
    assert paths == [args.csv, str(tmp_path / "out" / "results.csv")]
    monkeypatch.setattr(timing, "ON_ROW", cli._rows_so_far_writer(paths))

    def names(path: str) -> list[str]:
        with open(path, newline="") as file:
            return [r["name"] for r in csv.DictReader(file)]

    def second() -> Measured:
        assert all(names(path) == ["first"] for path in paths)  # written before this row
        return Measured("second")

    rows = [timing.Row("first", lambda: Measured("first"), str),
            timing.Row("plain", lambda: "no fields", str), timing.Row("second", second, str)]
    assert [getattr(r, "name", r) for r in timing.run_rows(rows)] == [
        "first", "no fields", "second"]
    assert all(names(path) == ["first", "second"] for path in paths)
    assert sorted(os.listdir(tmp_path)) == ["out", "rows.csv"]
    assert cli._rows_so_far_writer([]) is None


def test_a_suite_interrupted_outside_its_rows_stops_the_run(fresh_stop):
    def run() -> None:
        raise KeyboardInterrupt

    results = RunResults()
    cli._run_suite(results, "coldstart", run)
    assert fresh_stop.requested and results.notes == []


def test_a_run_after_an_interrupted_one_starts_afresh(fresh_stop, monkeypatch, capsys):
    """cli.main called again in one process (after a Ctrl-C) measures again: the stop is
    cleared when a run starts, and its exit status says whether it was interrupted."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cli._device, "kernel_device_error", lambda device: None)
    monkeypatch.setattr(cli, "header_lines", lambda *args: [])
    seen = []

    def run_suites(args, device):  # type: ignore[no-untyped-def]
        seen.append(timing.STOP.requested)
        timing.STOP.requested = len(seen) == 1  # the first run is interrupted
        return RunResults()

    monkeypatch.setattr(cli, "run_suites", run_suites)
    assert cli.main(["--suite", "square"]) == 130
    assert "interrupted" in capsys.readouterr().out
    assert cli.main(["--suite", "square"]) == 0
    assert seen == [False, False]


# --- fresh processes: --help and --list with only the core dependencies -------------------------

def test_help_and_list_run_without_plotting_packages():
    script = textwrap.dedent("""
        import runpy, sys
        sys.modules["matplotlib"] = None  # as if not installed: importing them fails
        sys.modules["pandas"] = None
        for argv in (["--help"], ["--list"]):
            sys.argv = ["python -m torch_triton_gemm.bench", *argv]
            try:
                runpy.run_module("torch_triton_gemm.bench", run_name="__main__")
            except SystemExit as exit:
                assert exit.code in (0, None), exit.code
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--suite NAMES" in proc.stdout and "coldstart" in proc.stdout
    for word in ("sweep", "classes", "--seed S", "--count N", "--inductor"):
        assert word in proc.stdout, word
    assert "rows would run" in proc.stdout
    # And the command itself, as a user types it.
    proc = subprocess.run([sys.executable, "-m", "torch_triton_gemm.bench", "--help"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m torch_triton_gemm.bench")


# --- on a GPU: small rows through the real measurements -----------------------------------------

FAST = timing.TimingSettings(warmup_ms=5, rep_ms=10, rounds=1, max_calls=4)


@pytest.mark.gpu
def test_gpu_mm_row_times_both_ways_and_checks_accuracy():
    from torch_triton_gemm.bench import gemm

    r = gemm.measure_mm(Case("square", "512^3", 512, 512, 512), "bf16", FAST,
                        torch.device("cuda"))
    assert not r.error, r.error
    for impl in ("tgemm", "torch"):
        for kind in ("kernel", "eager"):
            assert r.time_ms(impl, kind) > 0, (impl, kind)
    assert r.err_vs == "fp64" and r.rel_err < 1e-2


@pytest.mark.gpu
def test_gpu_kernel_only_leaves_out_host_time():
    import torch_triton_gemm as tgemm
    from torch_triton_gemm.bench import gemm, timing

    # 64^3 takes a few microseconds on the GPU, far less than an eager call's host time. The
    # host's time is its wall clock per call: the eager column's CUDA events, on a GPU that
    # other processes keep busy, can start only once the host has queued the whole batch.
    r = gemm.measure_mm(Case("latency", "64^3", 64, 64, 64), "bf16", FAST, torch.device("cuda"))
    assert not r.error, r.error
    a, b = (torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    host_us = timing.host_us_per_call({"tgemm": lambda: tgemm.mm(a, b.t())}, ())["tgemm"]
    assert host_us > 2 * r.time_ms("tgemm", "kernel") * 1e3, (host_us, r.kernel_ms)


@pytest.mark.gpu
def test_gpu_latency_row():
    from torch_triton_gemm.bench import gemm

    rows = gemm.run_latency([Case("latency", "64^3", 64, 64, 64)], ["bf16"], torch.device("cuda"))
    assert [r.dtype for r in rows] == ["bf16", "fp8"]  # the scaled_mm path's row too
    for r in rows:
        assert not r.error, r.error
        assert set(r.host_us) == {"torch.ops.tgemm.mm", "tgemm.mm", "torch.mm"}
        assert all(0 < us < 10_000 for us in r.host_us.values())


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(suites.GROUPED_FORMS))
def test_gpu_grouped_row(form):
    if grouped.missing_reason():
        pytest.skip(grouped.missing_reason())
    case = GroupedCase("t", form, groups=4, tokens=512, n=256, k=128, routing="skewed")
    r = grouped.measure_grouped(case, FAST, torch.device("cuda"))
    assert not r.error, r.error
    assert r.rel_err < 1e-2 and r.time_ms("tgemm") > 0 and r.time_ms("loop", "eager") > 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(suites.SCALED_RECIPES))
def test_gpu_scaled_row(recipe):
    if scaled.missing_reason():
        pytest.skip(scaled.missing_reason())
    r = scaled.measure_scaled(ScaledCase("t", 256, 512, 384, recipe), FAST,
                              torch.device("cuda"))
    assert not r.error, r.error
    assert r.rel_err < 1e-2 and r.time_ms("tgemm") > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_sgrouped_row(fast):
    if sgrouped.missing_reason():
        pytest.skip(sgrouped.missing_reason())
    case = ScaledGroupedCase("t", "gate_up", groups=8, tokens=1024, n=512, k=256,
                             routing="skewed", fast_accum=fast)
    r = sgrouped.measure_sgrouped(case, FAST, torch.device("cuda"))
    assert not r.error, r.error
    assert r.rel_err < 1e-2 and r.err_vs == "fp64 deq"
    assert r.peer_equal or r.peer_diff < 1e-2, r.note
    for impl in ("tgemm", "torch"):
        assert r.time_ms(impl) > 0 and r.time_ms(impl, "eager") > 0, (impl, r.note)


@pytest.mark.gpu
def test_gpu_coldstart_program_times_its_steps():
    from torch_triton_gemm.bench import coldstart

    result = coldstart.measure("plain", steps=2)
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])
    assert math.isfinite(result["loss"])


@pytest.mark.gpu
def test_gpu_command_line_prints_the_summary_last(tmp_path, capsys):
    argv = ["--suite", "odd", "--quick", "--rounds", "1", "--warmup", "5", "--rep", "10",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("mm odd") < out.index("summary:")
    assert _cells(out, "odd bf16")[2] == "2"  # both quick rows measured
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(float(r["ratio"]) > 0 and not r["error"] for r in rows)
    assert (tmp_path / "results.md").read_text().startswith("# torch_triton_gemm benchmark")


@pytest.mark.parametrize("form", ["fwd", "fwd+bwd"])
def test_moe_inputs_peer_and_reference_agree(form):
    """The moe suite's inputs, its unfused torch._grouped_mm peer and its fp32 loop reference
    compute the same block (on CPU, in fp32), and the error it reports is small."""
    from torch_triton_gemm.bench import moe

    case = MoECase("t", form, experts=4, top_k=2, hidden=32, inter=16, tokens=24)
    args = moe.make_inputs(case, torch.device("cpu"))
    x, w13, w2, ids, weights = args[:5]
    assert (x.shape, w13.shape, w2.shape, ids.shape, weights.shape) == (
        (24, 32), (4, 32, 32), (4, 32, 16), (24, 2), (24, 2))
    assert x.dtype == w13.dtype == weights.dtype == torch.bfloat16
    assert torch.allclose(weights.float().sum(-1), torch.ones(24), atol=1e-2)
    assert (x.requires_grad and weights.requires_grad) == (form == "fwd+bwd")
    fp32 = [t.detach().float() if t.is_floating_point() else t for t in (x, w13, w2, ids, weights)]
    ref = moe.reference_moe(*fp32)
    assert torch.allclose(moe.unfused_moe(*fp32), ref, rtol=1e-4, atol=1e-5)


# --- the plan sweep -------------------------------------------------------------------------------

def test_plan_sweep_takes_fp8_products_with_every_precise_kernel_plan(monkeypatch):
    from torch_triton_gemm import device as tgemm_device
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 232448)
    scaled_cases = [c for c in plans._cases(["scaled"], 1, 10) if isinstance(c, ScaledCase)]
    assert len(scaled_cases) == len(suites.scaled_cases())
    # --scaled-ms: the Llama-3-8B projections at other M, the other shapes as they were.
    mid = [c for c in plans._cases(["scaled"], 1, 10, (256, 512)) if isinstance(c, ScaledCase)]
    assert {c.m for c in mid} == {256, 512, 4096, 8192}
    assert {(c.m, c.n, c.k) for c in mid} == {(4096,) * 3, (8192,) * 3, (4096, 18944, 3584)} | {
        (m, n, k) for m in (256, 512) for _, n, k in suites.LLAMA_LAYERS}
    assert len(mid) * 19 == len(scaled_cases) * 11  # every recipe and mode, shape by shape
    # --scaled-layers: another model's projections instead of Llama-3-8B's.
    layers = plans._scaled_layers("qkv:4608:3584, down:3584:18944")
    assert layers == [("qkv", 4608, 3584), ("down", 3584, 18944)]
    other = [c for c in plans._cases(["scaled"], 1, 10, (448,), layers) if c.m == 448]
    assert {(c.name, c.n, c.k) for c in other} == {("qkv", 4608, 3584), ("down", 3584, 18944)}
    for bad in ("qkv:4608", "qkv:0:3584", ":1:2", "qkv:4608:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME:N:K"):
            plans._scaled_layers(bad)

    def precise(case: ScaledCase, tma: bool = True) -> list[tuning.MMPlan]:
        return [p for p in plans.space_of(case, 1, tma, 132, True)
                if p.kernel == tuning.FP8_PRECISE_KERNEL]

    blockwise = ScaledCase("8192^3", 8192, 8192, 8192, "blockwise")
    # (and its K splits and 64-row tiles: at 8192^3 the 64-row tiles, unsplit)
    assert precise(blockwise) == tuning.fp8_precise_plans(2) + tuning.ws_split_plans(
        8192, 8192, 8192, 1, 2, 132) and len(precise(blockwise)) > 6
    # The default plan of that kernel is among them.
    assert tuning.fp8_precise_plan(8192, 8192, 132, 2) in precise(blockwise)
    assert precise(ScaledCase("x", 16, 4096, 4096, "rowwise")) != []
    # Fast accumulation (tensorwise, rowwise) and GPUs without TMA: the plan space only.
    assert precise(ScaledCase("x", 16, 4096, 4096, "tensorwise", fast=True)) == []
    assert precise(blockwise, tma=False) == []
    # fp8 tiles: the plan space's, K steps twice as deep as for 16-bit operands.
    space = plans.space_of(blockwise, 1, True, 132, True)
    assert any(p.kernel == "tma" for p in space)
    assert "recipe" in plans.FIELDS and "accum" in plans.FIELDS and "split_fixup" in plans.FIELDS
    # Few rows: transposed candidates too (not blockwise), 64 x 16 tiles at 16 rows, 64 x 32 at
    # 17-32, ... 64 x 128 at 65-128, none above.
    def transposed(case: ScaledCase | Case, element_size: int = 1) -> set[tuple[int, int, int]]:
        return {(p.tile.block_m, p.tile.block_n, p.tile.block_k)
                for p in plans.space_of(case, element_size, True, 132, True) if p.swap_ab}
    assert transposed(ScaledCase("x", 16, 4096, 4096, "tensorwise")) == {(64, 16, 128),
                                                                         (64, 16, 256)}
    assert transposed(Case("mm", "x", 24, 4096, 4096, "row", "col"), 2) == {(64, 32, 64),
                                                                           (64, 32, 128)}
    assert transposed(ScaledCase("x", 16, 4096, 4096, "blockwise")) == set()
    assert transposed(ScaledCase("x", 128, 4096, 4096, "rowwise")) == {(64, 128, 128),
                                                                       (64, 128, 256)}
    assert transposed(ScaledCase("x", 129, 4096, 4096, "rowwise")) == set()
    assert "swap_ab" in plans.FIELDS


def test_plan_sweep_passes_keep_each_plans_best_time_and_errors():
    from torch_triton_gemm.bench import plans

    first = [{"name": "a", "us": 3.0, "cublas_us": 2.5, "ratio": 0.8333},
             {"name": "a", "us": 5.0, "cublas_us": 2.5, "ratio": 0.5},
             {"name": "a", "cublas_us": 2.5, "error": "RuntimeError: x"}]
    second = [{"name": "a", "us": 24.0, "cublas_us": 2.0, "ratio": 0.0833},
              {"name": "a", "us": 4.0, "cublas_us": 2.0, "ratio": 0.5},
              {"name": "a", "us": 1.0, "cublas_us": 2.0, "ratio": 2.0}]
    merged = plans.faster_rows(first, second)
    assert [(r.get("us"), r["cublas_us"], r.get("ratio")) for r in merged] == [
        (3.0, 2.0, 0.6667), (4.0, 2.0, 0.5), (None, 2.0, None)]
    assert merged[2]["error"] == "RuntimeError: x" and "us" not in merged[2]
    with pytest.raises(ValueError):
        plans.faster_rows(first, second[:2])
    # A plan that failed only in the second pass keeps that error and no time.
    failed = plans.faster_rows(first[:1], [{"name": "a", "cublas_us": 2.0, "error": "E: y"}])
    assert failed[0]["error"] == "E: y" and "us" not in failed[0] and "ratio" not in failed[0]


def test_plan_sweep_trailing_keeps_the_cases_below_the_ratio(tmp_path):
    from torch_triton_gemm.bench import plans

    rows = [{"name": "8x8x8", "M": 8, "N": 8, "K": 8, "dtype": "bf16", "ratio": "0.5"},
            {"name": "8x8x8", "M": 8, "N": 8, "K": 8, "dtype": "fp16", "ratio": "0.9"},
            {"name": "9x9x9 b-row", "M": 9, "N": 9, "K": 9, "dtype": "fp16", "ratio": "0.79"},
            {"name": "7x7x7", "M": 7, "N": 7, "K": 7, "dtype": "fp16", "ratio": "",
             "error": "RuntimeError: x"},
            # Suites reuse names: Llama's qkv at two token counts.
            {"name": "qkv", "M": 16, "N": 6144, "K": 4096, "dtype": "bf16", "ratio": "0.7"},
            {"name": "qkv", "M": 512, "N": 6144, "K": 4096, "dtype": "bf16", "ratio": "0.95"}]
    path = tmp_path / "chosen.csv"
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, ["name", "M", "N", "K", "dtype", "ratio", "error"])
        writer.writeheader()
        writer.writerows(rows)
    assert plans.trailing_cases(str(path), 0.8) == {
        ("8x8x8", 8, 8, 8, "bf16"), ("9x9x9 b-row", 9, 9, 9, "fp16"),
        ("qkv", 16, 6144, 4096, "bf16")}
    assert plans.trailing_cases(str(path), 0.5) == set()


def test_plan_picks_on_any_host_are_the_plan_models_and_find_what_a_change_moves(
        tmp_path, monkeypatch):
    """bench.picks answers as the planner would on an H100 (TMA plans among its picks, each
    the plan model's for the case's view), leaves this process's device queries as they were,
    and --against lists exactly the cases whose pick a change to the constants moved, which
    bench.plans --cases then selects."""
    from torch_triton_gemm import device as tgemm_device
    from torch_triton_gemm import plan_model
    from torch_triton_gemm.bench import picks, plans

    queries = (tgemm_device.num_sms, tgemm_device.shared_memory_per_block,
               tgemm_device.supports_tma)
    before, after, moved = (str(tmp_path / f"{n}.csv") for n in ("before", "after", "moved"))
    argv = ["--seed", "5", "--count", "40"]
    assert picks.main([*argv, "--csv", before]) == 0
    assert (tgemm_device.num_sms, tgemm_device.shared_memory_per_block,
            tgemm_device.supports_tma) == queries
    with open(before, newline="") as file:
        rows = list(csv.DictReader(file))
    cases = suites.sweep_cases(5, 40)
    assert len(rows) == 2 * len(cases) and {r["dtype"] for r in rows} == {"bf16", "fp16"}
    assert any(r["plan"].startswith("tma:") for r in rows)
    for row in rows[::7]:
        m, n, k = int(row["M"]), int(row["N"]), int(row["K"])
        mcol = row["a_layout"] == "col" and m > 1
        with picks.h100():
            plan = plan_model.modelled_plan(m, n, k, 2, 2, True, 132, row["aligned"] == "True",
                                            row["narrow"] == "True", mcol,
                                            int(row["pitch_vector"]))
        assert row["plan"] == picks.plan_name(plan), row
    # The same planner moves nothing; TMA launches 20 us dearer move some picks.
    assert picks.main([*argv, "--csv", moved, "--against", before]) == 0
    with open(moved, newline="") as file:
        assert list(csv.DictReader(file)) == []
    costs = plan_model.H100_COSTS
    monkeypatch.setattr(plan_model, "H100_COSTS", dataclasses.replace(costs, tiles={
        key: dataclasses.replace(cost, launch_us=cost.launch_us + 20 * (key[0] == "tma"))
        for key, cost in costs.tiles.items()}))
    assert picks.main([*argv, "--csv", after]) == 0
    assert picks.main([*argv, "--csv", moved, "--against", before]) == 0
    with open(after, newline="") as file:
        now = {(r["name"], r["a_layout"], r["b_layout"], r["dtype"]): r["plan"]
               for r in csv.DictReader(file)}
    with open(moved, newline="") as file:
        changes = list(csv.DictReader(file))
    earlier = {(r["name"], r["a_layout"], r["b_layout"], r["dtype"]): r["plan"] for r in rows}
    expected = {key for key in earlier if earlier[key] != now[key]}
    assert expected and {(r["name"], r["a_layout"], r["b_layout"], r["dtype"])
                          for r in changes} == expected
    assert all(r["plan_before"].startswith("tma:") and r["plan"] != r["plan_before"]
               for r in changes)
    sizes = {(r["name"], r["a_layout"], r["b_layout"], r["dtype"]): (r["M"], r["N"], r["K"])
             for r in rows}
    assert plans.listed_cases(moved) == {plans.case_key(key[0], *sizes[key], key[3])
                                         for key in expected}


def _picks_moved_by_a_rule(tmp_path, argv: list[str], off_flag: str,
                           constant: str) -> tuple[list[dict[str, str]], str]:
    """bench.picks with a rule off (``off_flag``), then on against it: the changed rows and the
    path of their CSV. The plan model's ``constant`` is as it was after the first call."""
    from torch_triton_gemm import plan_model
    from torch_triton_gemm.bench import picks

    off, moved = str(tmp_path / "off.csv"), str(tmp_path / "moved.csv")
    before = getattr(plan_model, constant)
    assert picks.main([*argv, off_flag, "--csv", off]) == 0
    assert getattr(plan_model, constant) == before and before
    assert picks.main([*argv, "--csv", moved, "--against", off]) == 0
    with open(moved, newline="") as file:
        return list(csv.DictReader(file)), moved


def test_plan_picks_tell_cases_of_one_name_apart_and_the_partial_round_rule_off(tmp_path):
    """The mm suites reuse names (Llama-3-8B's qkv at every token count): bench.picks
    --against and bench.plans --cases key cases by their sizes too. --whole-rounds plans with
    plan_model.partial_round off (the other arm of its A/B), in that call only: against it,
    the rule moves Llama's qkv at 512 tokens alone, onto one round of 128x256 TMA tiles (with
    the tail split's charge off in both arms: that charge alone moves it there too)."""
    from torch_triton_gemm.bench import plans

    changes, moved = _picks_moved_by_a_rule(
        tmp_path, ["--suites", "llama", "--dtypes", "bf16", "--no-tail-reduction"],
        "--whole-rounds", "PARTIAL_ROUND")
    assert [(r["name"], r["M"], r["plan"]) for r in changes] == [
        ("qkv", "512", "tma:128x256x64w8s3:sk1")]
    assert changes[0]["plan_before"] != changes[0]["plan"]
    assert plans.listed_cases(moved) == {("qkv", 512, 6144, 4096, "bf16")}


def test_plan_picks_with_the_tail_reduction_charge_off(tmp_path):
    """--no-tail-reduction plans as if a tail split's reduction cost only its launch (the other
    arm of that charge's A/B), in that call only: against it, the charge moves the drop-in
    model's 8192 x 2752 x 1024 products alone, off 128x256 tail splits onto the same tiles
    unsplit (both arms without the warp-specialized kernel's plans, which take them over)."""
    changes, _ = _picks_moved_by_a_rule(
        tmp_path, ["--suites", "training,llama", "--dtypes", "bf16", "--no-wgmma"],
        "--no-tail-reduction",
        "TAIL_REDUCTION_BYTES")
    assert [(r["name"], r["M"], r["N"], r["K"], r["plan_before"], r["plan"])
            for r in changes] == [
        (name, "8192", "2752", "1024", "tma:128x256x64w8s3:sk3T", "tma:128x256x64w8s3:sk1")
        for name in ("dropin gate", "dropin down")]


def test_plan_picks_with_the_narrow_overlap_rule_off(tmp_path):
    """--no-narrow-overlap plans as if K splits loading element by element charged every round
    in full (the other arm of plan_model.narrow_overlap's A/B), in that call only: against it,
    the rule moves seed 2118's 24 x 3896 x 10461 (0.60x cuBLAS on an H200) onto twice the
    splits, among products whose pitches no copy fits only."""
    changes, _ = _picks_moved_by_a_rule(
        tmp_path, ["--suites", "sweep", "--seed", "2118", "--count", "400", "--dtypes", "bf16"],
        "--no-narrow-overlap", "NARROW_OVERLAP_ROUND")
    moved = {r["name"]: (r["plan_before"], r["plan"]) for r in changes}
    assert moved["24x3896x10461"] == ("portable:32x64x128w4s4:sk2", "portable:32x64x128w4s4:sk4")
    assert all(r["narrow"] == "True" and r["pitch_vector"] == "0" for r in changes)
    assert all(r["plan"].startswith("portable:") for r in changes)


def test_plan_picks_with_the_l2_limit_off(tmp_path):
    """--no-l2-limit plans as if tiles' reads from L2 cost nothing (the other arm of the L2
    limit's A/B), in that call only: against it, the limit moves Llama's gate and up
    projections at 128 tokens alone, off 64x64 tiles (both arms without the warp-specialized
    kernel's plans, which take them over)."""
    from torch_triton_gemm.bench import plans

    changes, moved = _picks_moved_by_a_rule(
        tmp_path, ["--suites", "llama", "--dtypes", "bf16", "--no-wgmma"], "--no-l2-limit",
        "L2_BYTES_PER_US")
    assert [(r["name"], r["M"]) for r in changes] == [("gate_up", "128")]
    assert changes[0]["plan_before"].startswith("portable:64x64x")
    assert not changes[0]["plan"].startswith("portable:64x64x")
    assert plans.listed_cases(moved) == {("gate_up", 128, 28672, 4096, "bf16")}


def test_plan_sweep_wide_space_adds_plans_the_planners_rules_leave_out(monkeypatch):
    from torch_triton_gemm import device as tgemm_device
    from torch_triton_gemm.bench import plans

    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 232448)
    case = Case("mm", "9792x64x24", 9792, 64, 24, "row", "col")
    space = plans.space_of(case, 2, True, 132, False)
    wide = plans.space_of(case, 2, True, 132, False, wide=True)
    assert set(space) < set(wide)
    assert any(p.kernel == "portable" and p.tile.block_m == 128 for p in wide)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_plan_sweep_launches_plans_of_fp8_and_16_bit_products(device, recipe):
    """What the plan sweep times: a plan launched into the problem's output and into a fresh
    one from rotated operand copies, against the reference; and the planner's own plan."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    dtype = "bf16" if device == "cuda" else "fp16"  # the interpreter's tl.dot: not bf16
    mm = plans.problem(Case("mm", "x", 40, 72, 96, "row", "col"), dtype, device)
    scaled_case = ScaledCase("x", 40, 256, 256, recipe)
    fp8 = plans.problem(scaled_case, dtype, device)
    assert fp8.reference is not None and fp8.scales is not None and mm.scales is None
    tile = tuning.TileConfig(16, 32, 128, 1, 4, 2)
    for p, ref, budget in ((mm, mm.args[0].double() @ mm.args[1].double(), 1e-2),
                           (fp8, fp8.reference, 2e-2)):
        for plan in (tuning.MMPlan("portable", tile), tuning.MMPlan("portable", tile, split_k=2),
                     tuning.MMPlan("portable", tile, split_k=2, split_fixup=True), p.chosen()):
            p.out.fill_(float("nan"))
            p.launch(plan)
            assert rel_error(p.out, ref) <= budget, plan
            copies = [t.clone() for t in p.args]
            fresh = torch.empty_like(p.out)
            p.launch(plan, *copies, out=fresh)
            assert torch.equal(fresh, p.out)


def test_plan_sweep_fixup_ab_pairs_the_planners_split_plans():
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    tile = tuning.TileConfig(16, 64, 128, 1, 4, 4)
    split = tuning.MMPlan("portable", tile, split_k=8)
    assert plans.with_fixup_twin([split]) == [split, tuning.MMPlan("portable", tile, split_k=8,
                                                                   split_fixup=True)]
    tma = tuning.MMPlan("tma", tile, split_k=8)
    assert plans.with_fixup_twin([tma]) == [tma, tuning.MMPlan("tma", tile, split_k=8,
                                                               split_fixup=True)]
    for plan in (tuning.MMPlan("portable", tile), tuning.MMPlan(tuning.FP8_PRECISE_KERNEL, tile),
                 tuning.MMPlan("portable", tile, split_k=tuning.FIXUP_MAX_SPLITS + 1)):
        assert plans.with_fixup_twin([plan]) == [plan]


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_plan_sweep_rounds_alternate_and_keep_each_best(monkeypatch, rounds):
    """cuBLAS and the plans timed ``rounds`` times in alternating order; each keeps its best;
    the error is measured once, from a poisoned output."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    if not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("launches kernels: a GPU or Triton's interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    real_problem = plans.problem
    monkeypatch.setattr(plans, "problem", lambda case, dtype: real_problem(case, dtype, device))
    order: list[str] = []
    times = iter(float(t) for t in (9, 7, 8, 5, 6, 4, 3, 2, 1, 9, 9, 9))

    def fake_kernel_us(fn, args, rep_ms):  # type: ignore[no-untyped-def]
        order.append("cublas" if getattr(fn, "__name__", "") == "peer" else "plan")
        return next(times)

    monkeypatch.setattr(plans, "kernel_us", fake_kernel_us)
    tile = tuning.TileConfig(16, 32, 128, 1, 4, 2)
    candidates = [tuning.MMPlan("portable", tile), tuning.MMPlan("portable", tile, split_k=2)]
    rows = list(plans.time_case(Case("mm", "x", 24, 40, 64, "row", "col"), "fp16", candidates,
                                True, 1.0, rounds))
    expected_order = {1: ["cublas", "plan", "plan"],
                      2: ["cublas", "plan", "plan", "plan", "plan", "cublas"],
                      3: ["cublas", "plan", "plan", "plan", "plan", "cublas",
                          "cublas", "plan", "plan"]}[rounds]
    assert order == expected_order
    timed = [9, 7, 8, 5, 6, 4, 3, 2, 1][:len(order)]
    cublas = min(t for t, who in zip(timed, order) if who == "cublas")
    # Per plan: round 0 in order, round 1 reversed, round 2 in order again.
    plan_times = [t for t, who in zip(timed, order) if who == "plan"]
    firsts, seconds = [plan_times[0]], [plan_times[1]]
    if rounds >= 2:
        seconds.append(plan_times[2])
        firsts.append(plan_times[3])
    if rounds == 3:
        firsts.append(plan_times[4])
        seconds.append(plan_times[5])
    for row, best in zip(rows, (min(firsts), min(seconds))):
        assert row["us"] == best and row["cublas_us"] == cublas
        assert row["ratio"] == round(cublas / best, 4)
        assert float(row["rel_err"]) < 1e-2


class _FakeEvent:
    """A CUDA event on a fake stream: records its place in the log and the GPU clock."""

    def __init__(self, log: list[str], clock: list[float], **_: object) -> None:
        self.log, self.clock = log, clock

    def record(self) -> None:
        self.log.append("record")
        self.at = self.clock[0]

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at


@pytest.mark.parametrize("queue_ahead", [False, True])
def test_kernel_only_timing_queues_its_batches_behind_a_spin(monkeypatch, queue_ahead):
    """Kernel-only timing: one spinning kernel after the warm-up and before the first timed
    batch's start event (long enough for the host to queue every batch, capped); eager timing
    none. The median batch time per call comes back either way."""
    log: list[str] = []
    clock = [0.0]
    sleeps: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _FakeEvent(log, clock, **kw))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (sleeps.append(cycles),
                                                              log.append("sleep")))

    def batch() -> None:
        log.append("batch")
        clock[0] += 0.5  # ms

    per_call = timing.time_batches(batch, 10, warmup_ms=1.0, rep_ms=4.0, queue_ahead=queue_ahead)
    assert per_call == pytest.approx(0.05)
    if not queue_ahead:
        assert sleeps == []
        return
    assert len(sleeps) == 1
    timed = log[log.index("sleep") + 1:]
    assert timed[0] == "record" and timed.count("batch") == max(timing.MIN_BATCHES, 8)
    assert log[log.index("sleep") - 1] == "batch"  # after the warm-up's batches
    batches = timed.count("batch")
    expected = min(batches * timing.QUEUE_AHEAD_PER_BATCH_S, timing.QUEUE_AHEAD_MAX_S)
    assert sleeps[0] == int(expected * timing.SLEEP_CYCLES_PER_S)


def test_plan_sweep_launch_variants_vary_warps_and_stages_within_shared_memory():
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    tile = tuning.TileConfig(64, 64, 64, 8, 4, 5)
    portable = tuning.MMPlan("portable", tile, split_k=2)
    variants = plans.with_launch_variants([portable], 2, 232448)
    assert variants[0] == portable and len(set(variants)) == len(variants)
    assert {(p.tile.num_warps, p.tile.num_stages) for p in variants} == {
        (4, 5), (2, 5), (8, 5), (4, 1), (4, 2), (4, 3)}
    assert all(dataclasses.replace(p, tile=tile) == portable for p in variants)
    big = tuning.MMPlan("tma", tuning.TileConfig(128, 256, 64, 8, 8, 3))
    shared = tuning.shared_memory_bytes(big.tile, 2)
    stages = {p.tile.num_stages for p in plans.with_launch_variants([big], 2, shared)}
    assert stages == {2, 3}  # deeper pipelines do not fit
    fp8 = tuning.MMPlan(tuning.FP8_PRECISE_KERNEL, tile)
    assert plans.with_launch_variants([fp8], 1, 232448) == [fp8]


def test_fit_says_what_is_wrong_with_its_input(tmp_path, capsys):
    """bench.fit on input that is not a plan sweep: a usage error naming the problem."""
    from torch_triton_gemm.bench import fit

    header_only = tmp_path / "empty.csv"
    header_only.write_text("suite,name,M,N,K,us\n")
    cases = [([], "give plan-sweep CSVs"), (["--check", str(tmp_path / "missing.csv")],
                                              "No such file"),
             (["--check", str(tmp_path)], "Is a directory"),
             (["--check", str(header_only)], "no timed plans"),
             (["--refit", "nosuch", "--check", str(header_only)], "--refit: one of"),
             (["--min-launch", "-1", "--check", str(header_only)], "--min-launch: microseconds")]
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    cases.append((["--check", str(tmp_path / "other.csv")], "not a plan-sweep CSV"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            fit.main(argv)
        assert message in capsys.readouterr().err, argv



def test_fit_scales_only_products_whose_pick_the_constants_cost():
    """bench.fit's --scale-by: a pick the constants do not cost (splits finishing their own
    tiles without fixup constants, stream-K) leaves its product out rather than raising."""
    from torch_triton_gemm import plan_model, tuning
    from torch_triton_gemm.bench import fit

    costs = plan_model.H100_COSTS
    assert "fixup" not in costs.launch_us  # else pick a plan these constants leave out
    tile = tuning.TileConfig(64, 64, 64, 8, 4, 5)

    def timed(name: str, plan: tuning.MMPlan, us: float) -> fit.Timed:
        return fit.Timed(("f", "sweep", name, 64, 256, 4096, "row", "col", "", "", "bf16"),
                         64, 256, 4096, 2, True, plan, False, False, us, 10.0, True)

    plain = tuning.MMPlan("portable", tile, split_k=4)
    fixup = dataclasses.replace(plain, split_fixup=True)
    rows = [timed("a", plain, 20.0), timed("b", fixup, 20.0), timed("b", plain, 30.0)]
    scaled = fit.scaled_to_model(rows, rows[:2], costs)
    assert [r.shape[2] for r in scaled] == ["a"]
    predicted = plan_model.predict_us(costs, plain, 64, 256, 4096, 2, 2, True, False, False, 0)
    assert scaled[0].us == pytest.approx(predicted)
    assert scaled[0].cublas_us == pytest.approx(10.0 * predicted / 20.0)


def test_command_examples_in_docstrings_keep_their_line_breaks():
    """A docstring example's continuation needs an escaped backslash (``\\\\``): a bare one
    joins the two lines in the rendered text (``--help`` shows it)."""
    import importlib
    import pkgutil
    import re

    import torch_triton_gemm.bench as bench

    for info in pkgutil.iter_modules(bench.__path__):
        if info.name == "__main__":  # (importing it runs the benchmark)
            continue
        doc = importlib.import_module(f"torch_triton_gemm.bench.{info.name}").__doc__ or ""
        for line in doc.splitlines():
            assert not ("python -m" in line and re.search(r"\S {4,}--", line)), (info.name, line)


def _plans_csv(path, rows):
    columns = ["suite", "name", "M", "N", "K", "dtype", "recipe", "accum", "kernel", "block_m",
               "swap_ab", "heuristic", "us", "cublas_us", "ratio", "error"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for row in rows:
            ratio = round(row["cublas_us"] / row["us"], 4) if row["us"] != "" else ""
            writer.writerow({"suite": "fewrows", "heuristic": True, "error": "",
                             "ratio": ratio, **row})


def test_compare_reads_an_ab_off_two_plan_csvs(tmp_path):
    """bench.compare: cases matched across the arms, those whose plan moved apart from those
    kept (the drift), speed-ups as base / new time with their geometric mean, worst and best,
    the peer ratio before and after, groups by rows; failed rows, rows that are not the
    planner's pick and cases missing from one arm left out."""
    from torch_triton_gemm.bench import compare

    rng = random.Random(7)
    base, new, moved, kept = [], [], [], []
    for i in range(12):
        m = (2, 12, 24)[i % 3]
        shape = {"name": f"{m}x{4096 + 64 * i}x4096", "M": m, "N": 4096 + 64 * i, "K": 4096,
                 "dtype": "bf16", "recipe": "", "accum": ""}
        t_base, t_new = rng.uniform(10, 20), rng.uniform(10, 20)
        swap = i % 2 == 0
        base.append({**shape, "kernel": "tma", "block_m": 32, "swap_ab": False,
                     "us": t_base, "cublas_us": 15.0})
        new.append({**shape, "kernel": "portable" if swap else "tma",
                    "block_m": 64 if swap else 32, "swap_ab": swap, "us": t_new,
                    "cublas_us": 15.0})
        (moved if swap else kept).append((m, t_base / t_new))
    new.append({**new[0], "heuristic": False, "us": 1.0})  # another plan of a full sweep
    base.append({**base[1], "name": "only-in-base"})
    new[3] = {**new[3], "error": "RuntimeError: boom", "us": ""}
    kept = [k for i, k in enumerate(kept) if i != 1]  # case 3 (kept) failed in the new arm
    _plans_csv(tmp_path / "base.csv", base)
    _plans_csv(tmp_path / "new.csv", new)
    text = compare.compare(str(tmp_path / "base.csv"), str(tmp_path / "new.csv"), "rows", 2)

    def cells(label):
        line = next(line for line in text.splitlines() if line.strip().startswith(label))
        return line.split()[len(label.split()):]

    speedups = [s for _, s in moved]
    changed = cells("plan changed")
    assert changed[:4] == [str(len(moved)), f"{report.geometric_mean(speedups):.3f}",
                           f"{min(speedups):.3f}", f"{max(speedups):.3f}"]
    assert cells("plan kept (drift)")[:2] == [str(len(kept)),
                                              f"{report.geometric_mean([s for _, s in kept]):.3f}"]
    assert text.startswith("11 cases in both (13 in")
    for bucket, rows in (("2-8", 2), ("9-16", 12), ("17-32", 24)):
        group = [s for m, s in moved if m == rows]
        assert cells(f"changed, rows {bucket}")[:2] == [str(len(group)),
                                                         f"{report.geometric_mean(group):.3f}"]
    slowest = text.split("changed cases (base us -> new us):")[1].splitlines()[1:]
    assert len(slowest) == 2 and f"({min(speedups):.3f}x)" in slowest[0]
    assert compare.rows_bucket(1) == "1" and compare.rows_bucket(129) == "129+"


def test_plan_sweep_workers_settle_what_the_timing_captures(monkeypatch):
    """bench.plans' compile workers run each plan through ``settle`` (what the timing's CUDA
    graph captures launch, host-descriptor variants included, compiled in parallel), and count
    the plans that fail without stopping."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import plans

    good = tuning.MMPlan("portable", tuning.TileConfig(16, 32, 32, 1, 4, 2))
    bad = tuning.MMPlan("tma", tuning.TileConfig(16, 32, 32, 1, 4, 2))
    launched, settled = [], []

    class Problem:
        def launch(self, plan):
            launched.append(plan)
            if plan == bad:
                raise RuntimeError("no TMA here")

    monkeypatch.setattr(plans, "problem", lambda *args, **kwargs: Problem())
    monkeypatch.setattr(plans, "settle", lambda fn: (settled.append(fn), fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    case = suites.Case("t", "t", 8, 40, 32)
    assert plans._compile_jobs([(case, "fp16", [good, bad, good])]) == 1
    assert launched == [good, bad, good] and len(settled) == 3


def test_eager_plans_switch_forgets_memoised_calls_and_needs_a_gpu(monkeypatch, capsys):
    """bench.eager_plans: the switch holds inside its context (the memoised eager calls
    forgotten on the way in and out) and the setting before comes back; the command line
    refuses bad dtypes, and a host without a CUDA GPU."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import eager_plans
    from torch_triton_gemm.ops import launcher

    monkeypatch.delenv(tuning.EAGER_PLANS_ENV, raising=False)
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {("seen",): None})
    with eager_plans.eager_plans(False):
        assert not tuning.eager_plans_enabled() and not launcher._EAGER_LAUNCHES
        launcher._EAGER_LAUNCHES[("seen",)] = None
    assert tuning.eager_plans_enabled() and not launcher._EAGER_LAUNCHES
    assert tuning.EAGER_PLANS_ENV not in os.environ
    monkeypatch.setenv(tuning.EAGER_PLANS_ENV, "0")
    with eager_plans.eager_plans(True):
        assert tuning.eager_plans_enabled()
    assert os.environ[tuning.EAGER_PLANS_ENV] == "0"
    with pytest.raises(SystemExit) as exit_info:
        eager_plans.main(["--dtypes", "fp8", "--csv", "x.csv"])
    assert exit_info.value.code == 2 and "--dtypes" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        eager_plans.main(["--count", "4", "--csv", "x.csv"])
    assert exit_info.value.code == 2 and "CUDA GPU" in capsys.readouterr().err


def test_eager_plans_keeps_the_products_planned_on_the_asked_kernel(monkeypatch):
    """bench.eager_plans.moved: every product whose eager plan differs from the planner's, or
    with ``planned`` only those whose planner's plan runs that kernel (--planned tma: the
    products the portable-twin rule moves)."""
    from torch_triton_gemm import tuning
    from torch_triton_gemm.bench import eager_plans

    tile = tuning.TileConfig(64, 64, 128, 8, 4, 4)
    planned = {8: tuning.MMPlan("tma", tile), 16: tuning.MMPlan("portable", tile, split_k=4),
               24: tuning.MMPlan("tma", tile)}
    eager = {8: tuning.MMPlan("portable", tile), 16: tuning.MMPlan("portable", tile, split_k=4,
                                                                   split_inline=True)}
    # (CPU operands: the output moved() allocates beside them is on the CPU too.)
    monkeypatch.setattr(eager_plans, "make_operands",
                        lambda case, dtype, device: (torch.zeros(case.m, case.k, dtype=dtype),
                                                     torch.zeros(case.k, case.n, dtype=dtype)))
    monkeypatch.setattr(eager_plans, "plan_mm", lambda a, b, bias, out, act, traced:
                        planned[a.shape[0]])
    monkeypatch.setattr(eager_plans, "eager_mm_plan", lambda a, b, out, plan:
                        eager.get(a.shape[0]))
    cases = [suites.Case("t", f"c{m}", m, 40, 32) for m in (8, 16, 24)]
    assert [(c.m, p, e) for c, _, p, e in eager_plans.moved(cases, ["bf16"])] == [
        (8, planned[8], eager[8]), (16, planned[16], eager[16])]
    assert [c.m for c, _, _, _ in eager_plans.moved(cases, ["bf16"], "tma")] == [8]
    assert [c.m for c, _, _, _ in eager_plans.moved(cases, ["bf16"], "portable")] == [16]


def test_rule_ab_times_what_the_rule_moves_on_all_seeds_once_an_arm(tmp_path, monkeypatch,
                                                                    capsys):
    """bench.ab: the cases a rule flag's arm plans differently on each seed (bench.picks, here
    --portable-copies on seed 3003: 792 x 3141 x 64 and its like read their operands as they
    are by default; seed 3006 moves none), listed with their seed, then timed by one
    bench.plans --chosen-only an arm over the seeds that moved any (replaced here by a
    stand-in that records its arguments and times the flag's arm, on copies, 1.25x the
    default's), into one CSV with seed and arm and one per arm, reported by bench.compare;
    the rule constants and memos as they were. --moved-only lists without timing, --moved
    times a list without listing; a run cut short keeps what was timed; exactly one rule
    flag is taken, and only a plan model's."""
    from torch_triton_gemm import plan_model
    from torch_triton_gemm.bench import ab, picks, plans

    calls: list[list[str]] = []

    def timed_plans(argv: list[str]) -> int:
        calls.append(argv)
        flagged = "--portable-copies" in argv
        if flagged:
            plan_model.PORTABLE_READS_AS_IS = False  # as bench.plans sets it, for good
        with open(argv[argv.index("--cases") + 1], newline="") as file:
            rows = list(csv.DictReader(file))
        us = 12.5 if flagged else 10.0
        with open(argv[argv.index("--csv") + 1], "w", newline="") as file:
            writer = csv.DictWriter(file, plans.FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({**r, "kernel": "portable", "pad": "" if flagged else "False",
                              "heuristic": True, "us": us, "cublas_us": 11.0,
                              "ratio": 11.0 / us} for r in rows)
        return 0

    monkeypatch.setattr(plans, "main", timed_plans)
    out = str(tmp_path / "ab.csv")
    assert ab.main(["--portable-copies", "--seeds", "3003,3006", "--csv", out]) == 0
    assert plan_model.PORTABLE_READS_AS_IS
    with open(out, newline="") as file:
        rows = list(csv.DictReader(file))
    names = {r["name"] for r in rows}
    assert "792x3141x64 b-pad65" in names and {r["seed"] for r in rows} == {"3003"}
    assert {r["arm"] for r in rows} == {"--portable-copies", "default"}
    assert len(rows) == 2 * len(names) and all(r["dtype"] == "bf16" for r in rows)
    for arm in ("portable-copies", "default"):
        with open(tmp_path / f"ab-{arm}.csv", newline="") as file:
            assert {r["name"] for r in csv.DictReader(file)} == names
    with open(tmp_path / "ab-moved.csv", newline="") as file:
        listed = list(csv.DictReader(file))
    assert {r["name"] for r in listed} == names and {r["seed"] for r in listed} == {"3003"}
    assert len(calls) == 2 and all(
        "--chosen-only" in c and c[c.index("--seed") + 1] == "3003" for c in calls)
    printed = capsys.readouterr().out
    changed = next(line.strip() for line in printed.splitlines()
                   if line.strip().startswith("plan changed"))
    assert changed.split()[2:4] == [str(len(names)), "1.250"]
    assert plans.seeds_of("3000-3002,3005") == [3000, 3001, 3002, 3005]
    assert len(plans.seeded_cases(["sweep"], [3003, 3003], 8)) == 8  # drawn twice, kept once
    with pytest.raises(SystemExit):
        ab.main(["--seeds", "3003", "--csv", out])
    # Listing on one host, timing on another.
    calls.clear()
    listing = str(tmp_path / "list.csv")
    assert ab.main(["--portable-copies", "--seeds", "3003", "--moved-only",
                    "--csv", listing]) == 0
    assert calls == [] and (tmp_path / "list-moved.csv").exists()
    monkeypatch.setattr(picks, "main", lambda argv: pytest.fail("listed again"))
    again = str(tmp_path / "again.csv")
    assert ab.main(["--portable-copies", "--moved", str(tmp_path / "list-moved.csv"),
                    "--count", "8", "--csv", again]) == 0  # the list's sweeps: 400 cases
    assert all(c[c.index("--count") + 1] == "400" for c in calls)
    with open(again, newline="") as file:
        assert sorted(csv.DictReader(file), key=str) == sorted(rows, key=str)
    # A run cut short (here in the default arm's timing) keeps the flag's arm's rows.
    calls.clear()

    def interrupted(argv: list[str]) -> int:
        if calls:
            raise KeyboardInterrupt
        return timed_plans(argv)

    monkeypatch.setattr(plans, "main", interrupted)
    cut = str(tmp_path / "cut.csv")
    with pytest.raises(KeyboardInterrupt):
        ab.main(["--portable-copies", "--moved", str(tmp_path / "list-moved.csv"),
                 "--csv", cut])
    with open(cut, newline="") as file:
        kept = list(csv.DictReader(file))
    assert {r["name"] for r in kept} == names
    assert {r["arm"] for r in kept} == {"--portable-copies"} and len(kept) == len(names)
    with pytest.raises(SystemExit):  # a rule outside the plan model moves no pick
        ab.main(["--swap-from-k-2048", "--seeds", "3003", "--csv", out])
    assert "not a plan model rule" in capsys.readouterr().err
