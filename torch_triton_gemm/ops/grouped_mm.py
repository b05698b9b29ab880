"""tgemm::grouped_mm — torch._grouped_mm's contract on one persistent Triton kernel, with grads.

Contract (the shapes of ``torch._grouped_mm(a, b, offs=None, bias=None, out_dtype=None)``):

    a [T, K]     x  b [G, K, N]  with offs [G]  ->  out [T, N]     rows of a grouped (MoE forward)
    a [G, M, K]  x  b [K, N]     with offs [G]  ->  out [M, N]     columns of b grouped
    a [M, K]     x  b [K, N]     with offs [G]  ->  out [G, M, N]  the contraction grouped
                                                                   (MoE weight gradient)
    a [G, M, K]  x  b [G, K, N]  without offs   ->  out [G, M, N]  a batch (bmm)

- offs is int32 on a's device: cumulative ends of the groups along the grouped dimension
  (group g is [offs[g-1], offs[g]) with offs[-1] read as 0). Groups may be empty and of any
  size (no multiple of 16 needed); offs[-1] may stop short of the dimension's end.
- Past offs[-1], torch leaves the output unwritten (whatever the fresh tensor held): rows of out
  for 2-D x 3-D, columns for 3-D x 2-D. So does this op, unless ``zero_tail=True`` (an extension:
  zeros there, in the same launch). With the contraction grouped, indices past offs[-1] are
  ignored and an empty group gives zeros.
- Beyond torch: float16 and float32 as well as bfloat16 (fp32 is tf32 unless
  ``torch.get_float32_matmul_precision() == "highest"``), out_dtype float16 / bfloat16 /
  float32, any strides (an expert weight stored [G, N, K] and passed as ``w.transpose(-2, -1)``
  loads through TMA on Hopper), a bias, and gradients for a, b and bias in every form.
- bias: [G, N] (one row per group) when out has one [.., N] block per group, [N] (per column)
  for 3-D x 2-D where groups are column ranges of out; added in fp32 before the cast.
- Bad offs: offs is device data, so by default its values are checked only where reading them
  costs no device sync (tensors in host memory); ``TORCH_TRITON_GEMM_CHECK_OFFS=1`` checks them
  on GPUs too (one sync per call), ``=0`` never. Unchecked, the kernel clamps every group into
  [end of the previous group, the dimension's end]: it never reads or writes out of bounds, an
  entry below its predecessor gives an empty group, an entry past the end stops there.

This module reads top to bottom: checks, the op body (launch), the fake, registration,
autograd, and the typed public function. The forms, offs checks and the launch (loaders, tile,
grid) live in grouped_launch.py, shared with tgemm::scaled_grouped_mm.
"""

from __future__ import annotations

from typing import Any

import torch

from ._registry import define_triton_op, eager_autograd_apply, explain_bad_arguments
from .checks import check_value, float32_precision
from .grouped_launch import (
    GroupedLaunch,
    check_epilogue,
    check_grouping,
    check_offs_values,
    form_of,
    out_shape,
    prepare_grouped_launch,
    run_grouped_launch,
)
from .launcher import memoised_eager_call, plain_eager_grad, tensor_key

OP = "tgemm::grouped_mm"
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = INPUT_DTYPES


# --- checks -------------------------------------------------------------------------------------
# The forms, offs and the kernel's view of the operands are grouped_launch.py's (shared with
# tgemm::scaled_grouped_mm); this op adds its dtypes, zero_tail and the out dtype.

def _check_inputs(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                  bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                  zero_tail: bool) -> tuple[str, torch.dtype]:
    """Validate everything but offs' values (also under FakeTensor and symbolic shapes); return
    the form and the out dtype."""
    form = check_grouping(OP, a, b, offs, INPUT_DTYPES)
    check_value(not zero_tail or form in ("m", "n"),
                lambda: f"{OP}: zero_tail applies when a 2-D a or b is grouped by rows or "
                         f"columns (2-D x 3-D, 3-D x 2-D), not to a {a.dim()}-D x {b.dim()}-D "
                         f"product")
    if out_dtype is None:
        out_dtype = a.dtype
    check_epilogue(OP, form, a, b, offs, bias, out_dtype, OUT_DTYPES)
    return form, out_dtype


# --- the op body --------------------------------------------------------------------------------

def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     zero_tail: bool = False) -> torch.Tensor:
    """Shapes, dtypes and strides only: a contiguous tensor of the out dtype."""
    form, out_dtype = _check_inputs(a, b, offs, bias, out_dtype, zero_tail)
    return a.new_empty(out_shape(form, a, b, offs), dtype=out_dtype)


