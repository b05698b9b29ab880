"""The aten-level override: tgemm kernels stand in for aten's GEMM kernels while a context is open.

``override(level="aten")`` registers, for the devices tgemm runs on (CUDA; CPU under
``TRITON_INTERPRET=1``), kernels for ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` (and their
``out=`` forms), ``_grouped_mm``, ``_scaled_mm`` (and its ``out=`` form) and
``_scaled_grouped_mm`` with PyTorch's dispatcher. Every caller then reaches tgemm:
``torch.einsum``, C++ code paths, the autograd formulas of other ops, other libraries' ops, and
the aten calls that compiled code makes. Each kernel plans the call with the same planners as
the Python-level mode (routing.py); what tgemm cannot serve exactly goes to the kernel that was
registered before, taken with ``torch.library.get_kernel`` (or, where PyTorch has none for the
device, as ``_scaled_grouped_mm`` on CPU, raises as the dispatcher would).

Why a dispatcher registration and not a TorchDispatchMode: modes are thread-local and
torch.compile does not trace through TorchDispatchModes, while a registration is seen by every
call of every thread, compiled or not. The cost of that is scope: the registration is
process-wide, so only one aten-level override can be open at a time.

The kernels run below autograd: aten's own derivative formulas record the graph, and the
backward products they issue are aten GEMMs again, so they are routed too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .ops import compile_ahead as _compile_ahead
from .ops import grouped_mm as _grouped_module
from .ops import mm as _mm_module
from .ops._registry import _without_dynamo
from .ops.launcher import plain_eager
from .routing import (
    _KERNEL_DEVICE_TYPES,
    Router,
    _plan_addmm,
    _plan_baddbmm,
    _plan_bmm,
    _plan_grouped,
    _plan_mm,
    _plan_scaled,
    _plan_scaled_grouped,
)


class _AtenOp(NamedTuple):
    name: str  # the aten overload, as torch.library names it
    planner: Callable[..., Any]  # routing.py's planner for its arguments
    # For out= forms: where the out tensor's dtype must come from (a positional index of a
    # GEMM operand, or a keyword naming the out dtype), else None.
    out_dtype_from: int | str | None = None


_ATEN_OPS = (
    _AtenOp("mm", _plan_mm),
    _AtenOp("mm.out", _plan_mm, 0),
    _AtenOp("addmm", _plan_addmm),
    _AtenOp("addmm.out", _plan_addmm, 1),
    _AtenOp("bmm", _plan_bmm),
    _AtenOp("bmm.out", _plan_bmm, 0),
    _AtenOp("baddbmm", _plan_baddbmm),
    _AtenOp("baddbmm.out", _plan_baddbmm, 1),
    _AtenOp("_grouped_mm", _plan_grouped),
    _AtenOp("_scaled_mm", _plan_scaled),
    _AtenOp("_scaled_mm.out", _plan_scaled, "out_dtype"),
    _AtenOp("_scaled_grouped_mm", _plan_scaled_grouped),
)

_DISPATCH_KEYS = tuple(key for kind, key in (("cuda", "CUDA"), ("cpu", "CPU"))
                       if kind in _KERNEL_DEVICE_TYPES)

# The open aten-level override (one per process), how often it is entered, and the library
# that holds its registrations.
_LOCK = threading.Lock()
_ACTIVE: AtenGemmOverride | None = None
_DEPTH = 0
_LIBRARY: torch.library.Library | None = None

# Set while a routed call runs, per thread: aten GEMMs issued inside tgemm's own code go to the
# previous kernels rather than back into tgemm.
_ROUTING = threading.local()


def _out_dtype(op: _AtenOp, args: tuple, kwargs: dict) -> torch.dtype | None:
    source = op.out_dtype_from
    if isinstance(source, int):
        return args[source].dtype if len(args) > source else None
    if source in kwargs:
        return kwargs[source]
    position = _argument_position(op.name, source)
    return args[position] if len(args) > position else None


@functools.cache
def _argument_position(name: str, argument: str) -> int:
    """Where ``argument`` sits in the schema of the aten overload ``name`` ("op.overload")."""
    packet, _, overload = name.partition(".")
    schema = getattr(getattr(torch.ops.aten, packet), overload or "default")._schema
    return [a.name for a in schema.arguments].index(argument)


# --- remembered routes ------------------------------------------------------------------------
# A model's GEMMs repeat a few signatures every step, and most are routed to one tgemm call on
# the operands as they are (the planner's plan says so: ``_Plan.direct``). Once the planner has
# routed a call that way, later calls with its signature (the eager signature of that tgemm
# call: every tensor's shape, strides, dtype, device and alignment, fp32 precision, tuned-plan
# version; with the call's scalars and the router's settings) go straight to that call's eager
# path: the planner's decision depends on nothing else. Host time per routed GEMM matters: a
# small model's eager step issues hundreds of them.
class _Direct(NamedTuple):
    kind: str  # the tgemm call of the op's direct plans, as in ``_Plan.direct``
    arity: int  # positional arguments of the aten op
    operands: Callable[[tuple], tuple[torch.Tensor | None, ...]]  # that call's, from the op's


_DIRECT_CALLS = {
    "mm": _Direct("mm", 2, lambda args: (args[0], args[1], None)),
    "addmm": _Direct("mm", 3, lambda args: (args[1], args[2], args[0])),  # input is the bias
    "bmm": _Direct("grouped", 2, lambda args: args),
}
_ROUTED_CALLS: dict[tuple[Any, ...], str] = {}  # routed key -> family
_ROUTED_CALLS_LIMIT = 4096


def _eager_signature(kind: str, operands: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    if kind == "mm":
        return _mm_module.mm_eager_signature(*operands, "none", None)
    return _grouped_module.grouped_eager_signature(*operands, None, None, None, False)


def _is_direct(plan: Any, kind: str, operands: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether the planner's plan is the direct call ``kind`` on these very operands."""
    if plan.direct is None or plan.direct[0] != kind:
        return False
    planned = plan.direct[1]
    return len(planned) == len(operands) and all(x is y for x, y in zip(planned, operands))


