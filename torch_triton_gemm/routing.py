"""What both override levels share: the planners that route a call, and the router.

override.py (the Python level, a TorchFunctionMode) and aten_override.py (the aten level,
dispatcher kernels) both import this module, which imports neither: each planner takes a call's
arguments and returns a plan that runs it on tgemm's ops (ops/), or the reason it stays with
PyTorch; a ``Router`` (the override object) counts, logs and filters those decisions.

This module reads top to bottom: operand checks, one planner per entry point, and the router.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import device as _device
from . import sharding as _sharding
from .ops import grouped_mm as _grouped_mm_module
from .ops import scaled_grouped_mm as _scaled_grouped_mm_module
from .ops import scaled_mm as _scaled_mm_module
from .ops.compile_ahead import KernelsCompiling, pytorch_until_built
from .ops.grouped_mm import grouped_mm as _tgemm_grouped
from .ops.mm import mm as _tgemm
from .ops.scaled_grouped_mm import scaled_grouped_mm as _tgemm_scaled_grouped
from .ops.scaled_mm import scaled_mm as _tgemm_scaled

FAMILIES = ("mm", "addmm", "bmm", "grouped", "scaled")
# What a routed call does while the tgemm::mm kernels it needs compile: wait for them, or run on
# PyTorch (see Router.run).
WHILE_COMPILING = ("wait", "pytorch")

_LOG = logging.getLogger("torch_triton_gemm.override")

# fp8 is left out on purpose: PyTorch's matmuls reject it, and routing must not change what works.
_ROUTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Device types whose tensors tgemm can run on in this process. kernel_device_error depends only on
# the device type and TRITON_INTERPRET, which is fixed once the package is imported; deciding here
# keeps os.environ out of every call and out of what Dynamo traces.
_KERNEL_DEVICE_TYPES = frozenset(
    kind for kind in ("cuda", "cpu") if _device.kernel_device_error(torch.device(kind)) is None)

# Plain tensors and parameters are routed, and DTensors (sharding.py gives tgemm's ops their
# sharding rules); other tensor subclasses (quantized weights, ...) keep their semantics.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


# --- operand checks -----------------------------------------------------------------------------

def _operand_types(tensors: Sequence[object]) -> str | None:
    """Why the operands' types keep the call with PyTorch, or None: all plain tensors (or
    parameters), or all DTensors."""
    dtensors = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return "an operand is not a tensor"
        if type(t) in _sharding.DTENSOR_TYPES:
            dtensors += 1
        elif type(t) not in _PLAIN_TENSOR_TYPES:
            return "an operand is a tensor subclass"
    if 0 < dtensors < len(tensors):
        return "DTensor and plain tensor operands are mixed"
    return None


def _compute_dtype(*tensors: object, autocast: bool = True) -> torch.dtype | str:
    """The dtype tgemm computes these operands in, or why the call stays with PyTorch.

    ``autocast`` applies torch.autocast's cast, for calls seen above aten (at the aten level
    autocast has already cast what it casts).
    """
    reason = _operand_types(tensors)
    if reason is not None:
        return reason
    first = tensors[0]
    # Each .device makes a new torch.device: read once per tensor (host time per routed call).
    device = first.device
    if device.type not in _KERNEL_DEVICE_TYPES:
        return "tgemm does not run on this device"
    for t in tensors:
        if t is not first and t.device != device:
            return "operands are on different devices"
        if t.dtype not in _ROUTABLE_DTYPES:
            return "dtype is not float16, bfloat16 or float32"
    if autocast and torch.is_autocast_enabled(device.type):
        # aten casts matmul operands to the autocast dtype; tgemm::mm has no autocast rule, so
        # the planners cast the same way.
        return torch.get_autocast_dtype(device.type)
    dtype = first.dtype
    for t in tensors:
        if t.dtype != dtype:
            return "operands have different dtypes"
    return dtype


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def _unfolded(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A product's fresh output ``out`` in the caller's ``shape``. Not a view of it, as aten's
    matmul returns (``_unsafe_view``): a view would refuse what aten's results allow, such as
    ``detach_()`` or, made under no_grad, an in-place op that needs gradients."""
    return out if out.shape == shape else _UNSAFE_VIEW(out, shape)


