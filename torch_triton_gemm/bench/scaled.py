"""The scaled suite: ``torch_triton_gemm.scaled_mm`` against ``torch._scaled_mm``, float8_e4m3fn
operands to a bfloat16 output. Needs a CUDA GPU (the quantization helpers run anywhere).

Both ops share one contract, ``scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None,
use_fast_accum=False)``: out = (a * scale_a) @ (b * scale_b), the recipe read from the scale
shapes. The operands are quantized here with plain torch, amax-based: each block of the input
gets scale = amax(|block|) / 448 (e4m3's largest value) and is stored as x / scale. The scales
take the shapes and strides torch._scaled_mm asks for:

    tensorwise  scale_a []                      scale_b []
    rowwise     scale_a [M, 1]                  scale_b [1, N]
    blockwise   scale_a [M, K/128], stride (1, M) (1x128 blocks of a)
                scale_b [K/128, N/128], stride (1, K/128) (128x128 blocks of W [N, K], transposed
                like b = W.t())

Where this torch cannot run a recipe (blockwise needs a recent torch and cuBLAS), the row
reports tgemm alone and "n/a" for torch. Accuracy: against the fp32 (IEEE) product of the
dequantized operands.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

import torch_triton_gemm as tg

from .gemm import ieee_fp32, relative_error
from .results import GemmResult
from .suites import ScaledCase
from .timing import Row, TimingSettings, compare, first_call, run_rows, short_error

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
OUT_DTYPE = torch.bfloat16
BLOCK = 128


def missing_reason() -> str | None:
    """Why the suite cannot run with this package, or None."""
    if not hasattr(tg, "scaled_mm"):
        return "torch_triton_gemm has no scaled_mm in this version"
    return None


def quantize(x: torch.Tensor, block_rows: int,
             block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values of x [R, C] and fp32 dequantization scales [R / block_rows,
    C / block_cols], one per block (the blocks must tile x)."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    per_element = scale.reshape(scale.shape[0], 1, scale.shape[1], 1)
    q = (blocks / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows, cols), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``quantize``'s output."""
    rows_per_scale = q.shape[0] // scale.shape[0]
    cols_per_scale = q.shape[1] // scale.shape[1]
    full = scale.repeat_interleave(rows_per_scale, 0).repeat_interleave(cols_per_scale, 1)
    return q.float() * full


def make_inputs(case: ScaledCase, device: torch.device | str, reference: bool = True
                ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                           torch.Tensor | None]:
    """Fresh random operands quantized with the case's recipe: ((a, b, scale_a, scale_b), the
    fp32 reference product of the dequantized operands, or None without ``reference``: the
    dequantized copies are fp32, four times the operands' bytes)."""
    m, n, k = case.m, case.n, case.k
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)  # the weight, nn.Linear's [N, K]
    if case.recipe == "tensorwise":
        (a, sa), (wq, sw) = quantize(x, m, k), quantize(w, n, k)
        scale_a, scale_b = sa.reshape(()), sw.reshape(())
    elif case.recipe == "rowwise":
        (a, sa), (wq, sw) = quantize(x, 1, k), quantize(w, 1, k)
        scale_a, scale_b = sa, sw.reshape(1, n)
    elif case.recipe == "blockwise":
        (a, sa), (wq, sw) = quantize(x, 1, BLOCK), quantize(w, BLOCK, BLOCK)
        scale_a, scale_b = sa.t().contiguous().t(), sw.t()
    else:
        raise ValueError(f"unknown scaling recipe {case.recipe!r}")
    del x, w
    if not reference:
        return (a, wq.t(), scale_a, scale_b), None
    with ieee_fp32():
        ref = dequantize(a, sa) @ dequantize(wq, sw).t()
    return (a, wq.t(), scale_a, scale_b), ref


def _tgemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
           scale_b: torch.Tensor, fast: bool = False) -> torch.Tensor:
    return tg.scaled_mm(a, b, scale_a, scale_b, out_dtype=OUT_DTYPE, use_fast_accum=fast)


def _torch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
           scale_b: torch.Tensor, fast: bool = False) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=OUT_DTYPE, use_fast_accum=fast)


def measure_scaled(case: ScaledCase, settings: TimingSettings,
                   device: torch.device) -> GemmResult:
    """Time tgemm.scaled_mm and torch._scaled_mm (when it supports the recipe) on the same
    quantized operands; check tgemm against the dequantized fp32 product."""
    args, ref = make_inputs(case, device)
    tgemm_fn, torch_fn = (functools.partial(fn, fast=case.fast) for fn in (_tgemm, _torch))
    out, first_s = first_call(lambda: tgemm_fn(*args))
    rel_err = relative_error(out, ref)
    del out, ref
    fns = {"tgemm": tgemm_fn, "torch": torch_fn}
    notes = []
    try:
        torch_fn(*args)
    except Exception as exc:  # e.g. blockwise scales on an older torch or cuBLAS
        notes.append(f"torch._scaled_mm n/a ({short_error(exc)})")
        del fns["torch"]
    timings = compare(fns, args, settings)
    return GemmResult(case, "fp8", timings.kernel_ms, timings.eager_ms, rel_err, "fp32 deq",
                      first_s, note="; ".join(notes + timings.notes))


def run_scaled(cases: Sequence[ScaledCase], settings: TimingSettings,
               device: torch.device) -> list[GemmResult]:
    """Every case of the scaled suite."""
    return run_rows([
        Row(case.label(),
            lambda c=case: measure_scaled(c, settings, device),
            lambda message, c=case: GemmResult(c, "fp8", error=message))
        for case in cases])
