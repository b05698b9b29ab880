"""How a tgemm op is registered with torch.library, and how its eager calls stay cheap.

An op defined here is a ``torch.library.triton_op`` (a plain ``custom_op`` under Triton's CPU
interpreter). That serves tracing: FakeTensor, make_fx, torch.compile and torch.export see the
op, and AOT tracing sees the kernels inside it. Eager calls of such an op are slow, though:
the dispatcher runs PyTorch's generic Python autograd kernel (which redispatches through C++
to a second Python kernel), then the backend kernel's wrappers (a TorchDynamo guard, a context
manager, an aliasing check) before the body runs -- 20-60 microseconds of host time, more than
a small GEMM takes on the GPU.

``define_triton_op(..., eager_impl=...)`` adds lighter kernels on top, registered to the
dispatch keys that only real CPU/CUDA tensors reach:

- ``AutogradCPU`` / ``AutogradCUDA``: when the dispatch key set is exactly {backend, autograd of
  that backend} -- no tensor subclass, FakeTensor, functionalization, torch_dispatch mode or
  functorch layer -- the call is plain eager. Without gradients it calls ``eager_impl``
  directly; with gradients it applies a ``torch.autograd.Function`` built from the op's own
  ``register_autograd`` formulas. Every other key set goes to PyTorch's generic autograd kernel,
  so tracing behaves exactly as for any ``triton_op``.
- ``CPU`` / ``CUDA``: calls that skip autograd (inference mode, or redispatches from a
  torch_dispatch mode running the op) call ``eager_impl`` directly.

These kernels run with TorchDynamo turned off for them and everything they call, as
``custom_op`` does for its kernels, but marked once on their code objects instead of wrapped per
call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._library.autograd import make_autograd_impl
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .. import device as _device

_DEVICE_KEYS = ("CPU", "CUDA")
# The Library holding each op's eager kernels, by qualified name; a redefinition (a module
# reload) releases the previous kernels before the op is defined again.
_EAGER_LIBRARIES: dict[str, torch.library.Library] = {}
_EAGER_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def define_triton_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any], *,
                     eager_impl: Callable[..., Any] | None = None) -> CustomOpDef:
    """Register ``impl`` (checks, allocation, ``wrap_triton`` launches) as the op ``name``.

    With compiled Triton this is a ``torch.library.triton_op``: its body is make_fx-traceable, so
    it serves as its own fake implementation and torch.compile sees the kernels inside it.
    Under Triton's CPU interpreter the kernels are plain Python that ``wrap_triton`` cannot trace,
    so the op is an opaque ``custom_op`` whose fake is ``fake`` (the same checks and allocation,
    no launch).

    ``eager_impl``, when given, serves eager calls on real CPU/CUDA tensors (see the module
    docstring): it takes the arguments of ``impl`` with the same defaults (then optionally more,
    with defaults, that the op's calls never pass), launches the kernels
    directly (no ``wrap_triton``) and returns new tensors that alias no input. Gradients of such
    calls use the formulas given to the op's ``register_autograd``, read at call time, so it may
    be called after this function.
    """
    previous = _EAGER_LIBRARIES.pop(name, None)
    if previous is not None:
        previous._destroy()
        _EAGER_FUNCTIONS.pop(name, None)
    if _device.interpreter_enabled():
        op = torch.library.custom_op(name, impl, mutates_args=())
        op.register_fake(fake)
    else:
        op = torch.library.triton_op(name, _fake_when_metadata_only(impl, fake), mutates_args=())
    if eager_impl is not None:
        _check_same_parameters(name, impl, eager_impl)
        _EAGER_LIBRARIES[name], _EAGER_FUNCTIONS[name] = _register_eager_kernels(op, eager_impl)
    return op


def _fake_when_metadata_only(impl: Callable[..., Any],
                             fake: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` as the triton_op body, which also serves as its fake implementation: calls on
    FakeTensors with no graph being traced (DTensor's sharding propagation, TorchDynamo's example
    values) only want the output's metadata and get ``fake``'s, without planning a launch that
    nothing would run; their FakeTensors need not even be on a device the kernels run on (torch
    2.11's DTensor builds CPU FakeTensors for the metadata of CUDA shards). Traced calls (make_fx,
    AOT, export) run ``impl``, which plans and checks as real calls do."""

    def body(*args: Any, **kwargs: Any) -> Any:
        if isinstance(args[0], FakeTensor) and get_proxy_mode() is None:
            return fake(*args, **kwargs)
        return impl(*args, **kwargs)

    # The op's schema is read from the signature (annotations resolved: the op modules
    # postpone their evaluation).
    body.__signature__ = inspect.signature(impl, eval_str=True)  # type: ignore[attr-defined]
    body.__name__ = impl.__name__
    return body


def eager_autograd_apply(op: CustomOpDef) -> Callable[..., Any]:
    """``apply`` of the autograd.Function that the eager kernels of ``op`` use for calls that
    need gradients: it takes every positional argument of the op (defaults included).

    It is ``Function.apply`` without its Python wrapper (about 2 microseconds a call), which
    only matters under functorch transforms: callers use it for plain eager calls only
    (``launcher.plain_eager``), as the op's own autograd kernel does."""
    return super(torch.autograd.Function, _EAGER_FUNCTIONS[op._qualname]).apply


def explain_bad_arguments(op: CustomOpDef, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None) -> None:
    """Raise a clear error where the arguments of a call of ``op`` that failed do not fit the
    tensor arguments of its schema: TypeError for a value that is not a tensor (None where the
    argument is not optional), RuntimeError for a tensor that is not dense (strided). Returns
    where they fit, for the caller to re-raise its own error.

    Called only after a failure: eager paths read sizes, strides and data pointers before the
    op's checks (their memo key), and the dispatcher lets None through for a ``Tensor``, so a
    mistaken argument would otherwise surface as an AttributeError from inside the package.
    """
    kwargs = kwargs or {}
    for i, argument in enumerate(op._opoverload._schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        kind, optional = argument.type, False
        if isinstance(kind, torch._C.OptionalType):
            kind, optional = kind.getElementType(), True
        if not isinstance(kind, torch._C.TensorType) or (value is None and optional):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op._qualname}: {argument.name} must be a tensor, got "
                            f"{type(value).__name__}")
        if value.layout != torch.strided:
            raise RuntimeError(f"{op._qualname}: {argument.name} must be a dense (strided) "
                               f"tensor, got {value.layout}")


