"""Config spaces, pruning rules and heuristics for the tgemm kernels.

Configs are data: a tile (BLOCK_M, BLOCK_N, BLOCK_K), the L2 band height GROUP_M, and the launch
shape (num_warps, num_stages). The autotuner is keyed on power-of-two size buckets, so shapes
that differ slightly (every M from 1025 to 2048, say) share one tuning run.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import triton

from . import device as _device


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int  # for 16-bit inputs; scaled by element size, see `_for_dtype`
    group_m: int
    num_warps: int
    num_stages: int


# The mm search space. BLOCK_K is written for 2-byte inputs and rescaled per dtype so that a
# pipeline stage moves the same number of bytes (fp8: x2, fp32: /2).
MM_TILES: tuple[TileConfig, ...] = (
    # Large, compute-bound shapes: 128x256 / 256x128 tiles with 8 warps feed Hopper's wgmma.
    # 128x256 with GROUP_M = 16 led at 4096^3-8192^3 on an H100; its 4-stage twin and the
    # 5-stage 128x128 tile lead at M = 512, where fewer tiles must still fill 132 SMs.
    TileConfig(128, 256, 64, 16, 8, 3),
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
    TileConfig(16, 64, 256, 1, 4, 4),
    TileConfig(16, 128, 128, 1, 4, 4),
    TileConfig(32, 64, 128, 1, 4, 4),
    TileConfig(32, 128, 128, 4, 4, 4),
    TileConfig(64, 64, 128, 4, 4, 4),
)

# Tile for Triton's CPU interpreter: it pays per program and per K step in Python, and CI sizes
# are small, so one modest tile serves every shape there.
INTERPRETER_TILE = TileConfig(32, 32, 32, 4, 4, 1)

_AUTOTUNE_ENV = "TORCH_TRITON_GEMM_AUTOTUNE"


@functools.cache
def autotune_enabled() -> bool:
    """On for GPUs unless ``TORCH_TRITON_GEMM_AUTOTUNE=0`` (read once); never in the interpreter."""
    if _device.interpreter_enabled():
        return False
    return os.environ.get(_AUTOTUNE_ENV, "1") != "0"


def size_bucket(x: int | torch.SymInt) -> int | torch.SymInt:
    """Power-of-two bucket of a size: the autotuner's cache key for that dimension.

    A symbolic size (torch.compile with dynamic shapes) is passed through unchanged: bucketing it
    would guard on its range and recompile per bucket, and Inductor tunes its own launches.
    """
    if type(x) is int:  # the eager case, kept cheap
        return 1 << (x - 1).bit_length() if x > 1 else 1
    if isinstance(x, torch.SymInt):
        return x
    return size_bucket(int(x))


def _for_dtype(tile: TileConfig, element_size: int) -> TileConfig:
    block_k = max(16, tile.block_k * 2 // element_size)
    return TileConfig(tile.block_m, tile.block_n, block_k, tile.group_m, tile.num_warps,
                      tile.num_stages)


def _fits_problem(tile: TileConfig, m_bucket: int, n_bucket: int) -> bool:
    # A tile much larger than the problem wastes its work; a tile much smaller than a large
    # problem wastes bandwidth on re-reads. Both bounds use the power-of-two buckets.
    if tile.block_m > max(16, m_bucket) or tile.block_n > max(32, n_bucket):
        return False
    if m_bucket >= 256 and tile.block_m < 64:
        return False
    if m_bucket <= 64 and tile.block_m > 64:
        return False
    return True


def _shared_memory_bytes(tile: TileConfig, element_size: int) -> int:
    return (tile.block_m + tile.block_n) * tile.block_k * element_size * tile.num_stages


def _as_triton(tile: TileConfig) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
         "GROUP_M": tile.group_m},
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def _tiles_for(element_size: int) -> set[TileConfig]:
    return {_for_dtype(t, element_size) for t in MM_TILES}


def _prune_mm_configs(configs: list[triton.Config], named_args: dict[str, Any],
                      **kwargs: Any) -> list[triton.Config]:
    """early_config_prune for the mm autotuner: keep configs that suit the dtype and size bucket."""
    named_args = {**named_args, **kwargs}  # launches may pass kernel arguments by keyword
    a = named_args["a_ptr"]
    element_size = a.element_size()
    allowed = _tiles_for(element_size)
    smem_limit = _device.shared_memory_per_block(a.device.index or 0)
    m_bucket, n_bucket, k_bucket = (named_args[k] for k in ("M_BUCKET", "N_BUCKET", "K_BUCKET"))
    # Under torch.compile with dynamic shapes the sizes are symbolic: comparing them would guard
    # and recompile per bucket, so only dtype and shared-memory rules apply there.
    sizes_known = not any(isinstance(x, torch.SymInt) for x in (m_bucket, n_bucket, k_bucket))
    kept = []
    for cfg in configs:
        kw = cfg.kwargs
        tile = TileConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["GROUP_M"],
                          cfg.num_warps, cfg.num_stages)
        if tile not in allowed:
            continue
        if sizes_known and not _fits_problem(tile, m_bucket, n_bucket):
            continue
        if sizes_known and tile.block_k > max(32, k_bucket):
            continue
        if _shared_memory_bytes(tile, element_size) > smem_limit:
            continue
        kept.append(cfg)
    if not kept:
        kept = [_as_triton(heuristic_mm_tile(m_bucket, n_bucket, k_bucket, element_size))]
    return kept


def mm_configs() -> list[triton.Config]:
    """Every config the mm autotuner may try, for all input element sizes (pruned per call)."""
    tiles = []
    for element_size in (1, 2, 4):
        tiles += [t for t in sorted(_tiles_for(element_size), key=repr) if t not in tiles]
    return [_as_triton(t) for t in tiles]


def heuristic_mm_tile(m: int, n: int, k: int, element_size: int) -> TileConfig:
    """The tile used without autotuning (``TORCH_TRITON_GEMM_AUTOTUNE=0``, or the interpreter)."""
    if _device.interpreter_enabled():
        return INTERPRETER_TILE
    if m <= 16:
        tile = TileConfig(16, 64, 256, 1, 4, 4)
    elif m <= 64:
        tile = TileConfig(64, 64, 128, 4, 4, 4)
    elif n <= 64:
        tile = TileConfig(128, 64, 64, 8, 4, 4)
    else:
        tile = TileConfig(128, 128, 64, 8, 8, 4)
    return _for_dtype(tile, element_size)


@functools.cache
def mm_launch_config(tile: TileConfig) -> Mapping[str, Any]:
    """Keyword arguments that launch the mm kernel with ``tile`` (no autotuner); built once per
    tile, read-only."""
    cfg = _as_triton(tile)
    return MappingProxyType(dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def autotune_mm(kernel: Any) -> Any:
    """Wrap the mm kernel in Triton's autotuner, keyed on size buckets and the operand layout.

    Results are cached on disk (``cache_results``) so a process does not re-tune shapes an
    earlier run already tuned.
    """
    return triton.autotune(
        configs=mm_configs(),
        key=["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT"],
        prune_configs_by={"early_config_prune": _prune_mm_configs},
        cache_results=True,
    )(kernel)


class TunedLaunch:
    """Eager launches of an autotuned kernel that pay Triton's autotuner only once per key.

    ``Autotuner.run`` rebuilds its cache key from every argument on each call: tens of
    microseconds of host time, as long as a small GEMM takes on the GPU. The first launch for a
    key goes through the autotuner (which tunes, or reads its disk cache) and the pick is kept;
    later launches with that key call the jitted kernel with the kept config directly.
    """

    def __init__(self, autotuned: Any) -> None:
        self.autotuned = autotuned
        self._kernel = autotuned.fn
        self._configs: dict[Hashable, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, grid: Callable[[dict[str, Any]], tuple[int, ...]],
                 args: tuple[Any, ...]) -> None:
        """Launch with the runtime ``args`` (positional, kernel order) on ``grid(config)``.

        ``key`` must determine the autotuner's own key (size buckets, layout, dtypes).
        """
        config = self._configs.get(key)
        if config is None:
            # best_config is shared state on the autotuner: read it under the lock.
            with self._lock:
                self.autotuned[grid](*args)
                self._configs[key] = self.autotuned.best_config.all_kwargs()
            return
        self._kernel[grid(config)](*args, **config)


# --- grouped_mm ---------------------------------------------------------------------------------
# Tiles of the persistent grouped kernel (BLOCK_K for 16-bit inputs, rescaled per dtype as above).
# MoE groups range from a handful of rows (many experts, few tokens each) to thousands: 64-row
# tiles waste less on short groups, 128 x 128 and 128 x 256 tiles with 8 warps feed Hopper's
# wgmma on long ones. Each program keeps its tile's pipeline for the whole launch, so the space
# stays small and the first call of a bucket tunes quickly.
GROUPED_TILES: tuple[TileConfig, ...] = (
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 4),
    TileConfig(128, 128, 64, 8, 4, 3),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 4),
    # One-row problems (the bias gradient's ones-vector products) and decode-sized groups.
    TileConfig(16, 128, 64, 1, 4, 4),
)


def heuristic_grouped_tile(rows: int, n: int, k: int, element_size: int) -> TileConfig:
    """The grouped kernel's tile without autotuning; ``rows`` and ``n`` are a group's average
    output rows and columns (the grouped dimension divided by the group count)."""
    if _device.interpreter_enabled():
        return INTERPRETER_TILE
    if rows <= 16:
        tile = TileConfig(16, 128, 64, 1, 4, 4)
    elif rows <= 64:
        tile = TileConfig(64, 128, 64, 8, 4, 4)
    elif n <= 64:
        tile = TileConfig(128, 64, 64, 8, 4, 4)
    else:
        # Three stages of 128 x 128 x 64 fit the 100 KB of shared memory every sm_80+ GPU has.
        tile = TileConfig(128, 128, 64, 8, 8, 3)
    return _for_dtype(tile, element_size)


def _prune_grouped_configs(configs: list[triton.Config], named_args: dict[str, Any],
                           **kwargs: Any) -> list[triton.Config]:
    """early_config_prune for the grouped autotuner: the dtype's tiles that fit a group's
    average size (the buckets) and the GPU's shared memory."""
    named_args = {**named_args, **kwargs}
    a = named_args["a_ptr"]
    element_size = a.element_size()
    allowed = {_for_dtype(t, element_size) for t in GROUPED_TILES}
    smem_limit = _device.shared_memory_per_block(a.device.index or 0)
    m_bucket, n_bucket, k_bucket = (named_args[k] for k in ("M_BUCKET", "N_BUCKET", "K_BUCKET"))
    sizes_known = not any(isinstance(x, torch.SymInt) for x in (m_bucket, n_bucket, k_bucket))
    kept = []
    for cfg in configs:
        kw = cfg.kwargs
        tile = TileConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["GROUP_M"],
                          cfg.num_warps, cfg.num_stages)
        if tile not in allowed:
            continue
        if sizes_known and not _fits_problem(tile, m_bucket, n_bucket):
            continue
        if _shared_memory_bytes(tile, element_size) > smem_limit:
            continue
        kept.append(cfg)
    if not kept:
        kept = [_as_triton(heuristic_grouped_tile(m_bucket, n_bucket, k_bucket, element_size))]
    return kept


def grouped_configs() -> list[triton.Config]:
    """Every config the grouped autotuner may try, for 16- and 32-bit inputs (pruned per call)."""
    tiles: list[TileConfig] = []
    for element_size in (2, 4):
        tiles += [t for t in (_for_dtype(t, element_size) for t in GROUPED_TILES)
                  if t not in tiles]
    return [_as_triton(t) for t in tiles]


def autotune_grouped(kernel: Any) -> Any:
    """Wrap the grouped kernel in Triton's autotuner, keyed on a group's average size buckets,
    the operands' layout, the grouped dimension and the loader (TMA or pointers)."""
    return triton.autotune(
        configs=grouped_configs(),
        key=["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT", "GROUPED", "USE_TMA"],
        prune_configs_by={"early_config_prune": _prune_grouped_configs},
        cache_results=True,
    )(kernel)
