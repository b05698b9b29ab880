"""The launcher of the GEMM kernels: a plan and the tensors in, kernel launches out.

Data flow: ops -> planner -> launcher -> kernels. Given a plan, the launcher works out
descriptors, padded copies, grids, meta-parameters, the split-K workspace and reduction, and
launches: through wrap_triton where tracing may see the launch, else directly (through the
compiled kernel for memoised eager calls). It also keeps what every op's eager path shares: the
per-signature memo of eager launches and the test for calls that may skip the dispatcher.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import triton
from torch.library import wrap_triton

from .. import device as _device
from .. import tuning
from ..kernels import wgmma_fp8
from ..kernels.matmul import (
    DEPENDENT_LAUNCH_AVAILABLE,
    mm_kernel,
    mm_tma_kernel,
    splitk_reduce_kernel,
)
from . import graph_descriptors
from .checks import ceil_div, check, input_precision, needs_int64_indexing
from .compile_pool import POOL, trailing_arguments, variant_key
from .operands import Pad, blockwise_scale_tma, kernel_operands, warp_specialized_operands


class GemmScales(NamedTuple):
    """fp8 scales for the GEMM kernels (tgemm::scaled_mm's tensorwise, rowwise and blockwise
    recipes). "outer": scale_a per row of a, scale_b per column of b (stride 0 for one scale);
    "block": scale_a per ``a_rows`` rows x 128 K elements, scale_b per 128 K x ``b_cols``
    columns, indexed [row block, K block] and [K block, column block] through the strides."""
    mode: str
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    strides: tuple[int, int, int, int]  # scale_a: rows, K blocks; scale_b: K blocks, columns
    a_rows: int = 1
    b_cols: int = 1
    fast_accum: bool = False


# Scale strides and (SCALING, SA_ROWS, SB_COLS, FAST_ACCUM) of an unscaled GEMM.
_NO_SCALES = ((0, 0, 0, 0), ("none", 1, 1, False))


class PreparedLaunch(NamedTuple):
    """Everything a GEMM launch needs but the tensors: kernel, its launches (grid, meta-
    parameters, the runtime arguments after the tensor pointers; a tail split has two), and the
    split-K reduction if any."""
    kernel: Any
    launches: tuple[tuple[tuple[int], Mapping[str, Any], tuple[Any, ...]], ...]
    workspace_shape: tuple[Any, ...] | None
    reduce: tuple[tuple[int], tuple[Any, ...], Mapping[str, Any]] | None
    pads: tuple[Pad | None, Pad | None] | None = None  # operands to copy first (TMA rules)
    locks_shape: tuple[int] | None = None  # stream-K's flags, zeroed per launch
    plan: tuning.MMPlan | None = None  # the plan as launched (for benchmarks and tests)
    # The split tiles' counters of K splits that finish their tiles themselves (see
    # split_counters), passed where stream-K's flags go.
    counters_shape: tuple[int] | None = None
    # Compiled kernels per device, one cache per launch, then the reduction's (see
    # _launch_compiled), then run_kept's direct launches; for prepared launches that are kept
    # and reused (memoised eager calls), else empty.
    compiled: tuple[dict[Any, Any], ...] = ()
    # Of a kept eager call whose plain eager calls launch fewer kernels than the planner's plan
    # (planner.eager_mm_plan): the planner's, kept, which CUDA-graph captures launch instead
    # (see eager_or_capture).
    capture: Any = None


def num_sms(device: torch.device) -> int:
    """The SMs that persistent grids and split decisions count on ``device``. The interpreter
    runs programs one after another: a few persistent programs suffice there."""
    return _device.num_sms(device) if device.type == "cuda" else 4


def launch_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              activation: str, traceable: bool, plan: tuning.MMPlan,
              scales: GemmScales | None = None) -> None:
    """Launch the GEMM kernels of ``plan`` writing activation(a @ b + bias) into ``out``
    (checked inputs), the product scaled by ``scales`` when given (fp8 recipes of
    tgemm::scaled_mm).

    ``traceable=False`` launches the Triton kernels directly instead of through ``wrap_triton``,
    for plain eager calls that nothing traces. ``plan`` is the planner's (``planner.plan_mm``)
    or one to time (tuning); a "tma" plan runs on the portable kernel when the operands cannot
    be described for TMA.
    """
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"tgemm::mm: {error}")
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    prepared = prepare_launch(a, b, bias, out, activation, traceable, plan, scales)
    scale_a, scale_b = (None, None) if scales is None else (scales.scale_a, scales.scale_b)
    run_launch(prepared, a, b, bias, out, scale_a, scale_b, traceable)


def _unit(stride: Any) -> bool:
    """A stride known to be 1 (a symbolic one is not asked: that would guard on it)."""
    return type(stride) is int and stride == 1


def prepare_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, activation: str, traceable: bool,
                   plan: tuning.MMPlan, scales: GemmScales | None) -> PreparedLaunch:
    """Work out the launch of ``plan`` (see ``launch_mm``); M and N are non-zero."""
    if plan.kernel in (tuning.FP8_PRECISE_KERNEL, tuning.WS_KERNEL, tuning.WS_PINGPONG_KERNEL):
        return _prepare_warp_specialized(a, b, bias, out, activation, plan, scales)
    if plan.swap_ab:
        # The kernels compute C^T = B^T A^T: the same memory seen transposed; run_launch and
        # run_kept pass b's and scale_b's pointers where a's and scale_a's go (a check per
        # launch, no call: run_kept is the eager hot path).
        check(bias is None and (scales is None or scales.mode == "outer"),
              lambda: "tgemm: a transposed (swap_ab) plan takes no bias and no block scales")
        a, b, out = b.t(), a.t(), out.t()
        scales = None if scales is None else _transposed_scales(scales)
    device = a.device
    M, K = a.shape
    N = b.shape[1]
    stride_am, stride_ak = a.stride()
    stride_bk, stride_bn = b.stride()
    stride_cm, stride_cn = out.stride()
    tma_args = None
    pads = (None, None)
    if type(M) is int and type(N) is int and type(K) is int:
        tma_args, pads, (stride_am, stride_ak, stride_bk, stride_bn) = kernel_operands(
            a, b, out, plan.pad)
        if plan.kernel == "tma" and tma_args is None:
            plan = dataclasses.replace(plan, kernel="portable", epilogue_subtile=1,
                                       warp_specialize=False, stream_k=0)
        if scales is not None:
            plan = tuning.scaled_plan(plan, scales.mode)
        split_k, k_per_split = tuning.effective_split(K, plan.tile.block_k, plan.split_k)
    else:
        # Symbolic sizes (torch.compile with dynamic shapes): the planner's one plan for every
        # size, unsplit, so that nothing guards on them; the portable kernel takes any strides.
        split_k, k_per_split = 1, K
    tile = plan.tile
    tiles = tuning.output_tiles(M, N, tile)
    programs = num_sms(device) * plan.programs_per_sm  # of the persistent kernel
    sk_tiles = 0
    if plan.stream_k and plan.kernel == "tma" and split_k == 1:
        sk_tiles = tuning.stream_k_tiles(tiles, programs, plan.stream_k)
    whole_tiles, split_k = tuning.split_tiles(tiles, split_k, plan.split_tail, num_sms(device))
    split_units = (tiles - whole_tiles) * split_k if split_k > 1 else 0
    fixup = type(split_k) is int and tuning.fixes_up_splits(plan, split_k)
    # One launch of the portable kernel adding each tile's splits itself (eager calls); the
    # TMA kernel and scaled products split as the plan's twin without it does (same bits).
    inline = tuning.inlines_splits(plan) and scales is None and split_k > 1 and not fixup
    index_64 = needs_int64_indexing(((M, K, stride_am, stride_ak), (K, N, stride_bk, stride_bn),
                                     (M, N, stride_cm, stride_cn),
                                     (max(split_units, programs) * tile.block_m, tile.block_n,
                                      tile.block_n, 1)))
    stride_bias = bias.stride(0) if bias is not None else 0
    if scales is None:
        scale_strides, scaling = _NO_SCALES
    else:
        scale_strides = scales.strides
        scaling = (scales.mode, scales.a_rows, scales.b_cols, scales.fast_accum)
    if plan.kernel == "tma":
        strides, flags = tma_args
        kernel = mm_tma_kernel
    else:
        strides, flags = (stride_am, stride_ak, stride_bk, stride_bn), {}
        kernel = mm_kernel
    aligns = (1, 1, 1, 1, 1, 1, False)
    if kernel is mm_kernel and tuning.pitch_hints_enabled():
        # M is not specialised on (one kernel for every batch size); N is, but only on
        # multiples of 16. Only an operand contiguous along M (N) gets a size hint, so other
        # layouts compile no more variants.
        aligns = (*(tuning.pitch_alignment(stride, a.element_size()) for stride in strides),
                  tuning.size_alignment(M, False) if _unit(stride_am) else 1,
                  tuning.size_alignment(N, True) if _unit(stride_bn) else 1,
                  _unit(stride_bn) and tuning.odd_contiguous(N))
    # C's rows go out in vectors where its pitch and N divide by a power of two (all kernels'
    # pointer stores; the TMA kernel's only where C cannot be described for TMA).
    c_align = (tuning.store_alignment(stride_cm, N, out.element_size())
               if tuning.pitch_hints_enabled() else 1)

    # Programmatic dependent launch for eager single-wave launches (tuning.dependent_launch);
    # traced launches keep plain ones, as do ROCm builds (whose "cuda" devices report their own
    # 9.x) and Triton releases without the intrinsics.
    pdl_capability = (_device.capability(device) if device.type == "cuda" and not traceable
                      and not _INTERPRETED and _DEPENDENT_LAUNCH else (0, 0))

    def gemm_launch(first_tile: Any, units: Any, split: bool, k_per_split: Any,
                    inline: bool = False
                    ) -> tuple[tuple[int], Mapping[str, Any], tuple[Any, ...]]:
        # Runtime arguments after the tensors (a, b, out, bias, workspace, locks, scale_a,
        # scale_b), in the kernels' shared order; the plan's meta-parameters come after them.
        runtime_args = (
            M, N, K, *strides, stride_cm, stride_cn, stride_bias, *scale_strides, k_per_split,
            first_tile, units, sk_tiles, bias is not None, activation, input_precision(a.dtype),
            _device.interpreter_enabled() and a.dtype == torch.bfloat16, index_64,
        )
        stages = None
        if kernel is mm_kernel and type(k_per_split) is int:
            stages = tuning.pipeline_stages(tile.num_stages, ceil_div(k_per_split, tile.block_k))
        # Stream-K needs every program (each takes a share of the shared tiles' K steps).
        grid = ((programs if sk_tiles else min(programs, units)),) if (
            kernel is mm_tma_kernel) else (units,)
        pdl = tuning.dependent_launch(grid[0], num_sms(device), pdl_capability)
        meta = tuning.launch_meta(plan, split, scaling, sk_tiles > 0,
                                  split_k if fixup else 0, aligns, stages, pdl, c_align,
                                  inline)
        return grid, {**meta, **flags} if flags else meta, runtime_args

    launches = []
    if inline:  # every tile, the split ones (from whole_tiles on) in K splits of k_per_split
        launches.append(gemm_launch(whole_tiles, tiles, False, k_per_split, inline=True))
        split_k = 1  # no workspace, no reduction
    elif sk_tiles:
        launches.append(gemm_launch(sk_tiles, tiles - sk_tiles, False, K))
    elif split_k == 1 or whole_tiles > 0:  # (split_k first: no guard on symbolic sizes)
        launches.append(gemm_launch(0, whole_tiles, False, K))
    reduce = None
    if split_k > 1:
        launches.append(gemm_launch(whole_tiles, split_units, True, k_per_split))
    if split_k > 1 and not fixup:
        reduce = _split_reduction(out, bias, activation, tile, tiles - whole_tiles, whole_tiles,
                                  split_k, index_64, pdl_capability)
    workspace = locks = counters = None
    if split_k > 1:
        workspace = (split_units, tile.block_m, tile.block_n)
        if fixup:
            counters = (tiles - whole_tiles,)
    elif sk_tiles:
        # A partial tile per program at most, and the program's flag.
        workspace, locks = (programs, tile.block_m, tile.block_n), (programs,)
    return PreparedLaunch(kernel, tuple(launches), workspace, reduce,
                          None if pads == (None, None) else pads, locks_shape=locks, plan=plan,
                          counters_shape=counters)


def _split_reduction(out: torch.Tensor, bias: torch.Tensor | None, activation: str,
                     tile: tuning.TileConfig, split_tiles: Any, first_tile: Any, split_k: int,
                     index_64: bool, pdl_capability: tuple[int, int]
                     ) -> tuple[tuple[Any], tuple[Any, ...], Mapping[str, Any]]:
    """The launch (grid, runtime arguments, meta) of splitk_reduce_kernel adding the
    ``split_k`` fp32 partials of the ``split_tiles`` tiles from ``first_tile`` on (the GEMM's
    tiles in its L2-grouped order; workspace slot s * split_tiles + tile) and running the
    epilogue (bias, activation, cast) into ``out``, whose rows it stores in vectors as the
    GEMM kernels do (C_ALIGN)."""
    M, N = out.shape
    c_align = (tuning.store_alignment(out.stride(0), N, out.element_size())
               if tuning.pitch_hints_enabled() else 1)
    sms = num_sms(out.device)
    block_m, block_n, num_warps = tuning.reduce_tile(split_tiles, tile.block_m, tile.block_n,
                                                     sms)
    programs = split_tiles * (tile.block_m // block_m) * (tile.block_n // block_n)
    pdl = tuning.dependent_launch(programs, sms, pdl_capability)
    return (
        (programs,),
        (M, N, out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
         first_tile, bias is not None, activation, index_64),
        {"SPLIT_K": split_k, "TILE_M": tile.block_m, "TILE_N": tile.block_n,
         "GROUP_M": tile.group_m, "BLOCK_M": block_m, "BLOCK_N": block_n,
         "num_warps": num_warps, "C_ALIGN": c_align,
         **(tuning.PDL_META if pdl else tuning.NO_PDL_META)},
    )


def _transposed_scales(scales: GemmScales) -> GemmScales:
    """The "outer" scales of the transposed product C^T = B^T A^T: b's per-column scales become
    the per-row scales of its first operand and a's per-row ones the per-column scales of its
    second (the tensors themselves are swapped at launch)."""
    sa_rows, sa_k, sb_k, sb_cols = scales.strides
    return scales._replace(scale_a=scales.scale_b, scale_b=scales.scale_a,
                           strides=(sb_cols, sb_k, sa_k, sa_rows), a_rows=scales.b_cols,
                           b_cols=scales.a_rows)


def _prepare_warp_specialized(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                              out: torch.Tensor, activation: str, plan: tuning.MMPlan,
                              scales: GemmScales | None) -> PreparedLaunch:
    """The launch of Hopper's warp-specialized Gluon kernel (kernels/wgmma_fp8.py): a precise
    fp8 plan (``tuning.fp8_precise_plan``, scales read through their strides: tensorwise,
    rowwise, blockwise) or a 16-bit one (``tuning.WS_KERNEL``, unscaled), for operands the
    planner found it can read (``planner.ws_applies``); one persistent program per SM."""
    if plan.kernel == tuning.FP8_PRECISE_KERNEL:
        check(scales is not None and wgmma_fp8.AVAILABLE and (
                  scales.mode == "outer" or scales.mode == "block" and scales.b_cols == 128),
              lambda: f"tgemm: the {plan.kernel} kernel runs tensorwise, rowwise and 128x128-"
                      f"block scaled fp8 products")
    else:
        check(scales is None and wgmma_fp8.AVAILABLE and activation == "none"
              and a.element_size() == 2 and warp_specialized_operands(a, b, out),
              lambda: f"tgemm: the {plan.kernel} kernel runs unscaled 16-bit products of "
                      f"K-contiguous operands with 16-byte aligned pitches into a row-major "
                      f"output, without activation")
    (M, K), N = a.shape, b.shape[1]
    tile = plan.tile
    pingpong = plan.kernel == tuning.WS_PINGPONG_KERNEL
    consumers = 2 if pingpong else tile.block_m // wgmma_fp8.ROWS_PER_CONSUMER
    # K steps are 128 bytes of a row (tile.block_k counts 16-bit elements); K splits of whole
    # steps, whose partials splitk_reduce_kernel adds (bias and cast there).
    splits, k_per_split = (1, K) if pingpong else tuning.effective_split(
        K, tile.block_k * 2 // a.element_size(), plan.split_k)
    tiles = tuning.output_tiles(M, N, tile)
    programs = min(num_sms(a.device), tiles * splits)
    scale_args = ((*scales.strides, scales.mode == "block", scales.a_rows) if scales is not None
                  else (0, 0, 0, 0, False, 1))
    runtime_args = (M, N, K, a.stride(0), b.stride(1), out.stride(0),
                    bias.stride(0) if bias is not None else 0, *scale_args[:4], splits,
                    k_per_split, bias is not None and splits == 1, *scale_args[4:])
    meta = {"CONSUMERS": consumers, "BLOCK_N": tile.block_n, "GROUP_M": tile.group_m,
            "STAGES": tile.num_stages, "CONSUMER_REGS": wgmma_fp8.CONSUMER_REGS[consumers],
            "PINGPONG": pingpong, "SPLIT": splits > 1, "num_warps": 4}
    if scales is not None and scales.mode == "block" and blockwise_scale_tma(
            scales.scale_a, scales.a_rows, scales.strides[0], scales.strides[1], M, K
    ) and tuning.fp8_precise_fits(consumers, tile.num_stages, out.element_size(),
                                  tuning.FP8_SCALE_TMA_SPARE_BYTES):
        meta["SCALE_TMA"] = True
    workspace = reduce = None
    if splits > 1:
        workspace = (tiles * splits, tile.block_m, tile.block_n)
        index_64 = needs_int64_indexing(((M, N, out.stride(0), 1),))
        reduce = _split_reduction(out, bias, activation, tile, tiles, 0, splits, index_64, (0, 0))
    return PreparedLaunch(wgmma_fp8.ws_gemm_kernel, (((programs,), meta, runtime_args),),
                          workspace, reduce, plan=plan)


def _builds_descriptors(prepared: PreparedLaunch) -> bool:
    """Whether the launch's kernel builds TMA descriptors on the device (the persistent TMA
    kernel, Hopper's precise fp8 kernel): Triton then needs its scratch allocator."""
    return prepared.kernel is mm_tma_kernel or prepared.kernel is getattr(
        wgmma_fp8, "ws_gemm_kernel", None)


