"""Hopper's warp-specialized GEMM, written in Gluon (Triton's lower-level dialect) for sm_90:
fp8 with precise accumulation (tensorwise and rowwise scaled_mm with ``use_fast_accum=False``,
and blockwise scaled_mm: DeepSeek-V3's 1x128 / 128x128 scales, which apply at each promotion),
and 16-bit products.

Hopper's fp8 tensor cores keep fewer bits than fp32 in their accumulator, so a precise fp8 GEMM
adds each K step's product into an fp32 accumulator in registers: every step's wgmma writes a
fresh partial sum, the warpgroup waits for it and adds it. That wait idles the tensor cores
unless another warpgroup has work in flight, which a Triton kernel cannot arrange (its
warpgroups run in lock step, and Triton's own promotion, ``max_num_imprecise_acc``, waits the
same way: 0.80-0.87x cuBLAS on an H100). Here the work is warp-specialized, as DeepGEMM does:

- one loader warp streams A and B tiles through TMA into ``STAGES`` shared-memory slots, each
  slot guarded by a "ready" barrier (bytes arrived) and an "empty" one (every consumer done);
- CONSUMERS warpgroups (2 or 3) each own 64 rows of a [64 * CONSUMERS, BLOCK_N] output tile
  and share its B tile: per K step one wgmma into a fresh partial, a wait, the slot released,
  the partial added into fp32. While one warpgroup adds, the others' wgmmas run;
- the epilogue scales by scale_a (per row, stride 0 for one scale) and scale_b (per column),
  adds bias, casts and stores by TMA, per consumer. Blockwise scales multiply each step's
  partial sum instead (scale_b one per 128 columns: a tile's 128 columns are one block, loaded
  a step ahead). Where scale_a's rows are contiguous (torch's layout, and quantize's), the
  loader brings each step's scale_a into the step's slot by TMA (SCALE_TMA) and the consumers
  read it from shared memory: loaded into registers a step ahead instead, ptxas copied it into
  the loop's registers within the step, so every K step waited for an L2 round trip (8192^3 on
  an H200: 1180 TFLOP/s, 1284 with SCALE_TMA; tensorwise 1436).

``fp8_grouped_precise_kernel`` runs the same partitions over the groups of a 2-D x 3-D grouped
product (scaled_grouped_mm's MoE forward), tiles numbered group after group; a tile that passes
its group's last row stores through pointers masked there.

``ws_gemm_kernel`` also runs 16-bit products (tgemm::mm's "wgmma" plans): there the consumers
accumulate in the wgmma's own fp32 accumulator, issuing a K step's wgmma before waiting for the
one before (whose slot then goes back to the loader), so the kernel is the same warp-specialized
pipeline without the promotion. Three consumers give 192-row tiles, which Triton's power-of-two
blocks cannot: on an H200, 3072^3 bf16 in 86.9 us against 101.3 for tgemm's plan on the Triton
TMA kernel (cuBLAS 81.9).

Its ping-pong form (``PINGPONG``, 16-bit only; tgemm::mm's "wgmma-pp" plans) gives each of two
consumers whole 128-row tiles of its own, alternate ones, and has them take turns at their K
loops over one ring of slots, as CUTLASS's ping-pong kernels do: one consumer's epilogue runs
while the other's wgmmas do, where the shared-tile form idles the tensor cores through every
epilogue. On an H200 (bf16), 128x128 tiles with 5 stages ran seven of eight products with
K = 256-384 1.02-1.42x as fast as tgemm's default plan (3128 x 7304 x 320: 30.4 us against
36.3; 3264 x 6272 x 312: 0.75x), large products 2-5% slower than the shared-tile 128x256 and
K = 440-512 ones 0.81-0.87x: autotuning weighs it, the plan model does not.

With ``SPLIT`` (not ping-pong) each tile's K is cut into splits, work units numbered split by
split as the Triton kernels' K splits are; a unit's fp32 partial (scaled, without bias) goes to
a workspace slot and splitk_reduce_kernel (kernels/matmul.py) adds them in split order and runs
the epilogue: products whose tiles leave SMs idle, few-row ones above all, then stream their
operands on every SM. One consumer (64-row tiles) suits products of up to 64 rows.

Tiles are persistent (one CTA per SM) in L2-grouped order. A K step is 128 bytes of each row:
128 fp8 elements (the promotion interval of cuBLAS's precise mode: the same error against
float64) or 64 16-bit ones. Requirements, checked by the planner: A and B K-contiguous (b as
``W.t()``, torch._scaled_mm's layout), 16-byte aligned pitches and pointers, a row-major output;
TMA zero-fills the M, N and K edges.

Gluon exists in Triton 3.5 and later; ``AVAILABLE`` says whether this Triton has it.
"""