def _grouped_mm_impl(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     zero_tail: bool = False) -> torch.Tensor:
    return _allocate_and_launch(a, b, offs, bias, out_dtype, zero_tail, traceable=True)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                         bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                         zero_tail: bool, traceable: bool) -> torch.Tensor:
    out = _grouped_mm_fake(a, b, offs, bias, out_dtype, zero_tail)
    if offs is not None:
        check_offs_values(OP, a, b, offs)
    launch_grouped_mm(a, b, offs, bias, out, zero_tail, traceable)
    return out


def launch_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                      bias: torch.Tensor | None, out: torch.Tensor, zero_tail: bool = False,
                      traceable: bool = True, use_tma: bool | None = None) -> None:
    """Launch the grouped kernel writing a x b (+ bias) into ``out`` (checked inputs).

    ``traceable=False`` launches the Triton kernel directly instead of through ``wrap_triton``,
    for plain eager calls that nothing traces; ``use_tma=False`` keeps to the pointer loaders.
    """
    launch = prepare_grouped_launch(OP, a, b, offs, bias, out, zero_tail, use_tma)
    if launch is not None:
        run_grouped_launch(launch, a, b, offs, bias, out, traceable)


# --- plain eager calls ----------------------------------------------------------------------------
# As for tgemm::mm (see memoised_eager_call): checks and launch arithmetic are memoised per
# call signature (shapes, strides, dtypes, devices and 16-byte alignment of every tensor, out
# dtype, zero_tail, fp32 precision). offs' values are not in it: they are checked (where
# TORCH_TRITON_GEMM_CHECK_OFFS asks) on every call.

def grouped_eager_signature(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                            bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                            zero_tail: bool) -> tuple[Any, ...]:
    """The memo key of a plain eager call (see memoised_eager_call)."""
    return (OP, tensor_key(a), tensor_key(b), tensor_key(offs),
            tensor_key(bias), out_dtype, bool(zero_tail), float32_precision())


def _grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      zero_tail: bool = False) -> torch.Tensor:
    """The op body for eager calls on real tensors: the kernel launched without wrap_triton,
    checks and launch arithmetic memoised per call signature."""
    return grouped_eager_call(a, b, offs, bias, out_dtype, zero_tail,
                              grouped_eager_signature(a, b, offs, bias, out_dtype, zero_tail))


def grouped_eager_call(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                       bias: torch.Tensor | None, out_dtype: torch.dtype | None, zero_tail: bool,
                       signature: tuple[Any, ...]) -> torch.Tensor:
    """``_grouped_mm_eager`` for a caller that has the call's ``grouped_eager_signature``."""
    out, launch = memoised_eager_call(signature, _first_eager_call, a, b, offs, bias, out_dtype,
                                      zero_tail)
    if offs is not None:
        check_offs_values(OP, a, b, offs)
    if launch is not None:
        run_grouped_launch(launch, a, b, offs, bias, out, False)
    return out


