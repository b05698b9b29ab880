"""The command line: ``python -m torch_triton_gemm.bench [options]``.

Parses the options, runs the selected suites one after another (each suite's table is printed
as soon as it is done, progress goes to stderr), writes the requested files, and prints the
short summary last. ``--help`` and ``--list`` need neither a GPU nor the optional plotting
packages.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence

import torch
import triton

import torch_triton_gemm as tg
from torch_triton_gemm import device as _device

from . import report, suites, timing
from .results import RunResults
from .timing import TimingSettings

DTYPE_NAMES = ("bf16", "fp16")
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# The dtypes of the suites that do not follow --dtypes.
_FIXED_DTYPES = {"grouped": "bf16", "scaled": "fp8 e4m3 -> bf16",
                 "sgrouped": "fp8 e4m3 -> bf16", "moe": "bf16", "e2e": "bf16", "coldstart": "bf16"}


def _parse_names(text: str, allowed: Sequence[str], what: str,
                 aliases: dict[str, Sequence[str]]) -> list[str]:
    """Comma-separated names, aliases expanded, deduplicated in order; ArgumentTypeError if
    one is unknown."""
    names: list[str] = []
    for raw in text.split(","):
        raw = raw.strip().lower()
        if not raw:
            continue
        expanded = aliases.get(raw, (raw,))
        for name in expanded:
            if name not in allowed:
                choices = ", ".join([*allowed, *aliases])
                raise argparse.ArgumentTypeError(f"unknown {what} {raw!r}; choose from {choices}")
            if name not in names:
                names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return names


def _suites(text: str) -> list[str]:
    names = _parse_names(text, suites.ALL_SUITES, "suite", suites.SUITE_GROUPS)
    return [s for s in suites.ALL_SUITES if s in names]  # run order, whatever the list's order


def _dtypes(text: str) -> list[str]:
    aliases = {alias: (name,) for alias, name in _DTYPE_ALIASES.items()}
    return _parse_names(text, DTYPE_NAMES, "dtype", aliases)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _shard(text: str) -> tuple[int, int]:
    """--shard's I/N: the I-th of N shares (1 <= I <= N)."""
    index, _, count = text.partition("/")
    try:
        share = (int(index), int(count))
    except ValueError:
        share = (0, 0)
    if not 1 <= share[0] <= share[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N, got {text}")
    return share


def _suite_help() -> str:
    lines = ["suites (default: every one but grouped, scaled, sgrouped, moe, classes and sweep):"]
    lines += [f"  {name:<10} {suites.SUITE_DESCRIPTIONS[name]}" for name in suites.ALL_SUITES]
    lines.append("  " + "; ".join(f"{group} = {', '.join(names)}" if group == "mm" else
                                  f"{group}: {len(names)} suites"
                                  for group, names in suites.SUITE_GROUPS.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_triton_gemm.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark torch_triton_gemm against torch (cuBLAS) on a CUDA GPU, every\n"
                    "row timed kernel-only (CUDA-graph replays) and eager. Tables go to stdout\n"
                    "as each suite finishes, the summary last; progress goes to stderr.",
        epilog=_suite_help())
    parser.add_argument(
        "--suite", type=_suites, default=None, metavar="NAMES",
        help="comma-separated suites or groups (mm, default, all); see below")
    parser.add_argument(
        "--dtypes", type=_dtypes, default=None, metavar="NAMES",
        help="dtypes of the mm and latency suites: bf16, fp16 (default: bf16,fp16; "
             "with --quick: bf16); the latency suite adds fp8 (the scaled_mm path)")
    parser.add_argument(
        "--quick", action="store_true",
        help="a representative subset of every suite (see --list --quick), bf16 unless "
             "--dtypes says otherwise")
    parser.add_argument("--list", action="store_true",
                        help="print the suites with their row counts (and with --suite, their "
                             "shapes), then exit; needs no GPU")
    parser.add_argument("--warmup", type=_positive_int, default=25, metavar="MS",
                        help="warm-up time per measurement, ms (default: 25)")
    parser.add_argument("--rep", type=_positive_int, default=100, metavar="MS",
                        help="measured time per measurement, ms (default: 100)")
    parser.add_argument("--rounds", type=_positive_int, default=2, metavar="N",
                        help="alternating measurements of tgemm and its peers per row; each "
                             "keeps its best median (default: 2)")
    parser.add_argument("--calls", type=_positive_int, default=16, metavar="N",
                        help="most calls per timed batch and per CUDA graph (default: 16)")
    parser.add_argument("--seed", type=int, default=suites.SWEEP_SEED, metavar="S",
                        help="seed of the sweep's random shapes (default: "
                             f"{suites.SWEEP_SEED}); fit on one seed, judge on another")
    parser.add_argument("--count", type=_positive_int, default=None, metavar="N",
                        help=f"shapes in the sweep (default: {suites.SWEEP_COUNT}; with "
                             f"--quick: {suites.QUICK_SWEEP_COUNT}); a larger count keeps the "
                             "smaller one's shapes first")
    parser.add_argument("--shard", type=_shard, default=(1, 1), metavar="I/N",
                        help="only every N-th case of each mm suite, from the I-th (1/2 and 2/2 "
                             "split a run between two GPUs, each its own process with "
                             "CUDA_VISIBLE_DEVICES); the other suites run whole")
    parser.add_argument("--inductor", action="store_true",
                        help="also time torch.mm compiled by Inductor with Triton GEMM templates "
                             "only (max-autotune) in the mm suites; slow: a compile per shape")
    parser.add_argument("--csv", metavar="PATH", help="write every row to a CSV file")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG bar chart of the mm rows' TFLOP/s, and for the sweep "
                             "a plot of its ratios against M*N*K (PATH, or PATH with -sweep "
                             "added when there are other mm rows); needs matplotlib: "
                             'pip install "torch-triton-gemm[bench]"')
    parser.add_argument("--markdown", action="store_true",
                        help="also print the tables as GitHub markdown")
    parser.add_argument("--out", metavar="DIR",
                        help="write results.csv and results.md (every table) into DIR")
    parser.add_argument("--e2e-layers", type=_positive_int, default=2, metavar="N",
                        help="blocks stacked in the e2e model (default: 2)")
    parser.add_argument("--e2e-steps", type=_positive_int, default=20, metavar="N",
                        help="timed steps per variant in the e2e suite (default: 20)")
    parser.add_argument("--coldstart-timeout", type=_positive_int, default=300, metavar="S",
                        help="seconds each cold-start process may take (default: 300)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; fills in the defaults that depend on --quick."""
    args = build_parser().parse_args(argv)
    args.suite_given = args.suite is not None
    if args.suite is None:
        args.suite = list(suites.DEFAULT_SUITES)
    if args.dtypes is None:
        args.dtypes = ["bf16"] if args.quick else list(DTYPE_NAMES)
    args.count = suites.sweep_count(args.quick, args.count)
    return args


def settings_from(args: argparse.Namespace) -> TimingSettings:
    return TimingSettings(args.warmup, args.rep, args.rounds, args.calls)


# --- --list -------------------------------------------------------------------------------------

def list_text(args: argparse.Namespace) -> str:
    """The suites with their row counts (for the current --quick, --dtypes and --shard), which
    of them would run, and with --suite the shapes of the selected suites."""
    rows = []
    total = 0
    for name in suites.ALL_SUITES:
        count = suites.suite_row_count(name, args.quick, args.count)
        if name in (*suites.MM_SUITES, *suites.PLANNER_SUITES):  # the sharded suites
            count = len(range(args.shard[0] - 1, count, args.shard[1]))
        # The latency suite also times the fp8 scaled_mm path, whatever --dtypes says.
        extra = ("fp8",) if name == "latency" else ()
        dtypes = (",".join((*args.dtypes, *extra)) if suites.per_dtype(name)
                  else _FIXED_DTYPES[name])
        runs = name in args.suite
        if runs:
            total += count * (len(args.dtypes) + len(extra) if suites.per_dtype(name) else 1)
        rows.append([name, str(count), dtypes, "yes" if runs else "",
                     suites.SUITE_DESCRIPTIONS[name]])
    headers = ("suite", "rows", "dtypes", "runs", "what")
    parts = [report.format_table(headers, rows, {"suite", "dtypes", "runs", "what"}),
             f"{total} rows would run{' (--quick)' if args.quick else ''}; rows are per dtype "
             "where the suite follows --dtypes"]
    if args.suite_given:
        parts.append(_cases_text(args))
    return "\n".join(parts)


def _mm_cases(args: argparse.Namespace, suite: str) -> list[suites.Case]:
    """The cases of an mm suite this run measures: --shard's share."""
    index, count = args.shard
    return suites.suite_cases(suite, args.quick, seed=args.seed, count=args.count)[
        index - 1::count]


def _cases_text(args: argparse.Namespace) -> str:
    parts = []
    cases = [c for s in args.suite if suites.per_dtype(s) for c in _mm_cases(args, s)]
    if cases:
        # The class column only where a listed suite has classes (the planner suites).
        classes = any(c.shape_class for c in cases)
        headers = ("suite", *(("class",) if classes else ()), "name", "M", "N", "K", "a", "b")
        rows = [[c.suite, *((c.shape_class,) if classes else ()), c.name, str(c.m), str(c.n),
                 str(c.k), _layout_cell(c, "a"), _layout_cell(c, "b")] for c in cases]
        parts.append(report.format_table(headers, rows, {"suite", "class", "name", "a", "b"}))
    if "grouped" in args.suite:
        rows = [[c.name, c.form, c.routing, str(c.groups), str(c.tokens), str(c.n), str(c.k),
                 str(sum(size == 0 for size in c.group_sizes()))]
                for c in suites.grouped_cases(args.quick)]
        parts.append(report.format_table(
            ("grouped", "form", "routing", "G", "T", "N", "K", "empty groups"), rows,
            {"grouped", "form", "routing"}))
    if "scaled" in args.suite:
        rows = [[c.name, str(c.m), str(c.n), str(c.k), c.recipe, c.accumulation]
                for c in suites.scaled_cases(args.quick)]
        parts.append(report.format_table(("scaled", "M", "N", "K", "recipe", "accum"), rows,
                                         {"scaled", "recipe", "accum"}))
    if "sgrouped" in args.suite:
        rows = [[c.name, c.proj, c.routing, c.accum, str(c.groups), str(c.tokens), str(c.n),
                 str(c.k), str(sum(size == 0 for size in c.group_sizes()))]
                for c in suites.sgrouped_cases(args.quick)]
        parts.append(report.format_table(
            ("sgrouped", "proj", "routing", "accum", "G", "T", "N", "K", "empty groups"), rows,
            {"sgrouped", "proj", "routing", "accum"}))
    if "moe" in args.suite:
        rows = [[c.name, c.form, str(c.experts), str(c.top_k), str(c.hidden), str(c.inter),
                 str(c.tokens)] for c in suites.moe_cases(args.quick)]
        parts.append(report.format_table(("moe", "form", "E", "k", "H", "I", "T"), rows,
                                         {"moe", "form"}))
    return "\n\n".join(["", *parts]) if parts else ""


def _layout_cell(case: suites.Case, operand: str) -> str:
    layout = case.a_layout if operand == "a" else case.b_layout
    pad = case.stored(operand)[2]
    return f"{layout} pad {pad}" if pad else layout


# --- running ------------------------------------------------------------------------------------

def header_lines(device: torch.device, settings: TimingSettings,
                 inductor_config: dict[str, object] | None = None) -> list[str]:
    """What ran where, and how it was timed; ``inductor_config`` when --inductor is on."""
    inductor = ([f"inductor: torch.compile(torch.mm, mode=max-autotune-no-cudagraphs, "
                 f"dynamic=False) per shape, with Inductor config {inductor_config}"]
                if inductor_config is not None else [])
    return [
        f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | "
        f"triton {triton.__version__} | tgemm {tg.__version__}",
        f"median ms per call over batches of up to {settings.max_calls} calls on rotating "
        f"operand copies (cold L2); warmup {settings.warmup_ms:g} ms, rep {settings.rep_ms:g} "
        f"ms, best of {settings.rounds} alternating rounds",
        "mm: a row-major [M, K], b = W.t() with W [N, K] unless the name says otherwise",
        *inductor,
        *report.LEGEND,
    ]


def _run_suite(results: RunResults, name: str, run: Callable[[], None]) -> None:
    """Run one suite; an unexpected failure of the whole suite becomes a note, not a crash.
    After an interruption (``timing.STOP``) no suite starts; one interrupted outside its rows
    (e2e, coldstart) keeps nothing."""
    if timing.STOP.requested:
        return
    try:
        run()
    except KeyboardInterrupt:
        timing.STOP.requested = True
        print(f"\n{name}: interrupted", file=sys.stderr, flush=True)
    except Exception as exc:
        traceback.print_exc()
        results.notes.append(f"{name}: failed ({type(exc).__name__}: {exc}); traceback on stderr")
    finally:
        torch.cuda.empty_cache()


def _print_new_sections(results: RunResults, printed: set[str]) -> None:
    """Print the tables that appeared since the last call (each suite as it finishes)."""
    for section in report.sections(results):
        if section.title not in printed:
            printed.add(section.title)
            print()
            print(section.render(), flush=True)


def run_suites(args: argparse.Namespace, device: torch.device) -> RunResults:
    """Run the selected suites in order, printing each table when its suite is done."""
    # Imported here: they are only needed on a GPU.
    from . import e2e, gemm, grouped, moe, scaled, sgrouped

    settings = settings_from(args)
    results = RunResults()
    printed: set[str] = set()

    def run_mm_suite(suite: str) -> None:
        cases = _mm_cases(args, suite)
        _run_suite(results, suite, lambda: results.mm.extend(
            gemm.run_mm(cases, args.dtypes, settings, device, args.inductor)))
        _print_new_sections(results, printed)

    for suite in (s for s in suites.MM_SUITES if s in args.suite):
        run_mm_suite(suite)
    if "latency" in args.suite:
        cases = suites.suite_cases("latency")
        _run_suite(results, "latency", lambda: results.latency.extend(
            gemm.run_latency(cases, args.dtypes, device)))
        _print_new_sections(results, printed)
    for name, module, run, cases, target in (
            ("grouped", grouped, grouped.run_grouped, suites.grouped_cases(args.quick),
             results.grouped),
            ("scaled", scaled, scaled.run_scaled, suites.scaled_cases(args.quick),
             results.scaled),
            ("sgrouped", sgrouped, sgrouped.run_sgrouped, suites.sgrouped_cases(args.quick),
             results.sgrouped),
            ("moe", moe, moe.run_moe, suites.moe_cases(args.quick), results.moe)):
        if name not in args.suite:
            continue
        missing = module.missing_reason()
        if missing:
            results.notes.append(f"{name}: skipped ({missing})")
            print(f"\n{name}: skipped ({missing})", flush=True)
            continue
        _run_suite(results, name, lambda r=run, c=cases, t=target: t.extend(
            r(c, settings, device)))
        _print_new_sections(results, printed)
    if "e2e" in args.suite:
        def run_e2e() -> None:
            results.e2e = e2e.run_e2e(layers=args.e2e_layers, steps=args.e2e_steps,
                                      device=device)

        _run_suite(results, "e2e", run_e2e)
        _print_new_sections(results, printed)
    if "coldstart" in args.suite:
        _run_suite(results, "coldstart", lambda: results.coldstart.extend(
            e2e.run_coldstart(args.coldstart_timeout)))
        _print_new_sections(results, printed)
    # Last: the longest suites.
    for suite in (s for s in suites.PLANNER_SUITES if s in args.suite):
        run_mm_suite(suite)
    return results


def _csv_paths(args: argparse.Namespace) -> list[str]:
    """The CSV files the run writes: --csv's and --out's results.csv."""
    paths = [args.csv] if args.csv else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "results.csv"))
    return paths


