"""A planner rule's held-out A/B, every seed in one process: the cases the rule moves on each
seed's sweep (bench.picks: the plan model's picks with an H100's numbers, one arm against
the other) and both arms' picks timed on this GPU (bench.plans --chosen-only); then
bench.compare's report of the two arms.

    python -m torch_triton_gemm.bench.ab --portable-copies --seeds 3000-3007 --csv ab.csv

The flag is one of bench.plans' rule flags of the plan model (bench.picks models no other
rule: time those with bench.plans --chosen-only on both arms): its arm plans as the flag
says, the other ("default") as the planner does. ``--csv ab.csv`` gets both arms' rows
with ``seed`` and ``arm`` columns; ``ab-portable-copies.csv`` and ``ab-default.csv`` each
arm's, as bench.plans writes them (with ``seed``), for ``python -m
torch_triton_gemm.bench.compare``. The report's speed-up is the flag's arm's time over the
default's (above 1: the default faster). One process for every seed saves a start and the
compile of kernels the seeds share (about 10 s a seed on an H200's host); each seed's rows
are written as soon as both its arms are timed, so a run cut short keeps the seeds it
finished. Each arm's timing starts a pool of compile processes: about 30 s an arm, a minute
a seed, on a fresh H200 machine, however few its cases.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

from .. import plan_model
from ..ops import launcher, planner
from . import compare, picks, plans


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
    planner.forget_plans()
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
        planner.forget_plans()
        launcher.forget_eager_calls()


def _read(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


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
    module = next(module for name, module, *_ in plans.RULE_FLAGS if name == flag)
    if module is not plan_model:
        # bench.picks lists the plan model's picks only: this rule would move none.
        parser.error(f"{flag} is not a plan model rule, so bench.picks moves no case with it: "
                     f"time its arms with python -m torch_triton_gemm.bench.plans "
                     f"--chosen-only [{flag}] --shapes ...")
    common = ["--count", str(args.count), "--dtypes", args.dtypes]
    arms: dict[str, list[dict[str, str]]] = {flag: [], "default": []}
    root, ext = os.path.splitext(args.csv)
    paths = {arm: f"{root}-{arm.lstrip('-')}{ext or '.csv'}" for arm in arms}
    _write_arms(args.csv, paths, arms)
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
                arms[arm] += [{"seed": str(seed), **row} for row in _read(timed)]
            # Each seed's rows as soon as both arms are timed: a run cut short keeps them.
            _write_arms(args.csv, paths, arms)
    print(f"{sum(map(len, arms.values()))} rows written to {args.csv}, each arm's to "
          f"{paths[flag]} and {paths['default']}")
    print(compare.compare(paths[flag], paths["default"]))
    return 0


def _write_arms(path: str, paths: dict[str, str], arms: dict[str, list[dict[str, str]]]
                ) -> None:
    """Both arms' rows into ``path`` (with ``arm``), each arm's into its own of ``paths``."""
    _write(path, ["seed", "arm", *plans.FIELDS],
           [{"arm": arm, **row} for arm, rows in arms.items() for row in rows])
    for arm, rows in arms.items():
        _write(paths[arm], ["seed", *plans.FIELDS], rows)


def _write(path: str, fields: list[str], rows: list[dict[str, str]]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
