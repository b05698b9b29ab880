"""A machine model of tgemm::mm's plans: predicted kernel time of a plan on a shape, and the plan
of the plan space (``tuning.plan_space``) with the least of it.

Pure Python of shapes, plans and the GPU's numbers (SM count, memory bandwidth), so it runs and
is tested on any host. What it models, for a plan's persistent or one-shot programs:

- work on the busiest program: K steps and tiles (whole tiles in waves of programs; stream-K's
  even share of the shared tiles' K steps plus the partials it adds; a split's units), each step
  costing its tile's measured step time, each tile its epilogue;
- bytes: the operands and the output cross device memory at least once, at the bandwidth of the
  programs that are busy (a few programs cannot draw the whole memory system's bandwidth), and
  every tile's operand rows and columns cross from L2 to its SM (``l2_us``);
- fixed costs: a launch, a split's reduction launch and partials, the copies that make operands
  TMA can describe.

The constants (``COSTS``) are fitted to kernel-only timings of every plan on sweep shapes by
``python -m torch_triton_gemm.bench.fit`` from the CSV that ``python -m
torch_triton_gemm.bench.plans`` writes on the GPU; a tile without fitted constants is costed
like the nearest fitted one in size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import tuning


@dataclass(frozen=True)
class Machine:
    """What the model needs to know of the GPU."""

    num_sms: int
    # Device memory bandwidth, bytes per microsecond, and the most one busy SM draws.
    bytes_per_us: float
    sm_bytes_per_us: float
    # The L2 cache (l2_us); the fitted H100's unless the GPU says otherwise (with_machine).
    l2_bytes: int = 50 * 2**20


@dataclass(frozen=True)
class TileCost:
    """Measured costs of one tile on one kernel, in microseconds."""

    launch_us: float  # a launch of the kernel with this tile (larger shared memory costs more)
    step_us: float  # one BLOCK_K step of a whole tile on one SM
    tile_us: float  # per tile: prologue and epilogue


@dataclass(frozen=True)
class Costs:
    """The fitted constants of the model (microseconds unless named otherwise)."""

    # Of the split-K reduction ("reduce"), the copies ("copy") and, once fitted, of splits
    # finishing their own tiles: a fixed cost ("fixup") and one per KiB of partials the
    # finishing program reads back ("fixup_per_kib").
    launch_us: Mapping[str, float]
    exchange_us: float  # a stream-K partial handed over and added
    tiles: Mapping[tuple[str, int, int, int, int], TileCost]  # (kernel, bm, bn, warps, stages)
    machine: Machine


def cost_kernel(kernel: str, narrow: bool, a_m_contiguous: bool = False,
                one_step: bool = False, pitch_vector: int = 0) -> str:
    """The kernel name costs are kept under. The portable kernel reading operands whose pitches
    are not multiples of 16 elements (``narrow``) is a kernel apart where each program takes
    one K step (``one_step``, see the function of that name: one load of each operand tile,
    whatever the pitch), and in a longer K loop two more, by the widest cp.async copy the
    narrow pitches allow (``pitch_vector``, see the function of that name). Where that is 4
    or 8 bytes ('portable-narrow-vector'), the loop ran on an H100 3-4x faster than the
    constants of the others ('portable-narrow') predicted; the picks its own constants moved
    ran 1.09x faster in geomean on four held-out seeds (54 picks, 31 faster by more than 5%,
    14 slower). Where it is 16 bytes, TMA reads the operands as they are, and constants
    fitted to those loops took the portable kernel over TMA to lose (seeds 8 and 11: 170
    picks moved, 115 slower by more than 5%; 8 x 296 x 504: 3.4 -> 4.9 us), so such pitches
    keep the others' constants; so does a pitch no copy fits (element by element).
    So is the portable kernel reading an M-contiguous A (x.t() in a weight gradient), which
    ran at a third of the Hopper kernel's speed on an H100 (128 x 4416 x 2432: 32.6 us
    against 17.9)."""
    if kernel != "portable":
        return kernel
    if narrow:
        if one_step:
            return "portable-narrow-one-step"
        return "portable-narrow-vector" if 4 <= pitch_vector < 16 else "portable-narrow"
    return "portable-mcol" if a_m_contiguous else kernel


def pitch_vector(narrow_pitches: Iterable[tuple[int, int]], hinted: bool = True) -> int:
    """The widest cp.async copy, in bytes (4, 8 or 16), that the portable kernel's K loop can
    make along every one of ``narrow_pitches`` ((stride, element size) of each pitch that is
    not a multiple of 16 elements), as the launcher's pitch hints tell it
    (``tuning.pitch_alignment``); 0 where one allows none (below 4 bytes: the loop loads
    element by element), and where the kernel has no pitch hints (``hinted``:
    ``tuning.pitch_hints_enabled``)."""
    widths = [tuning.pitch_alignment(stride, size) * size for stride, size in narrow_pitches]
    if not widths:
        return 16  # Triton sees pitches that are multiples of 16 elements itself
    return min(widths) if hinted and min(widths) >= 4 else 0


# A cost kernel without fitted tiles of its own is costed as the one it refines.
REFINES = {"portable-narrow-one-step": "portable-narrow",
           "portable-narrow-vector": "portable-narrow"}


# Whether the launcher copies a product's operands TMA cannot describe as they are, for plans
# that leave ``pad`` unset (``operands.kernel_operands``: large products); the plan model's
# portable plans then read them as they are (``pad=False``), as it costs them. While portable
# plans left ``pad`` unset, the launcher copied for them too: on an H200, 7944 x 512 x 52
# (pitch 52) ran its pick in 16.5 us, two copies of 2.2 us and the GEMM's 11.7, against 12.6
# predicted and cuBLAS's 7.1 (docs/data/bench-sweep-h200-seed2166-shard2-a357cd4.csv); reading
# them as they are, 8.7 us (docs/data/bench-sweep-h200-seed2166-shard2-bf16-183a0c4-draft.csv).
# Held out (H200, seeds 3000-3005, the 12 bf16 products whose portable pick it moves off the
# copies): 1.16x faster in geomean, 10 faster (up to 1.51x), 1728 x 1408 x 64 0.80x and 792 x
# 3141 x 64 0.90x, both still 1.1x cuBLAS
# (docs/data/plans-h200-portable-reads-as-is-ab-d0ea6e9.csv).
# A draft that costed the portable kernel on the copies instead, with the copies charged,
# moved products from TMA onto it, and 4032 x 2304 x 102 ran 2x slower there (17.4 -> 35.2 us).
# Off (PORTABLE_READS_AS_IS False): portable plans leave ``pad`` unset, as before.
PORTABLE_READS_AS_IS = True


def one_step(plan: tuning.MMPlan, k: int, element_size: int) -> bool:
    """Whether each program of ``plan`` takes one K step through ``k`` columns (see
    ``cost_kernel``): one whole BLOCK_K step, or one step of the remainder
    (``tuning.k_loop_steps``). K <= BLOCK_K is not enough: on an H100 15104 x 192 x 120 on
    64x64x128 tiles (two remainder steps of 64) took 15.7 us, twice what constants fitted to
    single steps predicted."""
    return tuning.k_loop_steps(k, plan.tile, element_size) == 1


def _tile_key(kernel: str, tile: tuning.TileConfig) -> tuple[str, int, int, int, int]:
    return (kernel, tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)


def tile_cost(costs: Costs, kernel: str, tile: tuning.TileConfig) -> TileCost:
    """The fitted cost of ``tile`` on ``kernel`` (a ``cost_kernel`` name); an unfitted tile (a
    tuned or forced one) takes the fitted tile nearest in size on the same kernel, scaled by the
    area ratio."""
    key = _tile_key(kernel, tile)
    known = costs.tiles.get(key)
    if known is not None:
        return known
    area = tile.block_m * tile.block_n
    same = [(k, c) for k, c in costs.tiles.items() if k[0] == kernel]
    if not same and kernel in REFINES:
        return tile_cost(costs, REFINES[kernel], tile)
    same = same or list(costs.tiles.items())
    (_, bm, bn, _, _), cost = min(
        same, key=lambda kc: abs(math.log(kc[0][1] * kc[0][2] / area)))
    scale = area / (bm * bn)
    return TileCost(cost.launch_us, cost.step_us * scale, cost.tile_us * scale)


@dataclass(frozen=True)
class Work:
    """How a plan spreads a shape over programs: the busiest program's K steps, tiles and
    stream-K exchanges, how many programs are busy, the launches and the extra bytes."""

    steps: float
    tiles: float
    exchanges: float
    busy: int
    reduce: bool
    extra_bytes: float
    # Splits that finish their own tiles: partial bytes the busiest program reads back, one
    # after another, to finish its tiles (0: none, or a reduction launch instead).
    fixup_bytes: float = 0.0


def plan_work(plan: tuning.MMPlan, m: int, n: int, k: int, num_sms: int) -> Work:
    """The work of ``plan`` on an m x n x k product (see ``Work``)."""
    if tuning.inlines_splits(plan):
        # One program per tile through all of its K splits: the unsplit plan's K steps, and
        # a tile's prologue and epilogue for each split (its K loop starts afresh).
        whole = plan_work(dataclasses.replace(plan, split_k=1, split_tail=False,
                                              split_inline=False), m, n, k, num_sms)
        split, _ = tuning.effective_split(k, plan.tile.block_k, plan.split_k)
        return dataclasses.replace(whole, tiles=whole.tiles * split)
    tile = plan.tile
    tiles = tuning.output_tiles(m, n, tile)
    k_steps = max(1, -(-k // tile.block_k))
    programs = num_sms * plan.programs_per_sm
    persistent = plan.kernel == "tma" or tuning.warp_specialized(plan)
    if plan.stream_k and persistent and plan.split_k <= 1:
        shared = tuning.stream_k_tiles(tiles, programs, plan.stream_k)
        if shared:
            rounds = (tiles - shared) // programs
            share = shared * k_steps / programs
            # Partials a finishing program adds: the other programs its tile was shared with.
            exchanges = max(0.0, k_steps / share - 1) if share else 0.0
            return Work(rounds * k_steps + math.ceil(share), rounds + min(2.0, 1 + share /
                        k_steps), exchanges, programs, False, 0.0)
    split, k_per_split = tuning.effective_split(k, tile.block_k, plan.split_k)
    whole, split = tuning.split_tiles(tiles, split, plan.split_tail, num_sms)
    if split <= 1:
        rounds = -(-tiles // programs) if persistent else -(-tiles // num_sms)
        return Work(rounds * k_steps, rounds, 0.0, min(tiles, num_sms), False, 0.0)
    split_steps = -(-k_per_split // tile.block_k)
    units = (tiles - whole) * split
    rounds = whole // num_sms + -(-units // num_sms)
    steps = whole // num_sms * k_steps + -(-units // num_sms) * split_steps
    partial_bytes = 2.0 * units * tile.block_m * tile.block_n * 4
    busy = min(max(units, whole), num_sms)
    if tuning.fixes_up_splits(plan, split):
        # The last split of each tile reads the others' partials back: the split tiles are
        # finished by as many programs, in rounds of num_sms.
        finishing = -(-(tiles - whole) // num_sms) * (split - 1) * tile.block_m * tile.block_n * 4
        return Work(steps, rounds, 0.0, busy, False, partial_bytes, float(finishing))
    return Work(steps, rounds, 0.0, busy, True, partial_bytes)


# An H100 SM's shared memory (228 KiB); each resident program takes 1 KiB more than it asks for.
SM_SHARED_BYTES = 233472
PROGRAM_RESERVED_BYTES = 1024
# What each more program sharing an SM adds to the time of one (co_resident_rounds).
CO_RESIDENT_ROUND = 0.6


def co_resident_rounds(tile: tuning.TileConfig, rounds: int, element_size: int) -> float:
    """Rounds of work the busiest SM does when ``rounds`` unsplit programs of the portable
    kernel with ``tile`` land on it and its shared memory holds them all at once: a program of
    64 rows or more is bound by its latency, not by the SM's throughput, so each more one adds
    CO_RESIDENT_ROUND of its time, not a whole round (``rounds`` itself where they do not all
    fit, or under 64 rows, whose programs stream their operands). On an H100, 309 x 4923 x 6016
    on 64x128 tiles (195 tiles, two to an SM) took 41.1 us, about 1.6 rounds by the constants
    (docs/data/mid-rows-h100-seed2070-every-plan.csv)."""
    if tile.block_m < 64 or rounds < 2:
        return rounds
    fit = SM_SHARED_BYTES // (tuning.shared_memory_bytes(tile, element_size)
                              + PROGRAM_RESERVED_BYTES)
    return rounds if rounds > fit else 1 + (rounds - 1) * CO_RESIDENT_ROUND


# K splits of the portable kernel loading element by element: what each more program sharing
# an SM adds to the time of one (narrow_overlap; 1.0: a whole round, as the constants charge),
# where its programs take at least this many K steps each.
NARROW_OVERLAP_ROUND = 0.5
NARROW_OVERLAP_STEPS = 4


def narrow_overlap(plan: tuning.MMPlan, work: Work, kernel: str, pitch_vector: int,
                   element_size: int) -> float:
    """What ``work``'s compute costs, as a fraction of the constants' charge, where ``plan``
    splits K on the portable kernel along a pitch no copy fits (``kernel`` 'portable-narrow'
    with no ``pitch_vector``: every load one element) and the rounds of split programs on the
    busiest SM fit its shared memory at once: each such program waits on its loads in turn,
    so the programs sharing an SM overlap, each more one adding NARROW_OVERLAP_ROUND of a
    round. 1 elsewhere.

    The constants charge every round in full, so such products took few splits: on an H200,
    24 x 3896 x 10461 bf16 split 2 ways on 32x64 tiles ran 147 us, 4 ways (two programs an
    SM) 90.5, cuBLAS 90.0; 18 x 2571 x 4481 47 us split 3 ways, 33 split 6 ways
    (docs/data/plans-h200-narrow-worst-seed2118.csv). Judged on every plan sweep in docs/data
    (bench.fit's check), this rule moved 13 picks, 1.46x faster in geomean (3456 x 64 x 16139
    on an H100: 174 -> 96 us), one slower (64 x 4520 x 10516: 172 -> 202 us, TMA onto a 6-way
    split); at 0.6 a round the same, at 0.4 16 picks, 1.34x (4 slower). Without the floor on
    K steps it moved 15, 1.38x: short loops too, slower (960 x 1 x 3080: 7.3 -> 8.2 us).
    Unsplit rounds (co_resident_rounds' case, for plain pitches) keep the constants' charge;
    so do pitches the kernel copies in vectors.

    Held out on an H200 (sweep seeds 2124-2131, the 29 bf16 products whose pick it moves,
    each arm twice, alternating; docs/data/narrow-overlap-ab-h200-seed2118-2124-2131.csv):
    1.19x faster in geomean, 21 faster by more than 5% (64 x 2752 x 15488: 88.0 -> 52.1 us),
    4 slower, all unsplit picks split on short K loops (64 x 4808 x 663: 11.5 -> 14.3 us, 3
    ways; 4-8 K steps a program). On seed 2118's 6: 1.10x (5656 x 62 x 5443 with a
    column-major A 0.64x, onto 2 splits from 4: its three rounds, more than fit an SM at once,
    keep the full charge here, though two at a time overlap too; 448 x 256 x 8077 0.80x, off
    a padded TMA split)."""
    rounds = work.tiles
    if (kernel != "portable-narrow" or pitch_vector or plan.split_k <= 1 or rounds < 2
            or work.steps < NARROW_OVERLAP_STEPS * rounds or NARROW_OVERLAP_ROUND >= 1.0):
        return 1.0
    fit = SM_SHARED_BYTES // (tuning.shared_memory_bytes(plan.tile, element_size)
                              + PROGRAM_RESERVED_BYTES)
    if rounds > fit:
        return 1.0
    return (1 + (rounds - 1) * NARROW_OVERLAP_ROUND) / rounds


# The portable kernel's one-step tiles on narrow pitches it copies in less than 16-byte vectors
# (cost kernel 'portable-narrow-one-step', pitch vector 0, 4 or 8) where K is shorter than
# the tile's BLOCK_K, on outputs of more than NARROW_LARGE_OUTPUT_BYTES: their constants,
# fitted mostly on small outputs, predict too little. Timed, such plans took 1.34x (element by
# element), 1.48x (4-byte copies) and 1.36x (8-byte copies) their predicted times in geomean
# (153 plan timings of H100 seeds 1 and 9-14), against 1.0-1.2x on outputs under 4 MB and
# 0.8-1.1x where K fills the tile's step; on an H200, 6144 x 3858 x 19 on 64x128 tiles 48.4
# us, predicted 29.7, where TMA on padded copies ran 33.7 (predicted 33.4) and cuBLAS 39.3
# (docs/data/plans-h200-seed2166-worst-a357cd4.csv). Charged with NARROW_LARGE_OUTPUT_FACTOR.
# Held out (H200, seeds 3001-3007, the 7 bf16 products it moves onto TMA on padded copies):
# 1.19x faster in geomean, 1.04-1.42x on six, 0.84x on 4873 x 6528 x 4 with B row-major
# (25.8 -> 30.6 us, still 1.21x cuBLAS) (docs/data/plans-h200-narrow-large-output-ab-f82d6b8.csv).
NARROW_LARGE_OUTPUT_BYTES = 4 << 20
NARROW_LARGE_OUTPUT_FACTOR = 1.4


def narrow_large_output(kernel: str, pitch_vector: int, k: int, block_k: int,
                        output_bytes: int) -> float:
    """The factor on a plan's compute for the one-step narrow tiles' large outputs (see
    NARROW_LARGE_OUTPUT_FACTOR); 1 elsewhere."""
    if (kernel == "portable-narrow-one-step" and pitch_vector < 16 and k < block_k
            and output_bytes > NARROW_LARGE_OUTPUT_BYTES):
        return NARROW_LARGE_OUTPUT_FACTOR
    return 1.0


# What the L2 cache serves the SMs, bytes per microsecond, and how sharply that limit takes
# over from the rest of a plan's time where they come close (see l2_us; 0: no limit).
L2_BYTES_PER_US = 1.3e7
L2_LIMIT_POWER = 8.0


def l2_us(plan: tuning.MMPlan, m: int, n: int, k: int, element_size: int,
          cache_bytes: int) -> float:
    """The time the SMs take to read ``plan``'s operand tiles from L2, where an operand is
    larger than the L2 cache of ``cache_bytes`` (``Machine.l2_bytes``; 0 elsewhere): every
    output tile reads its BLOCK_M rows of A and
    BLOCK_N columns of B over the whole of K (split or not), so a tile narrower than the
    product re-reads the other operand, once per tile of it, where device memory gives each
    byte once (``predict_us``'s bytes). ``predict_us`` adds it as a smooth maximum (the
    L2_LIMIT_POWER-norm) with the rest of the time.

    The constants (time, bytes, bandwidth) charged every plan of a wide weight about the same
    time, bound by its bytes, and the pick then fell to the cheapest compute, which on such
    products are tiles of 64 rows or columns that read the weight two to four times from L2.
    On an H100, 128 x 28672 x 4096 (Llama-3-8B's gate and up projections at 128 tokens) took
    110.6 us on 64x64 tiles against 92.0 on 64x128 and 90.4 on 128x128
    (docs/data/plans-h100-seed1-extra-tiles.csv, overlap-tiles-h100.csv): 940 against 705 and
    470 MB read from L2, about 8.5 TB/s for the first.

    Chosen on every plan of the H100 sweeps the constants were fitted on (plans-h100-seed1*.csv,
    mid-rows-h100-seed2070-every-plan.csv, overlap-tiles-h100.csv): 13 TB/s and power 8 moved
    14 picks there, 1.15x faster in geomean (2 slower, 0.85x at worst; 10 TB/s and power 4:
    42 picks, 1.10x, 9 slower). Held out on an H200, every plan timed on 49 mid-row products of
    seed 2113 whose pick a limit of 10-13 TB/s moves (docs/data/l2-plans-h200-seed2113.csv,
    the cases in l2-cases-seed2113.csv): the 18 picks it moved ran 1.145x faster, 3 slower
    (0.81x at worst: 153 x 50608 x 11776 onto 256-row TMA tiles), and the picks of all 49
    against cuBLAS went 1.011 -> 1.062 in geomean. The bound on the operands' size came after
    that run: without it the limit also moved 256 x 6144 x 4096 (Llama-3-8B's qkv at 256
    tokens, whose 50.3 MB weight the cache holds) off the co-resident 64x128 tiles that ran
    it fastest of every plan timed (30.3 us on an H100, overlap-tiles-h100.csv) onto an
    untimed TMA plan. With it: 10 moves on the fitting sweeps, 1.23x faster, none slower;
    none on the other H100 sweeps (seeds 6-14, 2080); 17 on the H200's, 1.15x, the same 3
    slower. Of the benchmark's named suites it moves only that gate and up projection."""
    if not L2_BYTES_PER_US or max(m * k, k * n) * element_size <= cache_bytes:
        return 0.0
    tile = plan.tile
    tiles_m, tiles_n = -(-m // tile.block_m), -(-n // tile.block_n)
    return tiles_m * tiles_n * (tile.block_m + tile.block_n) * k * element_size / L2_BYTES_PER_US


# What a launch of one round costs, as a fraction of the fitted launch constant, on the kernels
# where the fit over-charges it (single_round): TMA programs that each finish one tile.
SINGLE_ROUND_LAUNCH = {"tma": 0.8}


# A TMA launch of a product of at most FEW_ROWS_TMA_MAX_ROWS rows, at least
# FEW_ROWS_TMA_MIN_COLUMNS columns and FEW_ROWS_TMA_MIN_K deep, unsplit, costs
# FEW_ROWS_TMA_CREDIT_US less than its fitted constant (few_rows_tma_credit; bench
# --no-few-rows-tma-credit plans without it).
FEW_ROWS_TMA_MAX_ROWS = 32
FEW_ROWS_TMA_MIN_COLUMNS = 2048
FEW_ROWS_TMA_MIN_K = 1024
FEW_ROWS_TMA_CREDIT_US = 2.0


def few_rows_tma_credit(plan: tuning.MMPlan, m: int, n: int, k: int) -> float:
    """What to take off the fitted launch of ``plan`` on an ``m`` x ``n`` x ``k`` product, in
    microseconds: FEW_ROWS_TMA_CREDIT_US for the TMA kernel, unsplit (nor stream-K), at most
    FEW_ROWS_TMA_MAX_ROWS rows, FEW_ROWS_TMA_MIN_COLUMNS columns or more and K at least
    FEW_ROWS_TMA_MIN_K, else nothing.

    The constants were fitted on an H100 whose TMA kernel built its descriptors on the device
    in every launch; on H200s, with CUDA-graph replays launching host-built ones, the same tile
    of 16-32 rows ran faster on the TMA kernel than on the portable one in 79% of 38 pairs
    (docs/data/fewrows-shortk-plans-h200-2547e5e.csv; 60% of few-rows-plans-h200.csv's),
    which the constants predicted in 3% (5%): they over-charged TMA against the portable
    kernel by a median 1.7 us (2.0), hence 2 us. Measured on H200s, same runs:
    - At every K, split and width of 1024 columns up (sweep seeds 3000-3011, docs/data/
      fewrows-tma-credit-ab-h200-seeds3000-3011-0573ddc.csv) the 119 picks it moved ran
      0.90x: below K 1024 (3 us kernels, where TMA's start is dearer) 0.87x (91 picks);
      onto split plans from K 1024 0.97x (14); onto unsplit ones from K 1024 1.13x (14, worst
      0.885x at 1216 columns), hence the K and split bounds.
    - Held out with those (seeds 3012-3051, the 62 plain bf16 products bench.picks moved, each
      arm twice, A B B A; docs/data/fewrows-tma-credit-ab-h200-seeds3012-3051-94247e7.csv):
      32 picks moved on the H200, 1.10x geomean, 27 faster, 0.98x -> 1.08x cuBLAS; the four
      slower (0.79-0.95x) all had under 2048 columns and lost a K split to an unsplit TMA
      plan, as did the fit set's slowest from K 1024 (1216 columns), hence
      FEW_ROWS_TMA_MIN_COLUMNS 2048: the other 27 ran 1.15x, worst 0.96x, 1.01x -> 1.15x
      cuBLAS (that bound read off both sets)."""
    if (plan.kernel == "tma" and plan.split_k == 1 and not plan.stream_k
            and m <= FEW_ROWS_TMA_MAX_ROWS
            and n >= FEW_ROWS_TMA_MIN_COLUMNS and k >= FEW_ROWS_TMA_MIN_K):
        return FEW_ROWS_TMA_CREDIT_US
    return 0.0


def single_round(work: Work) -> bool:
    """Whether every program of ``work`` finishes at most one tile, unsplit: no second round,
    reduction or fix-up after it. The constants, fitted over plans of every length, charged
    such plans 1.25-2x what they ran on an H100 on both kernels (tall short-K outputs: TMA
    128-row tiles 7-12 us where 10-20 were predicted, docs/data/plans-h100-seed2080-trailing.csv);
    most of it is the launch, which in a one-round TMA launch overlaps the descriptors' set-up
    and the programs' prologues. Charging the TMA kernel's one-round launches 0.8 of the
    constant moved 106 of 2400 picks on held-out sweep seeds 2081-2083 (bf16 and fp16; the
    plans before and after, each timed twice, alternating, on one H100,
    docs/data/single-round-ab-h100-seed*.csv): 1.093x faster in geomean (1.034x, 1.111x,
    1.114x per seed), 67 faster by more than 5%, 8 slower (384 x 3 x 64 with a column-major
    A: 2.1 -> 2.7 us); many moves replace a K split (two launches) with one TMA launch."""
    return work.tiles <= 1 and not work.reduce and not work.fixup_bytes


# The compute of one round of unsplit TMA programs on half the SMs or more (and at least this
# many K steps on the busiest one), as a fraction of what the constants charge: PARTIAL_ROUND[0] +
# PARTIAL_ROUND[1] * the fraction of SMs busy (see partial_round).
PARTIAL_ROUND = (0.8, 0.2)
WHOLE_ROUNDS = (1.0, 0.0)  # (PARTIAL_ROUND that charges every round in full: A/Bs of the rule)
PARTIAL_ROUND_STEPS = 16
PARTIAL_ROUND_FILL = 0.5


def partial_round(plan: tuning.MMPlan, work: Work, num_sms: int) -> float:
    """What ``work``'s compute (``plan``'s) costs, as a fraction of the constants' charge,
    where it is one round of unsplit programs on part of the SMs (every busy program one
    whole tile, all at once): with fewer SMs drawing on L2 and memory, each K step is faster.
    1 elsewhere.

    The constants, fitted mostly on full rounds, charged one-round plans of at least 16 K steps
    1.6-1.8x their time with a few SMs busy, 1.15-1.2x with half and 1.0-1.1x with three
    quarters, on both kernels, split or not (every plan of docs/data/plans-h100-*.csv; two
    rounds or more: about what they took). Applied to both kernels at any fill (0.8 + 0.2 *
    the fraction busy, 16+ K steps), it also took K splits of small products (whose splits, of
    fewer K steps, it left alone) onto one round on a fifth of the SMs, which ran slower on an
    H100 (576 x 120 x 1976: 6.8 -> 9.7 us). Applied to TMA plans on half the SMs or more
    (this rule), the picks it moved among the products timed (docs/data/partial-round-ab-h100.csv,
    each plan twice, alternating): 512 x 6144 x 4096 (Llama-3-8B's qkv at 512 tokens), 512 x
    6144 x 4040, 768 x 4096 x 4096 and 1664 x 1736 x 2496 from 128x128 K splits or portable
    tiles onto one round of 128x256 tiles, 1.24-1.32x faster (55.2 -> 43.7 us); 193 x 5760 x
    3328 and 81 x 9916 x 1280, 0.96-0.99x. The fill bound was chosen after those timings.
    Held out on sweep seeds 2088-2095 (docs/data/partial-round-held-out-h200.csv, each arm
    twice, alternating, on an H200), that version moved 8 bf16 products: the 3 it moved onto
    unsplit plans ran 1.05-1.38x faster (1408 x 886 x 2920: 32.5 -> 23.6 us), the 5 onto
    K-split plans 0.77-0.98x (64 x 824 x 13440 with a column-major A: 12.3 -> 15.9 us); hence
    unsplit plans only (every move of the first A/B was onto one too)."""
    if (plan.kernel != "tma" or plan.split_k > 1 or work.tiles > 1 or work.busy >= num_sms
            or work.steps < PARTIAL_ROUND_STEPS or work.busy < PARTIAL_ROUND_FILL * num_sms):
        return 1.0
    floor, slope = PARTIAL_ROUND
    return min(1.0, floor + slope * work.busy / num_sms)


# The share of a tail split's reduction bytes that its time is charged, at the memory's
# bandwidth (tail_reduction_us; 0: only the reduction's launch, as for other splits).
TAIL_REDUCTION_BYTES = 1.0


def tail_reduction_us(plan: tuning.MMPlan, m: int, n: int, k: int, out_size: int,
                      machine: Machine) -> float:
    """What the reduction of a TMA ``plan``'s tail split (``split_tail``: the last, partial
    round of tiles split along K after the whole tiles) costs beyond its launch: it reads every
    split's fp32 partial of those tiles and writes them, at the memory's bandwidth. 0 for
    other plans.

    A tail split of large tiles on a short K reads a wave of fp32 partials back: on an H200,
    8192 x 2752 x 1024 (the drop-in model's gate projection) took 86.6 us on 128x256 tiles
    with a 3-way tail split, the planner's pick before this charge, and 75.2 unsplit
    (docs/data/plans-h200-training.csv). Judged on every plan sweep in docs/data (bench.fit's
    check), this charge moved 8 picks, 1.08x faster in geomean: 6 faster (1536^3 1.22x,
    1500^3 and 2047 x 2049 x 2051 1.18x, 445 x 13584 x 15984 1.26x), 2 slower onto full K
    splits (391 x 6080 x 7568 0.79x, 512 x 4864 x 8192 0.84x). Charging every split's bytes
    moved 61 picks, 19 slower (to 0.80x), 1.05x; charging portable tail splits too took
    products off the co-resident portable tiles that ran them fastest (``best_plan`` re-costs
    those only where a portable plan is the least: Llama-3-8B's qkv at 256 tokens). Held out
    on an H200 (docs/data/tail-reduction-ab-h200-seed2122-*.csv: the 16 bf16 products of seed
    2122's sweeps and the named suites whose pick it moves, each arm twice, alternating): 1.12x
    faster in geomean, 13 faster (1408 x 3968 x 1152 38.0 -> 24.4 us), 2 slower (166 x 23568 x
    15104 0.82x, 292 x 15376 x 5496 0.85x, both onto other tail splits)."""
    if not (plan.kernel == "tma" and plan.split_tail and TAIL_REDUCTION_BYTES):
        return 0.0
    tile = plan.tile
    tiles = tuning.output_tiles(m, n, tile)
    split, _ = tuning.effective_split(k, tile.block_k, plan.split_k)
    whole, split = tuning.split_tiles(tiles, split, True, machine.num_sms)
    if split <= 1:
        return 0.0
    partials = (tiles - whole) * tile.block_m * tile.block_n
    return TAIL_REDUCTION_BYTES * partials * (split * 4 + out_size) / machine.bytes_per_us


def predict_us(costs: Costs, plan: tuning.MMPlan, m: int, n: int, k: int, element_size: int,
               out_size: int, aligned: bool = True, narrow: bool = False,
               a_m_contiguous: bool = False, pitch_vector: int = 0, *,
               co_resident: bool = False) -> float:
    """Predicted kernel-only time of ``plan`` on an m x n x k product, in microseconds
    (``aligned``: the operands can be described for TMA as they are; ``narrow``: their pitches
    are not all multiples of 16 elements; ``a_m_contiguous``: A's columns are contiguous;
    ``pitch_vector``: the widest copy the portable kernel makes along narrow pitches, see
    ``cost_kernel``; ``co_resident``: an unsplit portable plan on plain pitches counts
    ``co_resident_rounds``, see ``best_plan``)."""
    machine = costs.machine
    work = plan_work(plan, m, n, k, machine.num_sms)
    kernel = cost_kernel(plan.kernel, narrow, a_m_contiguous, one_step(plan, k, element_size),
                         pitch_vector)
    if co_resident and kernel == "portable" and not work.reduce and not work.fixup_bytes:
        rounds = co_resident_rounds(plan.tile, int(work.tiles), element_size)
        work = dataclasses.replace(work, steps=work.steps * rounds / work.tiles, tiles=rounds)
    cost = tile_cost(costs, kernel, plan.tile)
    compute = work.steps * cost.step_us + work.tiles * cost.tile_us
    compute *= partial_round(plan, work, machine.num_sms) * narrow_overlap(
        plan, work, kernel, pitch_vector, element_size) * narrow_large_output(
        kernel, pitch_vector, k, plan.tile.block_k, m * n * out_size)
    compute += work.exchanges * costs.exchange_us
    operand_bytes = (m * k + k * n) * element_size
    bytes_moved = operand_bytes + m * n * out_size + work.extra_bytes
    bandwidth = min(machine.bytes_per_us, work.busy * machine.sm_bytes_per_us)
    launch = cost.launch_us
    if single_round(work):
        launch *= SINGLE_ROUND_LAUNCH.get(kernel, 1.0)
    launch = max(launch - few_rows_tma_credit(plan, m, n, k), 0.0)
    time = launch + max(compute, bytes_moved / bandwidth)
    if work.reduce:
        time += costs.launch_us["reduce"] + tail_reduction_us(plan, m, n, k, out_size, machine)
    if work.fixup_bytes:
        # The counter's round trip and the finishing programs' reads of the partials (from L2,
        # all of a tile's at once: a rate of their own).
        time += (costs.launch_us["fixup"]
                 + work.fixup_bytes / 1024 * costs.launch_us["fixup_per_kib"])
    if plan.kernel == "tma" and not aligned:
        # Copying the operands: read and write each once, in a kernel of its own.
        time += costs.launch_us["copy"] + 2 * operand_bytes / machine.bytes_per_us
    l2 = l2_us(plan, m, n, k, element_size, machine.l2_bytes)
    if not l2:
        return time  # (exactly: equal predictions keep their order)
    return (time ** L2_LIMIT_POWER + l2 ** L2_LIMIT_POWER) ** (1 / L2_LIMIT_POWER)


def best_plan(costs: Costs, plans: Iterable[tuning.MMPlan], m: int, n: int, k: int,
              element_size: int, out_size: int, aligned: bool = True,
              narrow: bool = False, a_m_contiguous: bool = False,
              pitch_vector: int = 0) -> tuning.MMPlan:
    """The plan of ``plans`` with the least predicted time (the first of equals). Where that is
    on the portable kernel, the portable plans are costed again with co-resident rounds
    (``co_resident_rounds``), and the least of them takes over if it costs no more.

    Unsplit portable programs that all fit on their SMs at once run a second wave beside the
    first (two 64x128 tiles an SM: about 1.6 rounds, where the constants charge 2), so the K
    splits and the tiles of one program an SM that the model picks over them buy nothing. On
    an H100 every such move timed ran faster: 10 of 10 products, 1.14-1.45x (Llama-3-8B's qkv
    at 256 tokens 43.3 -> 30.5 us; docs/data/overlap-tiles-h100.csv,
    mid-rows-h100-seed2070-every-plan.csv, co-resident-ab-h100-seed2077-*.csv), and held out
    afterwards 28 of 28, 1.10-1.46x (co-resident-ab-h100-seed207{8,9}-*.csv). Costed so
    against every plan, 64x128 portable tiles two to an SM also took products from TMA tiles of
    twice their size filling one wave, a toss-up there (0.78-1.20x, 14 products of seed 2077):
    hence within the portable kernel only."""
    args = (m, n, k, element_size, out_size, aligned, narrow, a_m_contiguous, pitch_vector)
    timed = [(predict_us(costs, p, *args), p) for p in plans]
    time, plan = min(timed, key=lambda tp: tp[0])
    if plan.kernel != "portable":
        return plan
    shared_time, shared = min(((predict_us(costs, p, *args, co_resident=True), p)
                               for _, p in timed if p.kernel == "portable"),
                              key=lambda tp: tp[0])
    return shared if shared_time <= time else plan


# --- eager calls: the host's time as well as the GPU's -----------------------------------------
# Back-to-back eager calls each cost about the longer of the host's time to issue them and the
# GPU's to run them. The host's, measured on an H100's host with the GPU kept busy
# (docs/data/eager-host-diag-h100-3cb7a95.csv): a call of one kernel launch took about what
# torch.mm took, 14-23 us; each further launch (a split's reduction, a tail split's second
# GEMM launch) added about 10 us (64 x 120 x 1160 split 12 ways: 29.4 against torch.mm's
# 18.9; 1536^3 with a tail split, three launches: 43.4 against 22.7), and copying operands TMA
# cannot describe about 25 us an operand (512 x 1304 x 471: 73.1 against 23.3).


@dataclass(frozen=True)
class HostCosts:
    """What an eager call costs the host, in microseconds (see eager_us)."""

    call_us: float  # a call that launches one kernel
    launch_us: float  # each further kernel launch
    copy_us: float  # each operand copied into an aligned buffer first


H100_HOST = HostCosts(call_us=18.0, launch_us=10.0, copy_us=25.0)
# An eager call moves off the plan model's pick only onto a plan predicted to take at most this
# fraction of the pick's eager time: the GPU-time predictions of small products err by 10-20%.
EAGER_MARGIN = 0.85


def eager_launches(plan: tuning.MMPlan, m: int, n: int, k: int, num_sms: int,
                   copies: int = 0) -> tuple[int, int]:
    """(kernel launches, operand copies) of an eager call of ``plan`` on an m x n x k product,
    as the launcher makes them: a tail split launches its whole tiles and its split ones apart,
    a split without fix-ups its reduction (a portable ``split_inline`` plan: one launch), and
    the launcher first copies the ``copies`` operands TMA cannot describe as they are (the
    padded copies of ``operands.kernel_operands``, which a plan's ``pad`` asks for or, left
    unset, a large product gets on either kernel; none where ``pad`` is False)."""
    split, _ = tuning.effective_split(k, plan.tile.block_k, plan.split_k)
    if plan.stream_k and plan.kernel == "tma" and split <= 1:
        return 2, 0  # the GEMM and the zeroing of its flags
    whole, split = tuning.split_tiles(tuning.output_tiles(m, n, plan.tile), split,
                                      plan.split_tail, num_sms)
    launches = 1
    if split > 1 and not tuning.inlines_splits(plan):
        launches += (whole > 0) + (not tuning.fixes_up_splits(plan, split))
    return launches, 0 if plan.pad is False else copies


def eager_us(costs: Costs, host: HostCosts, plan: tuning.MMPlan, m: int, n: int, k: int,
             element_size: int, out_size: int, aligned: bool = True, narrow: bool = False,
             a_m_contiguous: bool = False, pitch_vector: int = 0, copies: int = 0) -> float:
    """Predicted time of ``plan`` per call in back-to-back eager calls: the longer of its kernel
    time (``predict_us``) and the host's time to issue its launches and the copies of the
    ``copies`` operands a TMA plan cannot read as they are."""
    launches, copied = eager_launches(plan, m, n, k, costs.machine.num_sms, copies)
    issue = host.call_us + (launches - 1) * host.launch_us + copied * host.copy_us
    return max(issue, predict_us(costs, plan, m, n, k, element_size, out_size, aligned, narrow,
                                 a_m_contiguous, pitch_vector))


def eager_plan(picked: tuning.MMPlan, m: int, n: int, k: int, element_size: int,
               out_size: int, num_sms: int, aligned: bool = True,
               narrow: bool = False, a_m_contiguous: bool = False, pitch_vector: int = 0,
               copies: int = 0, host: HostCosts = H100_HOST,
               l2_bytes: int | None = None,
               dram_gbps: float | None = None) -> tuning.MMPlan | None:
    """The plan that eager calls of a product launch instead of ``picked`` (``modelled_plan``'s,
    which CUDA-graph captures keep), or None where they launch ``picked`` too. ``copies``: the
    operands TMA cannot read as they are (0 where ``aligned``); ``l2_bytes``, ``dram_gbps``: as
    for ``modelled_plan``.

    Where ``picked`` is a K split of the portable kernel with a reduction launch (and a launch
    of its whole tiles, for a tail split): the same plan in one launch (``split_inline``: each
    program adds its tile's splits in split order, the bits of ``picked``), if ``eager_us``
    predicts that at most EAGER_MARGIN of ``picked``'s (the host's time of the extra launches
    then outweighs the GPU time the split saves). Not where a pitch lets the K loop load only
    element by element (``narrow`` with no ``pitch_vector``): one program then waits for each
    step's loads in turn, which the split spread over many (on an H200, 64 x 149 x 1163 ran 20
    -> 40 us, 8 x 648 x 2249 19 -> 64 us).

    On an H200, seed-2115 sweep (bf16 and fp16), the 48 products this rule moved without that
    exception and without ``plan_work``'s charge for each split's fresh K loop, both settings
    in one process, alternating (docs/data/eager-inline-h200-seed2115.csv): the same bits
    every time; 26 of them the final rule moves, eager calls 1.45x faster in geomean, none
    slower (a fit: those exceptions were chosen on this run). The rule before took the fastest
    one-launch plan of any tile, unsplit (other bits, so it was opt-in): 1.48x on seed 2112
    (docs/data/eager-plans-held-out-h200-seed2112.csv), 52 of its 68 moves onto ``picked``'s
    own tile. Splits that finish their tiles themselves (one launch, many programs per tile)
    gained only 1.02x (docs/data/eager-fixup-twin-ab-h100-seed2111.csv): their fix-ups' kernel
    time ate the host's saving.

    First, where the launcher would copy ``copies`` operands of a large product for
    ``picked``'s portable kernel (``picked.pad`` unset): the same plan reading them as they
    are (``pad`` False: the same tiles and K order, so the same bits; the plan model costs
    the portable kernel so in any case), by the same margin. On an H200, 2944 x 896 x 109
    (both pitches 109) took 64 us an eager call, two copies and the GEMM, against 15 in a CUDA
    graph and torch.mm's 19.6 (docs/data/eager-host-diag-h200-a4852a6.csv); not yet timed.
    (With PORTABLE_READS_AS_IS on, the model's portable picks read them as they are already.)

    Where ``picked`` is an unsplit plan of the persistent TMA kernel on operands it reads as
    they are, and the portable kernel on the same tile is predicted to take no longer than the
    host's time for a call (``host.call_us``): that plan (``portable_twin``)."""
    m, n, k = max(m, 1), max(n, 1), max(k, 1)
    costs = with_machine(H100_COSTS, num_sms, l2_bytes, dram_gbps)
    if picked.kernel == "tma":
        return portable_twin(costs, host, picked, m, n, k, element_size, out_size, aligned,
                             narrow, a_m_contiguous, pitch_vector, copies)
    if picked.kernel != "portable" or picked.split_fixup or picked.split_inline:
        return None
    args = (m, n, k, element_size, out_size, aligned, narrow, a_m_contiguous, pitch_vector,
            copies)
    plan = picked
    if copies and picked.pad is None:
        unpadded = dataclasses.replace(picked, pad=False)
        if eager_us(costs, host, unpadded, *args) <= EAGER_MARGIN * eager_us(costs, host,
                                                                             picked, *args):
            plan = unpadded
    moved = None if plan is picked else plan
    if (narrow and not pitch_vector) or eager_launches(plan, m, n, k, num_sms, copies)[0] == 1:
        return moved  # nothing to save: unsplit
    inline = dataclasses.replace(plan, split_inline=True)
    if eager_us(costs, host, inline, *args) > EAGER_MARGIN * eager_us(costs, host, plan,
                                                                      *args):
        return moved
    return inline


def portable_twin(costs: Costs, host: HostCosts, picked: tuning.MMPlan, m: int, n: int, k: int,
                  element_size: int, out_size: int, aligned: bool = True, narrow: bool = False,
                  a_m_contiguous: bool = False, pitch_vector: int = 0,
                  copies: int = 0) -> tuning.MMPlan | None:
    """The portable kernel on the tile of ``picked``, an unsplit plan of the persistent TMA
    kernel, for eager calls bound by the host; None where ``picked`` is split, stream-K or
    copies operands, where its tile is not one the plan space offers on the portable kernel
    beside TMA (``tuning.portable_beside_tma``), or where the portable plan's predicted kernel
    time (``predict_us``, with co-resident rounds as ``best_plan`` costs it) exceeds
    ``host.call_us``.

    An eager launch of the TMA kernel costs more than the portable kernel's: its device-built
    descriptors need the scratch allocator and buffer on the host, and their building and fence
    on the GPU (CUDA-graph captures, which keep ``picked``, launch host-built ones). Both
    kernels add the same tiles' products in the same K order: the same bits. On an H200, the
    25 products of the seed-2167 sweep under 1e8 multiply-adds whose pick was such a plan, in
    bf16 and fp16 (50 rows, ``docs/data/eager-tma-twin-h200-seed2167.csv``; tiles of 16-64
    rows, and 128 x 16, which the plan space does not offer on the portable kernel, so the rule
    leaves them): eager calls 1.13x faster in geomean on the portable plan, 46 of 50 faster
    (of the 46 rows the rule moves, 42), every output the same bits. Split plans stay: the
    same splits in one launch (``split_inline``), on the 10 split rows of that sweep, took 1.9x
    as long in geomean (up to 6x: one program through each tile's 24-64 splits)."""
    if (picked.kernel != "tma" or picked.split_k > 1 or picked.stream_k or picked.swap_ab
            or copies or picked.pad or not tuning.portable_beside_tma(picked.tile)):
        return None
    twin = tuning.MMPlan("portable", picked.tile)
    if predict_us(costs, twin, m, n, k, element_size, out_size, aligned, narrow, a_m_contiguous,
                  pitch_vector, co_resident=True) > host.call_us:
        return None
    return twin


# The peak DRAM bandwidth of the GPU the constants were fitted on (an H100 SXM, GB/s), and
# whether a GPU's own scales the memory system's bytes per microsecond (with_machine; not the
# most one SM draws, whose limit is the SM's). Off until a held-out A/B on a GPU of another
# bandwidth (an H200: 4814 GB/s) times the picks it moves (bench.plans --dram-scaling).
FITTED_DRAM_GBPS = 3352.0
DRAM_SCALING = False


def with_machine(costs: Costs, num_sms: int, l2_bytes: int | None = None,
                 dram_gbps: float | None = None) -> Costs:
    """``costs`` for a GPU with ``num_sms`` SMs and an L2 cache of ``l2_bytes`` (None: the
    fitted GPU's), with the bandwidth of the fitted one, or, with DRAM_SCALING, that scaled
    to the GPU's peak ``dram_gbps`` (None: the fitted GPU's)."""
    machine = costs.machine
    l2_bytes = machine.l2_bytes if l2_bytes is None else l2_bytes
    bytes_per_us = machine.bytes_per_us
    if DRAM_SCALING and dram_gbps:
        bytes_per_us *= dram_gbps / FITTED_DRAM_GBPS
    if (num_sms, l2_bytes, bytes_per_us) == (machine.num_sms, machine.l2_bytes,
                                             machine.bytes_per_us):
        return costs
    return dataclasses.replace(costs, machine=dataclasses.replace(
        machine, num_sms=num_sms, l2_bytes=l2_bytes, bytes_per_us=bytes_per_us))


# Whether the warp-specialized kernel's 16-bit plans (tuning.WS_KERNEL, its K splits and
# 64-row tiles) compete where they can run a product, and for which products: those of
# WS_FLOPS[0] to WS_FLOPS[1] floating-point operations (2 M N K), at least WS_MIN_ROWS rows
# and WS_MIN_COLUMNS columns. Costed by their constants below, they took 40 of 130 products
# of that FLOP range timed on an H200 (every ws plan beside the Triton kernels' picks, seeds
# 2141 and 2070 and the few-row and class probes: docs/data/ws-fit-*-h200-30a3e39.csv),
# 1.11x faster in geomean, the worst 0.92x; outside it their picks lost: tiny products
# (launch and descriptor set-up, 0.5-0.9x) and products of 10^11 and more, where the Triton
# kernels' deep K splits ran 1.0-1.2x faster. On held-out seeds 2162-2163, seed 2071's
# mid-row products and the named suites (113 moved picks, both arms in one run,
# docs/data/ws-plans-ab-h200-cba8121.csv) the FLOP range alone gave 1.06x, but outputs of 64
# columns ran 0.5-0.75x (half of each 128-column tile idle on memory-bound products) and
# products of 23-32 rows 0.88-0.92x (the transposed rule's few rows), hence the bounds on
# rows and columns. Held out for those bounds (seeds 2164-2165, seed 2072's mid-row
# products, the named suites: 113 moves, docs/data/ws-plans-ab-h200-a74a2fd.csv): 1.06x,
# per set 1.09x, 1.02x, 1.05x and 1.06x; worst 0.75-0.77x (11064 x 344 x 504 and 16256 x
# 4968 x 64 on 192x128 tiles, 140 x 14448 x 9056 on 64x128). An earlier version (every
# product, 128-row tiles only) ran its held-out picks 0.95x as fast
# (docs/data/wgmma-ab-h200-seed2142-2149.csv). Autotuning times them everywhere (tune.py),
# and bench.plans --no-wgmma plans without them.
WS_PLANS = True
WS_FLOPS = (2 ** 30, 2 ** 36)
WS_MIN_ROWS = 33
WS_MIN_COLUMNS = 256


def modelled_plan(m: int, n: int, k: int, element_size: int, out_size: int, tma: bool,
                  num_sms: int, aligned: bool, narrow: bool,
                  a_m_contiguous: bool = False, pitch_vector: int = 0,
                  l2_bytes: int | None = None, wgmma: bool = False,
                  dram_gbps: float | None = None, launcher_copies: bool = False
                  ) -> tuning.MMPlan | None:
    """The plan of the plan space (stream-K left out, and splits that finish their own tiles
    until the constants cost them) with the least time the plan model
    predicts (``plan_model``: waves of tiles over the SMs, bytes over the bandwidth of the busy
    SMs, launches, copies), for 16-bit operands. ``tma``: the TMA kernel can read the operands,
    as they are (``aligned``) or copied; ``narrow``: an operand pitch is not a multiple of 16
    elements; ``a_m_contiguous``: A's columns are contiguous; ``pitch_vector``: the widest
    copy the portable kernel makes along such pitches (``cost_kernel``); ``l2_bytes``: the
    GPU's L2 cache (None: the fitted H100's); ``wgmma``: the warp-specialized kernel can run
    the product (the planner's ``ws_applies``), whose plans compete once the constants cost
    them; ``dram_gbps``: the GPU's peak DRAM bandwidth (see DRAM_SCALING); ``launcher_copies``:
    the launcher copies the operands for plans that leave ``pad`` unset, where portable plans
    read them as they are (PORTABLE_READS_AS_IS). None where no plan of the space fits the
    GPU's shared memory."""
    m, n, k = max(m, 1), max(n, 1), max(k, 1)  # an empty output launches nothing
    costs = with_machine(H100_COSTS, num_sms, l2_bytes, dram_gbps)
    # Splits that finish their own tiles once the constants cost them (a fit on timings of
    # such plans), and so the warp-specialized kernel's plans.
    fixups = "fixup" in costs.launch_us
    costed = {key[0] for key in costs.tiles}
    ws = (wgmma and WS_PLANS and WS_FLOPS[0] <= 2 * m * n * k <= WS_FLOPS[1]
          and m >= WS_MIN_ROWS and n >= WS_MIN_COLUMNS)
    plans = [p for p in tuning.plan_space(m, n, k, element_size, tma, num_sms, aligned,
                                          wgmma_out_size=out_size if ws else 0)
             if not p.stream_k and (fixups or not p.split_fixup)
             and (not tuning.warp_specialized(p) or p.kernel in costed)]
    if not plans:  # no tile of the space fits (a GPU with little shared memory)
        return None
    if launcher_copies and PORTABLE_READS_AS_IS:
        plans = [dataclasses.replace(p, pad=False) if p.kernel == "portable" else p
                 for p in plans]
    return best_plan(costs, plans, m, n, k, element_size, out_size, aligned, narrow,
                     a_m_contiguous, pitch_vector)


# Fitted by python -m torch_triton_gemm.bench.fit on docs/data/plans-h100-seed1.csv and
# plans-h100-seed1-narrow.csv (one H100 SXM, torch 2.11, Triton 3.6): kernel-only times of every
# plan of the plan space on 480 shapes, and of the narrow tiles on its 85 outputs under 64 columns.
# Two constants differ from the fit: the split-K reduction costs twice the fitted launch, and one
# SM draws a third of the fitted bytes per microsecond (so a decode product still splits K to
# stream its weights on more SMs). Timed as the benchmark times (CUDA graphs of 64 calls), every
# tile split 1-32 ways on seed 1's 110 sweep shapes of fewer output tiles than SMs
# (docs/data/latency-splits-h100-seed1.csv), the model then picked plans 0.97x cuBLAS in
# geomean against 0.94x before (the best of those timed: 1.04x); on seeds 2 and 3 the 182
# shapes whose plan changed ran 1.10x and 1.11x faster, same run
# (docs/data/latency-splits-ab-h100-seed2-3.csv).
# The one-step narrow tiles ('portable-narrow-one-step') were fitted alone (bench.fit --refit)
# on docs/data/plans-h100-seed1-narrow-ktail.csv, every portable plan on seed 1's narrow-pitch
# shapes timed on the kernels whose K remainder loads in tile-sized steps (before them, such a
# remainder spilled registers, and those timings set the other narrow tiles). A first version
# keyed on K <= BLOCK_K alone: on held-out seed 11 (400 shapes, bf16 and fp16, one run,
# docs/data/chosen-h100-seed11-onestep-ab-*.csv) its 108 changed picks ran 1.09x faster, but
# on seed 8 it ran products whose remainder takes two steps at half cuBLAS's speed (15104 x
# 192 x 120: 0.36x, docs/data/chosen-h100-seed8-885d0d0.csv). Refitting the multi-step narrow
# tiles on the same timings made the picks 0.97x as fast: their long-K rows are few.
# Keyed on one step (this version), timed against the constants without one-step tiles on
# held-out seeds 11 and 8 (docs/data/chosen-h100-seed{11,8}-launch-ab-*.csv): the changed picks
# ran 1.16x and 1.18x faster. The launch offsets of bench.fit --rebase-launches, timed in the
# same runs, made the picks they changed 0.97x as fast (tiny products moved to TMA plans), so
# the launch constants stay as fitted.
# The 4-8-byte vector tiles ('portable-narrow-vector') were fitted alone (bench.fit --refit
# portable-narrow-vector) on the timings with today's hints of seeds 1 (-narrow-ktail), 9, 10,
# 12, 13 and 14 (plans-h100-seed{13,14}-narrow-portable.csv: every unsplit portable plan on
# 137 narrow-pitch shapes). Held out, their picks against the constants before (each arm timed
# twice, one run per pair of seeds, docs/data/chosen-h100-seed*-vector-ab-*.csv; the moved
# cases in docs/data/picks-moved-vector-seed*.csv): 1.07x and 1.11x faster on the 10 and 18
# picks they moved on seeds 8 and 11, 1.00x and 1.20x on 16 and 10 of seeds 15 and 16 (worst
# 504 x 3008 x 522: 13.3 -> 20.1 us). A first version gave 16-byte pitches tiles of their
# own too, fitted the same way: its 80 and 90 moved picks on seeds 8 and 11 ran 0.91x and
# 0.92x as fast (see cost_kernel; seeds 8 and 11's "new" arms are its picks, of which this
# version's moved ones are a subset, same plans). Seeds 15 and 16 were timed on this version
# alone, after the choice.
H100_COSTS = Costs(
    launch_us={'reduce': 2.438, 'copy': 3.725},
    exchange_us=0.7578,
    tiles={
        ('portable', 16, 16, 4, 4): TileCost(1.765, 0.7165, 0.449),
        ('portable', 16, 32, 4, 4): TileCost(1.816, 0.2659, 0.4516),
        ('portable', 16, 64, 4, 4): TileCost(2.268, 0.6765, 1.553),
        ('portable', 16, 64, 4, 6): TileCost(2.961, 0.3342, 0.9991),
        ('portable', 16, 128, 4, 4): TileCost(2.853, 0.5423, 1.118),
        ('portable', 32, 32, 4, 4): TileCost(1.845, 0.4271, 0.4535),
        ('portable', 32, 64, 4, 4): TileCost(3.706, 0.4817, 0.2617),
        ('portable', 32, 128, 4, 4): TileCost(2.49, 0.632, 1.672),
        ('portable', 64, 16, 4, 4): TileCost(2.574, 0.2006, 0.9059),
        ('portable', 64, 32, 4, 4): TileCost(2.256, 0.2906, 0.4744),
        ('portable', 64, 64, 4, 4): TileCost(2.48, 0.3506, 1.701),
        ('portable', 64, 64, 4, 5): TileCost(3.282, 0.1874, 0.787),
        ('portable', 64, 128, 4, 4): TileCost(3.149, 0.273, 1.023),
        ('portable', 64, 256, 4, 4): TileCost(2.21, 0.3864, 2.522),
        ('portable', 128, 64, 4, 4): TileCost(3.851, 0.6413, 0.7192),
        ('portable-mcol', 16, 64, 4, 4): TileCost(2.393, 1.208, 0.9983),
        ('portable-mcol', 16, 64, 4, 6): TileCost(2.515, 0.5295, 1.042),
        ('portable-mcol', 16, 128, 4, 4): TileCost(2.965, 0.8786, 0.5989),
        ('portable-mcol', 32, 64, 4, 4): TileCost(3.042, 0.601, 0.5962),
        ('portable-mcol', 32, 128, 4, 4): TileCost(3.081, 0.9476, 0.598),
        ('portable-mcol', 64, 64, 4, 4): TileCost(3.061, 0.8238, 0.4378),
        ('portable-mcol', 64, 64, 4, 5): TileCost(3.407, 0.4162, 0.6258),
        ('portable-mcol', 64, 128, 4, 4): TileCost(3.368, 0.5807, 0.7645),
        ('portable-mcol', 64, 256, 4, 4): TileCost(2.837, 1.319, 1.897),
        ('portable-mcol', 128, 64, 4, 4): TileCost(9.157, 0.251, 0.3765),
        ('portable-narrow', 16, 16, 4, 4): TileCost(1.316, 0.9564, 0.4164),
        ('portable-narrow', 16, 32, 4, 4): TileCost(2.103, 0.6558, 0.4676),
        ('portable-narrow', 16, 64, 4, 4): TileCost(4.557, 25.08, 29.77),
        ('portable-narrow', 16, 64, 4, 6): TileCost(3.645, 0.9685, 0.2253),
        ('portable-narrow', 16, 128, 4, 4): TileCost(1.605, 5.04, 1.622),
        ('portable-narrow', 32, 32, 4, 4): TileCost(2.866, 0.7754, 0.4962),
        ('portable-narrow', 32, 64, 4, 4): TileCost(3.517, 1.538, 0.0679),
        ('portable-narrow', 32, 128, 4, 4): TileCost(0.2694, 11.39, 0.1915),
        ('portable-narrow', 64, 16, 4, 4): TileCost(2.47, 0.9891, 0.339),
        ('portable-narrow', 64, 32, 4, 4): TileCost(3.155, 1.676, 0.5666),
        ('portable-narrow', 64, 64, 4, 4): TileCost(2.866, 4.38, 0.1291),
        ('portable-narrow', 64, 64, 4, 5): TileCost(3.386, 0.8264, 0.4403),
        ('portable-narrow', 64, 128, 4, 4): TileCost(3.781, 2.331, 0.2546),
        ('portable-narrow', 64, 256, 4, 4): TileCost(0.3793, 13.67, 0.5205),
        ('portable-narrow', 128, 64, 4, 4): TileCost(16.29, 0.1478, 0.1675),
        ('portable-narrow', 128, 128, 8, 5): TileCost(2.238, 2.18, 1.572),
        ('portable-narrow-one-step', 16, 16, 4, 4): TileCost(1.703, 0.2865, 0.4621),
        ('portable-narrow-one-step', 16, 32, 4, 4): TileCost(1.86, 0.2863, 0.4621),
        ('portable-narrow-one-step', 16, 64, 4, 4): TileCost(2.493, 0.2698, 0.421),
        ('portable-narrow-one-step', 16, 64, 4, 6): TileCost(2.496, 0.2513, 0.3772),
        ('portable-narrow-one-step', 16, 128, 4, 4): TileCost(2.109, 0.2888, 0.4694),
        ('portable-narrow-one-step', 32, 64, 4, 4): TileCost(0.7636, 0.476, 1.176),
        ('portable-narrow-one-step', 32, 128, 4, 4): TileCost(1.558, 0.3408, 0.6186),
        ('portable-narrow-one-step', 64, 16, 4, 4): TileCost(2.566, 0.152, 0.1849),
        ('portable-narrow-one-step', 64, 32, 4, 4): TileCost(1.48, 0.3574, 0.6698),
        ('portable-narrow-one-step', 64, 64, 4, 4): TileCost(1.63, 0.3785, 0.739),
        ('portable-narrow-one-step', 64, 64, 4, 5): TileCost(1.619, 0.3694, 0.711),
        ('portable-narrow-one-step', 64, 128, 4, 4): TileCost(1.682, 0.4112, 0.8055),
        ('portable-narrow-vector', 16, 16, 4, 4): TileCost(0.1157, 0.6748, 0.95),
        ('portable-narrow-vector', 16, 32, 4, 4): TileCost(1.342, 0.3429, 0.7294),
        ('portable-narrow-vector', 16, 64, 4, 4): TileCost(5.814, 0.9617, 0.0004663),
        ('portable-narrow-vector', 16, 64, 4, 6): TileCost(1.116, 0.5332, 1.261),
        ('portable-narrow-vector', 16, 128, 4, 4): TileCost(2.513, 0.956, 1.433),
        ('portable-narrow-vector', 32, 32, 4, 4): TileCost(0.4263, 0.4373, 1.451),
        ('portable-narrow-vector', 32, 64, 4, 4): TileCost(1.787, 0.4744, 1.508),
        ('portable-narrow-vector', 32, 128, 4, 4): TileCost(0.005789, 1.146, 2.618),
        ('portable-narrow-vector', 64, 16, 4, 4): TileCost(0.0002164, 0.4035, 1.978),
        ('portable-narrow-vector', 64, 32, 4, 4): TileCost(1.454, 0.5368, 1.177),
        ('portable-narrow-vector', 64, 64, 4, 4): TileCost(0.9172, 1.037, 1.702),
        ('portable-narrow-vector', 64, 64, 4, 5): TileCost(0.8714, 0.4616, 1.543),
        ('portable-narrow-vector', 64, 128, 4, 4): TileCost(1.137, 0.6675, 2.205),
        ('portable-narrow-vector', 64, 256, 4, 4): TileCost(0.0009535, 1.335, 3.122),
        ('portable-narrow-vector', 128, 16, 4, 4): TileCost(1.663, 0.8158, 1.559),
        ('portable-narrow-vector', 128, 32, 4, 4): TileCost(1.149, 0.4405, 1.897),
        ('portable-narrow-vector', 128, 64, 4, 4): TileCost(1.016, 0.4972, 2.814),
        ('portable-narrow-vector', 128, 128, 4, 4): TileCost(0.0007408, 1.489, 2.801),
        ('portable-narrow-vector', 128, 128, 8, 4): TileCost(0.0006387, 0.7541, 3.652),
        ('portable-narrow-vector', 128, 256, 8, 3): TileCost(0.001228, 1.03, 5.443),
        ('portable-narrow-vector', 256, 128, 8, 3): TileCost(0.001132, 1.141, 4.643),
        ('tma', 16, 16, 4, 4): TileCost(3.871, 0.4647, 0.5206),
        ('tma', 16, 32, 4, 4): TileCost(3.048, 0.3265, 0.5013),
        ('tma', 16, 64, 4, 4): TileCost(4.475, 0.8834, 0.6228),
        ('tma', 16, 64, 4, 6): TileCost(4.966, 0.4597, 0.7316),
        ('tma', 16, 128, 4, 4): TileCost(3.882, 0.6189, 1.65),
        ('tma', 32, 32, 4, 4): TileCost(4.118, 0.2919, 0.5239),
        ('tma', 32, 64, 4, 4): TileCost(4.595, 0.5542, 0.9485),
        ('tma', 32, 128, 4, 4): TileCost(3.831, 0.5322, 2.216),
        ('tma', 64, 16, 4, 4): TileCost(3.684, 0.2375, 0.7383),
        ('tma', 64, 32, 4, 4): TileCost(2.731, 0.2263, 1.575),
        ('tma', 64, 64, 4, 4): TileCost(5.455, 0.394, 0.434),
        ('tma', 64, 64, 4, 5): TileCost(5.895, 0.222, 0.4211),
        ('tma', 64, 128, 4, 4): TileCost(5.604, 0.3192, 0.8232),
        ('tma', 64, 256, 4, 4): TileCost(4.438, 0.4968, 2.749),
        ('tma', 128, 16, 4, 4): TileCost(2.957, 0.3556, 1.548),
        ('tma', 128, 32, 4, 4): TileCost(4.026, 0.2226, 0.4543),
        ('tma', 128, 64, 4, 4): TileCost(5.625, 0.3528, 0.7476),
        ('tma', 128, 128, 4, 4): TileCost(5.699, 0.4892, 2.08),
        ('tma', 128, 128, 8, 4): TileCost(6.246, 0.4559, 1.473),
        ('tma', 128, 128, 8, 5): TileCost(6.29, 0.3535, 0.9403),
        ('tma', 128, 256, 8, 3): TileCost(7.269, 0.7479, 3.356),
        ('tma', 128, 256, 8, 4): TileCost(6.256, 0.6578, 2.138),
        ('tma', 256, 128, 8, 3): TileCost(6.372, 0.8464, 3.223),
        # The warp-specialized kernel's 16-bit tiles (see WS_PLANS), fitted alone (bench.fit
        # --refit wgmma --min-launch 2, every other constant fixed) on its H200 timings scaled
        # into these constants' units (--scale-by: each time times the model's prediction for
        # the Triton kernels' pick on that product over the pick's time in the same run):
        # every ws plan on seed 2141's sweep, seed 2070's mid-row products and the few-row and
        # class probes (docs/data/ws-fit-*-h200-30a3e39.csv, ws-host-*-h200-87d9168.csv).
        # Unbounded, two tiles' launches fitted to zero and the model put products of a few
        # KFLOP on them. In-sample, with WS_FLOPS, floors of 0, 2, 3 and 5 us moved 42, 40,
        # 34 and 23 of the 130 products, 1.11x, 1.11x, 1.11x and 1.09x faster.
        ('wgmma', 64, 128, 4, 6): TileCost(2.0, 0.2328, 3.348),
        ('wgmma', 64, 256, 4, 4): TileCost(2.0, 0.4291, 3.952),
        ('wgmma', 128, 128, 4, 4): TileCost(2.0, 0.4206, 3.581),
        ('wgmma', 128, 256, 4, 3): TileCost(2.0, 0.7573, 4.502),
        ('wgmma', 192, 128, 4, 4): TileCost(5.93, 0.5644, 0.0),
    },
    machine=Machine(132, 2.46e+06, 3.21e+04),
)