def _run_direct(kind: str, operands: tuple[torch.Tensor | None, ...],
                signature: tuple[Any, ...]) -> torch.Tensor:
    """The direct call, on its eager path (no autograd: below it already), with the eager
    signature the route was looked up by."""
    if kind == "mm":
        return _mm_module.mm_eager_call(*operands, "none", None, signature)
    return _grouped_module.grouped_eager_call(*operands, None, None, None, False, signature)


def _aten_kernel(op: _AtenOp, previous: Any) -> Callable[..., Any]:
    """The kernel registered for ``op``: route the call through ``_ACTIVE``'s decision, or call
    the kernel registered before."""
    name = "aten::" + op.name
    direct = _DIRECT_CALLS.get(op.name)

    def kernel(keyset, *args, **kwargs):  # type: ignore[no-untyped-def]
        router = _ACTIVE
        if router is None or getattr(_ROUTING, "busy", False):
            return previous.call_boxed(keyset, *args, **kwargs)
        # Where this call's route may be remembered: its operands, as the direct call takes
        # them, and its key. Logging routers plan (and log) every call.
        operands = key = None
        if (direct is not None and not router.log and len(args) == direct.arity
                and plain_eager(*args)
                and (not kwargs or all(type(v) in (int, float, bool) for v in kwargs.values()))):
            operands = direct.operands(args)
            signature = _eager_signature(direct.kind, operands)
            key = (op.name, router.ops, router.min_size, tuple(kwargs.items()), signature)
            family = _ROUTED_CALLS.get(key)
            if family is not None:
                router._count(family)
                if not router.pytorch_while_compiling:
                    return _run_direct(direct.kind, operands, signature)
                result = router.run(functools.partial(_run_direct, direct.kind, operands,
                                                      signature))
                if result is not None:
                    return result
                return previous.call_boxed(keyset, *args, **kwargs)
        out = kwargs.pop("out", None)
        grad_mode = torch.is_grad_enabled()
        # Below autograd already: aten's formula records this call's graph node. tgemm's
        # Python entry points must not record one of their own.
        torch._C._set_grad_enabled(False)
        _ROUTING.busy = True
        _compile_ahead.RECORDED_BELOW.on = grad_mode
        try:
            plan: Any = op.planner(args, kwargs, autocast=False)
            if out is not None and not isinstance(plan, str):
                wanted = _out_dtype(op, args, kwargs)
                if out.dtype != wanted:
                    plan = f"out has dtype {out.dtype}, the product has {wanted}"
            plan = router.decide(name, plan, args)
            result = None if plan is None else router.run(plan.run)
            if key is not None and plan is not None and _is_direct(plan, direct.kind, operands):
                if len(_ROUTED_CALLS) >= _ROUTED_CALLS_LIMIT:
                    _ROUTED_CALLS.clear()
                _ROUTED_CALLS[key] = plan.family
        finally:
            _ROUTING.busy = False
            _compile_ahead.RECORDED_BELOW.on = False
            torch._C._set_grad_enabled(grad_mode)
        if result is None:
            if out is not None:
                kwargs["out"] = out
            return previous.call_boxed(keyset, *args, **kwargs)
        if out is None:
            return result
        if out.shape != result.shape:
            _resize_output(out, result.shape)
        return out.copy_(result)

    return _without_dynamo(kernel)


