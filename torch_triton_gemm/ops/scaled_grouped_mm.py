"""tgemm::scaled_grouped_mm — torch._scaled_grouped_mm's contract: grouped products of fp8
operands, each dequantized by its scales, in one persistent Triton launch.

Contract (``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None,
scale_result=None, out_dtype=None, use_fast_accum=False)``), out = (a * scale_a) @ (b * scale_b)
per group, with the forms of tgemm::grouped_mm (G groups; offs int32 [G], cumulative ends):

    form                           out          rowwise scale_a   rowwise scale_b
    a [T, K] x b [G, K, N], offs   [T, N]       [T]               [G, N]     (MoE forward)
    a [G, M, K] x b [K, N], offs   [M, N]       [G, M]            [N]
    a [M, K] x b [K, N], offs      [G, M, N]    [G * M]           [G * N]    (weight gradient)
    a [G, M, K] x b [G, K, N]      [G, M, N]    [G, M]            [G, N]     (a batch)

- Rowwise scales (torch's): float32, one per row of a and one per column of b, as torch indexes
  them: by the row (column) of the full 2-D operand where it is grouped, per group [G, ...]
  where the operand is 3-D, and per group in blocks of M (N) for the weight gradient, whose
  groups split the contraction. Applied to each tile after its K loop.
- Blockwise scales (an extension, DeepSeek-V3 style): float32, one per 1x128 or 128x128 block,
  indexed as tgemm::scaled_mm's blockwise recipe indexes them per product, with a leading [G]
  where the operand is 3-D: scale_a [T, kb] (1x128) or [ceil(T/128), kb] (128x128) for a 2-D
  a, [G, M, kb] or [G, ceil(M/128), kb] for a 3-D one; scale_b [G, kb, N] (1x128) or
  [G, kb, ceil(N/128)] (128x128) for a 3-D b, [kb, N] or [kb, ceil(N/128)] for a 2-D one
  (kb = ceil(K/128)). Not for the weight-gradient form: its groups split K at arbitrary
  points, across scale blocks. The recipe is read from the scales' ranks: one less than the
  operand's for rowwise, the operand's own for blockwise.
- Operands: float8_e4m3fn (torch's) or float8_e5m2, both the same; any strides (torch wants a
  row-major and b column-major: ``w.transpose(-2, -1)`` of expert weights stored [G, N, K]
  loads through TMA on Hopper), any sizes (no multiple of 16 needed), empty groups.
- out_dtype: bfloat16 (the default, torch's only one), float16 or float32. Accumulation is
  fp32; ``use_fast_accum=False`` adds every K step's product into fp32, True lets Hopper's fp8
  tensor cores sum a whole K loop at their reduced precision (rowwise; blockwise scales every
  step's product anyway). The scales are used as given (zero, negative, inf and NaN included).
- bias (an extension; torch refuses one): [G, N], or [N] for 3-D a x 2-D b, float16 / bfloat16
  / float32, added in fp32 after the scales. ``scale_result`` is refused, as torch refuses it.
- offs as tgemm::grouped_mm takes it: values checked where reading them costs no device sync
  (or as TORCH_TRITON_GEMM_CHECK_OFFS says), clamped in the kernel otherwise; outputs past
  offs[-1] are left unwritten, as torch leaves them.
- No gradients: asking for one (a, b, the scales or bias) is an error.

This module reads top to bottom: checks and the recipe, the op body (launch), the fake,
registration, autograd, and the typed public function; the forms, offs and the launch live in
grouped_launch.py, shared with tgemm::grouped_mm.
"""

from __future__ import annotations

from typing import Any

import torch

from ._registry import define_triton_op, explain_bad_arguments
from .checks import (
    BLOCKWISE_K,
    FP8_DTYPES,
    OUT_DTYPES,
    blockwise_scale_blocks,
    ceil_div,
    check,
    check_value,
)
from .grouped_launch import (
    GroupedLaunch,
    GroupedScales,
    check_epilogue,
    check_grouping,
    check_offs_values,
    out_shape,
    prepare_fp8_grouped_precise,
    prepare_grouped_launch,
    run_grouped_launch,
)
from .launcher import memoised_eager_call, plain_eager, tensor_key