def run_launch(prepared: PreparedLaunch, a: torch.Tensor, b: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, scale_a: torch.Tensor | None,
               scale_b: torch.Tensor | None, traceable: bool) -> bool:
    """Launch a prepared GEMM on these tensors (and its split-K reduction); scale_a and scale_b
    are the scales of a prepared scaled product, else None. Whether the host-descriptor
    variants of its launches of a kernel that builds TMA descriptors (the persistent TMA
    kernel, the warp-specialized one) are settled: loaded, for a CUDA graph's capture of the
    same launches to run, or never to be (graph_descriptors.prepare)."""
    # Eager launches of those kernels: captured ones take host-built descriptors where that
    # variant is loaded; others prepare it (graph_descriptors).
    if prepared.plan is not None and prepared.plan.swap_ab:  # see prepare_launch
        a, b, scale_a, scale_b = b, a, scale_b, scale_a
    host_descriptors = (graph_descriptors.supports(prepared.kernel) and not traceable
                        and not _INTERPRETED)
    capturing = host_descriptors and _capturing()
    host_settled = not capturing  # (a capture prepares nothing)
    if _builds_descriptors(prepared):
        _device.install_tma_allocator()  # per thread where Triton needs it (autograd's too)
    a, b = _padded(prepared, a, b)
    workspace = None
    if prepared.workspace_shape is not None:
        workspace = split_workspace(prepared.workspace_shape, a.device, traceable)
    locks = None
    if prepared.locks_shape is not None:
        locks = torch.zeros(prepared.locks_shape, device=a.device, dtype=torch.int32)
    elif prepared.counters_shape is not None:
        locks = split_counters(prepared.counters_shape[0], a.device, traceable)
    caches = prepared.compiled or (None,) * (len(prepared.launches) + 2)
    device = _current_device() if host_descriptors else None
    for (grid, meta, runtime_args), cache in zip(prepared.launches, caches):
        args = (a, b, out, bias, workspace, locks, scale_a, scale_b, *runtime_args)
        if capturing and not _launch_hooks_set() and graph_descriptors.launch_captured(
                prepared.kernel, grid, args, meta, device, _current_stream(device)):
            continue
        launch_kernel(prepared.kernel, grid, args, meta, traceable, cache)
        if host_descriptors and not capturing:
            host_settled &= graph_descriptors.prepare(prepared.kernel, grid, args, meta, device)
    if prepared.reduce is not None:
        grid, runtime_args, meta = prepared.reduce
        launch_kernel(splitk_reduce_kernel, grid, (workspace, out, bias, *runtime_args), meta,
                      traceable, caches[-2])
    return host_settled


