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

    step_us: float  # one BLOCK_K step of a whole tile on one SM
    tile_us: float  # per tile: prologue and epilogue


@dataclass(frozen=True)
class Costs:
    """The fitted constants of the model (microseconds unless named otherwise)."""

    launch_us: Mapping[str, float]  # per kernel ("tma", "portable") and "reduce", "copy"
    exchange_us: float  # a stream-K partial handed over and added
    tiles: Mapping[tuple[str, int, int, int, int], TileCost]  # (kernel, bm, bn, warps, stages)
    machine: Machine


def _tile_key(kernel: str, tile: tuning.TileConfig) -> tuple[str, int, int, int, int]:
    return (kernel, tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)


def tile_cost(costs: Costs, kernel: str, tile: tuning.TileConfig) -> TileCost:
    """The fitted cost of ``tile`` on ``kernel``; an unfitted tile (a tuned or forced one)
    takes the fitted tile nearest in size on the same kernel, scaled by the area ratio."""
    key = _tile_key(kernel, tile)
    known = costs.tiles.get(key)
    if known is not None:
        return known
    area = tile.block_m * tile.block_n
    same = [(k, c) for k, c in costs.tiles.items() if k[0] == kernel] or list(costs.tiles.items())
    (_, bm, bn, _, _), cost = min(
        same, key=lambda kc: abs(math.log(kc[0][1] * kc[0][2] / area)))
    scale = area / (bm * bn)
    return TileCost(cost.step_us * scale, cost.tile_us * scale)


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
               out_size: int, aligned: bool = True) -> float:
    """Predicted kernel-only time of ``plan`` on an m x n x k product, in microseconds
    (``aligned``: the operands can be described for TMA as they are)."""
    machine = costs.machine
    work = plan_work(plan, m, n, k, machine.num_sms)
    cost = tile_cost(costs, plan.kernel, plan.tile)
    compute = work.steps * cost.step_us + work.tiles * cost.tile_us
    compute += work.exchanges * costs.exchange_us
    operand_bytes = (m * k + k * n) * element_size
    bytes_moved = operand_bytes + m * n * out_size + work.extra_bytes
    bandwidth = min(machine.bytes_per_us, work.busy * machine.sm_bytes_per_us)
    time = costs.launch_us[plan.kernel] + max(compute, bytes_moved / bandwidth)
    if work.reduce:
        time += costs.launch_us["reduce"]
    if plan.kernel == "tma" and not aligned:
        # Copying the operands: read and write each once, in a kernel of its own.
        time += costs.launch_us["copy"] + 2 * operand_bytes / machine.bytes_per_us
    return time


def best_plan(costs: Costs, plans: Iterable[tuning.MMPlan], m: int, n: int, k: int,
              element_size: int, out_size: int, aligned: bool = True) -> tuning.MMPlan:
    """The plan of ``plans`` with the least predicted time (the first of equals)."""
    return min(plans, key=lambda p: predict_us(costs, p, m, n, k, element_size, out_size,
                                               aligned))


def with_machine(costs: Costs, num_sms: int) -> Costs:
    """``costs`` for a GPU with ``num_sms`` SMs (the bandwidth of the fitted one)."""
    if num_sms == costs.machine.num_sms:
        return costs
    return dataclasses.replace(costs, machine=dataclasses.replace(costs.machine,
                                                                  num_sms=num_sms))
