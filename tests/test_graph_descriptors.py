"""Host-built TMA descriptors for CUDA-graph captures of the persistent TMA kernel
(ops/graph_descriptors.py): the same bits as device-built ones for every form of the kernel's
launch, the variant's life (compiled in the background, loaded outside a capture, used by
captures), and on a GPU a captured tgemm.mm that runs it.

Without a GPU the host-descriptor launches run in Triton's interpreter, which implements host
descriptors as it implements device ones.
"""

from __future__ import annotations

import contextlib
import types
from concurrent.futures import Future

import pytest
import torch
from samples import make_operand, reference, rel_error
from test_plans import PLANS, _poisoned

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import plan_model
from torch_triton_gemm.kernels import wgmma_fp8
from torch_triton_gemm.ops import graph_descriptors, launcher, planner
from torch_triton_gemm.ops.compile_pool import variant_key

TMA_PLANS = [name for name, plan in PLANS.items() if plan.kernel == "tma"]
# (M, N, K) with 16-byte pitches in every layout (TMA's rule), edges in every dimension and a K
# that leaves a ragged last split.
SHAPES = [(40, 48, 104), (8, 40, 96), (24, 8, 64), (72, 64, 160)]


def _launch(prepared, a, b, out, host: bool) -> None:  # type: ignore[no-untyped-def]
    """Launch ``prepared`` as run_launch does, with host-built descriptors where ``host``."""
    tgemm_device.install_tma_allocator()  # (device-built descriptors need Triton's allocator)
    workspace = locks = None
    if prepared.workspace_shape is not None:
        workspace = launcher.split_workspace(prepared.workspace_shape, a.device, True)
    if prepared.locks_shape is not None:
        locks = torch.zeros(prepared.locks_shape, device=a.device, dtype=torch.int32)
    elif prepared.counters_shape is not None:
        locks = launcher.split_counters(prepared.counters_shape[0], a.device, True)
    for grid, meta, runtime_args in prepared.launches:
        args = (a, b, out, None, workspace, locks, None, None, *runtime_args)
        if host:
            described = graph_descriptors.describe(prepared.kernel, args, meta)
            assert described is not None
            args, meta = described
        launcher.launch_kernel(prepared.kernel, grid, args, meta, False, None)
    if prepared.reduce is not None:
        grid, runtime_args, meta = prepared.reduce
        launcher.launch_kernel(launcher.splitk_reduce_kernel, grid,
                               (workspace, out, None, *runtime_args), meta, False, None)


@pytest.mark.parametrize("plan", TMA_PLANS)
def test_host_descriptors_give_the_device_descriptors_bits(device, plan):
    """Every form of the persistent TMA kernel's launch (splits, tail splits, splits that finish
    their tiles, stream-K, subtiled epilogues) in every layout TMA describes: the launch with
    host-built descriptors writes what the device-built one writes, bit for bit."""
    for layout in ("row", "col", "nt"):
        for m, n, k in SHAPES:
            a = make_operand(m, k, torch.float16, device, layout, "a")
            b = make_operand(k, n, torch.float16, device, layout, "b")
            out = _poisoned(m, n, torch.float16, device)
            prepared = launcher.prepare_launch(a, b, None, out, "none", False, PLANS[plan],
                                               None)
            assert prepared.kernel is launcher.mm_tma_kernel, (layout, m, n, k)
            _launch(prepared, a, b, out, host=False)
            device_built = out.clone()
            out.fill_(float("nan"))
            _launch(prepared, a, b, out, host=True)
            assert torch.equal(out, device_built), (layout, m, n, k)
            assert rel_error(out, reference(a, b)) <= 1e-2, (layout, m, n, k)


def test_c_host_desc_is_the_tma_kernels_last_parameter():
    """Captures append C's host-built descriptor after the kernel's other arguments (prepare),
    so a parameter added after it would leave every host-descriptor variant unbuilt -- a
    warning on a GPU, nothing at all under the interpreter, hence this check."""
    assert launcher.mm_tma_kernel.arg_names[-1] == "c_host_desc"
    assert launcher.mm_tma_kernel.arg_names[-2] == "HOST_DESCRIPTORS"


