"""Drop-in override: PyTorch's matrix products run on tgemm's ops inside a context.

``with torch_triton_gemm.override():`` sends the matmul entry points that models call —
``nn.Linear`` / ``F.linear``, ``torch.mm``, ``torch.addmm``, ``torch.matmul`` / ``@`` and
``torch.bmm``, as functions and as Tensor methods — to ``torch.ops.tgemm.mm`` (batched products
to ``tgemm.grouped_mm``), and ``torch._grouped_mm`` / ``torch._scaled_mm`` /
``torch._scaled_grouped_mm`` to ``tgemm.grouped_mm`` / ``tgemm.scaled_mm`` /
``tgemm.scaled_grouped_mm``. A call that the ops cannot serve exactly (dtype,
device, ``out=``, arguments they reject, below ``min_size``) falls through to PyTorch unchanged.

How: the default override is a ``TorchFunctionMode``, so it sees calls at the Python API, above
autograd (``level="aten"``, in aten_override.py, registers dispatcher kernels with the same
planners instead).
A routed call becomes tgemm op calls, whose autograd formulas are tgemm ops again, so the
backward pass runs on tgemm too. torch.compile traces through the mode (Dynamo inlines
``__torch_function__`` and guards on the mode stack), so graphs compiled inside the context hold
tgemm ops and graphs compiled outside do not.

The planners (one per entry point: a plan to route the call, or the reason it stays with
PyTorch) and the router that both levels share live in routing.py. This module reads top to
bottom: the entry points, the mode, and the public function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.overrides import TorchFunctionMode

from . import env
from .aten_override import AtenGemmOverride
from .routing import (
    FAMILIES,
    WHILE_COMPILING,
    Router,
    _Plan,
    _plan_addmm,
    _plan_baddbmm,
    _plan_bmm,
    _plan_grouped,
    _plan_linear,
    _plan_matmul,
    _plan_mm,
    _plan_rmatmul,
    _plan_scaled,
    _plan_scaled_grouped,
)

# Entry point -> (name for the log, planner). ``a @ b`` arrives as Tensor.matmul; __matmul__ is
# listed too for the Python versions that pass the operator itself.
_ENTRY_POINTS: dict[Callable, tuple[str, Callable[[tuple, dict], _Plan | str]]] = {
    torch.nn.functional.linear: ("linear", _plan_linear),
    torch.mm: ("mm", _plan_mm),
    torch.Tensor.mm: ("Tensor.mm", _plan_mm),
    torch.addmm: ("addmm", _plan_addmm),
    torch.Tensor.addmm: ("Tensor.addmm", _plan_addmm),
    torch.matmul: ("matmul", _plan_matmul),
    torch.Tensor.matmul: ("Tensor.matmul", _plan_matmul),
    torch.Tensor.__matmul__: ("@", _plan_matmul),
    torch.Tensor.__rmatmul__: ("@ (reflected)", _plan_rmatmul),
    torch.bmm: ("bmm", _plan_bmm),
    torch.Tensor.bmm: ("Tensor.bmm", _plan_bmm),
    torch.baddbmm: ("baddbmm", _plan_baddbmm),
    torch.Tensor.baddbmm: ("Tensor.baddbmm", _plan_baddbmm),
    torch._grouped_mm: ("_grouped_mm", _plan_grouped),
    torch._scaled_mm: ("_scaled_mm", _plan_scaled),
    torch._scaled_grouped_mm: ("_scaled_grouped_mm", _plan_scaled_grouped),
}



# --- the mode -----------------------------------------------------------------------------------

class GemmOverride(Router, TorchFunctionMode, contextlib.ContextDecorator):
    """The Python-level override, a TorchFunctionMode that routes matrix products to tgemm's
    ops; made by :func:`override` with ``level="python"``.

    ``__enter__`` and ``__exit__`` are TorchFunctionMode's own: Dynamo supports modes that keep
    them, also across graph breaks inside the context.
    """

    def __init__(self, ops: frozenset[str], min_size: int, log: bool,
                 while_compiling: str = "wait") -> None:
        TorchFunctionMode.__init__(self)
        Router.__init__(self, ops, min_size, log, while_compiling)

    def __repr__(self) -> str:
        return f"override({self._describe_settings()})"

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        entry = _ENTRY_POINTS.get(func)
        if entry is None:  # most calls of a model's step: pass them on at the least cost
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        name, planner = entry
        plan = self.decide(name, _transform_active() or planner(args, kwargs), args)
        result = None if plan is None else self.run(plan.run)
        if result is None:
            return _call_past_overrides(func, args, kwargs)
        return result


def _transform_active() -> str | None:
    """Why calls stay with PyTorch while a torch.func transform (grad, jacrev, jvp, vmap, ...)
    or forward-mode AD is active, else None: tgemm's autograd formulas are reverse-mode
    autograd.Functions, which such transforms reject or, for tangents, silently drop."""
    if torch.compiler.is_compiling():
        return None
    if torch._C._are_functorch_transforms_active() or _forward_ad._current_level >= 0:
        return "a torch.func transform or forward-mode AD is active"
    return None


def _call_past_overrides(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Call ``func`` with every GemmOverride lifted off the mode stack, other modes kept in order.

    An override that declines a call has the last word: an outer override must not route what
    an inner one (with, say, a smaller ``ops``) left alone.
    """
    depth = torch._C._len_torch_function_stack()
    modes = [torch._C._get_function_stack_at(i) for i in range(depth)]
    if not any(isinstance(mode, GemmOverride) for mode in modes):
        return func(*args, **kwargs)
    kept = [mode for mode in modes if not isinstance(mode, GemmOverride)]
    for _ in modes:
        torch._C._pop_torch_function_stack()
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        return func(*args, **kwargs)
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)


