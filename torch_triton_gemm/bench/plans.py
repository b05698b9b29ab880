"""Every plan of tgemm::mm's plan space, timed kernel-only on a set of shapes next to cuBLAS:
the data the planner's rules are read off and checked against. Needs a CUDA GPU.

    python -m torch_triton_gemm.bench.plans --suites sweep,classes --seed 1 --count 300 \\
        --csv plans.csv
    python -m torch_triton_gemm.bench.plans --suites scaled --recipes blockwise --ms 8192 \\
        --csv fp8-plans.csv
    python -m torch_triton_gemm.bench.plans --suites scaled --scaled-ms 256,512,1024 \\
        --ms 256,512,1024 --csv fp8-mid-m.csv
    python -m torch_triton_gemm.bench.plans --suites scaled --chosen-only --accum precise \\
        --scaled-layers qkv:4608:3584,o:3584:3584 --scaled-ms 448,640 --ms 448,640 \\
        --csv fp8-held-out.csv      (another model's projections: the planner's own plans)
    python -m torch_triton_gemm.bench.plans --suites fewrows --seed 2026 --count 144 \\
        --chosen-only [--untransposed] --csv few-rows.csv   (the transposed rule on / off)
    python -m torch_triton_gemm.bench.plans --suites fewrows --seed 2050 --count 96 \\
        --few-rows-n 2048,4224 --chosen-only [--untransposed] --csv low-fill.csv
        (weights of fewer 64-row tiles than half a wave: the rule's lower bounds)
    python -m torch_triton_gemm.bench.picks --seed 2090 --whole-rounds --csv whole.csv
    python -m torch_triton_gemm.bench.picks --seed 2090 --csv moved.csv --against whole.csv
    python -m torch_triton_gemm.bench.plans --suites sweep --seed 2090 --cases moved.csv \\
        --chosen-only [--whole-rounds] --csv rounds.csv   (plan_model.partial_round on / off)
    python -m torch_triton_gemm.bench.plans --suites midrows --seed 2070 --count 40 \\
        --dtypes bf16 --csv mid-rows.csv   (every plan, the same weights against 33-512 rows)
    python -m torch_triton_gemm.bench.plans --shapes 512x6144x4040,8192x1000x1000 \\
        --dtypes bf16,fp16 --csv shapes.csv   (every plan of products of your own, in
        nn.Linear's layout: a row-major [M, K], b = W.t(); with --suites, those too)

The ``scaled`` suite's fp8 products (tensorwise, rowwise and blockwise scales, each
accumulation mode) take the plan space for 1-byte operands and every plan of Hopper's precise
fp8 kernel (``tuning.fp8_precise_plans``), next to ``torch._scaled_mm`` with the same recipe and
``use_fast_accum`` (the ``cublas_us`` column), checked against the dequantized fp32 product.

One CSV row per (shape, dtype, plan): the plan's fields, its kernel-only time (CUDA-graph
replays over rotating operands, as the benchmark times), cuBLAS's in the same run, the
relative error against cuBLAS's product, and whether the planner of this revision picks it.
Kernels are compiled first by several processes in parallel (Triton's compile is CPU-bound and
its on-disk cache is shared), then one process times them all, so compiles never overlap the
timings. ``--time-budget`` stops the timing early and keeps what was measured.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import torch

from .. import device as _device
from .. import plan_model, tuning
from ..warming import parse_shapes
from . import fit, suites
from .gemm import DTYPES, make_operands
from .suites import Case, ScaledCase
from .timing import calls_per_batch, capture_graph, operand_copies, settle, time_batches

FIELDS = ("suite", "name", "M", "N", "K", "a_layout", "b_layout", "a_pad", "b_pad", "class",
          "recipe", "accum", "dtype", "aligned",
          "kernel", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
          "split_k", "split_tail", "stream_k", "epilogue_subtile", "pad", "split_fixup",
          "swap_ab", "heuristic", "pitch_hints", "size_hints",
          "us", "cublas_us", "ratio", "rel_err", "error")


AnyCase = Case | ScaledCase


def seeds_of(text: str) -> list[int]:
    """Seeds from "A-B" (A to B inclusive) and comma-separated parts: "3000-3002,3005"."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected seeds such as 3000-3007, got {text!r}") from None
        if last < first:
            raise argparse.ArgumentTypeError(f"a range from {first} down to {last}")
        seeds += range(first, last + 1)
    return seeds


def seeded_cases(names: Sequence[str], seeds: Sequence[int], count: int,
                 *args: Any) -> list[AnyCase]:
    """``_cases`` of every seed in ``seeds`` in turn (``args``: _cases' after ``count``), a
    case that several seeds draw (the same frozen case) once."""
    return list(dict.fromkeys(case for seed in seeds
                              for case in _cases(names, seed, count, *args)))


