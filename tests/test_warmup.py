"""Compiling ahead: which kernel variants a product and its backward need (checked against the
launches real calls make), the compile pool (one compilation per variant, waits, the notice),
the hooks of tgemm::mm's first calls, ``torch_triton_gemm.warmup`` and its command line.

On CPU nothing compiles (Triton's interpreter): the pool runs fake compile functions here, and
the variants are compared by their keys, which are what Triton specialises on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from samples import rel_error

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import tuning, warming
from torch_triton_gemm.ops import compile_ahead, compile_pool, launcher
from torch_triton_gemm.ops.compile_ahead import OperandSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE = torch.float16  # the interpreter's tl.dot is wrong on bf16
# Calls run where the session's kernels do: CPU tensors in the interpreter, else the GPU.
DEVICE = "cpu" if tgemm_device.interpreter_enabled() else "cuda"
TILE = tuning.TileConfig(16, 32, 32, 1, 4, 2)
PLANS = {
    "heuristic": None,
    # M x 48 outputs in 16 x 32 tiles are two tiles more than the SMs (see _tail_rows): a
    # partial wave, whose tiles split K (a whole-tile launch, a split launch and the reduction).
    "portable-tail-split3": tuning.MMPlan("portable", TILE, split_k=3, split_tail=True),
    "tma-split3": tuning.MMPlan("tma", TILE, split_k=3),
}


@pytest.fixture(autouse=True)
def fresh_pool():
    """Every test starts and ends with an empty compile pool running the real compile."""
    compile_pool.POOL.reset()
    yield compile_pool.POOL
    compile_pool.POOL.reset()
    compile_pool.POOL._compile = compile_pool.compile_variant
    compile_pool.POOL._workers = None
    compile_ahead.PENDING.call = None


def _operand(rows: int, cols: int, transposed: bool, requires_grad: bool = True
             ) -> torch.Tensor:
    t = torch.randn(cols, rows, dtype=DTYPE, device=DEVICE).t() if transposed else torch.randn(
        rows, cols, dtype=DTYPE, device=DEVICE)
    return t.detach().requires_grad_(requires_grad)


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record the variant of every kernel launch the launcher makes."""
    launched: list[tuple] = []
    real = launcher.launch_kernel

    # Keyed by device as planned variants are (-1 under the interpreter, else the GPU's index).
    device = compile_ahead._device_index(torch.device(DEVICE))

    def recording(kernel, grid, args, meta, traceable, compiled=None):  # type: ignore[no-untyped-def]
        launched.append(compile_pool.variant_key(kernel, args, meta, device))
        return real(kernel, grid, args, meta, traceable, compiled)

    monkeypatch.setattr(launcher, "launch_kernel", recording)
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})  # every call is a first call
    # As under a profiler's launch hooks: a repeated eager signature launches through
    # launch_kernel too, not through the direct launches of kept kernels (run_kept).
    monkeypatch.setattr(launcher, "_launch_hooks_set", lambda: True)
    return launched


def _tail_rows() -> int:
    """Rows M for which M x 48 outputs in 16 x 32 tiles are the SM count plus two (40 in the
    interpreter's 4 SMs)."""
    sms = launcher.num_sms(torch.device(DEVICE))
    return 16 * (sms // 2 + 1) - 8


def _keys(specs: list[compile_ahead.GemmSpec]) -> set[tuple]:
    return {v.key() for spec in specs for v in compile_ahead.variants(spec)}


# --- the products and variants a call needs -------------------------------------------------------

def test_a_product_is_planned_as_eager_calls_plan_it_without_tuning(monkeypatch):
    """Compiling ahead plans a product as a plain eager call does, without tuning it: on an
    sm_90 GPU (its numbers from bench.picks) a product the plan model gives Hopper's
    warp-specialized kernel compiles that kernel, the one eager calls launch, though traced
    calls take a Triton kernel. With autotuning on, nothing tunes, and the untuned plan is
    not kept for the eager call that will tune."""
    from torch_triton_gemm import plan_model
    from torch_triton_gemm.bench import picks
    from torch_triton_gemm.kernels import wgmma_fp8
    from torch_triton_gemm.ops import operands, planner

    if not wgmma_fp8.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(operands, "on_hopper_with_gluon", lambda device: True)
    monkeypatch.setattr(planner, "_PLANS", {})
    spec = compile_ahead.linear_spec(2048, 2048, 2048, torch.bfloat16, "cuda:0")
    assert plan_model.WS_PLANS
    with picks.h100():
        (variant,) = compile_ahead.variants(spec)
        assert variant.kernel is wgmma_fp8.ws_gemm_kernel
        eager = planner.plan_mm(spec.a, spec.b, None, spec.out(), "none", False)
        traced = planner.plan_mm(spec.a, spec.b, None, spec.out(), "none", True)
        assert tuning.warp_specialized(eager) and not tuning.warp_specialized(traced)
        planner.forget_plans()
        monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)

        def no_tuning(*args):  # type: ignore[no-untyped-def]
            raise AssertionError("compiling ahead tuned")

        import torch_triton_gemm.tune as tune

        monkeypatch.setattr(tune, "tune_on_first_use", no_tuning)
        (again,) = compile_ahead.variants(spec)
        assert again.key() == variant.key() and not planner._PLANS


