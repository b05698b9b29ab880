"""Fit the plan model's constants (``plan_model.Costs``) to plan-sweep CSVs, and judge the
planner on other CSVs. Runs on any host (needs numpy and scipy, not a GPU).

    python -m torch_triton_gemm.bench.fit --fit docs/data/plans-h100-seed1.csv \\
        --check docs/data/plans-h100-seed2.csv

Fitting minimises the squared log error of the predicted kernel time over every timed plan
of the fit files. ``--refit KERNEL --scale-by CHOSEN.csv`` fits one kernel's tiles alone, on
timings put into the constants' units first (``scaled_to_model``: each product's times times
the model's prediction for the pick of a ``bench.plans --chosen-only`` run of the same session
over the pick's time), as for a kernel timed on another GPU than the constants':

    python -m torch_triton_gemm.bench.fit --fit ws-plans.csv --scale-by chosen.csv \\
        --refit wgmma [--min-launch 2]

(``--min-launch US`` keeps every fitted launch constant at or above US microseconds.) The
check compares, on each shape of the check files, the plan the model picks (among the timed
plans of the plan space) with cuBLAS and with the fastest timed plan. It prints the fitted
constants as Python, for ``plan_model.py``'s ``H100_COSTS``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import plan_model, tuning

GLOBALS = ("launch_reduce", "launch_copy", "exchange_us", "bytes_per_us", "sm_bytes_per_us",
           "launch_fixup", "fixup_per_kib")
PER_TILE = ("launch_us", "step_us", "tile_us")


@dataclass(frozen=True)
class Timed:
    """One timed plan of a plan-sweep CSV."""

    shape: tuple[object, ...]  # what identifies the product (sizes, layouts, dtype)
    m: int
    n: int
    k: int
    element_size: int
    aligned: bool
    plan: tuning.MMPlan
    narrow: bool  # an operand pitch is not a multiple of 16 elements
    a_m_contiguous: bool  # A stored [K, M] (transposed): its columns are contiguous
    us: float
    cublas_us: float
    heuristic: bool
    # Timed with pitch hints, and with size hints (both ``tuning.pitch_hints_enabled``; CSVs
    # without the column: not).
    pitch_hints: bool = False
    size_hints: bool = False
    # Timed before a change to the kernels' launches (``--fit-before``): the fit gives such
    # rows launch constants of their own, a factor per cost kernel off today's.
    before: bool = False
    # The widest copy the portable kernel made along narrow pitches (plan_model.pitch_vector).
    pitch_vector: int = 0


def read(paths: Sequence[str], before: bool = False) -> list[Timed]:
    """The timed (error-free) plans of plan-sweep CSVs (``before``: timed before a change to
    the launches, see ``Timed.before``). Raises KeyError (a missing column) or ValueError (a
    value that is no number) for a CSV that is not a plan sweep, with its path."""
    rows = []
    for path in paths:
        with open(path, newline="") as file:
            try:
                rows += _timed_rows(path, csv.DictReader(file), before)
            except KeyError as error:
                raise KeyError(f"{path}: no column {error}") from None
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from None
    return rows


def _timed_rows(path: str, reader: Iterable[dict[str, str]], before: bool) -> list[Timed]:
    """The timed rows of one plan-sweep CSV's ``reader`` (transposed candidates left out: the
    plan model costs plans as they run, untransposed)."""
    rows = []
    for r in reader:
        if not r["us"] or r.get("swap_ab") == "True":
            continue
        tile = tuning.TileConfig(*(int(r[f]) for f in (
            "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")))
        pad = {"True": True, "False": False}.get(r["pad"])
        plan = tuning.MMPlan(r["kernel"], tile, int(r["split_k"]), False,
                             int(r["epilogue_subtile"]), r["split_tail"] == "True",
                             1, int(r["stream_k"]), pad,
                             r.get("split_fixup") == "True")
        shape = (path, r["suite"], r["name"], r["M"], r["N"], r["K"], r["a_layout"],
                 r["b_layout"], r.get("a_pad", ""), r.get("b_pad", ""), r["dtype"])
        rows.append(Timed(shape, int(r["M"]), int(r["N"]), int(r["K"]),
                          1 if r["dtype"].startswith("fp8") else 2,
                          r["aligned"] == "True", plan, narrow_row(r),
                          r["a_layout"] == "col" and int(r["M"]) > 1, float(r["us"]),
                          float(r["cublas_us"]), r["heuristic"] == "True",
                          r.get("pitch_hints") == "True", r.get("size_hints") == "True",
                          before, pitch_vector_row(r)))
    return rows


def current_kernels(rows: Sequence[Timed]) -> list[Timed]:
    """``rows`` less the portable kernel's timings that today's hints (on by default) make
    stale, where the rows hold timings made with them: pitch hints change its loads of narrow
    pitches; size hints, its loads of an A contiguous along M and of a B contiguous along a
    narrow N (such pitches are narrow too). Only timings with the hints describe those."""
    def portable(r: Timed) -> bool:
        return r.plan.kernel == "portable" and (r.narrow or r.a_m_contiguous)

    if any(portable(r) and r.size_hints for r in rows):
        return [r for r in rows if not (portable(r) and not r.size_hints)]
    if any(portable(r) and r.narrow and r.pitch_hints for r in rows):
        return [r for r in rows if not (portable(r) and r.narrow and not r.pitch_hints)]
    return list(rows)


def scaled_to_model(rows: Sequence[Timed], picks: Sequence[Timed],
                    costs: plan_model.Costs) -> list[Timed]:
    """``rows`` in the units of ``costs``: each product's times (and cuBLAS's) times the
    model's prediction for that product's pick in ``picks`` (a ``--chosen-only`` run of the
    same session) over the pick's measured time, so that a kernel's timings on another GPU
    (or another day) can be fitted beside constants fitted elsewhere. Products without such a
    pick (none timed, transposed, or a plan the constants do not cost) are left out."""
    kernels = {key[0] for key in costs.tiles} | set(plan_model.REFINES)
    factors = {}
    for pick in picks:
        if _cost_kernel(pick) not in kernels or not costed(pick, costs):
            continue
        predicted = plan_model.predict_us(
            costs, pick.plan, pick.m, pick.n, pick.k, pick.element_size, 2, pick.aligned,
            pick.narrow, pick.a_m_contiguous, pick.pitch_vector)
        factors[pick.shape[1:]] = predicted / pick.us
    return [dataclasses.replace(r, us=r.us * factors[r.shape[1:]],
                                cublas_us=r.cublas_us * factors[r.shape[1:]])
            for r in rows if r.shape[1:] in factors]


def _pitches(r: Mapping[str, Any]) -> list[int]:
    """The pitches (elements) of a CSV row's operands along which they have more than one row
    (the sweep's layouts: a row-major or transposed, b nn.Linear's W.t() or row-major,
    padded)."""
    m, n, k = int(r["M"]), int(r["N"]), int(r["K"])
    a_pitch = (k if r["a_layout"] == "row" else m) + int(r.get("a_pad") or 0)
    b_pitch = (k if r["b_layout"] == "col" else n) + int(r.get("b_pad") or 0)
    a_rows, b_rows = (m if r["a_layout"] == "row" else k), (n if r["b_layout"] == "col" else k)
    # A pitch of 1 (K = 1 in a layout along K) steps like a contiguous dimension.
    return [pitch for rows, pitch in ((a_rows, a_pitch), (b_rows, b_pitch))
            if rows > 1 and pitch != 1]


def narrow_row(r: Mapping[str, Any]) -> bool:
    """Whether a CSV row's operands have a pitch that is not a multiple of 16 elements."""
    return any(pitch % 16 for pitch in _pitches(r))