def test_nothing_to_describe_without_k_nor_for_fp8_and_fp32_operands():
    meta = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "A_M_CONTIGUOUS": False,
            "B_K_CONTIGUOUS": False, "C_TMA": True, "EPILOGUE_SUBTILE": 1}
    a, b = torch.empty(4, 0, dtype=torch.float16), torch.empty(0, 8, dtype=torch.float16)
    out = torch.empty(4, 8, dtype=torch.float16)
    args = (a, b, out, None, None, None, None, None, 4, 8, 0, 0, 1, 8, 1, 8)
    tma = launcher.mm_tma_kernel
    assert graph_descriptors.describe(tma, args, meta) is None
    for dtype in (torch.float16, torch.float8_e4m3fn, torch.float32):
        a, b = torch.empty(4, 64, dtype=dtype), torch.empty(64, 32, dtype=dtype)
        args = (a, b, out, None, None, None, None, None, 4, 32, 64, 64, 1, 32, 1, 32)
        assert (graph_descriptors.describe(tma, args, meta) is None) == (dtype != torch.float16)


def _ws_launch_args(a, b, out, bias=None):  # type: ignore[no-untyped-def]
    """The launcher's arguments of a launch of ws_gemm_kernel (tensors, M, N, K, pitches)."""
    (M, K), N = a.shape, b.shape[1]
    return (a, b, out, bias, None, None, None, None, M, N, K, a.stride(0), b.stride(1),
            out.stride(0), 0, 0, 0, 0, 0, 1, K, bias is not None, False, 1)


@pytest.mark.skipif(not wgmma_fp8.AVAILABLE, reason="Gluon (Triton 3.5+)")
def test_warp_specialized_kernel_takes_host_descriptors():
    """Captures of the warp-specialized Gluon kernel take host-built descriptors too: its last
    parameters are HOST_DESCRIPTORS and c_host_desc (as the TMA kernel's), and ``describe``
    gives A, B (as its transpose) and C as the kernel describes them on the device: boxes of
    64 rows (B: BLOCK_N) by a 128-byte K step, C's of 64 x BLOCK_N, 128-byte swizzles (16-bit
    and fp8 operands, 16-bit and fp32 C); nothing without K nor where a pitch is not 16-byte
    aligned."""
    kernel = wgmma_fp8.ws_gemm_kernel
    assert graph_descriptors.supports(kernel)
    assert kernel.arg_names[-2:] == ["HOST_DESCRIPTORS", "c_host_desc"]
    for dtype, out_dtype, block_n in ((torch.bfloat16, torch.bfloat16, 256),
                                      (torch.float8_e4m3fn, torch.float32, 128)):
        a = torch.empty(200, 528, dtype=dtype)
        w = torch.empty(304, 528, dtype=dtype)
        out = torch.empty(200, 304, dtype=out_dtype)
        meta = {"BLOCK_N": block_n, "CONSUMERS": 2}
        host_args, host_meta = graph_descriptors.describe(kernel, _ws_launch_args(a, w.t(), out),
                                                          meta)
        a_desc, b_desc, c_desc = host_args[0], host_args[1], host_meta["c_host_desc"]
        step = 128 // a.element_size()
        assert host_meta["HOST_DESCRIPTORS"] and host_args[2:] == _ws_launch_args(
            a, w.t(), out)[2:]
        assert (list(a_desc.shape), list(a_desc.block_shape)) == ([200, 528], [64, step])
        assert (list(b_desc.shape), list(b_desc.block_shape)) == ([304, 528], [block_n, step])
        assert (list(c_desc.shape), list(c_desc.block_shape)) == ([200, 304], [64, block_n])
        assert b_desc.base.data_ptr() == w.data_ptr() and list(b_desc.strides) == [528, 1]
        assert all(d.layout.swizzle_byte_width == 128 for d in (a_desc, b_desc, c_desc))
    a = torch.empty(8, 0, dtype=torch.bfloat16)
    assert graph_descriptors.describe(kernel, _ws_launch_args(
        a, torch.empty(0, 16, dtype=torch.bfloat16), torch.empty(8, 16, dtype=torch.bfloat16)),
        {"BLOCK_N": 128}) is None
    odd = torch.empty(64, 68, dtype=torch.bfloat16)[:, :60]  # a 136-byte pitch: not described
    assert graph_descriptors.describe(kernel, _ws_launch_args(
        odd, torch.empty(60, 16, dtype=torch.bfloat16), torch.empty(64, 16, dtype=torch.bfloat16)),
        {"BLOCK_N": 128}) is None