# Buffers a GEMM launch uses only while it runs (split-K partials; counters of splits that
# finish their tiles, which every launch leaves at zero), kept per (kind, device, stream):
# launches on one stream run one after another, so each may take the previous one's buffer
# instead of allocating (host time of a small eager GEMM); other streams have their own.
_STREAM_BUFFERS: dict[tuple[Any, ...], torch.Tensor] = {}
# Larger workspaces are allocated per launch rather than held for the process.
STREAM_BUFFER_LIMIT = 1 << 24  # bytes


def stream_buffer(kind: str, shape: tuple[Any, ...], dtype: torch.dtype, device: torch.device,
                  traceable: bool, zeroed: bool = False) -> torch.Tensor:
    """A buffer of ``shape``'s size for a launch on ``device``'s current stream (``zeroed``: all
    zeros, as every launch that uses it leaves it): this stream's ``kind`` buffer, grown on
    demand, 1-D and maybe larger (kernels read only its base pointer; no view is made, which
    would cost what the allocation saves); fresh, of ``shape``, for launches that tracing
    records (before any size arithmetic: sizes may be symbolic) or a CUDA graph captures (the
    graph may replay beside eager work), and for buffers past STREAM_BUFFER_LIMIT."""
    allocate = torch.zeros if zeroed else torch.empty
    if traceable:
        return allocate(shape, device=device, dtype=dtype)
    numel = math.prod(shape)
    if numel * dtype.itemsize > STREAM_BUFFER_LIMIT or (
            device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()):
        return allocate(shape, device=device, dtype=dtype)
    stream = None
    if device.type == "cuda":
        stream = _current_stream(_current_device() if device.index is None else device.index)
    key = (kind, device.type, device.index, stream)
    buffer = _STREAM_BUFFERS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = allocate(max(numel, 1024), device=device, dtype=dtype)
        _STREAM_BUFFERS[key] = buffer
    return buffer


