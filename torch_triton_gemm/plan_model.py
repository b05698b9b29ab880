"""A machine model of tgemm::mm's plans: predicted kernel time of a plan on a shape, and the plan
of the plan space (``tuning.plan_space``) with the least of it.

Pure Python of shapes, plans and the GPU's numbers (SM count, memory bandwidth), so it runs and
is tested on any host. What it models, for a plan's persistent or one-shot programs:

- work on the busiest program: K steps and tiles (whole tiles in waves of programs; stream-K's
  even share of the shared tiles' K steps plus the partials it adds; a split's units), each step
  costing its tile's measured step time, each tile its epilogue;
- bytes: the operands and the output cross device memory at least once, at the bandwidth of the
  programs that are busy (a few programs cannot draw the whole memory system's bandwidth);
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


@dataclass(frozen=True)
class TileCost:
    """Measured costs of one tile on one kernel, in microseconds."""

    launch_us: float  # a launch of the kernel with this tile (larger shared memory costs more)
    step_us: float  # one BLOCK_K step of a whole tile on one SM
    tile_us: float  # per tile: prologue and epilogue


@dataclass(frozen=True)
class Costs:
    """The fitted constants of the model (microseconds unless named otherwise)."""

    launch_us: Mapping[str, float]  # of the split-K reduction ("reduce") and the copies ("copy")
    exchange_us: float  # a stream-K partial handed over and added
    tiles: Mapping[tuple[str, int, int, int, int], TileCost]  # (kernel, bm, bn, warps, stages)
    machine: Machine


def cost_kernel(kernel: str, narrow: bool) -> str:
    """The kernel name costs are kept under: the portable kernel reading operands whose pitches
    are not multiples of 16 elements (``narrow``) loads without wide vectors, a kernel apart."""
    return "portable-narrow" if kernel == "portable" and narrow else kernel


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
    same = [(k, c) for k, c in costs.tiles.items() if k[0] == kernel] or list(costs.tiles.items())
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


def plan_work(plan: tuning.MMPlan, m: int, n: int, k: int, num_sms: int) -> Work:
    """The work of ``plan`` on an m x n x k product (see ``Work``)."""
    tile = plan.tile
    tiles = tuning.output_tiles(m, n, tile)
    k_steps = max(1, -(-k // tile.block_k))
    programs = num_sms * plan.programs_per_sm
    persistent = plan.kernel == "tma"
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
    return Work(steps, rounds, 0.0, min(max(units, whole), num_sms), True, partial_bytes)


def predict_us(costs: Costs, plan: tuning.MMPlan, m: int, n: int, k: int, element_size: int,
               out_size: int, aligned: bool = True, narrow: bool = False) -> float:
    """Predicted kernel-only time of ``plan`` on an m x n x k product, in microseconds
    (``aligned``: the operands can be described for TMA as they are; ``narrow``: their pitches
    are not all multiples of 16 elements)."""
    machine = costs.machine
    work = plan_work(plan, m, n, k, machine.num_sms)
    cost = tile_cost(costs, cost_kernel(plan.kernel, narrow), plan.tile)
    compute = work.steps * cost.step_us + work.tiles * cost.tile_us
    compute += work.exchanges * costs.exchange_us
    operand_bytes = (m * k + k * n) * element_size
    bytes_moved = operand_bytes + m * n * out_size + work.extra_bytes
    bandwidth = min(machine.bytes_per_us, work.busy * machine.sm_bytes_per_us)
    time = cost.launch_us + max(compute, bytes_moved / bandwidth)
    if work.reduce:
        time += costs.launch_us["reduce"]
    if plan.kernel == "tma" and not aligned:
        # Copying the operands: read and write each once, in a kernel of its own.
        time += costs.launch_us["copy"] + 2 * operand_bytes / machine.bytes_per_us
    return time


def best_plan(costs: Costs, plans: Iterable[tuning.MMPlan], m: int, n: int, k: int,
              element_size: int, out_size: int, aligned: bool = True,
              narrow: bool = False) -> tuning.MMPlan:
    """The plan of ``plans`` with the least predicted time (the first of equals)."""
    return min(plans, key=lambda p: predict_us(costs, p, m, n, k, element_size, out_size,
                                               aligned, narrow))


def with_machine(costs: Costs, num_sms: int) -> Costs:
    """``costs`` for a GPU with ``num_sms`` SMs (the bandwidth of the fitted one)."""
    if num_sms == costs.machine.num_sms:
        return costs
    return dataclasses.replace(costs, machine=dataclasses.replace(costs.machine,
                                                                  num_sms=num_sms))



def modelled_plan(m: int, n: int, k: int, element_size: int, out_size: int, tma: bool,
                  num_sms: int, aligned: bool, narrow: bool) -> tuning.MMPlan | None:
    """The plan of the plan space (stream-K left out) with the least time the plan model
    predicts (``plan_model``: waves of tiles over the SMs, bytes over the bandwidth of the busy
    SMs, launches, copies), for 16-bit operands. ``tma``: the TMA kernel can read the operands,
    as they are (``aligned``) or copied; ``narrow``: an operand pitch is not a multiple of 16
    elements (the portable kernel then loads without wide vectors). None where no plan of the
    space fits the GPU's shared memory."""
    m, n, k = max(m, 1), max(n, 1), max(k, 1)  # an empty output launches nothing
    costs = with_machine(H100_COSTS, num_sms)
    plans = [p for p in tuning.plan_space(m, n, k, element_size, tma, num_sms, aligned)
             if not p.stream_k]
    if not plans:  # no tile of the space fits (a GPU with little shared memory)
        return None
    return best_plan(costs, plans, m, n, k, element_size, out_size, aligned, narrow)