class _Compiled:
    """A compiled kernel as the launcher sees one: loads once, records its launches."""

    def __init__(self) -> None:
        self.loads, self.launches = 0, []
        self.function, self.packed_metadata = "function", "metadata"

    def _init_handles(self) -> None:
        self.loads += 1

    def run(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.launches.append(args)


class _Kernel:
    """A Triton kernel as graph_descriptors sees one: parameters, and warmup from its cache."""

    def __init__(self) -> None:
        self.params = [types.SimpleNamespace(name=name, default=default) for name, default in
                       (("a_ptr", None), ("b_ptr", None), ("c_ptr", None), ("bias_ptr", None),
                        ("ws_ptr", None), ("locks_ptr", None), ("sa_ptr", None),
                        ("sb_ptr", None), ("M", None), ("N", None), ("K", None),
                        ("stride_am", None), ("stride_ak", None), ("stride_bk", None),
                        ("stride_bn", None), ("stride_cm", None), ("BLOCK_M", None),
                        ("HOST_DESCRIPTORS", False), ("c_host_desc", None))]
        self.compiled = _Compiled()
        self.warmups = []

    def warmup(self, *args, grid, **meta):  # type: ignore[no-untyped-def]
        self.warmups.append((args, grid, meta))
        return self.compiled


class _Pool:
    """The compile pool as graph_descriptors sees one: jobs kept and finished by ``drain``;
    ``other``: unfinished jobs that are not host-descriptor variants (kernels calls wait for)."""

    def __init__(self) -> None:
        self.jobs, self.other = [], 0

    @property
    def unfinished(self) -> int:
        return self.other + sum(not future.done() for _, _, future in self.jobs)

    def submit(self, key, *job):  # type: ignore[no-untyped-def]
        future: Future = Future()
        self.jobs.append((key, job, future))
        return future

    def drain(self) -> None:
        self.other = 0
        for _, _, future in self.jobs:
            if not future.done():
                future.set_result(None)


@pytest.fixture
def fresh_variants(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """graph_descriptors with no variants, nothing wanted, no prepare_capture running."""
    for name, value in (("_VARIANTS", {}), ("_WANTED", set()), ("_UNSETTLED", set()),
                        ("_PREPARING", 0), ("_OFF", 0), ("GENERATION", 0),
                        ("DEVICE_BUILT_CAPTURES", 0)):
        monkeypatch.setattr(graph_descriptors, name, value)


@pytest.fixture
def pool(monkeypatch, fresh_variants) -> _Pool:  # type: ignore[no-untyped-def]
    """... and a fake compile pool."""
    fake = _Pool()
    monkeypatch.setattr(graph_descriptors, "POOL", fake)
    monkeypatch.setattr(graph_descriptors, "background_switched_off", lambda: False)
    return fake


def _small_launch(m: int = 8) -> tuple[tuple, dict]:  # type: ignore[type-arg]
    """A persistent TMA launch's arguments and meta-parameters for an m x 32 x 8 product."""
    a, b = torch.randn(m, 32, dtype=torch.float16), torch.randn(32, 8, dtype=torch.float16)
    args = (a, b, torch.empty(m, 8, dtype=torch.float16), None, None, None, None, None,
            m, 8, 32, 32, 1, 8, 1, 8)
    meta = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "A_M_CONTIGUOUS": False,
            "B_K_CONTIGUOUS": False, "C_TMA": False, "EPILOGUE_SUBTILE": 1}
    return args, meta


def test_the_host_variant_is_compiled_after_other_work_loaded_outside_captures_then_captured(
        pool, monkeypatch):
    """prepare() after eager launches (here inside prepare_capture, which wants every
    variant): nothing while the compile pool has other work (kernels that calls wait for),
    then one background compile, then loading the compiled variant (which a capture could not
    do); launch_captured() runs it only once it is loaded, with this call's descriptors and the
    kernel's other arguments in order."""
    monkeypatch.setattr(graph_descriptors, "_PREPARING", 1)
    kernel = _Kernel()
    a, b = torch.randn(24, 40, dtype=torch.float16), torch.randn(40, 16, dtype=torch.float16)
    out = torch.empty(24, 16, dtype=torch.float16)
    args = (a, b, out, None, None, None, None, None, 24, 16, 40, 40, 1, 16, 1, 16)
    meta = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "A_M_CONTIGUOUS": False,
            "B_K_CONTIGUOUS": False, "C_TMA": True, "EPILOGUE_SUBTILE": 2,
            "HOST_DESCRIPTORS": False, "c_host_desc": None}

    def captured() -> bool:
        return graph_descriptors.launch_captured(kernel, (3,), args, meta, 0, 7)

    pool.other = 1
    assert not graph_descriptors.prepare(kernel, (3,), args, meta, 0) and not pool.jobs
    pool.other = 0
    assert not graph_descriptors.prepare(kernel, (3,), args, meta, 0)
    assert len(pool.jobs) == 1
    key, job, future = pool.jobs[0]
    assert key == ("host descriptors", *variant_key(kernel, args, meta, 0))
    assert job[0] is kernel and job[1] == (3,) and job[4] == 0
    host_args, host_meta = job[2], job[3]
    assert host_meta["HOST_DESCRIPTORS"] and host_meta["c_host_desc"].block_shape == [16, 8]
    assert host_args[0].base is a and host_args[0].shape == [24, 40]
    assert host_args[1].base is b and host_args[1].block_shape == [32, 16]
    assert host_args[2:] == args[2:]
    # Compiling: not yet, and captures launch the device-descriptor variant.
    assert not graph_descriptors.prepare(kernel, (3,), args, meta, 0) and len(pool.jobs) == 1
    assert not captured() and kernel.compiled.loads == 0
    assert graph_descriptors.DEVICE_BUILT_CAPTURES == 1  # (benchmarks note such captures)
    future.set_result(None)
    assert graph_descriptors.prepare(kernel, (3,), args, meta, 0)
    assert kernel.compiled.loads == 1 and len(kernel.warmups) == 1
    assert graph_descriptors.prepare(kernel, (3,), args, meta, 0)  # settled: nothing more
    assert kernel.compiled.loads == 1 and len(kernel.warmups) == 1
    assert captured() and graph_descriptors.DEVICE_BUILT_CAPTURES == 1
    (launch,) = kernel.compiled.launches
    assert launch[:9] == (3, 1, 1, 7, "function", "metadata", None, None, None)
    assert launch[9].base is a and launch[10].base is b and launch[11:25] == args[2:]
    assert launch[25] == 16 and launch[26] is True  # BLOCK_M, HOST_DESCRIPTORS
    assert launch[27].base is out and launch[27].block_shape == [16, 8]


