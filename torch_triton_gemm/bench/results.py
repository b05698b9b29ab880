"""What one benchmark row holds, with its derived numbers (TFLOP/s, ratios, GB/s).

Times are ms per call, NaN where a number could not be measured; ratios are speed ratios,
peer time / tgemm time, so above 1 means tgemm is faster. ``error`` is set on rows whose
measurement failed; they are reported, not raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .suites import Case, GroupedCase, MoECase, ScaledCase, ScaledGroupedCase

# How a row's note says that captured launches built their TMA descriptors on the device
# (timing.compare writes it; report.summary_lines counts such rows).
DEVICE_BUILT_NOTE = "built their TMA descriptors on the device"

AnyCase = Case | GroupedCase | ScaledCase | ScaledGroupedCase | MoECase

# Implementations a GEMM row may time: tgemm, the torch peer (torch.mm, torch._grouped_mm,
# torch._scaled_mm), for grouped rows a Python loop of torch.mm, and for mm rows with
# --inductor torch.mm compiled by Inductor with its Triton templates.
IMPLS = ("tgemm", "torch", "loop", "inductor")
ELEMENT_SIZES = {"bf16": 2, "fp16": 2, "fp8": 1}


def safe_ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN unless both are finite and the denominator positive."""
    if not (denominator > 0 and math.isfinite(denominator) and math.isfinite(numerator)):
        return math.nan
    return numerator / denominator


@dataclass
class GemmResult:
    """Timings and accuracy of one GEMM row: an mm, grouped or scaled case in one dtype."""

    case: AnyCase
    dtype: str
    kernel_ms: dict[str, float] = field(default_factory=dict)  # CUDA-graph replays
    eager_ms: dict[str, float] = field(default_factory=dict)  # back-to-back eager calls
    rel_err: float = math.nan
    err_vs: str = ""  # what rel_err was measured against
    first_call_s: float = math.nan  # tgemm's first call, tuning included when it was new
    error: str = ""
    note: str = ""
    peak_mib: dict[str, float] = field(default_factory=dict)  # memory a call adds (moe rows)
    # Median SM clock (MHz) and power draw (W) during each kept kernel-only measurement, where
    # sampled (moe rows; timing.ClockSampler).
    sm_mhz: dict[str, float] = field(default_factory=dict)
    power_w: dict[str, float] = field(default_factory=dict)
    # tgemm's output against the torch peer's, where a row compares them (sgrouped rows):
    # ||out - peer|| / ||peer||, and whether the two are bitwise equal.
    peer_diff: float = math.nan
    peer_equal: bool | None = None

    def time_ms(self, impl: str = "tgemm", kind: str = "kernel") -> float:
        """ms per call of ``impl``, ``kind`` "kernel" (kernel-only) or "eager"."""
        times = self.kernel_ms if kind == "kernel" else self.eager_ms
        return times.get(impl, math.nan)

    def tflops(self, impl: str = "tgemm", kind: str = "kernel") -> float:
        """Throughput of ``impl`` in TFLOP/s."""
        ms = self.time_ms(impl, kind)
        return self.case.flops / (ms * 1e-3) / 1e12 if ms > 0 else math.nan

    def ratio(self, peer: str = "torch", kind: str = "kernel", impl: str = "tgemm") -> float:
        """Speed of ``impl`` over speed of ``peer``: above 1 means ``impl`` is faster."""
        return safe_ratio(self.time_ms(peer, kind), self.time_ms(impl, kind))

    def has(self, impl: str) -> bool:
        """Whether ``impl`` was timed (either way) in this row."""
        return impl in self.kernel_ms or impl in self.eager_ms

    def gbps(self, impl: str = "tgemm") -> float:
        """Achieved bandwidth (operands and output once, kernel-only), memory-bound rows only."""
        ms = self.time_ms(impl, "kernel")
        if not self.case.memory_bound or not ms > 0:
            return math.nan
        return self.case.bytes_moved(ELEMENT_SIZES[self.dtype]) / (ms * 1e-3) / 1e9

    def label(self) -> str:
        return f"{self.case.label()} {self.dtype}"

    def record(self) -> dict[str, object]:
        """The row as CSV fields, full precision."""
        row: dict[str, object] = {"suite": self.case.suite, "name": self.case.name,
                                  "dtype": self.dtype, **self.case.record()}
        for impl in filter(self.has, IMPLS):
            row[f"{impl}_ms"] = self.time_ms(impl, "kernel")
            row[f"{impl}_eager_ms"] = self.time_ms(impl, "eager")
            row[f"{impl}_tflops"] = self.tflops(impl, "kernel")
        for peer in filter(self.has, IMPLS[1:]):
            prefix = "" if peer == "torch" else f"{peer}_"
            row[f"{prefix}ratio"] = self.ratio(peer, "kernel")
            row[f"{prefix}eager_ratio"] = self.ratio(peer, "eager")
        if self.has("inductor"):
            # Inductor against the same cuBLAS peer as tgemm's "ratio".
            row["inductor_vs_torch_ratio"] = self.ratio("torch", "kernel", "inductor")
            row["inductor_vs_torch_eager_ratio"] = self.ratio("torch", "eager", "inductor")
        if self.case.memory_bound:
            row["tgemm_gbps"] = self.gbps("tgemm")
            row["torch_gbps"] = self.gbps("torch")
        for impl, mib in self.peak_mib.items():
            row[f"{impl}_peak_mib"] = mib
        for impl, mhz in self.sm_mhz.items():
            row[f"{impl}_sm_mhz"] = mhz
            row[f"{impl}_power_w"] = self.power_w.get(impl, math.nan)
        if self.peer_equal is not None:
            row.update(torch_diff=self.peer_diff, torch_bitwise_equal=self.peer_equal)
        row.update(rel_err=self.rel_err, err_vs=self.err_vs, first_call_s=self.first_call_s,
                   error=self.error, note=self.note)
        return row


