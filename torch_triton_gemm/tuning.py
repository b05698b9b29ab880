"""How a GEMM is launched: plans (kernel, tile, K split), the heuristic, and tuning's candidates.

Configs are data. A *tile* is (BLOCK_M, BLOCK_N, BLOCK_K), the L2 band height GROUP_M and the
launch shape (num_warps, num_stages); a *plan* adds the kernel ("tma": the persistent Hopper
kernel, "portable": the one that runs everywhere), the number of K splits and the Hopper
options. Every call gets a plan without a tuning sweep: from the tuned table when the shape's
bucket was tuned (``torch_triton_gemm.tune`` / ``python -m torch_triton_gemm.tune``, or
``TORCH_TRITON_GEMM_AUTOTUNE=1`` to tune each new bucket on first use), else from the heuristic.
Tuned plans persist in one JSON file per GPU model, Triton version and kernel source (see
``plan_cache``), so a second process re-tunes nothing and a changed kernel never reuses stale
winners.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from . import device as _device
from . import env


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int  # for 16-bit inputs; scaled by element size, see `_for_dtype`
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MMPlan:
    # "tma", "portable", "wgmma_fp8" (see fp8_precise_plan), "wgmma" (WS_KERNEL) or "wgmma-pp"
    # (WS_PINGPONG_KERNEL)
    kernel: str
    tile: TileConfig
    split_k: int = 1
    warp_specialize: bool = False
    epilogue_subtile: int = 1  # TMA stores of C in this many column slices
    # Split only the tiles of the last, partial wave of SMs (the others run whole): that wave's
    # K splits then spread over every SM instead of leaving most of them idle.
    split_tail: bool = False
    # Persistent programs per SM of the TMA kernel: two, where their tiles fit the SM twice,
    # interleave one program's waits (scale loads, epilogue) with the other's tensor-core work.
    programs_per_sm: int = 1
    # Stream-K (TMA kernel, no split_k): the tiles of the last, partial wave and stream_k - 1
    # whole waves before it have their K steps shared evenly by all persistent programs (see
    # kernels/matmul.py); the other tiles run whole. 0: off.
    stream_k: int = 0
    # Operands TMA cannot describe are copied into aligned buffers for the TMA kernel: always
    # (True), never (False: the portable kernel reads them), or by operand size (None; see
    # ops/mm.py's PAD_MIN_SIZE).
    pad: bool | None = None
    # K splits finish their tiles themselves (the last split of a tile adds the partials: one
    # launch, no reduction kernel; see kernels/matmul.py), on the portable and the persistent
    # TMA kernel, up to FIXUP_MAX_SPLITS splits; others keep the reduction. Measured 0.81x the
    # reduction's speed on an H100 (README), so the planner picks it only once its constants
    # cost it; tuning may still find it faster for a shape.
    split_fixup: bool = False
    # The kernel computes the transposed product C^T = B^T A^T (the tile is of that product):
    # products of a few rows then put the weight's rows, not the tokens, along the tile's
    # 64-row side (``swap_plan``). The launcher swaps the operands; no bias.
    swap_ab: bool = False
    # Eager calls of a portable, unscaled K split: one launch whose programs add their tile's
    # splits in split order (no partials in memory, no reduction launch), the bits of the split
    # launches (``plan_model.eager_plan``; kernels/matmul.py's SPLIT_INLINE).
    split_inline: bool = False


# Tiles written for 2-byte inputs; BLOCK_K is rescaled per dtype so that a pipeline stage moves
# the same number of bytes (fp8: x2, fp32: /2).
MM_TILES: tuple[TileConfig, ...] = (
    # Large, compute-bound shapes: 128x256 / 256x128 tiles with 8 warps feed Hopper's wgmma.
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(128, 256, 64, 16, 8, 4),
    TileConfig(256, 128, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 5),
    TileConfig(128, 128, 64, 8, 4, 4),
    TileConfig(128, 128, 32, 8, 4, 5),
    TileConfig(64, 256, 64, 8, 4, 4),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 5),
    # Skinny M (decode, small batches): memory-bound on B, so narrow M tiles, narrow N tiles for
    # enough programs to fill the SMs, and deep K steps to keep many bytes in flight.
    TileConfig(16, 32, 256, 1, 4, 4),
    TileConfig(16, 32, 128, 1, 4, 8),
    TileConfig(16, 64, 256, 1, 4, 4),
    TileConfig(16, 64, 128, 1, 4, 6),
    TileConfig(16, 64, 128, 1, 2, 8),
    TileConfig(16, 128, 128, 1, 4, 4),
    TileConfig(16, 128, 64, 1, 4, 8),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(32, 128, 128, 4, 4, 4),
    TileConfig(64, 64, 128, 4, 4, 4),
)

# Tile for Triton's CPU interpreter: it pays per program and per K step in Python, and CI sizes
# are small, so one modest tile serves every shape there.
INTERPRETER_TILE = TileConfig(32, 32, 32, 4, 4, 1)

# moe_mlp's elementwise kernels (kernels/glu.py, kernels/combine.py): BLOCK_M rows (slots or
# tokens) a program, BLOCK_N columns a step or a program, num_warps; the interpreter takes wide
# steps (per-step cost).
MOE_ELEMENTWISE_TILE = (32, 128, 4)
INTERPRETER_MOE_ELEMENTWISE_TILE = (16, 64, 1)
# The gated activation's backward walks a row block's columns in one program (its row sums stay
# in one program: deterministic), so its grid has only S / BLOCK_M programs: 8 rows of 256
# columns (S / 8 programs) took 12-14% less time than 32 x 128 at Mixtral and Qwen3 sizes and
# came within 4% of the best of 16 tiles on each (H200; docs/data/glu-tiles-h200.csv).
MOE_GLU_BACKWARD_TILE = (8, 256, 4)

# Split K only while a split keeps at least this many BLOCK_K steps: fewer, and the partial
# tiles' write and re-read cost more than the parallelism gains.
MIN_K_STEPS_PER_SPLIT = 4
MAX_SPLIT_K = 64
# Split-K partials up to this size stay in L2 (50 MB on an H100), so they cost little traffic.
L2_RESIDENT_BYTES = 16 << 20
# A shape is "deep" when K is this many times its larger output side: few output tiles, long K
# loops, so larger tiles (more reuse per loaded byte) and K splits to fill the SMs win.
DEEP_K_RATIO = 4

_AUTOTUNE_ENV = "TORCH_TRITON_GEMM_AUTOTUNE"


@functools.cache
def autotune_enabled() -> bool:
    """Tune each new bucket on first use: ``TORCH_TRITON_GEMM_AUTOTUNE=1`` (read once), GPU only."""
    if _device.interpreter_enabled():
        return False
    return env.flag(_AUTOTUNE_ENV, False)


def size_bucket(x: int) -> int:
    """Power-of-two bucket of a size: tuned plans are kept per bucket of each dimension."""
    return 1 << (x - 1).bit_length() if x > 1 else 1


def _for_dtype(tile: TileConfig, element_size: int) -> TileConfig:
    block_k = max(16, tile.block_k * 2 // element_size)
    return dataclasses.replace(tile, block_k=block_k)


def shared_memory_bytes(tile: TileConfig, element_size: int) -> int:
    return (tile.block_m + tile.block_n) * tile.block_k * element_size * tile.num_stages


def remainder_step(tile: TileConfig, element_size: int) -> int:
    """The K step in which the portable kernels load what is left of K after the whole BLOCK_K
    steps (``TAIL_K`` of ``kernels/tiles.py``'s ``k_loop``, which says why): the longest of
    BLOCK_K, BLOCK_K / 2, ... whose loads and half the accumulator stay within 84 values a
    thread of 4 warps, at least 16; 32 for 1-byte inputs; at most BLOCK_K."""
    limit = (84 * 128 - tile.block_m * tile.block_n // 2) // (tile.block_m + tile.block_n)
    fit = next((tile.block_k // d for d in (1, 2, 4, 8) if tile.block_k // d <= limit),
               tile.block_k // 16)
    step = 32 if element_size == 1 else max(fit, 16)
    return min(step, tile.block_k)


def k_loop_steps(k: int, tile: TileConfig, element_size: int) -> int:
    """The K steps a portable-kernel program takes through ``k`` columns: the whole BLOCK_K
    steps, then the remainder's (``remainder_step``)."""
    whole, left = divmod(k, tile.block_k)
    return whole + -(-left // remainder_step(tile, element_size))


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) for splitting K into ``split_k`` parts of whole BLOCK_K steps; the
    count can come out lower than asked so that no split is empty."""
    if split_k <= 1 or k <= block_k:
        return 1, k
    k_steps = -(-k // block_k)
    k_per_split = -(-k_steps // split_k) * block_k
    return -(-k // k_per_split), k_per_split


def output_tiles(m: Any, n: Any, tile: TileConfig) -> Any:
    """How many of ``tile``'s [block_m, block_n] tiles cover an m x n output (sizes may be
    symbolic)."""
    return tile_count(m, n, tile.block_m, tile.block_n)


def tile_count(m: Any, n: Any, block_m: int, block_n: int) -> Any:
    """How many [block_m, block_n] tiles cover an m x n output (sizes may be symbolic)."""
    return ((m + block_m - 1) // block_m) * ((n + block_n - 1) // block_n)


def stream_k_tiles(tiles: int, programs: int, stream_k: int) -> int:
    """How many of ``tiles`` output tiles a stream-K launch of ``programs`` persistent programs
    shares out by K steps: the partial last wave and ``stream_k - 1`` whole waves before it
    (all of them below one wave; none when the waves come out even)."""
    if stream_k <= 0 or tiles % programs == 0:
        return 0
    return min(tiles, tiles % programs + (stream_k - 1) * programs)


def _most_splits(k: int, block_k: int) -> int:
    """The most K splits that keep MIN_K_STEPS_PER_SPLIT BLOCK_K steps each (at most
    MAX_SPLIT_K)."""
    return min(MAX_SPLIT_K, -(-k // block_k) // MIN_K_STEPS_PER_SPLIT)


def _wave_fill(units: int, num_sms: int) -> float:
    """The busy fraction of the SM waves that ``units`` equal work units take."""
    return units / (-(-units // num_sms) * num_sms)


def split_tiles(tiles: int, split_k: int, split_tail: bool, num_sms: int) -> tuple[int, int]:
    """(tiles computed whole, K splits of the others) for an output of ``tiles`` tiles: with
    ``split_tail`` the whole waves of ``num_sms`` tiles run unsplit and only the rest is split
    (no split when nothing is left over), else every tile is split."""
    if split_k <= 1:
        return tiles, 1
    dp_tiles = tiles // num_sms * num_sms if split_tail else 0
    if dp_tiles == tiles:
        return tiles, 1
    return dp_tiles, split_k


def _split_for(m: int, n: int, k: int, tile: TileConfig, num_sms: int,
               element_size: int = 2) -> int:
    """K splits for an output with too few tiles to keep the SMs busy (under half of them).

    Work units (tiles x splits) run in waves of num_sms; the last wave's idle SMs are wasted, so
    the split is the smallest that fills at least 90% of its waves (or the best filling one).
    Each split writes and re-reads an fp32 partial of C: unless the partials stay in L2, splits
    that would add more than a quarter of the operands' bytes are not taken.
    """
    tiles = output_tiles(m, n, tile)
    if tiles >= 0.5 * num_sms:
        return 1
    most = _most_splits(k, tile.block_k)
    operand_bytes = (m * k + k * n) * element_size
    best, best_fill = 1, 0.0
    for split in range(1, most + 1):
        partial_bytes = split * m * n * 4
        if split > 1 and partial_bytes > L2_RESIDENT_BYTES and 2 * partial_bytes > (
                0.25 * operand_bytes):
            break
        units = tiles * split
        fill = _wave_fill(units, num_sms)
        if fill >= 0.9:
            return split
        if fill > best_fill:
            best, best_fill = split, fill
    return best


# The warp-specialized precise fp8 kernel (kernels/wgmma_fp8.py): 64 output rows per consumer
# warpgroup, 128 columns, 128-deep K steps.
FP8_PRECISE_KERNEL = "wgmma_fp8"
# It applies from this fraction of a wave of its own output tiles on (from
# FP8_PRECISE_PARTIAL_WAVE_ROWS rows; fewer need a full wave of 128x128 tiles), and walks them
# in L2 bands of FP8_PRECISE_GROUP_M tile rows (grouped products: FP8_GROUPED_PRECISE_GROUP_M).
FP8_PRECISE_MIN_WAVES = 0.7
FP8_PRECISE_PARTIAL_WAVE_ROWS = 256
FP8_PRECISE_GROUP_M = 4
# Tensorwise and rowwise products with K of at least FP8_PRECISE_DEEP_K take it from
# FP8_PRECISE_DEEP_K_MIN_ROWS rows and FP8_PRECISE_DEEP_K_MIN_WAVES of a wave of 128x128 tiles.
FP8_PRECISE_DEEP_K = 8192
FP8_PRECISE_DEEP_K_MIN_ROWS = 64
FP8_PRECISE_DEEP_K_MIN_WAVES = 0.5
FP8_GROUPED_PRECISE_GROUP_M = 8


def fp8_precise_plan(m: int, n: int, num_sms: int, out_size: int, k: int = 0,
                     scaling: str = "block") -> MMPlan | None:
    """The plan of Hopper's warp-specialized kernel for an fp8 product with precise
    accumulation (tensorwise, rowwise or blockwise scales), or None where it does not apply:
    M under 128 (decode: the 16- and 32-row tiles stream the weights; M = 16 against N = 28672
    ran 0.86x torch here, 0.94x on a 16-row tile), or its own tiles fill less than 0.7 of a
    wave of SMs (or M is under 256, where that was not timed) and 128x128 tiles less than one
    (the earlier rule, kept for the products it took). Below that, 64-row tiles of the
    portable kernel fill the SMs better: Llama-3-8B's o and down projections at M = 256 (64
    tiles) ran 0.77-1.04x torch._scaled_mm on them against 0.73-0.84x here.

    Three consumer warpgroups (192-row tiles) and 4 stages where the shared memory holds them,
    else 3: on an H100 they ran 2-15% faster than two (128 rows) at M = 2048-8192; two where
    192-row tiles would pad M by 8% more rows than 128-row ones (M = 1024: 1152 rows).
    Bands of 4 tile rows: on the Llama-3-8B projections at M = 2048 and 4096^3 (every plan
    timed, docs/data/fp8-m2048-h100.csv) they tied or beat bands of 8 (up to 0.89x -> 0.97x
    torch); held out (docs/data/fp8-group-m-ab-h100.csv: 4096 x 18944 x 3584, M = 8192
    products, three other models' projections at M = 1536-6144, tensorwise, rowwise and
    blockwise) 1.01x faster over 126 products, from 0.96x to 1.08x.

    The 0.7 wave (one wave of 128x128 tiles before) comes from every plan timed on the
    Llama-3-8B projections at M = 256-1024, tensorwise and rowwise
    (docs/data/fp8-mid-m-h100.csv): at 96 and 128 tiles this kernel ran 0.89-0.95x torch, the
    TMA kernel's precise plans 0.66-0.72x. Held out (Qwen2.5-7B's o and down projections at
    M = 448, 112 tiles; docs/data/fp8-ab-h100.csv), the products it moves here ran 1.21-1.36x
    faster (tensorwise, rowwise and blockwise).

    Tensorwise and rowwise products (``scaling`` "outer"; K given) also take it where their
    K is deep (FP8_PRECISE_DEEP_K) and 128-row tiles fill FP8_PRECISE_DEEP_K_MIN_WAVES of a
    wave (and less than one), from 64 rows: 128-row tiles, or one 192-row tile row for
    129-192 rows (B read once) where ``_fp8_narrow_plan`` does not take the product. Up to
    FP8_SLIVER_PRECISE_MAX_ROWS rows they leave it for ``heuristic_mm_plan``'s 64x128 tiles
    where 128-row tiles would spill a sliver into a second wave (``fp8_second_wave_sliver``).
    Read off every plan timed on random products of 33-512 rows on an H100
    (docs/data/fp8-mid-rows-h100-seed2071.csv, -seed2072.csv): 91 x 9856 x 9456 ran 0.45 ->
    0.82x torch._scaled_mm, 174 x 6576 x 13360 0.52 -> 0.65x, 345-372 rows against 2768-5024
    columns, K 11648-15616, 0.60-0.75 -> 0.84-0.97x; 140 x 9232 x 4160 and 184 x 8976 x 6144
    (1.08-1.11 waves of 128-row tiles) 0.74 / 0.84 -> 0.83 / 0.94x. On held-out products
    (42 layer shapes of 80-330 rows and random seed 2074, planner picks timed against the
    rules before, docs/data/fp8-mid-rows-ab-h100.csv) the first form of these rules moved 33
    products, 1.14x and 1.23x faster in geomean but 8 slower (0.67-0.98x): the 0.45-wave
    bound at 80-112 x 7680 x 10240 (0.84x), 192-row tiles where the narrow rule had 64x64
    tiles (150 x 5120 x 12288, 179 x 4352 x 14848: 0.73x, 0.67x) and the sliver rule against
    the precise kernel's 128-row tiles at 200-240 rows (0.98-1.02x): hence the 0.5 bound,
    the narrow rule's precedence and the row limit. The 25 moves left ran 1.03-2.10x faster.
    At K = 4096 the 64-row tiles of the portable kernel stay (Llama-3-8B's o at M = 256,
    above); so do fewer rows (35 x 8992 x 11680: 0.87x there, 0.80x here).

    Blockwise products (``scaling`` "block"; K given) of 65-128 rows take
    ``_blockwise_ws_split_plan``'s K splits first, where it has one."""
    if scaling == "block":
        split = _blockwise_ws_split_plan(m, n, k, num_sms, out_size)
        if split is not None:
            return split
    if scaling == "outer" and m <= FP8_SLIVER_PRECISE_MAX_ROWS and fp8_second_wave_sliver(
            m, n, num_sms):
        return None
    if scaling == "outer" and m >= FP8_PRECISE_DEEP_K_MIN_ROWS and k >= FP8_PRECISE_DEEP_K and (
            FP8_PRECISE_DEEP_K_MIN_WAVES * num_sms <= tile_count(m, n, 128, 128) < num_sms) and (
            not 128 < m <= 192 or _fp8_narrow_plan(m, n, k, num_sms) is None):
        return MMPlan(FP8_PRECISE_KERNEL, _fp8_precise_fitted_tile(
            3 if 128 < m <= 192 else 2, out_size, FP8_PRECISE_GROUP_M))
    if m < 128:
        return None
    tile = _fp8_precise_tile(m, out_size, FP8_PRECISE_GROUP_M,
                             n if scaling == "outer" else 0, num_sms)
    column_tiles = -(-n // 128)
    partial_wave = (m >= FP8_PRECISE_PARTIAL_WAVE_ROWS and -(-m // tile.block_m) * column_tiles
                    >= FP8_PRECISE_MIN_WAVES * num_sms)
    if not partial_wave and -(-m // 128) * column_tiles < num_sms:
        return None
    return MMPlan(FP8_PRECISE_KERNEL, tile)


# Blockwise fp8 products of this many rows to 128, K at least BLOCKWISE_WS_SPLIT_MIN_K, take
# ``_blockwise_ws_split_plan``.
BLOCKWISE_WS_SPLIT_MIN_ROWS = 65
BLOCKWISE_WS_SPLIT_MIN_K = 3072


def _blockwise_ws_split_plan(m: int, n: int, k: int, num_sms: int,
                             out_size: int) -> MMPlan | None:
    """The K-split plan of Hopper's warp-specialized kernel for a blockwise fp8 product of
    BLOCKWISE_WS_SPLIT_MIN_ROWS to 128 rows and K of at least BLOCKWISE_WS_SPLIT_MIN_K whose
    128x128 tiles leave at least half the SMs idle, else None: one row of 128x128 tiles (B read
    once, each split streaming its K range through the loader's TMA ring, blockwise scales
    applied per 128 of K as unsplit): of ``ws_split_plans``' 128x128 plans, the one of most
    splits whose units (tiles x splits) still fit one wave. The 64x64 portable tiles of
    ``_blockwise_small_plan`` wait on their scales' loads at every K step. On an H200, every
    such plan timed on the Llama-3-8B projections at M = 128 with fewer 128x128 tiles than SMs
    (docs/data/fp8-ws-split-plans-h200-d1886ba.csv): qkv 21.2 -> 19.1 us, o 19.6 -> 16.3, down
    49.9 -> 31.7 (the fastest plan timed, or within 1% of it). Held out
    (docs/data/fp8-blockwise-ws-split-ab-h200.csv: ten projections of Qwen2.5-7B, Llama-3-70B,
    DeepSeek-V3, Phi-3 and Llama-3-8B at M = 80, 96, 112, 128, both arms in one run), the first
    form of the rule moved 40 products: 7168 x 2048 (K = 2048, 56 tiles) ran 0.87-1.02x against
    the size rules' unsplit 128x64 tiles, hence the K bound; the 36 moves left ran 1.45x faster
    in geomean (1.16-1.91x; K = 3072: 1.19-1.26x)."""
    if not (BLOCKWISE_WS_SPLIT_MIN_ROWS <= m <= 128 and k >= BLOCKWISE_WS_SPLIT_MIN_K):
        return None
    # (ws_split_plans keeps the splits whose shared memory fits, of whole K steps and at
    # least WS_MIN_STEPS_PER_SPLIT steps each.)
    splits = [p for p in ws_split_plans(m, n, k, 1, out_size, num_sms)
              if (p.tile.block_m, p.tile.block_n) == (128, 128) and p.split_k > 1
              and output_tiles(m, n, p.tile) * p.split_k <= num_sms]
    return max(splits, key=lambda p: p.split_k, default=None)


# Tensorwise and rowwise fp8 products with fast accumulation of 65-128 rows and K of at least
# FP8_PRECISE_DEEP_K take ``fp8_deep_k_half_rows``'s 64x128 tiles from this fraction of a wave
# of 128x128 tiles.
FP8_DEEP_K_FAST_MIN_WAVES = 0.55


def fp8_deep_k_half_rows(m: int, n: int, k: int, num_sms: int) -> bool:
    """Whether a tensorwise or rowwise fp8 product with fast accumulation of 65-128 rows (two
    64-row tiles), K of FP8_PRECISE_DEEP_K or more and 128x128 tiles for
    FP8_DEEP_K_FAST_MIN_WAVES to one wave takes 64x128 tiles on the portable kernel
    (``heuristic_mm_plan``) rather than the narrow rule's 64x64 ones. On an H100 (every plan
    timed: Llama-3-70B-like and other N x K of 10240-14336 x 8192-12288 at 80-128 rows,
    docs/data/fp8-deep-k-fast-h100.csv) 0.77-0.92 -> 0.92-1.02 of torch._scaled_mm (1.05-1.27x);
    at 0.48 of a wave (8192 x 28672) and at 64 rows the 64x64 tiles stayed faster. Held out
    (N x K 11008 x 8192, 13824 x 10240, 15360 x 9216 at 72-120 rows, the planner's picks
    before and after, same run, docs/data/fp8-deep-k-fast-ab-h100.csv): all 12 moves faster,
    1.04-1.18x, 0.87 -> 0.96 of torch in geomean."""
    return (64 < m <= 128 and k >= FP8_PRECISE_DEEP_K
            and FP8_DEEP_K_FAST_MIN_WAVES * num_sms <= tile_count(m, n, 128, 128) < num_sms)


# Tensorwise and rowwise fp8 products of more rows than this and at most FP8_SLIVER_MAX_ROWS
# whose 128x128 tiles make one wave and at most FP8_SLIVER_MAX_WAVES (a second wave of a few
# tiles), and whose 128x256 tiles fill under FP8_SLIVER_WIDE_WAVES of one (where the size
# rules take 128x256 tiles), run 64x128 tiles on the portable kernel (``heuristic_mm_plan``).
FP8_SLIVER_MAX_ROWS = 256
FP8_SLIVER_MAX_WAVES = 1.2
FP8_SLIVER_WIDE_WAVES = 0.6
# ... with precise accumulation, up to this many rows (above, the precise kernel's 128-row tiles
# tied with them).
FP8_SLIVER_PRECISE_MAX_ROWS = 192


def fp8_second_wave_sliver(m: int, n: int, num_sms: int) -> bool:
    """Whether a tensorwise or rowwise fp8 product of 129-256 rows would leave a sliver of
    128x128 tiles to a second wave (over one wave, at most FP8_SLIVER_MAX_WAVES) where
    128x256 tiles fill under FP8_SLIVER_WIDE_WAVES of one: its 64x128 tiles, twice as many
    and two to an SM, then finish together. On an H100 (every plan timed,
    docs/data/fp8-mid-rows-h100-seed2072.csv): 140 x 9232 x 4160 with fast accumulation
    0.44 -> 0.80x torch._scaled_mm, 184 x 8976 x 6144 0.59 -> 1.00x (precise: see
    ``fp8_precise_plan``); at 1.29 and 1.48 waves (211 x 10864, 227 x 12448) the 128-row plans
    stayed faster."""
    tiles = tile_count(m, n, 128, 128)
    return (128 < m <= FP8_SLIVER_MAX_ROWS and num_sms < tiles <= FP8_SLIVER_MAX_WAVES * num_sms
            and tile_count(m, n, 128, 256) < FP8_SLIVER_WIDE_WAVES * num_sms)


def _fp8_precise_tile(rows: int, out_size: int, group_m: int, n: int = 0,
                      num_sms: int = 0) -> TileConfig:
    """The precise fp8 kernel's tile for ``rows`` rows (of a group), in bands of ``group_m``
    tile rows: three consumers unless 192-row tiles pad the rows by 8% more than 128-row
    ones, or (given ``n`` and ``num_sms``) where 128-row tiles make one to 1.5 waves and
    192-row ones one (397 x 4736 x 4496 on an H100: 0.63 -> 0.81x torch._scaled_mm,
    docs/data/fp8-mid-rows-h100-seed2072.csv); 4 stages where the shared memory holds them
    (operand slots and a C tile per consumer), else fewer."""
    consumers = 3 if -(-rows // 192) * 192 <= 1.08 * (-(-rows // 128) * 128) else 2
    if n and num_sms < tile_count(rows, n, 128, 128) <= 1.5 * num_sms and (
            tile_count(rows, n, 192, 128) <= num_sms):
        consumers = 3
    return _fp8_precise_fitted_tile(consumers, out_size, group_m)


def _fp8_precise_fitted_tile(consumers: int, out_size: int, group_m: int) -> TileConfig:
    """The precise fp8 kernel's tile of ``consumers`` warpgroups with 4 stages where the shared
    memory holds them, else fewer."""
    stages = 4
    while stages > 2 and not fp8_precise_fits(consumers, stages, out_size):
        stages -= 1
    return _fp8_precise_tile_of(consumers, stages, group_m)


def _fp8_precise_shared(consumers: int, stages: int, out_size: int) -> int:
    """Shared memory of the precise fp8 kernel: ``stages`` slots of A (64 rows per consumer)
    and B (128 columns) 128 fp8 values deep, with blockwise scale_a's 64 fp32 values per
    consumer (counted for every recipe), and a C tile per consumer."""
    return (stages * ((consumers * 64 + 128) * 128 + consumers * 64 * 4)
            + consumers * 64 * 128 * out_size)


def fp8_precise_fits(consumers: int, stages: int, out_size: int, spare: int = 0) -> bool:
    """Whether the precise fp8 kernel's shared memory (``_fp8_precise_shared``) fits this
    GPU's with ``spare`` bytes left."""
    return _fp8_precise_shared(consumers, stages, out_size) + spare <= (
        _device.shared_memory_per_block(0))


# Shared memory a precise fp8 launch must leave spare for its loader to bring blockwise scales
# by TMA (kernels/wgmma_fp8.py's SCALE_TMA): on the tightest variant that fits (2 consumers, 5
# stages, fp32 out) Triton counted 288 bytes over _fp8_precise_shared (barriers, alignment),
# leaving 224 of an H100's 232448; closer variants keep their scales in registers.
FP8_SCALE_TMA_SPARE_BYTES = 1024


def _fp8_precise_tile_of(consumers: int, stages: int, group_m: int) -> TileConfig:
    # TileConfig's block_k is written for 2-byte inputs (see _for_dtype): 64 is 128 fp8 values.
    return TileConfig(64 * consumers, 128, 64, group_m, 4, stages)


# tgemm::mm's 16-bit plans on the same warp-specialized kernel (kernels/wgmma_fp8.py's
# ws_gemm_kernel, sm_90): persistent, unsplit, 64 output rows per consumer warpgroup (two or
# three: 192-row tiles, which the Triton kernels' power-of-two blocks cannot make), 64-deep K
# steps. The tiles that led on an H200 probe of 64 shapes (docs/data/wgmma-probe-h200.csv): 128x256
# in three stages, 128x128 in four, 192x128 in four.
WS_KERNEL = "wgmma"
WS_TILES: tuple[TileConfig, ...] = (TileConfig(128, 256, 64, 8, 4, 3),
                                    TileConfig(128, 128, 64, 8, 4, 4),
                                    TileConfig(192, 128, 64, 8, 4, 4))


# The same kernel's ping-pong form (ws_gemm_kernel's PINGPONG): two consumers on alternate tiles of
# 128 rows each, taking turns at their K loops over one ring of num_stages slots (a consumer's
# 128 x 256 accumulator would not fit its registers).
WS_PINGPONG_KERNEL = "wgmma-pp"
WS_PINGPONG_TILES: tuple[TileConfig, ...] = (TileConfig(128, 128, 64, 8, 4, 5),)


def warp_specialized(plan: MMPlan) -> bool:
    """Whether ``plan`` runs on the warp-specialized Gluon kernel's 16-bit forms."""
    return plan.kernel in (WS_KERNEL, WS_PINGPONG_KERNEL)


def ws_shared_bytes(tile: TileConfig, out_size: int) -> int:
    """Shared memory of a 16-bit plan on the warp-specialized kernel (either form): its stages
    of A and B tiles, a C tile (every consumer's rows) in the output's dtype, and up to 4 KiB
    of barriers and the epilogue's layout conversions (2.1 KiB in the sm_90 build of 128x256
    with a bias)."""
    return (tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
            + tile.block_m * tile.block_n * out_size + 4096)


def ws_plans(out_size: int) -> list[MMPlan]:
    """The 16-bit plans of the warp-specialized kernel (WS_TILES, and WS_PINGPONG_TILES of its
    ping-pong form) whose shared memory fits the GPU."""
    limit = _device.shared_memory_per_block(0)
    return [MMPlan(WS_KERNEL, tile) for tile in WS_TILES
            if ws_shared_bytes(tile, out_size) <= limit] + [
        MMPlan(WS_PINGPONG_KERNEL, tile) for tile in WS_PINGPONG_TILES
        if ws_shared_bytes(tile, out_size) <= limit]


# K splits of the same kernel (ws_gemm_kernel's SPLIT, 16-bit and precise fp8) for products
# whose tiles leave SMs idle, decode-like and few-row ones above all: each SM streams its
# share of the weights through the loader's TMA ring, and the fp32 partials are added by
# splitk_reduce_kernel. 64-row tiles (one consumer) for up to 64 rows.
WS_SPLIT_TILES: tuple[TileConfig, ...] = (TileConfig(64, 128, 64, 8, 4, 6),
                                          TileConfig(64, 256, 64, 8, 4, 4),
                                          TileConfig(128, 128, 64, 8, 4, 4),
                                          TileConfig(128, 256, 64, 8, 4, 3))
WS_SPLIT_COUNTS = (2, 3, 4, 6, 8, 12)
# A split keeps at least this many K steps (128 bytes of a row each).
WS_MIN_STEPS_PER_SPLIT = 4


def ws_split_plans(m: int, n: int, k: int, element_size: int, out_size: int,
                   num_sms: int) -> list[MMPlan]:
    """The warp-specialized kernel's plans with K splits for an m x n x k product (16-bit, or
    precise fp8 for ``element_size`` 1: 128-column tiles, which blockwise scales need): every
    WS_SPLIT_TILES tile whose shared memory fits, split WS_SPLIT_COUNTS ways where each split
    keeps WS_MIN_STEPS_PER_SPLIT K steps and the units (tiles x splits) stay within four
    waves of SMs; the 64-row tiles unsplit too. What the plan sweep and autotuning time."""
    limit = _device.shared_memory_per_block(0)
    step = 128 // element_size  # K elements a step
    steps = -(-k // step)
    plans = []
    for tile in WS_SPLIT_TILES:
        if element_size == 1:
            if tile.block_n != 128:
                continue
            kernel = FP8_PRECISE_KERNEL
            fits = fp8_precise_fits(tile.block_m // 64, tile.num_stages, out_size)
        else:
            kernel = WS_KERNEL
            fits = ws_shared_bytes(tile, out_size) <= limit
        if not fits:
            continue
        tiles = output_tiles(m, n, tile)
        for split in ((1,) if tile.block_m == 64 else ()) + WS_SPLIT_COUNTS:
            if split > 1 and (steps < split * WS_MIN_STEPS_PER_SPLIT or tiles * split > 4 * num_sms
                              or effective_split(k, step, split)[0] != split):
                continue
            plans.append(MMPlan(kernel, tile, split))
    return plans


def fp8_precise_plans(out_size: int) -> list[MMPlan]:
    """Every plan of the precise fp8 kernel whose shared memory fits the GPU (2 or 3
    consumers, 3 to 5 stages, L2 bands of 4 to 16 tile rows): what the plan sweep times."""
    return [MMPlan(FP8_PRECISE_KERNEL, _fp8_precise_tile_of(consumers, stages, group_m))
            for consumers in (2, 3) for stages in (3, 4, 5) for group_m in (4, 8, 16)
            if fp8_precise_fits(consumers, stages, out_size)]


def fp8_grouped_precise_tile(m: int, n: int, groups: int, num_sms: int,
                             out_size: int) -> TileConfig | None:
    """The tile of Hopper's warp-specialized kernel for a 2-D x 3-D grouped fp8 product with
    precise accumulation (rows m split among ``groups``), or None where it does not apply:
    groups of fewer than 128 rows on average, or fewer 128x128 tiles than SMs. The tile
    ``fp8_precise_plan`` picks for the average group's rows, in bands of 8 tile rows (not
    timed against 4 on grouped products)."""
    per_group = m // max(groups, 1)
    if per_group < 128 or max(groups, 1) * -(-per_group // 128) * -(-n // 128) < num_sms:
        return None
    return _fp8_precise_tile(per_group, out_size, FP8_GROUPED_PRECISE_GROUP_M)


def heuristic_mm_plan(m: int, n: int, k: int, element_size: int, tma: bool,
                      num_sms: int, out_size: int = 4, a_k_contiguous: bool = True,
                      scaling: str = "none", fast_accum: bool = False) -> MMPlan:
    """The plan used for a shape nobody tuned where the plan model does not choose (fp32 and
    fp8 operands, scaled recipes, GPUs without fitted costs; see ``plan_model.modelled_plan``),
    from its size class (rules read off kernel-only
    timings of every candidate plan on an H100: ``python -m torch_triton_gemm.tune --report``).

    - M <= 32 (decode, small batches): memory-bound on B; 16- or 32-row tiles on the portable
      kernel (it streamed B faster than TMA there), K split until about one SM wave is busy
      (tensorwise and rowwise fp8 at 2-16 rows: ``_fp8_decode_tile``, unsplit, where its
      tiles fill enough SMs);
    - M <= 128: 128x128 tiles on the TMA kernel when they fill a wave, else 64- or 128-row
      tiles (B read once), 64 wide, deep K steps, K split likewise;
    - operands TMA cannot describe (odd leading dimensions): 128x128 tiles, 5 stages, and a
      K split when the tiles leave SMs idle;
    - deep K (K >= 4 x max(M, N)): 128x128 tiles (64x64 when even those are very few), K split;
      4 warps when A is M-contiguous (weight gradients, x.t() @ dy: 0.77x cuBLAS against 0.70x
      with 8 warps at 1024x1024x8192);
    - at least 0.6 of a wave of 128x256 tiles: the persistent TMA kernel with 128x256 tiles,
      its epilogue stored in two slices (wide L2 bands and 4 stages below two waves);
    - otherwise 128x128 tiles when they fill most SMs, else 64x128 tiles;
    - fp8 recipes of scaled_mm (``scaling`` "outer" or "block", ``fast_accum``) adjust the TMA
      plans, see ``_scaled_tma_plan``; blockwise products of at most 128 rows take
      ``_blockwise_small_plan``, tensorwise and rowwise ones of 33-256 rows
      ``_fp8_narrow_plan``, except 64x128 portable tiles where 128x128 ones would leave a
      sliver of a second wave (``fp8_second_wave_sliver``) or, with fast accumulation, 65-128
      rows have a deep K (``fp8_deep_k_half_rows``).
    """
    if _device.interpreter_enabled():
        return MMPlan("portable", INTERPRETER_TILE)
    # An empty output launches nothing; planning it as one row or column keeps the rules total.
    m, n, k = max(m, 1), max(n, 1), max(k, 1)

    def tiles(bm: int, bn: int) -> int:
        return tile_count(m, n, bm, bn)

    kernel = "portable"
    if scaling == "block" and m <= BLOCKWISE_SMALL_ROWS:
        small = _blockwise_small_plan(m, n, k, num_sms)
        if small is not None:
            return small
    if scaling == "outer" and tma and (fp8_second_wave_sliver(m, n, num_sms) or (
            fast_accum and fp8_deep_k_half_rows(m, n, k, num_sms))):
        tile = _fit_shared_memory(_for_dtype(TileConfig(64, 128, 64, 8, 4, 4), element_size),
                                  element_size, _device.shared_memory_per_block(0))
        return MMPlan("portable", tile)
    if scaling == "outer" and FP8_NARROW_MIN_ROWS < m <= FP8_NARROW_MAX_ROWS:
        narrow = _fp8_narrow_plan(m, n, k, num_sms)
        if narrow is not None:
            return narrow
    if m <= 16:
        tile, split = _decode_tile_and_split(n, k, element_size, num_sms)
        fp8_tile = _fp8_decode_tile(n, num_sms) if scaling == "outer" and m > 1 else None
        if fp8_tile is not None:
            tile, split = fp8_tile, 1
        tile = _fit_shared_memory(tile, element_size, _device.shared_memory_per_block(0))
        return MMPlan("portable", tile, split)
    if m <= 32:
        tile = TileConfig(32, 64, 128, 4, 4, 4)
    elif m <= 128 and tma and tiles(128, 128) >= num_sms:
        # Wide enough for a wave of 128x128 tiles (M = 128 against N = 28672: 0.97x cuBLAS
        # against 0.90x for the 64-wide tiles below).
        kernel = "tma"
        tile = TileConfig(128, 128, 64, 8, 8, 5)
    elif m <= 128:
        # Still bound by B's bytes: one tile row covers all of M, so B is read once.
        tile = TileConfig(64 if m <= 64 else 128, 64, 128, 4, 4, 4)
    elif not tma:
        tile = TileConfig(128, 128, 64, 8, 8, 5)
    elif k >= DEEP_K_RATIO * max(m, n):
        kernel = "tma"
        if tiles(128, 128) < 16:
            tile = TileConfig(64, 64, 128, 4, 4, 4)
        elif a_k_contiguous:
            tile = TileConfig(128, 128, 64, 8, 8, 5)
        else:
            tile = TileConfig(128, 128, 64, 8, 4, 4)
    elif tiles(128, 256) >= 2 * num_sms:
        kernel = "tma"
        tile = TileConfig(128, 256, 64, 8, 8, 3)
    elif tiles(128, 256) >= 0.6 * num_sms:
        kernel = "tma"
        tile = TileConfig(128, 256, 64, 16, 8, 4)
    elif tiles(128, 128) >= 0.7 * num_sms:
        kernel = "tma"
        tile = TileConfig(128, 128, 64, 8, 8, 5)
    else:
        tile = TileConfig(64, 128, 64, 8, 4, 4)
    tma = kernel == "tma" and tma
    subtile = epilogue_subtile(tile)
    smem = _device.shared_memory_per_block(0)
    if tma:
        smem -= tma_epilogue_bytes(tile, out_size, subtile)
    tile = _fit_shared_memory(_for_dtype(tile, element_size), element_size, smem)
    split = _split_for(m, n, k, tile, num_sms, element_size)
    if tma:
        plan = MMPlan("tma", tile, split, epilogue_subtile=subtile)
        return _scaled_tma_plan(plan, m, n, k, num_sms, scaling, fast_accum)
    return MMPlan("portable", tile, split)


def _scaled_tma_plan(plan: MMPlan, m: int, n: int, k: int, num_sms: int, scaling: str,
                     fast_accum: bool) -> MMPlan:
    """The heuristic's TMA plan for an fp8 recipe of scaled_mm (fp8 operands, so BLOCK_K counts
    bytes as it is):

    - "block": each K step waits for its scales' loads (Triton pipelines only the loads that
      feed a dot), so unsplit plans run 64x128x128 tiles with 4 warps, two programs per SM,
      whose waits interleave (8192^3 on an H100: 640-680 against 490-510 TFLOP/s with 128x256
      tiles);
    - "outer" without fast accumulation: each K step's product is added to the fp32
      accumulator, which stalls the tensor cores once per step; 128x128 tiles with 256-deep K
      steps halve those stalls (1018 against 865 TFLOP/s at 8192^3 on an H100, the same error);
    - "outer" with fast accumulation, 128x256 tiles for 0.6 to 2 waves of the SMs: 128x128
      tiles with 4 warps where their last wave is fuller by FP8_HALF_TILE_FILL_GAIN (on an
      H100: Llama-3-8B's qkv at M = 1024, 1.45 against 2.9 waves, 0.80x -> 0.88x
      torch._scaled_mm, docs/data/fp8-mid-m-h100.csv; held out, docs/data/fp8-ab-h100.csv:
      Llama-3-70B's, Mistral-Nemo's and Qwen2.5-7B's projections at M = 448-1536, 1.05-1.15x
      faster. Not from two waves on: wide gate/up projections at 3.4 waves ran 0.84-1.02x as
      fast).
    """
    tile = plan.tile
    if scaling == "block" and tile.block_m == 128 and plan.split_k == 1:
        return dataclasses.replace(plan, tile=TileConfig(64, 128, 128, tile.group_m, 4, 3),
                                   epilogue_subtile=2, programs_per_sm=2)
    if (scaling == "outer" and not fast_accum
            and (tile.block_m, tile.block_n, tile.block_k) == (128, 256, 128)):
        deep = TileConfig(128, 128, 256, tile.group_m, 8, 3)
        return MMPlan("tma", deep, _split_for(m, n, k, deep, num_sms, 1), epilogue_subtile=2)
    wide = tile_count(m, n, 128, 256)
    if (scaling == "outer" and fast_accum and (tile.block_m, tile.block_n) == (128, 256)
            and 0.6 * num_sms <= wide < 2 * num_sms
            and _wave_fill(tile_count(m, n, 128, 128), num_sms)
            >= _wave_fill(wide, num_sms) + FP8_HALF_TILE_FILL_GAIN):
        half = TileConfig(128, 128, 128, 8, 4, 4)  # fp8: BLOCK_K counts bytes as it is
        return MMPlan("tma", half, _split_for(m, n, k, half, num_sms, 1), epilogue_subtile=2)
    return plan


# How much fuller the last wave of 128x128 tiles must be than that of 128x256 ones for a
# tensorwise or rowwise fp8 product with fast accumulation to take them (_scaled_tma_plan).
FP8_HALF_TILE_FILL_GAIN = 0.1


# Blockwise fp8 products of at most this many rows run ``_blockwise_small_plan``.
BLOCKWISE_SMALL_ROWS = 128
# ... split until their units fill about this many waves of the SMs.
BLOCKWISE_SMALL_WAVES = 3


def _blockwise_small_plan(m: int, n: int, k: int, num_sms: int) -> MMPlan | None:
    """The plan of a blockwise fp8 product (1x128 / 128x128 scales) of at most 128 rows whose
    64-wide tiles are fewer than the SMs, else None (the size rules' plan): 16-row (M <= 16)
    or 64-row tiles 64 wide on the portable kernel, K steps of one scale block (128), K split
    until the work units fill about three waves of SMs (at least 4 steps a split). Each K step
    waits for its scales' loads, which Triton does not pipeline; several programs per SM hide
    those waits where one wave of long programs does not. On an H100, the Llama-3-8B
    projections at M = 16, 64 and 128 with fewer such tiles than SMs (6 of 12; every plan of
    the space timed, docs/data/fp8-small-m-h100.csv) ran 0.58-1.16x torch._scaled_mm on the
    size rules' plans (one wave of 256-deep steps) and 0.81-1.22x on these; wider outputs
    already fill the SMs, and these tiles lost there (M = 64 x 28672: 0.77x against 0.99x)."""
    tile = TileConfig(16 if m <= 16 else 64, 64, 128, 1 if m <= 16 else 4, 4, 4)
    tiles = output_tiles(m, n, tile)
    if tiles >= num_sms:
        return None
    split = max(1, min(BLOCKWISE_SMALL_WAVES * num_sms // tiles, _most_splits(k, tile.block_k)))
    return MMPlan("portable", tile, split)


# Tensorwise and rowwise fp8 products of more rows than this and at most FP8_NARROW_MAX_ROWS
# may take ``_fp8_narrow_plan``: while its 64x64 tiles fill FP8_NARROW_MIN_WAVES to
# FP8_NARROW_MAX_WAVES waves of the SMs (FP8_NARROW_MAX_WAVES_WIDE above 128 rows).
FP8_NARROW_MIN_ROWS = 32
FP8_NARROW_MAX_ROWS = 256
FP8_NARROW_MIN_WAVES = 0.7
FP8_NARROW_MAX_WAVES = 3.5
FP8_NARROW_MAX_WAVES_WIDE = 2.0


# Products of few rows (fp8 tensorwise / rowwise and 16-bit; bias-free, both operands contiguous
# along K with SWAP_PITCH_BYTES pitches, K at least SWAP_MIN_K, within a wave
# SWAP_MIN_K_WITHIN_WAVE_16BIT / _FP8: the products it won on) run transposed (``MMPlan.swap_ab``)
# where the weight's rows make SWAP_MIN_WAVES to one wave of 64-row tiles (SWAP_MIN_ROWS to
# SWAP_MAX_ROWS rows), or SWAP_MIN_MULTI_WAVES waves and more
# (SWAP_MIN_ROWS_MULTI_WAVE to SWAP_MAX_ROWS rows, 16-bit SWAP_MAX_ROWS_MULTI_WAVE_16BIT, and K a
# multiple of SWAP_MULTI_WAVE_BLOCK_K, the K step of those tiles; on GPUs whose DRAM bandwidth
# per SM reaches SWAP_MULTI_WAVE_MIN_GBPS_PER_SM).
SWAP_MIN_ROWS = 2
SWAP_MAX_ROWS = 32
SWAP_MIN_ROWS_MULTI_WAVE = 4
SWAP_MAX_ROWS_MULTI_WAVE_16BIT = 16
# Within a wave, from this fraction of one: products of at most 16 rows (64x16 tiles) from
# SWAP_MIN_WAVES_16_ROWS (by element size: fp8 0.3, 16-bit 0.35), wider ones from SWAP_MIN_WAVES.
SWAP_MIN_WAVES = 0.45
SWAP_MIN_WAVES_16_ROWS = {1: 0.3, 2: 0.35}
SWAP_MIN_MULTI_WAVES = 2.0
SWAP_MIN_K = 2048
# 16-bit products within a wave from this K on; below SWAP_SHALLOW_K in K steps of
# SWAP_SHALLOW_BLOCK_K (more steps in flight through K of 256-1023).
SWAP_MIN_K_WITHIN_WAVE_16BIT = 256
# fp8 products within a wave from this K on; below SWAP_MIN_K not at SWAP_SHALLOW_FP8_SKIP_ROWS
# rows (bench.plans --fp8-swap-from-k-2048: the bound as it was, SWAP_MIN_K).
SWAP_MIN_K_WITHIN_WAVE_FP8 = 1024
SWAP_SHALLOW_FP8_SKIP_ROWS = 16
SWAP_SHALLOW_K = 1024
SWAP_SHALLOW_BLOCK_K = 64
SWAP_MULTI_WAVE_BLOCK_K = 128
# The operands' row pitches in bytes must be multiples of this (16 for fp8, 32 for 16-bit).
SWAP_PITCH_BYTES = {1: 16, 2: 32}
# From two waves only on GPUs whose DRAM streams at least this many GB/s per SM (an H200's 37;
# an H100's 25 gained nothing there).
SWAP_MULTI_WAVE_MIN_GBPS_PER_SM = 30.0


def swap_plan(m: int, n: int, k: int, element_size: int, num_sms: int,
              dram_gbps: float) -> MMPlan | None:
    """The transposed plan (``swap_ab``) of a product of ``m`` rows against a weight of ``n``
    rows, K deep, fp8 (``element_size`` 1: tensorwise or rowwise) or 16-bit (2), on a GPU of
    ``num_sms`` SMs and ``dram_gbps`` GB/s of DRAM bandwidth, or None where it does not apply
    (the caller checks the recipe, bias and layouts).

    Few tokens against a weight of n rows: C^T = W x^T puts the n rows along the 64-row side of
    a 64x16 tile (64x32 above 16 rows) and the tokens along its columns, so each program streams
    64 weight rows through the tensor cores instead of running 16- or 32-row tiles most of whose
    rows are padding. Within a wave, 256-byte K steps in 6 stages (the most bytes in flight per
    SM); from two waves, 128-deep K steps in 4 stages (two programs per SM). Within 4% of the
    best of 52-60 transposed tiles (64 or 128 rows, 128-512-byte K steps, 3-6 stages, 4 or 8
    warps, K split or not) on Llama-3-8B's projections.

    Measured on H200s (132 SMs), same-run A/Bs of the rule on and off (docs/data/
    swap-models-h200.csv, swap-random-h200.csv; README "Products of few rows"):
    - fp8 within a wave: faster on every held-out model projection at 2-32 rows (1.02-1.99x;
      at 24-32 rows 1.15-2.0x) and on every random product (34; geomean 1.36x).
    - fp8 from two waves: 4-32 rows 1.04-1.18x geomean on held-out projections (worst 0.975x);
      at 2 rows 0.89-0.97x, so not below 4; random products with K not a multiple of the K step
      0.99x geomean, worst 0.84x, so not those.
    - 16-bit: 1.05-1.33x geomean per row count on 22 held-out projections (worst 0.999x), 1.11x
      on 50 random products (worst 0.92x); from two waves at 32 rows 0.98x on Llama-3-8B, so
      16-bit stops at 16 rows there.
    - Not at 1-2 waves (160 tiles: 0.87x), nor at one row (where the K-split rule runs: 0.99x
      geomean, some 0.7x), nor above 32 rows (slower at 64).
    - H100 (same-run A/B, random seeds 2030 / 2031): within a wave 1.08x (16-bit, worst 1.02x)
      and 1.11x (fp8, worst 1.02x) as on H200s, but from two waves 1.01x for both (fp8 at 24-32
      rows 0.99x, worst 0.90x). Memory-bound products stream the weight either way; transposed
      tiles gain there only where more bandwidth per SM is to be had (H200: 37 GB/s per SM,
      H100: 25), so two waves and more take them from SWAP_MULTI_WAVE_MIN_GBPS_PER_SM.
    - Below 0.45 of a wave (same-run A/Bs, seeds 2040 / 2041 drawing weights of 2048-4224 rows;
      docs/data/swap-low-fill.csv): at 2-16 rows, fp8 from 0.3 of a wave 1.09x on an H100 and
      1.23x on an H200 (28 products each, worst 1.02x / 1.12x), 16-bit from 0.35 1.09x / 1.06x
      (14, worst 1.01x / 0.98x); 16-bit at 0.30-0.35 0.96x on the H100 (0.90x, and one 0.35x);
      at 17-32 rows 1.05-1.08x on the H100 but 1.01x / 1.07x on the H200 with products at
      0.83-0.84x, so those start at 0.45 as before. Bounds read off these sets (and a sweep of
      8 shapes' transposed tiles on the H100); on fresh seeds (2050 16-bit, 2051 fp8, H100,
      rule on vs off, docs/data/swap-low-fill-h100-seed205*.csv) 1.08x (19 moved, worst 0.94x
      at 4 rows) and 1.13x (28 moved, every one faster).
    - 16-bit rows whose pitch is 16 bytes off a multiple of 32 (K an odd multiple of 8) lost on
      all three random products that had one (0.74-0.93x, seeds 2026 and 2029), so the caller
      (``planner.swap_plan``) takes 16-bit pitches that are multiples of 32 bytes
      (SWAP_PITCH_BYTES); fp8's 16-byte pitches won (1.05-1.25x, 12 products).
    - 16-bit K under 2048 within a wave (SWAP_MIN_K_WITHIN_WAVE_16BIT; H200, every plan of 17
      few-row products with K 256-2047, seed 2201 and seed 2168's slowest; docs/data/
      fewrows-shortk-plans-h200-2547e5e.csv): the rule's tile beat the pick on all 6 it
      takes (K 448-2000: 0.62-1.01x cuBLAS picked, 0.82-1.14x transposed); below K 1024
      64-deep K steps (SWAP_SHALLOW_BLOCK_K) beat 128-deep on all four such products
      (0.69-0.97x against 0.67-0.90x, 6 stages). Held out (seed 2202, 24 products it moves,
      M 3-31, K 288-1744; rule on and off twice each, alternating; docs/data/
      swap-shallow-k-ab-h200-seed2202-48142d8.csv): 1.21x geomean, 23 faster (up to 1.37x),
      18 x 6320 x 1392 0.96x. Real models' decode projections it moves (GPT-2 S to XL,
      BERT-L, Qwen3-0.6B: 44 products of 2-32 rows, K 768-1600, bf16 and fp16, same run,
      docs/data/swap-shallow-k-ab-h200-models-ed342c0.csv): 1.20x geomean, 87 of 88 faster,
      worst 0.998x; against cuBLAS 0.86x -> 1.03x geomean, the slowest 0.69x -> 0.85x.
    - fp8 K 1024-2047 within a wave (SWAP_MIN_K_WITHIN_WAVE_FP8; H200, every plan of GPT-2 M /
      L and Qwen3-0.6B decode projections at 4, 16 and 32 rows, rowwise, docs/data/
      fp8-shortk-plans-h200-0573ddc.csv): the rule's tile against the pick 1.065x geomean on
      the 11 it would take (4 rows 1.11-1.15x on all four, 16 rows 0.99-1.02x, 32 rows
      0.96-1.16x). Held out (same run, each arm twice, A B B A; GPT-2 XL and Qwen3-0.6B qkv,
      8 random layers of 5120-8000 x 1088-1952, seed 4000, and the fitted layers at other
      row counts; 2-32 rows, rowwise and tensorwise; docs/data/
      fp8-swap-shallow-k-ab-h200-94247e7.csv): 1.09x geomean on 250 moved, 230 faster,
      against torch._scaled_mm 1.01x -> 1.11x; at 16 rows 1.00x (32, worst 0.85x: a 16-row
      tile has no rows of padding to save), so not there (SWAP_SHALLOW_FP8_SKIP_ROWS); the
      other 218 1.11x, worst 0.97x. 13-15 rows were not measured.
    """
    min_k = SWAP_MIN_K_WITHIN_WAVE_16BIT if element_size == 2 else SWAP_MIN_K_WITHIN_WAVE_FP8
    if (_device.interpreter_enabled() or element_size not in (1, 2)
            or not SWAP_MIN_ROWS <= m <= SWAP_MAX_ROWS or k < min_k
            or element_size == 1 and k < SWAP_MIN_K and m == SWAP_SHALLOW_FP8_SKIP_ROWS):
        return None
    width = 16 if m <= 16 else 32
    tiles = -(-n // 64)
    multi_wave_rows = SWAP_MAX_ROWS if element_size == 1 else SWAP_MAX_ROWS_MULTI_WAVE_16BIT
    min_waves = SWAP_MIN_WAVES_16_ROWS[element_size] if m <= 16 else SWAP_MIN_WAVES
    if min_waves * num_sms <= tiles <= num_sms:
        block_k = SWAP_SHALLOW_BLOCK_K if k < SWAP_SHALLOW_K else 256 // element_size
        tile = TileConfig(64, width, block_k, 8, 4, 6)
    elif (k >= SWAP_MIN_K and tiles >= SWAP_MIN_MULTI_WAVES * num_sms
          and k % SWAP_MULTI_WAVE_BLOCK_K == 0
          and SWAP_MIN_ROWS_MULTI_WAVE <= m <= multi_wave_rows
          and dram_gbps >= SWAP_MULTI_WAVE_MIN_GBPS_PER_SM * num_sms):
        tile = TileConfig(64, width, SWAP_MULTI_WAVE_BLOCK_K, 8, 4, 4)
    else:
        return None
    return MMPlan("portable", _fit_shared_memory(tile, element_size,
                                                 _device.shared_memory_per_block(0)),
                  swap_ab=True)


# Products of at most this many rows also have transposed candidates in the plan sweep
# (``transposed_plans``).
TRANSPOSED_SWEEP_MAX_ROWS = 128


def transposed_plans(m: int, element_size: int) -> list[MMPlan]:
    """Transposed candidates (``swap_ab``) of a product of ``m`` rows for the plan sweep
    (bench.plans), 16-bit or fp8, without bias: 64-row tiles as wide as the rows' size bucket
    (at least 16), 64- or 128-deep K steps (for 16-bit inputs; twice for fp8) in 4 or 6 stages,
    on the portable kernel; none above TRANSPOSED_SWEEP_MAX_ROWS rows. The planner takes only
    ``swap_plan``'s."""
    if not 1 <= m <= TRANSPOSED_SWEEP_MAX_ROWS:
        return []
    width = max(16, size_bucket(m))
    smem = _device.shared_memory_per_block(0)
    tiles = {_fit_shared_memory(_for_dtype(TileConfig(64, width, block_k, 8, 4, stages),
                                           element_size), element_size, smem)
             for block_k in (64, 128) for stages in (4, 6)}
    return [MMPlan("portable", tile, swap_ab=True)
            for tile in sorted(tiles, key=dataclasses.astuple)]


def _fp8_narrow_plan(m: int, n: int, k: int, num_sms: int) -> MMPlan | None:
    """The plan of a tensorwise or rowwise fp8 product (``scaling`` "outer") of 33-256 rows
    on 64x64 tiles of the portable kernel, or None (the size rules' plan). It applies while
    those tiles fill 0.7 to 3.5 waves of the SMs (up to 2 waves above 128 rows, and there
    only where too few 128x128 tiles for the TMA kernel's plans, 0.7 of a wave, leave the size
    rules at 64x128): up to one wave, 256-deep K steps and 4 stages, unsplit; beyond, 128-deep
    steps and 5 stages.

    On an H100, fitted on every plan of the space at M = 16-512 on the Llama-3-8B projections
    (docs/data/fp8-small-m-h100.csv): 64-row tiles beat the size rules' 128-row ones at M = 128
    (o 13.6 -> 10.6 us, torch._scaled_mm 9.4; qkv 15.4 -> 14.4), 128x128 TMA tiles half full of
    rows at M = 64 (gate_up 56.0 -> 46.4, torch 47.3), and 64x128 tiles at M = 256 (o 15.7 ->
    13.3, down 48.6 -> 41.0). Its bounds come from shapes outside that data (M = 40-256 x eight
    N, K; docs/data/fp8-narrow-ab-h100.csv): fewer 64x64 tiles than 0.7 of a wave lost to
    128-row tiles split in K (96 x 1536 x 7168: 13.3 against 11.4 us), and 2.4 waves of them at
    M = 256 to 64x128 tiles (256 x 5120 x 5120: 29.4 against 25.7). On a third set, held out
    from these bounds (M = 48-240 x eight other N, K; docs/data/fp8-narrow-ab2-h100.csv), the
    72 products whose plan it changes ran 1.13x faster, 0.81x -> 0.91x torch, none slower."""
    waves = tile_count(m, n, 64, 64) / num_sms
    wide = m > 128
    if (waves < FP8_NARROW_MIN_WAVES
            or waves > (FP8_NARROW_MAX_WAVES_WIDE if wide else FP8_NARROW_MAX_WAVES)
            or wide and tile_count(m, n, 128, 128) >= 0.7 * num_sms):
        return None
    smem = _device.shared_memory_per_block(0)
    if waves <= 1:
        tile = TileConfig(64, 64, 128, 4, 4, 4)
    else:
        tile = TileConfig(64, 64, 64, 4, 4, 5)
    return MMPlan("portable", _fit_shared_memory(_for_dtype(tile, 1), 1, smem))


# Tensorwise and rowwise fp8 products of 2-16 rows take ``_fp8_decode_tile`` where its tiles,
# unsplit, number at least this fraction of the SMs.
FP8_DECODE_MIN_FILL = 0.55
FP8_DECODE_WIDTHS = (128, 64, 32)


def _fp8_decode_tile(n: int, num_sms: int) -> TileConfig | None:
    """The unsplit decode tile of a tensorwise or rowwise fp8 product of 2-16 rows: 16 rows
    by the widest of 128, 64 or 32 columns whose tiles number at least 0.55 of the SMs,
    256-deep K steps, 6 stages below 128 columns; None when even 32-wide tiles are fewer
    (the K-split rule of ``_decode_tile_and_split`` then). Streaming fp8 weights, one wave of
    whole-K programs beat fewer, wider tiles split in K (the split's second launch and fp32
    partials cost more than the programs' K loop at these sizes). On an H100, every 16-row
    plan of the portable kernel at M = 8 and 16 on eight products
    (docs/data/fp8-decode-h100.csv): Llama-3-8B o 10.5 -> 9.2 us (torch._scaled_mm 8.5), down
    25.4 -> 24.5, N = K = 5120 14.6 -> 12.9; qkv unchanged. Not at M = 1 (Triton
    specialises a size of 1, and there the same 32-wide plan ran 12.1 us against the split
    rule's 11.5). Held out (M = 2-16, model-like N and K of another seed, the three recipes;
    docs/data/fp8-decode-ab-h100.csv): the 87 products whose plan it changes ran 1.07x faster
    in geomean, 1.04 -> 1.12x torch._scaled_mm; 4 slower by more than 3% (worst 0.91x:
    4 x 2560 x 7168, 80 tiles of 32 columns, a deep K that the split rule spread wider)."""
    for width in FP8_DECODE_WIDTHS:
        if -(-n // width) >= FP8_DECODE_MIN_FILL * num_sms:
            return TileConfig(16, width, 256, 1, 4, 4 if width == 128 else 6)
    return None


# Decode tiles (M <= 16): 128 columns wide, or 64 wide with a deeper pipeline; both on the
# portable kernel, which streamed B faster than TMA there.
DECODE_TILES = (TileConfig(16, 128, 128, 1, 4, 4), TileConfig(16, 64, 128, 1, 4, 6))


def _decode_tile_and_split(n: int, k: int, element_size: int,
                           num_sms: int) -> tuple[TileConfig, int]:
    """The decode tile and K split (M <= 16): streaming the weights wants as many SMs busy as
    possible in ONE wave (a second wave of equal units idles most of them; measured on an H100,
    48 tiles x 5 splits lost to 96 unsplit 64-wide tiles). On a tie, no K split (no partials,
    no second launch), then the wider tile."""
    def option(tile: TileConfig) -> tuple[tuple[float, bool, int], TileConfig, int]:
        tile = _for_dtype(tile, element_size)
        tiles = -(-n // tile.block_n)
        most = _most_splits(k, tile.block_k)
        split = max(1, min(most, num_sms // tiles))
        units = tiles * split
        fill = _wave_fill(units, num_sms)
        return (round(fill, 2), split == 1, tile.block_n), tile, split

    _, tile, split = max((option(t) for t in DECODE_TILES), key=lambda o: o[0])
    return tile, split


def epilogue_subtile(tile: TileConfig) -> int:
    """Column slices the TMA epilogue stores a tile of C in: halves from 128 columns on, which
    halves its staging buffer and lets the first half's store start while the second is staged."""
    return 2 if tile.block_n >= 128 else 1


def tma_epilogue_bytes(tile: TileConfig, out_size: int, subtile: int = 1) -> int:
    """Shared memory the TMA kernel's epilogue stages C in: one of its ``subtile`` column
    slices (``out_size`` is C's element size). The fp32 partials of a K split go out in slices
    as small (see kernels/matmul.py), so they need no more."""
    return tile.block_m * tile.block_n // subtile * out_size


def _fit_shared_memory(tile: TileConfig, element_size: int, limit: int) -> TileConfig:
    # Fewer pipeline stages on GPUs with less shared memory than an H100 (sm_80/86/89).
    while tile.num_stages > 2 and shared_memory_bytes(tile, element_size) > limit:
        tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    return tile


def scaled_plan(plan: MMPlan, mode: str) -> MMPlan:
    """Any plan (forced, tuned or the heuristic's) made valid for an fp8 recipe of scaled_mm:
    under "block" a K step must stay inside one 128-wide scale block (BLOCK_K <= 128)."""
    if mode == "block" and plan.tile.block_k > 128:
        return dataclasses.replace(plan, tile=dataclasses.replace(plan.tile, block_k=128))
    return plan


def symbolic_tile(element_size: int) -> TileConfig:
    """The tile for symbolic sizes (torch.compile with dynamic shapes), mm's and grouped_mm's:
    one for all sizes, so that nothing guards on them."""
    if _device.interpreter_enabled():
        return INTERPRETER_TILE
    tile = _for_dtype(TileConfig(128, 128, 64, 8, 8, 4), element_size)
    return _fit_shared_memory(tile, element_size, _device.shared_memory_per_block(0))


def symbolic_mm_plan(element_size: int) -> MMPlan:
    """The plan for symbolic sizes: the portable kernel (any strides) with ``symbolic_tile``."""
    return MMPlan("portable", symbolic_tile(element_size))


def reduce_tile(split_tiles: int, tile_m: int, tile_n: int,
                num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split-K reduction of ``split_tiles`` GEMM tiles of
    [tile_m, tile_n]: it reads every split's partial, so it is memory-bound and wants at least
    one program per SM; blocks shrink (columns first, to 32; then rows, to 8) until the split
    tiles give that many."""
    if _device.interpreter_enabled():
        return min(32, tile_m), min(32, tile_n), 4
    block_m, block_n = min(32, tile_m), min(128, tile_n)
    while split_tiles * (tile_m // block_m) * (tile_n // block_n) < num_sms:
        if block_n > 32:
            block_n //= 2
        elif block_m > 8:
            block_m //= 2
        else:
            break
    return block_m, block_n, 4


_FORCED: contextvars.ContextVar[MMPlan | None] = contextvars.ContextVar("tgemm_plan",
                                                                        default=None)


def forced_plan() -> MMPlan | None:
    """The plan set by ``force_plan`` in this context, if any."""
    return _FORCED.get()


@contextlib.contextmanager
def force_plan(plan: MMPlan) -> Iterator[None]:
    """Launch every mm in this block with ``plan`` (tuning and tests). A "tma" plan falls back
    to the portable kernel for operands TMA cannot describe."""
    token = _FORCED.set(plan)
    try:
        yield
    finally:
        _FORCED.reset(token)


# --- launch keyword arguments ---------------------------------------------------------------------

@functools.cache
def tile_meta(tile: TileConfig) -> Mapping[str, Any]:
    """The meta-parameters every tgemm kernel takes from a tile (block sizes, band height,
    warps, stages); built once, read-only."""
    return MappingProxyType({
        "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
        "GROUP_M": tile.group_m, "num_warps": tile.num_warps, "num_stages": tile.num_stages,
    })


_PITCH_HINTS_ENV = "TORCH_TRITON_GEMM_PITCH_HINTS"


def pitch_hints_enabled() -> bool:
    """Whether the portable kernel is told how the operands' pitches align
    (``pitch_alignment``), so that its sm_90 build loads narrow-pitch operands with cp.async
    vectors (``kernels/tiles.py``'s k_loop); on unless ``TORCH_TRITON_GEMM_PITCH_HINTS=0``.
    On an H100 the same plans ran 1.04x faster with them (geomean of 338 sweep shapes, 1.06x
    on pitches TMA cannot read; ``docs/data/plans-h100-seed7-hints-*.csv``)."""
    return env.flag(_PITCH_HINTS_ENV, True)


EAGER_PLANS_ENV = "TORCH_TRITON_GEMM_EAGER_PLANS"


def eager_plans_enabled() -> bool:
    """Whether plain eager calls of tgemm::mm may run the planner's portable K split in one
    launch (``MMPlan.split_inline``: no reduction launch, the same bits) where the host's time
    for the split's extra launches outweighs the GPU time it saves (``plan_model.eager_plan``);
    CUDA-graph captures and compiled calls keep the planner's launches, and a signature's first
    eager call runs them too (see ops/launcher.py's eager_or_capture). On unless
    ``TORCH_TRITON_GEMM_EAGER_PLANS=0``: on an H200, held out twice, the products whose eager
    plan moves ran 1.42x and 1.39x faster eagerly, with the same bits in every comparison
    (``docs/data/eager-inline-held-out-h200-seed2116.csv``,
    ``eager-plans-default-held-out-h200-seed2117.csv``)."""
    return env.flag(EAGER_PLANS_ENV, True)


def pitch_alignment(stride: Any, element_size: int) -> int:
    """The elements by which an operand stride is known to be a multiple, for the portable
    kernel's vector loads: the largest power of two dividing it, up to one 16-byte vector; 1
    where Triton knows as much itself (strides of 0, 1 or multiples of 16 elements, which it
    specialises on) and for symbolic strides (traced launches, which must not guard on them)."""
    if type(stride) is not int or stride <= 1 or stride % 16 == 0:
        return 1
    return _power_of_two_dividing(stride, max(1, 16 // element_size))


def size_alignment(size: Any, specialised: bool) -> int:
    """The power of two (up to 16) by which a GEMM size is known to divide, for the portable
    kernel's wrapped rows or columns (``offs % size``) along which an operand is contiguous:
    with it they stay contiguous in runs that vector loads can take. 1 where Triton knows as
    much itself (``specialised`` sizes that are multiples of 16), for sizes of 0 or 1 and for
    symbolic sizes (traced launches, which must not guard on them)."""
    if type(size) is not int or size <= 1 or (specialised and size % 16 == 0):
        return 1
    return _power_of_two_dividing(size, 16)


def store_alignment(stride_cm: Any, n: Any, element_size: int) -> int:
    """The power of two (up to one 16-byte vector) dividing both C's row stride and N, for the
    kernels' pointer stores (``kernels.tiles.store_epilogue``'s C_ALIGN): with it a row of C
    goes out in vectors of that many elements. 1 for symbolic values (traced launches must not
    guard on them) and where either is 0."""
    if type(stride_cm) is not int or type(n) is not int or stride_cm <= 0 or n <= 0:
        return 1
    return _power_of_two_dividing(math.gcd(stride_cm, n), max(1, 16 // element_size))


def odd_contiguous(size: Any) -> bool:
    """Whether the portable kernel is told that an operand contiguous along its wrapped columns
    of ``size`` (B along N) is: for odd sizes above 1, where ``size_alignment`` knows no run
    and Triton would lay the loads out along the other dimension (the kernel's N_ODD). False
    for symbolic sizes (traced launches must not guard on them)."""
    return type(size) is int and size > 1 and size % 2 == 1


def _power_of_two_dividing(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` (> 0), at most ``cap``."""
    return min(n & -n, cap)


@functools.cache
def launch_meta(plan: MMPlan, split: bool,
                scaling: tuple[str, int, int, bool] = ("none", 1, 1, False),
                stream_k: bool = False, fixup_splits: int = 0,
                aligns: tuple[int, ...] = (1, 1, 1, 1, 1, 1, False),
                num_stages: int | None = None, pdl: bool = False,
                c_align: int = 1, split_inline: bool = False) -> Mapping[str, Any]:
    """Meta-parameters launching ``plan``'s kernel, with K splits or not (``split``), the
    scaling recipe (SCALING, SA_ROWS, SB_COLS, FAST_ACCUM), stream-K tiles or not,
    (``fixup_splits``, the portable kernel's split launches) the splits that finish their tiles
    themselves, and (``aligns``, the portable kernel's) the ``pitch_alignment`` of stride_am,
    stride_ak, stride_bk and stride_bn, the ``size_alignment`` of M and N, then whether B is
    contiguous along an odd N (``odd_contiguous``); ``num_stages``
    (the portable kernel's, when K is known): its pipeline depth, ``pipeline_stages`` of the
    tile's for the K steps each program takes (the depth, not the steps, keys this cache, so
    that it stays as small as the plans); ``pdl``: launched with programmatic dependent launch
    (``dependent_launch``); ``c_align``: the ``store_alignment`` of C; ``split_inline``: the
    portable kernel's one launch of a K split (``MMPlan.split_inline``); read-only."""
    meta: dict[str, Any] = {
        **tile_meta(plan.tile), "SPLIT": split,
        "SCALING": scaling[0], "SA_ROWS": scaling[1], "SB_COLS": scaling[2],
        "FAST_ACCUM": scaling[3],
    }
    if plan.kernel == "tma":
        meta["EPILOGUE_SUBTILE"] = plan.epilogue_subtile
        meta["WARP_SPECIALIZE"] = plan.warp_specialize
        meta["STREAM_K"] = stream_k
        # Descriptors built on the device (ops/graph_descriptors.py passes host-built ones).
        meta["HOST_DESCRIPTORS"] = False
        meta["c_host_desc"] = None
    else:
        (meta["A_M_ALIGN"], meta["A_K_ALIGN"], meta["B_K_ALIGN"], meta["B_N_ALIGN"],
         meta["M_ALIGN"], meta["N_ALIGN"], meta["N_ODD"]) = aligns
        if num_stages is not None:
            meta["num_stages"] = num_stages
        meta["SPLIT_INLINE"] = split_inline
    # (Passed either way: torch.compile's Triton kernel wrapper takes no defaults.)
    meta.update(PDL_META if pdl else NO_PDL_META)
    meta["C_ALIGN"] = c_align
    fixup = split and fixup_splits > 1
    meta["SPLIT_FIXUP"] = fixup
    meta["SPLIT_K"] = fixup_splits if fixup else 1
    return MappingProxyType(meta)


# The meta-parameters of a launch with programmatic dependent launch (kernels/matmul.py's
# dependent_launch_wait): the kernel's switch and Triton's launch option.
PDL_META: Mapping[str, bool] = MappingProxyType({"PDL": True, "launch_pdl": True})
NO_PDL_META: Mapping[str, bool] = MappingProxyType({"PDL": False})
_PDL_ENV = "TORCH_TRITON_GEMM_PDL"


def dependent_launch(programs: int, num_sms: int, capability: tuple[int, int]) -> bool:
    """Whether an eager launch of ``programs`` programs of a GEMM kernel or the split-K
    reduction uses programmatic dependent launch: on sm_90+, for a single wave (``programs`` <=
    ``num_sms``; the persistent TMA kernel's grid always is), unless TORCH_TRITON_GEMM_PDL=0.
    Its launch and set-up then overlap the end of the kernel before it, which is about what a
    small product takes; a launch of several waves gains little and its early programs would
    hold SMs the kernel before still needs (tried on every portable launch, H100: 1000^3 took
    15.7 us against 13.3)."""
    return capability >= (9, 0) and programs <= num_sms and env.flag(_PDL_ENV, True)


def pipeline_stages(num_stages: int, k_steps: int) -> int:
    """The portable kernel's pipeline depth for a program of ``k_steps`` BLOCK_K steps: the
    tile's, but no deeper than the loop (buffers for steps that do not exist only cost; on an
    H100, 289 products under 1e8 FLOP with one K step ran 1.10x faster in geomean unpipelined
    than with the tile's 4-6 stages, and 1.07x with three steps in three stages)."""
    return max(1, min(num_stages, k_steps))


# The most K splits that finish their own tiles: the last split of a tile reads the others'
# partials in one unrolled sequence (more would cost more than the reduction launch saves, and
# lengthen the kernel's compile); plans with more splits keep the reduction kernel.
FIXUP_MAX_SPLITS = 16


def inlines_splits(plan: MMPlan) -> bool:
    """Whether ``plan``'s K splits run in one launch, each program adding its tile's splits
    (``MMPlan.split_inline``: the portable kernel's; other kernels split as without it)."""
    return plan.split_inline and plan.kernel == "portable"


def fixes_up_splits(plan: MMPlan, split_k: int) -> bool:
    """Whether ``plan``'s K splits (``split_k`` of them, as launched) finish their tiles
    themselves: the GEMM kernels', when the plan asks, up to FIXUP_MAX_SPLITS."""
    return (plan.split_fixup and 1 < split_k <= FIXUP_MAX_SPLITS
            and plan.kernel in ("portable", "tma"))


# --- candidates for tuning ------------------------------------------------------------------------

def candidate_plans(m: int, n: int, k: int, element_size: int, tma: bool,
                    num_sms: int, a_k_contiguous: bool = True,
                    wgmma_out_size: int = 0) -> Iterator[MMPlan]:
    """Plans worth timing for one shape: every tile of the space that suits its size, unsplit
    and split to fill the SMs, on each kernel the operands allow; the heuristic's plan first;
    last, where Hopper's warp-specialized kernel runs the product (``wgmma_out_size``: the
    output's element size, see ``plan_space``), its plans (``ws_plans``, ``ws_split_plans``)."""
    smem = _device.shared_memory_per_block(0)
    seen = set()
    first = heuristic_mm_plan(m, n, k, element_size, tma, num_sms,
                              a_k_contiguous=a_k_contiguous)
    seen.add(first)
    yield first
    kernels = ("tma", "portable") if tma else ("portable",)
    for base in MM_TILES:
        tile = _for_dtype(base, element_size)
        if not _fits_problem(tile, m, n) or shared_memory_bytes(tile, element_size) > smem:
            continue
        split = _split_for(m, n, k, tile, num_sms, element_size)
        # Memory-bound skinny shapes may gain from more bytes in flight than one wave holds.
        splits = [(s, False) for s in sorted({1, split, 2 * split} if m <= 32 else {1, split})]
        tail = _tail_split(m, n, k, tile, num_sms)
        if tail > 1:
            splits.append((tail, True))
        for (split, split_tail), kernel in itertools.product(splits, kernels):
            big = kernel == "tma" and tile.block_m >= 128 and tile.block_n >= 128
            for subtile, specialize in ((1, False), (2, False), (2, True)) if big else (
                    (1, False),):
                # The TMA kernel also stages a slice of C in shared memory for its store.
                if kernel == "tma" and shared_memory_bytes(tile, element_size) + (
                        tma_epilogue_bytes(tile, 2, subtile)) > smem:
                    continue
                plan = MMPlan(kernel, tile, split, specialize, subtile, split_tail)
                # The same splits also finishing their own tiles (no reduction launch).
                twins = (plan, dataclasses.replace(plan, split_fixup=True)) if (
                    1 < split <= FIXUP_MAX_SPLITS) else (plan,)
                for candidate in twins:
                    if candidate not in seen:
                        seen.add(candidate)
                        yield candidate
    if wgmma_out_size:
        yield from ws_plans(wgmma_out_size)
        yield from ws_split_plans(m, n, k, element_size, wgmma_out_size, num_sms)


# The space the planner's rules choose from (and the plan sweep times): tiles for 2-byte inputs.
PLAN_SPACE_TILES: tuple[TileConfig, ...] = (
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(256, 128, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 4),
    TileConfig(128, 128, 64, 8, 4, 4),
    TileConfig(64, 256, 64, 8, 4, 4),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 5),
    TileConfig(64, 64, 128, 4, 4, 4),
    TileConfig(32, 128, 128, 4, 4, 4),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(16, 128, 128, 1, 4, 4),
    TileConfig(16, 64, 128, 1, 4, 6),
    TileConfig(16, 64, 256, 1, 4, 4),
    # Narrow tiles for outputs under 64 columns (see _fits_width).
    TileConfig(128, 32, 64, 8, 4, 4),
    TileConfig(64, 32, 128, 4, 4, 4),
    TileConfig(32, 32, 128, 4, 4, 4),
    TileConfig(16, 32, 128, 1, 4, 4),
    TileConfig(128, 16, 128, 8, 4, 4),
    TileConfig(64, 16, 128, 4, 4, 4),
    TileConfig(16, 16, 256, 1, 4, 4),
)


def plan_space(m: int, n: int, k: int, element_size: int, tma: bool, num_sms: int,
               aligned: bool = True, wide: bool = False,
               wgmma_out_size: int = 0) -> Iterator[MMPlan]:
    """Every plan of the planner's space for one shape: each tile of PLAN_SPACE_TILES that
    suits the size, on the portable kernel (only tiles of up to 64 rows where ``tma``) and
    (``tma``: the operands can be described, or copied into aligned buffers when not
    ``aligned``) the persistent TMA kernel, run whole, with
    stream-K (the partial wave, or it and one whole wave), split to fill the SMs (and twice
    that for skinny products), or with the partial wave split. ``wide``: every tile that fits
    shared memory, on both kernels, whatever the size and width rules say (the plan sweep's
    ``--wide-space``: whether those rules leave faster plans out). ``wgmma_out_size``: the
    output's element size where the warp-specialized kernel can run the product (the planner's
    ``ws_applies``), whose plans (``ws_plans``, ``ws_split_plans``) come last; 0: it cannot."""
    smem = _device.shared_memory_per_block(0)
    seen: set[MMPlan] = set()
    suited = [tile for tile in (_for_dtype(base, element_size) for base in PLAN_SPACE_TILES)
              if shared_memory_bytes(tile, element_size) <= smem and (wide or (
                  _fits_problem(tile, m, n) and _fits_width(tile, n)))]
    # One-row bands (GROUP_M = 1) stream all of B once per tile row: only where one tile row
    # covers M (an H100 at 32 x 12288 x 4096 with 16-row tiles: 0.53x cuBLAS), unless no
    # other tile suits (17-32 rows against at most 16 columns, whose only tile is 16x16: a
    # space left empty there sent them to heuristic_mm_plan's 32x64 tiles, 30 x 8 x 1339 in
    # 17.2 us on an H200 against cuBLAS's 6.8).
    banded = [tile for tile in suited if wide or not (tile.group_m == 1 and m > tile.block_m)]
    for tile in banded or suited:
        tiles = output_tiles(m, n, tile)
        k_steps = -(-k // tile.block_k)
        split = _round_split(_split_for(m, n, k, tile, num_sms, element_size))
        splits = {1, split, 2 * split} if m <= 32 and split > 1 else {1, split}
        splits |= _latency_splits(tiles, k_steps, num_sms)
        tail = _round_split(_tail_split(m, n, k, tile, num_sms))
        options = [dict(split_k=s) for s in sorted(splits)]
        if tail > 1:
            options.append(dict(split_k=tail, split_tail=True))
        plans = [MMPlan("portable", tile, **o) for o in options] if (
            wide or not tma or portable_beside_tma(tile)) else []
        fits_tma = shared_memory_bytes(tile, element_size) + tma_epilogue_bytes(
            tile, 2, epilogue_subtile(tile)) <= smem
        if tma and fits_tma:
            pad = None if aligned else True
            subtile = epilogue_subtile(tile)
            plans += [MMPlan("tma", tile, epilogue_subtile=subtile, pad=pad, **o)
                      for o in options]
        # The same splits finishing their tiles themselves (no reduction launch).
        plans += [dataclasses.replace(p, split_fixup=True) for p in plans
                  if 1 < p.split_k <= FIXUP_MAX_SPLITS]
        if tma and fits_tma and tiles % num_sms and k_steps >= 2:
            plans += [MMPlan("tma", tile, epilogue_subtile=subtile, pad=pad, stream_k=s)
                      for s in (1, 2) if s == 1 or tiles > num_sms]
        for plan in plans:
            if plan not in seen:
                seen.add(plan)
                yield plan
    if wgmma_out_size:
        yield from ws_plans(wgmma_out_size)
        yield from ws_split_plans(m, n, k, element_size, wgmma_out_size, num_sms)


def portable_beside_tma(tile: TileConfig) -> bool:
    """Whether the plan space offers ``tile`` on the portable kernel where TMA can read the
    operands: skinny tiles only, up to 64 x 128 (the portable kernel streamed B as fast as TMA
    there; not 256-wide tiles, whose times there varied from run to run by 10-30%)."""
    return tile.block_m <= 64 and tile.block_n <= 128


def _latency_splits(tiles: int, k_steps: int, num_sms: int) -> set[int]:
    """More K splits for outputs of fewer tiles than SMs: such a product is bound by how long
    one program takes through K, not by the SMs' throughput, and on an H100 its fastest plan
    often split further than filling one wave asks (down to a K step or two per split; 64 x 64
    x 2204: 24 splits 8.0 us, the wave-filling 8 splits 10.6 us). The splits whose units fit
    in three waves, a whole K step each at least."""
    if tiles >= num_sms:
        return set()
    return {s for s in SPLIT_COUNTS if 1 < s <= k_steps and tiles * s <= 3 * num_sms}


# K split counts the plan space uses: each count compiles a reduction kernel of its own, so a
# few of them serve every shape (the closest at or below the count a rule asks for).
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _round_split(split: int) -> int:
    return max(s for s in SPLIT_COUNTS if s <= max(1, split))


def _tail_split(m: int, n: int, k: int, tile: TileConfig, num_sms: int) -> int:
    """K splits that spread the last, partial wave's tiles over about one wave of SMs (1: no
    partial wave, or K too short to split)."""
    tiles = output_tiles(m, n, tile)
    tail = tiles % num_sms
    most = _most_splits(k, tile.block_k)
    if tiles < num_sms or tail == 0 or most < 2:
        return 1
    return max(1, min(most, num_sms // tail))


def _fits_width(tile: TileConfig, n: int) -> bool:
    # Tiles under 64 columns serve outputs that narrow and no others: 16 columns up to 16, 32 up
    # to 32 (a 64-wide tile on N = 8 spends 7/8 of its MMAs and B loads on nothing; on an H100
    # 72 x 8 x 8 took 11.9 us against cuBLAS's 2.7). Wider outputs keep the 64-wide tiles.
    return tile.block_n >= 64 or tile.block_n == max(16, size_bucket(n))


def _fits_problem(tile: TileConfig, m: int, n: int) -> bool:
    # A tile much larger than the problem wastes its work; a tile much smaller than a large
    # problem wastes bandwidth on re-reads.
    mb, nb = size_bucket(m), size_bucket(n)
    if tile.block_m > max(16, mb) or tile.block_n > max(32, nb):
        return False
    if mb >= 256 and tile.block_m < 64:
        return False
    if mb <= 64 and tile.block_m > 64:
        return False
    return True


# --- scaled_mm (microscaled formats) -------------------------------------------------------------
# The fp8 recipes with float32 scales use the mm plans above. The microscaled kernel's BLOCK_K
# counts logical K elements (fp4 holds two a byte) and is a multiple of every scale block (16, 32).

# Decoding to bf16 in registers widens the tiles: modest tiles and K steps keep them in registers.
SCALED_MM_MICRO_TILE = TileConfig(128, 128, 64, 8, 8, 3)
SCALED_MM_MICRO_SKINNY_TILE = TileConfig(16, 64, 64, 1, 4, 4)
# tl.dot_scaled on tensor cores (sm_100) wants 128-row tiles and K steps of at least 128.
SCALED_MM_NATIVE_TILE = TileConfig(128, 256, 128, 8, 8, 3)


def heuristic_scaled_mm_tile(m: int, n: int, scaling: str) -> TileConfig:
    """The microscaled kernel's tile: one per path (and a skinny one for decode)."""
    if _device.interpreter_enabled():
        return INTERPRETER_TILE  # BLOCK_K 32: a multiple of every scale block
    if scaling == "micro_native":
        return SCALED_MM_NATIVE_TILE
    if type(m) is int and m <= 32:
        return SCALED_MM_MICRO_SKINNY_TILE
    return SCALED_MM_MICRO_TILE


# --- grouped_mm -----------------------------------------------------------------------------------
# The persistent grouped kernel launches one tile for all groups, chosen from a group's average
# size (offs stays on the device, so the host never sees the real group sizes). Tiles are written
# for 2-byte inputs; BLOCK_K is rescaled per dtype and stages shed to fit shared memory as for mm.

# Groups averaging fewer rows than this get 64-row tiles (less work wasted on each group's last,
# partial tile row); 16-row tiles below GROUPED_TINY_ROWS (decode-sized groups, and the one-row
# products of the bias gradient).
GROUPED_SMALL_ROWS = 128
GROUPED_TINY_ROWS = 16
# From this many output columns on, 128x256 tiles (TMA loads only): every group then has at
# least 8 column tiles, and the wider tile halves the A re-reads that bound MoE shapes.
GROUPED_WIDE_N = 2048


# C goes out through TMA (asynchronous stores clipped at each group's end) only where a group
# averages at least this many output tiles per SM: each program builds the store's descriptor
# for every group it has tiles in, which costs more than the stores save on groups of a few tiles
# per program (an MoE layer at 1024 tokens per expert on an H100: 0.84-0.99x torch._grouped_mm
# with TMA stores against 0.87-1.01x without), and pays off on large groups (Mixtral's weight
# gradient, 1792 tiles per group: 1.02-1.03x against 0.98-1.01x).
GROUPED_TMA_STORE_TILES_PER_SM = 4


def grouped_tma_store(tile: TileConfig, m_per_group: int, n_per_group: int,
                      num_sms: int) -> bool:
    """Whether the grouped kernel should store C through TMA (where it can) for groups of
    ``m_per_group`` x ``n_per_group`` outputs on average; always under the interpreter, which
    then runs the same code as Hopper."""
    if _device.interpreter_enabled():
        return True
    tiles = output_tiles(m_per_group, n_per_group, tile)
    return tiles >= GROUPED_TMA_STORE_TILES_PER_SM * num_sms


def heuristic_grouped_tile(m_per_group: int, n: int, element_size: int, tma: bool,
                           tma_out_size: int = 0, fp32_steps: bool = False,
                           gathered: bool = False) -> TileConfig:
    """The grouped kernel's tile for groups of ``m_per_group`` output rows (on average) and
    ``n`` output columns each, ``tma`` when the operands load through TMA descriptors (Hopper),
    ``tma_out_size`` (C's element size) when C is stored through them too (its staging buffer
    takes shared memory from the pipeline's stages), ``fp32_steps`` when every K step's product
    is added to the accumulator in fp32 (tgemm::scaled_grouped_mm's rowwise scales without fast
    accumulation, and its blockwise scales), ``gathered`` when A's rows arrive through an index
    (tgemm::moe_mlp's gathering launches, pointer loaders) on a GPU with TMA.

    - interpreter: the small tile every interpreted kernel uses;
    - T/G under 16 rows: 16x128 tiles; under 128 rows: 64x128 tiles, 4 warps, 4 stages;
    - otherwise (MoE layers): 128x256x64 with 8 warps, 3 stages and 16-row bands when N is
      large and TMA feeds the tiles or the rows are gathered, 128x64 tiles for narrow outputs,
      else 128x128x64 with 8 warps and 4 stages. Gathered rows: Mixtral's first MoE launch
      (SwiGLU in the epilogue, 1024 and 4096 rows per expert) ran 1.16-1.23x faster on an H100
      with the wide tile (650-730 TFLOP/s, as the TMA kernel on pre-gathered rows) than with
      128x128. The wide tile also serves weight gradients with few tokens per
      expert: with each group's tiles in one flattened pipeline, Mixtral's at 256 tokens per
      expert ran 0.93x torch._grouped_mm on an H100, against 0.90x for two programs per SM on
      128x128 tiles (which had beaten the wide tile without flattening). Not with
      ``fp32_steps``: the step's product is a second fp32 tile in registers, and at 128x256
      with 8 warps the fp8 kernel spills (ptxas for sm_90a: 280 bytes of spill stores; none
      at 128x128, nor at 128x256 with the tensor cores accumulating).
    """
    if _device.interpreter_enabled():
        return INTERPRETER_TILE
    if m_per_group < GROUPED_TINY_ROWS:
        tile = TileConfig(16, 128, 64, 1, 4, 4)
    elif m_per_group < GROUPED_SMALL_ROWS:
        tile = TileConfig(64, 128, 64, 8, 4, 4)
    elif (tma or gathered) and n >= GROUPED_WIDE_N and not fp32_steps:
        tile = TileConfig(128, 256, 64, 16, 8, 3)
    elif n <= 64:
        tile = TileConfig(128, 64, 64, 8, 4, 4)
    else:
        tile = TileConfig(128, 128, 64, 8, 8, 4)
    smem = _device.shared_memory_per_block(0)
    if tma_out_size:
        smem -= tma_epilogue_bytes(tile, tma_out_size, epilogue_subtile(tile))
    return _fit_shared_memory(_for_dtype(tile, element_size), element_size, smem)



def moe_elementwise_tile() -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of moe_mlp's 2-D-gridded elementwise kernels: the gated
    activation's forward and the combine."""
    if _device.interpreter_enabled():
        return INTERPRETER_MOE_ELEMENTWISE_TILE
    return MOE_ELEMENTWISE_TILE


def moe_glu_backward_tile() -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the gated activation's backward (kernels/glu.py), whose
    programs each walk a whole row block."""
    if _device.interpreter_enabled():
        return INTERPRETER_MOE_ELEMENTWISE_TILE
    return MOE_GLU_BACKWARD_TILE
