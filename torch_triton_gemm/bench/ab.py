"""A planner rule's held-out A/B over many seeds: the cases the rule moves on each seed's
sweep (bench.picks: the plan model's picks with an H100's numbers, one arm against the
other), then both arms' picks of all of them timed on this GPU (bench.plans --chosen-only,
one process an arm); then bench.compare's report of the two arms.

    python -m torch_triton_gemm.bench.ab --portable-copies --seeds 3000-3039 --csv ab.csv

The flag is one of bench.plans' rule flags of the plan model (bench.picks models no other
rule: time those with bench.plans --chosen-only on both arms): its arm plans as the flag
says, the other ("default") as the planner does. ``--csv ab.csv`` gets both arms' rows
with ``seed`` and ``arm`` columns; ``ab-portable-copies.csv`` and ``ab-default.csv`` each
arm's, as bench.plans writes them (with ``seed``), for ``python -m
torch_triton_gemm.bench.compare``; ``ab-moved.csv`` the moved cases (with ``seed``). The
report's speed-up is the flag's arm's time over the default's (above 1: the default faster).

Listing the moved cases needs no GPU (bench.picks is arithmetic: a few seconds a seed and
arm), so ``--moved-only`` stops after writing them, and ``--moved ab-moved.csv`` on the GPU
host times that list without listing again. Each arm's timing starts a pool of compile
processes (about 30 s on an H200's host), once per arm however many seeds; bench.plans
writes each case's rows as it finishes, and a run cut short keeps what both arms timed.
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
from .plans import seeds_of


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
    parser.add_argument("--seeds", type=seeds_of, metavar="SEEDS",
                        help="sweep seeds: 3000-3007, or comma-separated")
    parser.add_argument("--count", type=int, default=400, help="shapes per seed's sweep")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    parser.add_argument("--csv", required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--moved-only", action="store_true",
                        help="write the moved cases (any host) and stop")
    source.add_argument("--moved", metavar="CSV",
                        help="time these moved cases (an earlier --moved-only run's) instead "
                             "of listing them")
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
    if args.moved is None and args.seeds is None:
        parser.error("give --seeds (or --moved, a list of moved cases)")
    root, ext = os.path.splitext(args.csv)
    ext = ext or ".csv"
    if args.moved is not None:
        moved_path, moved = args.moved, _read(args.moved)
        # The sweeps the list was drawn from (their size decides which cases they hold).
        count = next((int(row["count"]) for row in moved if row.get("count")), args.count)
    else:
        count = args.count
        moved_path = f"{root}-moved{ext}"
        moved = moved_cases(args.seeds, count, args.dtypes, flag)
        _write(moved_path, list(moved[0]) if moved else ["seed"], moved)
        print(f"{len(moved)} moved cases written to {moved_path}", file=sys.stderr)
        if args.moved_only:
            return 0
    if not moved:
        print("the rule moves no pick", file=sys.stderr)
        return 0
    common = ["--count", str(count), "--dtypes", args.dtypes]
    # The seed each case was first listed under, for the timed rows.
    seed_of = {plans.row_key(row): row["seed"] for row in reversed(moved)}
    seeds = ",".join(dict.fromkeys(row["seed"] for row in moved))
    arms: dict[str, list[dict[str, str]]] = {flag: [], "default": []}
    paths = {arm: f"{root}-{arm.lstrip('-')}{ext}" for arm in arms}
    with tempfile.TemporaryDirectory() as scratch:
        timed = {arm: os.path.join(scratch, f"timed-{index}.csv")
                 for index, arm in enumerate(arms)}
        try:
            for arm, extra in ((flag, [flag]), ("default", [])):
                isolated(plans.main, ["--chosen-only", "--suites", "sweep", "--seed", seeds,
                                      *common, "--cases", moved_path, "--csv", timed[arm],
                                      *extra])
        finally:  # what both arms timed, also of a run cut short
            for arm in arms:
                arms[arm] = [{"seed": seed_of.get(plans.row_key(row), ""), **row}
                             for row in _read(timed[arm])]
            _write_arms(args.csv, paths, arms)
    print(f"{sum(map(len, arms.values()))} rows written to {args.csv}, each arm's to "
          f"{paths[flag]} and {paths['default']}")
    print(compare.compare(paths[flag], paths["default"]))
    return 0


def moved_cases(seeds: Sequence[int], count: int, dtypes: str, flag: str
                ) -> list[dict[str, str]]:
    """The cases of each of ``seeds``' sweeps of ``count`` shapes in ``dtypes`` whose plan
    ``flag`` changes (bench.picks), with ``seed`` and ``count`` columns; seeds whose listing
    fails are reported and left out."""
    moved: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            seeded = ["--seed", str(seed), "--count", str(count), "--dtypes", dtypes]
            other = os.path.join(scratch, f"picks-{seed}.csv")
            path = os.path.join(scratch, f"moved-{seed}.csv")
            if (isolated(picks.main, [*seeded, "--csv", other, flag])
                    and isolated(picks.main, [*seeded, "--csv", path, "--against", other])):
                moved += [{"seed": str(seed), "count": str(count), **row}
                          for row in _read(path)]
    return moved


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
