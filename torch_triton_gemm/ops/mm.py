"""tgemm::mm — out = activation(a @ b + bias), one Triton kernel.

Contract:
    mm(a: Tensor[M, K], b: Tensor[K, N], bias: Tensor[N] | None = None,
       activation: str = "none", out_dtype: torch.dtype | None = None) -> Tensor[M, N]

- a and b share one dtype: float16, bfloat16, float32 (tf32 unless
  ``torch.get_float32_matmul_precision() == "highest"``), float8_e4m3fn or float8_e5m2
  (unscaled). Accumulation is fp32. out_dtype defaults to the input dtype, and to bfloat16 for
  fp8; it may be float16, bfloat16 or float32.
- Any strides (row-major, column-major such as ``W.t()``, sliced views, stride-0 broadcasts) and
  any M, N, K >= 0: K = 0 gives activation(bias) (zeros without bias).
- bias (per output column) and the activation ("none", "relu", "gelu" with the tanh
  approximation, "silu", "leaky_relu" with slope 0.01) run in fp32 in the kernel's epilogue.
- Autograd: gradients for a, b and bias, computed with tgemm::mm itself.

This module reads top to bottom: checks, the op body (the planner's plan, launched by the
launcher: ops/planner.py, ops/launcher.py), the fake, plain eager calls, registration, autograd,
and the typed public function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import device as _device
from .. import plan_cache, tuning
from ..kernels.tiles import ACTIVATIONS
from . import compile_ahead
from ._registry import define_triton_op, eager_autograd_apply, explain_bad_arguments
from .checks import (
    FP8_DTYPES,
    check,
    check_epilogue_args,
    check_operand_pair,
    check_value,
    default_out_dtype,
    float32_precision,
)
from .launcher import (
    PreparedLaunch,
    eager_or_capture,
    kept,
    memoised_eager_call,
    plain_eager_grad,
    prepare_launch,
    run_kept,
    run_launch,
    tensor_key,
)
from .planner import eager_mm_plan, plan_mm

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                torch.float8_e5m2)


# --- checks -------------------------------------------------------------------------------------

def _check_inputs(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  out_dtype: torch.dtype | None) -> torch.dtype:
    """Validate the arguments (also under FakeTensor and symbolic shapes); return the out dtype."""
    check(
        a.dim() == 2,
        lambda: f"tgemm::mm: a must be 2-D [M, K], got {a.dim()}-D of shape {tuple(a.shape)}")
    check(
        b.dim() == 2,
        lambda: f"tgemm::mm: b must be 2-D [K, N], got {b.dim()}-D of shape {tuple(b.shape)}")
    check(
        a.shape[1] == b.shape[0],
        lambda: f"tgemm::mm: a has {a.shape[1]} columns but b has {b.shape[0]} rows "
                f"(a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    check_operand_pair("tgemm::mm", a, b, INPUT_DTYPES)
    check_value(
        activation in ACTIVATIONS,
        lambda: f"tgemm::mm: unknown activation {activation!r}; choose one of {ACTIVATIONS}")
    if out_dtype is None:
        out_dtype = default_out_dtype(a.dtype)
    check_epilogue_args("tgemm::mm", out_dtype, bias, b.shape[1])
    if bias is not None:
        check(bias.device == a.device,
              lambda: f"tgemm::mm: bias is on {bias.device} but a is on {a.device}")
    return out_dtype


# --- the op body --------------------------------------------------------------------------------

def _mm_fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Shapes, dtypes and strides only: a row-major [M, N] tensor of the out dtype."""
    out_dtype = _check_inputs(a, b, bias, activation, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mm_impl(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=True)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                         activation: str, out_dtype: torch.dtype | None,
                         traceable: bool) -> torch.Tensor:
    out = _mm_fake(a, b, bias, activation, out_dtype)
    prepared = _prepare_launch(a, b, bias, out, activation, traceable)
    if prepared is not None:
        run_launch(prepared, a, b, bias, out, None, None, traceable)
    return out


def _prepare_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor, activation: str, traceable: bool) -> PreparedLaunch | None:
    """The launch of a checked call writing into ``out``, on the planner's plan; None where
    the product is empty."""
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"tgemm::mm: {error}")
    if a.shape[0] == 0 or b.shape[1] == 0:
        return None
    plan = plan_mm(a, b, bias, out, activation, traceable)
    return prepare_launch(a, b, bias, out, activation, traceable, plan, None)


# --- plain eager calls ----------------------------------------------------------------------------
# Checks, plan and launch arithmetic memoised per call signature (see memoised_eager_call).

