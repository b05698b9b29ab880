"""tgemm::grouped_mm_list — independent products a[i] @ b[i] of any sizes in one launch.

Contract:
    grouped_mm_list(a: list[Tensor[M_i, K_i]], b: list[Tensor[K_i, N_i]],
                    out_dtype: torch.dtype | None = None) -> list[Tensor[M_i, N_i]]

- The Triton grouped-GEMM tutorial's form: every pair has its own sizes and strides (any,
  including empty problems and K_i = 0, which gives zeros). All operands share one dtype
  (float16, bfloat16 or float32, tf32 unless "highest" precision) and one device; accumulation
  is fp32; out_dtype as for tgemm::mm.
- One persistent launch computes every problem: the operands' addresses, sizes and strides go
  to the device as a small int64 table (built on the host each call, copied without a sync).
- Autograd: grads of all a[i] and b[i] come from one more launch of this op.
- torch.compile: tensor addresses cannot be traced, so this is an opaque ``custom_op`` with a
  fake implementation: it stays one node in the graph and runs its kernel as is. Its table copy
  reads host memory, so it is tagged ``cudagraph_unsafe`` (CUDA graphs are split around it).
  When the problems share K and N, ``grouped_mm`` on stacked operands (2-D x 3-D with offs) is
  traceable and graph-safe.
"""

from __future__ import annotations

import torch

from .. import device as _device
from .. import tuning
from ..kernels.grouped import TABLE_COLUMNS, grouped_mm_list_kernel
from .checks import check, check_value, input_precision
from .grouped_mm import INPUT_DTYPES, OUT_DTYPES
from .launcher import num_sms

_OP = "tgemm::grouped_mm_list"
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


# --- checks -------------------------------------------------------------------------------------

def _check_inputs(a: list[torch.Tensor], b: list[torch.Tensor],
                  out_dtype: torch.dtype | None) -> torch.dtype | None:
    """Validate the pairs (also under FakeTensor); return the out dtype (None for no pairs)."""
    check(len(a) == len(b),
          lambda: f"{_OP}: a has {len(a)} matrices but b has {len(b)}")
    if not a:
        return out_dtype
    dtype, device = a[0].dtype, a[0].device
    check_value(dtype in INPUT_DTYPES,
                lambda: f"{_OP}: a[0] has dtype {dtype}; supported: "
                         f"{', '.join(map(str, INPUT_DTYPES))}")
    for i, (x, y) in enumerate(zip(a, b)):
        _check_pair(i, x, y, dtype, device)
    out_dtype = dtype if out_dtype is None else out_dtype
    check_value(out_dtype in OUT_DTYPES,
                lambda: f"{_OP}: out_dtype {out_dtype} is not supported; choose one of "
                         f"{OUT_DTYPES}")
    return out_dtype