def split_counters(count: int, device: torch.device, traceable: bool) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters for a launch that leaves them zeroed (splits
    that finish their own tiles); see ``stream_buffer``."""
    return stream_buffer("counters", (count,), torch.int32, device, traceable, zeroed=True)


def split_workspace(shape: tuple[Any, ...], device: torch.device,
                    traceable: bool) -> torch.Tensor:
    """The fp32 workspace of a split-K or stream-K launch, [units, BLOCK_M, BLOCK_N] (see
    ``stream_buffer``)."""
    return stream_buffer("workspace", shape, torch.float32, device, traceable)


def _padded(prepared: PreparedLaunch, a: torch.Tensor, b: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b as the kernels read them: their padded copies where the launch makes them."""
    if prepared.pads is None:
        return a, b
    pad_a, pad_b = prepared.pads
    return (a if pad_a is None else pad_a.copy(a)), (b if pad_b is None else pad_b.copy(b))


def launch_kernel(kernel: Any, grid: tuple[int], args: tuple[Any, ...], meta: Mapping[str, Any],
                  traceable: bool, compiled: dict[int, Any] | None = None) -> None:
    """Launch ``kernel``: through wrap_triton where tracing may see it, else directly; with
    ``compiled`` (a memoised eager launch's cache), through its compiled kernel
    (_launch_compiled)."""
    # Interpreted kernels are plain Python that no tracer sees through (the op is then an opaque
    # custom_op), and torch 2.11's wrap_triton refuses them: they always launch directly.
    if traceable and not _INTERPRETED:
        # Arguments may be symbolic here: pass them by name, as wrap_triton expects.
        wrap_triton(kernel)[grid](**dict(zip(kernel.arg_names, args)), **meta)
        return
    with _device.SHARED_SCRATCH:
        if compiled is None or not _launch_compiled(compiled, kernel, grid, args, meta):
            if POOL.busy:
                wait_for_compilation(kernel, args, meta)
            kernel[grid](*args, **meta)