OP = "tgemm::scaled_grouped_mm"


# --- checks and the recipe ------------------------------------------------------------------------

def _shape(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape)


def _extents(form: str, a: torch.Tensor, b: torch.Tensor,
             offs: torch.Tensor | None) -> tuple[Any, Any, Any, Any]:
    """(G, M, N, K): the groups, and the rows, columns and depth of the full operands (the
    grouped dimension whole)."""
    if form == "m":
        return b.shape[0], a.shape[0], b.shape[2], a.shape[1]
    if form == "n":
        return a.shape[0], a.shape[1], b.shape[1], a.shape[2]
    if form == "k":
        return offs.shape[0], a.shape[0], b.shape[1], a.shape[1]  # type: ignore[union-attr]
    return a.shape[0], a.shape[1], b.shape[2], a.shape[2]


def _rowwise_shapes(form: str, G: Any, M: Any, N: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """torch's rowwise scale shapes for each form (see the module docstring)."""
    return {"m": ((M,), (G, N)), "n": ((G, M), (N,)), "k": ((G * M,), (G * N,)),
            "none": ((G, M), (G, N))}[form]


def _scales(form: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
            scale_b: torch.Tensor, offs: torch.Tensor | None,
            use_fast_accum: bool) -> GroupedScales:
    """The recipe, read from the scales' ranks and checked against their shapes, as the kernel
    reads it: mode, strides over (group, row, K block) of scale_a and (group, K block, column)
    of scale_b, block sizes."""
    G, M, N, K = _extents(form, a, b, offs)
    rowwise = scale_a.dim() == a.dim() - 1 and scale_b.dim() == b.dim() - 1
    blockwise = scale_a.dim() == a.dim() and scale_b.dim() == b.dim()
    expected_a, expected_b = _rowwise_shapes(form, G, M, N)
    check(rowwise or blockwise,
          lambda: f"{OP}: scale shapes fit no recipe: got scale_a {_shape(scale_a)} and scale_b "
                   f"{_shape(scale_b)} for a {_shape(a)} and b {_shape(b)}. Rowwise scales "
                   f"are one rank below their operand: scale_a {expected_a} and scale_b "
                   f"{expected_b}; blockwise scales have their operand's rank (1x128 or "
                   f"128x128 blocks)")
    if rowwise:
        check(_shape(scale_a) == expected_a and _shape(scale_b) == expected_b,
              lambda: f"{OP}: rowwise scales for a {_shape(a)} and b {_shape(b)} (G={G}, "
                       f"M={M}, N={N}) are scale_a {expected_a} and scale_b {expected_b}, got "
                       f"scale_a {_shape(scale_a)} and scale_b {_shape(scale_b)}")
        if form == "k":
            # One run of M (N) scales per group.
            sa, sb = scale_a.stride(0), scale_b.stride(0)
            strides = (M * sa, sa, 0, N * sb, 0, sb)
        else:
            sa_g, sa_m = scale_a.stride() if a.dim() == 3 else (0, scale_a.stride(0))
            sb_g, sb_n = scale_b.stride() if b.dim() == 3 else (0, scale_b.stride(0))
            strides = (sa_g, sa_m, 0, sb_g, 0, sb_n)
        return GroupedScales("outer", scale_a, scale_b, strides, fast_accum=bool(use_fast_accum))
    check_value(form != "k",
                lambda: f"{OP}: blockwise scales do not apply to 2-D a x 2-D b (groups along "
                         f"K start anywhere, across 128-wide scale blocks); use rowwise scales "
                         f"scale_a {expected_a} and scale_b {expected_b}")
    per_group_a = _shape(scale_a)[-2:]
    per_group_b = _shape(scale_b)[-2:]
    a_rows, b_cols = blockwise_scale_blocks(per_group_a, per_group_b, M, N, K)
    group_a = (G,) if a.dim() == 3 else ()
    group_b = (G,) if b.dim() == 3 else ()
    kb = ceil_div(K, BLOCKWISE_K)
    check(a_rows is not None and b_cols is not None
          and _shape(scale_a)[:-2] == group_a and _shape(scale_b)[:-2] == group_b,
          lambda: f"{OP}: blockwise scales for a {_shape(a)} and b {_shape(b)} (G={G}, M={M}, "
                   f"N={N}, K={K}, kb = ceil(K/128) = {kb}) are scale_a "
                   f"{(*group_a, M, kb)} (1x128 blocks) or "
                   f"{(*group_a, ceil_div(M, BLOCKWISE_K), kb)} (128x128), and scale_b "
                   f"{(*group_b, kb, N)} (1x128) or {(*group_b, kb, ceil_div(N, BLOCKWISE_K))} "
                   f"(128x128); got scale_a {_shape(scale_a)} and scale_b {_shape(scale_b)}")
    sa = scale_a.stride() if a.dim() == 3 else (0, *scale_a.stride())
    sb = scale_b.stride() if b.dim() == 3 else (0, *scale_b.stride())
    return GroupedScales("block", scale_a, scale_b, (*sa, *sb), a_rows, b_cols,
                         bool(use_fast_accum))


def _check_inputs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None,
                  scale_result: torch.Tensor | None, out_dtype: torch.dtype | None,
                  use_fast_accum: bool = False) -> tuple[str, torch.dtype, GroupedScales]:
    """Validate everything but offs' values (also under FakeTensor and symbolic shapes); return
    the form, the out dtype and the scales as the kernel reads them."""
    form = check_grouping(OP, a, b, offs, FP8_DTYPES)
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        check(t.device == a.device,
              lambda name=name, t=t: f"{OP}: {name} is on {t.device} but a is on {a.device}")
        check(t.layout == torch.strided,
              lambda name=name, t=t: f"{OP}: {name} must be a dense (strided) tensor, got "
                                      f"{t.layout}")
    check_value(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32,
                lambda: f"{OP}: scale_a and scale_b must be float32 (rowwise or blockwise fp8 "
                         f"scales), got scale_a {scale_a.dtype} and scale_b {scale_b.dtype}")
    check_value(scale_result is None,
                lambda: f"{OP}: scale_result is not supported (torch._scaled_grouped_mm does not "
                         f"support it either): the output is {OUT_DTYPES} and needs no scale; "
                         f"multiply the output instead")
    scales = _scales(form, a, b, scale_a, scale_b, offs, use_fast_accum)
    if out_dtype is None:
        out_dtype = torch.bfloat16
    check_epilogue(OP, form, a, b, offs, bias, out_dtype, OUT_DTYPES)
    return form, out_dtype, scales