def test_only_variants_a_capture_wanted_are_built(pool):
    """Programs that never capture build nothing: prepare() leaves an unwanted variant alone
    (settled); a capture that launches without it makes it wanted (and moves the generation on,
    so kept eager launches look again); the next eager launch submits it."""
    kernel = _Kernel()
    args, meta = _small_launch()
    assert graph_descriptors.prepare(kernel, (1,), args, meta, 0) and not pool.jobs
    assert not graph_descriptors.launch_captured(kernel, (1,), args, meta, 0, 7)
    assert graph_descriptors.GENERATION == 1
    assert not graph_descriptors.launch_captured(kernel, (1,), args, meta, 0, 7)
    assert graph_descriptors.GENERATION == 1  # (wanted once)
    assert not graph_descriptors.prepare(kernel, (1,), args, meta, 0) and len(pool.jobs) == 1
    # Inside off() (tuning): neither built nor launched nor wanted.
    other_args, _ = _small_launch(16)
    with graph_descriptors.off():
        assert graph_descriptors.prepare(kernel, (1,), other_args, meta, 0)
        assert not graph_descriptors.launch_captured(kernel, (1,), other_args, meta, 0, 7)
    assert graph_descriptors.GENERATION == 1 and len(pool.jobs) == 1


def test_a_host_variant_that_fails_is_settled_without_it(pool, monkeypatch, caplog):
    """A compile that failed, a load that fails (a warning: the user's call is unharmed), fp8
    launches and background compilation switched off: settled, captures launch the
    device-descriptor variant."""
    monkeypatch.setattr(graph_descriptors, "_PREPARING", 1)
    kernel = _Kernel()
    args, meta = _small_launch()
    assert not graph_descriptors.prepare(kernel, (1,), args, meta, 0)
    pool.jobs[0][2].set_exception(RuntimeError("out of resources"))
    assert graph_descriptors.prepare(kernel, (1,), args, meta, 0)
    assert not graph_descriptors.launch_captured(kernel, (1,), args, meta, 0, 7)
    assert not kernel.warmups and not kernel.compiled.launches
    assert "out of resources" in caplog.text
    # The load fails.
    args, meta = _small_launch(16)
    assert not graph_descriptors.prepare(kernel, (1,), args, meta, 0)
    pool.drain()
    kernel.compiled._init_handles = lambda: (_ for _ in ()).throw(RuntimeError("no module"))
    assert graph_descriptors.prepare(kernel, (1,), args, meta, 0)
    assert not graph_descriptors.launch_captured(kernel, (1,), args, meta, 0, 7)
    assert "no module" in caplog.text
    # fp8 operands (not yet run with host-built descriptors on a GPU): settled at once.
    fp8 = tuple(t.to(torch.float8_e4m3fn) if i < 2 else t for i, t in enumerate(args))
    jobs = len(pool.jobs)
    assert graph_descriptors.prepare(kernel, (1,), fp8, meta, 0) and len(pool.jobs) == jobs
    # Background compilation switched off: settled at once, nothing submitted.
    monkeypatch.setattr(graph_descriptors, "background_switched_off", lambda: True)
    args, meta = _small_launch(24)
    assert graph_descriptors.prepare(kernel, (1,), args, meta, 0) and len(pool.jobs) == jobs


