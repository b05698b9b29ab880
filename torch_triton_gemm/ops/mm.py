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

This module reads top to bottom: checks, the op body (choose a kernel, launch), the fake,
registration, autograd, and the typed public function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.library import wrap_triton

from .. import device as _device
from .. import tuning
from ..kernels.matmul import mm_kernel
from ..kernels.tiles import ACTIVATIONS
from ._registry import define_triton_op, eager_autograd_function

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                torch.float8_e5m2)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INT32_LIMIT = 2**31 - 1

_mm_kernel_autotuned = tuning.autotune_mm(mm_kernel)
_mm_eager_launch = tuning.TunedLaunch(_mm_kernel_autotuned)


# --- checks -------------------------------------------------------------------------------------

def _check(cond: bool | torch.SymBool, message: Callable[[], str],
           error: type[Exception] = RuntimeError) -> None:
    """torch._check / torch._check_value, skipped for a plain True to keep eager launches cheap.

    Symbolic conditions still go to torch._check, which records them without guarding.
    """
    if cond is True:
        return
    if error is ValueError:
        torch._check_value(cond, message)
    else:
        torch._check(cond, message)


def _check_value(cond: bool, message: Callable[[], str]) -> None:
    _check(cond, message, ValueError)


def _check_inputs(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  out_dtype: torch.dtype | None) -> torch.dtype:
    """Validate the arguments (also under FakeTensor and symbolic shapes); return the out dtype."""
    _check(
        a.dim() == 2,
        lambda: f"tgemm::mm: a must be 2-D [M, K], got {a.dim()}-D of shape {tuple(a.shape)}")
    _check(
        b.dim() == 2,
        lambda: f"tgemm::mm: b must be 2-D [K, N], got {b.dim()}-D of shape {tuple(b.shape)}")
    _check(
        a.shape[1] == b.shape[0],
        lambda: f"tgemm::mm: a has {a.shape[1]} columns but b has {b.shape[0]} rows "
                f"(a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    _check_value(
        a.dtype in INPUT_DTYPES,
        lambda: f"tgemm::mm: a has dtype {a.dtype}; supported: "
                f"{', '.join(str(d) for d in INPUT_DTYPES)}")
    _check_value(
        a.dtype == b.dtype,
        lambda: f"tgemm::mm: a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    _check(a.device == b.device, lambda: f"tgemm::mm: a is on {a.device} but b is on {b.device}")
    _check(a.layout == torch.strided and b.layout == torch.strided,
           lambda: f"tgemm::mm: a and b must be dense (strided) tensors, got {a.layout} and "
                   f"{b.layout}")
    _check_value(
        activation in ACTIVATIONS,
        lambda: f"tgemm::mm: unknown activation {activation!r}; choose one of {ACTIVATIONS}")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in _FP8_DTYPES else a.dtype
    _check_value(
        out_dtype in OUT_DTYPES,
        lambda: f"tgemm::mm: out_dtype {out_dtype} is not supported; choose one of {OUT_DTYPES}")
    if bias is not None:
        n = b.shape[1]
        _check(
            bias.dim() == 1 and bias.shape[0] == n,
            lambda: f"tgemm::mm: bias must be 1-D of size N={n} (b's columns), got shape "
                    f"{tuple(bias.shape)}")
        _check_value(
            bias.dtype in OUT_DTYPES,
            lambda: f"tgemm::mm: bias has dtype {bias.dtype}; supported: {OUT_DTYPES}")
        _check(bias.device == a.device,
               lambda: f"tgemm::mm: bias is on {bias.device} but a is on {a.device}")
    return out_dtype


def _needs_int64_indexing(shape_and_strides: tuple[tuple[int, ...], ...]) -> bool:
    """True when an element offset of some 2-D tensor (its shape and strides) may not fit in
    int32."""
    for rows, cols, row_stride, col_stride in shape_and_strides:
        if rows == 0 or cols == 0:
            continue
        if (rows - 1) * row_stride + (cols - 1) * col_stride > _INT32_LIMIT:
            return True
    return False


def _input_precision(dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _layout_key(stride_ak: int, stride_bk: int) -> int:
    # Whether each operand is contiguous along K; the best tile differs between layouts.
    return 2 * int(stride_ak == 1) + int(stride_bk == 1)


# --- the op body --------------------------------------------------------------------------------

def _mm_fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Shapes, dtypes and strides only: a row-major [M, N] tensor of the out dtype."""
    out_dtype = _check_inputs(a, b, bias, activation, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mm_impl(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=True)


def _mm_eager(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op body for eager calls on real tensors: the kernel launched without wrap_triton."""
    return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=False)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                         activation: str, out_dtype: torch.dtype | None,
                         traceable: bool) -> torch.Tensor:
    out = _mm_fake(a, b, bias, activation, out_dtype)
    launch_mm(a, b, bias, out, activation, traceable)
    return out


