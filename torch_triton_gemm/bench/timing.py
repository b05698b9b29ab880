"""How the benchmark times things on the GPU.

Two timings per implementation, from the same back-to-back calls:

- eager: a batch of ``calls`` plain Python calls, bracketed by CUDA events. Batches are queued
  back to back without synchronising, so a call costs whichever is longer, the host's time to
  issue it or the GPU's time to run it: what eager PyTorch code sees.
- kernel-only: the same batch captured in a CUDA graph and replayed. The host launches one
  graph per batch, queued behind a spinning kernel so that the GPU never waits for it, so the
  time is the GPU's alone (what ``torch.compile(mode="reduce-overhead")`` and CUDA-graph
  serving see).

Calls cycle through copies of the operands spanning 256 MB, so that each call reads operands
that are not in L2. A batch lasts about 1 ms (at most ``max_calls`` calls): short enough to
measure many batches, long enough that the gaps between batches do not count.

(``triton.testing.do_bench`` instead clears L2 with a 256 MB memset before every call and times
each call alone. While the GPU runs that memset, tens of microseconds, the host issues the next
call, so a small GEMM's host time is hidden: it measures neither of the above.)

The implementations of one row are timed in alternating order, ``rounds`` times, and each keeps
its best median, so a clock or power dip during one measurement does not decide the ratio.
Everything here needs a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import math
import select
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from .results import DEVICE_BUILT_NOTE

# Operand copies that calls cycle through span at least this many bytes (as much as do_bench
# clears): several times the L2 cache of current GPUs.
ROTATE_BYTES = 256 * 2**20
BATCH_TARGET_MS = 1.0
MIN_BATCHES = 5


@dataclass(frozen=True)
class TimingSettings:
    """How long and how often to measure (command-line options)."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    rounds: int = 2
    max_calls: int = 16
    # Sample the GPU's SM clock and power draw during each kernel-only measurement
    # (ClockSampler): long rows of large GEMMs, where a power limit may lower the clock.
    sample_clocks: bool = False


@dataclass
class Timings:
    """Per implementation: median ms per call, eager and kernel-only (NaN where not measured)."""

    eager_ms: dict[str, float] = field(default_factory=dict)
    kernel_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # With TimingSettings.sample_clocks: the median SM clock (MHz) and power draw (W) during
    # the kernel-only measurement each implementation keeps (where they could be read).
    sm_mhz: dict[str, float] = field(default_factory=dict)
    power_w: dict[str, float] = field(default_factory=dict)


# nvidia-smi's sampling period while a ClockSampler is open, and how long it may take to start.
CLOCK_SAMPLE_MS = 20
CLOCK_START_S = 5.0


class ClockSampler:
    """The median SM clock (MHz) and power draw (W) of one GPU while the context is open,
    sampled by ``nvidia-smi`` every CLOCK_SAMPLE_MS (``sm_mhz`` and ``power_w`` stay NaN where
    it is missing or reports nothing). A long run of large GEMMs can reach the GPU's power
    limit, which lowers its clock and so its speed, by how much power the kernels draw: the
    clocks tell such a row's ratio apart from the kernels' own speed."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        self.sm_mhz = math.nan
        self.power_w = math.nan
        self._device = device
        self._process: subprocess.Popen[str] | None = None

    def _gpu_id(self) -> str:
        # nvidia-smi numbers GPUs its own way (CUDA_VISIBLE_DEVICES aside): name it by bus.
        if not torch.cuda.is_available():
            return "0"
        props = torch.cuda.get_device_properties(self._device)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            return str(torch.cuda.current_device() if self._device is None else self._device)
        return (f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:"
                f"{getattr(props, 'pci_device_id', 0):02X}.0")

    def __enter__(self) -> ClockSampler:
        program = shutil.which("nvidia-smi")
        if program is not None:
            try:
                self._process = subprocess.Popen(
                    [program, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                     f"--loop-ms={CLOCK_SAMPLE_MS}", f"--id={self._gpu_id()}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except (OSError, RuntimeError):
                self._process = None
        if self._process is not None and self._process.stdout is not None:
            # nvidia-smi takes a while to start: wait for its first sample (taken before what
            # is measured, so left out) rather than miss a short measurement.
            ready, _, _ = select.select([self._process.stdout], [], [], CLOCK_START_S)
            if ready:
                self._process.stdout.readline()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            output, _ = self._process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            output, _ = self._process.communicate()
        self.sm_mhz, self.power_w = parse_clock_samples(output)


def parse_clock_samples(output: str) -> tuple[float, float]:
    """The medians of nvidia-smi's "clock, power" lines (NaN where none could be read)."""
    clocks, powers = [], []
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            clock, power = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        clocks.append(clock)
        powers.append(power)
    if not clocks:
        return math.nan, math.nan
    return statistics.median(clocks), statistics.median(powers)


