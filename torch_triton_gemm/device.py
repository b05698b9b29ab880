"""The one place that knows the hardware: interpreter mode, SM count, capability, shared memory.

Everything here is cached per device; nothing else in the package queries the GPU.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from typing import Any

import torch


@functools.cache
def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is decorated, so it is fixed for the process once the
    package is imported; it is read once here too.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_device_error(device: torch.device) -> str | None:
    """Why tgemm kernels cannot run on ``device`` in this process, or None when they can."""
    if device.type == "cuda":
        if interpreter_enabled():
            return (
                "CUDA tensors cannot be used while TRITON_INTERPRET=1 (Triton's CPU interpreter); "
                "unset it to run on the GPU"
            )
        return None
    if device.type == "cpu":
        if interpreter_enabled():
            return None
        return (
            "CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "importing torch_triton_gemm (slow; meant for small sizes), or move the tensors to a "
            "CUDA GPU"
        )
    return f"device type '{device.type}' is not supported (use CUDA tensors)"


@functools.cache
def _properties(index: int) -> torch.cuda._CudaDeviceProperties:
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# SMs assumed when no GPU can be asked (tracing CUDA FakeTensors on a CPU-only host): an H100's.
_PORTABLE_NUM_SMS = 132


def num_sms(device: torch.device) -> int:
    """Number of streaming multiprocessors (132 on an H100 SXM)."""
    if not torch.cuda.is_available():
        return _PORTABLE_NUM_SMS
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability, e.g. (9, 0) for Hopper."""
    props = _properties(_index(device))
    return props.major, props.minor


# DRAM bandwidth assumed when no GPU can be asked: an H100 SXM's (HBM3, 5120 bits at 2619 MHz).
_PORTABLE_DRAM_GBPS = 3352.32


def _driver_properties(index: int) -> dict[str, Any]:
    import triton

    return triton.runtime.driver.active.utils.get_device_properties(index)


@functools.cache
def _dram_gbps(index: int) -> float:
    try:
        props = _driver_properties(index)
        # Double data rate: two transfers per memory clock (kHz) across the bus (bits).
        gbps = 2 * props["mem_clock_rate"] * props["mem_bus_width"] / 8 / 1e6
    except Exception:  # a driver that does not say: the H100's
        return _PORTABLE_DRAM_GBPS
    return float(gbps) if gbps > 0 else _PORTABLE_DRAM_GBPS


def dram_gbps(device: torch.device) -> float:
    """Peak DRAM bandwidth in GB/s from the memory clock and bus width (3352 on an H100 SXM,
    4814 on an H200), the H100's where no GPU can be asked."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return _PORTABLE_DRAM_GBPS
    return _dram_gbps(_index(device))


# L2 cache assumed when no GPU can be asked: an H100's.
_PORTABLE_L2_BYTES = 50 * 2**20


def l2_cache_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (50 MiB on an H100, 60 MiB on an H200), the H100's where no
    GPU can be asked or the driver does not say."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return _PORTABLE_L2_BYTES
    return int(getattr(_properties(_index(device)), "L2_cache_size", 0) or _PORTABLE_L2_BYTES)


# Shared memory assumed when no GPU can be asked (tracing CUDA FakeTensors on a CPU-only host):
# the smallest opt-in limit among sm_80+ GPUs (sm_86/sm_89), so traced configs launch anywhere.
_PORTABLE_SHARED_MEMORY = 101376


@functools.cache
def shared_memory_per_block(index: int) -> int:
    """Largest shared-memory allocation one program may use, in bytes (opt-in limit)."""
    if not torch.cuda.is_available():
        return _PORTABLE_SHARED_MEMORY
    props = _properties(index)
    opt_in = getattr(props, "shared_memory_per_block_optin", 0)
    return int(opt_in or props.shared_memory_per_block)


@functools.cache
def _name(index: int) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return _properties(index).name


def name(device: torch.device) -> str:
    """The GPU model's name ("NVIDIA H100 80GB HBM3"), or "cpu" without one; keys tuned plans."""
    if device.type != "cuda":
        return "cpu"
    return _name(_index(device))


@functools.cache
def supports_tma(device: torch.device) -> bool:
    """Whether compiled kernels on ``device`` can use TMA descriptors (Hopper, sm_90, or newer)."""
    if device.type != "cuda" or interpreter_enabled() or not torch.cuda.is_available():
        return False
    return capability(device) >= (9, 0)