def wait_for_compilation(kernel: Any, args: tuple[Any, ...], meta: Mapping[str, Any]) -> None:
    """Before launching through Triton's JIT: wait for this variant if the compile pool is
    building it (compile_pool.py), rather than compile it a second time."""
    device = -1 if _INTERPRETED else torch._C._cuda_getDevice()
    POOL.wait(variant_key(kernel, args, meta, device), _kernel_name(kernel))


def _kernel_name(kernel: Any) -> str:
    return f"the GEMM kernel {getattr(kernel, '__name__', None) or kernel!r}"


def _launch_compiled(cache: dict[int, Any], kernel: Any, grid: tuple[int],
                     args: tuple[Any, ...], meta: Mapping[str, Any]) -> bool:
    """Launch a memoised eager launch through the kernel Triton compiled for it; False where the
    caller must launch through Triton's JIT.

    The launch's memo key (each op's eager signature) fixes everything Triton specialises
    on: every argument but the tensors, and of the tensors their dtypes and 16-byte alignment
    (inputs by ``tensor_key``, outputs and workspaces by being allocations of their own, whose
    bases are aligned). So one compiled kernel per device serves every call with that key.
    Launching it directly skips the JIT's argument binding and specialisation, about two
    thirds of the host time of a small GEMM.
    Triton's launch hooks (profilers) need the JIT's path, which calls them.
    """
    if _INTERPRETED or _launch_hooks_set():
        return False
    device = _current_device()
    entry = cache.get(device)
    if entry is None:
        # The variant's first launch here: Triton compiles it unless its cache (or the compile
        # pool) already has it; a long wait is reported once.
        start = time.perf_counter()
        if POOL.busy:
            wait_for_compilation(kernel, args, meta)
        launched = kernel[grid](*args, **meta)
        POOL.notice(time.perf_counter() - start, _kernel_name(kernel))
        if launched is not None and hasattr(launched, "result"):
            launched = launched.result()
        cache[device] = (launched, (*grid, 1, 1)[:3],
                         trailing_arguments(kernel, len(args), meta))
        return True
    launched, (grid_0, grid_1, grid_2), tail = entry
    launched.run(grid_0, grid_1, grid_2, _current_stream(device),
                 launched.function, launched.packed_metadata, None, None, None, *args, *tail)
    return True


# Fixed for the process once kernels are decorated (see device.interpreter_enabled).
_INTERPRETED = _device.interpreter_enabled()
_DEPENDENT_LAUNCH = DEPENDENT_LAUNCH_AVAILABLE and getattr(torch.version, "hip", None) is None
# The current CUDA device's index, a device's current stream, and whether the current stream is
# capturing a CUDA graph (CUDA builds of torch).
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
# Triton's runtime knobs (3.4+), where its launch hooks live; direct launches rely on the
# launcher contract of those versions (grid, stream, function, metadata, hooks, arguments) and
# are not used on older ones.
_TRITON_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks_set() -> bool:
    if _TRITON_RUNTIME is None:
        return True
    enter, leave = _TRITON_RUNTIME.launch_enter_hook, _TRITON_RUNTIME.launch_exit_hook
    # Triton 3.5+ keeps hook chains (empty when unused); earlier versions a callable or None.
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


# --- plain eager calls ----------------------------------------------------------------------------
# An eager call of a small GEMM is host-bound: checks, plan and launch arithmetic cost more than
# the kernel. They depend only on the call's signature (shapes, strides, dtypes, devices, the
# 16-byte alignment of operands and bias, activation, out dtype, fp32 precision, tuned-plan
# version), so eager calls memoise them per signature; a signature seen once needs no checks
# again, and its kernels launch without Triton's JIT (see _launch_compiled, run_kept).

