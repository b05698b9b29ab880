"""Quantize high-precision tensors for tgemm::scaled_mm, and dequantize them back.

``quantize(x, recipe, operand)`` returns ``(data, scale)`` laid out as ``scaled_mm`` takes them,
for its a operand (x is [M, K]) or its b operand (x is [K, N]), so that ``data * scale``
(the scale broadcast over its block) approximates x:

    recipe               data                    scale_a                scale_b
    "tensorwise"         fp8                     float32, one element   float32, one element
    "rowwise"            fp8                     float32 [M, 1]         float32 [1, N]
    "blockwise_1x128"    fp8                     float32 [M, kb]        float32 [kb, N]
    "blockwise_128x128"  fp8                     [ceil(M/128), kb]      [kb, ceil(N/128)]
    "blockwise"          1x128 for a, 128x128 for b (DeepSeek-V3's recipe)
    "mxfp8"              fp8                     e8m0 [M, K/32]         e8m0 [K/32, N]
    "mxfp4"              float4_e2m1fn_x2        e8m0 [M, K/32]         e8m0 [K/32, N]
    "nvfp4"              float4_e2m1fn_x2        e4m3 [M, K/16]         e4m3 [K/16, N]

(kb = ceil(K/128), a partial last block allowed; fp4 data are [M, K/2] for a and [K/2, N] for
b, two values a byte along K, the even K index in the low nibble; e8m0 is float8_e8m0fnu, e4m3
float8_e4m3fn.) Data come back K-major, the layout Hopper's fp8 tensor cores want: a row-major,
b column-major (the transpose of a contiguous [N, K] tensor, as ``weight.t()`` is). a's 1x128
blockwise scales come back rows-contiguous (stride (1, M), torch's layout for them), which
Hopper's precise fp8 kernel reads by TMA; scaled_mm takes any strides.

Scales: fp8 recipes use float32 amax / (fp8 max). mxfp8 / mxfp4 use the power of two
2^ceil(log2(amax / format max)), so no value saturates. nvfp4 uses amax / 6 rounded to e4m3 and
clamped to e4m3's 448 (blocks with amax above 2688 saturate to ±6); the per-tensor second-level
scale some nvfp4 recipes add is left to the caller (fold it into the output or bias). All-zero
blocks get scale 1. fp4 values round to the nearest of 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 (ties
to the even code).

Quantization is not differentiable: outputs never require grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RECIPES = ("tensorwise", "rowwise", "blockwise", "blockwise_1x128", "blockwise_128x128",
           "mxfp8", "mxfp4", "nvfp4")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_DTYPE = torch.float4_e2m1fn_x2
FP4_MAX = 6.0

# e2m1 magnitudes by code (the low three bits); bit 3 is the sign.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes: rounding thresholds.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _blocks(recipe: str, operand: str, outer: int, k: int) -> tuple[int, int]:
    """(outer, K) extent of one scale's block for the operand seen as [outer, K]."""
    if recipe == "tensorwise":
        return max(outer, 1), max(k, 1)
    if recipe == "rowwise":
        return 1, max(k, 1)
    if recipe == "blockwise":
        recipe = "blockwise_1x128" if operand == "a" else "blockwise_128x128"
    if recipe == "blockwise_1x128":
        return 1, 128
    if recipe == "blockwise_128x128":
        return 128, 128
    return 1, (16 if recipe == "nvfp4" else 32)


