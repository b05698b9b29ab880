"""The GEMM kernels of tgemm::mm and tgemm::scaled_mm: C = act(A @ B + bias), A and B of any
strides and sizes, unscaled or fp8 with tensor, row or block scales (SCALING).

``mm_kernel`` runs everywhere (any GPU, any alignment, Triton's CPU interpreter); the persistent
``mm_tma_kernel`` is the Hopper path for operands TMA can describe. Both can split K: each split
then writes an fp32 partial tile and ``splitk_reduce_kernel`` adds the partials in a fixed order
(the same bits every run) and applies the epilogue once.
"""

import triton
import triton.language as tl

from .tiles import (
    accumulate,
    bias_activation,
    grouped_tile,
    k_loop,
    outer_scales,
    store_epilogue,
    widen,
)
from .tma import load_operand, operand_descriptor


@triton.jit
def store_partial(acc, ws_ptr, split, offs_m, offs_n, M, N, INDEX_64: tl.constexpr):
    """Store one split's fp32 partial tile into the [SPLIT_K, M, N] workspace."""
    ws_split = ws_ptr + widen(split, INDEX_64) * M * N
    store_epilogue(acc, ws_split, ws_ptr, offs_m, offs_n, M, N, N, 1, 0, False, "none")


@triton.jit(do_not_specialize=["M"])
def mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    k_per_split,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT_K: tl.constexpr, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
    SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # One program computes one [BLOCK_M, BLOCK_N] tile of C over one K split; programs walk the
    # tiles in GROUP_M-row bands for L2 reuse, split-major. The K loop streams A and B tiles
    # through a num_stages-deep software pipeline into an fp32 accumulator; the epilogue adds
    # bias, applies the activation and casts to C's dtype (or, split, stores the fp32 partial).
    # Rows and columns past M / N are read wrapped (modulo) so the loads need no masks, and only
    # the store is masked. M is not specialised on: a serving loop's every batch size reuses one
    # compiled kernel.
    pid = tl.program_id(axis=0)
    tiles_mn = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    split = pid // tiles_mn
    pid_m, pid_n = grouped_tile(pid % tiles_mn, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = widen(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
    offs_n = widen(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
    k_start = widen(split * k_per_split, INDEX_64)
    rows = offs_m % M
    cols = offs_n % N
    acc = k_loop(
        a_ptr + k_start * stride_ak, b_ptr + k_start * stride_bk, rows, cols, k_start,
        tl.minimum(k_per_split, K - k_start),
        stride_am, stride_ak, stride_bk, stride_bn,
        sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
        BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
        SCALING, SA_ROWS, SB_COLS, FAST_ACCUM,
    )
    acc = outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn, SCALING)
    if SPLIT_K > 1:
        store_partial(acc, ws_ptr, split, offs_m, offs_n, M, N, INDEX_64)
    else:
        store_epilogue(
            acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
            HAS_BIAS, ACTIVATION,
        )


@triton.jit(do_not_specialize=["M"])
def mm_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    k_per_split,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT_K: tl.constexpr, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
    SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    A_M_CONTIGUOUS: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr, C_TMA: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Persistent: one program per SM, each looping over work units (tile of C x K split) in
    # L2-grouped order, stepping by the number of programs, so no wave of programs is left
    # half-empty and one unit's epilogue overlaps the next unit's first loads. A and B tiles
    # arrive by TMA (zero-filled past the edges, so no masks) through a software pipeline of
    # num_stages buffers, optionally with producer/consumer warp specialization. The epilogue
    # adds bias and applies the activation in fp32, casts, and stores by TMA in
    # EPILOGUE_SUBTILE column slices (or with masked pointers when C cannot be described; an
    # fp32 partial when K is split).
    # The runtime arguments match mm_kernel's, so both launch from one argument tuple.
    start = tl.program_id(axis=0)
    a_desc = operand_descriptor(a_ptr, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K,
                                A_M_CONTIGUOUS)
    b_desc = operand_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N,
                                B_K_CONTIGUOUS)
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SUBTILE])
    tiles_mn = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(k_per_split, BLOCK_K)
    for unit in tl.range(start, tiles_mn * SPLIT_K, tl.num_programs(axis=0), flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        split = unit // tiles_mn
        pid_m, pid_n = grouped_tile(unit % tiles_mn, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        k = split * k_per_split
        offs_m = widen(off_m + tl.arange(0, BLOCK_M), INDEX_64)
        offs_n = widen(off_n + tl.arange(0, BLOCK_N), INDEX_64)
        rows = offs_m % M  # scale lookups of edge tiles stay inside the scale tensors
        cols = offs_n % N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(k_tiles):
            a = load_operand(a_desc, off_m, k, A_M_CONTIGUOUS)
            b = load_operand(b_desc, k, off_n, B_K_CONTIGUOUS)
            acc = accumulate(acc, a, b, k, sa_ptr, sb_ptr, rows, cols,
                             stride_sam, stride_sak, stride_sbk, stride_sbn, INPUT_PRECISION,
                             UPCAST_TO_FP32, SCALING, SA_ROWS, SB_COLS, FAST_ACCUM)
            k += BLOCK_K
        acc = outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn, SCALING)
        if SPLIT_K > 1:
            store_partial(acc, ws_ptr, split, offs_m, offs_n, M, N, INDEX_64)
        elif C_TMA:
            acc = bias_activation(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS, ACTIVATION)
            c = acc.to(c_ptr.dtype.element_ty)
            if EPILOGUE_SUBTILE == 2:
                c = tl.reshape(c, (BLOCK_M, 2, BLOCK_N // 2)).permute(0, 2, 1)
                c0, c1 = tl.split(c)
                c_desc.store([off_m, off_n], c0)
                c_desc.store([off_m, off_n + BLOCK_N // 2], c1)
            else:
                c_desc.store([off_m, off_n], c)
        else:
            store_epilogue(
                acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                HAS_BIAS, ACTIVATION,
            )


@triton.jit
def splitk_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, M, N, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program sums the SPLIT_K fp32 partials of one [BLOCK_M, BLOCK_N] tile of the
    # [SPLIT_K, M, N] workspace in split order (deterministic: no atomics), then runs the
    # epilogue (bias, activation, cast, masked store) once.
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_m = widen((pid // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
    offs_n = widen((pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    split_stride = widen(M, INDEX_64) * N
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + split * split_stride, mask=mask, other=0.0)
    store_epilogue(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
                   HAS_BIAS, ACTIVATION)
