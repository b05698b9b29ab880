"""The microscaled kernel of tgemm::scaled_mm: C = (A * scale_a) @ (B * scale_b) + bias for
mxfp8, mxfp4 and nvfp4 operands (per-32 e8m0 or per-16 e4m3 scales along K).

The fp8 recipes with float32 scales (tensorwise, rowwise, blockwise) run on the shared GEMM
kernels of kernels/matmul.py; this kernel handles the formats whose scales change every 16 or
32 elements of K, two ways chosen by the ``SCALING`` constexpr:

- "micro": without tensor-core support (Hopper and older): each operand tile is decoded (fp4
  nibbles unpacked), multiplied by its per-SCALE_K scales and rounded to bf16 (exact within
  bf16's range: an fp4/fp8 value times a power of two or an e4m3 scale fits bf16's 8
  significant bits), and the tiles go through a bf16 dot with fp32 accumulation.
- "micro_native": the same formats through ``tl.dot_scaled`` (tensor cores on sm_100).

Operand tiles are loaded by small helpers (``load_a_tile`` / ``load_b_tile``) that take the K
offset of the step, so the loop does not carry pointers.
"""

import triton
import triton.language as tl

from .tiles import dot_tile, grouped_tile, store_epilogue, widen

# Bit patterns of fp32 values used when decoding e8m0 scales.
_F32_TWO_POW_MINUS_127 = tl.constexpr(0x00400000)  # e8m0 byte 0 is 2^-127, an fp32 subnormal
_F32_QUIET_NAN = tl.constexpr(0x7FC00000)  # e8m0 byte 255 is NaN