# --- the op body --------------------------------------------------------------------------------

def _scaled_grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                            scale_b: torch.Tensor, offs: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None,
                            scale_result: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None,
                            use_fast_accum: bool = False) -> torch.Tensor:
    """Shapes, dtypes and strides only: a contiguous tensor of the out dtype."""
    form, out_dtype, _ = _check_inputs(a, b, scale_a, scale_b, offs, bias, scale_result,
                                       out_dtype)
    return a.new_empty(out_shape(form, a, b, offs), dtype=out_dtype)


def _scaled_grouped_mm_impl(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                            scale_b: torch.Tensor, offs: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None,
                            scale_result: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None,
                            use_fast_accum: bool = False) -> torch.Tensor:
    form, out_dtype, scales = _check_inputs(a, b, scale_a, scale_b, offs, bias, scale_result,
                                            out_dtype, use_fast_accum)
    out = a.new_empty(out_shape(form, a, b, offs), dtype=out_dtype)
    # Inductor re-parses the Triton kernels a graph launches and cannot parse Gluon: products
    # that Hopper's precise kernel takes go through an opaque op that launches it.
    if prepare_fp8_grouped_precise(a, b, offs, bias, out, scales) is not None:
        return torch.ops.tgemm._scaled_grouped_mm_hopper(a, b, scale_a, scale_b, offs, bias,
                                                         out_dtype)
    if offs is not None:
        check_offs_values(OP, a, b, offs)
    launch_scaled_grouped_mm(a, b, scales, offs, bias, out, traceable=True)
    return out