# --- public API ---------------------------------------------------------------------------------

def override(ops: Iterable[str] = FAMILIES, min_size: int = 0, log: bool = False,
             level: str = "python", while_compiling: str | None = None) -> Router:
    """Run PyTorch's matrix products on tgemm inside a ``with`` block or decorated function.

    Routed entry points (function and Tensor-method forms):

    - ``"mm"``: ``torch.mm``, ``F.linear`` / ``nn.Linear`` without bias, ``torch.matmul`` and
      ``@`` for [M, K] @ [K, N] and [..., K] @ [K, N] (leading dims folded into M).
    - ``"addmm"``: ``torch.addmm`` and ``F.linear`` / ``nn.Linear`` with bias. With beta =
      alpha = 1 and an input of shape [N] or [1, N] (a bias) the add runs in tgemm's epilogue;
      otherwise the product is taken in float32 and ``beta * input + alpha * product`` rounded
      once, as aten does (beta = 0 ignores input, NaN included).
    - ``"bmm"``: ``torch.bmm``, and ``torch.matmul`` / ``@`` for [..., M, K] @ [..., K, N] of
      any rank with broadcast batch dims ([B, H, T, D] @ [B, H, D, T], [1, M, K] @ [B, K, N],
      [B, 1, M, K] @ [H, K, N], [M, K] @ [B, K, N]): the batch is flattened into one dimension
      (``expand`` + ``reshape``, which copies only an operand whose broadcast batch dims cannot
      share one stride) and runs in one ``tgemm.grouped_mm`` launch; when the right operand is
      the same matrix for the whole batch, the batch folds into M of one ``tgemm.mm`` launch.
      ``torch.baddbmm`` (any beta, alpha and broadcast input) as addmm's general case.
    - ``"grouped"``: ``torch._grouped_mm`` in all its forms, to ``tgemm.grouped_mm``.
    - ``"scaled"``: ``torch._scaled_mm`` with an ``out_dtype`` of bfloat16, float16 or float32,
      to ``tgemm.scaled_mm``; ``torch._scaled_grouped_mm`` to ``tgemm.scaled_grouped_mm``.

    Everything else falls through to PyTorch unchanged: tensors tgemm cannot run on (CUDA, or
    CPU under ``TRITON_INTERPRET=1``), float64 / integer / complex or mixed dtypes, ``out=``
    (at the Python level), 1-D operands, empty batches, tensor subclasses other than DTensor,
    DTensors mixed with plain tensors, products with M * N * K (times the batch) below
    ``min_size``; for ``torch._grouped_mm``, ``torch._scaled_mm`` and
    ``torch._scaled_grouped_mm``, arguments the tgemm op rejects, ``_grouped_mm`` under
    autocast, ``_scaled_mm`` with ``scale_result``, without ``out_dtype`` (PyTorch then returns
    the fp8 input dtype, which tgemm does not produce), and the scaled products with an input
    that requires grad. Under ``torch.autocast`` the operands of the other entry points are cast to
    the autocast dtype, as aten does. Gradients of routed calls are computed by tgemm as well.
    At the Python level also: calls while a torch.func transform or forward-mode AD is active,
    addmm / baddbmm with beta = 0 and an input that requires grad, and the linears inside
    ``nn.MultiheadAttention`` (a mode does not see the calls ``F.multi_head_attention_forward``
    makes); the aten level routes them.

    DTensor operands (tensor parallel) are routed like plain ones: the tgemm ops have DTensor
    sharding rules (``torch_triton_gemm.sharding``), so each rank runs tgemm on its shards with
    the collectives DTensor makes for aten's matmuls.

    Two levels. ``level="python"`` (the default) is a ``TorchFunctionMode``: it sees the Python
    entry points above, and torch.compile traces through it. ``level="aten"`` registers tgemm
    kernels for ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` (and their ``out=`` forms),
    ``_grouped_mm``, ``_scaled_mm`` and ``_scaled_grouped_mm`` with PyTorch's dispatcher while
    open, so every caller is routed: ``torch.einsum``, C++ code, other ops' autograd formulas,
    other libraries' ops, and compiled code (see below). Pick the Python level for models you
    compile (tgemm ops in the graph, Inductor sees them, no copy) and the aten level to catch
    GEMMs the Python level cannot see. Both may be open at once; the Python level decides
    first, and a call it leaves to PyTorch then reaches the aten level, which decides with its
    own settings.

    At the Python level, mode stacks are thread-local: only the thread
    that entered it is routed; other threads' matmuls run as usual. One override object may be
    entered by several threads at once; its ``counts`` then add up the calls of all of them.
    Nested overrides: the innermost decides, and a call it leaves to PyTorch is not routed by an
    outer one. Leaving the block restores normal behaviour, also when the body raises; an
    override object may be entered again and nested in itself.

    ``torch.compile`` traces through the Python level: functions compiled inside it get tgemm
    ops in their graph, and Dynamo's guard on the mode stack recompiles them when called
    outside. The exceptions are ``torch._grouped_mm`` and the scaled products: Dynamo hands a
    mode only the functions of ``torch.overrides.get_overridable_functions()``, which leaves out
    private ones, so compiled code keeps PyTorch's kernels for them.

    The aten level is process-wide: while it is open every thread's GEMMs are routed, and a
    second aten-level override cannot open (the same object may be entered again). Graphs
    compiled with it open hold aten ops, as without it; their GEMMs reach tgemm at run time,
    through the aten calls Inductor makes for them (``out=`` forms, whose result is copied into
    Inductor's buffer), whenever they run with the aten level open, wherever they were compiled.
    GEMMs Inductor writes itself (``max_autotune`` templates) are not aten calls and stay
    Inductor's. Its kernels run below autograd and autocast: aten's derivative formulas record
    the graph (their products are routed too), and operands arrive already cast.

    Args:
        ops: the families to route, a subset of ``("mm", "addmm", "bmm", "grouped", "scaled")``.
        min_size: products with fewer multiply-adds (M * N * K) stay with PyTorch.
        log: log each decision on the ``torch_triton_gemm.override`` logger: routed calls at
            DEBUG, calls left to PyTorch (with the reason) at INFO.
        level: ``"python"`` (a TorchFunctionMode) or ``"aten"`` (dispatcher kernels).
        while_compiling: what an eager call routed to ``tgemm.mm`` does while the kernels it
            needs compile (a fresh process's first calls of each shape): ``"wait"`` for them
            (what a direct tgemm call does), or ``"pytorch"``: run the call as PyTorch would,
            its kernels (and its backward's) compiling in the background, and route it to
            tgemm from the first call after they are built; so a first training step takes
            about the time of plain PyTorch's. Gradients of a routed call run on PyTorch too
            while theirs compile. Calls traced by torch.compile or captured in CUDA graphs
            always wait. Default: ``TORCH_TRITON_GEMM_WHILE_COMPILING``, else ``"wait"``.

    Returns:
        A context manager and decorator. Its ``counts`` dict gives the routed calls per family
        and the calls left to PyTorch under ``"fallback"``; ``ran_while_compiling``, the
        routed calls that ran on PyTorch while their kernels compiled. At the Python level
        calls inside compiled code are decided once when Dynamo traces them and are not
        counted or logged;
        at the aten level every call is counted, compiled or not.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> model = torch.nn.Linear(128, 256, device="cuda", dtype=torch.bfloat16)
        >>> x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        >>> with tg.override() as ov:
        ...     y = model(x)                  # tgemm::mm with the bias in its epilogue
        >>> ov.counts["addmm"]
        1
    """
    selected = (ops,) if isinstance(ops, str) else tuple(ops)
    unknown = [name for name in selected if name not in FAMILIES]
    if unknown:
        raise ValueError(f"override: unknown ops {unknown}; choose from {FAMILIES}")
    if min_size < 0:
        raise ValueError(f"override: min_size must be >= 0, got {min_size}")
    if while_compiling is None:
        while_compiling = env.choice("TORCH_TRITON_GEMM_WHILE_COMPILING",
                                     {mode: mode for mode in WHILE_COMPILING}, "wait")
    if while_compiling not in WHILE_COMPILING:
        raise ValueError(f"override: while_compiling must be one of {WHILE_COMPILING}, got "
                         f"{while_compiling!r}")
    if level == "python":
        return GemmOverride(frozenset(selected), int(min_size), bool(log), while_compiling)
    if level == "aten":
        return AtenGemmOverride(frozenset(selected), int(min_size), bool(log), while_compiling)
    raise ValueError(f"override: level must be 'python' or 'aten', got {level!r}")
