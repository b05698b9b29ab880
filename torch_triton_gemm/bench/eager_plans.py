"""Eager plans (on unless ``TORCH_TRITON_GEMM_EAGER_PLANS=0``) against the planner's plan, on a
GPU: the products of a seeded sweep (or mm suites) whose eager plan differs, each timed eager and
kernel-only (CUDA-graph replays) next to torch.mm, both settings in one process, alternating.

    python -m torch_triton_gemm.bench.eager_plans --seed 2112 --count 300 --csv eager.csv

``--planned tma`` keeps the products whose planner's plan runs the persistent TMA kernel (the
rule that moves them: ``plan_model.portable_twin``), ``--planned portable`` those on the
portable kernel (its K splits in one launch, its operands read unpadded).

Each product's two settings are timed ``--reps`` times in alternating order (the memoised eager
calls forgotten between them, so that each setting plans its calls afresh), which keeps the
host's drift between processes out of the comparison. One CSV row per product, dtype,
repetition and setting (``eager_plans`` 0 or 1): the planner's plan and the eager one, tgemm's
and torch.mm's microseconds per call eager and kernel-only, the relative error against a
float64 product, and whether the settings gave the same bits (``same_bits``: captures launch
the planner's plan in both, and an eager plan is that plan in one launch, so it should hold).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import torch

from .. import tuning
from ..ops import launcher
from ..ops.planner import eager_mm_plan, plan_mm
from . import suites
from .gemm import DTYPES, make_operands
from .picks import parsed_cases, plan_name
from .suites import Case
from .timing import TimingSettings, compare, settle

FIELDS = ("suite", "name", "dtype", "M", "N", "K", "a_layout", "b_layout", "a_pad", "b_pad",
          "plan", "eager_plan", "rep", "eager_plans", "tgemm_eager_us", "torch_eager_us",
          "tgemm_kernel_us", "torch_kernel_us", "rel_err", "same_bits")


@contextlib.contextmanager
def eager_plans(on: bool) -> Iterator[None]:
    """Eager plans on or off inside, every memoised eager call forgotten on the way in and out
    (each setting plans its calls afresh)."""
    before = os.environ.get(tuning.EAGER_PLANS_ENV)
    os.environ[tuning.EAGER_PLANS_ENV] = "1" if on else "0"
    launcher.forget_eager_calls()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(tuning.EAGER_PLANS_ENV, None)
        else:
            os.environ[tuning.EAGER_PLANS_ENV] = before
        launcher.forget_eager_calls()


def moved(cases: Sequence[Case], dtypes: Sequence[str], planned: str | None = None
          ) -> list[tuple[Case, str, tuning.MMPlan, tuning.MMPlan]]:
    """(case, dtype, the planner's plan, the eager plan) of each product whose plain eager calls
    launch another plan with eager plans on (``planned``: only where the planner's plan runs
    that kernel)."""
    found = []
    with eager_plans(True):
        for case in cases:
            for dtype in dtypes:
                a, b = make_operands(case, DTYPES[dtype], torch.device("cuda"))
                out = torch.empty((case.m, case.n), dtype=a.dtype, device=a.device)
                plan = plan_mm(a, b, None, out, "none", False)
                eager = eager_mm_plan(a, b, out, plan)
                if eager is not None and planned in (None, plan.kernel):
                    found.append((case, dtype, plan, eager))
    return found


def _compile(jobs: Sequence[tuple[Case, str]]) -> int:
    """Build what both settings launch for ``jobs`` (a worker process's share): each
    setting's first, later and captured calls."""
    import torch_triton_gemm as tg

    for case, dtype in jobs:
        a, b = make_operands(case, DTYPES[dtype], torch.device("cuda"))
        for on in (False, True):
            with eager_plans(on):
                for _ in range(3):
                    tg.mm(a, b)
                settle(lambda a=a, b=b: tg.mm(a, b))
        torch.cuda.synchronize()
    return len(jobs)


def time_case(case: Case, dtype: str, plan: tuning.MMPlan, eager: tuning.MMPlan,
              settings: TimingSettings, reps: int) -> list[dict[str, Any]]:
    """The rows of one product: both settings, ``reps`` times, in alternating order."""
    import torch_triton_gemm as tg

    a, b = make_operands(case, DTYPES[dtype], torch.device("cuda"))
    ref = torch.mm(a.double(), b.double())
    base = {"suite": case.suite, "name": case.name, "dtype": dtype, "M": case.m, "N": case.n,
            "K": case.k, "a_layout": case.a_layout, "b_layout": case.b_layout,
            "a_pad": case.a_pad, "b_pad": case.b_pad, "plan": plan_name(plan),
            "eager_plan": plan_name(eager)}
    rows, outs = [], {}
    for rep in range(reps):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            with eager_plans(on):
                for _ in range(4):  # the first call launches the planner's plan
                    out = tg.mm(a, b)
                settle(lambda: tg.mm(a, b))
                timings = compare({"tgemm": tg.mm, "torch": torch.mm}, (a, b), settings)
            outs[on] = out
            rows.append({**base, "rep": rep, "eager_plans": int(on),
                         "tgemm_eager_us": timings.eager_ms["tgemm"] * 1e3,
                         "torch_eager_us": timings.eager_ms["torch"] * 1e3,
                         "tgemm_kernel_us": timings.kernel_ms["tgemm"] * 1e3,
                         "torch_kernel_us": timings.kernel_ms["torch"] * 1e3,
                         "rel_err": f"{((out.double() - ref).norm() / ref.norm()).item():.2e}",
                         "same_bits": torch.equal(out, outs.get(not on, out))})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.eager_plans",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="sweep",
                        help="comma-separated: sweep (default) or mm suite names")
    parser.add_argument("--seed", type=int, default=suites.SWEEP_SEED)
    parser.add_argument("--count", type=int, default=suites.SWEEP_COUNT)
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16, fp16")
    parser.add_argument("--csv", required=True)
    parser.add_argument("--planned", choices=("portable", "tma"),
                        help="only products whose planner's plan runs this kernel")
    parser.add_argument("--reps", type=int, default=2, help="alternations of the settings")
    parser.add_argument("--rep-ms", type=float, default=40.0, help="ms of calls per timing")
    parser.add_argument("--workers", type=int, default=8,
                        help="processes building both settings' kernels first")
    parser.add_argument("--time-budget", type=float, default=float("inf"), metavar="S",
                        help="stop timing S seconds after the start (rows so far are kept)")
    args = parser.parse_args(argv)
    cases, dtypes = parsed_cases(parser, args)
    if not torch.cuda.is_available():
        parser.error("eager plans run on a CUDA GPU")
    start = time.perf_counter()
    found = moved(cases, dtypes, args.planned)
    print(f"{len(found)} products move", file=sys.stderr)
    jobs = [(case, dtype) for case, dtype, _, _ in found]
    if args.workers > 1 and jobs:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            list(pool.map(_compile, [jobs[i::args.workers] for i in range(args.workers)]))
    settings = TimingSettings(warmup_ms=args.rep_ms / 4, rep_ms=args.rep_ms, rounds=1)
    with open(args.csv, "w", newline="") as file:
        writer = csv.DictWriter(file, FIELDS)
        writer.writeheader()
        for done, (case, dtype, plan, eager) in enumerate(found):
            if time.perf_counter() - start > args.time_budget:
                print(f"time budget spent after {done} products", file=sys.stderr)
                break
            writer.writerows(time_case(case, dtype, plan, eager, settings, args.reps))
            file.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