def _cases(names: Sequence[str], seed: int, count: int,
           scaled_ms: Sequence[int] = suites.SCALED_LLAMA_MS,
           scaled_layers: Sequence[tuple[str, int, int]] = suites.LLAMA_LAYERS,
           few_rows_n: tuple[int, int] = suites.FEW_ROWS_N,
           shapes: Sequence[tuple[int, int, int]] = ()) -> list[AnyCase]:
    """The cases of the suites ``names`` (see --suites), then ``shapes`` (M, N, K) as cases of
    a suite named "shapes", in nn.Linear's layout."""
    cases: list[AnyCase] = []
    for name in names:
        if name == "scaled-fewrows":
            cases += suites.few_row_scaled_cases(seed, count, few_rows_n)
        elif name == "scaled-midrows":
            cases += suites.few_row_scaled_cases(seed, count, few_rows_n, suites.MID_ROWS_M)
        elif name == "scaled":
            cases += suites.scaled_cases(llama_ms=scaled_ms, layers=scaled_layers)
        else:
            cases += suites.plan_sweep_cases(name, seed, count, few_rows_n)
    return cases + suites.shape_cases("shapes", shapes)


@dataclasses.dataclass
class Problem:
    """One case's operands on the GPU: what its launches and its peer take (``args``), the
    output plans write into, and for fp8 products the recipe's scales and the reference."""

    case: AnyCase | None  # None: operands given directly (chosen_plan)
    args: tuple[torch.Tensor, ...]
    out: torch.Tensor
    scales: Any = None  # launcher.GemmScales of an fp8 product
    recipe: Any = None  # its scaled_mm recipe
    reference: torch.Tensor | None = None  # fp8: the dequantized operands' fp32 product

    def launch(self, plan: tuning.MMPlan, *args: torch.Tensor,
               out: torch.Tensor | None = None) -> None:
        """Launch ``plan`` on ``args`` (this problem's by default) into ``out``."""
        from ..ops.launcher import launch_mm

        a, b, *scales = args or self.args
        out = self.out if out is None else out
        if self.scales is None:
            launch_mm(a, b, None, out, "none", traceable=False, plan=plan)
            return
        launch_mm(a, b, None, out, "none", False, plan,
                  self.scales._replace(scale_a=scales[0], scale_b=scales[1]))

    def peer(self, *args: torch.Tensor) -> torch.Tensor:
        """cuBLAS on the same operands: torch.mm, or torch._scaled_mm with the same recipe
        and accumulation."""
        if self.scales is None:
            return torch.mm(*args)
        return torch._scaled_mm(*args, out_dtype=self.out.dtype,
                                use_fast_accum=self.scales.fast_accum)

    def chosen(self) -> tuning.MMPlan:
        """The plan tgemm launches for these operands (as this revision's planner picks it)."""
        from ..ops.launcher import prepare_launch
        from ..ops.planner import plan_mm

        a, b = self.args[:2]
        plan = plan_mm(a, b, None, self.out, "none", False, self.scales)
        return prepare_launch(a, b, None, self.out, "none", False, plan, self.scales).plan


def problem(case: AnyCase, dtype: str, device: torch.device | str = "cuda",
            reference: bool = True) -> Problem:
    """Fresh operands for ``case`` (``dtype`` for mm cases; fp8 cases are quantized with their
    recipe), on ``device``; fp8 ones without their fp32 reference unless ``reference``."""
    device = torch.device(device)
    if isinstance(case, ScaledCase):
        from ..ops import scaled_mm as scaled_op
        from .scaled import OUT_DTYPE, make_inputs

        args, reference_product = make_inputs(case, device, reference)
        out = torch.empty((case.m, case.n), device=device, dtype=OUT_DTYPE)
        _, recipe = scaled_op._check_inputs(*args, None, OUT_DTYPE)
        scales = scaled_op._gemm_scales(recipe, args[2], args[3], case.fast)
        return Problem(case, args, out, scales, recipe, reference_product)
    a, b = make_operands(case, DTYPES[dtype], device)
    return Problem(case, (a, b), torch.empty((case.m, case.n), device=device, dtype=a.dtype))