def _first_eager_call(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                      bias: torch.Tensor | None, out_dtype: torch.dtype | None, zero_tail: bool
                      ) -> tuple[torch.Tensor, GroupedLaunch | None]:
    """The checks, the output and the launch to keep of a signature's first eager call."""
    out = _grouped_mm_fake(a, b, offs, bias, out_dtype, zero_tail)  # the checks
    launch = prepare_grouped_launch(OP, a, b, offs, bias, out, zero_tail)
    return out, None if launch is None else launch._replace(compiled={})


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.grouped_mm on real tensors reach _grouped_mm_eager through light
# kernels (see define_triton_op); tracing and compile see the triton_op _grouped_mm_impl.
grouped_mm_op = define_triton_op(OP, _grouped_mm_impl, _grouped_mm_fake,
                                 eager_impl=_grouped_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# Every form's gradients are grouped products of the same family (a 2-D x 3-D forward has a
# 2-D x 3-D input gradient and a 2-D x 2-D weight gradient, and so on), so the backward pass is
# tgemm::grouped_mm again. Inputs past offs[-1] do not reach the output: their gradient is zero,
# written by zero_tail in the same launch. A per-group bias sums its group's rows of grad_out
# with one more grouped product against a ones vector (deterministic, no host sync).

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, offs, bias, _, _ = inputs
    ctx.form = form_of(a, b)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(a if b.requires_grad else None, b if a.requires_grad else None, offs)
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    a, b, offs = ctx.saved_tensors
    form = ctx.form
    grad = grad_out.to(ctx.a_dtype)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        if form == "m":
            grad_a = grouped_mm(grad, b.transpose(-2, -1), offs, zero_tail=True)
        elif form == "n":
            grad_a = grouped_mm(grad, b.t(), offs)
        elif form == "k":
            grad_a = grouped_mm(grad, b.t(), offs, zero_tail=True)
        else:
            grad_a = grouped_mm(grad, b.transpose(-2, -1))
    if ctx.needs_input_grad[1]:
        if form == "m":
            grad_b = grouped_mm(a.t(), grad, offs)
        elif form == "n":
            grad_b = grouped_mm(a.transpose(-2, -1), grad, offs, zero_tail=True)
        elif form == "k":
            grad_b = grouped_mm(a.t(), grad, offs, zero_tail=True)
        else:
            grad_b = grouped_mm(a.transpose(-2, -1), grad)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = _bias_grad(form, grad_out, offs).to(ctx.bias_dtype)
    return grad_a, grad_b, None, grad_bias, None, None


def _bias_grad(form: str, grad_out: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Sum of grad_out over each bias entry's outputs, in fp32."""
    if form == "m":
        # [G, 1, N] = ones [1, T] x grad_out [T, N], the contraction grouped by offs.
        ones = grad_out.new_ones(()).expand(1, grad_out.shape[0])
        return grouped_mm(ones, grad_out, offs, out_dtype=torch.float32).squeeze(1)
    if form == "n":
        # [1, N] = ones [G, 1, M] x grad_out [M, N], columns grouped by offs, zeros past them.
        ones = grad_out.new_ones(()).expand(offs.shape[0], 1, grad_out.shape[0])
        return grouped_mm(ones, grad_out, offs, out_dtype=torch.float32,
                          zero_tail=True).squeeze(0)
    return grad_out.sum(1, dtype=torch.float32)


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# The same forward and formulas for plain eager calls of tg.grouped_mm, which skip the
# dispatcher.
_eager_grouped_mm_with_grad = eager_autograd_apply(grouped_mm_op)


# --- public API ---------------------------------------------------------------------------------

def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
               zero_tail: bool = False) -> torch.Tensor:
    """Grouped matrix product with ``torch._grouped_mm``'s contract, in one Triton launch.

    Args:
        a: [T, K] (groups of rows), [G, M, K] (one matrix per group) or [M, K] (groups of
            columns, with a 2-D b); float16, bfloat16 or float32, any strides.
        b: [G, K, N], [K, N] (groups of columns, or of rows with a 2-D a); a's dtype, any
            strides (``w.transpose(-2, -1)`` of expert weights stored [G, N, K] is fast).
        offs: int32 [G] cumulative ends of the groups along the grouped dimension; required
            when a or b is 2-D, None for 3-D x 3-D. Groups may be empty.
        bias: optional [G, N] (one row per group), or [N] for 3-D a x 2-D b; added in fp32.
        out_dtype: float16, bfloat16 or float32; defaults to a's dtype.
        zero_tail: write zeros to the output rows (2-D a x 3-D b) or columns (3-D a x 2-D b)
            past offs[-1], which are otherwise left unwritten, as torch leaves them.

    Returns:
        A new contiguous tensor: [T, N], [M, N_total], [G, M, N] or [G, M, N] by form.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)   # routed tokens
        >>> w = torch.randn(8, 2048, 512, device="cuda", dtype=torch.bfloat16)  # [G, N, K]
        >>> counts = torch.tensor([120, 0, 300, 80, 200, 100, 150, 50], device="cuda")
        >>> offs = counts.cumsum(0).to(torch.int32)
        >>> y = tg.grouped_mm(x, w.transpose(-2, -1), offs)   # [1000, 2048]
    """
    try:
        grad = plain_eager_grad(a, b, offs, bias)  # (offs, integers, needs none)
        if grad is not None:
            if grad:
                return _eager_grouped_mm_with_grad(a, b, offs, bias, out_dtype, zero_tail)
            return _grouped_mm_eager(a, b, offs, bias, out_dtype, zero_tail)
        return torch.ops.tgemm.grouped_mm(a, b, offs, bias, out_dtype, zero_tail)
    except (AttributeError, TypeError, RuntimeError):
        explain_bad_arguments(grouped_mm_op, (a, b, offs, bias, out_dtype, zero_tail))
        raise

