"""A planner change's same-run A/B, read from two ``bench.plans --chosen-only`` CSVs.

    python -m torch_triton_gemm.bench.compare base.csv new.csv [--by rows] [--worst 5]

Each CSV holds the planner's pick per case (one arm each: e.g. ``--untransposed`` for the base,
nothing for the new). Cases are matched on their shape, layout, recipe, accumulation and dtype.
Reported: how many cases the change moved to another plan, their speed-up (base time over new
time; above 1: the change is faster) as a geometric mean with its worst and best cases, their
ratio to the peer (cuBLAS or torch._scaled_mm) before and after, and the same speed-up for the
cases whose plan did not change: a drift between the two arms' runs, which ought to read 1.00,
and against which the moved cases' figure is to be judged. ``--by`` splits the moved cases by a
CSV column or by ``rows`` (M: 1, 2-8, 9-16, 17-32, 33-128, more). Needs no GPU.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterable, Sequence

from .plans import PLAN_COLUMNS
from .report import format_table, geometric_mean

# The columns that name a case (bench.plans' CSV), where present; its plan's: PLAN_COLUMNS.
CASE_COLUMNS = ("name", "M", "N", "K", "a_layout", "b_layout", "a_pad", "b_pad", "recipe",
                "accum", "dtype")
ROW_BUCKETS = ((1, "1"), (8, "2-8"), (16, "9-16"), (32, "17-32"), (128, "33-128"))


def read_picks(path: str) -> dict[tuple[str, ...], dict[str, str]]:
    """The planner's pick per case of a bench.plans CSV (its ``heuristic`` rows; every row of a
    ``--chosen-only`` run), keyed by ``CASE_COLUMNS``; rows that failed are left out."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    picks = {}
    for row in rows:
        if row.get("heuristic", "True") != "True" or row.get("error") or not row.get("us"):
            continue
        picks[tuple(row.get(column, "") for column in CASE_COLUMNS)] = row
    return picks


def rows_bucket(m: int) -> str:
    """The row-count bucket of a product of ``m`` rows."""
    return next((label for top, label in ROW_BUCKETS if m <= top), "129+")


def _speedup(base: dict[str, str], new: dict[str, str]) -> float:
    return float(base["us"]) / float(new["us"])


def _plan(row: dict[str, str]) -> tuple[str, ...]:
    return tuple(row.get(column, "") for column in PLAN_COLUMNS)


def _line(label: str, pairs: Sequence[tuple[dict[str, str], dict[str, str]]]) -> list[str]:
    speedups = [_speedup(b, n) for b, n in pairs]
    if not speedups:
        return [label, "0", "", "", "", ""]
    peer_before = geometric_mean(float(b["ratio"]) for b, _ in pairs)
    peer_after = geometric_mean(float(n["ratio"]) for _, n in pairs)
    return [label, str(len(pairs)), f"{geometric_mean(speedups):.3f}",
            f"{min(speedups):.3f}", f"{max(speedups):.3f}",
            f"{peer_before:.3f} -> {peer_after:.3f}"]


def _group(pairs: Iterable[tuple[dict[str, str], dict[str, str]]], by: str
           ) -> dict[str, list[tuple[dict[str, str], dict[str, str]]]]:
    groups: dict[str, list[tuple[dict[str, str], dict[str, str]]]] = {}
    for base, new in pairs:
        key = rows_bucket(int(new["M"])) if by == "rows" else new.get(by, "")
        groups.setdefault(key, []).append((base, new))
    return groups


def compare(base_path: str, new_path: str, by: str | None = None, worst: int = 5) -> str:
    """The report of ``base_path`` against ``new_path`` (see the module's docstring)."""
    base, new = read_picks(base_path), read_picks(new_path)
    matched = [(base[key], new[key]) for key in base if key in new]
    moved = [(b, n) for b, n in matched if _plan(b) != _plan(n)]
    kept = [(b, n) for b, n in matched if _plan(b) == _plan(n)]
    headers = ["cases", "count", "speed-up", "worst", "best", "ratio to the peer"]
    table = [_line("plan changed", moved), _line("plan kept (drift)", kept)]
    if by is not None:
        order = [label for _, label in ROW_BUCKETS] + ["129+"]
        for key, pairs in sorted(_group(moved, by).items(), key=lambda item: (
                order.index(item[0]) if by == "rows" else 0, item[0])):
            table.append(_line(f"  changed, {by} {key}", pairs))
    lines = [f"{len(matched)} cases in both ({len(base)} in {base_path}, {len(new)} in "
             f"{new_path}); speed-up = base time / new time", format_table(headers, table)]
    if moved and worst > 0:
        lines.append(f"slowest {min(worst, len(moved))} changed cases (base us -> new us):")
        for b, n in sorted(moved, key=lambda pair: _speedup(*pair))[:worst]:
            label = " ".join(x for x in (n["name"], n.get("recipe", ""), n.get("accum", ""),
                                         n.get("dtype", "")) if x)
            lines.append(f"  {label}: {b['us']} -> {n['us']} ({_speedup(b, n):.3f}x)")
    if not matched:
        lines.append("no case timed in both files")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.compare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the base arm's bench.plans CSV")
    parser.add_argument("new", help="the new arm's bench.plans CSV")
    parser.add_argument("--by", default=None,
                        help="split the changed cases by this CSV column, or by rows (M)")
    parser.add_argument("--worst", type=int, default=5,
                        help="list this many of the slowest changed cases (default: 5)")
    args = parser.parse_args(argv)
    print(compare(args.base, args.new, args.by, args.worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