def pitch_vector_row(r: Mapping[str, Any]) -> int:
    """The widest copy a CSV row's portable launch made along its narrow pitches
    (``plan_model.pitch_vector``; rows timed without pitch hints: 0)."""
    size = 1 if r["dtype"].startswith("fp8") else 2
    return plan_model.pitch_vector([(pitch, size) for pitch in _pitches(r) if pitch % 16],
                                   r.get("pitch_hints") == "True")


def _cost_kernel(r: Timed) -> str:
    return plan_model.cost_kernel(r.plan.kernel, r.narrow, r.a_m_contiguous,
                                  plan_model.one_step(r.plan, r.k, r.element_size),
                                  r.pitch_vector)


def costed(r: Timed, costs: plan_model.Costs) -> bool:
    """Whether the planner costs ``r``'s plan with ``costs``: it leaves stream-K out (see
    tuning.plan_space's ``stream_k``), and splits that finish their own tiles where the
    constants do not cost them."""
    return not r.plan.stream_k and ("fixup" in costs.launch_us or not r.plan.split_fixup)


def _key(r: Timed) -> tuple[str, int, int, int, int]:
    return plan_model._tile_key(_cost_kernel(r), r.plan.tile)


def _tile_keys(rows: Sequence[Timed]) -> list[tuple[str, int, int, int, int]]:
    return sorted({_key(r) for r in rows})


