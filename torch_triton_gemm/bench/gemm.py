"""The mm suites (tgemm.mm against torch.mm) and the host-latency suite. Needs a CUDA GPU."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

import torch_triton_gemm as tg

from .results import GemmResult, LatencyResult
from .suites import Case
from .timing import Row, TimingSettings, compare, first_call, host_us_per_call, run_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# A float64 reference costs a float64 GEMM (slow even on GPUs with fp64 tensor cores) and 4x
# the memory of the operands, so only small products get one.
FP64_REF_LIMIT = 2**31


def make_operands(case: Case, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random a [M, K] and b [K, N] with the case's layouts (never zeros: those would
    hide wrong results and, on some GPUs, draw less power and run faster)."""
    m, n, k = case.m, case.n, case.k
    if case.a_layout == "row":
        a = torch.randn(m, k, device=device, dtype=dtype)
    else:
        a = torch.randn(k, m, device=device, dtype=dtype).t()
    if case.b_layout == "col":
        b = torch.randn(n, k, device=device, dtype=dtype).t()
    else:
        b = torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in ref's dtype."""
    return ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()


def measure_mm(case: Case, dtype_name: str, settings: TimingSettings,
               device: torch.device) -> GemmResult:
    """Time tgemm.mm and torch.mm on the same fresh operands and check tgemm's accuracy.

    ``err vs`` is "fp64" when the product is small enough for a float64 reference, else
    "torch": agreement with torch.mm's output, not error.
    """
    a, b = make_operands(case, DTYPES[dtype_name], device)
    out, first_s = first_call(lambda: tg.mm(a, b))
    if case.m * case.n * case.k <= FP64_REF_LIMIT:
        rel_err, err_vs = relative_error(out, torch.mm(a.double(), b.double())), "fp64"
    else:
        rel_err, err_vs = relative_error(out, torch.mm(a, b).float()), "torch"
    del out
    timings = compare({"tgemm": tg.mm, "torch": torch.mm}, (a, b), settings)
    return GemmResult(case, dtype_name, timings.kernel_ms, timings.eager_ms, rel_err, err_vs,
                      first_s, note="; ".join(timings.notes))


def run_mm(cases: Sequence[Case], dtype_names: Sequence[str], settings: TimingSettings,
           device: torch.device) -> list[GemmResult]:
    """Every (dtype, case) pair of the mm suites, dtype outermost."""
    return run_rows([
        Row(f"{case.label()} {dtype}",
            lambda c=case, d=dtype: measure_mm(c, d, settings, device),
            lambda message, c=case, d=dtype: GemmResult(c, d, error=message))
        for dtype in dtype_names for case in cases])


def measure_latency(case: Case, dtype_name: str, device: torch.device) -> LatencyResult:
    """Host time per eager call of the registered op, the Python function and torch.mm."""
    a, b = make_operands(case, DTYPES[dtype_name], device)
    fns = {
        "torch.ops.tgemm.mm": lambda x, y: torch.ops.tgemm.mm(x, y, None, "none", None),
        "tgemm.mm": tg.mm,
        "torch.mm": torch.mm,
    }
    # The first calls tune the size bucket; host_us_per_call warms up after that.
    first_call(lambda: tg.mm(a, b))
    return LatencyResult(case, dtype_name, host_us_per_call(fns, (a, b)))


def run_latency(cases: Sequence[Case], dtype_names: Sequence[str],
                device: torch.device) -> list[LatencyResult]:
    """The latency suite's rows for every dtype."""
    return run_rows([
        Row(f"{case.label()} {dtype} host time",
            lambda c=case, d=dtype: measure_latency(c, d, device),
            lambda message, c=case, d=dtype: LatencyResult(c, d, error=message))
        for dtype in dtype_names for case in cases])


# --- accuracy helpers shared by the grouped and scaled suites -----------------------------------

@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in full IEEE precision (no tf32) inside the block, for references."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def relative_error_of_pieces(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """||out - ref|| / ||ref|| over a tensor given as (out piece, fp32 ref piece) pairs, so
    that a large reference never exists whole."""
    diff = norm = 0.0
    for out, ref in pairs:
        diff += (out.float() - ref).norm().item() ** 2
        norm += ref.norm().item() ** 2
    return math.sqrt(diff / norm) if norm > 0 else math.nan