def test_backward_specs_of_a_linear_layer():
    M, N, K = 64, 48, 32
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, "cpu")  # x @ W.t()
    assert (tuple(spec.a.shape), spec.a.stride()) == ((M, K), (K, 1))
    assert (tuple(spec.b.shape), spec.b.stride()) == ((K, N), (1, K))
    grad_a, grad_b = compile_ahead.backward_specs(spec)
    # grad_x = grad @ W: [M, N] x [N, K], W row-major.
    assert (tuple(grad_a.a.shape), grad_a.a.stride()) == ((M, N), (N, 1))
    assert (tuple(grad_a.b.shape), grad_a.b.stride()) == ((N, K), (K, 1))
    assert tuple(grad_a.out().shape) == (M, K)
    # W is passed as W.t(), so its gradient is W-shaped: grad.t() @ x, [N, M] x [M, K].
    assert (tuple(grad_b.a.shape), grad_b.a.stride()) == ((N, M), (1, N))
    assert (tuple(grad_b.b.shape), grad_b.b.stride()) == ((M, K), (K, 1))
    assert tuple(grad_b.out().shape) == (N, K)
    assert grad_a.out_dtype == grad_b.out_dtype == DTYPE


def test_backward_specs_of_row_major_operands_and_recomputing_activations():
    M, N, K = 8, 24, 16
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, "cpu", "nn", bias=True, activation="silu")
    recompute, grad_a, grad_b = compile_ahead.backward_specs(spec)
    assert recompute.out_dtype == torch.float32 and recompute.bias is spec.bias
    assert recompute.activation == "none"
    assert (tuple(grad_a.b.shape), grad_a.b.stride()) == ((N, K), (1, N))  # b.t()
    assert (tuple(grad_b.a.shape), grad_b.a.stride()) == ((K, M), (1, K))  # a.t()
    assert [s.a.shape[0] for s in compile_ahead.backward_specs(spec, True, False)] == [M, M]
    assert compile_ahead.backward_specs(spec, False, False) == []


def _launched_and_planned(monkeypatch: pytest.MonkeyPatch, layout: str,
                          forced: tuning.MMPlan | None) -> tuple[set[tuple], set[tuple]]:
    """The variants that forward and backward of one product, twice, launch, and those
    compile-ahead plans for it."""
    M, N, K = _tail_rows(), 48, 96
    a = _operand(M, K, layout[0] == "t")
    b = _operand(K, N, layout[1] == "t")
    launched = _record_launches(monkeypatch)
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE, layout)
    # The backward in this thread: a forced plan (a context variable) reaches its calls.
    with tuning.force_plan(forced) if forced else _nothing(), \
            torch.autograd.set_multithreading_enabled(False):
        expected = _keys(warming.all_specs([spec]))
        for _ in range(2):
            tg.mm(a, b).backward(torch.randn(M, N, dtype=DTYPE, device=DEVICE))
    return set(launched), expected


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_variants_are_those_real_calls_launch(monkeypatch, plan, layout):
    """Forward and backward of one product, twice: the variants planned ahead are exactly the
    ones the calls launch (kernel, meta-parameters and every specialised argument)."""
    forced = PLANS[plan]
    launched, expected = _launched_and_planned(monkeypatch, layout, forced)
    assert launched == expected
    kernels = {key[0] for key in expected}
    if forced is not None:
        assert launcher.splitk_reduce_kernel in kernels
    if plan == "portable-tail-split3":  # whole tiles unsplit, the partial wave split
        assert {dict(key[3])["SPLIT"] for key in expected if key[0] is launcher.mm_kernel} == {
            False, True}


@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_variants_are_those_real_calls_launch_with_eager_plans(monkeypatch, layout):
    """With TORCH_TRITON_GEMM_EAGER_PLANS=1, under launch hooks (as a profiler sets them): the
    planned variants are still exactly those launched, the one-launch K split of the weight
    gradient's later calls among them on a GPU (planner.eager_mm_plan; a signature's first
    call launches the planner's split, which counts as run although hooks keep it off the
    direct launches)."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_EAGER_PLANS", "1")
    launched, expected = _launched_and_planned(monkeypatch, layout, None)
    assert launched == expected
    if DEVICE == "cuda":  # (the interpreter's calls keep the planner's plan)
        assert any(dict(key[3]).get("SPLIT_INLINE") for key in launched)


def test_variants_with_bias_and_a_recomputed_activation(monkeypatch):
    M, N, K = 24, 40, 32
    a, b = _operand(M, K, False), _operand(K, N, True)
    bias = torch.randn(N, dtype=DTYPE, device=DEVICE, requires_grad=True)
    launched = _record_launches(monkeypatch)
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE, "nt", bias=True, activation="gelu")
    tg.mm(a, b, bias, activation="gelu").backward(torch.randn(M, N, dtype=DTYPE, device=DEVICE))
    assert set(launched) == _keys(warming.all_specs([spec]))


def test_variants_of_a_product_whose_eager_calls_take_another_plan_are_both_plans(monkeypatch):
    """Where plain eager calls launch fewer kernels than the planner's plan (one, where it
    splits K: TORCH_TRITON_GEMM_EAGER_PLANS=1), compiling ahead covers both: captures launch
    the planner's plan."""
    M, N, K = _tail_rows(), 48, 96
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE, "nt")
    split = PLANS["portable-tail-split3"]
    whole = tuning.MMPlan("portable", tuning.TileConfig(16, 32, 64, 1, 4, 2))
    with tuning.force_plan(split):
        planned = _keys([spec])
    with tuning.force_plan(whole):
        eager = _keys([spec])
    # Whole tiles, split tiles and the reduction; one launch.
    assert len(planned) == 3 and len(eager) == 1 and not planned & eager
    monkeypatch.setattr(compile_ahead, "eager_mm_plan", lambda a, b, out, plan: whole)
    with tuning.force_plan(split):
        assert _keys([spec]) == planned | eager


def _nothing():  # type: ignore[no-untyped-def]
    import contextlib

    return contextlib.nullcontext()


# --- the compile pool -----------------------------------------------------------------------------

