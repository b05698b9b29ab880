"""The tuned-plan cache never fails a call: bad files are set aside with one warning, a cache
that cannot be read or written leaves tuned plans in memory, concurrent writers lose no plan,
and a failed tuning on first use leaves the call its heuristic plan."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from samples import reference, rel_error, tolerance
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_triton_gemm as tg
from torch_triton_gemm import plan_cache, tune, tuning
from torch_triton_gemm.ops import launcher, operands, planner

# Plans are looked up for CUDA devices only; on a host without a GPU the file is named "cpu".
GPU = torch.device("cuda", 0)
KEY = plan_cache.plan_key(512, 4096, 4096, torch.float16, 1, False)
OTHER = plan_cache.plan_key(16, 4096, 4096, torch.float16, 1, False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty cache directory (not created yet) for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCH_TRITON_GEMM_CACHE_DIR", str(root))
    return root


def _random_plan() -> tuning.MMPlan:
    tile = tuning.MM_TILES[int(torch.randint(len(tuning.MM_TILES), ()))]
    kernel = ("tma", "portable")[int(torch.randint(2, ()))]
    stream_k = int(torch.randint(3, ())) if kernel == "tma" else 0
    return tuning.MMPlan(kernel, tile, split_k=1 if stream_k else int(torch.randint(1, 9, ())),
                         epilogue_subtile=tuning.epilogue_subtile(tile), stream_k=stream_k,
                         pad=(None, True, False)[int(torch.randint(3, ()))],
                         split_fixup=bool(torch.randint(2, ())))


def _plan_for(i: int) -> tuning.MMPlan:
    """A distinct plan per key of the concurrency tests."""
    tile = tuning.MM_TILES[i % len(tuning.MM_TILES)]
    return tuning.MMPlan("portable", tile, split_k=1 + i % tuning.MAX_SPLIT_K)


def _cache_warnings(recwarn: pytest.WarningsRecorder, path: os.PathLike) -> list[str]:
    return [str(w.message) for w in recwarn if str(path) in str(w.message)]


def _with_entry(good: dict, field: str, value: object) -> bytes:
    """A file with one good entry and one whose ``field`` (``tile.x`` for a tile's) is changed."""
    bad = json.loads(json.dumps(good))
    where, name = (bad["tile"], field[5:]) if field.startswith("tile.") else (bad, field)
    if value is None:
        del where[name]
    else:
        where[name] = value
    return json.dumps({OTHER: good, KEY: bad}).encode()


BAD_FILES = {
    "not JSON": lambda good: json.dumps({KEY: good}).encode()[:-7],
    "empty": lambda good: b"",
    "not UTF-8": lambda good: b"\xff\xfe\xfd{",
    "a list": lambda good: json.dumps([good]).encode(),
    "a dict of strings": lambda good: json.dumps({KEY: "portable", OTHER: "tma"}).encode(),
    "an unknown field": lambda good: _with_entry(good, "num_ctas", 2),
    "a missing field": lambda good: _with_entry(good, "split_k", None),
    "a bool for an int": lambda good: _with_entry(good, "split_k", True),
    "a float for an int": lambda good: _with_entry(good, "tile.block_n", 64.0),
    "block_m=0": lambda good: _with_entry(good, "tile.block_m", 0),
    "block_n=48": lambda good: _with_entry(good, "tile.block_n", 48),
    "split_k=0": lambda good: _with_entry(good, "split_k", 0),
    "num_warps=-4": lambda good: _with_entry(good, "tile.num_warps", -4),
    "kernel=evil": lambda good: _with_entry(good, "kernel", "evil"),
    "pad=1": lambda good: _with_entry(good, "pad", 1),
    "stream_k=-1": lambda good: _with_entry(good, "stream_k", -1),
    "split_fixup=1": lambda good: _with_entry(good, "split_fixup", 1),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_set_aside_with_one_warning_and_rebuilt(case, cache_dir, recwarn):
    plan = _random_plan()
    path = plan_cache.cache_path(GPU)
    content = BAD_FILES[case](dataclasses.asdict(plan))
    cache_dir.mkdir()
    path.write_bytes(content)
    plans = plan_cache.TunedPlans()
    assert plans.get(GPU, KEY) is None and plans.get(GPU, OTHER) is None
    assert len(_cache_warnings(recwarn, path)) == 1
    assert not path.exists()
    assert path.with_name(path.name + ".bad").read_bytes() == content
    plans.put(GPU, KEY, plan)
    assert plan_cache.TunedPlans().get(GPU, KEY) == plan
    assert json.loads(path.read_text()) == {KEY: dataclasses.asdict(plan)}
    assert len(_cache_warnings(recwarn, path)) == 1


def test_a_file_from_before_split_fixup_reads_back(cache_dir, recwarn):
    plan = dataclasses.replace(_random_plan(), split_fixup=False)
    entry = dataclasses.asdict(plan)
    del entry["split_fixup"]
    cache_dir.mkdir()
    plan_cache.cache_path(GPU).write_text(json.dumps({KEY: entry}))
    assert plan_cache.TunedPlans().get(GPU, KEY) == plan
    assert not recwarn.list


def test_a_good_file_reads_back_every_field(cache_dir, recwarn):
    tuned = {plan_cache.plan_key(1 << i, 4096, 4096, torch.float16, 3, True): _random_plan()
             for i in range(8)}
    writer = plan_cache.TunedPlans()
    for key, plan in tuned.items():
        writer.put(GPU, key, plan)
    reader = plan_cache.TunedPlans()
    assert {key: reader.get(GPU, key) for key in tuned} == tuned
    assert not recwarn.list


def test_a_directory_in_place_of_the_file_keeps_plans_in_memory(cache_dir, recwarn):
    path = plan_cache.cache_path(GPU)
    path.mkdir(parents=True)
    plans = plan_cache.TunedPlans()
    assert plans.get(GPU, KEY) is None
    tuned = {KEY: _random_plan(), OTHER: _random_plan()}
    for key, plan in tuned.items():
        plans.put(GPU, key, plan)
    assert {key: plans.get(GPU, key) for key in tuned} == tuned
    assert len(_cache_warnings(recwarn, path)) == 1
    assert path.is_dir()


def test_a_cache_dir_that_cannot_be_created_keeps_plans_in_memory(tmp_path, monkeypatch,
                                                                   recwarn):
    (tmp_path / "file").write_text("a regular file")
    monkeypatch.setenv("TORCH_TRITON_GEMM_CACHE_DIR", str(tmp_path / "file" / "cache"))
    path = plan_cache.cache_path(GPU)
    plans = plan_cache.TunedPlans()
    tuned = {plan_cache.plan_key(1 << i, 256, 256, torch.float32, 3, False): _random_plan()
             for i in range(4)}
    for key, plan in tuned.items():
        version = plans.version
        plans.put(GPU, key, plan)
        assert plans.version != version  # memoised lookups see the new plan
    assert {key: plans.get(GPU, key) for key in tuned} == tuned
    assert len(_cache_warnings(recwarn, path)) == 1
    assert os.listdir(tmp_path) == ["file"]


def test_a_failing_replace_keeps_plans_and_writes_them_later(cache_dir, monkeypatch, recwarn):
    path = plan_cache.cache_path(GPU)
    plans = plan_cache.TunedPlans()
    first = {KEY: _random_plan(), OTHER: _random_plan()}

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied", str(dst))

    with monkeypatch.context() as patch:
        patch.setattr(plan_cache.os, "replace", refuse)
        for key, plan in first.items():
            plans.put(GPU, key, plan)
        assert {key: plans.get(GPU, key) for key in first} == first
        assert not path.exists() and not list(cache_dir.glob("*.tmp"))
    assert len(_cache_warnings(recwarn, path)) == 1
    # Once the cache takes writes again, the next tuned plan brings the kept ones with it.
    later = plan_cache.plan_key(4096, 4096, 4096, torch.float16, 1, False)
    plans.put(GPU, later, _random_plan())
    reader = plan_cache.TunedPlans()
    assert {key: reader.get(GPU, key) for key in first} == first
    assert reader.get(GPU, later) == plans.get(GPU, later)


def test_a_write_merges_the_plans_other_writers_stored(cache_dir, recwarn):
    ours, theirs = plan_cache.TunedPlans(), plan_cache.TunedPlans()
    assert ours.get(GPU, KEY) is None  # our table is loaded before they write
    their_plan, our_plan = _random_plan(), _random_plan()
    theirs.put(GPU, OTHER, their_plan)
    version = ours.version
    ours.put(GPU, KEY, our_plan)
    assert ours.version != version
    assert ours.get(GPU, OTHER) == their_plan and ours.get(GPU, KEY) == our_plan
    reader = plan_cache.TunedPlans()
    assert reader.get(GPU, OTHER) == their_plan and reader.get(GPU, KEY) == our_plan
    assert not recwarn.list


@pytest.mark.skipif(plan_cache.fcntl is None, reason="no file locks on this platform")
def test_a_lock_held_elsewhere_blocks_no_reader_and_writers_give_up(cache_dir, monkeypatch,
                                                                     recwarn):
    """A process stopped while holding the file's lock (a paused tuning job) makes no reader
    wait, and a writer waits at most LOCK_TIMEOUT_S, then keeps its plan in memory."""
    stored, ours = _random_plan(), _random_plan()
    plan_cache.TunedPlans().put(GPU, KEY, stored)
    path = plan_cache.cache_path(GPU)
    monkeypatch.setattr(plan_cache, "LOCK_TIMEOUT_S", 0.3)
    holder = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)
    plan_cache.fcntl.flock(holder, plan_cache.fcntl.LOCK_EX)  # another open file: it conflicts
    try:
        tuned = plan_cache.TunedPlans()
        start = time.monotonic()
        assert tuned.get(GPU, KEY) == stored
        assert time.monotonic() - start < 0.2
        tuned.put(GPU, OTHER, ours)
        assert 0.3 <= time.monotonic() - start < 5
        start = time.monotonic()
        tuned.put(GPU, KEY, stored)  # the lock is still held: no second wait
        assert time.monotonic() - start < 0.2
    finally:
        os.close(holder)
    assert tuned.get(GPU, OTHER) == ours and tuned.get(GPU, KEY) == stored
    assert len(warned := _cache_warnings(recwarn, path)) == 1 and "held by another" in warned[0]
    assert plan_cache.TunedPlans().get(GPU, OTHER) is None  # not written while locked


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    """TORCH_TRITON_GEMM_CACHE_DIR with ~ expanded; else an absolute XDG_CACHE_HOME; an empty
    or relative one is ignored (the XDG rule), as is an empty TORCH_TRITON_GEMM_CACHE_DIR."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    default = home / ".cache" / "torch_triton_gemm"
    cases = [(None, None, default), ("", "", default), (None, "relative/dir", default),
             (None, str(tmp_path / "xdg"), tmp_path / "xdg" / "torch_triton_gemm"),
             ("~/plans", str(tmp_path / "xdg"), home / "plans"),
             ("plans", None, tmp_path / "plans")]
    for chosen, xdg, expected in cases:
        for name, value in (("TORCH_TRITON_GEMM_CACHE_DIR", chosen), ("XDG_CACHE_HOME", xdg)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert plan_cache.cache_dir() == expected, (chosen, xdg)
        assert plan_cache.cache_path(GPU).parent == expected


@pytest.mark.parametrize("shared", [True, False], ids=["one-table", "a-table-each"])
def test_threads_writing_at_once_lose_no_plan(cache_dir, shared):
    threads, per_thread = 4, 10
    one = plan_cache.TunedPlans()
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        plans = one if shared else plan_cache.TunedPlans()
        start.wait()
        for i in range(t * per_thread, (t + 1) * per_thread):
            plans.put(GPU, f"key{i}", _plan_for(i))

    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(work, t) for t in range(threads)]:
            done.result()
    reader = plan_cache.TunedPlans()
    for i in range(threads * per_thread):
        assert reader.get(GPU, f"key{i}") == _plan_for(i), i


def _put_keys(first: int, count: int, start: threading.Barrier) -> None:
    plans = plan_cache.TunedPlans()
    start.wait()
    for i in range(first, first + count):
        plans.put(GPU, f"key{i}", _plan_for(i))


def test_processes_writing_at_once_lose_no_plan(cache_dir):
    spawn = multiprocessing.get_context("spawn")
    per_process = 20
    start = spawn.Barrier(2)
    workers = [spawn.Process(target=_put_keys, args=(p * per_process, per_process, start))
               for p in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
        assert worker.exitcode == 0
    reader = plan_cache.TunedPlans()
    for i in range(2 * per_process):
        assert reader.get(GPU, f"key{i}") == _plan_for(i), i


def _fake_cuda_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    with FakeTensorMode():
        return (torch.empty(m, k, device="cuda", dtype=torch.float16),
                torch.empty(n, k, device="cuda", dtype=torch.float16).t())


def _plan_of(a: torch.Tensor, b: torch.Tensor) -> tuning.MMPlan:
    """The plan an eager call on CUDA tensors ``a`` and ``b`` (no TMA) gets."""
    layout = operands.layout_key(a.stride(1), b.stride(0))
    return planner._plan(a, b, None, "none", a.element_size(), layout, False, True)


def _heuristic(a: torch.Tensor, b: torch.Tensor) -> tuning.MMPlan:
    (m, k), n = a.shape, b.shape[1]
    return tuning.heuristic_mm_plan(m, n, k, a.element_size(), False, launcher.num_sms(a.device),
                                    a.element_size(), a_k_contiguous=a.stride(1) == 1)


@pytest.fixture
def fresh_tuned(monkeypatch):
    """A tuned table and plan memo of this test's own."""
    monkeypatch.setattr(plan_cache, "TUNED", plan_cache.TunedPlans())
    monkeypatch.setattr(planner, "_PLANS", {})


def test_the_planner_takes_tuned_plans_and_survives_a_corrupt_file(cache_dir, fresh_tuned,
                                                                    recwarn):
    a, b = _fake_cuda_operands(512, 4096, 4096)
    key = plan_cache.plan_key(512, 4096, 4096, torch.float16,
                              operands.layout_key(a.stride(1), b.stride(0)), False)
    tuned = _random_plan()
    plan_cache.TunedPlans().put(GPU, key, tuned)
    assert _plan_of(a, b) == tuned
    path = plan_cache.cache_path(GPU)
    path.write_text(path.read_text()[:-1])
    # A new process meets the damaged file.
    plan_cache.TUNED = plan_cache.TunedPlans()
    planner.forget_plans()
    assert _plan_of(a, b) == _heuristic(a, b)
    assert len(_cache_warnings(recwarn, path)) == 1


def test_tuning_on_first_use_that_fails_leaves_the_heuristic(cache_dir, fresh_tuned,
                                                             monkeypatch, recwarn):
    sweeps = []

    def failing_tune_mm(*args: object, **kwargs: object) -> None:
        sweeps.append(args)
        raise RuntimeError("no plan ran")

    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tune, "tune_mm", failing_tune_mm)
    monkeypatch.setattr(tune, "_tuning_failed", False)
    for m in (16, 512, 2048):
        a, b = _fake_cuda_operands(m, 1024, 512)
        assert _plan_of(a, b) == _heuristic(a, b)
    assert len(sweeps) == 3
    failures = [w for w in recwarn if "tuning on first use failed" in str(w.message)]
    assert len(failures) == 1 and "no plan ran" in str(failures[0].message)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mm_is_right_while_the_cache_file_is_corrupt(device, dtype, cache_dir, fresh_tuned,
                                                     highest_fp32):
    for where in {GPU, torch.device(device)}:
        path = plan_cache.cache_path(where)
        path.parent.mkdir(exist_ok=True)
        path.write_text('{"float16/L1/ptr/1x1x1": {"kernel": "evil"')
    a = torch.randn(37, 45, device=device).to(dtype)
    b = torch.randn(45, 29, device=device).to(dtype)
    out = tg.mm(a, b)
    assert rel_error(out, reference(a, b)) <= tolerance(dtype, dtype)
