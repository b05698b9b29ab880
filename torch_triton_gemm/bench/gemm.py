"""The mm suites (tgemm.mm against torch.mm, and with ``--inductor`` Inductor's Triton GEMM
templates) and the host-latency suite. Needs a CUDA GPU."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

import torch_triton_gemm as tg

from .results import GemmResult, LatencyResult
from .suites import Case
from .timing import (
    Row,
    TimingSettings,
    compare,
    first_call,
    host_us_per_call,
    run_rows,
    short_error,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# A float64 reference costs a float64 GEMM (slow even on GPUs with fp64 tensor cores) and 4x
# the memory of the operands, so only small products get one.
FP64_REF_LIMIT = 2**31

# The --inductor peer: torch.mm compiled by Inductor with its Triton GEMM templates only.
INDUCTOR_MODE = "max-autotune-no-cudagraphs"
# Inductor config for it, set where the installed torch has the name (they move between
# versions): Triton templates only, no quiet fallback to aten (that would time cuBLAS), and the
# persistent TMA template where there is one.
INDUCTOR_CONFIG = {
    "max_autotune_gemm_backends": "TRITON",
    "autotune_fallback_to_aten": False,
    "triton.enable_persistent_tma_matmul": True,
}


def _operand(case: Case, operand: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    rows, columns, pad, transposed = case.stored(operand)
    # The first columns of the buffer, so that copies with the same strides (timing.py's
    # rotating operands) have the same alignment too.
    x = torch.randn(rows, columns + pad, device=device, dtype=dtype)[:, :columns]
    return x.t() if transposed else x


def make_operands(case: Case, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random a [M, K] and b [K, N] with the case's layouts and padded row strides
    (never zeros: those would hide wrong results and, on some GPUs, draw less power and run
    faster)."""
    return _operand(case, "a", dtype, device), _operand(case, "b", dtype, device)


def _has_config(config: object, name: str) -> bool:
    for part in name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def inductor_config() -> dict[str, object]:
    """The entries of INDUCTOR_CONFIG that the installed torch's Inductor config has."""
    from torch._inductor import config

    return {name: value for name, value in INDUCTOR_CONFIG.items() if _has_config(config, name)}


def _inductor_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


def compile_inductor_mm(a: torch.Tensor, b: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``torch.mm`` compiled for these operands' shapes and strides, compiled and tuned by a
    first call here (made under ``torch._inductor.config.patch(inductor_config())``)."""
    # A fresh cache per shape: with dynamic=False every shape is a recompile, and past
    # dynamo's recompile limit calls would quietly run eager.
    torch._dynamo.reset()
    compiled = torch.compile(_inductor_mm, mode=INDUCTOR_MODE, dynamic=False)
    compiled(a, b)
    torch.cuda.synchronize()
    return compiled


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in ref's dtype."""
    return ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()


def measure_mm(case: Case, dtype_name: str, settings: TimingSettings,
               device: torch.device, inductor: bool = False) -> GemmResult:
    """Time tgemm.mm and torch.mm (and with ``inductor`` a compiled torch.mm) on the same fresh
    operands and check tgemm's accuracy.

    ``err vs`` is "fp64" when the product is small enough for a float64 reference, else
    "torch": agreement with torch.mm's output, not error. A compile that fails leaves the row
    without Inductor times, and a note that says why.
    """
    a, b = make_operands(case, DTYPES[dtype_name], device)
    out, first_s = first_call(lambda: tg.mm(a, b))
    if case.m * case.n * case.k <= FP64_REF_LIMIT:
        rel_err, err_vs = relative_error(out, torch.mm(a.double(), b.double())), "fp64"
    else:
        rel_err, err_vs = relative_error(out, torch.mm(a, b).float()), "torch"
    del out
    fns: dict[str, Callable[..., torch.Tensor]] = {"tgemm": tg.mm, "torch": torch.mm}
    notes = []
    with contextlib.ExitStack() as stack:
        if inductor:
            from torch._inductor import config

            # Kept through the timing too: the compiled function never runs under another
            # config than the one it was compiled with.
            stack.enter_context(config.patch(inductor_config()))
            try:
                fns["inductor"] = compile_inductor_mm(a, b)
            except Exception as exc:  # reported in the row's note; tgemm and torch still run
                notes.append(f"inductor: compile failed ({short_error(exc)})")
        timings = compare(fns, (a, b), settings)
    return GemmResult(case, dtype_name, timings.kernel_ms, timings.eager_ms, rel_err, err_vs,
                      first_s, note="; ".join([*notes, *timings.notes]))


def run_mm(cases: Sequence[Case], dtype_names: Sequence[str], settings: TimingSettings,
           device: torch.device, inductor: bool = False) -> list[GemmResult]:
    """Every (dtype, case) pair of the mm suites, dtype outermost; ``inductor`` adds the
    compiled torch.mm peer."""
    return run_rows([
        Row(f"{case.label()} {dtype}",
            lambda c=case, d=dtype: measure_mm(c, d, settings, device, inductor),
            lambda message, c=case, d=dtype: GemmResult(c, d, error=message))
        for dtype in dtype_names for case in cases])


def measure_latency(case: Case, dtype_name: str, device: torch.device) -> LatencyResult:
    """Host time per eager call of the registered op, the Python function and torch.mm; for
    ``dtype_name`` "fp8", of the scaled_mm path in those roles (``SCALED_LATENCY_NAMES``:
    e4m3 operands, tensorwise scales, bf16 out, b as W.t())."""
    if dtype_name == "fp8":
        a, b = make_operands(case, torch.bfloat16, device)
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        fns = {
            "torch.ops.tgemm.mm": lambda x, y: torch.ops.tgemm.scaled_mm(
                x, y, one, one, None, torch.bfloat16, False),
            "tgemm.mm": lambda x, y: tg.scaled_mm(x, y, one, one, out_dtype=torch.bfloat16),
            "torch.mm": lambda x, y: torch._scaled_mm(x, y, one, one,
                                                      out_dtype=torch.bfloat16),
        }
    else:
        a, b = make_operands(case, DTYPES[dtype_name], device)
        fns = {
            "torch.ops.tgemm.mm": lambda x, y: torch.ops.tgemm.mm(x, y, None, "none", None),
            "tgemm.mm": tg.mm,
            "torch.mm": torch.mm,
        }
    # The first calls tune the size bucket; host_us_per_call warms up after that.
    first_call(lambda: fns["tgemm.mm"](a, b))
    return LatencyResult(case, dtype_name, host_us_per_call(fns, (a, b)))


def run_latency(cases: Sequence[Case], dtype_names: Sequence[str],
                device: torch.device) -> list[LatencyResult]:
    """The latency suite's rows for every dtype, then the fp8 scaled_mm path's."""
    return run_rows([
        Row(f"{case.label()} {dtype} host time",
            lambda c=case, d=dtype: measure_latency(c, d, device),
            lambda message, c=case, d=dtype: LatencyResult(c, d, error=message))
        for dtype in (*dtype_names, "fp8") for case in cases])


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