def costs_from(vector: Sequence[float], keys: Sequence[tuple[str, int, int, int, int]],
               num_sms: int, fixups: bool = True) -> plan_model.Costs:
    """Costs from a parameter vector (logs of the constants: the globals, then three per
    tile); ``fixups``: whether the timings held splits that finish their own tiles (else their
    constant, which nothing fitted, is left out and the model does not pick such plans)."""
    values = [math.exp(v) for v in vector]
    g = dict(zip(GLOBALS, values))
    per = len(PER_TILE)
    tiles = {key: plan_model.TileCost(*values[len(GLOBALS) + per * i:len(GLOBALS) + per * (i + 1)])
             for i, key in enumerate(keys)}
    launch = {"reduce": g["launch_reduce"], "copy": g["launch_copy"]}
    if fixups:
        launch["fixup"], launch["fixup_per_kib"] = g["launch_fixup"], g["fixup_per_kib"]
    return plan_model.Costs(launch, g["exchange_us"], tiles,
                            plan_model.Machine(num_sms, g["bytes_per_us"], g["sm_bytes_per_us"]))


def fit(rows: Sequence[Timed], num_sms: int,
        fixed: plan_model.Costs | None = None, min_launch_us: float = 0.0) -> plan_model.Costs:
    """Least-squares fit of the log predicted time to the log measured time, on features of
    each timed plan computed once (``plan_model.plan_work``): the same sum as
    ``plan_model.predict_us``, in numpy. With ``fixed``, only the tiles of ``rows`` are
    fitted: the global constants are ``fixed``'s, and so are its other tiles. Rows timed
    ``before`` a change to the launches share every constant with today's rows except their
    launch constants, which are today's times a factor per cost kernel (fitted, not returned):
    older sweeps still teach the model how K steps and tiles cost, and today's rows alone
    what a launch costs, where both are given. ``min_launch_us``: the least launch constant a
    fitted tile may take (0: unbounded)."""
    import numpy as np
    from scipy.optimize import least_squares

    if fixed is not None:
        # Plans that no fixed constant costs are left out.
        rows = [r for r in rows if "fixup" in fixed.launch_us or not r.plan.split_fixup]
    keys = _tile_keys(rows)
    index = {key: i for i, key in enumerate(keys)}
    works = [plan_model.plan_work(r.plan, r.m, r.n, r.k, num_sms) for r in rows]
    tile = np.array([index[_key(r)] for r in rows])
    steps = np.array([w.steps for w in works])
    tiles = np.array([w.tiles for w in works])
    exchanges = np.array([w.exchanges for w in works])
    busy = np.array([w.busy for w in works], dtype=float)
    reduce = np.array([w.reduce for w in works], dtype=float)
    operand = np.array([(r.m * r.k + r.k * r.n) * r.element_size for r in rows], dtype=float)
    moved = operand + np.array([r.m * r.n * r.element_size + w.extra_bytes
                                for r, w in zip(rows, works)])
    copied = np.array([r.plan.kernel == "tma" and not r.aligned for r in rows], dtype=float)
    fixup_bytes = np.array([w.fixup_bytes for w in works])
    partial = np.array([plan_model.partial_round(r.plan, w, num_sms)  # (not fitted)
                        * plan_model.narrow_overlap(r.plan, w, _cost_kernel(r), r.pitch_vector,
                                                    r.element_size)
                        for r, w in zip(rows, works)])
    cache = (plan_model.H100_COSTS if fixed is None else fixed).machine.l2_bytes
    l2 = np.array([plan_model.l2_us(r.plan, r.m, r.n, r.k, r.element_size, cache)  # (not fitted)
                   for r in rows])
    machine = (plan_model.H100_COSTS if fixed is None else fixed).machine
    tail = np.array([plan_model.tail_reduction_us(r.plan, r.m, r.n, r.k,  # (not fitted)
                                                  r.element_size, machine) for r in rows])
    power = plan_model.L2_LIMIT_POWER
    fixup = (fixup_bytes > 0).astype(float)
    measured = np.log([r.us for r in rows])
    n_globals = len(GLOBALS)
    # One launch factor per cost kernel for rows timed before, where today's rows are there
    # too (else the launch constants are simply those rows').
    before = np.array([r.before for r in rows], dtype=float)
    if before.all():
        before[:] = 0.0
    eras = sorted({key[0] for key, b in zip(map(_key, rows), before) if b})
    era = np.array([eras.index(_key(r)[0]) if b else 0 for r, b in zip(rows, before)])
    n_tiles = len(keys) * len(PER_TILE)

    held = None if fixed is None else np.array(_globals_of(fixed))

    def predict(vector: np.ndarray) -> np.ndarray:
        if held is None:
            g, vector = np.exp(vector[:n_globals]), vector[n_globals:]
        else:
            g = held
        factors = np.exp(vector[n_tiles:])
        per_tile = np.exp(vector[:n_tiles]).reshape(len(keys), len(PER_TILE))
        launch, step, per = per_tile[tile, 0], per_tile[tile, 1], per_tile[tile, 2]
        if eras:
            launch = launch * np.where(before > 0, factors[era], 1.0)
        compute = (steps * step + tiles * per) * partial + exchanges * g[2]
        bandwidth = np.minimum(g[3], busy * g[4])
        time = launch + np.maximum(compute, moved / bandwidth) + reduce * g[0] + tail
        time += fixup * g[5] + fixup_bytes / 1024 * g[6]
        time += copied * (g[1] + 2 * operand / g[3])
        return np.where(l2 > 0, (time ** power + l2 ** power) ** (1 / power), time)

    start = [] if fixed is not None else [
        math.log(v) for v in (2.0, 2.0, 0.5, 2.5e6, 3.0e4, 1.0, 0.01)]
    start += [math.log(3.0), math.log(0.3), math.log(0.5)] * len(keys) + [0.0] * len(eras)
    lower = np.full(len(start), -np.inf)
    if min_launch_us > 0:
        first = len(start) - len(eras) - n_tiles  # the tiles' constants follow the globals
        lower[first:first + n_tiles:len(PER_TILE)] = math.log(min_launch_us)
        start = np.maximum(start, lower + 1e-9)
    result = least_squares(lambda v: np.log(predict(v)) - measured, start, loss="soft_l1",
                           f_scale=0.1, max_nfev=2000, bounds=(lower, np.inf))
    fitted_vector = list(result.x[:len(result.x) - len(eras)])
    if eras:
        print("launch factors of the rows timed before: " + ", ".join(
            f"{name} {math.exp(v):.2f}" for name, v in zip(eras, result.x[-len(eras):])),
            file=sys.stderr)
    if fixed is None:
        return costs_from(fitted_vector, keys, num_sms, bool(fixup.any()))
    fitted = costs_from([math.log(v) for v in _globals_of(fixed)] + fitted_vector,
                        keys, num_sms)
    return plan_model.Costs(fixed.launch_us, fixed.exchange_us,
                            {**fixed.tiles, **fitted.tiles}, fixed.machine)