def mm_eager_signature(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                       activation: str, out_dtype: torch.dtype | None) -> tuple[Any, ...]:
    """The memo key of a plain eager call (see memoised_eager_call): a's and b's parts of
    ``tensor_key`` in one flat tuple (cheaper to build and hash than nested ones), then the
    other arguments; the float32 matmul precision only for float32 inputs, the only ones it
    changes (``checks.input_precision``)."""
    dtype = a.dtype
    return (a.shape, b.shape, a.stride(), b.stride(), dtype, b.dtype, a.device, b.device,
            a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0,
            None if bias is None else tensor_key(bias), activation, out_dtype,
            float32_precision() if dtype is torch.float32 else None, plan_cache.TUNED.version)


def mm_eager_call(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str = "none", out_dtype: torch.dtype | None = None,
                  signature: tuple[Any, ...] | None = None) -> torch.Tensor:
    """A plain eager call (see plain_eager) without autograd, and the op body for eager calls
    on real tensors: the kernels launched without wrap_triton, checks and launch arithmetic
    memoised per call signature. ``signature``, when the caller has it, is this call's
    ``mm_eager_signature``."""
    if tuning.forced_plan() is not None:
        return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=False)
    if signature is None:
        signature = mm_eager_signature(a, b, bias, activation, out_dtype)
    out, prepared = memoised_eager_call(signature, _first_eager_call, a, b, bias, activation,
                                        out_dtype)
    if prepared is not None:
        if prepared.capture is not None:  # (eager plans, unless TORCH_TRITON_GEMM_EAGER_PLANS=0)
            prepared = eager_or_capture(prepared)
        # A call the override routes with while_compiling="pytorch" goes back to it while its
        # kernels compile (compile_ahead.py).
        if compile_ahead.pytorch_until_built_on() and not compile_ahead.built(
                prepared, a, b, bias, out):
            raise compile_ahead.compiling_call(a, b, bias, activation, out)
        run_kept(prepared, a, b, bias, out, None, None)
    return out


def _first_eager_call(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                      activation: str, out_dtype: torch.dtype | None
                      ) -> tuple[torch.Tensor, PreparedLaunch | None]:
    """The checks, the output and the launch to keep of a signature's first eager call."""
    out = _mm_fake(a, b, bias, activation, out_dtype)  # the checks
    prepared = _prepare_launch(a, b, bias, out, activation, False)
    if prepared is None:
        return out, None
    prepared = kept(prepared)
    eager = eager_mm_plan(a, b, out, prepared.plan)
    if eager is not None:
        # Plain eager calls launch fewer kernels; CUDA-graph captures keep the planner's plan.
        prepared = kept(prepare_launch(a, b, bias, out, activation, False, eager, None)
                        )._replace(capture=prepared)
    if compile_ahead.background_enabled(a.device):
        compile_ahead.first_call(a, b, bias, activation, out, prepared)
    return out, prepared


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.mm on real tensors reach mm_eager_call through light kernels
# (see define_triton_op); tracing and compile see the triton_op _mm_impl.
mm_op = define_triton_op("tgemm::mm", _mm_impl, _mm_fake, eager_impl=mm_eager_call)


# --- autograd -----------------------------------------------------------------------------------
# out = act(z), z = a @ b + bias. relu and leaky_relu take their derivative from the output;
# gelu and silu recompute z with one more tgemm::mm (in fp32) rather than keep it alive.

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, bias, activation, _ = inputs
    check(
        a.dtype not in FP8_DTYPES or not (a.requires_grad or b.requires_grad),
        lambda: f"tgemm::mm: {a.dtype} inputs have no gradient; keep fp8 operands out of autograd")
    ctx.activation = activation
    ctx.has_bias = bias is not None
    recompute = activation in ("gelu", "silu")
    need_a = b.requires_grad or recompute
    need_b = a.requires_grad or recompute
    ctx.save_for_backward(
        a if need_a else None,
        b if need_b else None,
        bias if recompute else None,
        output if activation in ("relu", "leaky_relu") else None,
    )
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
    ctx.a_transposed, ctx.b_transposed = _is_transposed(a), _is_transposed(b)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    if getattr(compile_ahead.PENDING, "call", None) is not None:
        compile_ahead.recorded(a, b)  # a first call: its backward's kernels compile meanwhile
    # A call routed with while_compiling="pytorch": so are its gradients' products.
    ctx.pytorch_until_built = compile_ahead.pytorch_until_built_on()


