"""Background compilation of kernel variants: a thread pool, one future per variant.

Beneath the launcher, which waits here before it launches a variant that may be compiling, and
fed by compile_ahead.py (the variants a call or a model will need next, compiled before they
are launched) and the public ``torch_triton_gemm.warmup``. A variant is a kernel with the
arguments it specialises on (``variant_key``); compiling it means Triton's ``warmup``, which
compiles into the same in-memory cache that launches read, launching nothing. Triton's
compilation is CPU-bound: the LLVM and ptxas stages run without the GIL, so threads compile
several variants at once.

Triton's first compilation or cache lookup in a process also fingerprints Triton's own
installation (it hashes its sources and libraries into every kernel's cache key: about 0.35 s
on an H100's host, a third of a warm-cache process's first training step). Importing the
package starts that on a daemon thread (``prime``, CUDA builds of torch only), so the first GEMM
finds it done; a launch or worker that needs it sooner waits for that thread rather than
hashing a second time.

Rules: a variant is compiled once (a call that needs it while it compiles waits for that
compilation rather than starting its own); a call never waits for other variants (one still
queued is taken back, and the call compiles it itself); Triton caches a kernel only once it is
built, so no call runs a half-built kernel. A call that waits more than ``NOTICE_S`` seconds on
compilation says so once per process on the ``torch_triton_gemm`` logger.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import device as _device

LOG = logging.getLogger("torch_triton_gemm")
NOTICE_S = 1.0  # waits on compilation longer than this are reported (once)
_VARIANTS_LIMIT = 8192  # futures kept; past it, finished ones are forgotten


def _spec(arg: Any) -> Hashable:
    """What Triton specialises a kernel on of one argument: a tensor's dtype and 16-byte
    alignment, an int's being 1, a multiple of 16 and its width, other values as they are."""
    if hasattr(arg, "data_ptr"):
        return ("*", arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None or not isinstance(arg, int):
        return arg
    return ("i", arg == 1, arg % 16 == 0, -(1 << 31) <= arg < (1 << 31))


def variant_key(kernel: Any, args: tuple[Any, ...], meta: Mapping[str, Any],
                device: int) -> tuple[Any, ...]:
    """The key of a kernel variant: the kernel, the device index and what Triton specialises on
    (``args`` in the kernel's order, tensors or stand-ins with ``dtype`` and ``data_ptr``).
    Two launches with one key run one compiled kernel."""
    return (kernel, device, tuple(_spec(arg) for arg in args), tuple(sorted(meta.items())))


class CompilePool:
    """Variants compiling on worker threads, one future per variant key.

    ``compile`` builds one variant (called on a worker thread with the submitted job's
    arguments); tests pass a fake one.
    """

    def __init__(self, compile: Callable[..., Any], workers: int | None = None) -> None:
        self._compile = compile
        self._workers = workers
        self._lock = threading.RLock()  # (a done callback may run inside submit)
        self._futures: dict[Hashable, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._noticed = False
        self._unfinished = 0
        # Whether some variant is queued or compiling (or the primer runs): launches look here
        # first, and find nothing to wait for (no key to work out) once the pool is idle.
        self.busy = False
        self._primer: threading.Thread | None = None

    def workers(self) -> int:
        """The worker threads: TORCH_TRITON_GEMM_COMPILE_THREADS, else half the CPU cores (the
        calling threads compile too), at least one and at most 8."""
        if self._workers is not None:
            return self._workers
        env = os.environ.get("TORCH_TRITON_GEMM_COMPILE_THREADS")
        if env:
            return max(1, int(env))
        return max(1, min(8, (os.cpu_count() or 2) // 2))

    def prime(self, job: Callable[[], Any]) -> None:
        """Run ``job``, a one-time cost that compilations wait for, on a daemon thread now
        (once per pool); ``wait`` and the workers wait for it before they go on. Its failure is
        left to the compilation that runs into it again."""
        with self._lock:
            if self._primer is not None:
                return
            self._primer = threading.Thread(target=self._run_primer, args=(job,), daemon=True,
                                            name="tgemm-prime")
            self._unfinished += 1
            self.busy = True
        self._primer.start()

    def _run_primer(self, job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception:  # noqa: BLE001 -- the next compilation meets it and reports it
            pass
        finally:
            self._finished(None)

    def _await_primer(self) -> None:
        primer = self._primer
        if primer is not None and primer.is_alive() and primer is not threading.current_thread():
            primer.join()

    def _after_fork_in_child(self) -> None:
        # A fork's child has no threads but the forking one: the primer and the compilations
        # still running in the parent run nowhere here, so nothing may wait for them (a variant
        # is compiled again on demand; the fingerprint by Triton when it needs it).
        if self._primer is not None and not self._primer.is_alive():
            self._primer = None
        self._futures = {k: f for k, f in self._futures.items() if f.done()}
        self._executor = None
        self._lock = threading.RLock()
        self._unfinished, self.busy = 0, False

    def _run(self, *job: Any) -> Any:
        self._await_primer()
        return self._compile(*job)

    def submit(self, key: Hashable, *job: Any) -> Future:
        """Compile the variant ``key`` with ``compile(*job)`` on a worker, unless it was
        submitted before; its future either way."""
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                return future
            if len(self._futures) >= _VARIANTS_LIMIT:
                self._futures = {k: f for k, f in self._futures.items() if not f.done()}
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers(),
                                                    thread_name_prefix="tgemm-compile")
            future = self._executor.submit(self._run, *job)
            self._futures[key] = future
            self._unfinished += 1
            self.busy = True
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future | None) -> None:
        with self._lock:
            # (Never below zero: a job forgotten after a fork, see _after_fork_in_child.)
            self._unfinished = max(0, self._unfinished - 1)
            self.busy = self._unfinished > 0

    def future(self, key: Hashable) -> Future | None:
        return self._futures.get(key)

    def wait(self, key: Hashable, what: str = "a GEMM kernel") -> float:
        """Before launching the variant ``key``: wait for its compilation if it is running;
        take it back if it is still queued (the caller then compiles it, never waiting for
        other variants). Returns the seconds waited; a failed compilation is left to the
        caller's own, which raises its error."""
        self._await_primer()
        future = self._futures.get(key)
        if future is None or future.done():
            return 0.0
        if future.cancel():
            with self._lock:
                if self._futures.get(key) is future:
                    del self._futures[key]
            return 0.0
        start = time.perf_counter()
        try:
            future.result()
        except Exception:  # noqa: BLE001 -- the caller's compilation reports it
            pass
        waited = time.perf_counter() - start
        self.notice(waited, what)
        return waited

    def notice(self, seconds: float, what: str) -> None:
        """Report, once per process, a call that waited ``seconds`` on compilation."""
        if seconds <= NOTICE_S or self._noticed:
            return
        self._noticed = True
        LOG.warning(
            "torch_triton_gemm: a call waited %.1f s for %s to compile (first use of this shape "
            "and layout in this process; later calls do not wait). Compile ahead with "
            "torch_triton_gemm.warmup(model, tokens=...) or python -m torch_triton_gemm.warmup; "
            "Triton's on-disk cache (TRITON_CACHE_DIR) makes later processes faster. "
            "Reported once.", seconds, what)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the primer and every submitted variant (failures are left to the
        launches)."""
        self._await_primer()
        for future in list(self._futures.values()):
            try:
                future.result(timeout)
            except Exception:  # noqa: BLE001
                pass

    def reset(self) -> None:
        """Forget every variant, report waits again and stop the workers (tests)."""
        self.drain()
        with self._lock:
            self._futures.clear()
            self._noticed = False
            if self._executor is not None:
                self._executor.shutdown()  # its threads end after the done callbacks
                self._executor = None
            self._unfinished, self.busy = 0, False


def compile_variant(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                    meta: Mapping[str, Any], device: int) -> None:
    """Compile one variant into Triton's cache without launching it, on ``device`` (a worker
    thread's current device is the first GPU otherwise)."""
    with torch.cuda.device(device):
        kernel.warmup(*args, grid=grid, **meta)


def prepare_kernel(kernel: Any, device: int) -> None:
    """Create Triton's per-device state of ``kernel`` on the calling thread, before workers
    compile into it: Triton creates it on first use, unguarded, and two threads creating it at
    once would each keep their own cache."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None and device not in caches:
        with torch.cuda.device(device):
            caches[device]  # noqa: B018 -- a defaultdict: reading it creates the entry


def triton_fingerprint() -> Any:
    """Triton's fingerprint of its installation (``triton_key``, cached per process), computed
    now; None where this Triton has none to compute ahead."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        key = getattr(importlib.import_module(module), "triton_key", None)
        if key is not None:
            return key()
    return None


def background_switched_off() -> bool:
    """Whether TORCH_TRITON_GEMM_BACKGROUND_COMPILE=0 turns background compilation (and the
    fingerprint ahead) off."""
    return os.environ.get("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "1") == "0"


def priming_enabled() -> bool:
    """Whether importing the package fingerprints Triton ahead: CUDA (or ROCm) builds of torch
    (asked without initialising CUDA), not the interpreter, unless
    TORCH_TRITON_GEMM_BACKGROUND_COMPILE=0."""
    if background_switched_off():
        return False
    if _device.interpreter_enabled():
        return False
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


POOL = CompilePool(compile_variant)
os.register_at_fork(after_in_child=POOL._after_fork_in_child)
if priming_enabled():
    POOL.prime(triton_fingerprint)