def rebase_launches(rows: Sequence[Timed], costs: plan_model.Costs,
                    floor_us: float = 0.3) -> tuple[plan_model.Costs, dict[str, float]]:
    """``costs`` with each cost kernel's launch constants moved by one offset, fitted on
    ``rows`` (timed after the constants were: launches changed since, e.g. programmatic
    dependent launch, while steps and tiles did not), and the offsets (us, positive: today's
    launches are cheaper). Each offset minimises the median absolute log error of the
    kernel's rows; a launch constant stays at least ``floor_us``; kernels without rows keep
    their constants."""
    import numpy as np
    from scipy.optimize import minimize_scalar

    by_kernel: dict[str, list[Timed]] = defaultdict(list)
    for r in rows:
        if not costed(r, costs):
            continue
        by_kernel[_key(r)[0]].append(r)
    offsets = {}
    for kernel, timed in sorted(by_kernel.items()):
        measured = np.log([r.us for r in timed])
        # The kernel's part of each prediction that is not its launch.
        launch = np.array([plan_model.tile_cost(costs, kernel, r.plan.tile).launch_us
                           for r in timed])
        rest = np.array([plan_model.predict_us(costs, r.plan, r.m, r.n, r.k, r.element_size,
                                               r.element_size, r.aligned, r.narrow,
                                               r.a_m_contiguous, r.pitch_vector)
                         for r in timed]) - launch

        def error(offset: float, measured: Any = measured, rest: Any = rest,
                  launch: Any = launch) -> float:
            return float(np.median(np.abs(
                measured - np.log(rest + np.maximum(launch - offset, floor_us)))))

        offsets[kernel] = float(minimize_scalar(error, bounds=(-10.0, 10.0),
                                                method="bounded").x)
    tiles = {key: cost if key[0] not in offsets else dataclasses.replace(
        cost, launch_us=max(floor_us, cost.launch_us - offsets[key[0]]))
        for key, cost in costs.tiles.items()}
    return dataclasses.replace(costs, tiles=tiles), offsets


