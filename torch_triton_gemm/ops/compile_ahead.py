"""Compiling ahead: the kernel variants tgemm::mm calls will need, planned now and compiled on
the compile pool (compile_pool.py) before they are launched.

Data flow: ops -> planner -> launcher -> kernels; this module sits beside the ops, beneath them:
it plans products through the planner (``plan_mm``) and works out their launches through the
launcher (``prepare_launch``), exactly as real calls do, on stand-ins for the tensors
(``OperandSpec``: shape, strides, dtype, device, alignment; no memory). A kernel variant is what
Triton compiles once: a kernel with the arguments it specialises on.

Who asks:
- the first eager call of each tgemm::mm signature (ops/mm.py) submits its own kernels (a
  split-K plan launches two or three, which then compile at once) and, when autograd records
  it, the products its backward will run (``backward_specs``), which compile while the forward
  goes on (at the aten level, where aten's derivative formula records the call, at once:
  ``RECORDED_BELOW``);
- ``torch_triton_gemm.warmup`` submits every product of a model or shape list, forward and
  backward, and waits for them.

PyTorch while compiling (``override(while_compiling="pytorch")``): a routed call whose kernels
are not built yet raises ``KernelsCompiling`` out of tgemm::mm's eager path, once its kernels
(and its backward's) are submitted, and the override runs the call on PyTorch instead; the
first call after they are built runs on tgemm. The override marks the calls it routes this way
(``pytorch_until_built``), so direct tgemm calls never fall back.

Background compilation is on for CUDA devices unless TORCH_TRITON_GEMM_BACKGROUND_COMPILE=0.
Under Triton's interpreter (CPU) and on devices tgemm does not compile for, there is nothing to
compile: planning still runs, submission does not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from .. import device as _device
from .. import tuning
from .checks import default_out_dtype
from .compile_pool import (
    POOL,
    CompilePool,
    background_switched_off,
    prepare_kernel,
    variant_key,
)
from .launcher import PreparedLaunch, prepare_launch, splitk_reduce_kernel
from .planner import eager_mm_plan, plan_mm


class OperandSpec:
    """A stand-in for a 2-D tensor as the planner and launcher read it (shape, strides, dtype,
    device, 16-byte alignment of its base), holding no memory; also what Triton's ``warmup``
    reads of a pointer argument (``dtype``, ``data_ptr``)."""

    __slots__ = ("shape", "_strides", "dtype", "device", "aligned")

    def __init__(self, shape: tuple[int, int], strides: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, aligned: bool = True) -> None:
        self.shape = torch.Size(shape)
        self._strides = tuple(strides)
        self.dtype = dtype
        self.device = torch.device(device)
        self.aligned = aligned

    @classmethod
    def of(cls, t: torch.Tensor) -> OperandSpec:
        return cls(tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)

    @classmethod
    def row_major(cls, rows: int, cols: int, dtype: torch.dtype,
                  device: torch.device) -> OperandSpec:
        return cls((rows, cols), (cols, 1), dtype, device)

    def t(self) -> OperandSpec:
        """The transposed view, as ``Tensor.t()``."""
        return OperandSpec(self.shape[::-1], self._strides[::-1], self.dtype, self.device,
                           self.aligned)

    def stride(self, dim: int | None = None) -> Any:
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return self.dtype.itemsize

    def data_ptr(self) -> int:
        return 0 if self.aligned else self.dtype.itemsize

    def storage_offset(self) -> int:
        return 0

    def dim(self) -> int:
        return len(self.shape)

    def transposed(self) -> bool:
        """Column-major (``_is_transposed`` of ops/mm.py): its gradient is made column-major."""
        rows, cols = self.shape
        return self._strides == (1, rows) and rows != 1 and cols != 1

    def __repr__(self) -> str:
        return (f"OperandSpec({tuple(self.shape)}, {self._strides}, {self.dtype}, "
                f"{self.device}{'' if self.aligned else ', unaligned'})")


class GemmSpec(NamedTuple):
    """One tgemm::mm product: activation(a @ b + bias) in ``out_dtype`` (None: a's default)."""
    a: OperandSpec
    b: OperandSpec
    bias: OperandSpec | None = None
    activation: str = "none"
    out_dtype: torch.dtype | None = None

    def out(self) -> OperandSpec:
        """The output as tgemm::mm allocates it: row-major [M, N]."""
        dtype = self.out_dtype or default_out_dtype(self.a.dtype)
        return OperandSpec.row_major(self.a.shape[0], self.b.shape[1], dtype, self.a.device)


class Variant(NamedTuple):
    """One kernel launch as Triton compiles it: kernel, grid, arguments, meta-parameters."""
    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: Any
    device: int  # index (-1: interpreter / CPU)

    def key(self) -> tuple[Any, ...]:
        return variant_key(self.kernel, self.args, self.meta, self.device)


# --- the products a model needs -------------------------------------------------------------------

def backward_specs(spec: GemmSpec, grad_a: bool = True, grad_b: bool = True) -> list[GemmSpec]:
    """The tgemm::mm products of ``spec``'s backward (``_backward`` of ops/mm.py), for the
    gradients asked for: grad_a = grad @ b.T and grad_b = a.T @ grad, each in its input's
    layout, with the fp32 recomputation of a @ b + bias for gelu and silu. The gradient of the
    output is taken row-major, as autograd usually hands it."""
    a, b = spec.a, spec.b
    M, N = a.shape[0], b.shape[1]
    grad = OperandSpec.row_major(M, N, b.dtype, a.device)
    specs = []
    if spec.activation in ("gelu", "silu") and (grad_a or grad_b):
        specs.append(GemmSpec(a, b, spec.bias, "none", torch.float32))
    if grad_a:
        if a.transposed():
            specs.append(GemmSpec(b, grad.t(), out_dtype=a.dtype))
        else:
            specs.append(GemmSpec(grad, b.t(), out_dtype=a.dtype))
    if grad_b:
        if b.transposed():
            specs.append(GemmSpec(grad.t(), a, out_dtype=b.dtype))
        else:
            specs.append(GemmSpec(a.t(), grad, out_dtype=b.dtype))
    return specs


def linear_spec(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str,
                layout: str = "nt", bias: bool = False, activation: str = "none",
                out_dtype: torch.dtype | None = None) -> GemmSpec:
    """The product [M, K] @ [K, N] with operands laid out as ``layout`` says, one letter per
    operand: "n" row-major, "t" column-major (the ``.t()`` of a row-major matrix). "nt" is
    ``nn.Linear``'s x @ W.t()."""
    if len(layout) != 2 or set(layout) - {"n", "t"}:
        raise ValueError(f"layout must be two letters of 'n' and 't', got {layout!r}")
    device = torch.device(device)
    a = OperandSpec.row_major(M, K, dtype, device)
    b = OperandSpec.row_major(K, N, dtype, device)
    if layout[0] == "t":
        a = OperandSpec.row_major(K, M, dtype, device).t()
    if layout[1] == "t":
        b = OperandSpec.row_major(N, K, dtype, device).t()
    bias_spec = OperandSpec((N,), (1,), dtype, device) if bias else None
    return GemmSpec(a, b, bias_spec, activation, out_dtype)


# --- planning: the variants of a product ----------------------------------------------------------

def _device_index(device: torch.device) -> int:
    if device.type != "cuda" or _device.interpreter_enabled():
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def variants(spec: GemmSpec) -> list[Variant]:
    """The kernel launches of one product, planned by the planner and worked out by the
    launcher as a real call's; none for an empty product."""
    a, b, bias, activation = spec.a, spec.b, spec.bias, spec.activation
    out = spec.out()
    if a.shape[0] == 0 or b.shape[1] == 0:
        return []
    # As an eager call plans it (Hopper's warp-specialized kernel included, which traced calls
    # never take), without tuning: tuning times plans on real tensors.
    plan = plan_mm(a, b, bias, out, activation, False, tune=False)  # type: ignore[arg-type]
    prepared = prepare_launch(a, b, bias, out, activation, False, plan, None)  # type: ignore
    eager = eager_mm_plan(a, b, out, prepared.plan)  # type: ignore[arg-type]
    if eager is not None:  # what plain eager calls launch instead (mm_eager_call)
        prepared = prepare_launch(a, b, bias, out, activation, False, eager,  # type: ignore
                                  None)._replace(capture=prepared)
    return prepared_variants(prepared, a, b, bias, out)


def prepared_variants(prepared: PreparedLaunch, a: Any, b: Any, bias: Any, out: Any
                      ) -> list[Variant]:
    """The kernel launches of a prepared launch, with its arguments as ``run_launch`` passes
    them (operands or their stand-ins; padded copies, workspace and flags as stand-ins), and
    those of its ``capture`` launch."""
    found = ([] if prepared.capture is None
             else prepared_variants(prepared.capture, a, b, bias, out))
    device = _device_index(a.device)
    if prepared.pads is not None:
        a, b = (t if pad is None else OperandSpec.row_major(1, 1, t.dtype, t.device)
                for t, pad in zip((a, b), prepared.pads))
    workspace = locks = None
    if prepared.workspace_shape is not None:
        workspace = OperandSpec.row_major(1, 1, torch.float32, a.device)
    if prepared.locks_shape is not None or prepared.counters_shape is not None:
        locks = OperandSpec.row_major(1, 1, torch.int32, a.device)
    found += [Variant(prepared.kernel, grid,
                      (a, b, out, bias, workspace, locks, None, None, *runtime_args), meta,
                      device)
              for grid, meta, runtime_args in prepared.launches]
    if prepared.reduce is not None:
        grid, runtime_args, meta = prepared.reduce
        found.append(Variant(splitk_reduce_kernel, grid, (workspace, out, bias, *runtime_args),
                             meta, device))
    return found


# --- submission -----------------------------------------------------------------------------------

def background_enabled(device: torch.device) -> bool:
    """Whether calls on ``device`` compile ahead: CUDA devices, not the interpreter, unless
    TORCH_TRITON_GEMM_BACKGROUND_COMPILE=0; never while tuning on first use, which plans (and
    compiles) by timing."""
    if background_switched_off():
        return False
    return compiles(device) and not tuning.autotune_enabled()


def compiles(device: torch.device) -> bool:
    """Whether kernels for ``device`` are compiled at all (not under the interpreter)."""
    return device.type == "cuda" and not _device.interpreter_enabled()


def submit(found: Iterable[Variant], pool: CompilePool | None = None) -> list[Future]:
    """Compile ``found`` on ``pool`` (the process's compile pool by default); each variant
    once, however often it is submitted. The futures, in order."""
    pool = POOL if pool is None else pool
    futures = []
    for variant in found:
        if variant.device >= 0:
            prepare_kernel(variant.kernel, variant.device)
        futures.append(pool.submit(variant.key(), *variant[:4], variant.device))
    return futures


# --- PyTorch while compiling ----------------------------------------------------------------------

class KernelsCompiling(Exception):  # noqa: N818 -- a signal to the override, not an error
    """A routed tgemm::mm call whose kernels are still compiling, raised where the caller asked
    for it (``pytorch_until_built``): the override runs the call on PyTorch instead."""


class _UntilBuilt(threading.local):
    # Per thread: whether the tgemm::mm calls made now may raise KernelsCompiling. A class
    # default, not getattr's: a missing attribute costs every eager call ~0.4 us.
    on = False


_UNTIL_BUILT = _UntilBuilt()


class pytorch_until_built:  # noqa: N801 -- used as a context manager, like torch.no_grad
    """While open (``on``), this thread's eager tgemm::mm calls whose kernels are not built yet
    raise KernelsCompiling instead of waiting for them; the previous setting is restored on
    exit."""

    __slots__ = ("on", "_before")

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def __enter__(self) -> None:
        self._before = _UNTIL_BUILT.on
        _UNTIL_BUILT.on = self.on

    def __exit__(self, *exc: object) -> None:
        _UNTIL_BUILT.on = self._before


def pytorch_until_built_on() -> bool:
    """Whether this thread's tgemm::mm calls may raise KernelsCompiling now."""
    return _UNTIL_BUILT.on


def built(prepared: PreparedLaunch, a: torch.Tensor, b: torch.Tensor,
          bias: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether a kept eager launch's kernels are built: launched on this device before, or
    compiled by the pool (a failed compilation counts as built: the launch reports its error).
    Where not, they are submitted to the pool. Devices without background compilation, and
    CUDA graph captures (which must record tgemm's kernels), count as built: the call waits."""
    launched = prepared.compiled[0]  # the first launch's compiled kernel, per device index
    if launched and _device_index(a.device) in launched:
        return True  # every call once its kernels ran here: no further checks
    if not background_enabled(a.device):
        return True
    if a.device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing():
        return True
    return all(future.done() for future in submit(prepared_variants(prepared, a, b, bias, out)))


def compiling_call(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                   activation: str, out: torch.Tensor) -> KernelsCompiling:
    """The signal for a call left to PyTorch while its kernels compile, after submitting the
    kernels of its backward (autograd records PyTorch's call instead, so the products tgemm's
    backward would run are not submitted otherwise; a later step routes them)."""
    if a.requires_grad or b.requires_grad:
        bias_spec = None if bias is None else OperandSpec.of(bias)
        spec = GemmSpec(OperandSpec.of(a), OperandSpec.of(b), bias_spec, activation, out.dtype)
        for backward in backward_specs(spec, a.requires_grad, b.requires_grad):
            submit(variants(backward))
    return KernelsCompiling(
        f"tgemm::mm {tuple(a.shape)} x {tuple(b.shape)}: kernels still compiling")


# --- the hooks of tgemm::mm's eager calls ---------------------------------------------------------

class _Pending(threading.local):
    # The last first call whose backward is not submitted yet, per thread: its operands' ids
    # and its product. Autograd's setup_context (ops/mm.py) submits the backward when it
    # records that call; a call nothing records (no_grad inference) leaves it, and the next
    # first call replaces it. (A class default: setup_context reads it on every call.)
    call: tuple[int, int, GemmSpec] | None = None


PENDING = _Pending()


class _RecordedBelow(threading.local):
    # Set by the aten-level override around a call it routes while grad mode is on: aten's own
    # derivative formula records the call (tgemm's autograd never sees it), so a first call
    # submits its backward's products at once. (A class default: first calls read it.)
    on: bool = False


RECORDED_BELOW = _RecordedBelow()


def first_call(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
               out: torch.Tensor, prepared: PreparedLaunch) -> None:
    """The first eager call of a signature, before it launches: submit its own kernels, and
    keep its product for its backward if its operands may need gradients."""
    submit(prepared_variants(prepared, a, b, bias, out))
    if (a.requires_grad or b.requires_grad) and torch._C._current_graph_task_id() == -1:
        bias_spec = None if bias is None else OperandSpec.of(bias)
        spec = GemmSpec(OperandSpec.of(a), OperandSpec.of(b), bias_spec, activation, out.dtype)
        if RECORDED_BELOW.on:
            # aten's formulas for mm and addmm run the products backward_specs names.
            for backward in backward_specs(spec, a.requires_grad, b.requires_grad):
                submit(variants(backward))
        else:
            PENDING.call = (id(a), id(b), spec)


def recorded(a: torch.Tensor, b: torch.Tensor) -> None:
    """Autograd recorded a call (setup_context): if it is the pending first call, submit the
    products of its backward."""
    pending = getattr(PENDING, "call", None)
    PENDING.call = None
    if pending is None or pending[0] != id(a) or pending[1] != id(b):
        return
    spec = pending[2]
    for backward in backward_specs(spec, a.requires_grad, b.requires_grad):
        submit(variants(backward))