def tensor_key(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What an eager call's signature holds of a tensor argument (None stays None): shape,
    strides, dtype, device and 16-byte alignment, all that checks, plans and Triton's
    specialisation read of it."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


class EagerEntry(NamedTuple):
    """A memoised eager signature: a new output as the first call made it (``empty_strided``
    with that call's layout: the cheapest of torch's allocating calls, no option parsing from a
    template tensor as in ``new_empty``), and the prepared launch (None: nothing to launch)."""
    allocate: Callable[[], torch.Tensor] | None  # None: the caller allocates (memoised_launch)
    prepared: Any


# Signature -> its EagerEntry.
_EAGER_LAUNCHES: dict[tuple[Any, ...], EagerEntry] = {}
_EAGER_LAUNCHES_LIMIT = 4096


def kept(prepared: PreparedLaunch) -> PreparedLaunch:
    """``prepared`` with caches for the kernels it launches, to be kept and reused."""
    return prepared._replace(compiled=tuple({} for _ in range(len(prepared.launches) + 2)))


# Kept in a kept launch's last cache (beside its direct launches, keyed by device) once the
# launch has run in this process, whichever path it took: under launch hooks (a profiler's) it
# never builds direct launches, but its kernels are loaded all the same.
_RAN = "ran"


def eager_or_capture(prepared: PreparedLaunch) -> PreparedLaunch:
    """The launch a kept eager call runs: ``prepared``, or its ``capture`` launch in a CUDA
    graph capture, where the host's time is paid once, until that launch has run once in the
    process (so that its kernels are loaded before a capture needs them: a capturing stream
    cannot load one), and while its host-descriptor variants have work left (see
    ``_capture_unsettled``)."""
    capture = prepared.capture
    if capture is None:
        return prepared
    ran = capture.compiled[-1]
    if not ran or (_capturing is not None and _capturing()) or _capture_unsettled(capture, ran):
        return capture
    return prepared


def _capture_unsettled(capture: PreparedLaunch, ran: dict[Any, Any]) -> bool:
    """Whether a kept capture launch of a kernel that captures with host-built TMA descriptors
    has them unsettled as of graph_descriptors.GENERATION (a capture wanted them, or
    prepare_capture is running). Only eager launches build and load those variants
    (graph_descriptors.prepare, from run_kept), so the eager calls run the capture launch until
    they are settled: without it, an eager call whose own plan is another (the portable twin
    of a small TMA plan, an unsplit one) never built them, and its captures kept the
    device-built descriptors (about 2 us more a replay of a tiny product on an H200)."""
    if not graph_descriptors.GENERATION or not graph_descriptors.supports(capture.kernel):
        return False
    direct = ran.get(None if _INTERPRETED else _current_device())
    return (direct is not None and direct.tma_host is not None
            and direct.tma_host[0] != graph_descriptors.GENERATION)


def memoised_eager_call(signature: tuple[Any, ...],
                        first_call: Callable[..., tuple[torch.Tensor, Any]],
                        *args: Any) -> tuple[torch.Tensor, Any]:
    """The output and the prepared launch (None: nothing to launch) of an eager GEMM call, from
    the memo of its ``signature``, which must fix everything the checks and the launch depend
    on (the op's name among them where two ops share a form; devices included, so the output
    is allocated where the first call's was).

    The first call of a signature runs ``first_call(*args)``: the checks, then the output and
    the prepared launch. Later calls only allocate the output, as the first call made it. (A
    function and its arguments rather than a closure: an eager call of a small GEMM cannot
    afford to build one per call.)
    """
    known = _EAGER_LAUNCHES.get(signature)
    if known is None:
        out, prepared = first_call(*args)
        allocate = functools.partial(torch.empty_strided, tuple(out.shape), out.stride(),
                                     dtype=out.dtype, device=out.device)
        _remember(signature, EagerEntry(allocate, prepared))
        return out, prepared
    allocate, prepared = known
    return allocate(), prepared


def memoised_launch(signature: tuple[Any, ...], prepare: Callable[..., Any], *args: Any) -> Any:
    """The prepared launch of an eager call whose caller allocates the output itself, from the
    memo of its ``signature`` (which must fix everything ``prepare`` depends on, as in
    ``memoised_eager_call``); the first call of a signature runs ``prepare(*args)``."""
    known = _EAGER_LAUNCHES.get(signature)
    if known is not None:
        return known.prepared
    prepared = prepare(*args)
    _remember(signature, EagerEntry(None, prepared))
    return prepared


def forget_eager_calls() -> None:
    """Forget every memoised eager call: their next calls are first calls again (a benchmark
    switching a setting that signatures do not key on, such as TORCH_TRITON_GEMM_EAGER_PLANS)."""
    _EAGER_LAUNCHES.clear()


def _remember(signature: tuple[Any, ...], entry: EagerEntry) -> None:
    # A bounded memo: a process that meets ever new signatures starts it again.
    if len(_EAGER_LAUNCHES) >= _EAGER_LAUNCHES_LIMIT:
        _EAGER_LAUNCHES.clear()
    _EAGER_LAUNCHES[signature] = entry


def run_kept(prepared: PreparedLaunch, a: torch.Tensor, b: torch.Tensor,
             bias: torch.Tensor | None, out: torch.Tensor, scale_a: torch.Tensor | None,
             scale_b: torch.Tensor | None) -> None:
    """``run_launch`` of a kept prepared launch (a memoised eager call), without tracing.

    Once every kernel of the launch is compiled for the current device, a call only allocates
    the workspace and calls each compiled kernel's launcher with the arguments put together by
    the first call (``_DirectLaunches``, kept in ``prepared.compiled[-1]``): host time of a
    small GEMM is mostly this path's."""
    device = _current_device() if not _INTERPRETED else None
    direct = prepared.compiled[-1].get(device)
    if direct is not None and direct.single is not None and not _launch_hooks_set():
        # One launch and nothing else (most small GEMMs): the general path below, without
        # the checks and buffers that such a launch cannot need.
        launch, function, head, grid_0, grid_1, grid_2, rest = direct.single
        launch(grid_0, grid_1, grid_2, _current_stream(device), function, *head, a.data_ptr(),
               b.data_ptr(), out.data_ptr(), None if bias is None else bias.data_ptr(), None,
               None, None if scale_a is None else scale_a.data_ptr(),
               None if scale_b is None else scale_b.data_ptr(), *rest)
        return
    # Launches of the kernels that build TMA descriptors (the persistent TMA kernel's, the
    # warp-specialized one's) go through run_launch in CUDA graph captures (which launch
    # their host-descriptor variants where loaded) and while that variant has work left
    # (graph_descriptors.prepare; settled as of the generation kept in tma_host).
    tma_host = None if direct is None else direct.tma_host
    capturing = tma_host is not None and _capturing()
    if direct is None or _launch_hooks_set() or capturing or (
            tma_host is not None and tma_host[0] != graph_descriptors.GENERATION):
        host_settled = run_launch(prepared, a, b, bias, out, scale_a, scale_b, False)
        prepared.compiled[-1][_RAN] = True  # (see eager_or_capture)
        if direct is None and device is not None:
            direct = _direct_launches(prepared, device)
        if direct is not None:
            if direct.tma_host is not None and host_settled and not capturing:
                direct.tma_host[0] = graph_descriptors.GENERATION
            prepared.compiled[-1][device] = direct
        return
    gemm, reduce, workspace_shape, locks_shape, tma, scratch, _, _ = direct
    workspace = locks = None
    if workspace_shape is not None:
        workspace = split_workspace(workspace_shape, a.device, False)
    if locks_shape is not None:
        locks = torch.zeros(locks_shape, device=a.device, dtype=torch.int32)
    elif prepared.counters_shape is not None:
        locks = split_counters(prepared.counters_shape[0], a.device, False)
    stream = _current_stream(device)
    if prepared.plan is not None and prepared.plan.swap_ab:  # see prepare_launch
        a, b, scale_a, scale_b = b, a, scale_b, scale_a
    a, b = _padded(prepared, a, b)
    # The tensors' addresses: Triton's launcher takes an integer pointer as it is, where for a
    # tensor it calls data_ptr() and asks the driver whether the address is on the device (the
    # signature's first call checked the devices, for every call of it).
    pointers = (a.data_ptr(), b.data_ptr(), out.data_ptr(),
                None if bias is None else bias.data_ptr(),
                None if workspace is None else workspace.data_ptr(),
                None if locks is None else locks.data_ptr(),
                None if scale_a is None else scale_a.data_ptr(),
                None if scale_b is None else scale_b.data_ptr())
    # Device-side TMA descriptors' scratch memory: the shared buffer's address for launches
    # through Triton's C function (the buffer kept alive until they are queued), Triton's
    # allocator for launches through its launcher.
    buffer = _device.shared_scratch(scratch, stream) if scratch else None
    address = None if buffer is None else buffer.data_ptr()
    if tma:
        _device.install_tma_allocator()  # per thread where Triton needs it (autograd's too)
        with _device.SHARED_SCRATCH:
            _run_direct(gemm, stream, pointers, address)
    else:
        _run_direct(gemm, stream, pointers, address)
    if reduce is not None:
        # (ws, out, bias; the scratch address too, which _direct_launches sized for every
        # launch, the reduction's included)
        _run_direct((reduce,), stream, (pointers[4], pointers[2], pointers[3]), address)


# One kernel launch as run_kept makes it: the function to call (the compiled kernel's
# launcher, or its C function, see _c_launch), the kernel's handle, the arguments between it
# and the tensors, the grid, and the arguments after the tensors (constexprs included, in
# order).
DirectLaunch = tuple[Any, Any, tuple[Any, ...], int, int, int, tuple[Any, ...]]


class _DirectLaunches(NamedTuple):
    """A kept prepared launch as run_kept makes it on one device."""
    gemm: tuple[DirectLaunch, ...]
    reduce: DirectLaunch | None
    workspace_shape: tuple[int, ...] | None
    locks_shape: tuple[int] | None
    # Device-side TMA descriptors: launched through Triton's launcher, which asks the scratch
    # allocator (tma), or through its C function, given the shared scratch buffer of this many
    # bytes (scratch; 0: none needed).
    tma: bool
    scratch: int
    # Of a kernel graph_descriptors supports: [the graph_descriptors.GENERATION at which its
    # host-descriptor variants were last found settled, or -1]; None for other kernels.
    tma_host: list[int] | None
    # The one launch, where it is all the call makes: no reduction, workspace, counters,
    # padded copies, transposed operands, TMA descriptors or scratch (run_kept's shortest
    # path); None otherwise.
    single: DirectLaunch | None = None


def _run_direct(launches: tuple[DirectLaunch, ...], stream: int,
                pointers: tuple[int | None, ...], scratch: int | None = None) -> None:
    # Triton's launcher contract (see _TRITON_RUNTIME): grid, stream, function, metadata, the
    # launch metadata and hooks (none: run_kept is not used with hooks set), arguments; the
    # C function's has the launch flags and scratch buffers before the metadata (_c_launch),
    # the global one's address (``scratch``) where it holds _SCRATCH.
    for launch, function, head, grid_0, grid_1, grid_2, rest in launches:
        if scratch is not None and head[2] is _SCRATCH:
            head = (head[0], head[1], scratch, *head[3:])
        launch(grid_0, grid_1, grid_2, stream, function, *head, *pointers, *rest)


def _c_launch(run: Any, grid: tuple[int, int, int]
              ) -> tuple[Any, tuple[Any, ...], int] | None:
    """The C function behind a compiled kernel's launcher ``run``, the arguments it takes
    between the kernel's handle and the metadata (launch flags, then the global scratch
    buffer -- _SCRATCH where the kernel needs one, for the caller to fill in -- and no profile
    scratch), and the bytes of global scratch a launch on ``grid`` needs, where calling it is
    what ``run`` would do: Triton 3.6's CudaLauncher, which calls it after asking the
    allocators for those buffers. None otherwise (other Triton versions, other launchers,
    profile scratch: ``run`` is called). On an H100, calling it saved 1.3 us of an 8.3-us
    direct launch (64^3, portable kernel)."""
    form = _LAUNCHER_FORMS.get(type(run))
    if form is None:
        try:
            form = _TRITON_3_6 and list(
                inspect.signature(type(run).__call__).parameters) == _CALL_3_6
        except (TypeError, ValueError):
            form = False
        _LAUNCHER_FORMS[type(run)] = form
    flags = (getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None))
    size = getattr(run, "global_scratch_size", None)
    if not form or getattr(run, "profile_scratch_size", 1) or None in flags or not hasattr(
            run, "launch") or type(size) is not int or (
            size and getattr(run, "global_scratch_align", _SCRATCH_ALIGN + 1) > _SCRATCH_ALIGN):
        return None
    # (CudaLauncher's own arithmetic: a slice of ``size`` bytes per program.)
    scratch = grid[0] * grid[1] * grid[2] * getattr(run, "num_ctas", 1) * size
    return run.launch, (*flags, _SCRATCH if scratch else None, None), scratch