def _check_args(recipe: str, operand: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {RECIPES}")
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' ([M, K]) or 'b' ([K, N]), got {operand!r}")


def _block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Max |x| over each [rows, cols] block of a 2-D tensor (partial edge blocks included)."""
    r, c = x.shape
    padded = F.pad(x.abs(), (0, (-c) % cols, 0, (-r) % rows))
    nr, nc = padded.shape[0] // rows, padded.shape[1] // cols
    return padded.reshape(nr, rows, nc, cols).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    """Each block's scale repeated over its block, cut to ``shape``."""
    full = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full[: shape[0], : shape[1]]


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8) of values already within [-6, 6], rounded to nearest even."""
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=v.dtype, device=v.device)
    mag = v.abs()
    low = torch.bucketize(mag, midpoints, right=False)  # a tie goes to the smaller magnitude
    high = torch.bucketize(mag, midpoints, right=True)  # ... or to the larger one
    code = torch.where(low % 2 == 0, low, high)  # the even code (mantissa bit 0) wins a tie
    return (code | torch.where(v < 0, 8, 0)).to(torch.uint8)


def _pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack [outer, K] codes two a byte along K (even K in the low nibble) as float4_e2m1fn_x2."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(FP4_DTYPE)


def _unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of [outer, K/2] packed e2m1 data as [outer, K] in ``dtype``."""
    p = packed.view(torch.uint8)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], p.shape[1] * 2).long()
    table = torch.tensor(_E2M1_VALUES, dtype=dtype, device=p.device)
    mag = table[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


@torch.no_grad()
def quantize(x: torch.Tensor, recipe: str, operand: str = "a", *,
             dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` for one operand of ``scaled_mm`` with one recipe.

    Args:
        x: a floating-point 2-D tensor: [M, K] for operand "a", [K, N] for operand "b".
        recipe: one of ``RECIPES`` (see the module docstring for the layouts).
        operand: "a" or "b": which side of the product x is (it fixes the scale's shape).
        dtype: the fp8 element type of fp8 recipes and mxfp8: float8_e4m3fn or float8_e5m2.

    Returns:
        ``(data, scale)``: data K-major (a row-major, b column-major), scale as scaled_mm reads
        it, with ``dequantize(data, scale, recipe, operand) ≈ x``.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(32, 256, dtype=torch.bfloat16)
        >>> data, scale = tg.quantize(x, "mxfp4", "a")   # [32, 128] fp4x2, [32, 8] e8m0
    """
    _check_args(recipe, operand)
    if x.dim() != 2 or not x.is_floating_point() or x.dtype in (*FP8_DTYPES, FP4_DTYPE):
        raise ValueError(f"quantize: x must be a 2-D high-precision floating tensor, got "
                         f"{x.dim()}-D {x.dtype}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize: dtype must be one of {FP8_DTYPES}, got {dtype}")
    xk = (x if operand == "a" else x.t()).float()  # [outer, K]
    outer, k = xk.shape
    rows, cols = _blocks(recipe, operand, outer, k)
    if recipe in ("mxfp8", "mxfp4", "nvfp4") and k % cols != 0:
        raise ValueError(f"quantize: {recipe} scales cover {cols} elements of K, so K must be a "
                         f"multiple of {cols}; got K={k}")
    if recipe == "tensorwise":
        amax = xk.abs().amax().reshape(1, 1) if xk.numel() else xk.new_zeros(1, 1)
    elif recipe == "rowwise":
        amax = xk.abs().amax(dim=1, keepdim=True) if k else xk.new_zeros(outer, 1)
    else:
        amax = _block_amax(xk, rows, cols)
    if recipe in ("mxfp4", "nvfp4"):
        elem_max = FP4_MAX
    else:
        elem_max = torch.finfo(dtype).max
    if recipe in ("mxfp8", "mxfp4"):
        exponent = torch.ceil(torch.log2(amax / elem_max))
        exponent = torch.where(amax > 0, exponent, 0.0).clamp(-127, 127)
        scale = (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    elif recipe == "nvfp4":
        scale = torch.where(amax > 0, amax / FP4_MAX, 1.0).clamp(max=448.0)
        scale = scale.to(torch.float8_e4m3fn)
    else:
        scale = torch.where(amax > 0, amax / elem_max, 1.0)
    factor = _expand(scale.float(), rows, cols, xk.shape)
    values = torch.where(factor > 0, xk / factor, 0.0).clamp(-elem_max, elem_max)
    if recipe in ("mxfp4", "nvfp4"):
        data = _pack_e2m1(_e2m1_codes(values))
    else:
        data = values.to(dtype)
    if recipe == "tensorwise":
        scale = scale.reshape(())
    if operand == "b":
        data, scale = data.t(), (scale.t() if scale.dim() == 2 else scale)
    elif rows == 1 and recipe.startswith("blockwise"):
        scale = scale.t().contiguous().t()  # rows-contiguous (see the module docstring)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, recipe: str, operand: str = "a", *,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The real values ``data * scale`` of a quantized operand, in ``dtype`` (exact in float64).

    ``data`` and ``scale`` are laid out as ``quantize`` returns them and ``scaled_mm`` takes
    them (for fp4, data is packed along K). The result is [M, K] for operand "a" and [K, N] for
    operand "b". Scales are applied as given (zero, negative or non-finite too).

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> w = torch.randn(64, 96)
        >>> wq, ws = tg.quantize(w.t(), "blockwise", "b")
        >>> w_approx = tg.dequantize(wq, ws, "blockwise", "b").t()   # float64 [64, 96]
    """
    _check_args(recipe, operand)
    dk = data if operand == "a" else data.t()
    sk = scale if (operand == "a" or scale.dim() != 2) else scale.t()
    if dk.dtype == FP4_DTYPE:
        values = _unpack_e2m1(dk, dtype)
    else:
        values = dk.to(dtype)
    scales = sk.float().to(dtype)  # e8m0 and e4m3 widen exactly through float32
    if scales.dim() != 2:
        out = values * scales.reshape(())
    else:
        rows, cols = _blocks(recipe, operand, values.shape[0], values.shape[1])
        out = values * _expand(scales, rows, cols, values.shape)
    return out if operand == "a" else out.t()