@torch.library.custom_op("tgemm::_scaled_grouped_mm_hopper", mutates_args=())
def _scaled_grouped_mm_hopper(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                              scale_b: torch.Tensor, offs: torch.Tensor,
                              bias: torch.Tensor | None,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """tgemm::scaled_grouped_mm's traced calls that run on Hopper's precise fp8 kernel, opaque
    to tracing; the eager call's checks and launch."""
    return _scaled_grouped_mm_eager(a, b, scale_a, scale_b, offs, bias, None, out_dtype, False)


@_scaled_grouped_mm_hopper.register_fake
def _scaled_grouped_mm_hopper_fake(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                                   scale_b: torch.Tensor, offs: torch.Tensor,
                                   bias: torch.Tensor | None,
                                   out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_grouped_mm_fake(a, b, scale_a, scale_b, offs, bias, None, out_dtype, False)


def launch_scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scales: GroupedScales,
                             offs: torch.Tensor | None, bias: torch.Tensor | None,
                             out: torch.Tensor, traceable: bool = True,
                             use_tma: bool | None = None) -> None:
    """Launch the grouped kernel writing (a * scale_a) @ (b * scale_b) (+ bias) per group into
    ``out`` (checked inputs; ``scales`` from the checks). ``traceable=False`` launches the
    Triton kernel directly, for plain eager calls that nothing traces; ``use_tma=False`` keeps
    to the pointer loaders."""
    launch = prepare_grouped_launch(OP, a, b, offs, bias, out, False, use_tma, scales)
    if launch is not None:
        run_grouped_launch(launch, a, b, offs, bias, out, traceable, scales.scale_a,
                           scales.scale_b)


# --- plain eager calls ----------------------------------------------------------------------------
# As for tgemm::grouped_mm: checks and launch arithmetic are memoised per call signature (every
# tensor's shape, strides, dtype, device and 16-byte alignment, out dtype, accumulation mode);
# offs' values are checked (where asked) on every call.

def _scaled_grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                             scale_b: torch.Tensor, offs: torch.Tensor | None = None,
                             bias: torch.Tensor | None = None,
                             scale_result: torch.Tensor | None = None,
                             out_dtype: torch.dtype | None = None,
                             use_fast_accum: bool = False) -> torch.Tensor:
    """The op body for eager calls on real tensors: the kernel launched without wrap_triton,
    checks and launch arithmetic memoised per call signature."""
    signature = (OP, tensor_key(a), tensor_key(b), tensor_key(scale_a), tensor_key(scale_b),
                 tensor_key(offs), tensor_key(bias), tensor_key(scale_result), out_dtype,
                 bool(use_fast_accum))
    out, launch = memoised_eager_call(signature, _first_eager_call, a, b, scale_a, scale_b,
                                      offs, bias, scale_result, out_dtype, use_fast_accum)
    if offs is not None:
        check_offs_values(OP, a, b, offs)
    if launch is not None:
        run_grouped_launch(launch, a, b, offs, bias, out, False, scale_a, scale_b)
    return out


def _first_eager_call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor | None,
                      bias: torch.Tensor | None, scale_result: torch.Tensor | None,
                      out_dtype: torch.dtype | None, use_fast_accum: bool
                      ) -> tuple[torch.Tensor, GroupedLaunch | None]:
    """The checks, the output and the launch to keep of a signature's first eager call."""
    form, out_dtype_checked, scales = _check_inputs(a, b, scale_a, scale_b, offs, bias,
                                                    scale_result, out_dtype, use_fast_accum)
    out = a.new_empty(out_shape(form, a, b, offs), dtype=out_dtype_checked)
    launch = (prepare_fp8_grouped_precise(a, b, offs, bias, out, scales)
              or prepare_grouped_launch(OP, a, b, offs, bias, out, False, None, scales))
    return out, None if launch is None else launch._replace(compiled={})


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.scaled_grouped_mm on real tensors reach
# _scaled_grouped_mm_eager through light kernels (see define_triton_op); tracing and compile see
# the triton_op _scaled_grouped_mm_impl.
scaled_grouped_mm_op = define_triton_op(OP, _scaled_grouped_mm_impl, _scaled_grouped_mm_fake,
                                        eager_impl=_scaled_grouped_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# Nothing is differentiable: calls with an input that requires grad are refused when recorded.

def _check_no_grads(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b),
                    ("bias", bias)):
        check(
            t is None or not t.requires_grad,
            lambda name=name, t=t: (
                f"{OP}: {name} ({t.dtype}) requires grad, but scaled_grouped_mm has no "
                f"gradients: fp8 operands and their scales are a rounded copy of high-precision "
                f"tensors (rounding has no useful derivative, and an fp8 tensor cannot hold "
                f"one), and there is no backward for bias either. Pass {name}.detach(), and "
                f"differentiate through the high-precision tensors you quantized (e.g. with a "
                f"straight-through estimator around the quantization and the product)"))


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, scale_a, scale_b, _, bias, _, _, _ = inputs
    _check_no_grads(a, b, scale_a, scale_b, bias)


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    # _setup_context refuses every call that would record a backward.
    raise RuntimeError(f"{OP} has no backward")


