"""The GEMM kernels of tgemm::mm and tgemm::scaled_mm: C = act(A @ B + bias), A and B of any
strides and sizes, unscaled or fp8 with tensor, row or block scales (SCALING).

``mm_kernel`` runs everywhere (any GPU, any alignment, Triton's CPU interpreter); the persistent
``mm_tma_kernel`` is the Hopper path for operands TMA can describe. Both can split K: a launch
with SPLIT cuts every tile of C from ``first_tile`` on (in L2-grouped order) into K splits, each
writing an fp32 partial tile into a workspace of [splits x split tiles, BLOCK_M, BLOCK_N], and
``splitk_reduce_kernel`` adds the partials in a fixed order (the same bits every run) and
applies the epilogue once. A tail split runs the tiles before ``first_tile`` (whole waves of
SMs) in a launch without SPLIT first, and splits only the last, partial wave's tiles, which then
spread over every SM instead of leaving most of them idle. With SPLIT_FIXUP (either kernel)
there is no reduction launch: each split, once its partial is stored, counts itself in the
tile's counter, and the split that finds the others done adds the SPLIT_K partials in split
order (the same bits whichever finishes last), applies the epilogue and zeroes the counter for
the next launch. A small product then costs one launch instead of two.

Stream-K (``mm_tma_kernel`` with STREAM_K) shares the K steps of the first ``sk_tiles`` tiles
evenly among the persistent programs, each taking one contiguous range of (tile, K step) pairs,
before the remaining tiles run whole: a partial last wave then costs a fraction of a tile per SM,
not a whole tile on a few of them. A program that ends inside a tile hands its fp32 partial over
through the workspace and a flag; the program that finishes the tile adds the partials in program
order (no float atomics: the same bits every run) and applies the epilogue once. Each program works
through its range from the end, so partials go out before anything waits for them.
"""

import triton
import triton.language as tl

from .tiles import (
    accumulate,
    bias_activation,
    column_halves,
    grouped_tile,
    k_loop,
    outer_scales,
    step_scales,
    store_epilogue,
    widen,
)
from .tma import load_operand, operand_descriptor, store_tile


@triton.jit
def work_unit(unit, first_tile, M, N, K, k_per_split, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """(tile of C, first K index, K length) of work unit ``unit`` (also a split's workspace
    slot). Whole tiles: tile ``first_tile + unit``, all of K. SPLIT: every tile from
    ``first_tile`` on is cut into K splits of ``k_per_split``, and units run split-major, so
    neighbouring programs read neighbouring tiles' same K range (L2 reuse)."""
    if SPLIT:
        split_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) - first_tile
        k_start = unit // split_tiles * k_per_split
        return first_tile + unit % split_tiles, k_start, tl.minimum(k_per_split, K - k_start)
    else:
        return first_tile + unit, unit * 0, K