def _aligned(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    from ..ops.operands import kernel_operands

    return kernel_operands(a, b, out, pad=False)[0] is not None


def chosen_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuning.MMPlan:
    """The plan tgemm.mm launches for these operands (as this revision's planner picks it)."""
    return Problem(None, (a, b), out).chosen()


def _chosen_of(case: AnyCase, dtype: str) -> tuning.MMPlan:
    return problem(case, dtype, reference=False).chosen()


def space_of(case: AnyCase, element_size: int, tma: bool, num_sms: int, aligned: bool,
             out_size: int = 2, wide: bool = False, wgmma: bool = False) -> list[tuning.MMPlan]:
    """The plans timed for ``case``: the plan space (``wide``: without its size and width
    rules, see ``tuning.plan_space``; ``wgmma``: with the 16-bit plans of Hopper's
    warp-specialized kernel, where it runs the product, and its K splits), for an fp8 product
    whose recipe Hopper's precise fp8 kernel runs (tensorwise or rowwise without fast
    accumulation, blockwise) on a GPU with TMA, every plan of that kernel (its K splits too),
    and for products of few rows (not blockwise) the transposed candidates
    (``tuning.transposed_plans``)."""
    plans = list(tuning.plan_space(case.m, case.n, case.k, element_size, tma, num_sms,
                                   aligned, wide, out_size if wgmma else 0))
    if isinstance(case, ScaledCase) and tma and (case.recipe == "blockwise" or not case.fast):
        plans += tuning.fp8_precise_plans(out_size)
        plans += tuning.ws_split_plans(case.m, case.n, case.k, 1, out_size, num_sms)
    if not (isinstance(case, ScaledCase) and case.recipe == "blockwise"):
        plans += tuning.transposed_plans(case.m, element_size)
    return plans


def case_plans(case: AnyCase, dtype: str,
               wide: bool = False) -> tuple[bool, list[tuning.MMPlan]]:
    """Whether the case's operands can be described for TMA as they are, and its plans
    (``space_of``) and, last, the planner's choice when it is not among them."""
    p = problem(case, dtype, reference=False)
    a, b = p.args[:2]
    aligned = _aligned(a, b, p.out)
    from ..ops.planner import ws_applies

    wgmma = not isinstance(case, ScaledCase) and ws_applies(a, b, p.out)
    plans = space_of(case, a.element_size(), _device.supports_tma(a.device),
                     _device.num_sms(a.device), aligned, p.out.element_size(), wide, wgmma)
    chosen = p.chosen()
    if chosen not in plans:
        plans.append(chosen)
    return aligned, plans


def with_fixup_twin(plans: list[tuning.MMPlan]) -> list[tuning.MMPlan]:
    """``plans`` and, where the first splits K (up to tuning.FIXUP_MAX_SPLITS), the same plan
    with splits that finish their own tiles."""
    first = plans[0]
    if not tuning.fixes_up_splits(dataclasses.replace(first, split_fixup=True), first.split_k) or (
            first.split_fixup):
        return plans
    return [*plans, dataclasses.replace(first, split_fixup=True)]


# Launch variants of the planner's pick (--launch-variants): the warps and pipeline depths
# tried on its tile.
VARIANT_WARPS = (2, 4, 8)
VARIANT_STAGES = {"portable": (1, 2, 3), "tma": (2, 3, 4, 5)}


def with_launch_variants(plans: list[tuning.MMPlan], element_size: int,
                         shared_memory: int) -> list[tuning.MMPlan]:
    """``plans`` and the first one's tile with each other warp count of VARIANT_WARPS and
    pipeline depth of VARIANT_STAGES (its kernel's; the portable kernel launches at most as
    deep as its K loop, see ``tuning.pipeline_stages``), those that fit ``shared_memory``: how
    the launch shape of the planner's picks could change, timed in one run."""
    first = plans[0]
    if first.kernel not in VARIANT_STAGES:
        return plans
    tiles = [dataclasses.replace(first.tile, num_warps=w) for w in VARIANT_WARPS]
    tiles += [dataclasses.replace(first.tile, num_stages=s) for s in VARIANT_STAGES[first.kernel]]
    variants = list(plans)
    for tile in tiles:
        plan = dataclasses.replace(first, tile=tile)
        if plan not in variants and tuning.shared_memory_bytes(tile, element_size) <= (
                shared_memory):
            variants.append(plan)
    return variants


def _compile_jobs(jobs: list[tuple[AnyCase, str, list[tuning.MMPlan]]],
                  deadline: float = math.inf) -> int:
    """Launch each plan (a worker process's share) until what its timing launches is compiled
    and cached, until ``deadline`` (time.time()); returns how many failed. That includes the
    host-descriptor variants of 16-bit TMA launches, which the timing's CUDA-graph captures
    take (``settle``): left to the timing process, they compiled one after another there (an
    H100's first bf16 cases of a plan sweep: 90 s each, against 3-7 s once compiled)."""
    failed = 0
    for case, dtype, plans in jobs:
        # No fp8 reference, and the memory handed back after each case: a dozen workers
        # holding the largest case's fp32 copies ran a 141 GB GPU out of memory.
        p = problem(case, dtype, reference=False)
        for plan in plans:
            if time.time() > deadline:
                return failed
            try:
                settle(lambda launch=p.launch, plan=plan: launch(plan))
            except Exception:  # noqa: BLE001 - timed (and reported) again by the main process
                failed += 1
        torch.cuda.synchronize()
        del p
        torch.cuda.empty_cache()
    return failed


def compile_all(jobs: list[tuple[AnyCase, str, list[tuning.MMPlan]]], workers: int,
                budget_s: float) -> None:
    """Compile every plan's kernels in ``workers`` processes (round-robin shares), for at most
    ``budget_s`` seconds (what is left compiles when it is first timed)."""
    deadline = time.time() + budget_s
    if workers <= 1:
        _compile_jobs(jobs, deadline)
        return
    shares = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_jobs, shares, [deadline] * workers))
    print(f"compiled in {workers} processes ({failed} launches failed)", file=sys.stderr)


