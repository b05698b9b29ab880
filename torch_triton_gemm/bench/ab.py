"""A planner rule's held-out A/B, every seed in one process: the cases the rule moves on each
seed's sweep (bench.picks: the plan model's picks with an H100's numbers, one arm against
the other) and both arms' picks timed on this GPU (bench.plans --chosen-only), into one CSV
with ``seed`` and ``arm`` columns; then the rule's speedup over the moved cases.

    python -m torch_triton_gemm.bench.ab --portable-copies --seeds 3000-3007 --csv ab.csv

The flag is one of bench.plans' rule flags: its arm plans as the flag says, the other
("default") as the planner does. The speedup of a case is its time on the flag's arm over its
time on the default arm (above 1: the default faster); printed are their geometric mean, how
many are above 1 and the lowest. One process for every seed saves a start and the compile of
kernels the seeds share (about 10 s a seed on an H200's host).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

from ..ops import launcher, planner
from . import picks, plans


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


def isolated(entry: Callable[[list[str]], int], argv: list[str]) -> bool:
    """Run a benchmark entry point (bench.picks or bench.plans ``main``) on ``argv`` as its own
    process would: the rule constants it may set restored afterwards, and the planner's and
    the eager calls' memos (keyed without those constants) emptied before and after. Whether
    it ran to the end (a failure is printed; the A/B goes on with the other seeds)."""
    saved = [(module, name, getattr(module, name)) for _, module, name, _, _ in plans.RULE_FLAGS]
    planner._PLANS.clear()
    launcher.forget_eager_calls()
    try:
        return entry(argv) == 0
    except SystemExit as exit_:
        return exit_.code in (0, None)
    except Exception as error:  # reported; the other seeds still run
        print(f"bench.ab: {' '.join(argv)}: {type(error).__name__}: {error}", file=sys.stderr)
        return False
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        planner._PLANS.clear()
        launcher.forget_eager_calls()


def _read(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def speedups(rows: Sequence[dict[str, str]], flag: str) -> list[tuple[float, str]]:
    """Per case timed on both arms (same seed, name and dtype): time on ``flag``'s arm over
    time on the default arm, and the case ("seed name dtype")."""
    times: dict[tuple[str, str, str], dict[str, float]] = {}
    for row in rows:
        if row.get("us"):
            key = (row["seed"], row["name"], row["dtype"])
            times.setdefault(key, {})[row["arm"]] = float(row["us"])
    return [(arms[flag] / arms["default"], " ".join(key)) for key, arms in times.items()
            if flag in arms and "default" in arms and arms["default"] > 0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.ab",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=seeds_of, required=True, metavar="SEEDS",
                        help="sweep seeds: 3000-3007, or comma-separated")
    parser.add_argument("--count", type=int, default=400, help="shapes per seed's sweep")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    parser.add_argument("--csv", required=True)
    plans.add_rule_flags(parser, " (the A/B's other arm; give exactly one)")
    args = parser.parse_args(argv)
    chosen = [flag for flag, *_ in plans.RULE_FLAGS
              if getattr(args, flag.lstrip("-").replace("-", "_"))]
    if len(chosen) != 1:
        parser.error(f"give one rule flag, not {len(chosen)}")
    flag = chosen[0]
    common = ["--count", str(args.count), "--dtypes", args.dtypes]
    rows: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            seeded = ["--seed", str(seed), *common]
            other = os.path.join(scratch, f"picks-{seed}.csv")
            moved = os.path.join(scratch, f"moved-{seed}.csv")
            if not (isolated(picks.main, [*seeded, "--csv", other, flag])
                    and isolated(picks.main, [*seeded, "--csv", moved, "--against", other])):
                continue
            if not _read(moved):
                print(f"seed {seed}: the rule moves no pick", file=sys.stderr)
                continue
            for arm, extra in ((flag, [flag]), ("default", [])):
                timed = os.path.join(scratch, f"timed-{seed}-{len(extra)}.csv")
                isolated(plans.main, ["--chosen-only", "--suites", "sweep", *seeded,
                                      "--cases", moved, "--csv", timed, *extra])
                rows += [{"seed": str(seed), "arm": arm, **row} for row in _read(timed)]
    fields = ["seed", "arm", *plans.FIELDS]
    with open(args.csv, "w", newline="") as file:
        writer = csv.DictWriter(file, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    ratios = speedups(rows, flag)
    if not ratios:
        print(f"{len(rows)} rows written to {args.csv}; no case timed on both arms")
        return 0
    geomean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
    low, case = min(ratios)
    print(f"{len(rows)} rows written to {args.csv}. {len(ratios)} cases on both arms: the "
          f"default arm {geomean:.3f}x as fast as {flag}'s in geomean, faster on "
          f"{sum(r > 1 for r, _ in ratios)}; lowest {low:.3f}x ({case})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