def test_prepare_capture_runs_until_the_host_variants_are_loaded(pool):
    """tg.prepare_capture(fn): eager runs of fn, waiting for the compile pool between them,
    until its launches' host-descriptor variants are loaded. Every variant a run launches is
    submitted in that run (two here); with the pool busy with other work at first: a run that
    waits, one that submits, one that loads; then a settled step takes one run."""
    pool.other = 1
    kernels = (_Kernel(), _Kernel())
    launches = (_small_launch(8), _small_launch(16))
    runs = []

    def step(scale: int) -> int:
        runs.append(scale)
        for kernel, (args, meta) in zip(kernels, launches):
            graph_descriptors.prepare(kernel, (1,), args, meta, 0)
        return len(runs) * scale

    assert tg.prepare_capture(step, 10) == 30 and runs == [10] * 3
    assert [k.compiled.loads for k in kernels] == [1, 1] and len(pool.jobs) == 2
    assert tg.prepare_capture(step, scale=1) == 4 and len(runs) == 4
    assert graph_descriptors._PREPARING == 0


def test_a_variant_prepare_capture_left_compiling_is_loaded_by_a_later_eager_launch(
        pool, monkeypatch):
    kernel = _Kernel()
    args, meta = _small_launch()
    monkeypatch.setattr(graph_descriptors, "_PREPARING", 1)
    assert not graph_descriptors.prepare(kernel, (1,), args, meta, 0) and len(pool.jobs) == 1
    monkeypatch.setattr(graph_descriptors, "_PREPARING", 0)
    pool.drain()
    assert graph_descriptors.prepare(kernel, (1,), args, meta, 0)
    assert kernel.compiled.loads == 1