# Fitted by python -m torch_triton_gemm.bench.fit on docs/data/plans-h100-seed1.csv and
# plans-h100-seed1-narrow.csv (one H100 SXM, torch 2.11, Triton 3.6): kernel-only times of every
# plan of the plan space on 480 shapes, and of the narrow tiles on its 85 outputs under 64 columns.
H100_COSTS = Costs(
    launch_us={'reduce': 1.216, 'copy': 3.725},
    exchange_us=0.7578,
    tiles={
        ('portable', 16, 16, 4, 4): TileCost(1.766, 0.7167, 0.4487),
        ('portable', 16, 32, 4, 4): TileCost(1.817, 0.2659, 0.4517),
        ('portable', 16, 64, 4, 4): TileCost(2.268, 0.704, 1.539),
        ('portable', 16, 64, 4, 6): TileCost(2.925, 0.3401, 1.012),
        ('portable', 16, 128, 4, 4): TileCost(2.768, 0.5455, 1.195),
        ('portable', 32, 32, 4, 4): TileCost(1.845, 0.4273, 0.4535),
        ('portable', 32, 64, 4, 4): TileCost(3.64, 0.4887, 0.2922),
        ('portable', 32, 128, 4, 4): TileCost(2.341, 0.6374, 1.798),
        ('portable', 64, 16, 4, 4): TileCost(2.631, 0.2007, 0.8481),
        ('portable', 64, 32, 4, 4): TileCost(2.256, 0.2906, 0.4744),
        ('portable', 64, 64, 4, 4): TileCost(2.505, 0.3578, 1.655),
        ('portable', 64, 64, 4, 5): TileCost(3.319, 0.1894, 0.7966),
        ('portable', 64, 128, 4, 4): TileCost(3.189, 0.2751, 1.032),
        ('portable', 64, 256, 4, 4): TileCost(2.32, 0.3884, 2.542),
        ('portable', 128, 64, 4, 4): TileCost(3.745, 0.7153, 0.8956),
        ('portable-narrow', 16, 16, 4, 4): TileCost(1.318, 0.9565, 0.4154),
        ('portable-narrow', 16, 32, 4, 4): TileCost(2.105, 0.6557, 0.4678),
        ('portable-narrow', 16, 64, 4, 4): TileCost(5.04, 25.07, 29.36),
        ('portable-narrow', 16, 64, 4, 6): TileCost(3.645, 0.9686, 0.2258),
        ('portable-narrow', 16, 128, 4, 4): TileCost(1.651, 5.042, 1.579),
        ('portable-narrow', 32, 32, 4, 4): TileCost(2.869, 0.7753, 0.4962),
        ('portable-narrow', 32, 64, 4, 4): TileCost(3.515, 1.538, 0.06988),
        ('portable-narrow', 32, 128, 4, 4): TileCost(0.2728, 11.38, 0.2118),
        ('portable-narrow', 64, 16, 4, 4): TileCost(2.463, 0.9892, 0.3451),
        ('portable-narrow', 64, 32, 4, 4): TileCost(3.186, 1.675, 0.5517),
        ('portable-narrow', 64, 64, 4, 4): TileCost(2.859, 4.378, 0.1384),
        ('portable-narrow', 64, 64, 4, 5): TileCost(3.387, 0.8264, 0.4402),
        ('portable-narrow', 64, 128, 4, 4): TileCost(3.775, 2.33, 0.2614),
        ('portable-narrow', 64, 256, 4, 4): TileCost(0.3959, 13.66, 0.5316),
        ('portable-narrow', 128, 64, 4, 4): TileCost(16.3, 0.1523, 0.1659),
        ('portable-narrow', 128, 128, 8, 5): TileCost(2.231, 2.18, 1.579),
        ('tma', 16, 16, 4, 4): TileCost(3.872, 0.4647, 0.5206),
        ('tma', 16, 32, 4, 4): TileCost(3.049, 0.3265, 0.5014),
        ('tma', 16, 64, 4, 4): TileCost(4.474, 0.8834, 0.6232),
        ('tma', 16, 64, 4, 6): TileCost(4.966, 0.4597, 0.7322),
        ('tma', 16, 128, 4, 4): TileCost(3.88, 0.6189, 1.652),
        ('tma', 32, 32, 4, 4): TileCost(4.12, 0.2918, 0.5239),
        ('tma', 32, 64, 4, 4): TileCost(4.595, 0.5542, 0.9488),
        ('tma', 32, 128, 4, 4): TileCost(3.828, 0.5322, 2.219),
        ('tma', 64, 16, 4, 4): TileCost(3.715, 0.2375, 0.7088),
        ('tma', 64, 32, 4, 4): TileCost(2.85, 0.2261, 1.469),
        ('tma', 64, 64, 4, 4): TileCost(5.455, 0.394, 0.434),
        ('tma', 64, 64, 4, 5): TileCost(5.895, 0.222, 0.4211),
        ('tma', 64, 128, 4, 4): TileCost(5.603, 0.3192, 0.8232),
        ('tma', 64, 256, 4, 4): TileCost(4.437, 0.4968, 2.75),
        ('tma', 128, 16, 4, 4): TileCost(2.999, 0.3557, 1.505),
        ('tma', 128, 32, 4, 4): TileCost(4.024, 0.2226, 0.4576),
        ('tma', 128, 64, 4, 4): TileCost(5.625, 0.3528, 0.7477),
        ('tma', 128, 128, 4, 4): TileCost(5.698, 0.4892, 2.081),
        ('tma', 128, 128, 8, 4): TileCost(6.245, 0.4559, 1.473),
        ('tma', 128, 128, 8, 5): TileCost(6.29, 0.3536, 0.9393),
        ('tma', 128, 256, 8, 3): TileCost(7.267, 0.7479, 3.357),
        ('tma', 128, 256, 8, 4): TileCost(6.258, 0.6578, 2.136),
        ('tma', 256, 128, 8, 3): TileCost(6.37, 0.8464, 3.224),
    },
    machine=Machine(132, 2.459e+06, 9.673e+04),
)