def _globals_of(costs: plan_model.Costs) -> list[float]:
    """The global constants of ``costs`` in ``GLOBALS`` order (1 for fix-up constants that
    ``costs`` lacks; no plan they would cost is fitted with them)."""
    launch = costs.launch_us
    return [launch["reduce"], launch["copy"], costs.exchange_us, costs.machine.bytes_per_us,
            costs.machine.sm_bytes_per_us, launch.get("fixup", 1.0),
            launch.get("fixup_per_kib", 1.0)]


def check(costs: plan_model.Costs, rows: Sequence[Timed]) -> dict[str, float]:
    """Per shape: the model's pick among the timed plans against cuBLAS and the fastest."""
    shapes: dict[tuple[object, ...], list[Timed]] = defaultdict(list)
    for r in rows:
        shapes[r.shape].append(r)
    picked, oracle, heuristic, worst = [], [], [], []
    for timed in shapes.values():
        first = timed[0]
        eligible = [r for r in timed if costed(r, costs)] or timed
        # The planner's own choice (best_plan) among the timed plans.
        by_plan: dict[tuning.MMPlan, Timed] = {}
        for r in eligible:
            by_plan.setdefault(r.plan, r)
        choice = by_plan[plan_model.best_plan(
            costs, list(by_plan), first.m, first.n, first.k, first.element_size,
            first.element_size, first.aligned, first.narrow, first.a_m_contiguous,
            first.pitch_vector)]
        best = min(timed, key=lambda r: r.us)
        picked.append(first.cublas_us / choice.us)
        oracle.append(first.cublas_us / best.us)
        heuristic += [first.cublas_us / r.us for r in timed if r.heuristic]
        worst.append((picked[-1], first.m, first.n, first.k, first.shape[6:8], choice.plan,
                      best.plan, best.us / choice.us))
    worst.sort(key=lambda w: w[0])
    for row in worst[:15]:
        print("  worst", row, file=sys.stderr)

    def summary(ratios: list[float]) -> str:
        if not ratios:
            return "n/a"
        ordered = sorted(ratios)
        geomean = math.exp(statistics.fmean(math.log(r) for r in ordered))
        return (f"geomean {geomean:.3f} p5 {ordered[len(ordered) // 20]:.3f} "
                f"median {statistics.median(ordered):.3f} min {ordered[0]:.3f} "
                f"<0.9 {sum(r < 0.9 for r in ordered) / len(ordered):.2f}")

    print(f"shapes {len(shapes)}\n  model pick: {summary(picked)}\n"
          f"  fastest:    {summary(oracle)}\n  previous heuristic: {summary(heuristic)}")
    return {"geomean": math.exp(statistics.fmean(math.log(r) for r in picked))}