def _is_transposed(t: torch.Tensor) -> bool:
    """A column-major matrix (the ``.t()`` of a contiguous one), whose gradient should be too."""
    rows, cols = t.shape
    row_stride, col_stride = t.stride()
    transposed = (row_stride == 1) & (col_stride == rows) & (rows != 1) & (cols != 1)
    # Plain sizes give a bool (eager calls: no guard_or_false, a microsecond each); symbolic
    # ones (torch.compile with dynamic shapes) are decided without a guard on the sizes.
    return transposed if type(transposed) is bool else guard_or_false(transposed)


def _activation_grad(ctx, saved: tuple[torch.Tensor | None, ...],  # type: ignore[no-untyped-def]
                     grad_out: torch.Tensor) -> torch.Tensor:
    a, b, bias, out = saved
    if ctx.activation == "none":
        return grad_out
    if ctx.activation == "relu":
        return torch.ops.aten.threshold_backward(grad_out, out, 0)
    if ctx.activation == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward(grad_out, out, 0.01, True)
    z = mm(a, b, bias, out_dtype=torch.float32)
    if ctx.activation == "gelu":
        return torch.ops.aten.gelu_backward(grad_out.float(), z, approximate="tanh")
    return torch.ops.aten.silu_backward(grad_out.float(), z)


def _gradient_product(x: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype,
                      pytorch_until_built: bool) -> torch.Tensor:
    """x @ y in ``out_dtype`` for a gradient: tgemm::mm, or torch.mm while its kernels compile
    where the forward was routed with while_compiling="pytorch"."""
    if not pytorch_until_built:
        return mm(x, y, out_dtype=out_dtype)
    try:
        with compile_ahead.pytorch_until_built():
            return mm(x, y, out_dtype=out_dtype)
    except compile_ahead.KernelsCompiling:
        return torch.mm(x, y).to(out_dtype)


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    saved = ctx.saved_tensors  # unpacked once: each unpacking checks every saved tensor
    a, b = saved[0], saved[1]
    grad_z = _activation_grad(ctx, saved, grad_out)
    grad_a = grad_b = grad_bias = None
    until_built = getattr(ctx, "pytorch_until_built", False)
    # Each gradient in its input's layout, as aten's mm formulas give it: a weight passed as
    # W.t() gets a W.t()-shaped gradient, so W.grad is contiguous and autograd copies nothing.
    if ctx.needs_input_grad[0]:
        if ctx.a_transposed:
            grad_a = _gradient_product(b, grad_z.to(ctx.b_dtype).t(), ctx.a_dtype,
                                       until_built).t()
        else:
            grad_a = _gradient_product(grad_z.to(ctx.b_dtype), b.t(), ctx.a_dtype, until_built)
    if ctx.needs_input_grad[1]:
        if ctx.b_transposed:
            grad_b = _gradient_product(grad_z.to(ctx.a_dtype).t(), a, ctx.b_dtype,
                                       until_built).t()
        else:
            grad_b = _gradient_product(a.t(), grad_z.to(ctx.a_dtype), ctx.b_dtype, until_built)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_z.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_a, grad_b, grad_bias, None, None


mm_op.register_autograd(_backward, setup_context=_setup_context)


# The same forward and formulas for plain eager calls of tg.mm, which skip the dispatcher.
_eager_mm_with_grad = eager_autograd_apply(mm_op)


# --- public API ---------------------------------------------------------------------------------

def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
       activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Matrix product ``activation(a @ b + bias)`` on a Triton kernel.

    Args:
        a: [M, K] tensor, any strides.
        b: [K, N] tensor of a's dtype, any strides (``weight.t()`` of an ``nn.Linear`` is fine).
        bias: optional [N] tensor added to every row, in fp32, before the activation.
        activation: "none", "relu", "gelu" (tanh approximation), "silu" or "leaky_relu".
        out_dtype: float16, bfloat16 or float32; defaults to a's dtype (bfloat16 for fp8).

    Returns:
        A new row-major [M, N] tensor.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
        >>> y = tg.mm(x, w.t(), activation="gelu")   # [64, 256]
    """
    try:
        grad = plain_eager_grad(a, b, bias)
        if grad is not None:
            if grad:
                return _eager_mm_with_grad(a, b, bias, activation, out_dtype)
            return mm_eager_call(a, b, bias, activation, out_dtype)
        return torch.ops.tgemm.mm(a, b, bias, activation, out_dtype)
    except (AttributeError, TypeError, RuntimeError):
        explain_bad_arguments(mm_op, (a, b, bias, activation, out_dtype))
        raise