def _allocate_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side TMA descriptors live in a small global-memory scratch buffer that Triton asks
    # its allocator for at each launch. tgemm's own eager launches (inside ``SHARED_SCRATCH``)
    # take the shared buffer of ``shared_scratch``; other launches -- kernels of other libraries
    # that use this allocator, graphs compiled by Inductor -- get a buffer of their own.
    if not getattr(_SHARING, "on", False):
        return torch.empty(size, device="cuda", dtype=torch.int8)
    return shared_scratch(size, stream)


def shared_scratch(size: int, stream: int | None) -> torch.Tensor:
    """A scratch buffer of at least ``size`` bytes for one of tgemm's own eager launches on the
    current device and ``stream``: one buffer per device and stream, grown on demand. Kernels
    on one stream run one after another (those tgemm launches with programmatic dependent
    launch wait for the one before before building descriptors: kernels/matmul.py), so a
    launch may take the buffer of the previous one, which saves an allocation per launch (host
    time of small eager GEMMs). A launch captured into a CUDA graph (which may replay on any
    stream, alongside eager launches) gets a buffer of its own, from the graph's pool; the
    caller keeps it alive until the launch is queued."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(size, device="cuda", dtype=torch.int8)
    key = (torch._C._cuda_getDevice(), stream)
    buffer = _SCRATCH_BUFFERS.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, device=torch.device("cuda", key[0]), dtype=torch.int8)
        _SCRATCH_BUFFERS[key] = buffer
    return buffer


# The scratch buffer of each (device index, stream) that tgemm's eager launches have used.
_SCRATCH_BUFFERS: dict[tuple[int, int | None], torch.Tensor] = {}
_SHARING = threading.local()


class _SharedScratch:
    """``with SHARED_SCRATCH:`` -- this thread's launches in the block take the shared
    per-stream scratch buffer (see ``_allocate_scratch``); for tgemm's own eager launches."""

    def __enter__(self) -> None:
        _SHARING.on = True

    def __exit__(self, *exc: object) -> None:
        _SHARING.on = False


SHARED_SCRATCH = _SharedScratch()


_TMA_ALLOCATOR = threading.local()


def install_tma_allocator() -> None:
    """Give Triton the allocator that device-side TMA descriptors need, in every thread.

    Triton keeps its allocator in a ContextVar, which is per thread, and autograd runs backward
    kernels (compiled graphs' too) on threads of its own. Where Triton's allocator variable is a
    ContextVar it is replaced, once, by one whose *default* is this allocator, so threads that
    never set one use it; ``triton.set_allocator`` keeps working. Elsewhere the allocator is set
    in each thread that launches (call this before each launch; it is cheap).
    """
    if getattr(_TMA_ALLOCATOR, "installed", False):
        return
    import triton
    from triton.runtime import _allocation

    variable = getattr(_allocation, "_allocator", None)
    if isinstance(variable, contextvars.ContextVar) and not _PROCESS_DEFAULT:
        default: contextvars.ContextVar = contextvars.ContextVar(
            "_allocator", default=_allocate_scratch)
        current = variable.get()
        if not isinstance(current, getattr(_allocation, "NullAllocator", ())):
            default.set(current)  # keep an allocator this thread's caller set
        _allocation._allocator = default
        _PROCESS_DEFAULT.append(True)
    elif not _PROCESS_DEFAULT:
        triton.set_allocator(_allocate_scratch)
    _TMA_ALLOCATOR.installed = True


_PROCESS_DEFAULT: list[bool] = []  # the ContextVar default was installed (once per process)


def supports_native_fp4(device: torch.device) -> bool:
    """True where ``tl.dot_scaled`` runs microscaled products (mxfp8, mxfp4, nvfp4) on tensor
    cores: CUDA GPUs of compute capability 10.x (B200, GB200). Hopper (9.0) has fp8 but no fp4
    or block-scaled tensor-core instructions; there the ops decode the operands in registers.

    False for CPU tensors (the interpreter) and when no GPU can be asked (tracing CUDA
    FakeTensors on a CPU-only host), so traced graphs take the path that runs on every GPU.
    """
    if device.type != "cuda" or interpreter_enabled() or not torch.cuda.is_available():
        return False
    return capability(device)[0] == 10
