"""How results are shown: plain-text and markdown tables, the summaries, CSV, and PNG plots.

Nothing here needs a GPU, and matplotlib is imported only when a plot is written (it is an
optional dependency: ``pip install "torch-triton-gemm[bench]"``).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from . import suites
from .results import (
    DEVICE_BUILT_NOTE,
    SCALED_LATENCY_NAMES,
    ColdStartResult,
    E2EResult,
    GemmResult,
    LatencyResult,
    RunResults,
    latency_name,
    safe_ratio,
)

# --- tables -------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 left: Iterable[str] = ()) -> str:
    """Plain-text table: columns padded to their widest cell, text left, numbers right."""
    left = set(left)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.ljust(w) if h in left else cell.rjust(w)
                 for cell, w, h in zip(cells, widths, headers, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def format_markdown(headers: Sequence[str], rows: Sequence[Sequence[str]],
                    left: Iterable[str] = ()) -> str:
    """GitHub markdown table with the same alignment as ``format_table``."""
    left = set(left)
    align = [":---" if h in left else "---:" for h in headers]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(value: float, spec: str) -> str:
    """A number, or "n/a" where it could not be measured."""
    return format(value, spec) if math.isfinite(value) else "n/a"


def fmt_tflops(value: float) -> str:
    # Decode-sized rows run at a few TFLOP/s; keep two decimals there so they are not all "1.0".
    return _fmt(value, ".1f" if value >= 10 else ".2f")


def fmt_ratio(value: float) -> str:
    return _fmt(value, ".2f")


def fmt_times(value: float) -> str:
    """A ratio as "1.23x"."""
    return _fmt(value, ".2f") + "x" if math.isfinite(value) else "n/a"


def _err_cells(r: GemmResult) -> list[str]:
    return ["ERROR", ""] if r.error else [_fmt(r.rel_err, ".2e"), r.err_vs]


@dataclass(frozen=True)
class Section:
    """One table of the report: a title line, headers, rows, left-aligned columns, and lines
    to print under it (errors, notes)."""

    title: str
    headers: tuple[str, ...]
    rows: list[list[str]]
    left: frozenset[str]
    footer: list[str]

    def render(self, markdown: bool = False) -> str:
        fmt = format_markdown if markdown else format_table
        parts = [f"## {self.title}" if markdown else self.title,
                 fmt(self.headers, self.rows, self.left)]
        if self.footer:
            parts.append("\n".join(f"- {line}" if markdown else f"  {line}"
                                   for line in self.footer))
        return "\n\n".join(parts) if markdown else "\n".join(parts)


def _issues(labelled: Iterable[tuple[str, str, str]]) -> list[str]:
    """Footer lines for (label, error, note) triples that have an error or a note."""
    lines = []
    for label, error, note in labelled:
        if error:
            lines.append(f"ERROR {label}: {error}")
        elif note:
            lines.append(f"note {label}: {note}")
    return lines


def _gemm_issues(results: Sequence[GemmResult]) -> list[str]:
    return _issues((r.label(), r.error, r.note) for r in results)


MM_HEADERS = ("suite", "name", "M", "N", "K", "dtype", "tgemm TFLOP/s", "torch TFLOP/s",
              "ratio kernel", "ratio eager", "tgemm GB/s", "torch GB/s", "rel err", "err vs")
# Columns after "ratio eager" in tables with --inductor rows; its ratios are against torch.
INDUCTOR_HEADERS = ("inductor TFLOP/s", "inductor ratio kernel", "inductor ratio eager")


def _with_inductor(results: Sequence[GemmResult]) -> bool:
    return any(r.has("inductor") for r in results)


def mm_section(results: Sequence[GemmResult], title: str = "mm") -> Section:
    inductor = _with_inductor(results)
    headers = MM_HEADERS
    if inductor:
        split = MM_HEADERS.index("ratio eager") + 1
        headers = (*MM_HEADERS[:split], *INDUCTOR_HEADERS, *MM_HEADERS[split:])
    rows = []
    for r in results:
        c = r.case
        gbps = ([_fmt(r.gbps("tgemm"), ".0f"), _fmt(r.gbps("torch"), ".0f")]
                if c.memory_bound else ["", ""])
        inductor_cells = ([fmt_tflops(r.tflops("inductor")),
                           fmt_ratio(r.ratio("torch", "kernel", "inductor")),
                           fmt_ratio(r.ratio("torch", "eager", "inductor"))] if inductor else [])
        rows.append([c.suite, c.display_name, str(c.m), str(c.n), str(c.k), r.dtype,
                     fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     *inductor_cells, *gbps, *_err_cells(r)])
    return Section(title, headers, rows, frozenset({"suite", "name", "dtype", "err vs"}),
                   _gemm_issues(results))


LATENCY_HEADERS = ("name", "M", "N", "K", "dtype", "torch.ops.tgemm.mm us", "tgemm.mm us",
                   "torch.mm us", "op / torch.mm", "tgemm.mm / torch.mm")


def latency_section(results: Sequence[LatencyResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        us = [_fmt(r.host_us.get(impl, math.nan), ".1f")
              for impl in ("torch.ops.tgemm.mm", "tgemm.mm", "torch.mm")]
        rows.append([c.name, str(c.m), str(c.n), str(c.k), r.dtype, *us,
                     fmt_ratio(r.ratio("torch.ops.tgemm.mm")), fmt_ratio(r.ratio("tgemm.mm"))])
    title = ("latency: host time per eager call in us (back-to-back calls, not waiting for the "
             "GPU); ratios are host time over torch.mm's (above 1: more host time); fp8 rows: "
             f"{', '.join(SCALED_LATENCY_NAMES.values())} in those columns "
             "(e4m3, tensorwise scales, bf16 out)")
    return Section(title, LATENCY_HEADERS, rows, frozenset({"name", "dtype"}),
                   _issues((r.label(), r.error, "") for r in results))


GROUPED_HEADERS = ("name", "form", "routing", "G", "T", "N", "K", "tgemm TFLOP/s",
                   "torch TFLOP/s", "loop TFLOP/s", "ratio kernel", "ratio eager",
                   "vs loop kernel", "vs loop eager", "rel err")


def grouped_section(results: Sequence[GemmResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        rows.append([c.name, c.form, c.routing, str(c.groups), str(c.tokens), str(c.n),
                     str(c.k), fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_tflops(r.tflops("loop")), fmt_ratio(r.ratio("torch", "kernel")),
                     fmt_ratio(r.ratio("torch", "eager")), fmt_ratio(r.ratio("loop", "kernel")),
                     fmt_ratio(r.ratio("loop", "eager")), _err_cells(r)[0]])
    title = ("grouped: grouped_mm (bf16) vs torch._grouped_mm (ratio) and a Python loop of "
             "torch.mm (vs loop); rel err vs fp32 products per group (fwd+bwd: of the grads)")
    return Section(title, GROUPED_HEADERS, rows, frozenset({"name", "form", "routing"}),
                   _gemm_issues(results))


SCALED_HEADERS = ("name", "M", "N", "K", "recipe", "accum", "tgemm TFLOP/s", "torch TFLOP/s",
                  "ratio kernel", "ratio eager", "rel err")


def scaled_section(results: Sequence[GemmResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        rows.append([c.name, str(c.m), str(c.n), str(c.k), c.recipe, c.accumulation,
                     fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     _err_cells(r)[0]])
    title = ("scaled: scaled_mm (float8_e4m3fn -> bf16) vs torch._scaled_mm (n/a: this torch "
             "cannot run the recipe), both with the row's accumulation (precise: "
             "use_fast_accum=False); rel err vs the dequantized operands' fp32 product")
    return Section(title, SCALED_HEADERS, rows, frozenset({"name", "recipe", "accum"}),
                   _gemm_issues(results))


SGROUPED_HEADERS = ("name", "proj", "routing", "accum", "G", "T", "N", "K", "tgemm TFLOP/s",
                    "torch TFLOP/s", "ratio kernel", "ratio eager", "rel err", "vs torch")


def _peer_cell(r: GemmResult) -> str:
    """How tgemm's output compares with the peer's: "bitwise" where equal, else the relative
    difference ("n/a" where the peer did not run)."""
    if r.error or r.peer_equal is None:
        return "" if r.error else "n/a"
    return "bitwise" if r.peer_equal else _fmt(r.peer_diff, ".2e")


def sgrouped_section(results: Sequence[GemmResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        rows.append([c.name, c.proj, c.routing, c.accum, str(c.groups), str(c.tokens), str(c.n),
                     str(c.k), fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     _err_cells(r)[0], _peer_cell(r)])
    title = ("sgrouped: scaled_grouped_mm (rowwise float8_e4m3fn -> bf16, 2-D x 3-D, T routed "
             "rows) vs torch._scaled_grouped_mm with the same use_fast_accum (accum: fp32 = "
             "False, fast = True); rel err: worst sampled expert vs the dequantized fp64 "
             "product; vs torch: ||out - torch|| / ||torch||, or bitwise equal")
    return Section(title, SGROUPED_HEADERS, rows,
                   frozenset({"name", "proj", "routing", "accum"}), _gemm_issues(results))


MOE_HEADERS = ("name", "form", "E", "k", "H", "I", "T", "tgemm TFLOP/s", "torch TFLOP/s",
               "ratio kernel", "ratio eager", "tgemm peak MiB", "torch peak MiB",
               "MHz tgemm/torch", "W tgemm/torch", "rel err")


def _pair_cell(values: Mapping[str, float], fmt: str) -> str:
    """tgemm's and torch's value of a per-implementation reading, "a/b"."""
    tgemm, torch = (_fmt(values.get(impl, math.nan), fmt) for impl in ("tgemm", "torch"))
    return f"{tgemm}/{torch}"


def moe_section(results: Sequence[GemmResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        rows.append([c.name, c.form, str(c.experts), str(c.top_k), str(c.hidden), str(c.inter),
                     str(c.tokens), fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     _fmt(r.peak_mib.get("tgemm", math.nan), ".0f"),
                     _fmt(r.peak_mib.get("torch", math.nan), ".0f"), _pair_cell(r.sm_mhz, ".0f"),
                     _pair_cell(r.power_w, ".0f"), _err_cells(r)[0]])
    title = ("moe: moe_mlp (bf16) vs the unfused MoE MLP on torch._grouped_mm (sort, row copy, "
             "gate/up, SwiGLU, down, weighted index_add); peak MiB: memory a call adds; MHz, W: "
             "the median SM clock and power draw while each was timed kernel-only (a GPU at its "
             "power limit lowers its clock); rel err vs the unfused MLP in fp32")
    return Section(title, MOE_HEADERS, rows, frozenset({"name", "form"}), _gemm_issues(results))


E2E_HEADERS = ("model", "plain ms", "override ms", "override/plain", "max loss rel diff")


def e2e_section(result: E2EResult) -> Section:
    row = [result.description, _fmt(result.plain_ms, ".2f"), _fmt(result.override_ms, ".2f"),
           _fmt(result.ratio, ".3f"), _fmt(result.loss_rel_diff, ".2e")]
    title = "e2e: median training step time (override/plain below 1: the override is faster)"
    return Section(title, E2E_HEADERS, [row], frozenset({"model"}), [])


COLDSTART_HEADERS = ("process", "first step s", "vs plain", "later steps ms", "process s",
                     "first loss")


def coldstart_section(results: Sequence[ColdStartResult]) -> Section:
    plain = _plain_first_step(results)
    rows = [[r.run, _fmt(r.first_step_s, ".2f"), fmt_ratio(safe_ratio(r.first_step_s, plain)),
             _fmt(r.later_step_ms, ".1f"), _fmt(r.process_s, ".1f"), _fmt(r.loss, ".4f")]
            for r in results]
    title = ("coldstart: first training step of the drop-in model in fresh processes, one "
             "Triton cache per override level, from empty (vs plain: first-step time ratio)")
    return Section(title, COLDSTART_HEADERS, rows, frozenset({"process"}),
                   _issues((r.run, r.error, "") for r in results))


def _plain_first_step(results: Sequence[ColdStartResult]) -> float:
    return next((r.first_step_s for r in results if r.run == "plain"), math.nan)


def sections(results: RunResults) -> list[Section]:
    """The tables of everything measured, in report order (a planner suite's summaries right
    after its rows)."""
    out = []
    for suite, group in _grouped_by(results.mm, lambda r: r.case.suite).items():
        out.append(mm_section(group, f"mm {suite}"))
        if suite == "sweep":
            out.append(distribution_section(suite, group))
        if suite in suites.PLANNER_SUITES:
            out.append(groups_section(suite, group))
    if results.latency:
        out.append(latency_section(results.latency))
    if results.grouped:
        out.append(grouped_section(results.grouped))
    if results.scaled:
        out.append(scaled_section(results.scaled))
    if results.sgrouped:
        out.append(sgrouped_section(results.sgrouped))
    if results.moe:
        out.append(moe_section(results.moe))
    if results.e2e is not None:
        out.append(e2e_section(results.e2e))
    if results.coldstart:
        out.append(coldstart_section(results.coldstart))
    return out


# --- summary ------------------------------------------------------------------------------------

def geometric_mean(values: Iterable[float]) -> float:
    """Geometric mean of the positive finite values, NaN when there are none."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    if not values:
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