scaled_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------------

def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None,
                      scale_result: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None,
                      use_fast_accum: bool = False) -> torch.Tensor:
    """Grouped product of fp8 operands with ``torch._scaled_grouped_mm``'s contract: per group,
    ``(a * scale_a) @ (b * scale_b) + bias``, in one Triton launch.

    Args:
        a: [T, K] (groups of rows), [G, M, K] (one matrix per group) or [M, K] (groups along
            K, with a 2-D b); float8_e4m3fn or float8_e5m2, any strides.
        b: [G, K, N], or [K, N] (groups of columns, or of K with a 2-D a); a's dtype, any
            strides (``w.transpose(-2, -1)`` of expert weights stored [G, N, K] is fast).
        scale_a, scale_b: float32 scales (they multiply: ``a * scale_a`` is the real value).
            Rowwise: scale_a [T], [G, M] or [G * M] (groups along K) and scale_b [G, N], [N]
            or [G * N], as torch takes them; blockwise 1x128 / 128x128 (an extension; not for
            groups along K): the operand's rank, see the module docstring or the README.
        offs: int32 [G] cumulative ends of the groups along the grouped dimension; required
            when a or b is 2-D, None for 3-D x 3-D. Groups may be empty.
        bias: optional [G, N], or [N] for 3-D a x 2-D b; added in fp32 after the scales.
        scale_result: not supported (an error, as in torch).
        out_dtype: bfloat16 (default), float16 or float32.
        use_fast_accum: let Hopper's fp8 tensor cores accumulate a whole K loop at reduced
            precision (faster, less exact).

    Returns:
        A new contiguous tensor: [T, N], [M, N_total], [G, M, N] or [G, M, N] by form; rows
        (columns) past offs[-1] are left unwritten, as torch leaves them.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)   # routed tokens
        >>> w = torch.randn(8, 2048, 512, device="cuda", dtype=torch.bfloat16)  # [G, N, K]
        >>> counts = torch.tensor([120, 0, 300, 80, 200, 100, 150, 50], device="cuda")
        >>> offs = counts.cumsum(0).to(torch.int32)
        >>> xs = x.abs().amax(1).float() / 448                       # rowwise: [T]
        >>> ws = w.abs().amax(2).float() / 448                       # [G, N]
        >>> xq = (x / xs[:, None]).to(torch.float8_e4m3fn)
        >>> wq = (w / ws[..., None]).to(torch.float8_e4m3fn)
        >>> y = tg.scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs)  # [1000, 2048]
    """
    try:
        if torch.is_grad_enabled():
            _check_no_grads(a, b, scale_a, scale_b, bias)
        if plain_eager(a, b, scale_a, scale_b, offs, bias):
            return _scaled_grouped_mm_eager(a, b, scale_a, scale_b, offs, bias, scale_result,
                                            out_dtype, use_fast_accum)
        return torch.ops.tgemm.scaled_grouped_mm(a, b, scale_a, scale_b, offs, bias,
                                                 scale_result, out_dtype, use_fast_accum)
    except (AttributeError, TypeError, RuntimeError):
        explain_bad_arguments(scaled_grouped_mm_op, (a, b, scale_a, scale_b, offs, bias,
                                                     scale_result, out_dtype, use_fast_accum))
        raise