def test_prepare_capture_says_when_it_ran_out_of_rounds(pool, caplog):
    kernel = _Kernel()
    args, meta = _small_launch()
    pool.other = 1
    runs = []
    result = tg.prepare_capture(
        lambda: runs.append(graph_descriptors.prepare(kernel, (1,), args, meta, 0)), rounds=1)
    assert result is None and runs == [False] and "still had" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["tma", "tma-split3-fixup", "tma-stream-k", "tma-subtile",
                                  "tma-tail-split3"])
def test_gpu_captured_tgemm_runs_host_descriptors(plan, monkeypatch, fresh_variants):
    """On a GPU: tg.prepare_capture runs tgemm.mm of a TMA plan until its host-descriptor
    variants are loaded (a tail split launches twice), then a CUDA graph capture launches them,
    not the device-descriptor variants; replays on new operands give the eager call's bits."""
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    captured = _spy_on_captures(monkeypatch)
    a = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(200, 520, device="cuda", dtype=torch.bfloat16)
    with tg.tuning.force_plan(PLANS[plan]):
        eager = tg.prepare_capture(tg.mm, a, w.t())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tg.mm(a, w.t())
    assert captured and all(captured), captured
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    a.copy_(torch.randn_like(a))
    w.copy_(torch.randn_like(w))
    graph.replay()
    with tg.tuning.force_plan(PLANS[plan]):
        expected = tg.mm(a, w.t())
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and not torch.equal(out, eager)
    assert rel_error(out, reference(a, w.t())) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["shared-tile", "ping-pong", "k-split", "fp8-rowwise"])
def test_gpu_captured_warp_specialized_launches_run_host_descriptors(form, monkeypatch,
                                                                      fresh_variants):
    """On an H100: captures of the warp-specialized kernel's launches (a 16-bit plan, its
    ping-pong form, a K split with its reduction, and a precise fp8 product the planner gives
    it) launch the host-descriptor variant after tg.prepare_capture; replays give the eager
    call's bits, and on new operands the eager call's on those."""
    if not (wgmma_fp8.AVAILABLE and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the warp-specialized kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm import tuning

    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    captured = _spy_on_captures(monkeypatch)
    m, n, k = (1024, 2304, 512) if form == "fp8-rowwise" else (300, 200, 520)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if form == "fp8-rowwise":  # (the planner's plan: the precise kernel)
        a, w = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa = torch.rand(m, 1, device="cuda") + 0.5
        sw = torch.rand(1, n, device="cuda") + 0.5

        def call() -> torch.Tensor:
            return tg.scaled_mm(a, w.t(), sa, sw, bias)

        def plan() -> contextlib.AbstractContextManager:  # type: ignore[type-arg]
            return contextlib.nullcontext()
    else:
        chosen = {"shared-tile": tuning.ws_plans(2)[1], "ping-pong": tuning.ws_plans(2)[-1],
                  "k-split": tuning.MMPlan(tuning.WS_KERNEL, tuning.WS_SPLIT_TILES[0], 2)}[form]

        def call() -> torch.Tensor:
            return tg.mm(a, w.t(), bias)

        def plan() -> contextlib.AbstractContextManager:  # type: ignore[type-arg]
            return tuning.force_plan(chosen)
    with plan():
        eager = tg.prepare_capture(call)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
    assert captured and all(captured), captured
    assert any(isinstance(state, graph_descriptors._Loaded) and key[0] is wgmma_fp8.ws_gemm_kernel
               for key, state in graph_descriptors._VARIANTS.items())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    a.copy_(torch.randn(a.shape, device="cuda").to(a.dtype))
    graph.replay()
    with plan():
        expected = call()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and not torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_a_capture_without_prepare_capture_wants_the_variant(monkeypatch, fresh_variants):
    """Without prepare_capture, on the planner's own TMA plan (kept eager launches, the
    direct path): a first capture launches the device-descriptor variant and makes the host
    one wanted; eager calls then build and load it, and a later capture launches it. Eager
    calls of a program that never captures build nothing. (The warp-specialized kernel's
    plans, which take this product on Hopper, left out: the test is about the TMA kernel.)"""
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    monkeypatch.setattr(plan_model, "WS_PLANS", False)
    captured = _spy_on_captures(monkeypatch)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    out = a.new_empty((2048, 2048))
    plan = planner.plan_mm(a, w.t(), None, out, "none", False)
    prepared = launcher.prepare_launch(a, w.t(), None, out, "none", False, plan, None)
    assert prepared.kernel is launcher.mm_tma_kernel
    for _ in range(3):
        eager = tg.mm(a, w.t())
        launcher.POOL.drain()
    assert not graph_descriptors._VARIANTS
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        out_first = tg.mm(a, w.t())
    for _ in range(3):
        tg.mm(a, w.t())
        launcher.POOL.drain()
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        out_second = tg.mm(a, w.t())
    assert captured == [False, True]
    first.replay()
    second.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_first, eager) and torch.equal(out_second, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(64, 1472, 120), (1280, 176, 216)])