SUMMARY_HEADERS = ("suite", "dtype", "rows", "kernel-only", "eager", "worst row (kernel-only)")


def _worst(results: Sequence[GemmResult], peer: str, impl: str = "tgemm",
           kind: str = "kernel") -> GemmResult | None:
    measured = [r for r in results if math.isfinite(r.ratio(peer, kind, impl))]
    return min(measured, key=lambda r: r.ratio(peer, kind, impl), default=None)


def _summary_row(name: str, dtype: str, results: Sequence[GemmResult],
                 peer: str = "torch", impl: str = "tgemm") -> list[str]:
    """Geometric means of ``impl``'s speed over ``peer``'s; rows without ``impl`` (failed, or
    Inductor could not compile them) count as failed."""
    measured = sum(r.has(impl) for r in results)
    failed = len(results) - measured
    rows = str(measured) + (f" ({failed} failed)" if failed else "")
    worst = _worst(results, peer, impl)
    worst_cell = (f"{worst.case.label()} {fmt_ratio(worst.ratio(peer, 'kernel', impl))}"
                  if worst else "n/a")
    return [name, dtype, rows,
            fmt_ratio(geometric_mean(r.ratio(peer, "kernel", impl) for r in results)),
            fmt_ratio(geometric_mean(r.ratio(peer, "eager", impl) for r in results)), worst_cell]