def _elapsed_ms(run: Callable[[], Any]) -> float:
    """ms between CUDA events around one ``run()`` on an idle GPU (host gaps included)."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


# Kernel-only timing queues every timed batch behind a spinning kernel first (see
# time_batches): about this long per batch (the host's cost of a replay and two event records,
# with room to spare), at most QUEUE_AHEAD_MAX_S in all, at this many GPU clock cycles a second.
QUEUE_AHEAD_PER_BATCH_S = 25e-6
QUEUE_AHEAD_MAX_S = 0.05
SLEEP_CYCLES_PER_S = 2.0e9


def time_batches(run_batch: Callable[[], Any], calls: int, warmup_ms: float,
                 rep_ms: float, queue_ahead: bool = False) -> float:
    """Median ms per call over back-to-back batches of ``calls`` calls, each batch bracketed by
    CUDA events; about ``warmup_ms`` of batches first, then at least ``rep_ms`` of them.

    ``queue_ahead`` (kernel-only timing: ``run_batch`` replays a CUDA graph): the GPU first runs
    a spinning kernel while the host queues the timed batches, so that the GPU never waits for
    the host between them: a host stall while the GPU drains a batch of few-microsecond
    kernels would otherwise land inside the next batch's events. (It did not remove the slow
    windows seen in plan sweeps on an H100, identical kernels up to 8x slower in one run than
    the next in both of a row's rounds: those last longer than a row; bench.plans --passes
    times the whole sweep again instead. Eager timing must not queue ahead: there the host's
    time is part of what is measured.)"""
    # Not the first run: a CUDA graph's first replay uploads it (and a first launch may meet
    # the GPU at idle clocks), which made batches of a few-microsecond kernel look ten times
    # longer than they are and left too few warm-up and timed batches.
    run_batch()
    batch_ms = max(_elapsed_ms(run_batch), 1e-3)
    for _ in range(math.ceil(warmup_ms / batch_ms)):
        run_batch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(MIN_BATCHES, math.ceil(rep_ms / batch_ms)))]
    spin = getattr(torch.cuda, "_sleep", None)  # (private; absent: time as before)
    if queue_ahead and spin is not None:
        seconds = min(len(events) * QUEUE_AHEAD_PER_BATCH_S, QUEUE_AHEAD_MAX_S)
        spin(int(seconds * SLEEP_CYCLES_PER_S))
    for start, end in events:
        start.record()
        run_batch()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / calls


def calls_per_batch(fn: Callable[..., Any], args: Sequence[Any], max_calls: int) -> int:
    """How many calls make a batch of about BATCH_TARGET_MS (1 to ``max_calls``)."""
    call_ms = max(_elapsed_ms(lambda: fn(*args)), 1e-3)
    return max(1, min(max_calls, math.ceil(BATCH_TARGET_MS / call_ms)))


def _clone(value: Any) -> Any:
    """A copy of a tensor with the same strides (and requires_grad), anything else as is."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                               device=value.device)
    copy.copy_(value.detach())
    return copy.requires_grad_(value.requires_grad)