@triton.jit
def load_a_tile(a_ptr, offs_m, k0, k_end, stride_am, stride_ak,
                BLOCK_K: tl.constexpr, MASKED: tl.constexpr, INDEX_64: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile A[offs_m, k0:k0 + BLOCK_K] (K in stored elements: bytes for
    packed fp4). Columns at or past ``k_end`` read as zero when MASKED."""
    offs_k = widen(k0 + tl.arange(0, BLOCK_K), INDEX_64)
    ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if MASKED:
        return tl.load(ptrs, mask=offs_k[None, :] < k_end, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_b_tile(b_ptr, offs_n, k0, k_end, stride_bk, stride_bn,
                BLOCK_K: tl.constexpr, MASKED: tl.constexpr, INDEX_64: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile B[k0:k0 + BLOCK_K, offs_n]; rows at or past ``k_end`` read as
    zero when MASKED."""
    offs_k = widen(k0 + tl.arange(0, BLOCK_K), INDEX_64)
    ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if MASKED:
        return tl.load(ptrs, mask=offs_k[:, None] < k_end, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_k_scales(s_ptr, offs_mn, kb0, kb_end, stride_mn, stride_kb,
                  NUM_KB: tl.constexpr, MASKED: tl.constexpr):
    """The [len(offs_mn), NUM_KB] tile of per-K-block scales s[offs_mn, kb0:kb0 + NUM_KB] in the
    layout ``tl.dot_scaled`` takes for both operands (the B scales too are [N, K blocks])."""
    offs_kb = kb0 + tl.arange(0, NUM_KB)
    ptrs = s_ptr + offs_mn[:, None] * stride_mn + offs_kb[None, :] * stride_kb
    if MASKED:
        return tl.load(ptrs, mask=offs_kb[None, :] < kb_end, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def decode_scale(s, SCALE_FORMAT: tl.constexpr):
    """Scales as fp32: "fp32" as stored, "e8m0" (uint8 exponent bytes) as 2^(byte - 127) with byte
    255 as NaN, "e4m3" (fp8) widened."""
    if SCALE_FORMAT == "e8m0":
        e = s.to(tl.int32)
        bits = tl.where(e == 0, _F32_TWO_POW_MINUS_127, e << 23)
        bits = tl.where(e == 255, _F32_QUIET_NAN, bits)
        return bits.to(tl.float32, bitcast=True)
    else:
        return s.to(tl.float32)


@triton.jit
def e2m1_to_float32(code):
    """fp32 values of 4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit; int32 in [0, 16)).

    Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: codes 2..7 are normal, 2^(e - 1) * (1 + m / 2), whose
    fp32 exponent field is e + 126; code 1 is the subnormal 0.5.
    """
    mag = code & 7
    bits = ((126 + (mag >> 1)) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag == 1, 126 << 23, bits)
    bits = tl.where(mag == 0, 0, bits)
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def unpack_e2m1_along_k(packed, K_AXIS: tl.constexpr):
    """Unpack a uint8 tile holding two e2m1 codes a byte along K (the even K index in the low
    nibble) into an int32 code tile twice as long along K_AXIS (1 for A tiles, 0 for B tiles)."""
    p = packed.to(tl.int32)
    pairs = tl.join(p & 0xF, p >> 4)  # [R, C, 2]: the last axis is the K parity
    if K_AXIS == 1:
        return tl.reshape(pairs, (packed.shape[0], packed.shape[1] * 2))
    else:
        pairs = tl.permute(pairs, (0, 2, 1))
        return tl.reshape(pairs, (packed.shape[0] * 2, packed.shape[1]))


@triton.jit
def dequantize_tile(tile, scales, FORMAT: tl.constexpr, SCALE_FORMAT: tl.constexpr,
                    K_AXIS: tl.constexpr, SCALE_K: tl.constexpr):
    """A microscaled operand tile as bf16: decode the values, multiply each by its scale.

    ``scales`` is [rows, K blocks] for A tiles (K_AXIS = 1) and [columns, K blocks] for B tiles
    (K_AXIS = 0); each scale covers SCALE_K consecutive K elements.
    """
    if FORMAT == "e2m1":
        values = e2m1_to_float32(unpack_e2m1_along_k(tile, K_AXIS))
    else:
        values = tile.to(tl.float32)
    s = decode_scale(scales, SCALE_FORMAT)
    R: tl.constexpr = s.shape[0]
    NUM_KB: tl.constexpr = s.shape[1]
    if K_AXIS == 1:
        s = tl.broadcast_to(s[:, :, None], (R, NUM_KB, SCALE_K))
        s = tl.reshape(s, (R, NUM_KB * SCALE_K))
    else:
        s = tl.broadcast_to(tl.trans(s)[:, None, :], (NUM_KB, SCALE_K, R))
        s = tl.reshape(s, (NUM_KB * SCALE_K, R))
    return (values * s).to(tl.bfloat16)


@triton.jit
def scaled_k_step(
    acc, a_ptr, b_ptr, sa_ptr, sb_ptr, offs_m, offs_n, k0, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    SCALING: tl.constexpr, FORMAT_A: tl.constexpr, FORMAT_B: tl.constexpr,
    SCALE_FORMAT: tl.constexpr, SCALE_K: tl.constexpr, UPCAST_TO_FP32: tl.constexpr,
    BLOCK_K: tl.constexpr, MASKED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Add the scaled products of K elements k0 .. k0 + BLOCK_K to acc."""
    PACK_A: tl.constexpr = 2 if FORMAT_A == "e2m1" else 1
    PACK_B: tl.constexpr = 2 if FORMAT_B == "e2m1" else 1
    a = load_a_tile(a_ptr, offs_m, k0 // PACK_A, K // PACK_A, stride_am, stride_ak,
                    BLOCK_K // PACK_A, MASKED, INDEX_64)
    b = load_b_tile(b_ptr, offs_n, k0 // PACK_B, K // PACK_B, stride_bk, stride_bn,
                    BLOCK_K // PACK_B, MASKED, INDEX_64)
    NUM_KB: tl.constexpr = BLOCK_K // SCALE_K
    kb0 = k0 // SCALE_K
    kb_end = K // SCALE_K
    sa = load_k_scales(sa_ptr, offs_m, kb0, kb_end, stride_sam, stride_sak, NUM_KB, MASKED)
    sb = load_k_scales(sb_ptr, offs_n, kb0, kb_end, stride_sbn, stride_sbk, NUM_KB, MASKED)
    if SCALING == "micro_native":
        acc = tl.dot_scaled(a, sa, FORMAT_A, b, sb, FORMAT_B, acc)
    else:
        a = dequantize_tile(a, sa, FORMAT_A, SCALE_FORMAT, 1, SCALE_K)
        b = dequantize_tile(b, sb, FORMAT_B, SCALE_FORMAT, 0, SCALE_K)
        acc = dot_tile(a, b, acc, None, UPCAST_TO_FP32)
    return acc


@triton.jit
def scaled_mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    SCALING: tl.constexpr, FORMAT_A: tl.constexpr, FORMAT_B: tl.constexpr,
    SCALE_FORMAT: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # One program computes one [BLOCK_M, BLOCK_N] tile of C, programs walking the tiles in
    # GROUP_M-row bands for L2 reuse. The K loop runs full BLOCK_K steps unmasked and one masked
    # step for a remainder; each step loads an A and a B tile and their per-SCALE_K scales and
    # adds their scaled product to an fp32 accumulator. The epilogue adds bias, casts and
    # stores. K counts logical elements (two per byte for fp4); rows and columns past M / N are
    # read wrapped.
    pid = tl.program_id(axis=0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = widen(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
    offs_n = widen(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
    rows = offs_m % M
    cols = offs_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_full = K // BLOCK_K
    for kt in range(0, k_full):
        acc = scaled_k_step(
            acc, a_ptr, b_ptr, sa_ptr, sb_ptr, rows, cols, kt * BLOCK_K, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            stride_sam, stride_sak, stride_sbk, stride_sbn,
            SCALING, FORMAT_A, FORMAT_B, SCALE_FORMAT, SCALE_K, UPCAST_TO_FP32, BLOCK_K, False,
            INDEX_64,
        )
    if k_full * BLOCK_K < K:
        acc = scaled_k_step(
            acc, a_ptr, b_ptr, sa_ptr, sb_ptr, rows, cols, k_full * BLOCK_K, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            stride_sam, stride_sak, stride_sbk, stride_sbn,
            SCALING, FORMAT_A, FORMAT_B, SCALE_FORMAT, SCALE_K, UPCAST_TO_FP32, BLOCK_K, True,
            INDEX_64,
        )
    store_epilogue(
        acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
        HAS_BIAS, "none",
    )
