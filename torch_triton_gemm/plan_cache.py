"""Tuned plans on disk: one JSON file per GPU model, Triton version and kernel source.

The file maps ``plan_key`` strings to plans (``MMPlan`` fields, the tile as a nested object).
A cache only ever costs speed, never a call:

- a file that is not such a table (damaged, empty, written by something else, or holding values
  no kernel launches with) is set aside as ``<file>.bad`` with one warning and read as empty;
  the next tuned plan writes a good file in its place;
- a file or directory that cannot be read or written gets one warning; this process then keeps
  its tuned plans in memory;
- writers take a lock on ``<file>.lock`` (``fcntl.flock``; best effort without it), re-read the
  file, merge their new plans into it and replace it atomically, so concurrent tuning processes
  and threads lose no plan, and each writer picks up the plans the others stored. Readers need
  no lock (the file is replaced atomically), except to set a bad file aside; nobody waits for
  the lock longer than ``LOCK_TIMEOUT_S`` (a tuning process stopped while holding it), after
  which the plans stay in memory as for an unwritable cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import triton

from . import device as _device
from .tuning import (
    MAX_SPLIT_K,
    WS_KERNEL,
    WS_PINGPONG_KERNEL,
    WS_PINGPONG_TILES,
    WS_SPLIT_TILES,
    WS_TILES,
    MMPlan,
    size_bucket,
)

try:
    import fcntl
except ImportError:  # Windows: writers merge without a lock
    fcntl = None

_CACHE_DIR_ENV = "TORCH_TRITON_GEMM_CACHE_DIR"
LOCK_TIMEOUT_S = 10.0


def plan_key(m: int, n: int, k: int, dtype: torch.dtype, layout: int, tma: bool) -> str:
    """Key of the tuned table: size buckets, dtype, operand layout and TMA eligibility."""
    return (f"{str(dtype).removeprefix('torch.')}/L{layout}/{'tma' if tma else 'ptr'}/"
            f"{size_bucket(m)}x{size_bucket(n)}x{size_bucket(k)}")


@functools.cache
def _kernel_source_hash() -> str:
    kernels = Path(__file__).parent / "kernels"
    digest = hashlib.sha256()
    for path in sorted(kernels.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the tuned-plan files live (read at each call): ``$TORCH_TRITON_GEMM_CACHE_DIR``
    (``~`` expanded, relative to the working directory if relative), else
    ``$XDG_CACHE_HOME/torch_triton_gemm`` where that is an absolute path (the XDG rule: an empty
    or relative one is ignored), else ``~/.cache/torch_triton_gemm``."""
    # os.path.expanduser leaves "~" as it is where there is no home directory (no HOME, a
    # user without a passwd entry, as in containers); Path.expanduser would raise.
    chosen = os.environ.get(_CACHE_DIR_ENV)
    if chosen:
        return Path(os.path.expanduser(chosen)).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache"))
    return base / "torch_triton_gemm"


def cache_path(device: torch.device) -> Path:
    """The tuned-plan file for ``device``'s GPU model, this Triton and these kernels, in
    ``cache_dir()``."""
    gpu = _device.name(device).replace(" ", "_").replace("/", "_")
    return cache_dir() / f"mm-{gpu}-triton{triton.__version__}-{_kernel_source_hash()}.json"