def costs_source(costs: plan_model.Costs) -> str:
    """``costs`` as the Python literal plan_model.py keeps."""
    lines = ["H100_COSTS = Costs(",
             f"    launch_us={ {k: round(v, 3) for k, v in costs.launch_us.items()} },",
             f"    exchange_us={costs.exchange_us:.4g},", "    tiles={"]
    for key, cost in sorted(costs.tiles.items()):
        lines.append(f"        {key}: TileCost({cost.launch_us:.4g}, {cost.step_us:.4g}, "
                     f"{cost.tile_us:.4g}),")
    m = costs.machine
    lines += ["    },", f"    machine=Machine({m.num_sms}, {m.bytes_per_us:.4g}, "
              f"{m.sm_bytes_per_us:.4g}),", ")"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.fit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", nargs="*", default=[], help="plan-sweep CSVs to fit on")
    parser.add_argument("--fit-before", nargs="*", default=[], metavar="CSV",
                        help="plan-sweep CSVs timed before a change to the launches (e.g. "
                             "programmatic dependent launch) to fit on too: they share every "
                             "constant with --fit's but the launches, whose constants --fit's "
                             "rows set")
    parser.add_argument("--check", nargs="*", default=[], help="plan-sweep CSVs to judge on")
    parser.add_argument("--rebase-launches", nargs="*", default=[], metavar="CSV",
                        help="plan-sweep CSVs timed after the constants: move each cost "
                             "kernel's launch constants by the offset that fits them best "
                             "(after --fit, if given), print the offsets and the constants")
    parser.add_argument("--scale-by", nargs="*", default=None, metavar="CSV",
                        help="--chosen-only plan-sweep CSVs of the same runs as --fit's: fit "
                             "their times scaled into the constants' units (scaled_to_model), "
                             "as for --refit of a kernel timed on another GPU")
    parser.add_argument("--num-sms", type=int, default=132)
    parser.add_argument("--refit", default=None, metavar="KERNEL",
                        help="fit only the tiles of this cost kernel (plan_model.cost_kernel: "
                             "portable, portable-narrow, portable-narrow-vector, portable-mcol, "
                             "tma, wgmma) on the fit files' rows of it; every other constant stays "
                             "plan_model.H100_COSTS's")
    parser.add_argument("--min-launch", type=float, default=0.0, metavar="US",
                        help="the least launch constant (microseconds) a fitted tile may take "
                             "(default: unbounded)")
    args = parser.parse_args(argv)
    if args.min_launch < 0:
        parser.error(f"--min-launch: microseconds, at least 0, not {args.min_launch}")
    if args.fit_before and not args.fit:
        parser.error("--fit-before needs --fit: today's timings set the launch constants")
    if not args.fit and not args.check and not args.rebase_launches:
        parser.error("give plan-sweep CSVs to --fit on, --rebase-launches on and/or to --check")
    cost_kernels = sorted({key[0] for key in plan_model.H100_COSTS.tiles} | set(
        plan_model.REFINES) | {tuning.WS_KERNEL, tuning.WS_PINGPONG_KERNEL})
    if args.refit is not None and args.refit not in cost_kernels:
        parser.error(f"--refit: one of {', '.join(cost_kernels)}, not {args.refit!r}")
    try:
        fitted = {path: read([path])
                  for path in (*args.fit, *args.check, *args.rebase_launches)}
        fitted.update({path: read([path], before=True) for path in args.fit_before})
    except OSError as error:
        parser.error(str(error))
    except (KeyError, ValueError) as error:
        parser.error(f"not a plan-sweep CSV (python -m torch_triton_gemm.bench.plans writes "
                     f"them): {error}")
    for path, timed in fitted.items():
        if not timed:
            parser.error(f"{path}: no timed plans")
    costs = plan_model.H100_COSTS
    if args.fit:
        rows = current_kernels([row for path in (*args.fit, *args.fit_before)
                                for row in fitted[path]])
        if args.scale_by:
            try:
                picks = read(args.scale_by)
            except (OSError, KeyError, ValueError) as error:
                parser.error(str(error))
            rows = scaled_to_model(rows, picks, costs)
            if not rows:
                parser.error("--scale-by: no product of --fit's has a costed pick there")
        if args.refit is not None:
            costs = fit([r for r in rows if _key(r)[0] == args.refit], args.num_sms, costs,
                        args.min_launch)
        else:
            costs = fit(rows, args.num_sms, min_launch_us=args.min_launch)
        print(costs_source(costs))
        print("fit set (--fit's rows):")
        check(costs, [r for r in rows if not r.before])
    if args.rebase_launches:
        costs, offsets = rebase_launches(
            current_kernels([r for path in args.rebase_launches for r in fitted[path]]), costs)
        print("launch offsets (us): " + ", ".join(f"{k} {v:.2f}" for k, v in offsets.items()))
        print(costs_source(costs))
    for path in args.check:
        print(f"check {path}:")
        check(costs, fitted[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
