"""A compile worker process: compiles kernel variants into Triton's on-disk cache for its parent.

Run as ``python -m torch_triton_gemm.ops.compile_worker`` by compile_pool.py (a plain
subprocess, not multiprocessing's spawn or forkserver, which would import the user's
``__main__`` again). Triton's front end holds the GIL for much of a compilation, so compile
threads in the calling process slow each other and the calling thread; a worker process
compiles beside it. The parent's launch of the same variant then finds it in Triton's file
cache (``TRITON_CACHE_DIR``, shared through the environment) and only loads it.

Protocol (pickle frames on stdin and stdout): first ``("init", device, target)``, the CUDA
device index and Triton's ``GPUTarget`` of the parent; then ``("compile", module, name, grid,
args, meta)`` per variant, answered by ``("ok", seconds)`` or ``("error", message)``; end of
input ends the worker. Pointer arguments arrive as ``PointerSpec`` (dtype and alignment,
what Triton specialises on). The worker never touches the GPU: Triton's active driver is
replaced by ``OfflineDriver``, which answers the device, stream and target questions a
compilation asks with the parent's answers.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import time
from typing import Any, BinaryIO


class PointerSpec:
    """What Triton's ``warmup`` reads of a pointer argument: its dtype and whether its address
    is 16-byte aligned. Picklable."""

    __slots__ = ("dtype", "aligned")

    def __init__(self, dtype: Any, aligned: bool) -> None:
        self.dtype = dtype
        self.aligned = aligned

    def data_ptr(self) -> int:
        return 0 if self.aligned else self.dtype.itemsize

    def __getstate__(self) -> tuple[Any, bool]:
        return self.dtype, self.aligned

    def __setstate__(self, state: tuple[Any, bool]) -> None:
        self.dtype, self.aligned = state


class OfflineDriver:
    """Triton's active driver in a worker: the parent's device index and target, stream 0;
    nothing that needs a GPU."""

    def __init__(self, device: int, target: Any) -> None:
        self._device = device
        self._target = target

    def get_current_device(self) -> int:
        return self._device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self._target

    def set_current_device(self, device: int) -> None:
        self._device = device


def compile_job(module: str, name: str, grid: tuple[int, ...], args: tuple[Any, ...],
                meta: dict[str, Any]) -> float:
    """Compile one variant of the kernel ``module.name`` (Triton's ``warmup``: compiles and
    caches, launches nothing); the seconds it took."""
    kernel = getattr(importlib.import_module(module), name)
    start = time.perf_counter()
    kernel.warmup(*args, grid=grid, **meta)
    return time.perf_counter() - start


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Answer frames from ``stdin`` on ``stdout`` until the input ends."""
    from triton.runtime.driver import driver

    while True:
        try:
            frame = pickle.load(stdin)
        except EOFError:
            return
        kind, *rest = frame
        if kind == "init":
            device, target = rest
            driver.set_active(OfflineDriver(device, target))
            continue
        try:
            reply = ("ok", compile_job(*rest))
        except Exception as exc:  # noqa: BLE001 -- the parent compiles it itself and reports
            reply = ("error", f"{type(exc).__name__}: {exc}")
        pickle.dump(reply, stdout)
        stdout.flush()


def main() -> None:
    # Frames go out on the real stdout only: anything printed (warnings, imports) goes to stderr.
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr
    serve(stdin, stdout)


if __name__ == "__main__":
    main()