@triton.jit
def store_partial(acc, ws_ptr, slot, offs_m, offs_n, M, N,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """Store a K split's fp32 partial tile into its workspace slot (rows and columns past M and
    N are not stored, nor read back). Tiles go out in slices of at most 64 columns: moving a
    whole fp32 tile out of the tensor cores' layout would take as much shared memory as the
    pipeline's buffers."""
    ws_tile = ws_ptr + widen(slot, INDEX_64) * (BLOCK_M * BLOCK_N)
    store_partial_slice(acc, ws_tile, 0, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, BLOCK_N)


@triton.jit
def store_partial_slice(acc, ws_tile, first, offs_m, offs_n, M, N, BLOCK_M: tl.constexpr,
                        COLUMNS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store columns [first, first + COLUMNS) of a partial tile (halving wider slices)."""
    if COLUMNS > 64:
        half: tl.constexpr = COLUMNS // 2
        acc0, acc1 = column_halves(acc, BLOCK_M, COLUMNS)
        offs0, offs1 = tl.split(tl.reshape(offs_n, (2, half)).permute(1, 0))
        store_partial_slice(acc0, ws_tile, first, offs_m, offs0, M, N, BLOCK_M, half, BLOCK_N)
        store_partial_slice(acc1, ws_tile, first + half, offs_m, offs1, M, N, BLOCK_M, half,
                            BLOCK_N)
    else:
        ptrs = (ws_tile + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
                + (first + tl.arange(0, COLUMNS))[None, :])
        tl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def load_partial(ws_ptr, slot, offs_m, offs_n, M, N, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """The fp32 partial tile ``store_partial`` stored in workspace slot ``slot`` (zeros past M
    and N, which were not stored)."""
    ws_tile = ws_ptr + widen(slot, INDEX_64) * (BLOCK_M * BLOCK_N)
    ptrs = ws_tile + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return tl.load(ptrs, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0)


@triton.jit
def finish_split_tile(ws_ptr, counts_ptr, c_ptr, bias_ptr, unit, first_tile, offs_m, offs_n,
                      M, N, stride_cm, stride_cn, stride_bias, HAS_BIAS: tl.constexpr,
                      ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr, C_ALIGN: tl.constexpr):
    """After K split ``unit`` stored its partial (store_partial): count it in its tile's
    counter (a release, after every thread's stores); the split that brings the count to
    SPLIT_K adds the tile's partials in split order, zeroes the counter (the next launch finds
    it so) and runs the epilogue once. No split waits for another."""
    split_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) - first_tile
    index = unit % split_tiles
    tl.debug_barrier()
    arrived = tl.atomic_add(counts_ptr + index, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        tl.debug_barrier()
        acc = load_partial(ws_ptr, index, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, INDEX_64)
        for split in tl.static_range(1, SPLIT_K):
            acc += load_partial(ws_ptr, split * split_tiles + index, offs_m, offs_n, M, N,
                                BLOCK_M, BLOCK_N, INDEX_64)
        tl.atomic_xchg(counts_ptr + index, 0, sem="relaxed", scope="gpu")
        store_epilogue(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                       stride_bias, HAS_BIAS, ACTIVATION, C_ALIGN)


@triton.jit
def stream_k_owner(iteration, iterations, programs):
    """The program whose stream-K range holds ``iteration`` of ``iterations`` (program p takes
    [p * iterations // programs, (p + 1) * iterations // programs))."""
    return ((iteration + 1) * programs - 1) // iterations


@triton.jit
def publish_partial(acc, ws_ptr, locks_ptr, program, offs_m, offs_n, M, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """Hand a stream-K partial tile to the program that finishes the tile: store it in this
    program's workspace slot, then raise the program's flag (a release, after every thread's
    stores)."""
    store_partial(acc, ws_ptr, program, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, INDEX_64)
    tl.debug_barrier()
    tl.atomic_xchg(locks_ptr + program, 1, sem="release", scope="gpu")


@triton.jit
def collect_partials(acc, ws_ptr, locks_ptr, iteration, end, iterations, programs, offs_m,
                     offs_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     INDEX_64: tl.constexpr):
    """acc plus the partials of the programs whose ranges hold stream-K iterations
    [iteration, end), added in program order once each program's flag is up (programs with
    empty ranges, when there are fewer iterations than programs, hold none and are skipped);
    the flags are lowered again for the next launch. The programs of a stream-K launch are all
    resident (one per SM), and the earlier ones started first, so the wait ends."""
    while iteration < end:
        program = stream_k_owner(iteration, iterations, programs)
        while tl.atomic_cas(locks_ptr + program, 1, 0, sem="acquire", scope="gpu") != 1:
            pass
        tl.debug_barrier()
        acc += load_partial(ws_ptr, program, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, INDEX_64)
        iteration = (program + 1) * iterations // programs
    return acc


@triton.jit(do_not_specialize=["M", "first_tile", "units", "sk_tiles"])
def mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, locks_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    k_per_split, first_tile, units, sk_tiles,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT: tl.constexpr, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
    SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_FIXUP: tl.constexpr, SPLIT_K: tl.constexpr, A_M_ALIGN: tl.constexpr,
    A_K_ALIGN: tl.constexpr, B_K_ALIGN: tl.constexpr, B_N_ALIGN: tl.constexpr,
    M_ALIGN: tl.constexpr, N_ALIGN: tl.constexpr, N_ODD: tl.constexpr = False,
    C_ALIGN: tl.constexpr = 1, PDL: tl.constexpr = False, SPLIT_INLINE: tl.constexpr = False,
):
    # One program computes one work unit (see work_unit; the grid has ``units`` programs): a
    # [BLOCK_M, BLOCK_N] tile of C, or one K split of one. Tiles go in GROUP_M-row bands for L2
    # reuse. The K loop streams A and B tiles through a num_stages-deep software pipeline into
    # an fp32 accumulator; the epilogue adds bias, applies the activation and casts to C's
    # dtype (a split stores its fp32 partial instead). Rows and columns past M / N are read
    # wrapped (modulo) so the loads need no masks, and only the stores are masked. M is not
    # specialised on: a serving loop's every batch size reuses one compiled kernel. SPLIT_FIXUP:
    # the last of a tile's SPLIT_K splits to finish adds the partials and runs the epilogue
    # (finish_split_tile), counting in locks_ptr. (sk_tiles serves the TMA kernel's stream-K,
    # which this kernel does not run.) M_ALIGN / N_ALIGN: powers of two dividing M / N (1:
    # nothing known beyond Triton's own specialisation), so that the wrapped rows (columns)
    # stay contiguous in runs of that many and an operand contiguous along M (N) loads in
    # vectors (tuning.size_alignment). N_ODD: B is contiguous along N and N is odd, so no run of
    # wrapped columns is known contiguous and Triton, seeing neither of B's dimensions
    # contiguous, lays its loads out down K (each thread of a warp on another row: on an H100
    # 2536x965x64 with B row-major ran 2.5x cuBLAS's time); claiming runs of 2 (wrong only at
    # the wrap; with no divisibility claimed the loads stay scalar, so nothing is read as a
    # vector across it) lays them along N. C_ALIGN: see store_epilogue. PDL: launched with
    # programmatic dependent launch (see dependent_launch_wait). SPLIT_INLINE: a K split's work
    # in one launch (eager calls, where a second launch costs the host more than the split
    # saves), unscaled: program ``unit`` runs tile ``unit``, and from ``first_tile`` on adds its
    # K splits' sums in split order as splitk_reduce_kernel adds their partials: the same bits.
    unit = tl.program_id(axis=0)
    if SPLIT_INLINE:
        tile, k_start, k_len = unit, 0, K
    else:
        tile, k_start, k_len = work_unit(unit, first_tile, M, N, K, k_per_split, BLOCK_M,
                                         BLOCK_N, SPLIT)
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = widen(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
    offs_n = widen(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
    k_start = widen(k_start, INDEX_64)
    rows = offs_m % M
    cols = offs_n % N
    if M_ALIGN > 1:
        rows = tl.max_contiguous(tl.multiple_of(rows, M_ALIGN), M_ALIGN)
    if N_ALIGN > 1:
        cols = tl.max_contiguous(tl.multiple_of(cols, N_ALIGN), N_ALIGN)
    if N_ODD:
        cols = tl.max_contiguous(cols, 2)
    dependent_launch_wait(PDL)
    if SPLIT_INLINE:
        # The first split's K, or all of it (whole tiles); zero plus the first split's sum is
        # that sum (16-bit operands: a sum from a +0 accumulator is never -0).
        k_len = tl.where(tile >= first_tile, k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for split in range(0, tl.cdiv(K, k_len)):
            # Whole BLOCK_K steps from the start: told, the loads of a K-contiguous operand
            # stay aligned vectors, software-pipelined.
            k_split = widen(tl.multiple_of(split * k_len, BLOCK_K), INDEX_64)
            acc += k_loop(
                a_ptr + k_split * stride_ak, b_ptr + k_split * stride_bk, rows, cols, k_split,
                tl.minimum(k_len, K - k_split), stride_am, stride_ak, stride_bk, stride_bn,
                sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
                BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
                SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, A_M_ALIGN, A_K_ALIGN, B_K_ALIGN,
                B_N_ALIGN,
            )
    else:
        acc = k_loop(
            a_ptr + k_start * stride_ak, b_ptr + k_start * stride_bk, rows, cols, k_start,
            k_len, stride_am, stride_ak, stride_bk, stride_bn,
            sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
            SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, A_M_ALIGN, A_K_ALIGN, B_K_ALIGN, B_N_ALIGN,
        )
    dependent_launch_trigger(PDL)
    acc = outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn, SCALING)
    if SPLIT:
        store_partial(acc, ws_ptr, unit, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, INDEX_64)
        if SPLIT_FIXUP:
            finish_split_tile(ws_ptr, locks_ptr, c_ptr, bias_ptr, unit, first_tile, offs_m,
                              offs_n, M, N, stride_cm, stride_cn, stride_bias, HAS_BIAS,
                              ACTIVATION, SPLIT_K, BLOCK_M, BLOCK_N, INDEX_64, C_ALIGN)
    else:
        store_epilogue(
            acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION, C_ALIGN,
        )


# Triton's griddepcontrol intrinsics (3.4 on): older releases launch without PDL.
DEPENDENT_LAUNCH_AVAILABLE = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


@triton.jit
def dependent_launch_wait(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL, sm_90+), a kernel may start while the one
    before it on the stream is finishing, to overlap its launch and set-up with that kernel's
    tail; it must wait for that kernel to finish (and its writes to show) before touching
    memory, here. tgemm launches single-wave GEMMs (the persistent TMA kernel always is one)
    and split-K reductions so (tuning.dependent_launch), where the launch costs about as much
    as the work."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def dependent_launch_trigger(PDL: tl.constexpr):
    """With PDL: let the next kernel on the stream start launching (each program calls this
    once its main loop is done: the next kernel's programs, which wait for this one to finish,
    then only overlap the epilogue, not take SMs this one still needs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def tma_k_steps(acc, a_desc, b_desc, off_m, off_n, k, steps, sa_ptr, sb_ptr, rows, cols, K,
                stride_sam, stride_sak, stride_sbk, stride_sbn,
                A_M_CONTIGUOUS: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr,
                SCALING: tl.constexpr, SA_ROWS: tl.constexpr, SB_COLS: tl.constexpr,
                FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus ``steps`` K steps of one tile from K index k on, A and B tiles through TMA."""
    for _ in range(steps):
        a = load_operand(a_desc, off_m, k, A_M_CONTIGUOUS)
        b = load_operand(b_desc, k, off_n, B_K_CONTIGUOUS)
        sa, sb = step_scales(sa_ptr, sb_ptr, rows, cols, k, K, stride_sam, stride_sak,
                             stride_sbk, stride_sbn, SCALING, SA_ROWS, SB_COLS)
        acc = accumulate(acc, a, b, sa, sb, INPUT_PRECISION, UPCAST_TO_FP32, SCALING, FAST_ACCUM)
        k += BLOCK_K
    return acc


@triton.jit
def store_c(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, offs_m, offs_n, M, N,
            stride_cm, stride_cn, stride_bias, HAS_BIAS: tl.constexpr,
            ACTIVATION: tl.constexpr, C_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_ALIGN: tl.constexpr):
    """The epilogue of a finished tile: bias and activation in fp32, cast, store by TMA in
    EPILOGUE_SUBTILE column slices (or with masked pointers when C cannot be described)."""
    if C_TMA:
        acc = bias_activation(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS, ACTIVATION)
        store_tile(c_desc, acc.to(c_ptr.dtype.element_ty), off_m, off_n, BLOCK_M, BLOCK_N,
                   EPILOGUE_SUBTILE)
    else:
        store_epilogue(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                       stride_bias, HAS_BIAS, ACTIVATION, C_ALIGN)


# TMA reads the operands whatever their sizes and (16-byte multiple) pitches: none of them is
# specialised on, so one compiled kernel serves every shape of a layout.
@triton.jit(do_not_specialize=["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                               "stride_cm", "k_per_split", "first_tile", "units", "sk_tiles"])
def mm_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, locks_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    k_per_split, first_tile, units, sk_tiles,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT: tl.constexpr, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
    SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    A_M_CONTIGUOUS: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr, C_TMA: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_FIXUP: tl.constexpr, SPLIT_K: tl.constexpr,
    C_ALIGN: tl.constexpr = 1, PDL: tl.constexpr = False,
    HOST_DESCRIPTORS: tl.constexpr = False, c_host_desc=None,
):
    # Persistent: one program per SM, each looping over the ``units`` work units (see
    # work_unit) in L2-grouped order, stepping by the number of programs, so no wave of
    # programs is left half-empty and one unit's epilogue overlaps the next unit's first loads.
    # Every unit runs the same number of K steps, which lets Triton flatten the loop nest into
    # one software pipeline. A and B tiles arrive by TMA (zero-filled past the edges, so no
    # masks; a split's last steps may pass K) through num_stages buffers, optionally with
    # producer/consumer warp specialization. The epilogue adds bias and applies the activation
    # in fp32, casts, and stores by TMA in EPILOGUE_SUBTILE column slices (or with masked
    # pointers when C cannot be described; an fp32 partial for a split).
    # STREAM_K: before its work units, each program takes its share of the K steps of tiles
    # [0, sk_tiles) (see the module docstring); the work units are then the tiles after them.
    # SPLIT_FIXUP: the last of a tile's SPLIT_K splits to finish adds the partials and runs
    # the epilogue (finish_split_tile, through pointer stores), counting in locks_ptr.
    # The runtime arguments match mm_kernel's, so both launch from one argument tuple.
    # HOST_DESCRIPTORS: a_ptr and b_ptr are the operands' descriptors as the launcher built
    # them on the host, and c_host_desc C's (with C_TMA), described as below; building them
    # here costs each program about 0.8 us per descriptor before its first load (c_host_desc
    # stays the last parameter: the launcher appends it after the others).
    # PDL: launched with programmatic dependent launch (see dependent_launch_wait); it waits
    # before building descriptors too, which Triton writes to scratch memory that the kernel
    # before may still be reading (the allocator reuses it in stream order). Each program lets
    # the next kernel launch once its last unit's main loop is done.
    dependent_launch_wait(PDL)
    start = tl.program_id(axis=0)
    programs = tl.num_programs(axis=0)
    if HOST_DESCRIPTORS:
        a_desc = a_ptr
        b_desc = b_ptr
        c_desc = c_host_desc
    else:
        a_desc = operand_descriptor(a_ptr, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K,
                                    A_M_CONTIGUOUS)
        b_desc = operand_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N,
                                    B_K_CONTIGUOUS)
        c_desc = c_ptr
        if C_TMA:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                               block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SUBTILE])
    if STREAM_K:
        k_tiles_all = tl.cdiv(K, BLOCK_K)
        # (tile, K step) pairs in int64: times the program count they may pass 2**31.
        iterations = widen(sk_tiles, True) * k_tiles_all
        # This program's range of (tile, K step) pairs, worked through from its end: its last
        # tile's partial goes out first, so the program finishing that tile never waits for
        # this one's other work, and the tile this program finishes comes last.
        first = start * iterations // programs
        end = (start + 1) * iterations // programs
        while end > first:
            tile = ((end - 1) // k_tiles_all).to(tl.int32)
            tile_start = widen(tile, True) * k_tiles_all
            begin = tl.maximum(first, tile_start)
            k_first = (begin - tile_start).to(tl.int32)
            k_last = (end - tile_start).to(tl.int32)
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            offs_m = widen(off_m + tl.arange(0, BLOCK_M), INDEX_64)
            offs_n = widen(off_n + tl.arange(0, BLOCK_N), INDEX_64)
            rows = offs_m % M
            cols = offs_n % N
            acc = tma_k_steps(
                tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_desc, b_desc, off_m, off_n,
                k_first * BLOCK_K, k_last - k_first, sa_ptr, sb_ptr, rows, cols, K,
                stride_sam, stride_sak, stride_sbk, stride_sbn, A_M_CONTIGUOUS, B_K_CONTIGUOUS,
                INPUT_PRECISION, UPCAST_TO_FP32, SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, BLOCK_K)
            if k_last < k_tiles_all:
                publish_partial(acc, ws_ptr, locks_ptr, start, offs_m, offs_n, M, N,
                                BLOCK_M, BLOCK_N, INDEX_64)
            else:
                acc = collect_partials(acc, ws_ptr, locks_ptr, tile_start, begin, iterations,
                                       programs, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N,
                                       INDEX_64)
                acc = outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn,
                                   SCALING)
                store_c(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, offs_m, offs_n, M, N,
                        stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, C_TMA,
                        EPILOGUE_SUBTILE, BLOCK_M, BLOCK_N, C_ALIGN)
            end = begin
    k_tiles = tl.cdiv(k_per_split, BLOCK_K)
    # Not flattened with SPLIT_FIXUP: Triton 3.6's nested-loop fusion fails on the finishing
    # split's branch (an scf.if verifier error while compiling for sm_90).
    for unit in tl.range(start, units, programs, flatten=not SPLIT_FIXUP,
                         warp_specialize=WARP_SPECIALIZE):
        tile, k, _ = work_unit(unit, first_tile, M, N, K, k_per_split, BLOCK_M, BLOCK_N, SPLIT)
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = widen(off_m + tl.arange(0, BLOCK_M), INDEX_64)
        offs_n = widen(off_n + tl.arange(0, BLOCK_N), INDEX_64)
        rows = offs_m % M  # scale lookups of edge tiles stay inside the scale tensors
        cols = offs_n % N
        acc = tma_k_steps(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_desc, b_desc, off_m, off_n, k,
            k_tiles, sa_ptr, sb_ptr, rows, cols, K, stride_sam, stride_sak, stride_sbk,
            stride_sbn, A_M_CONTIGUOUS, B_K_CONTIGUOUS, INPUT_PRECISION, UPCAST_TO_FP32,
            SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, BLOCK_K)
        if PDL:
            if unit + programs >= units:  # this program's last unit
                dependent_launch_trigger(PDL)
        acc = outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn, SCALING)
        if SPLIT:
            store_partial(acc, ws_ptr, unit, offs_m, offs_n, M, N, BLOCK_M, BLOCK_N, INDEX_64)
            if SPLIT_FIXUP:
                finish_split_tile(ws_ptr, locks_ptr, c_ptr, bias_ptr, unit, first_tile, offs_m,
                                  offs_n, M, N, stride_cm, stride_cn, stride_bias, HAS_BIAS,
                                  ACTIVATION, SPLIT_K, BLOCK_M, BLOCK_N, INDEX_64, C_ALIGN)
        else:
            store_c(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, offs_m, offs_n, M, N,
                    stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, C_TMA,
                    EPILOGUE_SUBTILE, BLOCK_M, BLOCK_N, C_ALIGN)


@triton.jit(do_not_specialize=["first_tile"])
def splitk_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, M, N, stride_cm, stride_cn, stride_bias, first_tile,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT_K: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_ALIGN: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    # One program sums the SPLIT_K fp32 partials of one [BLOCK_M, BLOCK_N] block of one split
    # [TILE_M, TILE_N] tile of C (the GEMM's tiles, in its order) in split order (deterministic:
    # no atomics), then runs the epilogue (bias, activation, cast, masked store) once. SPLIT_K
    # is a constant so that the loop unrolls and every partial's load is in flight at once: a
    # runtime loop waited for each load in turn (128x128x32768, 60 splits: 0.78x cuBLAS
    # against 0.92x).
    pid = tl.program_id(axis=0)
    blocks_n: tl.constexpr = TILE_N // BLOCK_N
    blocks: tl.constexpr = (TILE_M // BLOCK_M) * blocks_n
    index = pid // blocks
    block = pid % blocks
    pid_m, pid_n = grouped_tile(first_tile + index, M, N, TILE_M, TILE_N, GROUP_M)
    in_m = (block // blocks_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_n = (block % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = widen(pid_m * TILE_M + in_m, INDEX_64)
    offs_n = widen(pid_n * TILE_N + in_n, INDEX_64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile_size: tl.constexpr = TILE_M * TILE_N
    ptrs = ws_ptr + widen(index, INDEX_64) * tile_size + in_m[:, None] * TILE_N + in_n[None, :]
    split_tiles = tl.cdiv(M, TILE_M) * tl.cdiv(N, TILE_N) - first_tile
    split_stride = widen(split_tiles, INDEX_64) * tile_size
    dependent_launch_wait(PDL)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + split * split_stride, mask=mask, other=0.0)
    dependent_launch_trigger(PDL)
    store_epilogue(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                   HAS_BIAS, ACTIVATION, C_ALIGN)
