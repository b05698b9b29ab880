"""tgemm::scaled_mm — out = (a * scale_a) @ (b * scale_b) + bias for fp8 and fp4 operands.

Contract (``torch._scaled_mm``'s, for the recipes below):
    scaled_mm(a: Tensor[M, K], b: Tensor[K, N], scale_a: Tensor, scale_b: Tensor,
              bias: Tensor[N] | None = None, out_dtype: torch.dtype | None = None,
              use_fast_accum: bool = False) -> Tensor[M, N]

A scale multiplies its operand's elements (it dequantizes: ``a * scale_a`` is the real value).
The recipe is read from the dtypes and the scale shapes, in this order:

    recipe      a, b dtype                  scales          scale_a            scale_b
    tensorwise  float8_e4m3fn / float8_e5m2  float32         one element        one element
    rowwise     float8_e4m3fn / float8_e5m2  float32         [M, 1] (or one)    [1, N] (or one)
    blockwise   float8_e4m3fn / float8_e5m2  float32         [M, kb] (1x128)    [kb, ceil(N/128)]
                                                             [ceil(M/128), kb]  [kb, N] (1x128)
    mxfp8       float8_e4m3fn / float8_e5m2  float8_e8m0fnu  [M, K/32]          [K/32, N]
    mxfp4       float4_e2m1fn_x2             float8_e8m0fnu  [M, K/32]          [K/32, N]
    nvfp4       float4_e2m1fn_x2             float8_e4m3fn   [M, K/16]          [K/16, N]

with kb = ceil(K / 128) (128x128 blocks cover 128 rows of a or 128 columns of b and 128 of K).
Scales are indexed like their operand: scale_a[row block, K block], scale_b[K block, column
block]; any strides (``W_scale.t()`` of a weight's [N, K/32] scales is fine). fp4 operands hold
two values a byte packed along K (the even K index in the low nibble), so a is [M, K/2] and b is
[K/2, N]; fp8 and fp4 operands may be mixed under e8m0 scales (mxfp8 x mxfp4).

- out_dtype: bfloat16 (the default; torch's default, the fp8 input dtype, is not offered),
  float16 or float32. Accumulation is fp32; ``use_fast_accum=True`` lets Hopper's fp8 tensor
  cores sum a whole K loop in their reduced-precision accumulator (faster, less exact); False
  adds every BLOCK_K-deep product into fp32.
- bias: optional [N] (float16 / bfloat16 / float32), added in fp32 after the scales.
- Any strides for a and b (b as ``W.t()`` is fastest: both operands K-major) and any M, N, K.
  Blockwise accepts a K that is not a multiple of 128 (a last, partial scale block); the
  microscaled recipes need K to be a multiple of their scale block (32, or 16 for nvfp4).
- Scales are used as given, with no check that would synchronise with the GPU: a zero scale
  zeroes its block, a negative one negates it, inf or NaN propagate to the outputs they touch.
- Autograd: gradients flow to bias; asking for gradients of a, b or the scales is an error.

This module reads top to bottom: recipe detection and checks, the op body (choose the kernel
path, launch), the fake, registration, autograd, and the typed public function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import device as _device
from .. import plan_cache, tuning
from ..kernels.scaled import scaled_mm_kernel
from ._registry import define_triton_op, explain_bad_arguments
from .checks import (
    BLOCKWISE_K,
    blockwise_scale_blocks,
    ceil_div,
    check,
    check_epilogue_args,
    check_value,
    needs_int64_indexing,
)
from .launcher import (
    GemmScales,
    PreparedLaunch,
    kept,
    launch_kernel,
    launch_mm,
    memoised_eager_call,
    plain_eager_grad,
    prepare_launch,
    run_kept,
    tensor_key,
)
from .planner import fp8_precise_plan, plan_mm

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_DTYPE = torch.float4_e2m1fn_x2
INPUT_DTYPES = (*FP8_DTYPES, FP4_DTYPE)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu, torch.float8_e4m3fn)
MX_BLOCK = 32  # K elements per e8m0 scale (mxfp8, mxfp4)
NVFP4_BLOCK = 16  # K elements per e4m3 scale (nvfp4)

# Element formats as tl.dot_scaled names them.
_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", FP4_DTYPE: "e2m1"}

@dataclass(frozen=True)
class Recipe:
    """How scaled_mm reads the scales, as decided from dtypes and scale shapes."""

    name: str  # "tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4", "mxfp8 x mxfp4"
    scaling: str  # the kernel's SCALING: "outer", "block" or "micro"
    scale_format: str  # "fp32", "e8m0" or "e4m3"
    scale_k: int = 0  # K elements per scale (block and micro)
    a_rows: int = 1  # rows of a per scale (block: 1 or 128)
    b_cols: int = 1  # columns of b per scale (block: 1 or 128)


# --- recipe detection and checks ----------------------------------------------------------------

def _shape(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape)


def _pack(dtype: torch.dtype) -> int:
    return 2 if dtype == FP4_DTYPE else 1


def _fp32_scale_recipe(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, K: Any) -> Recipe:
    """tensorwise, rowwise or blockwise, from the shapes of float32 scales (torch's order)."""
    m, n = a.shape[0], b.shape[1]
    check_value(
        a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES,
        lambda: f"tgemm::scaled_mm: float32 scales (tensorwise, rowwise, blockwise) go with fp8 "
                f"operands, got a {a.dtype} and b {b.dtype}; fp4 operands take float8_e8m0fnu "
                f"(mxfp4) or float8_e4m3fn (nvfp4) scales")
    a_one, b_one = scale_a.numel() == 1, scale_b.numel() == 1
    if a_one and b_one:
        return Recipe("tensorwise", "outer", "fp32")
    a_rows = scale_a.dim() == 2 and _shape(scale_a) == (m, 1)
    b_cols = scale_b.dim() == 2 and _shape(scale_b) == (1, n)
    if (a_one or a_rows) and (b_one or b_cols):
        return Recipe("rowwise", "outer", "fp32")
    kb = ceil_div(K, BLOCKWISE_K)
    a_group = b_group = None
    if scale_a.dim() == 2 and scale_b.dim() == 2:
        a_group, b_group = blockwise_scale_blocks(_shape(scale_a), _shape(scale_b), m, n, K)
    check(
        a_group is not None and b_group is not None,
        lambda: f"tgemm::scaled_mm: scale shapes fit no recipe: got scale_a "
                f"{_shape(scale_a)} and scale_b {_shape(scale_b)} for a {_shape(a)} and b "
                f"{_shape(b)} (M={m}, N={n}, K={K}). Tensorwise: one element each. Rowwise: "
                f"scale_a ({m}, 1), scale_b (1, {n}). Blockwise (kb = ceil(K/128) = {kb}): "
                f"scale_a ({m}, {kb}) for 1x128 or ({ceil_div(m, 128)}, {kb}) for 128x128 "
                f"blocks, scale_b ({kb}, {ceil_div(n, 128)}) for 128x128 or ({kb}, {n}) for "
                f"1x128 blocks")
    return Recipe("blockwise", "block", "fp32", BLOCKWISE_K, a_group, b_group)


def _microscaling_recipe(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                         scale_b: torch.Tensor, K: Any) -> Recipe:
    """mxfp8 / mxfp4 (e8m0 scales per 32) or nvfp4 (e4m3 scales per 16)."""
    if scale_a.dtype == torch.float8_e8m0fnu:
        names = {torch.float8_e4m3fn: "mxfp8", torch.float8_e5m2: "mxfp8", FP4_DTYPE: "mxfp4"}
        name_a, name_b = names[a.dtype], names[b.dtype]
        name = name_a if name_a == name_b else f"{name_a} x {name_b}"
        recipe = Recipe(name, "micro", "e8m0", MX_BLOCK)
    else:
        check_value(
            a.dtype == FP4_DTYPE and b.dtype == FP4_DTYPE,
            lambda: f"tgemm::scaled_mm: float8_e4m3fn scales are nvfp4's and go with "
                    f"float4_e2m1fn_x2 operands, got a {a.dtype} and b {b.dtype}; fp8 operands "
                    f"take float32 (tensorwise, rowwise, blockwise) or float8_e8m0fnu (mxfp8) "
                    f"scales")
        recipe = Recipe("nvfp4", "micro", "e4m3", NVFP4_BLOCK)
    block = recipe.scale_k
    m, n = a.shape[0], b.shape[1]
    check_value(
        K % block == 0,
        lambda: f"tgemm::scaled_mm: {recipe.name} scales cover {block} elements of K, so K must "
                f"be a multiple of {block}; got K={K} (a {_shape(a)}, b {_shape(b)})")
    kb = K // block
    check(
        _shape(scale_a) == (m, kb) and _shape(scale_b) == (kb, n),
        lambda: f"tgemm::scaled_mm: {recipe.name} takes one {scale_a.dtype} scale per {block} "
                f"elements along K: scale_a ({m}, {kb}) and scale_b ({kb}, {n}) for M={m}, "
                f"N={n}, K={K}; got scale_a {_shape(scale_a)} and scale_b {_shape(scale_b)}")
    return recipe


def _check_inputs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None) -> tuple[torch.dtype, Recipe]:
    """Validate the arguments (also under FakeTensor and symbolic shapes); return the out dtype
    and the recipe."""
    check(a.dim() == 2, lambda: f"tgemm::scaled_mm: a must be 2-D [M, K], got {a.dim()}-D of "
                                 f"shape {_shape(a)}")
    check(b.dim() == 2, lambda: f"tgemm::scaled_mm: b must be 2-D [K, N], got {b.dim()}-D of "
                                 f"shape {_shape(b)}")
    for name, t in (("a", a), ("b", b)):
        check_value(
            t.dtype in INPUT_DTYPES,
            lambda name=name, t=t: f"tgemm::scaled_mm: {name} has dtype {t.dtype}; scaled_mm "
                                   f"takes quantized operands: float8_e4m3fn, float8_e5m2 or "
                                   f"float4_e2m1fn_x2 (quantize them with "
                                   f"torch_triton_gemm.quantize, or use tgemm.mm for "
                                   f"{t.dtype} operands)")
    for name, t in (("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias)):
        if t is not None:
            check(t.device == a.device,
                  lambda name=name, t=t: f"tgemm::scaled_mm: {name} is on {t.device} but a is "
                                          f"on {a.device}")
            check(t.layout == torch.strided,
                  lambda name=name, t=t: f"tgemm::scaled_mm: {name} must be a dense (strided) "
                                          f"tensor, got {t.layout}")
    k_a, k_b = a.shape[1] * _pack(a.dtype), b.shape[0] * _pack(b.dtype)
    check(
        k_a == k_b,
        lambda: f"tgemm::scaled_mm: a has K={k_a} but b has K={k_b} (a is {_shape(a)} "
                f"{a.dtype}, b is {_shape(b)} {b.dtype}; float4_e2m1fn_x2 holds two elements "
                f"of K a byte)")
    check_value(
        scale_a.dtype == scale_b.dtype and scale_a.dtype in SCALE_DTYPES,
        lambda: f"tgemm::scaled_mm: scale_a and scale_b must share one scale dtype: float32 "
                f"(tensorwise, rowwise, blockwise), float8_e8m0fnu (mxfp8, mxfp4) or "
                f"float8_e4m3fn (nvfp4); got scale_a {scale_a.dtype} and scale_b "
                f"{scale_b.dtype}")
    if scale_a.dtype == torch.float32:
        recipe = _fp32_scale_recipe(a, b, scale_a, scale_b, k_a)
    else:
        recipe = _microscaling_recipe(a, b, scale_a, scale_b, k_a)
    if out_dtype is None:
        out_dtype = torch.bfloat16
    check_epilogue_args("tgemm::scaled_mm", out_dtype, bias, b.shape[1])
    return out_dtype, recipe


def _check_no_quantized_grads(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                              scale_b: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        check(
            not t.requires_grad,
            lambda name=name, t=t: (
                f"tgemm::scaled_mm: {name} ({t.dtype}) requires grad, but scaled_mm's quantized "
                f"operands and their scales have no gradient: they are a rounded copy of a "
                f"high-precision tensor, rounding has no useful derivative, and an fp8 or fp4 "
                f"tensor cannot hold one. Only bias is differentiable: pass {name}.detach(), "
                f"and differentiate through the high-precision tensor you quantized (e.g. with "
                f"a straight-through estimator around quantize + scaled_mm)"))


# --- the op body --------------------------------------------------------------------------------

def _scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None,
                    use_fast_accum: bool = False) -> torch.Tensor:
    """Shapes, dtypes and strides only: a row-major [M, N] tensor of the out dtype."""
    out_dtype, _ = _check_inputs(a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _scaled_mm_impl(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None,
                    use_fast_accum: bool = False) -> torch.Tensor:
    if _runs_on_hopper_kernel(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        return torch.ops.tgemm._scaled_mm_hopper(a, b, scale_a, scale_b, bias, out_dtype,
                                                  use_fast_accum)
    return _allocate_and_launch(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                traceable=True)


def _runs_on_hopper_kernel(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                           scale_b: torch.Tensor, bias: torch.Tensor | None,
                           out_dtype: torch.dtype | None, use_fast_accum: bool) -> bool:
    """Whether a traced call runs on Hopper's warp-specialized Gluon kernel (known sizes and a
    product its plan takes): Inductor re-parses the Triton kernels a graph launches and cannot
    parse Gluon, so such calls go through the opaque ``tgemm::_scaled_mm_hopper``."""
    out_dtype, recipe = _check_inputs(a, b, scale_a, scale_b, bias, out_dtype)
    M, N = a.shape[0], b.shape[1]
    if (recipe.scaling not in ("outer", "block") or type(M) is not int or type(N) is not int
            or type(a.shape[1]) is not int or M == 0 or N == 0
            or _device.interpreter_enabled()):
        return False
    out = a.new_empty((M, N), dtype=out_dtype)
    scales = _gemm_scales(recipe, scale_a, scale_b, use_fast_accum)
    return fp8_precise_plan(a, b, out, scales) is not None


@torch.library.custom_op("tgemm::_scaled_mm_hopper", mutates_args=())
def _scaled_mm_hopper(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None, use_fast_accum: bool) -> torch.Tensor:
    """tgemm::scaled_mm's traced calls that run on Hopper's warp-specialized kernel, opaque to
    tracing (see ``_runs_on_hopper_kernel``); the same checks, plan and launch as an eager
    call."""
    return _allocate_and_launch(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                traceable=False)


@_scaled_mm_hopper.register_fake
def _scaled_mm_hopper_fake(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                           scale_b: torch.Tensor, bias: torch.Tensor | None,
                           out_dtype: torch.dtype | None,
                           use_fast_accum: bool) -> torch.Tensor:
    return _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                         scale_b: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype | None, use_fast_accum: bool,
                         traceable: bool) -> torch.Tensor:
    out_dtype, recipe = _check_inputs(a, b, scale_a, scale_b, bias, out_dtype)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    launch_scaled_mm(a, b, scale_a, scale_b, bias, out, recipe, use_fast_accum, traceable)
    return out


def _as_kernel_arg(t: torch.Tensor) -> torch.Tensor:
    # Triton has no fp4 or e8m0 pointer types: the kernel reads their bytes.
    if t.dtype in (FP4_DTYPE, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    return t


def _scale_strides(recipe: Recipe, scale_a: torch.Tensor,
                   scale_b: torch.Tensor) -> tuple[Any, Any, Any, Any]:
    """(stride_sam, stride_sak, stride_sbk, stride_sbn): a one-element scale is read with stride
    0 wherever its row or column index is."""
    if recipe.scaling == "outer":
        stride_sam = 0 if scale_a.numel() == 1 else scale_a.stride(0)
        stride_sbn = 0 if scale_b.numel() == 1 else scale_b.stride(1)
        return stride_sam, 0, 0, stride_sbn
    return (*scale_a.stride(), *scale_b.stride())


def _gemm_scales(recipe: Recipe, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 use_fast_accum: bool) -> GemmScales:
    """The scales of an fp8 recipe (tensorwise, rowwise, blockwise) as the GEMM kernels read
    them."""
    return GemmScales(recipe.scaling, scale_a, scale_b, _scale_strides(recipe, scale_a, scale_b),
                      recipe.a_rows, recipe.b_cols, bool(use_fast_accum))


def launch_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                     recipe: Recipe, use_fast_accum: bool = False, traceable: bool = True,
                     native: bool | None = None, tile: tuning.TileConfig | None = None) -> None:
    """Launch the kernels writing (a * scale_a) @ (b * scale_b) + bias into ``out``.

    Inputs must have been checked (``recipe`` comes from the checks). The fp8 recipes
    (tensorwise, rowwise, blockwise) run on tgemm::mm's GEMM kernels and plans (the persistent
    TMA kernel on Hopper, split-K) with the scales applied in their K loop or epilogue; the
    microscaled ones run on ``scaled_mm_kernel``. ``native`` picks the microscaled path:
    ``tl.dot_scaled`` (True) or in-register decoding (False); None asks
    ``device.supports_native_fp4``. ``tile`` forces one tile instead of the planned one.
    ``traceable=False`` launches the Triton kernels directly, for plain eager calls that nothing
    traces.
    """
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"tgemm::scaled_mm: {error}")
    M, N = a.shape[0], b.shape[1]
    K = a.shape[1] * _pack(a.dtype)
    if M == 0 or N == 0:
        return
    if recipe.scaling in ("outer", "block"):
        scales = _gemm_scales(recipe, scale_a, scale_b, use_fast_accum)
        plan = (plan_mm(a, b, bias, out, "none", traceable, scales) if tile is None
                else tuning.MMPlan("portable", tile))
        launch_mm(a, b, bias, out, "none", traceable, plan, scales)
        return
    scaling = "micro"
    if native is None:
        native = _device.supports_native_fp4(a.device)
    if native:
        # The interpreter's dot_scaled reads every scale as e8m0.
        check(not (_device.interpreter_enabled() and recipe.scale_format == "e4m3"),
              lambda: "tgemm::scaled_mm: Triton's interpreter has no e4m3-scaled dot_scaled")
        scaling = "micro_native"
    stride_am, stride_ak = a.stride()
    stride_bk, stride_bn = b.stride()
    stride_cm, stride_cn = out.stride()
    stride_sam, stride_sak, stride_sbk, stride_sbn = _scale_strides(recipe, scale_a, scale_b)
    index_64 = needs_int64_indexing(((M, a.shape[1], stride_am, stride_ak),
                                     (b.shape[0], N, stride_bk, stride_bn),
                                     (M, N, stride_cm, stride_cn)))
    # Runtime arguments in scaled_mm_kernel's order; the tile's meta-parameters come after them.
    args = (
        _as_kernel_arg(a), _as_kernel_arg(b), out, bias,
        _as_kernel_arg(scale_a), _as_kernel_arg(scale_b),
        M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        bias.stride(0) if bias is not None else 0,
        stride_sam, stride_sak, stride_sbk, stride_sbn,
        scaling, _FORMAT[a.dtype], _FORMAT[b.dtype], recipe.scale_format, recipe.scale_k,
        bias is not None, _device.interpreter_enabled(), index_64,
    )
    if tile is None:
        tile = tuning.heuristic_scaled_mm_tile(M, N, scaling)
    grid = (tuning.output_tiles(M, N, tile),)
    kernel_meta = tuning.tile_meta(tile)
    launch_kernel(scaled_mm_kernel, grid, args, kernel_meta, traceable)


# --- plain eager calls ----------------------------------------------------------------------------
# As for tgemm::mm (see memoised_eager_call): an eager call of an fp8 recipe (float32
# scales) memoises its checks and launch per call signature, which fixes everything they depend
# on: shapes, strides, dtypes, devices and 16-byte alignment of every tensor, out dtype, the
# accumulation mode. The microscaled recipes launch their own kernel on every call.

def _eager_signature(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype | None, use_fast_accum: bool) -> tuple[Any, ...]:
    # The parts of tensor_key of a, b and the scales in one flat tuple (cheaper to build and
    # hash than nested ones).
    return ("tgemm::scaled_mm", a.shape, b.shape, scale_a.shape, scale_b.shape,
            a.stride(), b.stride(), scale_a.stride(), scale_b.stride(),
            a.dtype, b.dtype, scale_a.dtype, scale_b.dtype,
            a.device, b.device, scale_a.device, scale_b.device,
            a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, scale_a.data_ptr() % 16 == 0,
            scale_b.data_ptr() % 16 == 0, None if bias is None else tensor_key(bias), out_dtype,
            bool(use_fast_accum), plan_cache.TUNED.version)


def _scaled_mm_eager(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None,
                     use_fast_accum: bool = False) -> torch.Tensor:
    """The op body for eager calls on real tensors: kernels launched without wrap_triton,
    checks and launch arithmetic of the fp8 recipes memoised per call signature."""
    if scale_a.dtype != torch.float32 or tuning.forced_plan() is not None:
        return _allocate_and_launch(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                    traceable=False)
    signature = _eager_signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    out, prepared = memoised_eager_call(signature, _first_eager_call, a, b, scale_a, scale_b,
                                        bias, out_dtype, use_fast_accum)
    if prepared is not None:
        run_kept(prepared, a, b, bias, out, scale_a, scale_b)
    return out


def _first_eager_call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None, use_fast_accum: bool
                      ) -> tuple[torch.Tensor, PreparedLaunch | None]:
    """The checks, the output and the launch to keep of a signature's first eager call."""
    out_dtype_checked, recipe = _check_inputs(a, b, scale_a, scale_b, bias, out_dtype)
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"tgemm::scaled_mm: {error}")
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype_checked)
    if out.numel() == 0:
        return out, None
    scales = _gemm_scales(recipe, scale_a, scale_b, use_fast_accum)
    plan = plan_mm(a, b, bias, out, "none", False, scales)
    return out, kept(prepare_launch(a, b, bias, out, "none", False, plan, scales))


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.scaled_mm on real tensors reach _scaled_mm_eager through light
# kernels (see _registry.define_triton_op); tracing sees the triton_op.
scaled_mm_op = define_triton_op("tgemm::scaled_mm", _scaled_mm_impl, _scaled_mm_fake,
                                eager_impl=_scaled_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# Only bias is differentiable: d out / d bias sums grad_out over rows.

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, scale_a, scale_b, bias, _, _ = inputs
    _check_no_quantized_grads(a, b, scale_a, scale_b)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    grad_bias = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        grad_bias = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return None, None, None, None, grad_bias, None, None


scaled_mm_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------------

def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              use_fast_accum: bool = False) -> torch.Tensor:
    """Scaled matrix product ``(a * scale_a) @ (b * scale_b) + bias`` of fp8 / fp4 operands.

    The recipe (tensorwise, rowwise, blockwise, mxfp8, mxfp4, nvfp4) is read from the dtypes and
    the scale shapes, as ``torch._scaled_mm`` does; see this module's docstring or the README
    for the table. ``torch_triton_gemm.quantize`` produces operands and scales for each recipe.

    Args:
        a: [M, K] float8_e4m3fn / float8_e5m2, or [M, K/2] float4_e2m1fn_x2; any strides.
        b: [K, N] (or [K/2, N] for fp4); any strides (``w.t()`` of a [N, K] weight is fastest).
        scale_a, scale_b: the recipe's scales (they multiply: ``a * scale_a`` is the real value).
        bias: optional [N] float16 / bfloat16 / float32, added in fp32 after the scales.
        out_dtype: bfloat16 (default), float16 or float32.
        use_fast_accum: let Hopper's fp8 tensor cores accumulate a whole K loop at reduced
            precision (faster, less exact).

    Returns:
        A new row-major [M, N] tensor.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        >>> xq, xs = tg.quantize(x, "rowwise", "a")
        >>> wq, ws = tg.quantize(w.t(), "rowwise", "b")   # [K, N] column-major
        >>> y = tg.scaled_mm(xq, wq, xs, ws)               # [64, 512] bfloat16
    """
    try:
        grad = plain_eager_grad(a, b, scale_a, scale_b, bias)
        if grad is not None:
            if not grad:
                return _scaled_mm_eager(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
            _check_no_quantized_grads(a, b, scale_a, scale_b)  # bias alone may need gradients
        elif torch.is_grad_enabled():
            _check_no_quantized_grads(a, b, scale_a, scale_b)
        return torch.ops.tgemm.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype,
                                         use_fast_accum)
    except (AttributeError, TypeError, RuntimeError):
        explain_bad_arguments(scaled_mm_op, (a, b, scale_a, scale_b, bias, out_dtype,
                                             use_fast_accum))
        raise