def _check_same_parameters(name: str, impl: Callable[..., Any],
                           eager_impl: Callable[..., Any]) -> None:
    def parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    # More parameters after impl's, each with a default, serve other callers of eager_impl
    # (the dispatcher never passes them).
    expected, given = parameters(impl), parameters(eager_impl)
    if given[:len(expected)] != expected or any(
            default is inspect.Parameter.empty for _, _, default in given[len(expected):]):
        raise TypeError(f"{name}: eager_impl must take the parameters of impl, with the same "
                        f"defaults, first: {inspect.signature(impl)} vs "
                        f"{inspect.signature(eager_impl)}")


def _register_eager_kernels(op: CustomOpDef, eager_impl: Callable[..., Any]
                            ) -> tuple[torch.library.Library, type[torch.autograd.Function]]:
    overload = op._opoverload
    arguments = overload._schema.arguments
    # The dispatcher drops trailing arguments equal to their defaults; setup_context expects them.
    defaults = tuple(a.default_value for a in arguments)
    # Keyword-only arguments reach kernels as kwargs, which autograd.Function.apply cannot take:
    # such calls use PyTorch's generic autograd kernel when they need gradients.
    apply_grad = not any(a.kwarg_only for a in arguments)
    generic_autograd = make_autograd_impl(overload, op)
    plain_key_sets = frozenset(
        torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        .add(getattr(torch._C.DispatchKey, "Autograd" + key)).raw_repr()
        for key in _DEVICE_KEYS)
    function = _eager_function(op, eager_impl)
    # autograd.Function.apply without its Python wrapper, which only matters for functorch
    # transforms (their key sets never take this path).
    apply = super(torch.autograd.Function, function).apply
    any_requires_grad = torch._C._any_requires_grad
    is_grad_enabled = torch._C.is_grad_enabled

    def autograd_kernel(keyset, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            if keyset.raw_repr() in plain_key_sets:
                if not (is_grad_enabled() and any_requires_grad(*args)):
                    return eager_impl(*args, **kwargs)
                if apply_grad:
                    return apply(*args, *defaults[len(args):])
            return generic_autograd(keyset, *args, **kwargs)
        except (AttributeError, TypeError, RuntimeError):
            explain_bad_arguments(op, args, kwargs)
            raise

    def backend_kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return eager_impl(*args, **kwargs)
        except (AttributeError, TypeError, RuntimeError):
            explain_bad_arguments(op, args, kwargs)
            raise

    library = torch.library.Library(op._namespace, "IMPL")
    for key in _DEVICE_KEYS:
        library.impl(op._name, _without_dynamo(backend_kernel), key)
        library.impl(op._name, _without_dynamo(autograd_kernel), "Autograd" + key,
                     with_keyset=True)
    return library, function


def _eager_function(op: CustomOpDef, eager_impl: Callable[..., Any]
                    ) -> type[torch.autograd.Function]:
    """An autograd.Function running ``eager_impl`` with the op's registered formulas.

    forward takes ``ctx`` itself (no separate setup_context): ``Function.apply`` then skips
    binding the arguments through ``inspect.signature``, which costs more host time than a small
    GEMM's launch.
    """

    def forward(ctx, *args):  # type: ignore[no-untyped-def]
        out = eager_impl(*args)
        if op._setup_context_fn is not None:
            op._setup_context_fn(ctx=ctx, inputs=args, output=out)
        return out

    def backward(ctx, *grads):  # type: ignore[no-untyped-def]
        if op._backward_fn is None:
            raise RuntimeError(f"Trying to backward through {op._qualname} but no autograd "
                               "formula was registered; use register_autograd to add one.")
        return op._backward_fn(ctx, *grads)

    name = "Eager_" + op._qualname.replace("::", "_")
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(_without_dynamo(forward)),
                 "backward": staticmethod(backward)})


def _without_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` and everything it calls without TorchDynamo, like ``torch.compiler.disable``.

    A Python kernel is called by the dispatcher, not by the code that called the op; without
    this, a frame that TorchDynamo runs eagerly (a skipped frame) would have TorchDynamo trace
    the kernel. Marking the code object costs nothing per call; a ``disable`` wrapper (the
    fallback where PyTorch lacks the marking) costs about a microsecond per call.
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return torch._disable_dynamo(fn)
    set_code_exec_strategy(fn.__code__,
                           _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return fn