def _check_pair(i: int, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> None:
    check(x.dim() == 2 and y.dim() == 2,
          lambda: f"{_OP}: a[{i}] and b[{i}] must be 2-D, got shapes {tuple(x.shape)} and "
                   f"{tuple(y.shape)}")
    check(x.shape[1] == y.shape[0],
          lambda: f"{_OP}: a[{i}] has {x.shape[1]} columns but b[{i}] has {y.shape[0]} rows")
    check_value(x.dtype == dtype and y.dtype == dtype,
                lambda: f"{_OP}: every matrix must have a[0]'s dtype {dtype}, got a[{i}] "
                         f"{x.dtype} and b[{i}] {y.dtype}")
    check(x.device == device and y.device == device,
          lambda: f"{_OP}: every matrix must be on a[0]'s device {device}, got a[{i}] on "
                   f"{x.device} and b[{i}] on {y.device}")
    check(x.layout == torch.strided and y.layout == torch.strided,
          lambda: f"{_OP}: a[{i}] and b[{i}] must be dense (strided) tensors")


# --- the op body --------------------------------------------------------------------------------

def _fake(a: list[torch.Tensor], b: list[torch.Tensor],
          out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Shapes and dtypes only: a contiguous [M_i, N_i] tensor per pair."""
    out_dtype = _check_inputs(a, b, out_dtype)
    return [x.new_empty((x.shape[0], y.shape[1]), dtype=out_dtype) for x, y in zip(a, b)]


# out_dtype has no default in the schema: the dispatcher drops arguments equal to their default,
# and autograd for list inputs expects the backward to match the arguments actually passed.
@torch.library.custom_op("tgemm::grouped_mm_list", mutates_args=(), tags=_TAGS)
def _grouped_mm_list_op(a: list[torch.Tensor], b: list[torch.Tensor],
                        out_dtype: torch.dtype | None) -> list[torch.Tensor]:
    out = _fake(a, b, out_dtype)
    launch_grouped_mm_list(a, b, out)
    return out


_grouped_mm_list_op.register_fake(_fake)


def launch_grouped_mm_list(a: list[torch.Tensor], b: list[torch.Tensor],
                           out: list[torch.Tensor]) -> None:
    """One launch writing a[i] @ b[i] into out[i] for every pair (checked inputs)."""
    if not a:
        return
    device = a[0].device
    error = _device.kernel_device_error(device)
    check(error is None, lambda: f"{_OP}: {error}")
    rows, tiles = [], 0
    # The pointer loaders only: the list's operands have no common layout to describe.
    tile = tuning.heuristic_grouped_tile(max(x.shape[0] for x in a), max(y.shape[1] for y in b),
                                         a[0].element_size(), tma=False)
    for x, y, c in zip(a, b, out):
        (m, k), n = x.shape, y.shape[1]
        rows.append([x.data_ptr(), y.data_ptr(), c.data_ptr(), m, n, k, *x.stride(), *y.stride(),
                     *c.stride()])
        tiles += tuning.output_tiles(m, n, tile)
    if tiles == 0:
        return
    assert len(rows[0]) == TABLE_COLUMNS.value
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned memory copies without a host sync; the caching host allocator keeps the buffer
        # until the copy has run.
        table = table.pin_memory().to(device, non_blocking=True)
    grid = (min(num_sms(device), tiles),)
    aligned = all(_aligned(x, y, c) for x, y, c in zip(a, b, out) if c.numel() > 0)
    grouped_mm_list_kernel[grid](
        a[0], b[0], out[0], table, len(rows), aligned, input_precision(a[0].dtype),
        _device.interpreter_enabled() and a[0].dtype == torch.bfloat16,
        **tuning.tile_meta(tile))


def _aligned(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """What the kernel's ALIGNED flag promises for one problem: rows of a, b and c contiguous,
    16-byte aligned addresses, and K, N and the row strides multiples of 16 elements."""
    matrices = (a, b, c)
    return (all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
                for t in matrices)
            and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0)


# --- autograd -----------------------------------------------------------------------------------
# grad a[i] = grad[i] @ b[i]^T and grad b[i] = a[i]^T @ grad[i]: every pair's gradients are
# independent products again, all computed by one more launch of this op.

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, _ = inputs
    ctx.n = len(a)
    ctx.dtype = a[0].dtype if a else None
    ctx.save_for_backward(*a, *b)


def _backward(ctx, grads):  # type: ignore[no-untyped-def]
    saved = ctx.saved_tensors
    a, b = saved[:ctx.n], saved[ctx.n:]
    grads = [g.to(ctx.dtype) if g is not None else x.new_zeros(x.shape[0], y.shape[1])
             for g, x, y in zip(grads, a, b)]
    # needs_input_grad holds one flag per matrix of each list.
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    lhs = [g for g, need in zip(grads, need_a) if need]
    rhs = [y.t() for y, need in zip(b, need_a) if need]
    lhs += [x.t() for x, need in zip(a, need_b) if need]
    rhs += [g for g, need in zip(grads, need_b) if need]
    products = iter(grouped_mm_list(lhs, rhs))
    grad_a = [next(products) if need else None for need in need_a]
    grad_b = [next(products) if need else None for need in need_b]
    return grad_a, grad_b, None


_grouped_mm_list_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------------

def grouped_mm_list(a: list[torch.Tensor], b: list[torch.Tensor],
                    out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """``[a[i] @ b[i] for i]`` for independent pairs of any sizes, in one Triton launch.

    Args:
        a: matrices [M_i, K_i], any strides; float16, bfloat16 or float32, one dtype for all.
        b: matrices [K_i, N_i] of the same dtype and device, any strides.
        out_dtype: float16, bfloat16 or float32; defaults to the inputs' dtype.

    Returns:
        New contiguous [M_i, N_i] tensors, in order.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> sizes = [(1024, 512, 256), (128, 4096, 64), (300, 77, 1000)]
        >>> a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for m, _, k in sizes]
        >>> b = [torch.randn(k, n, device="cuda", dtype=torch.float16) for _, n, k in sizes]
        >>> c = tg.grouped_mm_list(a, b)   # c[i] == a[i] @ b[i]
    """
    return torch.ops.tgemm.grouped_mm_list(list(a), list(b), out_dtype)