def _rows_so_far_writer(paths: Sequence[str]) -> Callable[[object], None] | None:
    """What ``timing.ON_ROW`` calls with each measured row: the CSVs at ``paths`` rewritten
    with every row measured so far, so that a run killed outright still leaves them (the
    finished run writes them again, in report order, with the suites that have no rows)."""
    if not paths:
        return None
    measured: list[dict[str, object]] = []

    def write(result: object) -> None:
        record = getattr(result, "record", None)
        if record is None:
            return
        measured.append(record())
        for path in paths:
            report.write_csv(path, measured)

    return write


def _write_files(args: argparse.Namespace, header: list[str], results: RunResults) -> None:
    records = results.records()
    if args.csv:
        report.write_csv(args.csv, records)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        csv_path, md_path = (os.path.join(args.out, f) for f in ("results.csv", "results.md"))
        report.write_csv(csv_path, records)
        with open(md_path, "w") as f:
            f.write(report.markdown_report(header, results))
        print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    if args.plot:
        _write_plots(args.plot, results)


def _write_plots(path: str, results: RunResults) -> None:
    """The bar chart of the mm rows at ``path``, the sweep's scatter plot at ``path`` with
    "-sweep" added (at ``path`` itself when the sweep was the only mm suite)."""
    bars = [r for r in results.mm if r.case.suite != "sweep"]
    sweep = [r for r in results.mm if r.case.suite == "sweep"]
    if bars and report.write_plot(path, bars):
        print(f"wrote {path}", file=sys.stderr)
    if sweep:
        stem, ext = os.path.splitext(path)
        sweep_path = f"{stem}-sweep{ext or '.png'}" if bars else path
        if report.write_ratio_plot(sweep_path, sweep):
            print(f"wrote {sweep_path}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected suites and print the results; returns the process exit status."""
    args = parse_args(argv)
    if args.list:
        print(list_text(args))
        return 0
    if args.plot and not report.matplotlib_available():
        # Said before the run, not after it; the rest of the run goes ahead.
        print(report.NO_MATPLOTLIB, file=sys.stderr)
        args.plot = None
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--list shows what it would run", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    error = _device.kernel_device_error(device)
    if error is not None:
        print(f"cannot benchmark: {error}", file=sys.stderr)
        return 2

    from . import gemm  # imported once a GPU is known to be there, as in run_suites

    header = header_lines(device, settings_from(args),
                          gemm.inductor_config() if args.inductor else None)
    print("\n".join(f"# {line}" for line in header), flush=True)
    torch.manual_seed(0)
    # A time limit's SIGTERM stops the run as Ctrl-C does: the rows measured so far are
    # printed and written. (A run in the same process after an interrupted one starts afresh.)
    timing.STOP.requested = False
    previous = signal.signal(signal.SIGTERM, _interrupt)
    timing.ON_ROW = _rows_so_far_writer(_csv_paths(args))
    try:
        results = run_suites(args, device)
    finally:
        signal.signal(signal.SIGTERM, previous)
        timing.ON_ROW = None
    if timing.STOP.requested:
        results.notes.append("interrupted: only the rows measured before the stop are here")
    if args.markdown:
        print()
        print("\n\n".join(s.render(markdown=True) for s in report.sections(results)))
    _write_files(args, header, results)
    print()
    print(report.summary(results), flush=True)
    return 130 if timing.STOP.requested else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
