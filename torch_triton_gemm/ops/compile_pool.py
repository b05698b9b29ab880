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
hashing a second time. Each variant compiled here also gets its C launcher built here (Triton
3.6 builds one per kernel signature with the host's C compiler when the kernel is first loaded:
0.27 s each on an H100's host with an empty cache), so that it does not land on the thread that
launches.

With TORCH_TRITON_GEMM_COMPILE_PROCESSES=N (N > 0; 0, the default, keeps to threads) each of
N threads drives a worker process of its own (compile_worker.py), started on first use: the
process compiles the variant into Triton's on-disk cache beside this one, without its GIL, and
the thread then loads it from that cache into the in-memory one. A variant the worker cannot
compile (or a worker that fails) is compiled on the thread as without workers.

Rules: a variant is compiled once (a call that needs it while it compiles waits for that
compilation rather than starting its own); a call never waits for other variants (one still
queued is taken back, and the call compiles it itself); Triton caches a kernel only once it is
built, so no call runs a half-built kernel. A call that waits more than ``NOTICE_S`` seconds on
compilation says so once per process on the ``torch_triton_gemm`` logger.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import logging
import os
import pathlib
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import device as _device
from .. import env
from .compile_worker import PointerSpec

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
        """The worker threads: TORCH_TRITON_GEMM_COMPILE_THREADS, else one per worker process
        (``compile_processes``), else half the CPU cores (the calling threads compile too), at
        least one and at most 8."""
        if self._workers is not None:
            return self._workers
        threads = env.integer("TORCH_TRITON_GEMM_COMPILE_THREADS", 0, least=0)  # 0: this rule
        return threads or compile_processes() or max(1, min(8, (os.cpu_count() or 2) // 2))

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
                _before_exit_joins(self._executor)
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

    @property
    def unfinished(self) -> int:
        """Jobs submitted and not finished."""
        return self._unfinished

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


def _before_exit_joins(executor: ThreadPoolExecutor) -> None:
    """At interpreter exit, drop ``executor``'s queued variants before its threads are joined:
    no launch will need them, and the exit then waits only for the compilations already running
    (one per thread), not for every queued one (12 queued half-second compilations on one
    thread held a finished script 6 s). Python joins the pool's threads after its threading
    exit hooks, which run latest-registered first, so this one runs before
    concurrent.futures' own."""
    register = getattr(threading, "_register_atexit", None)  # (private; absent: as before)
    if register is None:
        return
    try:
        register(functools.partial(executor.shutdown, wait=False, cancel_futures=True))
    except RuntimeError:  # the interpreter is already exiting
        pass


def trailing_arguments(kernel: Any, count: int, meta: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a compiled kernel's launcher takes after a launch's first ``count`` arguments: the
    remaining parameters (it takes every one, constexprs included, in signature order), from
    ``meta``, else their defaults."""
    return tuple(meta[param.name] if param.name in meta else param.default
                 for param in kernel.params[count:])


def compile_variant(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                    meta: Mapping[str, Any], device: int) -> None:
    """Compile one variant into Triton's cache without launching it, on ``device`` (a worker
    thread's current device is the first GPU otherwise): in this thread's worker process first
    when there are worker processes (then Triton's warmup here loads it from the file cache)."""
    with torch.cuda.device(device):
        if compile_processes():
            compile_in_worker(kernel, grid, args, meta, device)
        build_launcher(kernel.warmup(*args, grid=grid, **meta))


def build_launcher(compiled: Any) -> None:
    """Build the C launcher of ``compiled`` (what Triton's ``warmup`` returned) into Triton's
    cache now, on the calling (worker) thread: Triton 3.6 builds it with the host's C compiler
    when the kernel is first loaded, on the launching thread (0.27 s per kernel signature on an
    H100's host), and then finds it built. Building one touches no GPU. Nothing where the
    kernel is loaded already, where ``compiled`` is no compiled kernel (a future, say), or where
    this Triton's driver has no launcher class; a failure is left to the launch, which builds
    it again and reports it."""
    if getattr(compiled, "module", 0) is not None or not hasattr(compiled, "metadata"):
        return
    try:
        launcher = _launcher_class()
        if launcher is not None:
            launcher(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 -- the launch builds it again and reports the error
        pass


def _launcher_class() -> Any:
    from triton.runtime.driver import driver

    return getattr(driver.active, "launcher_cls", None)


# --- worker processes -------------------------------------------------------------------------

def compile_processes() -> int:
    """TORCH_TRITON_GEMM_COMPILE_PROCESSES: worker processes compiling variants (0, the default:
    none)."""
    return env.integer("TORCH_TRITON_GEMM_COMPILE_PROCESSES", 0, least=0)


class WorkerProcess:
    """One compile worker process (compile_worker.py) for one CUDA device, driven by one thread.

    Started with this package importable (its root first on PYTHONPATH) and with worker
    processes of its own switched off; its output other than the protocol's is discarded (the
    calling thread's own compilation reports what fails)."""

    def __init__(self, device: int, target: Any) -> None:
        root = str(pathlib.Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, TORCH_TRITON_GEMM_COMPILE_PROCESSES="0")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch_triton_gemm.ops.compile_worker"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.answered = False
        self._send(("init", device, target))

    def _send(self, frame: tuple[Any, ...]) -> None:
        pickle.dump(frame, self.process.stdin)
        self.process.stdin.flush()

    def compile(self, module: str, name: str, grid: tuple[int, ...], args: tuple[Any, ...],
                meta: dict[str, Any]) -> bool:
        """Compile a variant of ``module.name``; whether the worker did. Raises EOFError where
        the worker ended or gave no answer within WORKER_TIMEOUT_S (it is killed then)."""
        self._send(("compile", module, name, grid, args, meta))
        ready, _, _ = select.select([self.process.stdout], [], [], WORKER_TIMEOUT_S)
        if not ready:
            self.process.kill()
            raise EOFError("the compile worker did not answer")
        reply = pickle.load(self.process.stdout)
        self.answered = True
        return reply[0] == "ok"

    def close(self) -> None:
        """End the worker (it exits at the end of its input)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass


# A worker that has not answered in this long is taken to hang (a compilation takes seconds).
WORKER_TIMEOUT_S = 600.0
_THREAD_WORKERS = threading.local()  # device index -> this thread's WorkerProcess
_ALL_WORKERS: list[WorkerProcess] = []
_ALL_WORKERS_LOCK = threading.Lock()
# Set when a worker ends before its first answer (it cannot start here): no more are started.
_WORKERS_FAIL_TO_START = threading.Event()


def kernel_reference(kernel: Any) -> tuple[str, str] | None:
    """(module, name) under which a worker process imports ``kernel``, or None where the kernel
    is not a module-level Triton kernel of an imported module."""
    fn = getattr(kernel, "fn", None)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if module is None or name is None:
        return None
    if getattr(sys.modules.get(module), name, None) is not kernel:
        return None
    return module, name


def worker_arguments(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``args`` as a worker receives them: pointer arguments (tensors and stand-ins) as
    ``PointerSpec``, plain values as they are; None where one is neither."""
    out = []
    for arg in args:
        if hasattr(arg, "data_ptr") and hasattr(arg, "dtype"):
            out.append(PointerSpec(arg.dtype, arg.data_ptr() % 16 == 0))
        elif arg is None or isinstance(arg, (bool, int, float, str)):
            out.append(arg)
        else:
            return None
    return tuple(out)


def compile_in_worker(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                      meta: Mapping[str, Any], device: int) -> bool:
    """Compile a variant in this thread's worker process for ``device`` (started on first use)
    into Triton's file cache; whether it did. A worker that fails is ended and replaced on the
    thread's next variant."""
    reference, sent = kernel_reference(kernel), worker_arguments(args)
    if reference is None or sent is None or _WORKERS_FAIL_TO_START.is_set():
        return False
    workers = _THREAD_WORKERS.__dict__
    worker = workers.get(device)
    try:
        if worker is None:
            from triton.runtime.driver import driver

            worker = WorkerProcess(device, driver.active.get_current_target())
            with _ALL_WORKERS_LOCK:
                _ALL_WORKERS.append(worker)
            workers[device] = worker
        return worker.compile(*reference, tuple(grid), sent, dict(meta))
    except Exception:  # noqa: BLE001 -- the thread compiles the variant itself
        if worker is None or not worker.answered:
            _WORKERS_FAIL_TO_START.set()
        if worker is not None:
            worker.close()
        workers.pop(device, None)
        return False


@atexit.register
def _close_workers() -> None:
    with _ALL_WORKERS_LOCK:
        for worker in _ALL_WORKERS:
            worker.close()
        _ALL_WORKERS.clear()


def _forget_workers_after_fork() -> None:
    # A fork's child does not use its parent's worker processes (they answer the parent's
    # threads), nor a lock a parent thread may have held at the fork.
    global _ALL_WORKERS_LOCK
    _ALL_WORKERS_LOCK = threading.Lock()
    _ALL_WORKERS.clear()
    _THREAD_WORKERS.__dict__.clear()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


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
    return not env.flag("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", True)


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
