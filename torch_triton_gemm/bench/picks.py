"""The plans tgemm::mm's plan model picks for benchmark cases on an H100, computed on any host
(no GPU: the operands are meta tensors with the cases' sizes and strides): which cases a change
to the plan model or its space moves, so that a GPU run times those cases alone.

    python -m torch_triton_gemm.bench.picks --seed 8 --count 400 --csv before.csv
    (--suites midrows: bench.plans' mid-row set of that seed instead of the sweep)
    (change the planner)
    python -m torch_triton_gemm.bench.picks --seed 8 --count 400 --csv changed.csv \\
        --against before.csv
    python -m torch_triton_gemm.bench.plans --chosen-only --suites sweep --seed 8 \\
        --count 400 --cases changed.csv --csv after-timed.csv      (on the GPU)

One CSV row per (case, dtype): the case, how the plan model sees its operands (``aligned``:
TMA reads them as they are; ``narrow``: a pitch is not a multiple of 16 elements;
``pitch_vector``: the widest copy the portable kernel makes along such pitches) and the
plan (``plan``; ``none`` where no plan of the space fits and the heuristic plans). With
``--against``, only the rows whose plan differs from that file's, with its plan beside.
16-bit products only (the plan model's); tuned plans are not consulted.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch

from .. import device as _device
from .. import plan_model, tuning
from ..ops.planner import model_view, modelled_mm_plan
from . import plans, suites
from .gemm import DTYPES, make_operands
from .suites import Case

# The GPU the picks are made for: what the planner reads of it.
H100_NUM_SMS = 132
H100_SHARED_MEMORY = 232448  # bytes a block may use (227 KiB)

FIELDS = ("name", "a_layout", "b_layout", "dtype", "M", "N", "K", "aligned", "narrow",
          "pitch_vector", "plan")


def plan_name(plan: tuning.MMPlan | None) -> str:
    """A plan as one compact field: kernel, tile (BMxBNxBK, warps, stages), K splits (T: the
    partial wave's only, F: finishing their own tiles, I: in one launch), stream-K, padded
    copies (nocopy: a plan that reads operands as they are where others copy them)."""
    if plan is None:
        return "none"
    t = plan.tile
    name = (f"{plan.kernel}:{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"
            f":sk{plan.split_k}{'T' if plan.split_tail else ''}"
            f"{'F' if plan.split_fixup else ''}{'I' if plan.split_inline else ''}")
    if plan.stream_k:
        name += f":streamk{plan.stream_k}"
    return name + (":pad" if plan.pad else ":nocopy" if plan.pad is False else "")


@contextlib.contextmanager
def h100() -> Iterator[None]:
    """The device queries the planner makes answered with an H100's numbers, whatever the
    device (this process only)."""
    with mock.patch.object(_device, "num_sms", lambda device: H100_NUM_SMS), \
            mock.patch.object(_device, "shared_memory_per_block",
                              lambda index: H100_SHARED_MEMORY), \
            mock.patch.object(_device, "supports_tma", lambda device: True), \
            mock.patch.object(_device, "l2_cache_bytes",
                              lambda device: plan_model.H100_COSTS.machine.l2_bytes):
        yield


def picks(cases: Sequence[Case], dtypes: Sequence[str]) -> list[dict[str, object]]:
    """The plan model's pick for each case and dtype on an H100 (see the module docstring)."""
    rows = []
    meta = torch.device("meta")
    with h100():
        for case in cases:
            for dtype in dtypes:
                a, b = make_operands(case, DTYPES[dtype], meta)
                out = torch.empty((case.m, case.n), dtype=a.dtype, device=meta)
                aligned, narrow, _, pitch_vector, _ = model_view(a, b, out)
                rows.append({
                    "name": case.name, "a_layout": case.a_layout, "b_layout": case.b_layout,
                    "dtype": dtype, "M": case.m, "N": case.n, "K": case.k,
                    "aligned": aligned, "narrow": narrow, "pitch_vector": pitch_vector,
                    "plan": plan_name(modelled_mm_plan(a, b, out))})
    return rows


def _key(row: Mapping[str, Any]) -> plans.CaseKey:
    return plans.case_key(row["name"], row["M"], row["N"], row["K"], row["dtype"])


def changed(rows: Sequence[dict[str, object]], before: Sequence[dict[str, str]]
            ) -> list[dict[str, object]]:
    """The rows whose plan differs from ``before``'s row of the same case and dtype, with
    before's plan as ``plan_before`` (cases ``before`` lacks are left out)."""
    earlier = {_key(r): r["plan"] for r in before}
    out = []
    for row in rows:
        plan = earlier.get(_key(row))
        if plan is not None and plan != row["plan"]:
            out.append({**row, "plan_before": plan})
    return out


def parsed_cases(parser: argparse.ArgumentParser, args: argparse.Namespace
                 ) -> tuple[list[Case], list[str]]:
    """The cases of ``--suites`` (seeded by ``--seed`` and ``--count``) and the ``--dtypes`` of
    a command line over 16-bit products (this one, bench.eager_plans); a bad value ends it
    with the parser's error."""
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in ("bf16", "fp16")]
    if bad:
        parser.error(f"--dtypes: bf16 or fp16, not {', '.join(bad)}")
    try:
        cases = [case for name in args.suites.split(",")
                 for case in suites.plan_sweep_cases(name, args.seed, args.count)]
    except ValueError as error:
        parser.error(f"--suites: {error}")
    return cases, dtypes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.picks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="sweep",
                        help="comma-separated, as bench.plans takes them (16-bit sets): sweep "
                             "(default), fewrows, midrows or mm suite names")
    parser.add_argument("--seed", type=int, default=suites.SWEEP_SEED)
    parser.add_argument("--count", type=int, default=suites.SWEEP_COUNT)
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16, fp16")
    parser.add_argument("--csv", required=True)
    parser.add_argument("--against", default=None, metavar="CSV",
                        help="an earlier run's CSV: write only the cases whose plan changed")
    parser.add_argument("--dram-gbps", type=float, default=None, metavar="GBPS",
                        help="the GPU's peak DRAM bandwidth (default: an H100's, 3352; an "
                             "H200's is 4814), which --dram-scaling plans with")
    plans.add_rule_flags(parser, ", as bench.plans times it")
    args = parser.parse_args(argv)
    cases, dtypes = parsed_cases(parser, args)
    with contextlib.ExitStack() as rules:
        for module, constant, value in plans.rules_off(args):
            rules.enter_context(mock.patch.object(module, constant, value))
        if args.dram_gbps is not None:
            rules.enter_context(mock.patch.object(_device, "dram_gbps",
                                                  lambda device: args.dram_gbps))
        rows = picks(cases, dtypes)
    fields = list(FIELDS)
    if args.against is not None:
        try:
            with open(args.against, newline="") as file:
                before = list(csv.DictReader(file))
        except OSError as error:
            parser.error(str(error))
        rows = changed(rows, before)
        fields.append("plan_before")
    with open(args.csv, "w", newline="") as file:
        writer = csv.DictWriter(file, fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} rows written to {args.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