# Triton 3.6's CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function, *args), which
# calls launch(gridX, gridY, gridZ, stream, function, launch_cooperative_grid, launch_pdl,
# global_scratch, profile_scratch, *args); other releases keep their wrapper.
_TRITON_3_6 = triton.__version__.startswith("3.6.")
_CALL_3_6 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_LAUNCHER_FORMS: dict[type, bool] = {}
# Where a direct launch's global scratch address goes (_run_direct fills it in per call), and
# the alignment torch's allocations (the shared scratch buffer) always have.
_SCRATCH = object()
_SCRATCH_ALIGN = 256


def _direct_launches(prepared: PreparedLaunch, device: int) -> _DirectLaunches | None:
    """run_kept's launches of ``prepared`` on ``device``, once _launch_compiled has kept the
    compiled kernel of each of its launches there; None where some launch went through
    Triton's JIT. (Padded copies are made by run_kept before the launches, as by run_launch:
    the kept arguments are the copies' strides.)"""
    def direct(cache: dict[int, Any], runtime_args: tuple[Any, ...]
               ) -> tuple[DirectLaunch, int | None]:
        # The launch, and the global scratch bytes its C function needs (None: the launch
        # goes through Triton's launcher, which asks the allocator itself).
        launched, grid, tail = cache[device]
        launch, head, scratch = launched.run, (), None
        c_launch = _c_launch(launched.run, grid)
        if c_launch is not None:
            launch, head, scratch = c_launch
        return (launch, launched.function, (*head, launched.packed_metadata, None, None, None),
                *grid, (*runtime_args, *tail)), scratch

    caches = prepared.compiled
    if any(device not in cache for cache in caches[:len(prepared.launches)]) or (
            prepared.reduce is not None and device not in caches[-2]):
        return None
    launches = [direct(cache, runtime_args)
                for (_, _, runtime_args), cache in zip(prepared.launches, caches)]
    if prepared.reduce is not None:
        launches.append(direct(caches[-2], prepared.reduce[1]))
    sizes = [size for _, size in launches]
    gemm = tuple(launch for launch, _ in launches[:len(prepared.launches)])
    reduce = launches[-1][0] if prepared.reduce is not None else None
    direct = _DirectLaunches(gemm, reduce, prepared.workspace_shape, prepared.locks_shape,
                             _builds_descriptors(prepared) and None in sizes,
                             max((size or 0 for size in sizes), default=0),
                             [-1] if graph_descriptors.supports(prepared.kernel) else None)
    plain = (len(gemm) == 1 and reduce is None and direct.workspace_shape is None
             and direct.locks_shape is None and prepared.counters_shape is None
             and prepared.pads is None and not direct.tma and not direct.scratch
             and direct.tma_host is None
             and not (prepared.plan is not None and prepared.plan.swap_ab))
    return direct._replace(single=gemm[0]) if plain else direct


_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


_grad_enabled = torch._C.is_grad_enabled


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True for a call no PyTorch subsystem needs to see as an op: no tracing, compile, modes or
    tensor subclasses. Such calls skip the dispatcher (autograd still applies, through the op's
    eager autograd function: ``eager_autograd_apply`` in ops/_registry.py), whose Python
    custom-op path costs more host time than a small GEMM takes on the GPU."""
    return plain_eager_grad(*tensors) is not None


def plain_eager_grad(*tensors: torch.Tensor | None) -> bool | None:
    """None where a call on ``tensors`` is not plain eager (``plain_eager``), else whether
    autograd must record it (grad mode on and a tensor requiring gradients; None entries are
    skipped): both in one pass over the tensors, as the ops' eager entry points ask them of
    every call. (Reading requires_grad costs less than torch._C._any_requires_grad's argument
    parsing.)"""
    # is_compiling first: TorchDynamo, tracing this, folds it and traces no further.
    if (torch.compiler.is_compiling() or _len_dispatch_stack() or _function_mode_enabled()
            or _functorch_active()):
        return None
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TYPES or _functorch_wrapped(t):
                return None
            grad = grad or t.requires_grad
    return grad and _grad_enabled()