def operand_copies(args: Sequence[Any], calls: int) -> list[tuple[Any, ...]]:
    """``args`` and enough copies of its tensors to span ROTATE_BYTES (at most ``calls`` sets)."""
    nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    count = max(1, min(calls, math.ceil(ROTATE_BYTES / max(nbytes, 1))))
    return [tuple(args)] + [tuple(_clone(a) for a in args) for _ in range(count - 1)]


def _batch(fn: Callable[..., Any], copies: Sequence[tuple[Any, ...]],
           calls: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(calls):
            fn(*copies[i % len(copies)])

    return run


def capture_graph(run: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run()``, after one warm-up call on a side stream (as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def short_error(exc: BaseException, limit: int = 120) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# The longest quiet_host waits for any one background compile, seconds.
QUIET_HOST_WAIT_S = 120.0


def quiet_host() -> int:
    """Wait for tgemm's background compiles (ops/compile_pool.py: the variants a first call
    submits, its capture launch's and its backward's; host-descriptor variants) before a
    timing, and return how many were unfinished: they share the host with the timed calls (the
    GIL for Triton's front end, cores for its back end), which would then time a transient
    rather than the calls."""
    from ..ops.compile_pool import POOL

    pending = POOL.unfinished
    if pending:
        POOL.drain(QUIET_HOST_WAIT_S)  # (bounded: a stuck compile must not stop the run)
    return pending


def compare(fns: Mapping[str, Callable[..., Any]], args: Sequence[Any],
            settings: TimingSettings) -> Timings:
    """Time each of ``fns`` (called as ``fn(*args)``, already warmed up and tuned) eager and
    kernel-only, in alternating order, best of ``settings.rounds``.

    Each measurement captures its own graph and drops it afterwards, so that only one graph's
    memory pool is alive at a time. A function that cannot be captured (it synchronises, say)
    keeps its eager time; its kernel-only time is NaN and a note says why. A note also counts
    captured TMA launches that built their descriptors on the device (no host-descriptor
    variant loaded: slower replays).
    """
    from ..ops import graph_descriptors

    pending = quiet_host()
    first = next(iter(fns.values()))
    calls = calls_per_batch(first, args, settings.max_calls)
    copies = operand_copies(args, calls)
    batches = {name: _batch(fn, copies, calls) for name, fn in fns.items()}
    timings = Timings({name: math.inf for name in fns}, {name: math.inf for name in fns})
    if pending:
        timings.notes.append(f"timed after {pending} background compiles finished")
    uncapturable: set[str] = set()
    for round_index in range(settings.rounds):
        names = list(fns) if round_index % 2 == 0 else list(reversed(fns))
        for name in names:
            eager = time_batches(batches[name], calls, settings.warmup_ms, settings.rep_ms)
            timings.eager_ms[name] = min(timings.eager_ms[name], eager)
            if name in uncapturable:
                continue
            built = graph_descriptors.DEVICE_BUILT_CAPTURES
            try:
                graph = capture_graph(batches[name])
            except Exception as exc:  # reported in the row's note; the eager time stands
                uncapturable.add(name)
                timings.notes.append(f"{name}: no CUDA graph ({short_error(exc)})")
                torch.cuda.synchronize()
                continue
            device_built = graph_descriptors.DEVICE_BUILT_CAPTURES - built
            if device_built and round_index == 0:
                # (slower replays: ops/graph_descriptors.py)
                timings.notes.append(f"{name}: {device_built} captured launches of {calls} "
                                     f"calls {DEVICE_BUILT_NOTE}")
            sampler = ClockSampler() if settings.sample_clocks else None
            with sampler or contextlib.nullcontext():
                kernel = time_batches(graph.replay, calls, settings.warmup_ms, settings.rep_ms,
                                      queue_ahead=True)
            if kernel < timings.kernel_ms[name]:
                timings.kernel_ms[name] = kernel
                if sampler is not None:
                    timings.sm_mhz[name], timings.power_w[name] = sampler.sm_mhz, sampler.power_w
            del graph
    for table in (timings.eager_ms, timings.kernel_ms):
        for name, value in table.items():
            table[name] = value if math.isfinite(value) else math.nan
    return timings


def host_us_per_call(fns: Mapping[str, Callable[..., Any]], args: Sequence[Any],
                     calls: int = 100, repeats: int = 20) -> dict[str, float]:
    """Host time per call in microseconds: wall time of ``calls`` back-to-back calls, without
    waiting for the GPU, over ``calls``; median of ``repeats``, the functions alternating.

    The GPU's launch queue holds far more than ``calls`` small launches, so the host never waits
    for the GPU inside the loop; it synchronises between repeats. Background compiles the
    warm-up calls started finish first (``quiet_host``).
    """
    for fn in fns.values():
        for _ in range(3):
            fn(*args)
    quiet_host()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for repeat in range(repeats):
        names = list(fns) if repeat % 2 == 0 else list(reversed(fns))
        for name in names:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


# --- running rows -------------------------------------------------------------------------------

R = TypeVar("R")


@dataclass(frozen=True)
class Row(Generic[R]):
    """One row to measure: ``measure()`` gives its result, ``failed(message)`` the error row."""

    label: str
    measure: Callable[[], R]
    failed: Callable[[str], R]


def first_call(fn: Callable[[], R]) -> tuple[R, float]:
    """``fn()`` and its wall time to completion in s (a first call tunes new size buckets);
    then ``settle(fn)``: the CUDA graphs of kernel-only timings capture the host-descriptor
    variants of TMA launches (ops/graph_descriptors.py), as after ``tg.prepare_capture``."""
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    settle(fn)
    return out, seconds


def settle(fn: Callable[[], Any]) -> None:
    """Call ``fn()`` eagerly until what CUDA graph captures of it launch is built and loaded
    (``torch_triton_gemm.prepare_capture``)."""
    from ..ops.graph_descriptors import prepare_capture

    prepare_capture(fn)


@dataclass
class Stop:
    """Whether the run was told to stop (Ctrl-C, or the SIGTERM of a time limit, which the
    command line turns into the same KeyboardInterrupt): rows measured before it are kept and
    written, none after it is started."""

    requested: bool = False


STOP = Stop()

# Called with each row's result as soon as it is measured (the command line rewrites its CSV
# with the rows so far, so that a run killed outright, past any signal handler, still leaves
# them); None: nothing is called.
ON_ROW: Callable[[Any], None] | None = None


def run_rows(rows: Sequence[Row[R]]) -> list[R]:
    """Measure each row in turn, progress on stderr. A row that raises (out of memory, a
    missing feature, a wrong result) becomes its error row, its traceback goes to stderr, and
    the run goes on. An interruption (KeyboardInterrupt) sets ``STOP`` and returns the rows
    measured before it; once ``STOP`` is set, no row is started."""
    results: list[R] = []
    try:
        for index, row in enumerate(rows, 1):
            if STOP.requested:
                break
            print(f"[{index}/{len(rows)}] {row.label} ...", end=" ", file=sys.stderr,
                  flush=True)
            start = time.perf_counter()
            try:
                result = row.measure()
            except Exception as exc:
                print("failed:", file=sys.stderr, flush=True)
                traceback.print_exc()
                result = row.failed(short_error(exc))
            else:
                first = getattr(result, "first_call_s", math.nan)
                tuning = f" (first tgemm call {first:.1f} s)" if math.isfinite(first) else ""
                print(f"{time.perf_counter() - start:.1f} s{tuning}", file=sys.stderr,
                      flush=True)
            results.append(result)
            if ON_ROW is not None:
                ON_ROW(result)
            # Give the cached blocks back so that large shapes do not stack up.
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        print("interrupted: the rows measured before it are kept", file=sys.stderr, flush=True)
        STOP.requested = True
    return results