def test_gpu_captures_of_a_portable_twins_tma_plan_run_host_descriptors(
        monkeypatch, fresh_variants, m, n, k):
    """A product whose eager calls run the portable twin of the planner's TMA plan (the
    launch CUDA graphs capture): prepare_capture still builds and loads that TMA launch's
    host-descriptor variant (eager calls run the capture launch until it settles), and the
    capture launches it; so does a later capture without prepare_capture, once eager calls have
    run. Replays give the eager calls' bits."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_EAGER_PLANS", "1")
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    monkeypatch.setattr(plan_model, "WS_PLANS", False)
    captured = _spy_on_captures(monkeypatch)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    out = a.new_empty((m, n))
    plan = planner.plan_mm(a, b, None, out, "none", False)
    assert plan.kernel == "tma" and planner.eager_mm_plan(a, b, out, plan).kernel == "portable"
    eager = tg.prepare_capture(tg.mm, a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = tg.mm(a, b)
    assert captured == [True]
    # A variant wanted by another capture: the next eager calls settle this launch again.
    monkeypatch.setattr(graph_descriptors, "GENERATION", graph_descriptors.GENERATION + 1)
    for _ in range(2):
        assert torch.equal(tg.mm(a, b), eager)
        launcher.POOL.drain()
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        got_second = tg.mm(a, b)
    assert captured == [True, True]
    got.fill_(float("nan"))
    got_second.fill_(float("nan"))
    graph.replay()
    second.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, eager) and torch.equal(got_second, eager)
    assert rel_error(eager, reference(a, b)) <= 1e-2


def _spy_on_captures(monkeypatch) -> list[bool]:  # type: ignore[no-untyped-def]
    """What each launch_captured call returned, from now on."""
    captured: list[bool] = []
    launch_captured = graph_descriptors.launch_captured

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        captured.append(launch_captured(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(graph_descriptors, "launch_captured", spy)
    return captured


_HOST_COMPILE_SCRIPT = """
from hopper_compile import compile_for
from torch_triton_gemm.kernels.matmul import mm_tma_kernel

pointers = {"a_ptr": "tensordesc<bf16[64, 64]>", "b_ptr": "tensordesc<bf16[64, 64]>",
            "c_ptr": "*bf16", "bias_ptr": "*bf16", "ws_ptr": "*fp32", "locks_ptr": "*i32",
            "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_host_desc": "tensordesc<bf16[64, 32]>"}
constants = dict(stride_ak=1, stride_bk=1, stride_cn=1, HAS_BIAS=False, ACTIVATION="none",
                 INPUT_PRECISION=None, UPCAST_TO_FP32=False, INDEX_64=False, SPLIT=False,
                 SCALING="none", SA_ROWS=1, SB_COLS=1, FAST_ACCUM=False, BLOCK_M=64,
                 BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_FIXUP=False, SPLIT_K=1,
                 A_M_CONTIGUOUS=False, B_K_CONTIGUOUS=True, C_TMA=True, EPILOGUE_SUBTILE=2,
                 STREAM_K=False, WARP_SPECIALIZE=False, PDL=False, C_ALIGN=1)
