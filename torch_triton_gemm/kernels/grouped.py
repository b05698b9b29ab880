"""The tgemm::grouped_mm kernels: many GEMMs in one persistent launch.

``grouped_mm_kernel`` serves torch._grouped_mm's forms, where groups are ranges of one dimension
given by cumulative ends ``offs`` read on the device (GROUPED = "m": rows of a 2-D A and of C;
"n": columns of a 2-D B and of C; "k": the contraction of a 2-D A and a 2-D B, one [M, N] output
per group), or the entries of a batch (GROUPED = "none"); with fp8 scales (SCALING) it also
serves torch._scaled_grouped_mm's. ``grouped_mm_list_kernel`` serves independent problems of any
sizes whose addresses, sizes and strides come from a table.

With ROUTE = "gather" (tgemm::moe_mlp, GROUPED = "m"), the rows of the grouped product are
token slots sorted by expert whose rows of A are read through an index (no permuted copy of the
tokens); C's rows are the sorted slots (kernels/combine.py sums them back per token). GATE (an
activation name) makes the tile a gated one: it accumulates columns n of B and their partners
n + N in one dot and stores act(first) * second (SwiGLU and its relatives); given pre_ptr (a
contiguous [M, 2N] buffer, training's saved pre-activations), it stores both halves there too,
before the activation.

Both walk the tiles of all groups the same way; a tile is computed by the shared pieces of
tiles.py (``k_loop`` or ``accumulate``, ``step_scales`` and ``outer_scales`` for scaled products,
``store_epilogue``) with operands loaded through pointers or through the TMA descriptors of tma.py.
What is grouped-specific lives here: group extents from offs, the persistent walk over the groups'
tiles, and the list kernel's problem table.
"""

import triton
import triton.language as tl