def test_a_variant_compiles_once_and_a_call_waits_for_it():
    started, release = threading.Event(), threading.Event()
    calls = []

    def compile_slowly(name: str) -> None:
        calls.append(name)
        started.set()
        assert release.wait(10)

    pool = compile_pool.CompilePool(compile_slowly, workers=2)
    first = pool.submit("k", "k")
    assert pool.submit("k", "k") is first and pool.busy
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    begin = time.perf_counter()
    waited = pool.wait("k")
    assert first.done() and release.is_set()
    assert waited >= 0.15 and time.perf_counter() - begin >= 0.15
    assert calls == ["k"]
    assert pool.wait("k") == 0.0  # built: no wait
    for _ in range(500):  # the done callback runs just after the result is set
        if not pool.busy:
            break
        time.sleep(0.01)
    assert not pool.busy  # launches no longer look here
    pool.reset()


def test_a_call_never_waits_for_other_variants():
    """One worker busy with another variant: the call takes its own queued variant back
    (to compile it itself) instead of waiting behind the other."""
    release = threading.Event()
    calls = []

    def compile_fn(name: str) -> None:
        calls.append(name)
        if name == "other":
            assert release.wait(10)

    pool = compile_pool.CompilePool(compile_fn, workers=1)
    pool.submit("other", "other")
    queued = pool.submit("mine", "mine")
    begin = time.perf_counter()
    assert pool.wait("mine") == 0.0 and time.perf_counter() - begin < 0.1
    assert queued.cancelled() and pool.future("mine") is None
    release.set()
    pool.drain(10)
    assert calls == ["other"]
    pool.reset()


def test_a_failed_compilation_is_left_to_the_call():
    def failing(name: str) -> None:
        raise RuntimeError("no registers left")

    pool = compile_pool.CompilePool(failing, workers=1)
    future = pool.submit("k", "k")
    pool.drain(10)
    assert isinstance(future.exception(), RuntimeError)
    assert pool.wait("k") == 0.0  # the launch then compiles, and raises, itself
    pool.reset()


def test_a_long_wait_is_reported_once(monkeypatch, caplog):
    monkeypatch.setattr(compile_pool, "NOTICE_S", 0.05)
    pool = compile_pool.CompilePool(lambda name: time.sleep(0.3), workers=2)
    with caplog.at_level(logging.INFO, logger="torch_triton_gemm"):
        pool.submit("a", "a")
        pool.submit("b", "b")
        time.sleep(0.05)  # both running
        assert pool.wait("a", "kernel A") > 0.05
        assert pool.wait("b", "kernel B") >= 0.0
        pool.notice(5.0, "kernel C")
    records = [r for r in caplog.records if r.name == "torch_triton_gemm"]
    assert len(records) == 1
    assert "kernel A" in records[0].getMessage() and "warmup" in records[0].getMessage()
    pool.reset()


def test_the_primer_runs_once_and_compilations_wait_for_it():
    """The one-time cost every compilation needs (Triton's fingerprint of its installation)
    runs on its own thread; a launch's wait and the workers wait for it instead of repeating
    it, and the pool is busy until it ends."""
    release = threading.Event()
    order = []

    def primer() -> None:
        assert release.wait(10)
        order.append("primer")

    pool = compile_pool.CompilePool(lambda name: order.append(name), workers=2)
    pool.prime(primer)
    pool.prime(primer)  # once per pool
    assert pool.busy
    future = pool.submit("k", "k")
    time.sleep(0.1)
    assert order == [] and not future.done()  # the worker waits for the primer
    threading.Timer(0.2, release.set).start()
    begin = time.perf_counter()
    pool.wait("other")  # a launch of a variant nobody compiles: waits for the primer only
    assert time.perf_counter() - begin >= 0.15 and order[0] == "primer"
    pool.drain(10)
    assert order == ["primer", "k"]
    for _ in range(500):
        if not pool.busy:
            break
        time.sleep(0.01)
    assert not pool.busy
    pool.reset()


def test_a_failing_primer_is_left_to_the_compilations():
    def primer() -> None:
        raise OSError("unreadable")

    pool = compile_pool.CompilePool(lambda name: None, workers=1)
    pool.prime(primer)
    pool.drain(10)
    assert pool.submit("k", "k").result(10) is None
    pool.reset()


def test_a_forked_child_waits_for_none_of_the_parents_threads():
    """A child forked while the primer and a compilation ran has neither thread: it forgets
    them (a launch there compiles its variant itself) instead of waiting forever."""
    release = threading.Event()
    pool = compile_pool.CompilePool(lambda name: release.wait(10), workers=1)
    pool.prime(lambda: None)
    pool.drain(10)
    running = pool.submit("k", "k")
    # As in the child: the primer's thread ended (it is gone), the worker's future never ends.
    pool._after_fork_in_child()
    assert not pool.busy and pool._primer is None and pool.future("k") is None
    assert pool.wait("k") == 0.0
    release.set()
    running.result(10)
    pool.reset()


_EXIT_SCRIPT = """
import sys, time
from torch_triton_gemm.ops.compile_pool import CompilePool
started = []

def compile_one(i):
    started.append(i)
    with open(sys.argv[1], "a") as log:
        log.write(f"{i}\\n")
    time.sleep(1.0)  # (the script's exit begins while the first one runs)

pool = CompilePool(compile_one, workers=1)
futures = [pool.submit(("variant", i), i) for i in range(15)]
while not started:
    time.sleep(0.01)
"""


def test_exit_waits_for_the_running_compilation_not_the_queued_ones(tmp_path):
    """A script that ends with 15 variants queued on one compile thread (1 s each) exits
    after the one compiling: the queued ones never start (counted, not timed: a loaded host
    stretches an interpreter's exit by seconds)."""
    log = tmp_path / "started.txt"
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(log)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["0"]


