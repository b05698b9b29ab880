"""Host-built TMA descriptors for the launches that a CUDA graph captures of the kernels that
build their descriptors on the device: the persistent TMA kernel and Hopper's warp-specialized
Gluon kernel (``ws_gemm_kernel``: tgemm::mm's "wgmma" plans, precise fp8 scaled_mm).

``mm_tma_kernel`` builds its TMA descriptors on the device (kernels/tma.py): that works under
tracing, torch.compile and CUDA graphs alike, but each program spends about 0.8 us per
descriptor before its first load (H100, kernel-only, a bare persistent TMA GEMM at 64^3: 4.9 us
with three device-built descriptors, 2.6 us with host-built ones, 2.3 us with plain pointers).
Host-built descriptors cost host time at every launch instead (the launcher encodes them), which
an eager small GEMM cannot spare, but a launch captured into a CUDA graph pays it once, at
capture. So captured launches pass descriptors built here (the kernel's HOST_DESCRIPTORS). The
warp-specialized kernel builds three before its loader's first load, as the TMA kernel does.

That is another compiled variant of the kernel, and no kernel can be loaded while a stream is
capturing (cuModuleLoadData is prohibited there). So a launch's host-descriptor variant is
built only once it is wanted -- a capture launched the device-descriptor variant instead, or
``prepare_capture`` is running -- then compiled in the background (behind kernels that calls
wait for) and loaded by a later eager launch, and captures launch it from then on; until then a
capture launches the device-descriptor variant, which gives the same bits (the descriptors
describe the same tensors; only where they are built differs). Programs that never capture
build nothing. Launches that tracing records (wrap_triton, torch.compile) keep device-built
descriptors: host-built ones passed into a traced op read wrong values. So do tuning's timings
(``off``), which compare plans as eager calls run them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import triton  # noqa: F401  before triton.tools: as Triton's first import, 3.6 fails on it

from ..kernels import wgmma_fp8
from ..kernels.matmul import mm_tma_kernel
from .compile_pool import POOL, background_switched_off, trailing_arguments, variant_key

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4: no host descriptors, captures build them on the device
    TensorDescriptor = None  # type: ignore[assignment,misc]


class _Loaded(NamedTuple):
    """A loaded host-descriptor variant: its compiled kernel and the launcher's arguments after
    the runtime ones (constexprs included, in the kernel's order) but the last, C's descriptor."""
    compiled: Any
    tail: tuple[Any, ...]


LOG = logging.getLogger("torch_triton_gemm")

# Per device-descriptor variant (compile_pool.variant_key of the eager launch): the host
# variant's compile job while it runs, then the loaded variant; None where it cannot be built.
_VARIANTS: dict[tuple[Any, ...], Future | _Loaded | None] = {}
# Variants a capture launched without their host variant: eager launches build it.
_WANTED: set[tuple[Any, ...]] = set()
# Variants whose last prepare() found them not settled (see prepare_capture).
_UNSETTLED: set[tuple[Any, ...]] = set()
# Active prepare_capture calls (every variant launched is wanted) and ``off`` blocks. Counts,
# not thread-local flags: autograd runs a step's backward launches on threads of its own.
_PREPARING = 0
_OFF = 0
# Bumped whenever more variants become wanted: eager launches kept by run_kept skip prepare()
# only while the generation they settled at is current.
GENERATION = 0
# Captured launches that built their descriptors on the device (no host variant loaded, and
# not ``off``): benchmarks note them, since such replays take longer.
DEVICE_BUILT_CAPTURES = 0


def supports(kernel: Any) -> bool:
    """Whether captured launches of ``kernel`` may take host-built descriptors (``describe``)."""
    return kernel is mm_tma_kernel or (
        wgmma_fp8.AVAILABLE and wgmma_fp8.TensorDescriptor is not None
        and kernel is wgmma_fp8.ws_gemm_kernel)


def describe(kernel: Any, args: tuple[Any, ...], meta: Mapping[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments and meta-parameters of a launch of ``kernel`` (``supports``; ``args`` as
    the launcher passes them: a, b, out, bias, workspace, locks, scales, then M, N, K and the
    strides) with A's, B's and C's descriptors built on the host, described as the kernel
    describes them; None where there is nothing to describe (K = 0) or the tensors cannot be
    described, and for the persistent TMA kernel where the operands or C are not 16-bit (fp8
    and fp32 launches keep device-built descriptors until a GPU has run their host-built
    ones). Any kernel but the warp-specialized one is described as the TMA kernel."""
    if wgmma_fp8.AVAILABLE and kernel is wgmma_fp8.ws_gemm_kernel:
        return _describe_warp_specialized(args, meta)
    if TensorDescriptor is None:
        return None
    a, b, out = args[:3]
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm = args[8:16]
    if not (M and N and K) or a.element_size() != 2 or out.element_size() != 2:
        return None
    block_m, block_n, block_k = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    try:
        if meta["A_M_CONTIGUOUS"]:
            a_desc = TensorDescriptor(a, [K, M], [stride_ak, 1], [block_k, block_m])
        else:
            a_desc = TensorDescriptor(a, [M, K], [stride_am, 1], [block_m, block_k])
        if meta["B_K_CONTIGUOUS"]:
            b_desc = TensorDescriptor(b, [N, K], [stride_bn, 1], [block_n, block_k])
        else:
            b_desc = TensorDescriptor(b, [K, N], [stride_bk, 1], [block_k, block_n])
        c_desc = None
        if meta["C_TMA"]:
            c_desc = TensorDescriptor(out, [M, N], [stride_cm, 1],
                                      [block_m, block_n // meta["EPILOGUE_SUBTILE"]])
    except AssertionError:  # (TensorDescriptor's checks: alignment, unit last stride)
        return None
    return (a_desc, b_desc, *args[2:]), {**meta, "HOST_DESCRIPTORS": True, "c_host_desc": c_desc}


def _describe_warp_specialized(args: tuple[Any, ...], meta: Mapping[str, Any]
                               ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``describe`` for ``ws_gemm_kernel`` (its runtime arguments: M, N, K, A's, B's and C's
    row pitches first; B described as its transpose)."""
    a, b, out = args[:3]
    M, N, K, stride_am, stride_bn, stride_cm = args[8:14]
    if not (M and N and K):
        return None
    try:
        a_desc, b_desc, c_desc = wgmma_fp8.host_descriptors(
            a, b, out, M, N, K, stride_am, stride_bn, stride_cm, meta["BLOCK_N"])
    except (AssertionError, KeyError):  # (TensorDescriptor's checks; a dtype it has no name for)
        return None
    return (a_desc, b_desc, *args[2:]), {**meta, "HOST_DESCRIPTORS": True, "c_host_desc": c_desc}


def prepare(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
            meta: Mapping[str, Any], device: int) -> bool:
    """After an eager (not captured) launch of ``kernel``: move its host-descriptor variant
    along if it is wanted -- submit its compilation once the compile pool has nothing else to
    do, load it once compiled. Whether nothing is left to do for now: loaded (captures of this
    launch then use it), never to be, or not wanted."""
    if _OFF or not (_PREPARING or _WANTED):
        return True  # (nothing wanted: no key to work out on an eager launch)
    key = variant_key(kernel, args, meta, device)
    state = _VARIANTS.get(key, False)
    if state is False:
        if not _PREPARING and key not in _WANTED:
            return True
        _WANTED.add(key)  # (wanted until settled, after prepare_capture too)
    settled = _advance(key, state, kernel, grid, args, meta, device)
    if settled:
        _UNSETTLED.discard(key)
    else:
        _UNSETTLED.add(key)
    return settled


def _advance(key: tuple[Any, ...], state: Future | _Loaded | None | bool, kernel: Any,
             grid: tuple[int, ...], args: tuple[Any, ...], meta: Mapping[str, Any],
             device: int) -> bool:
    if isinstance(state, _Loaded) or state is None:
        return True
    if state is False:
        described = describe(kernel, args, meta)
        if described is None or background_switched_off():
            _VARIANTS[key] = None
            return True
        if POOL.unfinished > _compiling():
            return False  # (after the kernels that calls wait for)
        host_args, host_meta = described
        _VARIANTS[key] = POOL.submit(("host descriptors", *key), kernel, grid, host_args,
                                     host_meta, device)
        return False
    if not state.done():
        return False
    described = describe(kernel, args, meta)
    try:
        if state.exception() is not None or described is None:
            raise RuntimeError(state.exception() or "the launch can no longer be described")
        host_args, host_meta = described
        compiled = kernel.warmup(*host_args, grid=grid, **host_meta)  # (from the JIT's cache)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        compiled._init_handles()  # load it now: a capture could not
        if kernel.params[-1].name != "c_host_desc":
            raise RuntimeError("the kernel's last parameter is not c_host_desc")
        # (c_host_desc, last, is this launch's: launch_captured passes it.)
        tail = trailing_arguments(kernel, len(host_args), host_meta)[:-1]
    except Exception as error:  # noqa: BLE001 -- captures keep device-built descriptors
        LOG.warning("torch_triton_gemm: CUDA graph captures of a GEMM keep device-built TMA "
                    "descriptors: its host-descriptor variant failed to build: %s", error)
        _VARIANTS[key] = None
        return True
    _VARIANTS[key] = _Loaded(compiled, tail)
    return True


def _compiling() -> int:
    """Host-descriptor variants being compiled."""
    return sum(isinstance(state, Future) and not state.done() for state in _VARIANTS.values())


def _want(key: tuple[Any, ...]) -> None:
    global GENERATION
    _WANTED.add(key)
    GENERATION += 1


def launch_captured(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                    meta: Mapping[str, Any], device: int, stream: int) -> bool:
    """Launch ``kernel`` with host-built descriptors on ``stream`` (which is capturing) where
    its host-descriptor variant is loaded; whether it did (else the caller launches as usual,
    and the variant is wanted from then on)."""
    global DEVICE_BUILT_CAPTURES
    if _OFF:
        return False
    key = variant_key(kernel, args, meta, device)
    loaded = _VARIANTS.get(key, False)
    described = describe(kernel, args, meta) if isinstance(loaded, _Loaded) else None
    if described is None:
        if loaded is False and key not in _WANTED:
            _want(key)
        DEVICE_BUILT_CAPTURES += 1
        return False
    host_args, host_meta = described
    compiled = loaded.compiled
    grid_0, grid_1, grid_2 = (*grid, 1, 1)[:3]
    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *host_args, *loaded.tail, host_meta["c_host_desc"])
    return True


def prepare_capture(fn: Callable[..., Any], *args: Any, rounds: int = 8, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` eagerly -- a model's step, say -- until every launch it makes
    of a kernel that builds TMA descriptors has its host-descriptor variant loaded (or settled
    without one), waiting for the compile pool between runs (usually three runs: one submits,
    one finds them compiled and loads them, one finds nothing left), at most ``rounds`` runs;
    returns the last run's result. A CUDA graph captured next launches those variants.

    Example:
        >>> out = tg.prepare_capture(model, static_input)
        >>> graph = torch.cuda.CUDAGraph()
        >>> with torch.cuda.graph(graph):
        ...     out = model(static_input)
    """
    global _PREPARING, GENERATION
    _PREPARING += 1
    GENERATION += 1  # (kept eager launches check their variants again)
    try:
        result = None
        for _ in range(rounds):
            _UNSETTLED.clear()
            result = fn(*args, **kwargs)
            if not _UNSETTLED:
                return result
            POOL.drain()
        LOG.warning("torch_triton_gemm.prepare_capture: %d GEMM launches still had their "
                    "host-descriptor variants compiling after %d runs; captures launch the "
                    "device-descriptor variants until an eager run loads them",
                    len(_UNSETTLED), rounds)
        return result
    finally:
        _PREPARING -= 1


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Inside the block, launches neither build nor launch host-descriptor variants (tuning
    times plans as eager calls launch them)."""
    global _OFF
    _OFF += 1
    try:
        yield
    finally:
        _OFF -= 1


def forget() -> None:
    """Forget every host-descriptor variant (tests; a forked child, whose compile jobs are
    gone)."""
    _VARIANTS.clear()
    _WANTED.clear()
    _UNSETTLED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget)