def _resize_output(out: torch.Tensor, shape: torch.Size) -> None:
    """Resize an ``out=`` tensor as aten's out= kernels do (at::native::resize_output), with
    PyTorch's deprecation warning where it had elements."""
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape "
            f"{list(out.shape)}, which does not match the required output shape "
            f"{list(shape)}. This behavior is deprecated, and in a future PyTorch release "
            f"outputs will not be resized unless they have zero elements. You can explicitly "
            f"reuse an out tensor t by resizing it, inplace, to zero elements with "
            f"t.resize_(0).", UserWarning, stacklevel=2)
    out.resize_(shape)


class _NoKernel(NamedTuple):
    """Stands in for the previous kernel where PyTorch has none for the device (the CPU build
    has no ``_scaled_grouped_mm``): calls tgemm declines fail as they would without the
    override."""
    name: str
    key: str

    def call_boxed(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Could not run '{self.name}' with arguments from the '{self.key}' backend: PyTorch "
            f"has no {self.key} kernel for it, and tgemm's override declined the call")


def _previous_kernel(name: str, key: str) -> Any:
    try:
        return torch.library.get_kernel(name, key)
    except RuntimeError:  # no kernel registered for this dispatch key
        return _NoKernel(name, key)


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point.
        warnings.simplefilter("ignore", UserWarning)
        for op in _ATEN_OPS:
            for key in _DISPATCH_KEYS:
                previous = _previous_kernel("aten::" + op.name, key)
                library.impl(op.name, _aten_kernel(op, previous), key, with_keyset=True)
    return library


class AtenGemmOverride(Router, contextlib.ContextDecorator):
    """The aten-level override; made by :func:`torch_triton_gemm.override` with
    ``level="aten"``.

    Entering registers tgemm's kernels for aten's GEMM ops process-wide; leaving (also on an
    exception) removes them, which puts back the kernels registered before. The same object may
    be entered again while open (nesting, recursion, other threads): the kernels stay until the
    last exit. Another aten-level override cannot open while one is open.
    """

    def __repr__(self) -> str:
        return f"override({self._describe_settings()}, level='aten')"

    def __enter__(self) -> AtenGemmOverride:
        global _ACTIVE, _DEPTH, _LIBRARY
        with _LOCK:
            if _ACTIVE is not None and _ACTIVE is not self:
                raise RuntimeError(
                    f"override(level='aten'): {_ACTIVE!r} is open; the aten-level override is "
                    "process-wide, so only one can be open at a time (enter the same object "
                    "again to nest it)")
            if _ACTIVE is None:
                _LIBRARY = _register()
                _ACTIVE = self
            _DEPTH += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE, _DEPTH, _LIBRARY
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _ACTIVE = None
                library, _LIBRARY = _LIBRARY, None
                if library is not None:
                    library._destroy()


def active() -> AtenGemmOverride | None:
    """The open aten-level override, or None."""
    return _ACTIVE