for host in (True, False):
    if not host:
        pointers.update(a_ptr="*bf16", b_ptr="*bf16")
    for warp_specialize in (False, True):
        flags = dict(HOST_DESCRIPTORS=host, WARP_SPECIALIZE=warp_specialize)
        if not host:
            flags["c_host_desc"] = None
        compiled = compile_for(mm_tma_kernel, pointers, dict(constants, **flags),
                               ["c_ptr"] if host else ["a_ptr", "b_ptr", "c_ptr"],
                               num_warps=4, num_stages=3)
        ptx = compiled.asm["ptx"]
        print(host, "cp.async.bulk.tensor" in ptx, "tensormap.replace" in ptx)
"""


def test_host_descriptor_variant_compiles_for_hopper():
    """The sm_90 build with host-built descriptors loads and stores by TMA and builds no
    descriptor on the device (no tensormap.replace); the default build does build them."""
    from test_mm import _run_without_interpreter

    lines = _run_without_interpreter(_HOST_COMPILE_SCRIPT).splitlines()
    assert lines == ["True True False"] * 2 + ["False True True"] * 2


_WS_HOST_COMPILE_SCRIPT = """
import torch
from hopper_compile import compile_for
from triton.runtime.jit import mangle_type
from torch_triton_gemm.kernels import wgmma_fp8
from torch_triton_gemm.kernels.wgmma_fp8 import CONSUMER_REGS, ws_gemm_kernel

for dtype, out_dtype, name, out_name in ((torch.bfloat16, torch.bfloat16, "*bf16", "*bf16"),
                                         (torch.float8_e4m3fn, torch.float32, "*fp8e4nv", "*fp32")):
    a = torch.empty(256, 512, dtype=dtype)
    w = torch.empty(384, 512, dtype=dtype)
    out = torch.empty(256, 384, dtype=out_dtype)
    for pingpong in ((False, True) if dtype == torch.bfloat16 else (False,)):
        for host in (True, False):
            descs = wgmma_fp8.host_descriptors(a, w.t(), out, 256, 384, 512, 512, 512, 384, 128)
            pointers = {"a_ptr": name, "b_ptr": name, "c_ptr": out_name, "bias_ptr": "*bf16",
                        "ws_ptr": "*fp32", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
            constants = dict(HAS_BIAS=True, BLOCKWISE=False, A_ROWS=1, CONSUMERS=2, BLOCK_N=128,
                             GROUP_M=8, STAGES=4, CONSUMER_REGS=CONSUMER_REGS[2],
                             PINGPONG=pingpong, HOST_DESCRIPTORS=host, locks_ptr=None)
            if host:
                pointers.update(a_ptr=mangle_type(descs[0]), b_ptr=mangle_type(descs[1]),
                                c_host_desc=mangle_type(descs[2]))
            else:
                constants["c_host_desc"] = None
            ptx = compile_for(ws_gemm_kernel, pointers, constants,
                              ["c_ptr"] + ([] if host else ["a_ptr", "b_ptr"]),
                              num_warps=4).asm["ptx"]
            print(host, pingpong, "cp.async.bulk.tensor" in ptx, "tensormap" in ptx)
"""


@pytest.mark.skipif(not wgmma_fp8.AVAILABLE, reason="Gluon (Triton 3.5+)")
def test_warp_specialized_host_variant_compiles_for_hopper():
    """The warp-specialized kernel's sm_90 builds with host-built descriptors (16-bit, its
    ping-pong form, precise fp8 into fp32) load and store by TMA and build no descriptor on
    the device (no tensormap instruction); the default builds do build them."""
    from test_mm import _run_without_interpreter

    lines = _run_without_interpreter(_WS_HOST_COMPILE_SCRIPT).splitlines()
    assert lines[:6] == ["True False True False", "False False True True",
                         "True True True False", "False True True True",
                         "True False True False", "False False True True"], lines