from typing import Any

try:  # Gluon and its Hopper ops: Triton 3.5+
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Triton renamed the TMA copies after 3.6.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

try:  # host-built descriptors of Gluon kernels (their shared-memory layout included)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

ROWS_PER_CONSUMER = 64  # one warpgroup's wgmma rows
BLOCK_K = 128  # fp8 elements per K step (one promotion); 16-bit steps take 64 (the same bytes)
SCALE_BLOCK = 128  # blockwise scales: one per 128 of K, and scale_b one per 128 columns
# Registers per thread of the consumer warpgroups, for two or three of them: a 64x128 fp32
# accumulator and the step's partial sum (64 each) fit either way; three consumers must leave
# room in the SM's 64K registers for each other and the loader. (One consumer is the
# kernel's default partition, which keeps what the loader leaves.)
CONSUMER_REGS = {1: 232, 2: 232, 3: 160}


def host_descriptors(a: Any, b: Any, out: Any, M: int, N: int, K: int, stride_am: int,
                     stride_bn: int, stride_cm: int, block_n: int) -> tuple[Any, Any, Any]:
    """A's [M, K], B's transpose [N, K] and C's [M, N] TMA descriptors built on the host, as
    ``ws_gemm_kernel`` builds them on the device (boxes of 64 rows, or of block_n rows of B,
    by a K step of 128 bytes; C's of 64 rows by block_n; each its default swizzled layout),
    for its HOST_DESCRIPTORS variant. Raises AssertionError where TMA cannot describe a
    tensor (alignment, a last stride that is not 1), KeyError for a dtype it does not take."""

    def describe(t: Any, shape: list[int], stride: int, block: list[int]) -> Any:
        layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[str(t.dtype)])
        return TensorDescriptor(t, shape, [stride, 1], block,
                                getattr(layout, "value", layout))  # (a constexpr on some Tritons)

    step = 128 // a.element_size()
    return (describe(a, [M, K], stride_am, [ROWS_PER_CONSUMER, step]),
            describe(b, [N, K], stride_bn, [block_n, step]),
            describe(out, [M, N], stride_cm, [ROWS_PER_CONSUMER, block_n]))


