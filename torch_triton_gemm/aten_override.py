"""The aten-level override: tgemm kernels stand in for aten's GEMM kernels while a context is open.

``override(level="aten")`` registers, for the devices tgemm runs on (CUDA; CPU under
``TRITON_INTERPRET=1``), kernels for ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` (and their
``out=`` forms), ``_grouped_mm`` and ``_scaled_mm`` (and its ``out=`` form) with PyTorch's
dispatcher. Every caller then reaches tgemm: ``torch.einsum``, C++ code paths, the autograd
formulas of other ops, other libraries' ops, and the aten calls that compiled code makes. Each
kernel plans the call with the same planners as the Python-level mode (override.py); what tgemm
cannot serve exactly goes to the kernel that was registered before, taken with
``torch.library.get_kernel``.

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

from .ops import grouped_mm as _grouped_module
from .ops import mm as _mm_module
from .ops._registry import _without_dynamo
from .override import (
    _KERNEL_DEVICE_TYPES,
    Router,
    _plan_addmm,
    _plan_baddbmm,
    _plan_bmm,
    _plan_grouped,
    _plan_mm,
    _plan_scaled,
)


class _AtenOp(NamedTuple):
    name: str  # the aten overload, as torch.library names it
    planner: Callable[..., Any]  # override.py's planner for its arguments
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


# --- the fast route of repeated plain products ----------------------------------------------------
# A model's GEMMs repeat a few signatures every step, and most are plain products that the
# planners route to one tgemm eager call on the operands as they are: aten::mm, aten::addmm with
# a bias of N and beta = alpha = 1 (tgemm.mm), aten::bmm of a batch not shared by b
# (tgemm.grouped_mm, 3-D x 3-D). Once the planner has routed such a call, later calls with its
# signature go straight to that eager call, skipping the planner (whose decision depends only on
# the signature and the router's settings). Host time per routed GEMM matters: a small model's
# eager step issues hundreds of them.
_ROUTED_PRODUCTS: dict[tuple[Any, ...], str] = {}
_ROUTED_PRODUCTS_LIMIT = 4096
_REMEMBERED_OPS = ("mm", "addmm", "bmm")


def _plain_route(name: str, args: tuple, kwargs: dict
                 ) -> tuple[tuple[Any, ...], Callable[[], torch.Tensor]] | None:
    """The eager signature and the direct tgemm call of an aten::mm / addmm / bmm call that the
    planners route to that call if they route it at all, or None.

    Only where tgemm's eager path would be taken anyway (plain tensors, no mode, not tracing):
    the planner's run ends there too.
    """
    if name == "bmm":
        if len(args) != 2 or kwargs:
            return None
        a, b = args
        # The planner folds a batch that b shares (one entry, or a stride-0 batch) into M.
        if (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or b.shape[0] < 2
                or b.stride(0) == 0 or not _mm_module._plain_eager(a, b)):
            return None
        return (_grouped_module._eager_signature(a, b, None, None, None, False),
                lambda: _grouped_module._grouped_mm_eager(a, b))
    if name == "mm" and len(args) == 2 and not kwargs:
        a, b = args
        bias = None
    elif (name == "addmm" and len(args) == 3 and kwargs.keys() <= {"beta", "alpha"}
          and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1):
        bias, a, b = args
        if bias.dim() != 1 or b.dim() != 2 or bias.shape[0] != b.shape[1]:
            return None
    else:
        return None
    if not _mm_module._plain_eager(a, b, bias):
        return None
    signature = _mm_module._eager_signature(a, b, bias, "none", None)
    return signature, lambda: _mm_module._eager_allocate_and_launch(a, b, bias, "none", None,
                                                                    signature)


def _aten_kernel(op: _AtenOp, previous: Any) -> Callable[..., Any]:
    """The kernel registered for ``op``: route the call through ``_ACTIVE``'s decision, or call
    the kernel registered before."""
    name = "aten::" + op.name
    remembers = op.name in _REMEMBERED_OPS

    def kernel(keyset, *args, **kwargs):  # type: ignore[no-untyped-def]
        router = _ACTIVE
        if router is None or getattr(_ROUTING, "busy", False):
            return previous.call_boxed(keyset, *args, **kwargs)
        key = None  # set for a plain product, whose routing is then remembered
        if remembers and not router.log:  # (a logging router plans, and logs, every call)
            route = _plain_route(op.name, args, kwargs)
            if route is not None:
                signature, run = route
                key = (op.name, router.ops, router.min_size, signature)
                family = _ROUTED_PRODUCTS.get(key)
                if family is not None:
                    router._count(family)
                    return run()
        out = kwargs.pop("out", None)
        grad_mode = torch.is_grad_enabled()
        # Below autograd already: aten's formula records this call's graph node. tgemm's
        # Python entry points must not record one of their own.
        torch._C._set_grad_enabled(False)
        _ROUTING.busy = True
        try:
            plan: Any = op.planner(args, kwargs, autocast=False)
            if out is not None and not isinstance(plan, str):
                wanted = _out_dtype(op, args, kwargs)
                if out.dtype != wanted:
                    plan = f"out has dtype {out.dtype}, the product has {wanted}"
            plan = router.decide(name, plan, args)
            result = None if plan is None else plan.run()
            if key is not None and plan is not None:
                if len(_ROUTED_PRODUCTS) >= _ROUTED_PRODUCTS_LIMIT:
                    _ROUTED_PRODUCTS.clear()
                _ROUTED_PRODUCTS[key] = plan.family
        finally:
            _ROUTING.busy = False
            torch._C._set_grad_enabled(grad_mode)
        if result is None:
            if out is not None:
                kwargs["out"] = out
            return previous.call_boxed(keyset, *args, **kwargs)
        if out is None:
            return result
        if out.shape != result.shape:
            out.resize_(result.shape)
        return out.copy_(result)

    return _without_dynamo(kernel)


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point.
        warnings.simplefilter("ignore", UserWarning)
        for op in _ATEN_OPS:
            for key in _DISPATCH_KEYS:
                previous = torch.library.get_kernel("aten::" + op.name, key)
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