# --- planners: route a call, or say why not ------------------------------------------------------

class _Plan(NamedTuple):
    family: str  # the ``ops`` name that must be selected, one of FAMILIES
    size: int  # multiply-adds, M * N * K (times the batch), compared with ``min_size``
    run: Callable[[], torch.Tensor]
    op: str = "tgemm::mm"  # the op that runs it, for the log
    # Set where ``run`` amounts to one tgemm call on these tensors, no cast or copy first:
    # ("mm", (a, b, bias)) for tgemm.mm(a, b, bias), ("grouped", (a, b)) for a 3-D x 3-D
    # tgemm.grouped_mm(a, b). The aten level remembers such plans (aten_override.py).
    direct: tuple[str, tuple[torch.Tensor | None, ...]] | None = None


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...],
          keywords: tuple[str, ...] = ()) -> dict[str, Any] | str:
    """Name the arguments as the PyTorch signature does, or say why the call is left alone."""
    if len(args) > len(names):
        return "unexpected positional arguments"
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key == "out" and value is None:
            continue
        if key in bound or (key not in names and key not in keywords):
            return f"keyword argument {key}= is not handled"
        bound[key] = value
    return bound


def _bind_operands(args: tuple, kwargs: dict, names: tuple[str, ...],
                   keywords: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                   autocast: bool = True) -> tuple[dict[str, Any], torch.dtype] | str:
    """Bind the call and find the compute dtype of its operands ``names`` (those in ``optional``
    may be None), or say why the call is left alone."""
    bound = _bind(args, kwargs, names, keywords)
    if isinstance(bound, str):
        return bound
    tensors = [bound.get(name) for name in names
               if not (name in optional and bound.get(name) is None)]
    dtype = _compute_dtype(*tensors, autocast=autocast)
    if isinstance(dtype, str):
        return dtype
    return bound, dtype


def _bind_pair(args: tuple, kwargs: dict, names: tuple[str, str],
               autocast: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.dtype] | str:
    """The two operands of a ``(input, other)``-style call and their compute dtype, or why the
    call is left alone."""
    operands = _bind_operands(args, kwargs, names, autocast=autocast)
    if isinstance(operands, str):
        return operands
    bound, dtype = operands
    return bound[names[0]], bound[names[1]], dtype