class TunedPlans:
    """The tuned tables: each read from disk on first use, merged with the file on disk at each
    write. Reads and writes never raise; see the module's docstring.

    ``version`` changes whenever a table changes, so callers may memoise lookups per version.
    """

    def __init__(self) -> None:
        self._tables: dict[Path, dict[str, MMPlan]] = {}
        # Plans tuned here that are not on disk yet: merged into the file at the next write.
        self._unsaved: dict[Path, dict[str, MMPlan]] = {}
        self._warned: set[tuple[Path, str]] = set()
        # Files whose lock a write waited LOCK_TIMEOUT_S for: later writes try it without
        # waiting (its holder may be stopped for good), until one gets it.
        self._contended: set[Path] = set()
        self._lock = threading.RLock()
        self.version = 0

    def get(self, device: torch.device, key: str) -> MMPlan | None:
        """The tuned plan for ``key`` on ``device``'s GPU model, or None."""
        return self._table(cache_path(device)).get(key)

    def put(self, device: torch.device, key: str, plan: MMPlan) -> None:
        """Keep ``plan`` for ``key``, in memory at once and on disk where the cache is writable."""
        path = cache_path(device)
        with self._lock:
            table = {**self._table(path), key: plan}
            unsaved = self._unsaved.setdefault(path, {})
            unsaved[key] = plan
            try:
                table = {**table, **self._write(path, unsaved)}
                unsaved.clear()
            except OSError as error:
                self._warn(path, "io", f"cannot write it ({error}); tuned plans stay in this "
                                       "process's memory")
            self._tables[path] = table
            self.version += 1

    def _table(self, path: Path) -> dict[str, MMPlan]:
        table = self._tables.get(path)
        if table is None:
            with self._lock:
                table = self._tables.get(path)
                if table is None:
                    try:
                        table = self._read(path)
                    except OSError as error:
                        self._warn(path, "io", f"cannot read it ({error}); tuned plans stay in "
                                               "this process's memory")
                        table = {}
                    self._tables[path] = table
        return table

    def _write(self, path: Path, unsaved: dict[str, MMPlan]) -> dict[str, MMPlan]:
        """Merge ``unsaved`` into the file under its lock; returns the table written."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _file_lock(path, writing=True, wait=path not in self._contended):
                self._contended.discard(path)
                merged = {**self._read(path, locked=True), **unsaved}
                tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
                try:
                    tmp.write_text(json.dumps(
                        {k: dataclasses.asdict(p) for k, p in sorted(merged.items())},
                        indent=1))
                    os.replace(tmp, path)  # atomic: readers never see a torn file
                finally:
                    with contextlib.suppress(OSError):
                        tmp.unlink(missing_ok=True)
        except TimeoutError:  # (the lock's: nothing in the block waits)
            self._contended.add(path)
            raise
        return merged

    def _read(self, path: Path, locked: bool = False) -> dict[str, MMPlan]:
        """The table in ``path`` (empty without a file); a bad file is set aside, under the
        file's lock (``locked``: the caller holds it). Raises OSError where the file exists but
        cannot be read."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            return _table_from_json(json.loads(data))
        except (ValueError, RecursionError) as error:  # JSON, UTF-8 or contents
            if not locked:
                # Read again under the lock before setting the file aside: a writer may have
                # just replaced it with a good one.
                try:
                    with _file_lock(path, writing=True):
                        return self._read(path, locked=True)
                except OSError as lock_error:
                    self._warn(path, "bad", f"it is not a table of tuned plans ({error}); "
                                            f"left in place ({lock_error}); tuned plans start "
                                            "again from an empty table")
                    return {}
            bad = path.with_name(path.name + ".bad")
            try:
                os.replace(path, bad)
                where = f"moved it to {bad}"
            except OSError:
                try:
                    path.unlink()
                    where = "removed it"
                except OSError:
                    where = "could neither move nor remove it"
            self._warn(path, "bad", f"it is not a table of tuned plans ({error}); {where}; "
                                    "tuned plans start again from an empty table")
            return {}

    def _warn(self, path: Path, kind: str, what: str) -> None:
        if (path, kind) not in self._warned:
            self._warned.add((path, kind))
            warnings.warn(f"tgemm: tuned-plan cache {path}: {what}", RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def _file_lock(path: Path, writing: bool, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s sibling ``.lock`` file where ``fcntl`` exists. A
    reader that cannot create the lock file (no directory, a read-only cache) goes on without
    it; a writer raises OSError, as does anyone who waited ``LOCK_TIMEOUT_S`` for it (or, with
    ``wait=False``, found it held)."""
    fd = None
    lock = path.with_name(path.name + ".lock")
    if fcntl is not None:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            if writing:
                raise
    try:
        if fd is not None:
            deadline = time.monotonic() + (LOCK_TIMEOUT_S if wait else 0.0)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{lock} was held by another process for "
                                           f"{LOCK_TIMEOUT_S:g} s") from None
                    time.sleep(0.01)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _table_from_json(data: Any) -> dict[str, MMPlan]:
    if not isinstance(data, dict):
        raise ValueError(f"the file holds a {type(data).__name__}, not an object")
    return {key: _plan_from_json(key, entry) for key, entry in data.items()}


def _plan_from_json(key: str, entry: Any) -> MMPlan:
    plan = _dataclass_from_json(MMPlan, entry, key)
    if not _launchable(plan):
        raise ValueError(f"{key}: no kernel launches {plan}")
    return plan


# MMPlan fields added since the file format began: a file written before may lack them (the
# plan then takes the field's default).
_ADDED_FIELDS = frozenset({"split_fixup", "swap_ab", "split_inline"})


def _dataclass_from_json(cls: type, entry: Any, where: str) -> Any:
    """``cls`` built from a JSON object with exactly its fields (those of ``_ADDED_FIELDS``
    may be missing), each of its exact type."""
    hints = typing.get_type_hints(cls)
    if not isinstance(entry, dict) or not (
            hints.keys() - _ADDED_FIELDS <= entry.keys() <= hints.keys()):
        raise ValueError(f"{where}: {entry!r} does not have exactly the fields {sorted(hints)}")
    values = {}
    for name, value in entry.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            value = _dataclass_from_json(kind, value, f"{where}.{name}")
        elif type(value) not in typing.get_args(kind) + (kind,):  # exact: True is no int
            raise ValueError(f"{where}.{name}: {value!r} is not a {kind}")
        values[name] = value
    return cls(**values)


def _power_of_two(x: int, low: int, high: int) -> bool:
    return low <= x <= high and x & (x - 1) == 0


def _launchable(plan: MMPlan) -> bool:
    """Whether ``plan`` holds values the kernels launch with: a known kernel, power-of-two
    blocks of 16 to 1024 (tl.dot's least size; no larger tile fits an SM), a launch shape a
    GPU takes, K splits up to tuning's limit (each costs fp32 workspace), stream-K over at
    most a few waves, not transposed (tuning times plans as they are, untransposed); or one
    of the warp-specialized kernel's plans as ``ws_plans`` and ``ws_split_plans`` make them."""
    tile = plan.tile
    if plan.kernel == WS_KERNEL:
        return (tile in WS_TILES and plan == MMPlan(WS_KERNEL, tile)) or (
            tile in WS_SPLIT_TILES and 1 <= plan.split_k <= MAX_SPLIT_K
            and plan == MMPlan(WS_KERNEL, tile, plan.split_k))
    if plan.kernel == WS_PINGPONG_KERNEL:
        return tile in WS_PINGPONG_TILES and plan == MMPlan(WS_PINGPONG_KERNEL, tile)
    return (plan.kernel in ("tma", "portable")
            and all(_power_of_two(b, 16, 1024) for b in (tile.block_m, tile.block_n, tile.block_k))
            and tile.group_m >= 1 and _power_of_two(tile.num_warps, 1, 32)
            and 1 <= tile.num_stages <= 16 and 1 <= plan.split_k <= MAX_SPLIT_K
            and _power_of_two(plan.epilogue_subtile, 1, tile.block_n)
            and plan.programs_per_sm >= 1 and 0 <= plan.stream_k <= 4 and not plan.swap_ab)


TUNED = TunedPlans()