def kernel_us(fn, args: Sequence[torch.Tensor], rep_ms: float) -> float:  # type: ignore[no-untyped-def]
    """Median kernel-only time of ``fn(*args)`` in us: CUDA-graph replays of a batch of calls
    cycling through copies of the operands."""
    calls = calls_per_batch(fn, args, 16)
    copies = operand_copies(args, calls)

    def batch() -> None:
        for i in range(calls):
            fn(*copies[i % len(copies)])

    graph = capture_graph(batch)
    try:
        return time_batches(graph.replay, calls, rep_ms / 4, rep_ms, queue_ahead=True) * 1e3
    finally:
        del graph


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_case(case: AnyCase, dtype: str, plans: list[tuning.MMPlan], aligned: bool,
              rep_ms: float, rounds: int = 1) -> Iterator[dict[str, object]]:
    """The rows of one case: cuBLAS, then every plan (poisoned output, error, time). With
    ``rounds`` > 1 cuBLAS and the plans are timed that many times, in alternating order, and
    each keeps its best: one slow window (a clock dip after compiles, say) then decides no
    ratio."""
    p = problem(case, dtype)
    out = p.out
    ref = p.reference if p.reference is not None else p.peer(*p.args).float()
    chosen = p.chosen()
    base = {**case.record(), "suite": case.suite, "name": case.name,
            "dtype": "fp8" if p.scales is not None else dtype, "aligned": aligned,
            # Pitch and size hints: one switch (rows of CSVs made before the size hints
            # existed have no size_hints column).
            "pitch_hints": tuning.pitch_hints_enabled(),
            "size_hints": tuning.pitch_hints_enabled()}
    # Stream-K plans last: a plan's timing should not follow spin-waiting kernels.
    ordered = sorted(plans, key=lambda candidate: candidate.stream_k > 0)
    rows = [{**base, **_plan_fields(plan), "heuristic": plan == chosen} for plan in ordered]
    best = [math.inf] * len(ordered)
    cublas = math.inf
    for round_index in range(rounds):
        if round_index % 2 == 0:
            cublas = min(cublas, kernel_us(p.peer, p.args, rep_ms))
        for index in (range(len(ordered)) if round_index % 2 == 0
                      else reversed(range(len(ordered)))):
            plan, row = ordered[index], rows[index]
            if "error" in row:
                continue
            try:
                if round_index == 0:
                    out.fill_(math.nan)
                    p.launch(plan)
                    row["rel_err"] = f"{_relative_error(out, ref):.2e}"
                    settle(lambda launch=p.launch, plan=plan: launch(plan))
                best[index] = min(best[index], kernel_us(
                    lambda *args, plan=plan: p.launch(plan, *args, out=torch.empty_like(out)),
                    p.args, rep_ms))
            except Exception as exc:  # noqa: BLE001 - a plan that cannot run is a row saying so
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                torch.cuda.synchronize()
        if round_index % 2 == 1:
            cublas = min(cublas, kernel_us(p.peer, p.args, rep_ms))
    for row, us in zip(rows, best):
        row["cublas_us"] = round(cublas, 3)
        if "error" not in row:
            row["us"] = round(us, 3)
            row["ratio"] = round(cublas / us, 4)
        yield row


# MMPlan fields a CSV row leaves out (its tile's fields stand in for ``tile``).
_UNWRITTEN_PLAN_FIELDS = ("tile", "warp_specialize", "programs_per_sm")
# The columns that name a row's plan, as _plan_fields writes them.
PLAN_COLUMNS = tuple(f.name for f in dataclasses.fields(tuning.MMPlan)
                     if f.name not in _UNWRITTEN_PLAN_FIELDS) + tuple(
    f.name for f in dataclasses.fields(tuning.TileConfig))