def test_priming_only_where_kernels_compile(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", raising=False)
    monkeypatch.setattr(compile_pool._device, "interpreter_enabled", lambda: False)
    assert compile_pool.priming_enabled()
    monkeypatch.setenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "0")
    assert not compile_pool.priming_enabled()
    monkeypatch.delenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE")
    monkeypatch.setattr(compile_pool._device, "interpreter_enabled", lambda: True)
    assert not compile_pool.priming_enabled()
    monkeypatch.setattr(compile_pool._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert not compile_pool.priming_enabled()


def test_the_fingerprint_is_tritons_own():
    import triton.runtime.cache as triton_cache

    assert compile_pool.triton_fingerprint() == triton_cache.triton_key()


class _Compiled:
    """What Triton's warmup returns, as build_launcher reads it: source, metadata, and the
    module once loaded."""

    def __init__(self, module=None):  # type: ignore[no-untyped-def]
        self.src, self.metadata, self.module = object(), object(), module


def test_a_compiled_variant_gets_its_launcher_built_on_the_compiling_thread(monkeypatch):
    """compile_variant builds the C launcher of what it compiled on its own thread (from the
    compiled kernel's source and metadata), not for kernels already loaded or for anything
    that is no compiled kernel; a launcher that fails to build is left to the launch."""
    built: list[tuple] = []

    def launcher_class(src, metadata):  # type: ignore[no-untyped-def]
        built.append((src, metadata, threading.current_thread().name))

    monkeypatch.setattr(compile_pool, "_launcher_class", lambda: launcher_class)
    compiled = _Compiled()

    class Kernel:
        def warmup(self, *args, grid, **meta):  # type: ignore[no-untyped-def]
            assert args == (1, 2) and grid == (3,) and meta == {"BLOCK": 4}
            return compiled

    monkeypatch.setattr(compile_pool.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(compile_pool, "compile_processes", lambda: 0)
    pool = compile_pool.CompilePool(compile_pool.compile_variant)
    pool.submit("variant", Kernel(), (3,), (1, 2), {"BLOCK": 4}, 0).result(timeout=30)
    pool.reset()
    assert built == [(compiled.src, compiled.metadata, built[0][2])]
    assert built[0][2].startswith("tgemm-compile")
    compile_pool.build_launcher(_Compiled(module=object()))  # loaded: Triton built it then
    compile_pool.build_launcher(None)  # no compiled kernel (a future, say)
    assert len(built) == 1

    def failing(src, metadata):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(compile_pool, "_launcher_class", lambda: failing)
    compile_pool.build_launcher(_Compiled())  # no error: the launch builds and reports it
    monkeypatch.setattr(compile_pool, "_launcher_class", lambda: None)
    compile_pool.build_launcher(_Compiled())


def test_variant_keys_follow_triton_specialisation():
    key = compile_pool.variant_key
    aligned = OperandSpec((4, 4), (4, 1), DTYPE, torch.device("cpu"))
    unaligned = OperandSpec((4, 4), (4, 1), DTYPE, torch.device("cpu"), aligned=False)
    assert key("k", (aligned, 32), {"A": 1}, 0) == key("k", (aligned, 64), {"A": 1}, 0)
    assert key("k", (aligned, 32), {}, 0) != key("k", (aligned, 33), {}, 0)
    assert key("k", (aligned, 1), {}, 0) != key("k", (aligned, 17), {}, 0)
    assert key("k", (aligned,), {}, 0) != key("k", (unaligned,), {}, 0)
    assert key("k", (aligned,), {}, 0) != key("k", (aligned,), {}, 1)
    assert key("k", (True,), {}, 0) != key("k", (1,), {}, 0)
    real = torch.empty(4, 4, dtype=DTYPE)
    assert key("k", (real, None, "gelu"), {}, 0) == key("k", (aligned, None, "gelu"), {}, 0)


# --- worker processes ---------------------------------------------------------------------------

_WORKER_SCRIPT = """
import os, sys, torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from torch_triton_gemm.ops import compile_pool
from torch_triton_gemm.ops.compile_worker import OfflineDriver, PointerSpec
from torch_triton_gemm.kernels.glu import glu_forward_kernel as kernel

def entries():
    root = os.environ["TRITON_CACHE_DIR"]
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}

# No GPU here: this process answers Triton's device questions as a worker does (sm_90).
driver.set_active(OfflineDriver(0, GPUTarget("cuda", 90, 32)))
args = (PointerSpec(torch.bfloat16, True), PointerSpec(torch.bfloat16, False), 64, 32, 64, 32,
        "silu")
meta = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4}
print(compile_pool.compile_in_worker(kernel, (2, 1), args, meta, 0))
compiled = entries()
print(any(name.endswith(".cubin") for name in compiled))
kernel.warmup(*args, grid=(2, 1), **meta)  # here: found in the file cache, nothing added
print(entries() == compiled, len(compile_pool._ALL_WORKERS))
"""


def test_a_worker_process_compiles_into_tritons_file_cache(tmp_path):
    """A compile worker process compiles a variant for sm_90 (no GPU needed) into
    TRITON_CACHE_DIR, and the same variant compiled here afterwards adds nothing to that cache:
    worker and caller agree on Triton's cache key, so a launch only loads what the worker
    built."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="",
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env["PYTHONPATH"] = os.pathsep.join((REPO, env.get("PYTHONPATH", "")))
    proc = subprocess.run([sys.executable, "-c", _WORKER_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True", "1"]


def test_a_worker_that_cannot_start_leaves_compilation_to_the_thread(monkeypatch):
    """A worker process that ends without answering: the variant is left to the calling
    thread (False), and no further worker is started in this process."""
    from triton.runtime.driver import driver

    from torch_triton_gemm.kernels.glu import glu_forward_kernel
    from torch_triton_gemm.ops.compile_worker import OfflineDriver

    started = []

    class Exits(compile_pool.WorkerProcess):
        def __init__(self, device, target):
            started.append(device)
            self.answered = False
            self.process = subprocess.Popen([sys.executable, "-c", "pass"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    monkeypatch.setattr(compile_pool, "WorkerProcess", Exits)
    monkeypatch.setattr(driver, "_active", OfflineDriver(0, "a target"))
    monkeypatch.setattr(compile_pool, "_WORKERS_FAIL_TO_START", threading.Event())
    args = (torch.empty(4, dtype=torch.float16), torch.empty(4, dtype=torch.float16), 4, 2, 4, 2,
            "silu")
    for _ in range(2):
        assert not compile_pool.compile_in_worker(glu_forward_kernel, (1, 1), args,
                                                  {"BLOCK_M": 16, "BLOCK_N": 16}, 0)
    assert started == [0]


def test_what_a_worker_receives():
    """Pointer arguments (tensors and stand-ins) go as dtype and alignment; a kernel goes by
    module and name, where that name finds it; the process count reads its variable."""
    from torch_triton_gemm.kernels.glu import glu_forward_kernel
    from torch_triton_gemm.ops.compile_worker import PointerSpec

    base = torch.empty(8, dtype=torch.float16)
    sent = compile_pool.worker_arguments((base, base[1:], None, 3, "silu", True))
    assert [(s.dtype, s.data_ptr() % 16 == 0) for s in sent[:2]] == [
        (torch.float16, True), (torch.float16, False)]
    assert sent[2:] == (None, 3, "silu", True)
    assert all(isinstance(s, PointerSpec) for s in sent[:2])
    assert compile_pool.worker_arguments((object(),)) is None
    assert compile_pool.kernel_reference(glu_forward_kernel) == (
        "torch_triton_gemm.kernels.glu", "glu_forward_kernel")
    assert compile_pool.kernel_reference(lambda: None) is None
    for value, count in (("", 0), ("0", 0), ("4", 4), ("x", 0), ("-2", 0)):
        os.environ["TORCH_TRITON_GEMM_COMPILE_PROCESSES"] = value
        try:
            assert compile_pool.compile_processes() == count
            # One compile thread per worker process (unless the threads are set).
            threads = compile_pool.CompilePool(lambda: None).workers()
            assert threads == count or not count
        finally:
            del os.environ["TORCH_TRITON_GEMM_COMPILE_PROCESSES"]


# --- the hooks of tgemm::mm's first calls ---------------------------------------------------------

def _fake_background(monkeypatch: pytest.MonkeyPatch, pool: compile_pool.CompilePool,
                     delay: float = 0.0) -> tuple[list[tuple], list[tuple]]:
    """Background compilation on for CPU calls, compiling with a fake; the keys submitted and
    the keys compiled (a launch takes back a variant still queued: it may not be compiled)."""
    submitted: list[tuple] = []
    compiled: list[tuple] = []

    def fake_compile(kernel, grid, args, meta, device):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        compiled.append(compile_pool.variant_key(kernel, args, meta, device))

    real_submit = pool.submit

    def recording_submit(key, *job):  # type: ignore[no-untyped-def]
        submitted.append(key)
        return real_submit(key, *job)

    monkeypatch.setattr(compile_ahead, "background_enabled", lambda device: True)
    monkeypatch.setattr(pool, "_compile", fake_compile)
    monkeypatch.setattr(pool, "submit", recording_submit)
    monkeypatch.setattr(pool, "_workers", 4)
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    return submitted, compiled


def test_a_first_call_submits_its_kernels_and_its_backward(monkeypatch, fresh_pool):
    M, N, K = 24, 40, 32
    submitted, _ = _fake_background(monkeypatch, fresh_pool)
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE)
    forward, everything = _keys([spec]), _keys(warming.all_specs([spec]))
    a, b = _operand(M, K, False), _operand(K, N, True)
    out = tg.mm(a, b)
    # Its own kernels before it launched them, its backward's when autograd recorded it.
    assert set(submitted[:len(forward)]) == forward and set(submitted) == everything
    launched = _record_launches(monkeypatch)
    out.backward(torch.randn(M, N, dtype=DTYPE, device=DEVICE))
    assert set(launched) <= everything
    assert set(submitted) == everything  # the backward's first calls submitted nothing new


@pytest.mark.parametrize("bias", [False, True])
def test_an_aten_level_first_call_submits_its_backward_at_once(monkeypatch, fresh_pool, bias):
    """Below autograd, aten's derivative formula records the call and tgemm's autograd never
    sees it: the forward's first call submits the backward's products itself, the ones aten's
    backward then launches; under no_grad it submits none."""
    M, N, K = 24, 72, 32
    submitted, _ = _fake_background(monkeypatch, fresh_pool)
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE, bias=bias)
    forward, everything = _keys([spec]), _keys(warming.all_specs([spec]))
    assert everything > forward
    x = _operand(M, K, False)
    w = torch.randn(N, K, dtype=DTYPE, device=DEVICE, requires_grad=True)
    b = torch.randn(N, dtype=DTYPE, device=DEVICE, requires_grad=True) if bias else None
    with tg.override(level="aten"):
        out = torch.nn.functional.linear(x, w, b)
        assert set(submitted[:len(forward)]) == forward
        assert set(submitted) == everything  # before any backward ran
        launched = _record_launches(monkeypatch)
        out.backward(torch.randn(M, N, dtype=DTYPE, device=DEVICE))
        assert launched and set(launched) <= everything
        assert not compile_ahead.RECORDED_BELOW.on
        other = compile_ahead.linear_spec(M, N // 2, K, DTYPE, DEVICE, bias=bias)
        with torch.no_grad():
            torch.nn.functional.linear(x, w[:N // 2].detach(), None if b is None else b[:N // 2])
    assert set(submitted) == everything | _keys([other])


def test_a_launch_waits_for_its_variant_compiling_in_the_pool(monkeypatch, fresh_pool):
    M, N, K = 24, 48, 32
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE)
    (variant,) = compile_ahead.variants(spec)
    started, release = threading.Event(), threading.Event()
    compiled = []

    def blocking_compile(*job):  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        compiled.append(job)

    monkeypatch.setattr(fresh_pool, "_compile", blocking_compile)
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    compile_ahead.submit([variant])
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    begin = time.perf_counter()
    with torch.no_grad():
        tg.mm(_operand(M, K, False), _operand(K, N, True))
    assert time.perf_counter() - begin >= 0.25 and len(compiled) == 1


def test_a_call_nothing_records_submits_no_backward(monkeypatch, fresh_pool):
    M, N, K = 24, 56, 32
    submitted, _ = _fake_background(monkeypatch, fresh_pool)
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE)
    a, b = _operand(M, K, False), _operand(K, N, True)
    with torch.no_grad():
        tg.mm(a, b)
    assert set(submitted) == _keys([spec])
    # A later recorded call of another product does not take the stale one's backward.
    x, w = _operand(8, 16, False), _operand(16, 8, False)
    tg.mm(x, w)
    other = compile_ahead.linear_spec(8, 8, 16, DTYPE, DEVICE, "nn")
    assert set(submitted) == _keys([spec]) | _keys(warming.all_specs([other]))


# --- override(while_compiling="pytorch") ---------------------------------------------------------

def _gated_background(monkeypatch: pytest.MonkeyPatch, pool: compile_pool.CompilePool,
                      gated: set[tuple]) -> threading.Event:
    """Background compilation on for CPU calls, with a fake compile that holds the variants in
    ``gated`` until the returned event is set (the others compile at once)."""
    release = threading.Event()

    def gated_compile(kernel, grid, args, meta, device):  # type: ignore[no-untyped-def]
        if compile_pool.variant_key(kernel, args, meta, device) in gated:
            assert release.wait(30)

    monkeypatch.setattr(compile_ahead, "background_enabled", lambda device: True)
    monkeypatch.setattr(pool, "_compile", gated_compile)
    monkeypatch.setattr(pool, "_workers", 4)
    return release


def _linear_step(model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    out.backward(grad)
    return (out.detach(), x.grad, *(p.grad for p in model.parameters()))


@pytest.mark.parametrize("level", ["python", "aten"])
@pytest.mark.parametrize("bias", [False, True])
def test_pytorch_runs_the_calls_whose_kernels_compile(monkeypatch, fresh_pool, level, bias):
    M, N, K = 24, 40, 32
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE, bias=bias)
    forward, everything = _keys([spec]), _keys(warming.all_specs([spec]))
    release = _gated_background(monkeypatch, fresh_pool, everything)
    model = torch.nn.Linear(K, N, bias=bias, device=DEVICE, dtype=DTYPE)
    x = torch.randn(M, K, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(M, N, device=DEVICE, dtype=DTYPE)
    plain = _linear_step(model, x, grad)
    launched = _record_launches(monkeypatch)
    ov = tg.override(level=level, while_compiling="pytorch")
    with ov:
        first = _linear_step(model, x, grad)
    # Nothing built: the step ran as plain PyTorch's, bit for bit, and every kernel it and
    # its backward will need is compiling.
    assert launched == [] and ov.ran_while_compiling >= 1
    assert sum(ov.counts.values()) >= 1 and ov.counts["fallback"] == 0, ov.counts
    for got, want in zip(first, plain):
        assert torch.equal(got, want)
    assert all(fresh_pool.future(key) is not None for key in everything)
    release.set()
    fresh_pool.drain()
    ran_before = ov.ran_while_compiling
    with ov:
        second = _linear_step(model, x, grad)
    # Built: the forward and both gradients on tgemm (the bias gradient is a sum).
    assert ov.ran_while_compiling == ran_before
    assert forward <= set(launched) <= everything and len(launched) >= 3, launched
    ref = [t.double() for t in plain]
    for got, want in zip(second, ref):
        assert rel_error(got, want) <= 1e-2


def test_gradients_run_on_pytorch_while_theirs_compile(monkeypatch, fresh_pool):
    M, N, K = 24, 40, 32
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE)
    forward, everything = _keys([spec]), _keys(warming.all_specs([spec]))
    release = _gated_background(monkeypatch, fresh_pool, everything - forward)
    model = torch.nn.Linear(K, N, bias=False, device=DEVICE, dtype=DTYPE)
    x = torch.randn(M, K, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(M, N, device=DEVICE, dtype=DTYPE)
    plain = _linear_step(model, x, grad)
    ov = tg.override(while_compiling="pytorch")
    with ov:
        _linear_step(model, x, grad)  # submits everything; the forward's kernels compile at once
    for key in forward:
        fresh_pool.future(key).result(30)
    launched = _record_launches(monkeypatch)
    with ov:
        routed = _linear_step(model, x, grad)
    # The forward on tgemm; its gradients on PyTorch, their kernels still compiling.
    assert set(launched) == forward
    assert rel_error(routed[0], plain[0].double()) <= 1e-2
    assert torch.equal(routed[1], plain[1]) and torch.equal(routed[2], plain[2])
    release.set()


def test_direct_calls_and_the_default_wait(monkeypatch, fresh_pool):
    M, N, K = 24, 48, 32
    spec = compile_ahead.linear_spec(M, N, K, DTYPE, DEVICE)
    release = _gated_background(monkeypatch, fresh_pool, _keys([spec]))
    threading.Timer(0.3, release.set).start()
    a, b = _operand(M, K, False, False), _operand(K, N, True, False)
    with tg.override(while_compiling="pytorch"):
        begin = time.perf_counter()
        out = tg.mm(a, b)  # a direct call: tgemm, waiting for its kernels
    assert time.perf_counter() - begin >= 0.25
    assert rel_error(out, a.double() @ b.double()) <= 1e-2
    monkeypatch.setenv("TORCH_TRITON_GEMM_WHILE_COMPILING", "pytorch")
    assert tg.override().while_compiling == "pytorch"
    monkeypatch.delenv("TORCH_TRITON_GEMM_WHILE_COMPILING")
    assert tg.override(level="aten").while_compiling == "wait"
    with pytest.raises(ValueError, match="while_compiling"):
        tg.override(while_compiling="aten")


def test_background_compilation_switch(monkeypatch):
    monkeypatch.setattr(compile_ahead._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: False)
    cuda = torch.device("cuda")
    monkeypatch.delenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", raising=False)
    assert compile_ahead.background_enabled(cuda)
    assert not compile_ahead.background_enabled(torch.device("cpu"))
    monkeypatch.setenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "0")
    assert not compile_ahead.background_enabled(cuda)
    monkeypatch.setenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "1")
    assert compile_ahead.background_enabled(cuda)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)  # tuning plans by timing
    assert not compile_ahead.background_enabled(cuda)


@pytest.mark.skipif(not tgemm_device.interpreter_enabled(),
                    reason="about the interpreter; test_background_compilation_switch covers GPUs")
def test_background_compilation_is_off_under_the_interpreter():
    assert not compile_ahead.background_enabled(torch.device("cpu"))
    assert not compile_ahead.background_enabled(torch.device("cuda"))


# --- torch_triton_gemm.warmup -------------------------------------------------------------------

def test_warmup_plans_shapes_without_compiling_on_cpu():
    result = tg.warmup([(64, 48, 32), {"M": 16, "N": 8, "K": 32, "layout": "nn", "bias": True,
                                       "dtype": "fp16"}],
                       dtype=DTYPE, device="cpu", progress=False)
    assert result.products == 6 and result.variants >= 1
    assert result.compiled == 0 and result.failures == ()
    assert not compile_pool.POOL.busy
    forward_only = tg.warmup([(64, 48, 32)], dtype=DTYPE, device="cpu", backward=False,
                             progress=False)
    assert forward_only.products == 1


def test_warmup_of_a_model(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 16, bias=False)).to(DTYPE)
    by_tokens = warming.model_specs(model, tokens=64)
    assert [(tuple(s.a.shape), tuple(s.b.shape), s.bias is not None) for s in by_tokens] == [
        ((64, 32), (32, 48), True), ((64, 48), (48, 16), False)]
    recorded = warming.model_specs(model, example_input=torch.randn(4, 16, 32, dtype=DTYPE))
    assert [warming._spec_key(s) for s in recorded] == [warming._spec_key(s) for s in by_tokens]
    assert len(warming.model_specs(model, tokens=[8, 64])) == 4
    result = tg.warmup(model, tokens=64, progress=False)
    assert result.products == 2 + 4
    with pytest.raises(ValueError, match="tokens="):
        tg.warmup(model)


def test_warmup_compiles_every_variant_in_parallel(monkeypatch, fresh_pool, capsys):
    """With a device to compile for (faked), warmup submits each variant once, waits for all,
    shows progress, and a second warmup finds them built."""
    _, compiled = _fake_background(monkeypatch, fresh_pool, delay=0.1)
    monkeypatch.setattr(compile_ahead, "_device_index", lambda device: 0)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the stderr line
    shapes = [(40, 48, 96), (40, 96, 48)]
    with tuning.force_plan(PLANS["portable-tail-split3"]):
        result = tg.warmup(shapes, dtype=DTYPE, device="cpu")
        again = tg.warmup(shapes, dtype=DTYPE, device="cpu", progress=False)
    assert result.products == 6 and result.compiled == result.variants == len(compiled)
    assert len(set(compiled)) == len(compiled)
    # 4 workers: much less than one compilation after the other.
    assert result.seconds < 0.1 * len(compiled)
    assert f"compiled {len(compiled)}/{len(compiled)} kernels" in capsys.readouterr().err
    assert again.compiled == 0 and len(compiled) == result.variants


def test_warmup_reports_failed_compilations(monkeypatch, fresh_pool, caplog):
    monkeypatch.setattr(compile_ahead, "_device_index", lambda device: 0)

    def failing(kernel, grid, args, meta, device):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(fresh_pool, "_compile", failing)
    with caplog.at_level(logging.WARNING, logger="torch_triton_gemm"):
        result = tg.warmup([(16, 16, 16)], dtype=DTYPE, device="cpu", backward=False,
                           progress=False)
    assert result.compiled == 0 and len(result.failures) == result.variants >= 1
    assert "out of shared memory" in result.failures[0]
    assert any("failed to compile" in r.getMessage() for r in caplog.records)


def test_warmup_rejects_unknown_arguments():
    with pytest.raises(ValueError, match="layout"):
        tg.warmup([(8, 8, 8)], device="cpu", layout="nx", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        tg.warmup([(8, 8, 8)], device="cpu", dtype="fp64", progress=False)
    with pytest.raises(ValueError, match="shape keys"):
        tg.warmup([{"M": 8, "N": 8, "K": 8, "tokens": 3}], device="cpu", progress=False)


# --- the command line ---------------------------------------------------------------------------

def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "torch_triton_gemm.warmup", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert "--shapes" in proc.stdout and "--no-backward" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr


def test_cli_run_on_cpu(capsys):
    assert warming.main(["--shapes", "64x48x32,16x8x32", "--dtype", "fp16", "--device", "cpu",
                         "--layout", "nn", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "6 products" in out and "on cpu" in out and "planned only" in out
    with pytest.raises(SystemExit):
        warming.main(["--shapes", "64x48", "--device", "cpu"])
    assert warming.parse_shapes("1x2x3, 4X5X6") == [(1, 2, 3), (4, 5, 6)]


@pytest.mark.parametrize("how", ["tokens", "example_input"])
def test_warmup_covers_a_training_step_under_the_override(monkeypatch, how):
    """The benchmark's Llama-style model, one training step under ``override()``: every kernel
    variant it launches is one that ``warmup`` plans for the model."""
    from torch_triton_gemm.bench.model import TinyLlama, train_step

    batch, seq = 2, 8
    model = TinyLlama(vocab=64, hidden=32, heads=2, layers=1, intermediate=48,
                      max_seq=seq).to(DEVICE)
    tokens = torch.randint(64, (batch, seq + 1), device=DEVICE)
    if how == "tokens":
        specs = warming.model_specs(model, tokens=batch * seq)
    else:
        specs = warming.model_specs(model, example_input=tokens[:, :-1])
    planned = _keys(warming.all_specs(specs))
    launched = _record_launches(monkeypatch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tg.override() as ov:
        train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    assert ov.counts["mm"] == 8 and len(launched) >= 3 * 8  # 8 linears, forward and backward
    assert set(launched) <= planned


# --- GPU only -----------------------------------------------------------------------------------

def _triton_cache_entries() -> dict[str, set]:
    """The variants in Triton's in-memory caches of the GEMM kernels, on the current GPU."""
    device = torch.cuda.current_device()
    entries = {}
    for kernel in (launcher.mm_kernel, launcher.mm_tma_kernel, launcher.splitk_reduce_kernel):
        caches = kernel.device_caches.get(device)
        entries[kernel.__name__] = set(caches[0]) if caches else set()
    return entries


@pytest.mark.gpu
def test_after_warmup_a_training_step_compiles_nothing():
    """The variants warmup compiles on the pool (stand-ins for the tensors, Triton's warmup)
    are the ones a training step under the override launches: the step finds them all in
    Triton's cache."""
    from torch_triton_gemm.bench.model import TinyLlama, train_step

    batch, seq = 2, 96  # M = 192: not a multiple of 16 in every product's sizes
    model = TinyLlama(vocab=1000, hidden=192, heads=3, layers=1, intermediate=520,
                      max_seq=seq).to(device="cuda", dtype=torch.bfloat16)
    result = tg.warmup(model, tokens=batch * seq, progress=False)
    assert result.failures == () and result.variants > 0
    before = _triton_cache_entries()
    tokens = torch.randint(1000, (batch, seq + 1), device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tg.override():
        train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    after = _triton_cache_entries()
    assert {name: after[name] - before[name] for name in after} == {
        name: set() for name in after}


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_background_compilation_gives_correct_results(monkeypatch, fresh_pool, transposed):
    """First calls with background compilation on: forward and gradients match float64, and
    every variant the pool compiled built."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "1")
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    M, N, K = 333, 272, 1000 + 8 * int(transposed)  # fresh signatures
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = (w.t() if transposed else w.t().contiguous()).detach().requires_grad_()
    out = tg.mm(x, b)
    assert fresh_pool.busy or fresh_pool._futures  # the backward's variants were submitted
    grad = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    out.backward(grad)
    x64, b64 = x.detach().double(), b.detach().double()
    reference = (x64 @ b64, grad.double() @ b64.t(), x64.t() @ grad.double())
    for got, want in zip((out, x.grad, b.grad), reference):
        assert (got.double() - want).norm() <= 2e-2 * want.norm()
    fresh_pool.drain(60)
    assert all(f.exception() is None for f in fresh_pool._futures.values())


def _bad_warmups() -> list[tuple[str, object, type[Exception], str]]:
    linear = torch.nn.Linear(4, 4)
    return [
        ("negative size", lambda: tg.warmup([(-1, 8, 8)], progress=False), ValueError,
         "M must be 0 or more, got -1"),
        ("fractional size", lambda: tg.warmup([(8, 8.5, 8)], progress=False), ValueError,
         "N must be a whole number, got 8.5"),
        ("one shape, not a list", lambda: tg.warmup((8, 8, 8), progress=False), ValueError,
         "for one product pass a list"),
        ("two sizes", lambda: tg.warmup([(8, 8)], progress=False), ValueError,
         "a shape is an (M, N, K) tuple"),
        ("dict without K", lambda: tg.warmup([{"M": 8, "N": 8}], progress=False), ValueError,
         "no K"),
        ("activation", lambda: tg.warmup([{"M": 8, "N": 8, "K": 8, "activation": "tanh"}],
                                         progress=False), ValueError, "unknown activation"),
        ("float64", lambda: tg.warmup([(8, 8, 8)], dtype=torch.float64, progress=False),
         ValueError, "not torch.float64"),
        ("out dtype", lambda: tg.warmup([{"M": 8, "N": 8, "K": 8, "out_dtype": torch.int32}],
                                        progress=False), ValueError, "out_dtype torch.int32"),
        ("negative tokens", lambda: tg.warmup(linear, tokens=-3, progress=False), ValueError,
         "tokens must be a whole number"),
        ("bool tokens", lambda: tg.warmup(linear, tokens=True, progress=False), ValueError,
         "tokens must be a whole number"),
        ("not a device", lambda: tg.warmup([(8, 8, 8)], device="foo", progress=False),
         ValueError, "'foo' is not a device"),
        ("meta device", lambda: tg.warmup([(8, 8, 8)], device="meta", progress=False),
         ValueError, "not meta"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_arguments_say_what_is_wrong(case):
    name, call, error, message = _bad_warmups()[case]
    with pytest.raises(error, match=re.escape("warmup: ") + ".*" + re.escape(message)):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_is_an_error():
    with pytest.raises(RuntimeError, match="warmup: cuda:0 is not available"):
        tg.warmup([(8, 8, 8)], device="cuda:0", progress=False)
    with pytest.raises(SystemExit):
        warming.main(["--shapes", "8x8x8", "--device", "cuda", "--quiet"])