from .tiles import (
    accumulate,
    apply_activation,
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

# Columns of the list kernel's problem table (int64, one row per problem).
TABLE_A = tl.constexpr(0)  # addresses of A, B and C
TABLE_B = tl.constexpr(1)
TABLE_C = tl.constexpr(2)
TABLE_M = tl.constexpr(3)  # sizes
TABLE_N = tl.constexpr(4)
TABLE_K = tl.constexpr(5)
TABLE_STRIDE_AM = tl.constexpr(6)  # strides
TABLE_STRIDE_AK = tl.constexpr(7)
TABLE_STRIDE_BK = tl.constexpr(8)
TABLE_STRIDE_BN = tl.constexpr(9)
TABLE_STRIDE_CM = tl.constexpr(10)
TABLE_STRIDE_CN = tl.constexpr(11)
TABLE_COLUMNS = tl.constexpr(12)


# --- group extents ------------------------------------------------------------------------------

# Helpers below take values loaded from offs and rows, never those pointers: PyTorch's analysis of
# what a kernel writes (torch.compile copies each written tensor) takes every result of a helper as
# derived from all its arguments, and a store address derived from a pointer argument would count
# that tensor as written. Loads in the kernel's own body are followed no further.

@triton.jit
def group_end(entry, start, total):
    """Where a group ends along the grouped dimension, given where it starts and its entry of
    offs (cumulative ends).

    The end is clamped into [start, total], so groups never overlap and never leave the tensor
    whatever offs holds: an entry below its predecessor gives an empty group, an entry past the
    end stops at the end.
    """
    return tl.minimum(tl.maximum(entry, start), total)


@triton.jit
def group_problem(entry, start, M, N, K, GROUPED: tl.constexpr):
    """A group's row, column and contraction ranges [m0, m1), [n0, n1), [k0, k1), in the
    coordinates of the full operands, and where it ends along the grouped dimension, from where
    it starts and its entry of offs."""
    m0 = 0
    m1 = M
    n0 = 0
    n1 = N
    k0 = 0
    k1 = K
    end = start
    if GROUPED == "m":
        end = group_end(entry, start, M)
        m0 = start
        m1 = end
    elif GROUPED == "n":
        end = group_end(entry, start, N)
        n0 = start
        n1 = end
    elif GROUPED == "k":
        end = group_end(entry, start, K)
        k0 = start
        k1 = end
    return m0, m1, n0, n1, k0, k1, end


# --- one output tile ------------------------------------------------------------------------------

@triton.jit
def wrapped(start, end, offs, INDEX_64: tl.constexpr):
    """Indices ``start + offs`` of a group's range [start, end), those past its end wrapped
    inside it: they address valid operand rows (or columns) and scales, and are not stored."""
    return widen(start + offs % (end - start), INDEX_64)


@triton.jit
def pointer_tile(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, rows_ptr, pre_ptr, m0, m1, n0, n1,
    k_size, pid_m, pid_n,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr,
    INDEX_64: tl.constexpr, SCALING: tl.constexpr, SA_ROWS: tl.constexpr,
    SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr, ROUTE: tl.constexpr, GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Compute and store tile (pid_m, pid_n) of rows [m0, m1) x columns [n0, n1) of C through
    pointers; a_ptr and b_ptr point at the first contraction index of the problem, sa_ptr and
    sb_ptr at the problem's scales (read as SCALING says, see tiles.py's ``accumulate``; not
    read by unscaled products). ROUTE and GATE gather A's rows through rows_ptr and gate the
    tile (see the module docstring); GATE needs n0 = 0, the partner of column n being n + n1,
    and stores the halves into pre_ptr (row pitch 2 * n1) where it is not None.

    Rows and columns past the range are read wrapped inside it (no load masks) and not stored.
    """
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = wrapped(m0, m1, rows, INDEX_64)
    a_rows = in_rows
    if ROUTE == "gather":
        a_rows = widen(tl.load(rows_ptr + in_rows), INDEX_64)
    # A gated tile accumulates BLOCK_N columns and, beside them, their partners: one dot.
    ACC_N: tl.constexpr = BLOCK_N * (2 if GATE != "none" else 1)
    pair = tl.arange(0, ACC_N)
    in_cols = (wrapped(n0, n1, pid_n * BLOCK_N + pair % BLOCK_N, INDEX_64)
               + widen(n1, INDEX_64) * (pair >= BLOCK_N))
    acc = k_loop(
        a_ptr, b_ptr, a_rows, in_cols, 0, k_size,
        stride_am, stride_ak, stride_bk, stride_bn,
        sa_ptr, sb_ptr, stride_sam, stride_sak, stride_sbk, stride_sbn,
        BLOCK_M, ACC_N, BLOCK_K, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
        SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, 1, 1, 1, 1,
    )
    if GATE != "none":
        gate, up = column_halves(acc, BLOCK_M, ACC_N)
        if pre_ptr is not None:
            pre_rows = widen(m0 + rows, INDEX_64)
            pre_cols = widen(cols, INDEX_64)
            store_epilogue(gate, pre_ptr, pre_ptr, pre_rows, pre_cols, m1, n1, 2 * n1, 1, 0,
                           False, "none")
            store_epilogue(up, pre_ptr + widen(n1, INDEX_64), pre_ptr, pre_rows, pre_cols, m1,
                           n1, 2 * n1, 1, 0, False, "none")
        acc = apply_activation(gate, GATE) * up
    else:
        acc = outer_scales(acc, sa_ptr, sb_ptr, in_rows, in_cols, stride_sam, stride_sbn,
                           SCALING)
    store_epilogue(
        acc, c_ptr, bias_ptr, widen(m0 + rows, INDEX_64), widen(n0 + cols, INDEX_64), m1, n1,
        stride_cm, stride_cn, stride_bias, HAS_BIAS, "none",
    )


# --- kernels ------------------------------------------------------------------------------------

@triton.jit
def grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, offs_ptr, sa_ptr, sb_ptr, rows_ptr, pre_ptr,
    G, M, N, K,
    stride_ag, stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cg, stride_cm, stride_cn,
    stride_bias_g, stride_bias_n,
    stride_sag, stride_sam, stride_sak,
    stride_sbg, stride_sbk, stride_sbn,
    GROUPED: tl.constexpr, ZERO_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALING: tl.constexpr, SA_ROWS: tl.constexpr, SB_COLS: tl.constexpr, FAST_ACCUM: tl.constexpr,
    USE_TMA: tl.constexpr, A_M_CONTIGUOUS: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr,
    C_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr, INDEX_64: tl.constexpr,
    ROUTE: tl.constexpr, GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Persistent: program p computes tiles p, p + P, p + 2P, ... of one numbering that lists
    # group 0's output tiles (in GROUP_M-row bands for L2 reuse), then group 1's, and so on.
    # Every program walks the groups in order, reading each group's extent from offs on the
    # device, so the launch never depends on offs on the host. With USE_TMA, A and B arrive
    # through TMA descriptors that end where the group ends, and a program's tiles of one group
    # run as one flattened software pipeline (all have the group's K steps), so one tile's
    # epilogue overlaps the next tile's first loads; C_TMA stores tiles asynchronously through
    # a descriptor clipped at the group's end, in EPILOGUE_SUBTILE column slices. Otherwise
    # tiles load through pointers with wrapped rows and a masked K remainder. The epilogue adds
    # the group's bias, casts, and stores the rows and columns inside the group. ZERO_TAIL then
    # writes zeros past the last group ("m": rows of C, "n": columns of C); without it they are
    # left as they were. M, N and K are the full extents (the grouped one included).
    # SCALING (fp8, tiles.py's ``accumulate``): "outer" multiplies each tile by its rows' scale_a
    # and its columns' scale_b after the K loop; "block" scales every K step's product by its
    # 128-wide K block's scales (groups then never split K: GROUPED is not "k"). A group's
    # scales start at sa_ptr + g * stride_sag and sb_ptr + g * stride_sbg, indexed by the rows
    # and columns of the full operands, as the operands are.
    # ROUTE = "gather" / GATE (tgemm::moe_mlp, GROUPED = "m", pointer loaders): M counts the
    # sorted token slots, rows_ptr maps each to the row of A it reads; with GATE, N is the
    # gated output's width and B holds 2N columns, and pre_ptr (None, or [M, 2N] contiguous)
    # keeps the pre-activations (see ``pointer_tile``; ZERO_TAIL zeroes its tail rows too).
    pid = tl.program_id(axis=0)
    num_programs = tl.num_programs(axis=0)
    tile = pid
    tiles_before = 0
    end = 0
    for g in range(0, G):
        entry = 0
        if GROUPED != "none":
            entry = tl.load(offs_ptr + g)
        m0, m1, n0, n1, k0, k1, end = group_problem(entry, end, M, N, K, GROUPED)
        num_pid_m = tl.cdiv(m1 - m0, BLOCK_M)
        num_pid_n = tl.cdiv(n1 - n0, BLOCK_N)
        tiles_end = tiles_before + num_pid_m * num_pid_n
        if tile < tiles_end:
            gw = widen(g, INDEX_64)
            a_g = a_ptr + gw * stride_ag
            b_g = b_ptr + gw * stride_bg
            c_g = c_ptr + gw * stride_cg
            bias_g = bias_ptr
            if HAS_BIAS:
                bias_g = bias_ptr + gw * stride_bias_g
            sa_g = sa_ptr
            sb_g = sb_ptr
            if SCALING != "none":
                sa_g = sa_ptr + gw * stride_sag
                sb_g = sb_ptr + gw * stride_sbg
            if USE_TMA:
                # The descriptors end at the group's last row, column and contraction index.
                k_end = tl.maximum(k1, 1)
                a_desc = operand_descriptor(a_g, m1, k_end, stride_am, stride_ak, BLOCK_M,
                                            BLOCK_K, A_M_CONTIGUOUS)
                b_desc = operand_descriptor(b_g, k_end, n1, stride_bk, stride_bn, BLOCK_K,
                                            BLOCK_N, B_K_CONTIGUOUS)
                if C_TMA:
                    c_desc = tl.make_tensor_descriptor(
                        c_g, shape=[m1, n1], strides=[stride_cm, 1],
                        block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SUBTILE])
                k_tiles = tl.cdiv(k1 - k0, BLOCK_K)
                for t in tl.range(tile, tiles_end, num_programs, flatten=True):
                    pid_m, pid_n = grouped_tile(t - tiles_before, m1 - m0, n1 - n0,
                                                BLOCK_M, BLOCK_N, GROUP_M)
                    off_m = m0 + pid_m * BLOCK_M
                    off_n = n0 + pid_n * BLOCK_N
                    # The rows and columns whose scales the tile reads (unscaled products: none).
                    scale_rows = wrapped(m0, m1, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                                         INDEX_64)
                    scale_cols = wrapped(n0, n1, pid_n * BLOCK_N + tl.arange(0, BLOCK_N),
                                         INDEX_64)
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    k = k0
                    for _ in range(k_tiles):
                        a = load_operand(a_desc, off_m, k, A_M_CONTIGUOUS)
                        b = load_operand(b_desc, k, off_n, B_K_CONTIGUOUS)
                        sa, sb = step_scales(sa_g, sb_g, scale_rows, scale_cols, k, k1,
                                             stride_sam, stride_sak, stride_sbk, stride_sbn,
                                             SCALING, SA_ROWS, SB_COLS)
                        acc = accumulate(acc, a, b, sa, sb, INPUT_PRECISION, UPCAST_TO_FP32,
                                         SCALING, FAST_ACCUM)
                        k += BLOCK_K
                    acc = outer_scales(acc, sa_g, sb_g, scale_rows, scale_cols, stride_sam,
                                       stride_sbn, SCALING)
                    cols = widen(off_n + tl.arange(0, BLOCK_N), INDEX_64)
                    if C_TMA:
                        acc = bias_activation(acc, bias_g, cols, n1, stride_bias_n, HAS_BIAS,
                                              "none")
                        store_tile(c_desc, acc.to(c_ptr.dtype.element_ty), off_m, off_n,
                                   BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)
                    else:
                        rows = widen(off_m + tl.arange(0, BLOCK_M), INDEX_64)
                        store_epilogue(acc, c_g, bias_g, rows, cols, m1, n1, stride_cm,
                                       stride_cn, stride_bias_n, HAS_BIAS, "none")
                # This program's first tile past the group, in its stride.
                tile += tl.cdiv(tiles_end - tile, num_programs) * num_programs
            else:
                while tile < tiles_end:
                    pid_m, pid_n = grouped_tile(tile - tiles_before, m1 - m0, n1 - n0,
                                                BLOCK_M, BLOCK_N, GROUP_M)
                    kw = widen(k0, INDEX_64)
                    pointer_tile(
                        a_g + kw * stride_ak, b_g + kw * stride_bk, c_g, bias_g, sa_g, sb_g,
                        rows_ptr, pre_ptr, m0, m1, n0, n1, k1 - k0, pid_m, pid_n,
                        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                        stride_bias_n, stride_sam, stride_sak, stride_sbk, stride_sbn,
                        HAS_BIAS, INPUT_PRECISION, UPCAST_TO_FP32, INDEX_64,
                        SCALING, SA_ROWS, SB_COLS, FAST_ACCUM, ROUTE, GATE,
                        BLOCK_M, BLOCK_N, BLOCK_K,
                    )
                    tile += num_programs
        tiles_before = tiles_end
    if ZERO_TAIL:
        # The rows (GROUPED "m") or columns ("n") from the last group's end on, as one more
        # range of tiles in the same numbering.
        m0 = 0
        n0 = 0
        if GROUPED == "m":
            m0 = end
        else:
            n0 = end
        num_pid_m = tl.cdiv(M - m0, BLOCK_M)
        num_pid_n = tl.cdiv(N - n0, BLOCK_N)
        tiles_end = tiles_before + num_pid_m * num_pid_n
        while tile < tiles_end:
            pid_m, pid_n = grouped_tile(tile - tiles_before, M - m0, N - n0,
                                        BLOCK_M, BLOCK_N, GROUP_M)
            rows = widen(m0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M), INDEX_64)
            cols = widen(n0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N), INDEX_64)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            store_epilogue(zeros, c_ptr, bias_ptr, rows, cols, M, N, stride_cm, stride_cn, 0,
                           False, "none")
            if pre_ptr is not None:  # both halves of the kept pre-activations
                store_epilogue(zeros, pre_ptr, pre_ptr, rows, cols, M, N, 2 * N, 1, 0, False,
                               "none")
                store_epilogue(zeros, pre_ptr + widen(N, INDEX_64), pre_ptr, rows, cols, M, N,
                               2 * N, 1, 0, False, "none")
            tile += num_programs


@triton.jit
def grouped_mm_list_kernel(
    a_ptr, b_ptr, c_ptr, table_ptr, G,
    ALIGNED: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_TO_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # C_g = A_g @ B_g for G independent problems of any sizes and strides, one row of table_ptr
    # each (addresses, sizes, strides as int64; see TABLE_COLUMNS). Persistent, with the same
    # tile numbering as grouped_mm_kernel; tiles go through the pointer loaders with int64
    # offsets. a_ptr, b_ptr and c_ptr are problem 0's tensors: they give the table's addresses
    # their element types. ALIGNED (checked on the host for every problem: A and B rows
    # contiguous, 16-byte aligned addresses, K, N and leading strides multiples of 16 elements)
    # tells the compiler so, which lets it vectorize and pipeline the loads.
    pid = tl.program_id(axis=0)
    num_programs = tl.num_programs(axis=0)
    tile = pid
    tiles_before = 0
    for g in range(0, G):
        row = table_ptr + g * TABLE_COLUMNS
        m = tl.load(row + TABLE_M)
        n = tl.load(row + TABLE_N)
        tiles_end = tiles_before + (tl.cdiv(m, BLOCK_M) * tl.cdiv(n, BLOCK_N)).to(tl.int32)
        if tile < tiles_end:
            a_g = tl.load(row + TABLE_A).to(tl.pointer_type(a_ptr.dtype.element_ty))
            b_g = tl.load(row + TABLE_B).to(tl.pointer_type(b_ptr.dtype.element_ty))
            c_g = tl.load(row + TABLE_C).to(tl.pointer_type(c_ptr.dtype.element_ty))
            k = tl.load(row + TABLE_K)
            stride_am = tl.load(row + TABLE_STRIDE_AM)
            stride_ak = tl.load(row + TABLE_STRIDE_AK)
            stride_bk = tl.load(row + TABLE_STRIDE_BK)
            stride_bn = tl.load(row + TABLE_STRIDE_BN)
            stride_cm = tl.load(row + TABLE_STRIDE_CM)
            stride_cn = tl.load(row + TABLE_STRIDE_CN)
            if ALIGNED:
                a_g = tl.multiple_of(a_g, 16)
                b_g = tl.multiple_of(b_g, 16)
                c_g = tl.multiple_of(c_g, 16)
                n = tl.multiple_of(n, 16)
                k = tl.multiple_of(k, 16)
                stride_am = tl.multiple_of(stride_am, 16)
                stride_bk = tl.multiple_of(stride_bk, 16)
                stride_cm = tl.multiple_of(stride_cm, 16)
                stride_ak = 1
                stride_bn = 1
                stride_cn = 1
            while tile < tiles_end:
                pid_m, pid_n = grouped_tile(tile - tiles_before, m, n, BLOCK_M, BLOCK_N, GROUP_M)
                # Unscaled products: the scale pointers and strides are not read.
                pointer_tile(
                    a_g, b_g, c_g, c_g, a_g, b_g, a_g, None, 0, m, 0, n, k, pid_m, pid_n,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, 0,
                    0, 0, 0, 0, False, INPUT_PRECISION, UPCAST_TO_FP32, True,
                    "none", 1, 1, False, "none", "none", BLOCK_M, BLOCK_N, BLOCK_K,
                )
                tile += num_programs
        tiles_before = tiles_end