def _matrix_plan(family: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> _Plan:
    m, k = a.shape
    n = b.shape[1]
    uncast = all(t is None or t.dtype == dtype for t in (a, b, bias))
    return _Plan(family, m * n * k,
                 lambda: _tgemm(_cast(a, dtype), _cast(b, dtype), _cast(bias, dtype)),
                 direct=("mm", (a, b, bias)) if uncast else None)


_DTENSOR_FOLD_REFUSED = "this PyTorch's DTensor cannot fold the operand's sharding into one dim"


def _dtensor_refuses_reshape(t: torch.Tensor, shape: tuple[int, ...],
                             expand: tuple[int, ...] | None = None) -> bool:
    """Whether ``t`` is a DTensor whose sharding this PyTorch cannot carry through
    ``t.expand(expand).reshape(shape)`` (``t.reshape(shape)`` without ``expand``) without
    redistribution.

    torch 2.11 refuses to fold a sharded dim other than the first of those merged (a sequence-
    sharded [B, T, K] into [B*T, K]); later versions keep it as a strided shard. aten's linear
    and matmul fold contiguous operands the same way, so such calls stay with aten, which raises
    or gets by without folding exactly as it does without the override.
    """
    if type(t) not in _sharding.DTENSOR_TYPES:
        return False
    try:
        (t if expand is None else t.expand(expand)).reshape(shape)
    except RuntimeError:
        return True
    return False


def _folded_plan(family: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, b_is_weight: bool = False) -> _Plan | str:
    """[..., K] @ [K, N]: fold the leading dims into M, multiply once, unfold.

    With ``b_is_weight`` b is an nn.Linear weight [N, K], used as the view ``b.t()``.
    """
    lead = a.shape[:-1]
    m, k = math.prod(lead), a.shape[-1]
    n = b.shape[0] if b_is_weight else b.shape[1]
    if _dtensor_refuses_reshape(a, (m, k)):
        return _DTENSOR_FOLD_REFUSED

    def run() -> torch.Tensor:
        b_kn = _cast(b, dtype).t() if b_is_weight else _cast(b, dtype)
        a_mk = _cast(a, dtype)
        if len(lead) == 1:  # already [M, K]: no view (and no view node for autograd) either way
            return _tgemm(a_mk, b_kn, _cast(bias, dtype))
        return _unfolded(_tgemm(a_mk.reshape(m, k), b_kn, _cast(bias, dtype)), (*lead, n))

    return _Plan(family, m * n * k, run)


def _batched_plan(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> _Plan | str:
    """[..., M, K] @ [..., K, N] with broadcast batch dims, at least one operand 3-D or more.

    The broadcast batch is flattened into one dimension (``expand`` + ``reshape``, which copies
    only an operand whose expanded batch dims cannot merge into one stride) and multiplied in
    one tgemm::grouped_mm launch (its 3-D x 3-D form), or in one tgemm::mm launch with the batch
    folded into M when b is the same matrix for every batch entry.
    """
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if b.shape[-2] != k:
        return "sizes do not match (PyTorch raises)"
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        return "batch dims do not broadcast (PyTorch raises)"
    count = math.prod(batch)
    if count == 0 or m * n * k == 0:
        return "empty batch or matrix"

    b_expanded = b.expand(*batch, k, n)
    one_b = all(size == 1 or stride == 0
                for size, stride in zip(batch, b_expanded.stride()[:-2], strict=True))
    if one_b and torch.is_grad_enabled() and b.requires_grad and any(
            size != 1 for size in b.shape[:-2]):
        # b is an expand()ed tensor whose own gradient has one matrix per batch entry: folding
        # would give the whole gradient to its first entry.
        one_b = False
    if one_b:
        # One B matrix for the whole batch (a single matrix, broadcast): the batch folds into M.
        if _dtensor_refuses_reshape(a, (count * m, k), (*batch, m, k)):
            return _DTENSOR_FOLD_REFUSED
        b_matrix = b_expanded[(0,) * len(batch)]
        return _Plan("bmm", count * m * n * k, lambda: _unfolded(_tgemm(
            _cast(a, dtype).expand(*batch, m, k).reshape(count * m, k),
            _cast(b_matrix, dtype)), (*batch, m, n)))

    if (_dtensor_refuses_reshape(a, (count, m, k), (*batch, m, k))
            or _dtensor_refuses_reshape(b_expanded, (count, k, n))):
        return _DTENSOR_FOLD_REFUSED

    def run() -> torch.Tensor:
        a3 = _cast(a, dtype).expand(*batch, m, k).reshape(count, m, k)
        b3 = _cast(b, dtype).expand(*batch, k, n).reshape(count, k, n)
        return _unfolded(_tgemm_grouped(a3, b3), (*batch, m, n))

    # Two 3-D operands of one batch in the compute dtype: the expands and reshapes are views of
    # the operands as they are.
    direct = (a.shape == (count, m, k) and b.shape == (count, k, n)
              and a.dtype == b.dtype == dtype)
    return _Plan("bmm", count * m * n * k, run, "tgemm::grouped_mm",
                 ("grouped", (a, b)) if direct else None)


def _plan_linear(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_operands(args, kwargs, ("input", "weight", "bias"), optional=("bias",),
                              autocast=autocast)
    if isinstance(operands, str):
        return operands
    bound, dtype = operands
    x, weight, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
    if x.dim() < 2 or weight.dim() != 2:
        return "1-D input or weight not 2-D"
    n, k = weight.shape
    if x.shape[-1] != k:
        return "sizes do not match (PyTorch raises)"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return "bias is not of shape [N]"
    return _folded_plan("mm" if bias is None else "addmm", x, weight, bias, dtype,
                        b_is_weight=True)


def _plan_mm(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_pair(args, kwargs, ("input", "mat2"), autocast=autocast)
    if isinstance(operands, str):
        return operands
    a, b, dtype = operands
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "not [M, K] @ [K, N] (PyTorch raises)"
    return _matrix_plan("mm", a, b, None, dtype)


def _scaled_sum(product: Callable[[], torch.Tensor], input: torch.Tensor, beta: Any,
                alpha: Any, dtype: torch.dtype) -> torch.Tensor:
    """``beta * input + alpha * product()`` rounded once to ``dtype``, as aten's addmm and
    baddbmm do: ``product`` returns the float32 product, and beta = 0 ignores input (NaN too)."""
    out = product()
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        out = out + (input if beta == 1 else input * beta).to(torch.float32)
    return out.to(dtype)


_INPUT_IGNORED_WITH_GRAD = ("beta = 0 with an input that requires grad (PyTorch links the "
                            "output to it with a zero gradient)")


def _input_ignored_with_grad(input: torch.Tensor, beta: Any) -> bool:
    """beta = 0 ignores ``input`` (``_scaled_sum``), which would leave it out of the graph;
    PyTorch's result depends on it with a zero gradient."""
    return beta == 0 and torch.is_grad_enabled() and input.requires_grad


def _bind_scaled_sum(args: tuple, kwargs: dict, names: tuple[str, str, str],
                     autocast: bool) -> tuple[Any, ...] | str:
    """input, the two factors, beta, alpha and the compute dtype of an addmm-style call
    (``beta * input + alpha * product``), or why the call is left alone."""
    operands = _bind_operands(args, kwargs, names, ("beta", "alpha"), autocast=autocast)
    if isinstance(operands, str):
        return operands
    bound, dtype = operands
    return (*(bound.get(name) for name in names), bound.get("beta", 1), bound.get("alpha", 1),
            dtype)


def _plan_addmm(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_scaled_sum(args, kwargs, ("input", "mat1", "mat2"), autocast)
    if isinstance(operands, str):
        return operands
    bias, a, b, beta, alpha, dtype = operands
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "not [M, K] @ [K, N] (PyTorch raises)"
    if _input_ignored_with_grad(bias, beta):
        return _INPUT_IGNORED_WITH_GRAD
    m, k = a.shape
    n = b.shape[1]
    if not _broadcasts_to(bias, (m, n)):
        return "input does not broadcast to [M, N] (PyTorch raises)"
    # The common case, nn.Linear's bias: tgemm's epilogue adds a row of N in fp32.
    if beta == 1 and alpha == 1 and bias.shape[-1:] == (n,) and bias.numel() == n:
        return _matrix_plan("addmm", a, b, bias if bias.dim() == 1 else bias.reshape(n), dtype)
    return _Plan("addmm", m * n * k, lambda: _scaled_sum(
        lambda: _tgemm(_cast(a, dtype), _cast(b, dtype), out_dtype=torch.float32),
        _cast(bias, dtype), beta, alpha, dtype))


def _plan_baddbmm(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_scaled_sum(args, kwargs, ("input", "batch1", "batch2"), autocast)
    if isinstance(operands, str):
        return operands
    c, a, b, beta, alpha, dtype = operands
    if _input_ignored_with_grad(c, beta):
        return _INPUT_IGNORED_WITH_GRAD
    if (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]
            or a.shape[2] != b.shape[1]):
        return "not [B, M, K] @ [B, K, N] (PyTorch raises)"
    count, m, k = a.shape
    n = b.shape[2]
    if not _broadcasts_to(c, (count, m, n)):
        return "input does not broadcast to [B, M, N] (PyTorch raises)"
    if count * m * n * k == 0:
        return "empty batch or matrix"
    return _Plan("bmm", count * m * n * k, lambda: _scaled_sum(
        lambda: _tgemm_grouped(_cast(a, dtype), _cast(b, dtype), out_dtype=torch.float32),
        _cast(c, dtype), beta, alpha, dtype), "tgemm::grouped_mm")


def _broadcasts_to(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return t.dim() <= len(shape) and all(
        size in (1, want) for size, want in zip(reversed(t.shape), reversed(shape)))


def _plan_matmul(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_pair(args, kwargs, ("input", "other"), autocast=autocast)
    if isinstance(operands, str):
        return operands
    a, b, dtype = operands
    if a.dim() < 2 or b.dim() < 2:
        return "1-D operand"
    if b.dim() == 2:
        if a.shape[-1] != b.shape[0]:
            return "sizes do not match (PyTorch raises)"
        return _folded_plan("mm", a, b, None, dtype)
    return _batched_plan(a, b, dtype)


def _plan_rmatmul(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    # Tensor.__rmatmul__(self, other) computes other @ self.
    if len(args) != 2 or kwargs:
        return "unexpected arguments"
    return _plan_matmul((args[1], args[0]), {}, autocast)


def _plan_bmm(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    operands = _bind_pair(args, kwargs, ("input", "mat2"), autocast=autocast)
    if isinstance(operands, str):
        return operands
    a, b, dtype = operands
    if (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]
            or a.shape[2] != b.shape[1]):
        return "not [B, M, K] @ [B, K, N] (PyTorch raises)"
    return _batched_plan(a, b, dtype)


def _check_plain(tensors: tuple[Any, ...]) -> str | None:
    """Why tgemm cannot take these operands as they are (None where it can): the type and
    device checks that the planners above make in ``_compute_dtype``. The first two are
    required, the others may be None."""
    if tensors[0] is None or tensors[1] is None:
        return "an operand is missing"
    present = [t for t in tensors if t is not None]
    reason = _operand_types(present)
    if reason is not None:
        return reason
    if present[0].device.type not in _KERNEL_DEVICE_TYPES:
        return "tgemm does not run on this device"
    return None


def _rejected(check: Callable[[], object]) -> str | None:
    """Run one of the ops' own argument checks: the message of what it rejects, else None."""
    try:
        check()
    except (RuntimeError, ValueError) as error:
        return f"tgemm rejects the arguments: {error}"
    return None


def _plan_grouped(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    bound = _bind(args, kwargs, ("input", "mat2", "offs", "bias", "out_dtype"))
    if isinstance(bound, str):
        return bound
    a, b = bound.get("input"), bound.get("mat2")
    offs, bias, out_dtype = bound.get("offs"), bound.get("bias"), bound.get("out_dtype")
    reason = _check_plain((a, b, offs, bias))
    if reason is not None:
        return reason
    if autocast and torch.is_autocast_enabled(a.device.type):
        return "autocast is enabled (its rule for torch._grouped_mm stays with PyTorch)"
    reason = _rejected(lambda: _grouped_mm_module._check_inputs(a, b, offs, bias, out_dtype,
                                                                False))
    if reason is not None:
        return reason
    return _Plan("grouped", _grouped_size(a, b),
                 lambda: _tgemm_grouped(a, b, offs, bias, out_dtype), "tgemm::grouped_mm")


def _grouped_size(a: torch.Tensor, b: torch.Tensor) -> int:
    """Multiply-adds of a grouped product: every row of a meets N columns of b (K deep), except
    3-D a x 2-D b, whose G matrices of M rows share out's N columns between them."""
    if (a.dim(), b.dim()) == (3, 2):
        return a.shape[1] * a.shape[-1] * b.shape[1]
    return a.numel() * b.shape[-1]


def _plan_scaled(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    names = ("input", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype",
             "use_fast_accum")
    bound = _bind(args, kwargs, names)
    if isinstance(bound, str):
        return bound
    a, b, scale_a, scale_b = (bound.get(name) for name in names[:4])
    bias, out_dtype = bound.get("bias"), bound.get("out_dtype")
    if bound.get("scale_result") is not None:
        return "scale_result is given (tgemm does not scale the output)"
    if out_dtype is None:
        return "out_dtype is not given: PyTorch then returns the fp8 input dtype, which tgemm " \
               "does not produce"
    reason = _check_plain((a, b, scale_a, scale_b, bias))
    if reason is not None:
        return reason
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, scale_a, scale_b)):
        return "a quantized operand or scale requires grad"
    reason = _rejected(lambda: _scaled_mm_module._check_inputs(a, b, scale_a, scale_b, bias,
                                                               out_dtype))
    if reason is not None:
        return reason
    # fp4 operands pack two values a byte along K.
    k = a.shape[1] * (2 if a.dtype == _scaled_mm_module.FP4_DTYPE else 1)
    use_fast_accum = bool(bound.get("use_fast_accum", False))
    return _Plan("scaled", a.shape[0] * b.shape[1] * k,
                 lambda: _tgemm_scaled(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum),
                 "tgemm::scaled_mm")


def _plan_scaled_grouped(args: tuple, kwargs: dict, autocast: bool = True) -> _Plan | str:
    names = ("input", "mat2", "scale_a", "scale_b", "offs", "bias", "scale_result", "out_dtype",
             "use_fast_accum")
    bound = _bind(args, kwargs, names)
    if isinstance(bound, str):
        return bound
    a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype = (
        bound.get(name) for name in names[:8])
    use_fast_accum = bool(bound.get("use_fast_accum", False))
    reason = _check_plain((a, b, scale_a, scale_b, offs, bias, scale_result))
    if reason is not None:
        return reason
    if type(a) in _sharding.DTENSOR_TYPES:
        return "DTensor operands (tgemm::scaled_grouped_mm has no sharding rules)"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (a, b, scale_a, scale_b, bias)):
        return "an operand, a scale or bias requires grad"
    reason = _rejected(lambda: _scaled_grouped_mm_module._check_inputs(
        a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum))
    if reason is not None:
        return reason
    return _Plan("scaled", _grouped_size(a, b),
                 lambda: _tgemm_scaled_grouped(a, b, scale_a, scale_b, offs, bias, None,
                                               out_dtype, use_fast_accum),
                 "tgemm::scaled_grouped_mm")


def _describe(args: tuple) -> str:
    return ", ".join(f"{list(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a)
                     for a in args)


# --- the router ---------------------------------------------------------------------------------

class Router:
    """What both override levels share: the families to route, ``min_size``, the decision log
    and ``counts``."""

    def __init__(self, ops: frozenset[str], min_size: int, log: bool,
                 while_compiling: str = "wait") -> None:
        self.ops = ops
        self.min_size = min_size
        self.log = log
        self.while_compiling = while_compiling
        self.pytorch_while_compiling = while_compiling == "pytorch"
        self.counts: dict[str, int] = dict.fromkeys((*FAMILIES, "fallback"), 0)
        # Routed calls (counted in ``counts``) that ran on PyTorch while their kernels compiled.
        self.ran_while_compiling = 0
        # Threads share this object; += on a dict entry is a read-modify-write, so increments
        # take the lock.
        self._counts_lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    def decide(self, name: str, plan: _Plan | str, args: tuple) -> _Plan | None:
        """The plan to run, or None where the call stays with PyTorch; counted and logged."""
        if not isinstance(plan, str):
            if plan.family not in self.ops:
                plan = f"'{plan.family}' is not in ops"
            elif self.min_size and plan.size < self.min_size:
                plan = "M * N * K is below min_size"
        # Under torch.compile this body runs once, when Dynamo traces; counting or logging there
        # would be recorded as side effects to replay, so compiled calls go uncounted.
        traced = torch.compiler.is_compiling()
        if isinstance(plan, str):
            if not traced:
                self._count("fallback")
                if self.log:
                    _LOG.info("%s(%s) stays with PyTorch: %s", name, _describe(args), plan)
            return None
        if not traced:
            self._count(plan.family)
            if self.log:
                _LOG.debug("%s(%s) -> %s [%s]", name, _describe(args), plan.op, plan.family)
        return plan

    def run(self, call: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Run a routed call (a plan's ``run``); None where the router runs calls on PyTorch
        while their kernels compile (``while_compiling="pytorch"``) and this call's are not
        built yet (its kernels are then compiling in the background; the caller runs the call
        on PyTorch)."""
        if not self.pytorch_while_compiling or torch.compiler.is_compiling():
            return call()
        try:
            with pytorch_until_built():
                return call()
        except KernelsCompiling:
            with self._counts_lock:
                self.ran_while_compiling += 1
            return None

    def _describe_settings(self) -> str:
        settings = (f"ops={tuple(f for f in FAMILIES if f in self.ops)}, "
                    f"min_size={self.min_size}, log={self.log}")
        if self.while_compiling != "wait":
            settings += f", while_compiling={self.while_compiling!r}"
        return settings