if AVAILABLE:
    # Gluon's dtype of each torch dtype the kernel's descriptors describe (host_descriptors).
    _GL_DTYPES = {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16,
                  "torch.float32": gl.float32, "torch.float8_e4m3fn": gl.float8e4nv,
                  "torch.float8_e5m2": gl.float8e5}
    _ROWS = gl.constexpr(ROWS_PER_CONSUMER)
    _SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)

    @gluon.jit
    def _tile_offsets(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      GROUP_M: gl.constexpr):
        """(row, column) of the tile-th output tile of an M x N output in L2-grouped order:
        GROUP_M tile rows sweep the columns together, so a B tile is read from L2 by each."""
        grid_m = gl.cdiv(M, BLOCK_M)
        grid_n = gl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @gluon.jit
    def _group_end(offs_ptr, g, start, M, GROUPED: gl.constexpr):
        """Where group g's rows end (GROUPED: offs' cumulative end, clamped into [start, M] so
        that groups never overlap or leave the tensor), else M: one group of every row."""
        if GROUPED:
            end = gl.minimum(gl.maximum(gl.load(offs_ptr + g), start), M)
        else:
            end = M
        return end

    @gluon.jit
    def _to_group_of(tile, g, m0, m1, tiles_before, tiles_end, offs_ptr, G, M, N,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUPED: gl.constexpr):
        """Advance (g, its rows [m0, m1), its tiles [tiles_before, tiles_end)) to the group
        holding ``tile``, or to the last group when ``tile`` is past every group's tiles."""
        while (tile >= tiles_end) & (g + 1 < G):
            g += 1
            m0 = m1
            m1 = _group_end(offs_ptr, g, m0, M, GROUPED)
            tiles_before = tiles_end
            tiles_end = tiles_before + gl.cdiv(m1 - m0, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        return g, m0, m1, tiles_before, tiles_end

    @gluon.jit
    def _first_group(offs_ptr, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUPED: gl.constexpr):
        m1 = _group_end(offs_ptr, 0, 0, M, GROUPED)
        return 0, 0, m1, 0, gl.cdiv(m1, BLOCK_M) * gl.cdiv(N, BLOCK_N)

    @gluon.jit
    def _unit_work(unit, tiles_before, m0, m1, N, k_steps, split_steps, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """(row, column, first and end K step) of work unit ``unit`` of its group: a tile of the
        group's [m0, m1) rows, all of K, or with K splits (split_steps < k_steps; one group)
        split ``(unit - tiles_before) // tiles``'s K steps of tile ``... % tiles``: units run
        split-major, as the Triton kernels' (kernels/matmul.py's work_unit) and the partials'
        reduction (splitk_reduce_kernel) number them."""
        tiles = gl.cdiv(m1 - m0, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        index = unit - tiles_before
        split = index // tiles
        off_m, off_n = _tile_offsets(index - split * tiles, m1 - m0, N, BLOCK_M, BLOCK_N,
                                     GROUP_M)
        k0 = split * split_steps
        return off_m + m0, off_n, k0, gl.minimum(k0 + split_steps, k_steps)

    # Both partitions walk this program's work units the same way: tiles numbered group after
    # group (each group's [m0, m1) rows x N columns in L2-grouped order; with K splits, one
    # group's tiles once per split), every num_programs-th from the program id on, so the
    # loader's K steps and the consumers' match one for one.

    @gluon.jit
    def _load_partition(operands, GROUPED: gl.constexpr, CONSUMERS: gl.constexpr,
                        BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """The loader warp: every K step of every work unit of this program, in order, into
        the next slot once its consumers have released it. ``operands``: the descriptors,
        shared buffers, barriers and sizes (_gemm's ``loader``)."""
        (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, M, N, K, splits,
         k_per_split, scale_tma, stride_sak) = operands
        sa_desc, sa_bufs = scale_tma
        BLOCK_M: gl.constexpr = _ROWS * CONSUMERS
        # Blockwise scale_a by TMA (SCALE_TMA): each consumer's 64 scales of a K step ride
        # in the step's slot, on its barrier.
        SCALE_TMA: gl.constexpr = sa_desc is not None
        slot_bytes: gl.constexpr = (CONSUMERS * a_desc.block_type.nbytes
                                    + b_desc.block_type.nbytes
                                    + (CONSUMERS * _ROWS * 4 if SCALE_TMA else 0))
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        k_steps = gl.cdiv(K, BLOCK_K)
        split_steps = gl.cdiv(k_per_split, BLOCK_K)
        tile = gl.program_id(0)
        g, m0, m1, tiles_before, tiles_end = _first_group(offs_ptr, M, N, BLOCK_M, BLOCK_N,
                                                          GROUPED)
        tiles_end = tiles_end * splits
        g, m0, m1, tiles_before, tiles_end = _to_group_of(
            tile, g, m0, m1, tiles_before, tiles_end, offs_ptr, G, M, N, BLOCK_M, BLOCK_N,
            GROUPED)
        step = 0
        while tile < tiles_end:
            off_m, off_n, k0, k1 = _unit_work(tile, tiles_before, m0, m1, N, k_steps,
                                              split_steps, BLOCK_M, BLOCK_N, GROUP_M)
            off_b = g * N + off_n  # B's groups are stacked along its rows
            for k in range(k0, k1):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), (step // STAGES) & 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, slot_bytes)
                for c in gl.static_range(CONSUMERS):
                    _tma_load(a_desc, [off_m + c * _ROWS, k * BLOCK_K], bar,
                              a_bufs.index(slot * CONSUMERS + c))
                    if SCALE_TMA:
                        _tma_load(sa_desc, [k * stride_sak + off_m + c * _ROWS], bar,
                                  sa_bufs.index(slot * CONSUMERS + c))
                _tma_load(b_desc, [off_b, k * BLOCK_K], bar, b_bufs.index(slot))
                step += 1
            tile += gl.num_programs(0)
            g, m0, m1, tiles_before, tiles_end = _to_group_of(
                tile, g, m0, m1, tiles_before, tiles_end, offs_ptr, G, M, N, BLOCK_M, BLOCK_N,
                GROUPED)

    @gluon.jit
    def _consumer_partition(operands, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr,
                            GROUPED: gl.constexpr, SCALED: gl.constexpr, BLOCKWISE: gl.constexpr,
                            A_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                            BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr):
        """One warpgroup: rows [64 * CONSUMER, 64 * CONSUMER + 64) of every work unit of this
        program. SCALED (fp8): each K step's wgmma promoted into fp32 (times the step's scales
        when BLOCKWISE: scale_a per A_ROWS rows, scale_b one per 128 columns; else the outer
        scales in the epilogue); 16-bit inputs accumulate in the wgmma's own fp32 accumulator,
        one wgmma left in flight while the next waits for its operands. Then the epilogue:
        stored by TMA, or through pointers masked at the group's last row where a GROUPED
        tile passes it; a SPLIT unit's fp32 partial (scaled, no bias) goes into its workspace
        slot ``ws_ptr[unit]`` for the reduction to add. ``operands``: the shared buffers,
        barriers, tensors and sizes (_gemm's ``shared``)."""
        (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ptr, bias_ptr, ws_ptr, offs_ptr, sa_ptr,
         sb_ptr, G, M, N, K, splits, k_per_split, stride_cm, stride_bias_g, stride_bias_n,
         stride_sam, stride_sak, stride_sbg, stride_sbk, stride_sbn, scale_tma) = operands
        sa_bufs = scale_tma[1]
        SCALE_TMA: gl.constexpr = sa_bufs is not None
        BLOCK_M: gl.constexpr = _ROWS * CONSUMERS
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        INSTR_K: gl.constexpr = 32 if SCALED else 16
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, INSTR_K])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        vector_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k_steps = gl.cdiv(K, BLOCK_K)
        split_steps = gl.cdiv(k_per_split, BLOCK_K)
        zero = gl.zeros((_ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        c_smem = c_bufs.index(CONSUMER)
        tile = gl.program_id(0)
        g, m0, m1, tiles_before, tiles_end = _first_group(offs_ptr, M, N, BLOCK_M, BLOCK_N,
                                                          GROUPED)
        tiles_end = tiles_end * splits
        g, m0, m1, tiles_before, tiles_end = _to_group_of(
            tile, g, m0, m1, tiles_before, tiles_end, offs_ptr, G, M, N, BLOCK_M, BLOCK_N,
            GROUPED)
        step = 0
        while tile < tiles_end:
            off_m, off_n, k0, k1 = _unit_work(tile, tiles_before, m0, m1, N, k_steps,
                                              split_steps, BLOCK_M, BLOCK_N, GROUP_M)
            off_m += CONSUMER * _ROWS
            # The epilogue's scales and bias, loaded now so that their latency hides under the
            # K loop, and held one element a thread until then (no registers to spare).
            rows = off_m + gl.arange(0, _ROWS, layout=vector_layout)
            cols = off_n + gl.arange(0, BLOCK_N, layout=vector_layout)
            if SCALED and not BLOCKWISE:
                scale_a = gl.load(sa_ptr + rows * stride_sam, mask=rows < M, other=0.0)
                scale_b = gl.load(sb_ptr + g * stride_sbg + cols * stride_sbn, mask=cols < N,
                                  other=0.0)
            if HAS_BIAS:
                bias = gl.load(bias_ptr + g * stride_bias_g + cols * stride_bias_n,
                               mask=cols < N, other=0.0)
            if BLOCKWISE:
                # A step's scales are loaded one step ahead, while the wgmma before runs
                # (scale_a's, unless the loader brings them: SCALE_TMA).
                step_rows = off_m + gl.arange(0, _ROWS, layout=row_layout)
                sa_ptrs = sa_ptr + (step_rows // A_ROWS) * stride_sam
                sb_step = sb_ptr + (off_n // _SCALE_BLOCK) * stride_sbn
                if not SCALE_TMA:
                    sa_next = gl.load(sa_ptrs + k0 * stride_sak, mask=step_rows < M, other=0.0)
                sb_next = gl.load(sb_step + k0 * stride_sbk)
            acc = gl.zeros((_ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
            if not SCALED:
                for k in range(k0, k1):
                    slot = step % STAGES
                    mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(slot * CONSUMERS + CONSUMER),
                                        b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                    # The step before is done once at most this one is in flight: its slot
                    # goes back to the loader.
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    if k > k0:
                        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
                    step += 1
                acc = warpgroup_mma_wait(0, deps=(acc,))
                if k1 > k0:
                    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            else:
                for k in range(k0, k1):
                    slot = step % STAGES
                    mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                    part = warpgroup_mma(a_bufs.index(slot * CONSUMERS + CONSUMER),
                                         b_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                                         is_async=True)
                    if BLOCKWISE:
                        more = k + 1 < k1
                        if SCALE_TMA:
                            # Read before the slot is released. (Registers loaded a step
                            # ahead were copied within the step, which so waited for the
                            # loads: an L2 round trip a K step, on sm_90.)
                            step_scale = sa_bufs.index(slot * CONSUMERS + CONSUMER).load(
                                row_layout) * sb_next
                        else:
                            step_scale = sa_next * sb_next
                            sa_next = gl.load(sa_ptrs + (k + 1) * stride_sak,
                                              mask=(step_rows < M) & more, other=0.0)
                        sb_next = gl.load(sb_step + (k + 1) * stride_sbk, mask=more, other=0.0)
                    part = warpgroup_mma_wait(0, deps=(part,))
                    mbarrier.arrive(empty.index(slot), count=1)
                    # The promotion: one fp32 add (and for blockwise, one multiply) per K step.
                    if BLOCKWISE:
                        acc = acc + part * gl.expand_dims(step_scale, 1)
                    else:
                        acc = acc + part
                    step += 1
            if SCALED and not BLOCKWISE:
                scale_a = gl.convert_layout(scale_a, row_layout)
                scale_b = gl.convert_layout(scale_b, col_layout)
                acc = acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)
            if HAS_BIAS:
                bias = gl.convert_layout(bias.to(gl.float32), col_layout)
                acc = acc + gl.expand_dims(bias, 0)
            if SPLIT:
                # The unit's slot holds its [BLOCK_M, BLOCK_N] partial, this consumer's rows
                # from 64 * CONSUMER on; rows past M are neither stored nor read by the
                # reduction (a decode product's 16 rows store a quarter of a slot). Columns
                # past N (zeros) are: a mask along the columns would split the stores'
                # column pairs.
                slot_rows = CONSUMER * _ROWS + gl.arange(0, _ROWS, layout=row_layout)
                slot_cols = gl.arange(0, BLOCK_N, layout=col_layout)
                ptrs = (ws_ptr + tile.to(gl.int64) * (BLOCK_M * BLOCK_N)
                        + gl.expand_dims(slot_rows * BLOCK_N, 1) + gl.expand_dims(slot_cols, 0))
                in_m = gl.expand_dims(off_m - CONSUMER * _ROWS + slot_rows < M, 1)
                gl.store(ptrs, acc, mask=in_m & gl.expand_dims(slot_cols < BLOCK_N, 0))
            elif GROUPED and off_m + _ROWS > m1:
                # The group's last rows: a store masked at its end (TMA would clip at M only).
                out_rows = off_m + gl.arange(0, _ROWS, layout=row_layout)
                out_cols = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
                ptrs = (c_ptr + gl.expand_dims(out_rows.to(gl.int64) * stride_cm, 1)
                        + gl.expand_dims(out_cols, 0))
                mask = gl.expand_dims(out_rows < m1, 1) & gl.expand_dims(out_cols < N, 0)
                gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
            else:
                tma.store_wait(0)  # this consumer's previous tile has left c_smem
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [off_m, off_n], c_smem)
            tile += gl.num_programs(0)
            g, m0, m1, tiles_before, tiles_end = _to_group_of(
                tile, g, m0, m1, tiles_before, tiles_end, offs_ptr, G, M, N, BLOCK_M, BLOCK_N,
                GROUPED)
        tma.store_wait(0)

    @gluon.jit
    def _shared_operands(a_ptr, b_ptr, c_ptr, c_host_desc, M, N, K, b_rows, stride_am,
                         stride_bn, stride_cm, HOST_DESCRIPTORS: gl.constexpr,
                         A_SLOTS: gl.constexpr, C_TILES: gl.constexpr, READERS: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The TMA descriptors of A [M, K], B's transpose [b_rows, K] and C [M, N] (built
        here, or HOST_DESCRIPTORS: a_ptr, b_ptr and c_host_desc are the launcher's, described
        so: ``host_descriptors``); STAGES slots of A_SLOTS 64-row A tiles and one B tile each,
        C_TILES 64-row C tiles; each slot's "ready" barrier and its "empty" one (READERS
        arrivals free it; every slot starts free)."""
        if HOST_DESCRIPTORS:
            a_desc = a_ptr
            b_desc = b_ptr
            c_desc = c_host_desc
        else:
            # A K step is 128 bytes of each row: 128 fp8 or 64 16-bit elements.
            STEP_K: gl.constexpr = 1024 // a_ptr.dtype.element_ty.primitive_bitwidth
            a_desc = tma.make_tensor_descriptor(
                a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[_ROWS, STEP_K],
                layout=gl.NVMMASharedLayout.get_default_for([_ROWS, STEP_K],
                                                            a_ptr.dtype.element_ty))
            b_desc = tma.make_tensor_descriptor(
                b_ptr, shape=[b_rows, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, STEP_K],
                layout=gl.NVMMASharedLayout.get_default_for([BLOCK_N, STEP_K],
                                                            b_ptr.dtype.element_ty))
            c_desc = tma.make_tensor_descriptor(
                c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[_ROWS, BLOCK_N],
                layout=gl.NVMMASharedLayout.get_default_for([_ROWS, BLOCK_N],
                                                            c_ptr.dtype.element_ty))
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * A_SLOTS, _ROWS, BLOCK_K],
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K],
                                           b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [C_TILES, _ROWS, BLOCK_N],
                                           c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=READERS)
            mbarrier.arrive(empty.index(i), count=READERS)
        return a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty

    @gluon.jit
    def _gemm(a_ptr, b_ptr, c_ptr, c_host_desc, bias_ptr, ws_ptr, offs_ptr, sa_ptr, sb_ptr, G, M,
              N, K, splits, k_per_split, stride_am, stride_bn, stride_cm, stride_bias_g,
              stride_bias_n, stride_sam, stride_sak, stride_sbg, stride_sbk, stride_sbn,
              GROUPED: gl.constexpr, BLOCKWISE: gl.constexpr, A_ROWS: gl.constexpr,
              HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, CONSUMERS: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              CONSUMER_REGS: gl.constexpr, HOST_DESCRIPTORS: gl.constexpr,
              SCALE_TMA: gl.constexpr = False):
        """Descriptors, shared memory and barriers, then the warp-specialized partitions.
        SCALE_TMA (BLOCKWISE with A_ROWS 1, scale_a's rows contiguous and 16-byte aligned):
        scale_a read by TMA into the K steps' slots, as a flat [(K blocks - 1) * stride_sak +
        M] vector (rows past M read the next K block's or zeros: never stored)."""
        # B as its transpose [N, K], the groups' stacked along its rows ([G * N, K]).
        a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty = _shared_operands(
            a_ptr, b_ptr, c_ptr, c_host_desc, M, N, K, G * N, stride_am, stride_bn, stride_cm,
            HOST_DESCRIPTORS, CONSUMERS, CONSUMERS, CONSUMERS, BLOCK_N, STAGES)
        SCALED: gl.constexpr = a_desc.dtype.primitive_bitwidth == 8
        if SCALE_TMA:
            sa_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                           element_bitwidth=32, rank=1)
            sa_desc = tma.make_tensor_descriptor(
                sa_ptr, shape=[(gl.cdiv(K, _SCALE_BLOCK) - 1) * stride_sak + M], strides=[1],
                block_shape=[_ROWS], layout=sa_layout)
            # (scale_a's descriptor and slots; None, None without: a literal, as a tuple
            # element cannot be a variable holding None)
            scale_tma = (sa_desc, gl.allocate_shared_memory(
                gl.float32, [STAGES * CONSUMERS, _ROWS], sa_layout))
        else:
            scale_tma = (None, None)
        # Partitions are listed statically: the default one (the kernel's 4 warps) is the
        # first consumer, then the other consumers (4 warps each) and the loader (1 warp).
        shared = (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ptr, bias_ptr, ws_ptr,
                  offs_ptr, sa_ptr, sb_ptr, G, M, N, K, splits, k_per_split, stride_cm,
                  stride_bias_g, stride_bias_n, stride_sam, stride_sak, stride_sbg, stride_sbk,
                  stride_sbn, scale_tma)
        loader = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, G, M, N, K, splits,
                  k_per_split, scale_tma, stride_sak)
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer_partition, (shared, 0, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_load_partition, (loader, GROUPED, CONSUMERS, BLOCK_N, GROUP_M, STAGES)),
            ], [1], [24])
        elif CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer_partition, (shared, 0, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_consumer_partition, (shared, 1, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_load_partition, (loader, GROUPED, CONSUMERS, BLOCK_N, GROUP_M, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer_partition, (shared, 0, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_consumer_partition, (shared, 1, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_consumer_partition, (shared, 2, CONSUMERS, GROUPED, SCALED, BLOCKWISE, A_ROWS,
                                       HAS_BIAS, SPLIT, BLOCK_N, GROUP_M, STAGES)),
                (_load_partition, (loader, GROUPED, CONSUMERS, BLOCK_N, GROUP_M, STAGES)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])

    # --- ping-pong: each consumer on alternate tiles of its own -----------------------------
    # With the consumers sharing a tile, both reach its epilogue together and the tensor cores
    # idle through it. Here consumer c takes this program's tiles c, c + 2, ... (128 rows of
    # its own: two 64-row wgmmas a K step), and the consumers take turns at their K loops
    # (CUTLASS's ping-pong order): while one stores a tile, the other's wgmmas run. The loader
    # (the shared-tile form's, with two 64-row A boxes a slot) fills one ring of STAGES slots
    # tile after tile, so the consumer whose turn it is has the whole ring ahead of it; the
    # turns also keep each consumer's waits within one phase of the ring's barriers.

    @gluon.jit
    def _pingpong_consumer_partition(a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs,
                                     bias_ptr, M, N, K, stride_bias, CONSUMER: gl.constexpr,
                                     HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                                     GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: this program's tiles CONSUMER, CONSUMER + 2, ..., 128 rows each as
        two 64-row accumulators, one K step's pair of wgmmas in flight. Its K loop waits for
        its turn (``turns``: a barrier per consumer, passed on once its last wgmmas are
        issued); its epilogue (bias, cast, TMA stores of each half) runs in the other's."""
        BLOCK_M: gl.constexpr = 2 * _ROWS
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        vector_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k_steps = gl.cdiv(K, BLOCK_K)
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        c_smem = c_bufs.index(CONSUMER)
        tile = gl.program_id(0) + CONSUMER * gl.num_programs(0)
        step = CONSUMER * k_steps  # the ring's steps of this program's tiles before this one
        turn = 0
        while tile < tiles:
            off_m, off_n = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            if HAS_BIAS:
                cols = off_n + gl.arange(0, BLOCK_N, layout=vector_layout)
                bias = gl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
            top = gl.zeros((_ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
            bottom = gl.zeros((_ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
            mbarrier.wait(turns.index(CONSUMER), turn)
            for k in range(k_steps):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                b_tile = b_bufs.index(slot).permute((1, 0))
                top = warpgroup_mma(a_bufs.index(slot * 2), b_tile, top, is_async=True)
                bottom = warpgroup_mma(a_bufs.index(slot * 2 + 1), b_tile, bottom,
                                       is_async=True)
                # The step before is done once at most this one's pair is in flight.
                top, bottom = warpgroup_mma_wait(2, deps=(top, bottom))
                if k > 0:
                    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
                step += 1
            mbarrier.arrive(turns.index(1 - CONSUMER), count=1)
            turn ^= 1
            top, bottom = warpgroup_mma_wait(0, deps=(top, bottom))
            if k_steps > 0:
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            step += k_steps  # past the other consumer's next tile
            if HAS_BIAS:
                row_bias = gl.expand_dims(gl.convert_layout(bias.to(gl.float32), col_layout), 0)
                top = top + row_bias
                bottom = bottom + row_bias
            tma.store_wait(0)  # this consumer's last store has left c_smem
            c_smem.store(top.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], c_smem)
            tma.store_wait(0)
            c_smem.store(bottom.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m + _ROWS, off_n], c_smem)
            tile += 2 * gl.num_programs(0)
        tma.store_wait(0)

    @gluon.jit
    def _pingpong_gemm(a_ptr, b_ptr, c_ptr, c_host_desc, bias_ptr, M, N, K, stride_am, stride_bn,
                       stride_cm, stride_bias, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, HOST_DESCRIPTORS: gl.constexpr):
        """ws_gemm_kernel's ping-pong form for 16-bit inputs: descriptors, one ring of STAGES
        slots (each consumer reads whole slots), the turns' barriers, then the partitions."""
        a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty = _shared_operands(
            a_ptr, b_ptr, c_ptr, c_host_desc, M, N, K, N, stride_am, stride_bn, stride_cm,
            HOST_DESCRIPTORS, 2, 2, 1, BLOCK_N, STAGES)
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
        mbarrier.arrive(turns.index(0), count=1)  # consumer 0's K loop goes first
        gl.warp_specialize([
            (_pingpong_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc,
                                            c_bufs, bias_ptr, M, N, K, stride_bias, 0, HAS_BIAS,
                                            BLOCK_N, GROUP_M, STAGES)),
            (_pingpong_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc,
                                            c_bufs, bias_ptr, M, N, K, stride_bias, 1, HAS_BIAS,
                                            BLOCK_N, GROUP_M, STAGES)),
            # (the shared-tile form's loader: two 64-row A boxes a slot, tile after tile)
            (_load_partition, ((a_desc, b_desc, a_bufs, b_bufs, ready, empty, None, 1, M, N, K,
                                1, K, (None, None), 0), False, 2, BLOCK_N, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])

    # The entry kernels' leading tensors match the Triton kernels their launchers run (the
    # mm kernels': locks unused; the grouped kernel's: routing unused), so each launcher runs
    # them like those. Nothing is specialised on sizes, pitches or K splits.
    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_am", "stride_bn", "stride_cm",
                                  "splits", "k_per_split"])
    def ws_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, locks_ptr, sa_ptr, sb_ptr,
                       M, N, K, stride_am, stride_bn, stride_cm, stride_bias, stride_sam,
                       stride_sak, stride_sbk, stride_sbn, splits, k_per_split,
                       HAS_BIAS: gl.constexpr, BLOCKWISE: gl.constexpr, A_ROWS: gl.constexpr,
                       CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
                       SPLIT: gl.constexpr = False, SCALE_TMA: gl.constexpr = False,
                       HOST_DESCRIPTORS: gl.constexpr = False, c_host_desc=None):
        """C = A @ B + bias for K-contiguous A [M, K] and B [K, N] (described as B's transpose
        [N, K]). fp8: (A * scale_a) @ (B * scale_b), fp32 promotion every K step; tensorwise or
        rowwise scales (stride 0 for one) in the epilogue, or BLOCKWISE ones (scale_a [row
        block, K block] per A_ROWS rows, scale_b [K block, column block] per 128 columns) at
        each promotion. 16-bit inputs: no scales (sa_ptr, sb_ptr unused), accumulated by the
        wgmmas in place; PINGPONG (16-bit only): the ping-pong form, two consumers on
        alternate 128-row tiles (CONSUMERS unused). SPLIT (not PINGPONG): K cut into ``splits``
        parts of ``k_per_split`` (whole K steps), each tile's split s is work unit
        s * tiles + tile, whose scaled fp32 partial goes to the workspace ``ws_ptr`` [units,
        64 * CONSUMERS, BLOCK_N] (no bias, C untouched) for splitk_reduce_kernel; else
        splits = 1 and k_per_split = K. HOST_DESCRIPTORS (CUDA-graph captures,
        ops/graph_descriptors.py): a_ptr and b_ptr are A's and B's TMA descriptors and
        c_host_desc C's, as ``host_descriptors`` builds them, so that no program spends its
        first microseconds building them; c_host_desc stays the last parameter. SCALE_TMA
        (BLOCKWISE, A_ROWS 1, stride_sam 1, sa_ptr 16-byte aligned, stride_sak a multiple of
        4): the loader brings scale_a by TMA with the operands (ops/operands.py's
        ``blockwise_scale_tma``). See the module docstring. Launch with num_warps=4, at most
        one program per SM."""
        if PINGPONG:
            _pingpong_gemm(a_ptr, b_ptr, c_ptr, c_host_desc, bias_ptr, M, N, K, stride_am,
                           stride_bn, stride_cm, stride_bias, HAS_BIAS, BLOCK_N, GROUP_M,
                           STAGES, CONSUMER_REGS, HOST_DESCRIPTORS)
        else:
            _gemm(a_ptr, b_ptr, c_ptr, c_host_desc, bias_ptr, ws_ptr, None, sa_ptr, sb_ptr, 1, M,
                  N, K, splits, k_per_split, stride_am, stride_bn, stride_cm, 0, stride_bias,
                  stride_sam, stride_sak, 0, stride_sbk, stride_sbn, False, BLOCKWISE, A_ROWS,
                  HAS_BIAS, SPLIT, CONSUMERS, BLOCK_N, GROUP_M, STAGES, CONSUMER_REGS,
                  HOST_DESCRIPTORS, SCALE_TMA)

    @gluon.jit(do_not_specialize=["G", "M", "N", "K", "stride_am", "stride_bn", "stride_cm"])
    def fp8_grouped_precise_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, offs_ptr, sa_ptr, sb_ptr,
                                   rows_ptr, G, M, N, K, stride_am, stride_bn,
                                   stride_cm, stride_bias_g, stride_bias_n,
                                   stride_sam, stride_sbg, stride_sbn, HAS_BIAS: gl.constexpr,
                                   CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
                                   GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr):
        """tgemm::scaled_grouped_mm's 2-D A [M, K] x 3-D B [G, K, N] with rowwise scales and
        precise accumulation: group g's rows [offs[g-1], offs[g]) of A and C times B[g], each
        K-contiguous, B's groups dense (stride_bg = N * stride_bn, so that B is one [G * N, K]
        descriptor) and C row-major with 16-byte aligned rows; scale_a per row, scale_b [G, N],
        bias [G, N]. Rows past the last group are not written. Launch with num_warps=4, at
        most one program per SM."""
        _gemm(a_ptr, b_ptr, c_ptr, None, bias_ptr, None, offs_ptr, sa_ptr, sb_ptr, G, M, N, K,
              1, K, stride_am, stride_bn, stride_cm, stride_bias_g, stride_bias_n, stride_sam, 0,
              stride_sbg, 0, stride_sbn, True, False, 1, HAS_BIAS, False, CONSUMERS, BLOCK_N,
              GROUP_M, STAGES, CONSUMER_REGS, False)
