"""How results are shown: plain-text and markdown tables, the summary, CSV, and a PNG plot.

Nothing here needs a GPU, and matplotlib is imported only when a plot is written (it is an
optional dependency: ``pip install "torch-triton-gemm[bench]"``).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .results import (
    ColdStartResult,
    E2EResult,
    GemmResult,
    LatencyResult,
    RunResults,
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


def mm_section(results: Sequence[GemmResult], title: str = "mm") -> Section:
    rows = []
    for r in results:
        c = r.case
        gbps = ([_fmt(r.gbps("tgemm"), ".0f"), _fmt(r.gbps("torch"), ".0f")]
                if c.memory_bound else ["", ""])
        rows.append([c.suite, c.name, str(c.m), str(c.n), str(c.k), r.dtype,
                     fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     *gbps, *_err_cells(r)])
    return Section(title, MM_HEADERS, rows, frozenset({"suite", "name", "dtype", "err vs"}),
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
             "GPU); ratios are host time over torch.mm's (above 1: more host time)")
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


SCALED_HEADERS = ("name", "M", "N", "K", "recipe", "tgemm TFLOP/s", "torch TFLOP/s",
                  "ratio kernel", "ratio eager", "rel err")


def scaled_section(results: Sequence[GemmResult]) -> Section:
    rows = []
    for r in results:
        c = r.case
        rows.append([c.name, str(c.m), str(c.n), str(c.k), c.recipe,
                     fmt_tflops(r.tflops("tgemm")), fmt_tflops(r.tflops("torch")),
                     fmt_ratio(r.ratio("torch", "kernel")), fmt_ratio(r.ratio("torch", "eager")),
                     _err_cells(r)[0]])
    title = ("scaled: scaled_mm (float8_e4m3fn -> bf16) vs torch._scaled_mm (n/a: this torch "
             "cannot run the recipe); rel err vs the dequantized operands' fp32 product")
    return Section(title, SCALED_HEADERS, rows, frozenset({"name", "recipe"}),
                   _gemm_issues(results))


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
             "Triton cache shared from empty (vs plain: first-step time ratio)")
    return Section(title, COLDSTART_HEADERS, rows, frozenset({"process"}),
                   _issues((r.run, r.error, "") for r in results))


def _plain_first_step(results: Sequence[ColdStartResult]) -> float:
    return next((r.first_step_s for r in results if r.run == "plain"), math.nan)


def sections(results: RunResults) -> list[Section]:
    """The tables of everything measured, in report order."""
    out = [mm_section(group, f"mm {suite}") for (suite, _), group
           in _grouped_by(results.mm, lambda r: (r.case.suite, "")).items()]
    if results.latency:
        out.append(latency_section(results.latency))
    if results.grouped:
        out.append(grouped_section(results.grouped))
    if results.scaled:
        out.append(scaled_section(results.scaled))
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


def _worst(results: Sequence[GemmResult], peer: str) -> GemmResult | None:
    measured = [r for r in results if math.isfinite(r.ratio(peer, "kernel"))]
    return min(measured, key=lambda r: r.ratio(peer, "kernel"), default=None)


def _summary_row(name: str, dtype: str, results: Sequence[GemmResult],
                 peer: str = "torch") -> list[str]:
    failed = sum(bool(r.error) for r in results)
    rows = str(len(results) - failed) + (f" ({failed} failed)" if failed else "")
    worst = _worst(results, peer)
    worst_cell = (f"{worst.case.label()} {fmt_ratio(worst.ratio(peer, 'kernel'))}"
                  if worst else "n/a")
    return [name, dtype, rows,
            fmt_ratio(geometric_mean(r.ratio(peer, "kernel") for r in results)),
            fmt_ratio(geometric_mean(r.ratio(peer, "eager") for r in results)), worst_cell]


def _grouped_by(results: Sequence[GemmResult],
                key: Callable[[GemmResult], tuple[str, str]]) -> dict[tuple[str, str], list]:
    groups: dict[tuple[str, str], list[GemmResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return groups


def summary_rows(results: RunResults) -> list[list[str]]:
    """Geometric-mean ratios (tgemm speed / peer speed) per suite and dtype, both timings,
    with each group's worst row."""
    rows = [_summary_row(suite, dtype, group) for (suite, dtype), group
            in _grouped_by(results.mm, lambda r: (r.case.suite, r.dtype)).items()]
    if results.grouped:
        rows.append(_summary_row("grouped vs torch", "bf16", results.grouped))
        rows.append(_summary_row("grouped vs loop", "bf16", results.grouped, peer="loop"))
    by_recipe = _grouped_by(results.scaled, lambda r: (r.case.recipe, r.dtype))
    rows += [_summary_row(f"scaled {recipe}", dtype, group)
             for (recipe, dtype), group in by_recipe.items()]
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
            lines.append(
                f"latency {r.case.name} {r.dtype}, host time per call: tgemm.mm {us['tgemm.mm']}"
                f" ({fmt_times(r.ratio('tgemm.mm'))} torch.mm), torch.ops.tgemm.mm "
                f"{us['torch.ops.tgemm.mm']} ({fmt_times(r.ratio('torch.ops.tgemm.mm'))}), "
                f"torch.mm {us['torch.mm']}")
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
    gemm_rows = [*results.mm, *results.grouped, *results.scaled]
    worst = _worst(gemm_rows, "torch")
    if worst is not None:
        lines.append(f"worst row (kernel-only, vs torch): {worst.label()} "
                     f"{fmt_times(worst.ratio('torch', 'kernel'))}")
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
    "output (agreement, not error); fp32, fp32 products; fp32 deq, the dequantized product",
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


# --- files --------------------------------------------------------------------------------------

def write_csv(path: str, records: Sequence[dict[str, object]]) -> None:
    """Every row, full precision; columns are the union of the rows' fields, in order of first
    appearance (a field a row lacks is left empty)."""
    fields: dict[str, None] = {}
    for record in records:
        fields.update(dict.fromkeys(record))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), restval="")
        writer.writeheader()
        writer.writerows(records)


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


def write_plot(path: str, results: Sequence[GemmResult]) -> bool:
    """Bar chart of tgemm vs torch kernel-only TFLOP/s per mm row, one panel per dtype; False
    (with a message on stderr) when matplotlib is missing or nothing was measured."""
    results = [r for r in results if not r.error]
    if not results:
        return False
    try:
        import matplotlib
    except ImportError:
        print(NO_MATPLOTLIB, file=sys.stderr)
        return False
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    dtype_names = list(dict.fromkeys(r.dtype for r in results))
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