def _plan_fields(plan: tuning.MMPlan) -> dict[str, object]:
    fields = dataclasses.asdict(plan)
    tile = fields.pop("tile")
    for name in _UNWRITTEN_PLAN_FIELDS[1:]:
        fields.pop(name)
    return {**fields, **tile}


def _n_range(text: str) -> tuple[int, int]:
    """``--few-rows-n``'s LO,HI: whole numbers, 1 <= LO <= HI."""
    try:
        lo, hi = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LO,HI (two whole numbers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


# The planner's rules a flag turns off, for the other arm of each rule's A/B (bench.plans
# times it, bench.picks lists the picks it moves): the flag, the module and name of the
# constant, its value with the rule off, and what planning then assumes.
RULE_FLAGS: tuple[tuple[str, Any, str, object, str], ...] = (
    ("--whole-rounds", plan_model, "PARTIAL_ROUND", plan_model.WHOLE_ROUNDS,
     "plan as if one round of programs on part of the SMs cost the constants' whole charge "
     "(plan_model.partial_round off)"),
    ("--no-l2-limit", plan_model, "L2_BYTES_PER_US", 0,
     "plan as if tiles' reads from L2 cost nothing (plan_model.l2_us off)"),
    ("--no-tail-reduction", plan_model, "TAIL_REDUCTION_BYTES", 0,
     "plan as if a tail split's reduction cost only its launch (plan_model.tail_reduction_us "
     "off)"),
    ("--no-narrow-overlap", plan_model, "NARROW_OVERLAP_ROUND", 1.0,
     "plan as if K splits loading element by element charged every round of programs on an "
     "SM in full (plan_model.narrow_overlap off)"),
    ("--dram-scaling", plan_model, "DRAM_SCALING", True,
     "plan with the memory system's bandwidth scaled to the GPU's peak DRAM bandwidth "
     "(plan_model.DRAM_SCALING on)"),
    ("--no-narrow-large-output", plan_model, "NARROW_LARGE_OUTPUT_FACTOR", 1.0,
     "plan as if the portable kernel's one-step tiles on narrow pitches took their "
     "constants' time on outputs over 4 MiB (plan_model.narrow_large_output off)"),
    ("--portable-copies", plan_model, "PORTABLE_READS_AS_IS", False,
     "plan as if the portable kernel's plans read the copies the launcher makes of large "
     "products' operands TMA cannot describe (plan_model.PORTABLE_READS_AS_IS off)"),
    ("--no-wgmma", plan_model, "WS_PLANS", False,
     "plan as if Hopper's warp-specialized kernel's 16-bit plans never competed "
     "(plan_model.WS_PLANS off)"),
    ("--no-few-rows-tma-credit", plan_model, "FEW_ROWS_TMA_CREDIT_US", 0.0,
     "plan as if TMA launches of products of few rows against wide weights cost their "
     "fitted constants (plan_model.few_rows_tma_credit off)"),
    ("--swap-from-k-2048", tuning, "SWAP_MIN_K_WITHIN_WAVE_16BIT", 2048,
     "plan as if 16-bit products of few rows ran transposed only from K 2048 (tuning."
     "swap_plan's shallow K within a wave off)"),
    ("--fp8-swap-from-k-2048", tuning, "SWAP_MIN_K_WITHIN_WAVE_FP8", 2048,
     "plan as if fp8 products of few rows ran transposed only from K 2048 (tuning.swap_plan's "
     "shallow K within a wave off for fp8)"),
    ("--no-blockwise-ws-split", tuning, "BLOCKWISE_WS_SPLIT_MIN_ROWS", 129,
     "plan as if blockwise fp8 products of 65-128 rows never took the warp-specialized "
     "kernel's K splits (tuning._blockwise_ws_split_plan off)"),
)


def add_rule_flags(parser: argparse.ArgumentParser, arm: str) -> None:
    """RULE_FLAGS' flags on ``parser``, each help text ending with ``arm``."""
    for flag, _, _, _, assumes in RULE_FLAGS:
        parser.add_argument(flag, action="store_true", help=assumes + arm)


def rules_off(args: argparse.Namespace) -> list[tuple[Any, str, object]]:
    """(module, constant, value) for each rule that ``args``' RULE_FLAGS turn off."""
    return [(module, constant, value) for flag, module, constant, value, _ in RULE_FLAGS
            if getattr(args, flag.lstrip("-").replace("-", "_"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.plans",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default=None,
                        help="comma-separated: sweep, mm suite names, scaled, fewrows / "
                             "scaled-fewrows (--count seeded 16-bit / fp8 products of 2-32 "
                             "rows, for the transposed rule) and midrows / scaled-midrows "
                             "(the same weights against 33-512 rows); default sweep,classes, "
                             "none with --shapes")
    parser.add_argument("--shapes", type=parse_shapes, default=(), metavar="MxNxK,...",
                        help="also time these products (comma-separated MxNxK, out[M, N] = "
                             "a[M, K] @ b[K, N]; a row-major, b = W.t() as in nn.Linear)")
    parser.add_argument("--few-rows-n", default=suites.FEW_ROWS_N, metavar="LO,HI",
                        type=_n_range,
                        help="fewrows / scaled-fewrows: draw the weight's rows N over LO..HI "
                             "(default: %(default)s), e.g. 2048,4224 for weights of fewer "
                             "64-row tiles than half a wave")
    parser.add_argument("--recipes", default=None,
                        help="scaled: only these recipes (comma-separated)")
    parser.add_argument("--ms", default=None,
                        help="only cases with these M (comma-separated)")
    parser.add_argument("--scaled-ms", default=None, metavar="MS",
                        help="scaled: the Llama-3-8B projections at these M (comma-separated) "
                             "instead of the suite's "
                             f"{', '.join(map(str, suites.SCALED_LLAMA_MS))}")
    parser.add_argument("--scaled-layers", default=None, metavar="NAME:N:K,...",
                        type=_scaled_layers,
                        help="scaled: these projections (another model's, to judge a rule on "
                             "shapes it was not fitted on) instead of Llama-3-8B's")
    parser.add_argument("--accum", choices=("precise", "fast"), default=None,
                        help="scaled: only this accumulation mode")
    parser.add_argument("--seed", type=seeds_of, default=[1], metavar="SEEDS",
                        help="the seeded suites' seed, or several (3000-3007, comma-separated: "
                             "each seed's cases in turn)")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--csv", required=True)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="processes compiling kernels before the timing")
    parser.add_argument("--rep-ms", type=float, default=6.0, help="ms of replays per plan")
    parser.add_argument("--rounds", type=int, default=None,
                        help="time cuBLAS and every plan this many times, alternating, best "
                             "kept (default: 2 with --chosen-only, --fixup-ab or "
                             "--launch-variants, else 1)")
    parser.add_argument("--passes", type=int, default=1,
                        help="time every case this many times, one pass over all cases after "
                             "another, each row keeping its best: a slow window of the GPU "
                             "(identical few-microsecond kernels timed up to 8x slower in one "
                             "sweep than the next, in both of a case's rounds) then decides no "
                             "ratio")
    parser.add_argument("--time-budget", type=float, default=math.inf, metavar="S",
                        help="stop timing S seconds after the compiles end (rows so far are kept)")
    parser.add_argument("--compile-budget", type=float, default=math.inf, metavar="S",
                        help="stop the parallel compiles after S seconds")
    parser.add_argument("--no-stream-k", action="store_true", help="leave stream-K plans out")
    parser.add_argument("--max-n", type=int, default=None, metavar="N",
                        help="only shapes with at most N output columns")
    parser.add_argument("--max-flop", type=float, default=None, metavar="F",
                        help="only products of at most F floating-point operations (2*M*N*K)")
    parser.add_argument("--narrow-only", action="store_true",
                        help="only products with an operand pitch that is not a multiple of 16 "
                             "elements")
    parser.add_argument("--layouts", default=None,
                        help="only products with one of these operand layouts (comma-separated: "
                             "a-row, a-col (x.t()), b-col (W.t()), b-row)")
    parser.add_argument("--kernels", default=None,
                        help="only plans of these kernels (comma-separated: portable, tma, "
                             "wgmma)")
    parser.add_argument("--split-ks", default=None, metavar="S",
                        help="only plans splitting K into one of these counts (comma-separated: "
                             "1 for unsplit plans, which is what a refit of a kernel's step and "
                             "tile costs needs)")
    parser.add_argument("--trailing", default=None, metavar="CSV",
                        help="only the cases (and dtypes) whose rows in CSV, an earlier run's "
                             "(--chosen-only), ran below --below of cuBLAS: time every plan "
                             "where the planner's pick trailed")
    parser.add_argument("--cases", default=None, metavar="CSV",
                        help="only the cases (and dtypes) of CSV's rows (its name and dtype "
                             "columns: python -m torch_triton_gemm.bench.picks --against writes "
                             "the cases a planner change moves)")
    parser.add_argument("--below", type=float, default=0.8, metavar="R",
                        help="with --trailing: the ratio to cuBLAS under which a case is kept")
    parser.add_argument("--wide-space", action="store_true",
                        help="time every tile of the plan space that fits shared memory, on "
                             "both kernels, whatever its size and width rules say (with "
                             "--trailing: whether they leave faster plans out)")
    parser.add_argument("--chosen-only", action="store_true",
                        help="time only the plan the planner picks (its ratio to cuBLAS)")
    parser.add_argument("--untransposed", action="store_true",
                        help="plan as if the transposed rule (tuning.swap_plan) were off: with "
                             "--chosen-only, the other arm of its A/B")
    add_rule_flags(parser, ": with --chosen-only, the other arm of its A/B")
    parser.add_argument("--fixup-ab", action="store_true",
                        help="time the plan the planner picks and, where it splits K, the "
                             "same plan with splits that finish their tiles themselves "
                             "(split_fixup)")
    parser.add_argument("--launch-variants", action="store_true",
                        help="time the plan the planner picks and its tile with other warp "
                             "counts and pipeline depths (with_launch_variants)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the plan sweep needs a CUDA GPU")
    if args.untransposed:
        tuning.SWAP_MAX_ROWS = 0
    for module, constant, value in rules_off(args):
        setattr(module, constant, value)
    start = time.perf_counter()
    scaled_ms = suites.SCALED_LLAMA_MS if args.scaled_ms is None else tuple(
        int(m) for m in args.scaled_ms.split(","))
    names = args.suites if args.suites is not None else "" if args.shapes else "sweep,classes"
    cases = seeded_cases([s.strip() for s in names.split(",") if s.strip()], args.seed,
                         args.count, scaled_ms, args.scaled_layers or suites.LLAMA_LAYERS,
                         args.few_rows_n, args.shapes)
    if args.max_n is not None:
        cases = [case for case in cases if case.n <= args.max_n]
    if args.max_flop is not None:
        cases = [case for case in cases if 2 * case.m * case.n * case.k <= args.max_flop]
    if args.narrow_only:
        cases = [case for case in cases
                 if isinstance(case, Case) and fit.narrow_row(case.record())]
    if args.layouts is not None:
        layouts = set(args.layouts.split(","))
        cases = [case for case in cases if isinstance(case, Case) and (
            f"a-{case.a_layout}" in layouts or f"b-{case.b_layout}" in layouts)]
    if args.recipes is not None:
        recipes = set(args.recipes.split(","))
        cases = [c for c in cases if not isinstance(c, ScaledCase) or c.recipe in recipes]
    if args.accum is not None:
        cases = [c for c in cases if not isinstance(c, ScaledCase) or c.accumulation == args.accum]
    if args.ms is not None:
        ms = {int(m) for m in args.ms.split(",")}
        cases = [case for case in cases if case.m in ms]
    # fp8 products take their dtype from their recipe: once, whatever --dtypes says.
    dtypes = args.dtypes.split(",")
    wanted = None if args.trailing is None else trailing_cases(args.trailing, args.below)
    if args.cases is not None:
        listed = listed_cases(args.cases)
        wanted = listed if wanted is None else wanted & listed
    jobs = [(case, dtype, *case_plans(case, dtype, args.wide_space)) for case in cases
            for dtype in (dtypes[:1] if isinstance(case, ScaledCase) else dtypes)
            if wanted is None or case_key(case.name, case.m, case.n, case.k, dtype) in wanted]
    if args.chosen_only or args.fixup_ab or args.launch_variants:
        jobs = [(c, d, aligned, [_chosen_of(c, d)]) for c, d, aligned, _ in jobs]
    if args.fixup_ab:
        jobs = [(c, d, aligned, with_fixup_twin(plans)) for c, d, aligned, plans in jobs]
    if args.launch_variants:
        smem = _device.shared_memory_per_block(0)
        jobs = [(c, d, aligned, with_launch_variants(
                    plans, 1 if isinstance(c, ScaledCase) else DTYPES[d].itemsize, smem))
                for c, d, aligned, plans in jobs]
    if args.kernels is not None:
        kernels = set(args.kernels.split(","))
        jobs = [(c, d, aligned, [p for p in plans if p.kernel in kernels])
                for c, d, aligned, plans in jobs]
        jobs = [job for job in jobs if job[3]]  # (cases no such plan runs: nothing to time)
    if args.split_ks is not None:
        splits = {int(s) for s in args.split_ks.split(",")}
        jobs = [(c, d, aligned, [p for p in plans if p.split_k in splits])
                for c, d, aligned, plans in jobs]
    if args.no_stream_k:
        jobs = [(c, d, aligned, [p for p in plans if not p.stream_k])
                for c, d, aligned, plans in jobs]
    total = sum(len(plans) for *_, plans in jobs)
    rounds = args.rounds if args.rounds is not None else (
        2 if args.chosen_only or args.fixup_ab or args.launch_variants else 1)
    print(f"{len(jobs)} cases, {total} plans", file=sys.stderr)
    compile_all([(case, dtype, plans) for case, dtype, _, plans in jobs], args.workers,
                args.compile_budget)
    print(f"compiled after {time.perf_counter() - start:.0f} s", file=sys.stderr)
    # The timing budget starts here, so that --compile-budget and --time-budget add up.
    timing_start = time.perf_counter()
    timed = 0
    kept: list[list[dict[str, object]]] = []
    for pass_index in range(args.passes):
        done = 0
        with open(args.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, FIELDS, extrasaction="ignore")
            writer.writeheader()
            for case, dtype, aligned, plans in jobs[:len(kept) if pass_index else None]:
                if time.perf_counter() - timing_start > args.time_budget:
                    print(f"time budget spent after {done} cases", file=sys.stderr)
                    break
                rows = list(time_case(case, dtype, plans, aligned, args.rep_ms, rounds))
                if pass_index:
                    kept[done] = rows = faster_rows(kept[done], rows)
                else:
                    kept.append(rows)
                writer.writerows(rows)
                done += 1
                timed += len(plans)
                file.flush()
                torch.cuda.empty_cache()
                label = rows[0]["dtype"] if rows else dtype  # fp8 cases: "fp8"
                print(f"[{pass_index + 1}:{done}/{len(jobs)}] {case.m}x{case.n}x{case.k} "
                      f"{label}: {len(plans)} plans, {time.perf_counter() - start:.0f} s",
                      file=sys.stderr)
            # Cases the time budget left out of a later pass keep the earlier passes' rows.
            for rows in kept[done:]:
                writer.writerows(rows)
    print(f"timed {timed} plans in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def _scaled_layers(text: str) -> list[tuple[str, int, int]]:
    """--scaled-layers: "qkv:4608:3584,o:3584:3584" -> [("qkv", 4608, 3584), ...]."""
    layers = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[0] or not all(p.isdigit() and int(p) > 0
                                                      for p in parts[1:]):
            raise argparse.ArgumentTypeError(
                f"{item!r}: each projection is NAME:N:K with positive integers N and K")
        layers.append((parts[0], int(parts[1]), int(parts[2])))
    return layers


CaseKey = tuple[str, int, int, int, str]


def case_key(name: str, m: int, n: int, k: int, dtype: str) -> CaseKey:
    """What tells one timed case from another: its name, sizes and dtype (the suites reuse
    names: Llama's qkv is one name at every M)."""
    return (name, int(m), int(n), int(k), dtype)


def row_key(row: dict[str, str]) -> CaseKey:
    """``case_key`` of a plan-sweep CSV's row (or any row with name, M, N, K and dtype)."""
    return case_key(row["name"], int(row["M"]), int(row["N"]), int(row["K"]), row["dtype"])


def trailing_cases(path: str, below: float) -> set[CaseKey]:
    """``case_key`` of the rows of the plan-sweep CSV at ``path`` whose ratio to cuBLAS is below
    ``below`` (rows without a ratio, failed ones, are left out)."""
    with open(path, newline="") as file:
        return {row_key(row) for row in csv.DictReader(file)
                if row.get("ratio") and float(row["ratio"]) < below}


def listed_cases(path: str) -> set[CaseKey]:
    """``case_key`` of every row of the CSV at ``path``."""
    with open(path, newline="") as file:
        return {row_key(row) for row in csv.DictReader(file)}


def faster_rows(first: Sequence[dict[str, object]],
                second: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """The rows of two passes over one case's plans, each plan's and cuBLAS's best time
    kept (a plan that failed in either pass keeps its error, and no time)."""
    merged = []
    for one, two in zip(first, second, strict=True):
        row = dict(one)
        if "error" in two:
            row["error"] = two["error"]
        cublas = min(float(one["cublas_us"]), float(two["cublas_us"]))  # type: ignore[arg-type]
        row["cublas_us"] = round(cublas, 3)
        if "error" in row:
            row.pop("us", None)
            row.pop("ratio", None)
        else:
            us = min(float(one["us"]), float(two["us"]))  # type: ignore[arg-type]
            row["us"] = round(us, 3)
            row["ratio"] = round(cublas / us, 4)
        merged.append(row)
    return merged


if __name__ == "__main__":
    sys.exit(main())