K = TypeVar("K", bound=Hashable)


def _grouped_by(results: Sequence[GemmResult],
                key: Callable[[GemmResult], K]) -> dict[K, list[GemmResult]]:
    """The results by ``key``, in order of first appearance."""
    groups: dict[K, list[GemmResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return groups


def summary_rows(results: RunResults) -> list[list[str]]:
    """Geometric-mean ratios (tgemm speed / peer speed) per suite and dtype, both timings,
    with each group's worst row."""
    rows = []
    for (suite, dtype), group in _grouped_by(results.mm, lambda r: (r.case.suite, r.dtype)).items():
        rows.append(_summary_row(suite, dtype, group))
        if _with_inductor(group):
            rows.append(_summary_row(f"{suite} inductor", dtype, group, impl="inductor"))
    if results.grouped:
        rows.append(_summary_row("grouped vs torch", "bf16", results.grouped))
        rows.append(_summary_row("grouped vs loop", "bf16", results.grouped, peer="loop"))
    by_recipe = _grouped_by(results.scaled, lambda r: (
        r.case.recipe + (" fast" if r.case.fast else ""), r.dtype))
    rows += [_summary_row(f"scaled {recipe}", dtype, group)
             for (recipe, dtype), group in by_recipe.items()]
    by_accum = _grouped_by(results.sgrouped, lambda r: r.case.accum)
    rows += [_summary_row(f"sgrouped accum={accum}", "fp8", group)
             for accum, group in by_accum.items()]
    if results.moe:
        rows.append(_summary_row("moe vs torch", "bf16", results.moe))
    return rows


def _amount(value: float, spec: str, unit: str) -> str:
    return f"{value:{spec}} {unit}" if math.isfinite(value) else "n/a"


def summary_lines(results: RunResults) -> list[str]:
    """The summary's lines under its table: host latency, e2e, cold start, overall worst row,
    failures and skipped suites."""
    lines = []
    for r in results.latency:
        if not r.error:
            us = {impl: _amount(r.host_us.get(impl, math.nan), ".1f", "us")
                  for impl in ("tgemm.mm", "torch.ops.tgemm.mm", "torch.mm")}
            fn, op, peer = (latency_name(impl, r.dtype)
                            for impl in ("tgemm.mm", "torch.ops.tgemm.mm", "torch.mm"))
            lines.append(
                f"latency {r.case.name} {r.dtype}, host time per call: {fn} {us['tgemm.mm']}"
                f" ({fmt_times(r.ratio('tgemm.mm'))} {peer}), {op} "
                f"{us['torch.ops.tgemm.mm']} ({fmt_times(r.ratio('torch.ops.tgemm.mm'))}), "
                f"{peer} {us['torch.mm']}")
    if results.e2e is not None:
        e = results.e2e
        lines.append(f"e2e: override step {_amount(e.override_ms, '.1f', 'ms')} vs plain "
                     f"{_amount(e.plain_ms, '.1f', 'ms')}: {fmt_times(e.ratio)} the plain time")
    if results.coldstart:
        plain = _plain_first_step(results.coldstart)
        parts = [f"{r.run} {_amount(r.first_step_s, '.2f', 's')}"
                 + ("" if r.run == "plain"
                    else f" ({fmt_times(safe_ratio(r.first_step_s, plain))})")
                 for r in results.coldstart]
        lines.append("coldstart first step: " + ", ".join(parts))
    gemm_rows = [*results.mm, *results.grouped, *results.scaled, *results.sgrouped,
                 *results.moe]
    worst = _worst(gemm_rows, "torch")
    if worst is not None:
        lines.append(f"worst row (kernel-only, vs torch): {worst.label()} "
                     f"{fmt_times(worst.ratio('torch', 'kernel'))}")
    device_built = [r.label() for r in gemm_rows if DEVICE_BUILT_NOTE in r.note]
    if device_built:
        more = f" and {len(device_built) - 3} more" if len(device_built) > 3 else ""
        lines.append(f"{len(device_built)} rows captured launches that {DEVICE_BUILT_NOTE} "
                     f"(slower replays): {', '.join(device_built[:3])}{more}")
    failed = sum(bool(r.error) for r in (*gemm_rows, *results.latency, *results.coldstart))
    if failed:
        lines.append(f"{failed} rows failed: see the ERROR lines under the tables")
    lines += results.notes
    return lines


LEGEND = (
    "ratio = tgemm speed / peer speed, above 1: tgemm faster; kernel = CUDA-graph replays "
    "(GPU time alone), eager = back-to-back eager calls (host cost included)",
    "TFLOP/s and GB/s are kernel-only; GB/s = (M*K + K*N + M*N) * bytes / time, on "
    "memory-bound rows",
    "rel err = ||out - ref|| / ||ref|| against: fp64, a float64 product; torch, torch.mm's "
    "output (agreement, not error); fp32, fp32 products; fp32 deq (fp64 deq), the "
    "dequantized product in fp32 (fp64)",
    "inductor (--inductor): torch.mm compiled by Inductor with Triton GEMM templates only; "
    "its ratios are Inductor speed / torch speed",
)


def summary(results: RunResults, markdown: bool = False) -> str:
    """The short summary printed last: a table of geometric means, then single lines."""
    title = ("summary: geometric mean of tgemm speed / peer speed (above 1: tgemm faster), "
             "kernel-only and eager")
    rows = summary_rows(results)
    lines = summary_lines(results)
    table = Section(title, SUMMARY_HEADERS, rows, frozenset({"suite", "dtype", "rows",
                                                            "worst row (kernel-only)"}), lines)
    return table.render(markdown) if rows else "\n".join([title.split(":")[0] + ":", *lines])


# --- planner suites: distributions, and geometric means by class and size ----------------------

# (upper bound of M*N*K, label) of the size bands, smallest first.
SIZE_BANDS = ((1e7, "MNK < 1e7"), (1e9, "MNK 1e7-1e9"), (1e11, "MNK 1e9-1e11"),
              (math.inf, "MNK >= 1e11"))


def size_band(case: suites.Case) -> str:
    """The SIZE_BANDS label of a case's M*N*K."""
    volume = case.m * case.n * case.k
    return next(label for bound, label in SIZE_BANDS if volume < bound)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolating linearly between the
    closest ranks (numpy's default); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class RatioStats:
    """How a set of speed ratios is spread; ``below`` maps a threshold to the share under it."""

    count: int
    geomean: float
    p5: float
    median: float
    minimum: float
    below: dict[float, float]


LOW_RATIOS = (0.9, 0.5)  # thresholds the distribution table counts the shares below


def ratio_stats(values: Iterable[float]) -> RatioStats:
    """Statistics of the positive finite ``values`` (the others were not measured)."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    below = {t: (sum(v < t for v in values) / len(values) if values else math.nan)
             for t in LOW_RATIOS}
    return RatioStats(len(values), geometric_mean(values), percentile(values, 5),
                      percentile(values, 50), min(values, default=math.nan), below)


def _peer_columns(results: Sequence[GemmResult]) -> list[tuple[str, str]]:
    """(impl, kind) pairs whose speed / torch speed the planner tables show."""
    impls = ("tgemm", "inductor") if _with_inductor(results) else ("tgemm",)
    return [(impl, kind) for impl in impls for kind in ("kernel", "eager")]


DISTRIBUTION_HEADERS = ("dtype", "impl", "timing", "rows", "geomean", "p5", "median", "min",
                        *(f"< {t:g}" for t in LOW_RATIOS), "worst shape")


def distribution_section(suite: str, results: Sequence[GemmResult]) -> Section:
    """Per dtype, implementation and timing: how the speed ratios to torch spread, and the
    shape of the smallest."""
    rows = []
    for dtype, group in _grouped_by(results, lambda r: r.dtype).items():
        for impl, kind in _peer_columns(results):
            stats = ratio_stats(r.ratio("torch", kind, impl) for r in group)
            worst = _worst(group, "torch", impl, kind)
            share = [_fmt(100 * stats.below[t], ".1f") + "%" if stats.count else "n/a"
                     for t in LOW_RATIOS]
            rows.append([dtype, impl, kind, str(stats.count), fmt_ratio(stats.geomean),
                         fmt_ratio(stats.p5), fmt_ratio(stats.median), fmt_ratio(stats.minimum),
                         *share, worst.case.display_name if worst else "n/a"])
    title = (f"{suite}: speed / torch speed (above 1: faster than cuBLAS) over "
             f"{len({r.case for r in results})} shapes")
    footer = ["names: a-col = a is a [K, M] tensor transposed; b-row = b is a row-major [K, N] "
              "tensor; a-padP, b-padP = the operand is sliced from a buffer P columns wider"]
    return Section(title, DISTRIBUTION_HEADERS, rows,
                   frozenset({"dtype", "impl", "timing", "worst shape"}), footer)


def _groups(suite: str, results: Sequence[GemmResult]) -> list[tuple[str, list[GemmResult]]]:
    """The sweep's rows by size class, then by size band; other suites' by shape class."""
    by_class = _grouped_by(results, lambda r: r.case.shape_class)
    if suite != "sweep":
        return list(by_class.items())
    by_band = _grouped_by(results, lambda r: size_band(r.case))
    return ([(name, by_class[name]) for name in suites.SIZE_CLASSES if name in by_class]
            + [(label, by_band[label]) for _, label in SIZE_BANDS if label in by_band])


def groups_section(suite: str, results: Sequence[GemmResult]) -> Section:
    """Geometric means of the speed ratios to torch per dtype and group of shapes."""
    columns = _peer_columns(results)
    headers = ("dtype", "group", "rows", *(f"{impl} {kind}" for impl, kind in columns))
    rows = []
    for dtype, by_dtype in _grouped_by(results, lambda r: r.dtype).items():
        for name, group in _groups(suite, by_dtype):
            rows.append([dtype, name, str(sum(not r.error for r in group)),
                         *(fmt_ratio(geometric_mean(r.ratio("torch", kind, impl) for r in group))
                           for impl, kind in columns)])
    what = "size class and M*N*K band" if suite == "sweep" else "class"
    title = f"{suite}: geometric mean of speed / torch speed by {what}"
    return Section(title, headers, rows, frozenset({"dtype", "group"}), [])


# --- files --------------------------------------------------------------------------------------

def write_csv(path: str, records: Sequence[dict[str, object]]) -> None:
    """Every row, full precision; columns are the union of the rows' fields, in order of first
    appearance (a field a row lacks is left empty). Written beside ``path`` and moved over it,
    so that a run stopped while writing leaves the previous file whole."""
    fields: dict[str, None] = {}
    for record in records:
        fields.update(dict.fromkeys(record))
    partial = f"{path}.partial"
    with open(partial, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), restval="")
        writer.writeheader()
        writer.writerows(records)
    os.replace(partial, path)


def markdown_report(header: Sequence[str], results: RunResults) -> str:
    """The whole report as one markdown document: header lines, every table, the summary."""
    parts = ["# torch_triton_gemm benchmark", "\n".join(f"- {line}" for line in header)]
    parts += [s.render(markdown=True) for s in sections(results)]
    parts.append(summary(results, markdown=True))
    return "\n\n".join(parts) + "\n"


NO_MATPLOTLIB = ('--plot needs matplotlib, which is not installed: pip install '
                 '"torch-triton-gemm[bench]" (or pip install matplotlib). No plot is written.')


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (checked before a long run, imported only to plot)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> ModuleType | None:
    """matplotlib.pyplot drawing to files, or None (with a message on stderr) without it."""
    try:
        import matplotlib
    except ImportError:
        print(NO_MATPLOTLIB, file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _plot_input(results: Sequence[GemmResult]) -> tuple[list[GemmResult], Any, list[str]] | None:
    """The measured rows, pyplot and the dtypes (one panel each) of a plot; None when nothing
    was measured or matplotlib is missing (said on stderr)."""
    measured = [r for r in results if not r.error]
    if not measured:
        return None
    plt = _pyplot()
    if plt is None:
        return None
    return measured, plt, list(dict.fromkeys(r.dtype for r in measured))


def write_plot(path: str, results: Sequence[GemmResult]) -> bool:
    """Bar chart of tgemm vs torch kernel-only TFLOP/s per mm row, one panel per dtype; False
    (with a message on stderr) when matplotlib is missing or nothing was measured."""
    ready = _plot_input(results)
    if ready is None:
        return False
    results, plt, dtype_names = ready
    widest = max(sum(r.dtype == d for r in results) for d in dtype_names)
    fig, axes = plt.subplots(len(dtype_names), 1, squeeze=False,
                             figsize=(max(8.0, 0.4 * widest + 2), 4.5 * len(dtype_names)))
    bar = 0.4
    for ax, dtype_name in zip(axes[:, 0], dtype_names, strict=True):
        rows = [r for r in results if r.dtype == dtype_name]
        x = range(len(rows))
        ax.bar([i - bar / 2 for i in x], [r.tflops("tgemm") for r in rows], bar, label="tgemm")
        ax.bar([i + bar / 2 for i in x], [r.tflops("torch") for r in rows], bar,
               label="torch (cuBLAS)")
        ax.set_xticks(list(x))
        ax.set_xticklabels([r.case.label() for r in rows], rotation=90, fontsize=8)
        # Log scale: decode rows (a few TFLOP/s) stay readable next to the large GEMMs.
        ax.set_yscale("log")
        ax.set_ylabel("TFLOP/s, kernel-only (log scale)")
        ax.set_title(f"tgemm vs torch.mm, {dtype_name}")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_ratio_plot(path: str, results: Sequence[GemmResult]) -> bool:
    """Scatter plot of speed / torch speed against M*N*K (both log scales), kernel-only and
    eager (and Inductor's where it ran), one panel per dtype, for the sweep's many shapes;
    False (with a message on stderr) when matplotlib is missing or nothing was measured."""
    ready = _plot_input(results)
    if ready is None:
        return False
    results, plt, dtype_names = ready
    fig, axes = plt.subplots(len(dtype_names), 1, squeeze=False,
                             figsize=(9.0, 5.0 * len(dtype_names)))
    markers = {("tgemm", "kernel"): "o", ("tgemm", "eager"): "x", ("inductor", "kernel"): "^",
               ("inductor", "eager"): "+"}
    for ax, dtype_name in zip(axes[:, 0], dtype_names, strict=True):
        rows = [r for r in results if r.dtype == dtype_name]
        for impl, kind in _peer_columns(rows):
            points = [(r.case.m * r.case.n * r.case.k, r.ratio("torch", kind, impl))
                      for r in rows]
            points = [(x, y) for x, y in points if math.isfinite(y) and y > 0]
            ax.scatter([x for x, _ in points], [y for _, y in points], s=12, alpha=0.6,
                       marker=markers[impl, kind], label=f"{impl}, {kind}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")  # 0.5x and 2x equally far from 1
        ax.set_xlabel("M*N*K")
        ax.set_ylabel("speed / torch (cuBLAS) speed")
        ax.set_title(f"{rows[0].case.suite}: speed / cuBLAS speed, {dtype_name} "
                     "(above 1: faster)")
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
