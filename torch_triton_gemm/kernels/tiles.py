"""Pieces every tgemm kernel is built from: tile order, the K loop, the epilogue.

The mm, grouped and scaled kernels compose these helpers and switch behaviour with
``tl.constexpr`` flags instead of carrying their own copies.
"""

import triton
import triton.language as tl

# Activation names understood by ``apply_activation``; the ops validate against this tuple.
ACTIVATIONS = ("none", "relu", "gelu", "silu", "leaky_relu")
LEAKY_RELU_SLOPE = tl.constexpr(0.01)  # torch.nn.functional.leaky_relu's default
GELU_TANH_COEFF = tl.constexpr(0.044715)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# K elements per scale of the blockwise fp8 recipe (1x128 and 128x128 blocks, as torch._scaled_mm).
BLOCK_SCALE_K = tl.constexpr(128)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a linear program id to a (tile row, tile column) pair.

    Programs run in column-major order within bands of GROUP_M tile rows, so the B tiles a band
    reads stay in L2 while its A rows are reused across the band (the tutorial's L2 grouping).
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def column_halves(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """The left and right halves of a [ROWS, COLUMNS] tile."""
    return tl.split(tl.reshape(x, (ROWS, 2, COLUMNS // 2)).permute(0, 2, 1))


@triton.jit
def widen(x, INDEX_64: tl.constexpr):
    """Promote an index (tensor, runtime scalar or specialised constant) to int64 when asked.

    Offsets into tensors of 2**31 elements or more would wrap in int32 arithmetic.
    """
    if INDEX_64:
        return x + tl.full([], 0, tl.int64)
    else:
        return x


@triton.jit
def dot_tile(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr):
    """acc += a @ b with fp32 accumulation.

    UPCAST_TO_FP32 is set only under Triton's CPU interpreter, whose bf16 dot multiplies the raw
    bit patterns; an fp32 dot of the widened tiles is exact there.
    """
    if UPCAST_TO_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def step_scales(sa_ptr, sb_ptr, rows, cols, k, k_end, stride_sam, stride_sak, stride_sbk,
                stride_sbn, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
                SB_COLS: tl.constexpr):
    """The scales of the K step starting at k under the "block" recipe: scale_a of each row
    (per SA_ROWS rows) and scale_b of each column (per SB_COLS columns) for K block k // 128.
    Steps at or past ``k_end`` (a split's last steps may pass K; their operands read as zeros)
    get zero scales. Other recipes load nothing.

    ``k_loop`` (the pointer loaders) loads them one step ahead for tiles of 64 rows or more: a
    step's product waits for its scales, and Triton's pipeliner stages only the loads that feed
    a dot, so loads issued in the step that uses them stall it for their whole latency (H100,
    blockwise plans on 64- and 128-row tiles at M = 128-512: 1.1-1.3x faster). Not for 16-row
    tiles (many programs per SM hide the latency; gate_up at M = 16 ran 0.94x with it), nor in
    the TMA kernel's loop, flattened across tiles (a split 128x128 plan ran 6.7x slower).
    """
    if SCALING == "block":
        kb = k // BLOCK_SCALE_K
        sa = tl.load(sa_ptr + (rows // SA_ROWS) * stride_sam + kb * stride_sak,
                     mask=rows * 0 + k < k_end, other=0.0)
        sb = tl.load(sb_ptr + kb * stride_sbk + (cols // SB_COLS) * stride_sbn,
                     mask=cols * 0 + k < k_end, other=0.0)
        return sa, sb
    else:
        return 0.0, 0.0


@triton.jit
def accumulate(acc, a, b, sa, sb, INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr,
               SCALING: tl.constexpr, FAST_ACCUM: tl.constexpr):
    """acc += the product of one K step's tiles a and b, scaled as SCALING says:

    - "none": plain products (unscaled GEMMs; fp8 accumulates at the tensor cores' precision);
    - "outer": fp8 with per-row / per-column scales applied after the loop (``outer_scales``);
      without FAST_ACCUM each step's product is added in fp32, so the tensor cores' reduced-
      precision fp8 sums span one step, not the whole K loop;
    - "block": scales per 128 elements of K, the step's ``step_scales`` (sa per row, sb per
      column), applied to each step's product; BLOCK_K must divide 128.
    """
    if SCALING == "block":
        return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])
    elif SCALING == "outer" and not FAST_ACCUM:
        return acc + tl.dot(a, b)
    else:
        return dot_tile(a, b, acc, INPUT_PRECISION, UPCAST_TO_FP32)


@triton.jit
def outer_scales(acc, sa_ptr, sb_ptr, rows, cols, stride_sam, stride_sbn,
                 SCALING: tl.constexpr):
    """Apply per-row scales of a and per-column scales of b (stride 0: one scale each) to the
    accumulated tile when SCALING is "outer"; other recipes pass acc through."""
    if SCALING == "outer":
        sa = tl.load(sa_ptr + rows * stride_sam)
        sb = tl.load(sb_ptr + cols * stride_sbn)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def k_loop(
    a_ptr, b_ptr, offs_m, offs_n, k_start, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    SCALING: tl.constexpr, SA_ROWS: tl.constexpr, SB_COLS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, A_M_ALIGN: tl.constexpr, A_K_ALIGN: tl.constexpr,
    B_K_ALIGN: tl.constexpr, B_N_ALIGN: tl.constexpr,
):
    """Accumulate one [BLOCK_M, BLOCK_N] tile of A[offs_m, k_start:k_start+K] @
    B[k_start:k_start+K, offs_n] in fp32 (a_ptr and b_ptr point at column / row k_start).

    offs_m / offs_n must already point at valid rows / columns (callers wrap them modulo M / N),
    so only K needs masking: the full BLOCK_K steps run unmasked and software-pipelined, and
    masked steps of TAIL_K handle the remainder when K is not a multiple of BLOCK_K. Each step
    goes through ``accumulate`` (scaled recipes included).

    The *_ALIGN constants are elements by which the strides are known multiples beyond what
    Triton specialises on itself (``tuning.pitch_alignment``; 1: nothing more): a pitch of 8
    bf16 elements is not a multiple of 16, so without the hint every load is scalar and unpipelined.
    """
    a_rows = offs_m * stride_am
    b_cols = offs_n * stride_bn
    if A_M_ALIGN > 1:
        a_rows = tl.multiple_of(a_rows, A_M_ALIGN)
    if B_N_ALIGN > 1:
        b_cols = tl.multiple_of(b_cols, B_N_ALIGN)
    a_ptrs, b_ptrs = k_step_pointers(a_ptr, b_ptr, a_rows, b_cols, stride_ak, stride_bk, BLOCK_K,
                                     INDEX_64, A_K_ALIGN, B_K_ALIGN)
    a_step = BLOCK_K * widen(stride_ak, INDEX_64)
    b_step = BLOCK_K * widen(stride_bk, INDEX_64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = k_start + K
    k_full = K // BLOCK_K
    # Blockwise scales of 64+-row tiles are loaded a step ahead (see ``step_scales``).
    PREFETCH: tl.constexpr = SCALING == "block" and BLOCK_M >= 64
    if PREFETCH:
        sa, sb = step_scales(sa_ptr, sb_ptr, offs_m, offs_n, k_start, k_end, stride_sam,
                             stride_sak, stride_sbk, stride_sbn, SCALING, SA_ROWS, SB_COLS)
    for step in range(0, k_full):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if PREFETCH:
            sa_next, sb_next = step_scales(sa_ptr, sb_ptr, offs_m, offs_n,
                                           k_start + (step + 1) * BLOCK_K, k_end, stride_sam,
                                           stride_sak, stride_sbk, stride_sbn, SCALING,
                                           SA_ROWS, SB_COLS)
            acc = accumulate(acc, a, b, sa, sb, INPUT_PRECISION, UPCAST_TO_FP32, SCALING,
                             FAST_ACCUM)
            sa, sb = sa_next, sb_next
        else:
            sa_step, sb_step = step_scales(sa_ptr, sb_ptr, offs_m, offs_n,
                                           k_start + step * BLOCK_K, k_end, stride_sam,
                                           stride_sak, stride_sbk, stride_sbn, SCALING,
                                           SA_ROWS, SB_COLS)
            acc = accumulate(acc, a, b, sa_step, sb_step, INPUT_PRECISION, UPCAST_TO_FP32,
                             SCALING, FAST_ACCUM)
        a_ptrs += a_step
        b_ptrs += b_step
    k_left = K - k_full * BLOCK_K
    # The remainder in masked steps of TAIL_K. With K not a multiple of 16 its loads are scalar,
    # a register an element until the dot, and one BLOCK_K step of them spilled on sm_90 (README,
    # "K's remainder in steps sized to the tile"). The step is the longest of BLOCK_K,
    # BLOCK_K / 2, ... whose loads plus half the accumulator fit 84 values a thread of 4 warps
    # (where Triton 3.6's builds of the plan-space tiles stop spilling), at least 16, so small
    # tiles keep one step. fp8 steps 32 on every tile: its tensor cores round within a dot, so
    # plans sharing BLOCK_K (an eager call's and a compiled one's) must cut K alike. The tail
    # lies within one scale block (BLOCK_K divides 128).
    TAIL_LIMIT: tl.constexpr = (84 * 128 - BLOCK_M * BLOCK_N // 2) // (BLOCK_M + BLOCK_N)
    TAIL_FIT: tl.constexpr = (
        BLOCK_K if BLOCK_K <= TAIL_LIMIT else BLOCK_K // 2 if BLOCK_K // 2 <= TAIL_LIMIT
        else BLOCK_K // 4 if BLOCK_K // 4 <= TAIL_LIMIT
        else BLOCK_K // 8 if BLOCK_K // 8 <= TAIL_LIMIT else BLOCK_K // 16)
    TAIL_STEP: tl.constexpr = (32 if a_ptr.dtype.element_ty.primitive_bitwidth == 8
                               else TAIL_FIT if TAIL_FIT >= 16 else 16)
    TAIL_K: tl.constexpr = TAIL_STEP if TAIL_STEP < BLOCK_K else BLOCK_K
    if k_left > 0:
        if not PREFETCH:
            sa, sb = step_scales(sa_ptr, sb_ptr, offs_m, offs_n, k_start + k_full * BLOCK_K,
                                 k_end, stride_sam, stride_sak, stride_sbk, stride_sbn,
                                 SCALING, SA_ROWS, SB_COLS)
        a_tail, b_tail = k_step_pointers(a_ptr, b_ptr, a_rows, b_cols, stride_ak, stride_bk,
                                         TAIL_K, INDEX_64, A_K_ALIGN, B_K_ALIGN)
        a_tail += k_full * a_step
        b_tail += k_full * b_step
        offs_t = tl.arange(0, TAIL_K)
        for k in range(0, k_left, TAIL_K):
            a = tl.load(a_tail, mask=offs_t[None, :] < k_left - k, other=0.0)
            b = tl.load(b_tail, mask=offs_t[:, None] < k_left - k, other=0.0)
            acc = accumulate(acc, a, b, sa, sb, INPUT_PRECISION, UPCAST_TO_FP32, SCALING,
                             FAST_ACCUM)
            a_tail += TAIL_K * widen(stride_ak, INDEX_64)
            b_tail += TAIL_K * widen(stride_bk, INDEX_64)
    return acc


@triton.jit
def k_step_pointers(a_ptr, b_ptr, a_rows, b_cols, stride_ak, stride_bk, STEP_K: tl.constexpr,
                    INDEX_64: tl.constexpr, A_K_ALIGN: tl.constexpr, B_K_ALIGN: tl.constexpr):
    """Pointers to the first STEP_K columns of A's rows (offsets ``a_rows``) and the first
    STEP_K rows of B's columns (offsets ``b_cols``), with the K strides' alignment hints."""
    offs_k = widen(tl.arange(0, STEP_K), INDEX_64)
    a_cols, b_rows = offs_k * stride_ak, offs_k * stride_bk
    if A_K_ALIGN > 1:
        a_cols = tl.multiple_of(a_cols, A_K_ALIGN)
    if B_K_ALIGN > 1:
        b_rows = tl.multiple_of(b_rows, B_K_ALIGN)
    return (a_ptr + (a_rows[:, None] + a_cols[None, :]),
            b_ptr + (b_rows[:, None] + b_cols[None, :]))


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    """Elementwise activation on an fp32 tile; names as in ``ACTIVATIONS``."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        # tanh approximation; tanh(u) = 2 * sigmoid(2u) - 1 keeps to portable math functions.
        u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x)
        x = x * tl.sigmoid(2.0 * u)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    elif ACTIVATION == "leaky_relu":
        x = tl.where(x >= 0.0, x, LEAKY_RELU_SLOPE * x)
    return x


@triton.jit
def activation_and_grad(x, ACTIVATION: tl.constexpr):
    """act(x) and act'(x) on an fp32 tile, for "silu" and "gelu" (tanh approximation, as
    ``apply_activation``): the gated MLPs' backward pass."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(x)
        return x * sig, sig * (1.0 + x * (1.0 - sig))
    else:
        u = SQRT_2_OVER_PI * (x + GELU_TANH_COEFF * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh(u)
        du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_COEFF * x * x)
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


@triton.jit
def bias_activation(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS: tl.constexpr,
                    ACTIVATION: tl.constexpr):
    """The fp32 part of every epilogue: add bias (per output column), apply the activation."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return apply_activation(acc, ACTIVATION)


@triton.jit
def store_epilogue(
    acc, c_ptr, bias_ptr, offs_m, offs_n, M, N,
    stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, C_ALIGN: tl.constexpr = 1,
):
    """Add bias (per output column), apply the activation in fp32, cast and store the tile.

    C_ALIGN: a power of two dividing both stride_cm and N (``tuning.store_alignment``; 1:
    nothing known beyond Triton's own specialisation). Triton vectorises a store only where it
    knows each row starts aligned and the mask is constant over the vector; ``offs_n < N``
    says nothing about runs unless N is known to divide by 16, so with an N of, say, 1000 every
    element went out on its own 2-byte store. Comparing runs of C_ALIGN columns instead (the
    same mask when C_ALIGN divides N) lets them go out C_ALIGN elements at a time."""
    acc = bias_activation(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS, ACTIVATION)
    rows = offs_m * stride_cm
    if C_ALIGN > 1:
        rows = tl.multiple_of(rows, C_ALIGN)
        in_n = (offs_n // C_ALIGN) < (N // C_ALIGN)
    else:
        in_n = offs_n < N
    c_ptrs = c_ptr + rows[:, None] + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & in_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