def launch_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              activation: str, traceable: bool = True) -> None:
    """Launch the mm kernel writing activation(a @ b + bias) into ``out`` (checked inputs).

    ``traceable=False`` launches the Triton kernel directly instead of through ``wrap_triton``,
    for plain eager calls that nothing traces.
    """
    device = a.device
    error = _device.kernel_device_error(device)
    _check(error is None, lambda: f"tgemm::mm: {error}")
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    # Host time matters here (an eager call of a small GEMM is host-bound): each stride is read
    # once, and the grid is plain integer arithmetic.
    stride_am, stride_ak = a.stride()
    stride_bk, stride_bn = b.stride()
    stride_cm, stride_cn = out.stride()
    m_bucket = tuning.size_bucket(M)
    n_bucket = tuning.size_bucket(N)
    k_bucket = tuning.size_bucket(K)
    layout = _layout_key(stride_ak, stride_bk)
    index_64 = _needs_int64_indexing(((M, K, stride_am, stride_ak), (K, N, stride_bk, stride_bn),
                                      (M, N, stride_cm, stride_cn)))
    # Runtime arguments in mm_kernel's order; the tile's meta-parameters come after them.
    args = (
        a, b, out, bias, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        bias.stride(0) if bias is not None else 0,
        m_bucket, n_bucket, k_bucket, layout,
        bias is not None, activation, _input_precision(a.dtype),
        _device.interpreter_enabled() and a.dtype == torch.bfloat16,
        index_64,
    )

    def grid(meta: dict[str, Any]) -> tuple[int]:
        block_m, block_n = meta["BLOCK_M"], meta["BLOCK_N"]
        return (((M + block_m - 1) // block_m) * ((N + block_n - 1) // block_n),)

    if traceable:
        # Arguments may be symbolic here: pass them by name, as wrap_triton expects, and hand it
        # the autotuner itself (Inductor tunes its own launch).
        named = dict(zip(mm_kernel.arg_names, args))
        if tuning.autotune_enabled():
            wrap_triton(_mm_kernel_autotuned)[grid](**named)
        else:
            wrap_triton(mm_kernel)[grid](**named, **_heuristic_config(a, M, N, K))
    elif tuning.autotune_enabled():
        key = (device, a.dtype, out.dtype, bias.dtype if bias is not None else None,
               m_bucket, n_bucket, k_bucket, layout)
        _mm_eager_launch(key, grid, args)
    else:
        config = _heuristic_config(a, M, N, K)
        mm_kernel[grid(config)](*args, **config)


def _heuristic_config(a: torch.Tensor, M: int, N: int, K: int) -> Mapping[str, Any]:
    return tuning.mm_launch_config(tuning.heuristic_mm_tile(M, N, K, a.element_size()))


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True for a call no PyTorch subsystem needs to see as an op: no tracing, compile, modes or
    tensor subclasses. Such calls skip the dispatcher (autograd still applies, through
    ``_EagerMM``), whose Python custom-op path costs more host time than a small GEMM takes on
    the GPU."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.mm on real tensors reach _mm_eager through light kernels (see
# define_triton_op); tracing and compile see the triton_op _mm_impl.
mm_op = define_triton_op("tgemm::mm", _mm_impl, _mm_fake, eager_impl=_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# out = act(z), z = a @ b + bias. relu and leaky_relu take their derivative from the output;
# gelu and silu recompute z with one more tgemm::mm (in fp32) rather than keep it alive.

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, bias, activation, _ = inputs
    _check(
        a.dtype not in _FP8_DTYPES or not (a.requires_grad or b.requires_grad),
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
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _activation_grad(ctx, grad_out: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    a, b, bias, out = ctx.saved_tensors
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


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    a, b, _, _ = ctx.saved_tensors
    grad_z = _activation_grad(ctx, grad_out)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_a = mm(grad_z.to(ctx.b_dtype), b.t(), out_dtype=ctx.a_dtype)
    if ctx.needs_input_grad[1]:
        grad_b = mm(a.t(), grad_z.to(ctx.a_dtype), out_dtype=ctx.b_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_z.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_a, grad_b, grad_bias, None, None


mm_op.register_autograd(_backward, setup_context=_setup_context)


# The same forward and formulas for plain eager calls of tg.mm, which skip the dispatcher.
_EagerMM = eager_autograd_function(mm_op)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


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
    if _plain_eager(a, b, bias):
        if _needs_grad(a, b, bias):
            return _EagerMM.apply(a, b, bias, activation, out_dtype)
        return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=False)
    return torch.ops.tgemm.mm(a, b, bias, activation, out_dtype)
