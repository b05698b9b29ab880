"""The tgemm::mm kernel: C = act(A @ B + bias) for any strides and sizes."""

import triton
import triton.language as tl

from .tiles import grouped_tile, k_loop, store_epilogue, widen


@triton.jit(do_not_specialize=["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT"])
def mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET, LAYOUT,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # One program computes one [BLOCK_M, BLOCK_N] tile of C; programs walk the tiles in
    # GROUP_M-row bands for L2 reuse. The K loop streams A and B tiles through a
    # num_stages-deep software pipeline into an fp32 accumulator; the epilogue adds bias,
    # applies the activation and casts to C's dtype. Rows and columns past M / N are read
    # wrapped (modulo) so the loads need no masks, and only the store is masked.
    # M_BUCKET, N_BUCKET, K_BUCKET and LAYOUT only key the autotuner's cache.
    pid = tl.program_id(axis=0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = widen(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
    offs_n = widen(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
    acc = k_loop(
        a_ptr, b_ptr, offs_m % M, offs_n % N, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
    )
    store_epilogue(
        acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
        HAS_BIAS, ACTIVATION,
    )