LATENCY_IMPLS = ("torch.ops.tgemm.mm", "tgemm.mm", "torch.mm")
# fp8 latency rows time the scaled_mm path in the same three roles, kept under those keys.
SCALED_LATENCY_NAMES = {"torch.ops.tgemm.mm": "torch.ops.tgemm.scaled_mm",
                        "tgemm.mm": "tgemm.scaled_mm", "torch.mm": "torch._scaled_mm"}


def latency_name(impl: str, dtype: str) -> str:
    """What a latency row of ``dtype`` timed under the key ``impl`` (one of LATENCY_IMPLS)."""
    return SCALED_LATENCY_NAMES[impl] if dtype == "fp8" else impl


@dataclass
class LatencyResult:
    """Host time per eager call (us) of each entry point, for one small shape."""

    case: Case
    dtype: str
    host_us: dict[str, float] = field(default_factory=dict)
    error: str = ""

    def ratio(self, impl: str) -> float:
        """Host time of ``impl`` over torch.mm's: above 1 means it costs more host time."""
        return safe_ratio(self.host_us.get(impl, math.nan), self.host_us.get("torch.mm", math.nan))

    def label(self) -> str:
        return f"{self.case.label()} {self.dtype}"

    def record(self) -> dict[str, object]:
        row: dict[str, object] = {"suite": "latency", "name": self.case.name,
                                  "dtype": self.dtype, **self.case.record()}
        for impl in LATENCY_IMPLS:
            row[f"{impl}_host_us"] = self.host_us.get(impl, math.nan)
        row["host_ratio"] = self.ratio("tgemm.mm")
        row["op_host_ratio"] = self.ratio("torch.ops.tgemm.mm")
        row["error"] = self.error
        return row


@dataclass
class E2EResult:
    """Step times of the e2e model, plain and under ``override()``."""

    description: str
    dtype: str
    plain_ms: float
    override_ms: float
    loss_rel_diff: float  # max over measured steps of |loss_override - loss_plain| / |loss_plain|

    @property
    def ratio(self) -> float:
        """Override step time over plain step time: below 1 means the override is faster."""
        return safe_ratio(self.override_ms, self.plain_ms)

    def record(self) -> dict[str, object]:
        return {"suite": "e2e", "name": self.description, "dtype": self.dtype,
                "plain_ms": self.plain_ms, "override_ms": self.override_ms,
                "step_ratio": self.ratio, "loss_rel_diff": self.loss_rel_diff}


@dataclass
class ColdStartResult:
    """One fresh process: the first training steps of the example model."""

    run: str  # one of suites.COLDSTART_RUNS
    first_step_s: float = math.nan
    later_step_ms: float = math.nan  # median of the steps after the first
    process_s: float = math.nan  # the whole process: start, imports, model, all steps
    loss: float = math.nan  # first step's loss
    error: str = ""

    def record(self) -> dict[str, object]:
        return {"suite": "coldstart", "name": self.run, "first_step_s": self.first_step_s,
                "later_step_ms": self.later_step_ms, "process_s": self.process_s,
                "loss": self.loss, "error": self.error}


@dataclass
class RunResults:
    """Everything one run measured, by kind, plus suite-level notes (skips, failures)."""

    mm: list[GemmResult] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)
    grouped: list[GemmResult] = field(default_factory=list)
    scaled: list[GemmResult] = field(default_factory=list)
    sgrouped: list[GemmResult] = field(default_factory=list)
    moe: list[GemmResult] = field(default_factory=list)
    e2e: E2EResult | None = None
    coldstart: list[ColdStartResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def records(self) -> list[dict[str, object]]:
        """Every row as CSV fields, in report order."""
        rows = [r.record() for r in (*self.mm, *self.latency, *self.grouped, *self.scaled,
                                      *self.sgrouped, *self.moe)]
        if self.e2e is not None:
            rows.append(self.e2e.record())
        rows += [r.record() for r in self.coldstart]
        return rows
