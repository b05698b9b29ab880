"""Direct launches of memoised eager calls: after a signature's first call, tgemm calls each
compiled kernel's launcher itself (launcher.run_kept). These tests stand in for the compiled
kernels (this host may have no GPU) and check that the direct launches pass exactly what the
first launch passed through Triton's JIT, for plain, split-K and scaled products."""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch
from samples import randn, reference, rel_error, tolerance

import torch_triton_gemm as tg
from torch_triton_gemm import tuning
from torch_triton_gemm.kernels import wgmma_fp8
from torch_triton_gemm.kernels.matmul import mm_kernel, mm_tma_kernel, splitk_reduce_kernel
from torch_triton_gemm.ops import graph_descriptors, launcher, operands
from torch_triton_gemm.ops import mm as mm_module

_STREAM = 7


class _Recorder:
    """Stands in for Triton: ``kernel[grid](*args, **meta)`` (the JIT) records the launch by
    parameter name and returns a compiled kernel whose launcher records its calls."""

    def __init__(self, c_launcher: bool = False) -> None:
        self.jit: list[tuple[str, tuple[int, ...], dict[str, object]]] = []
        self.direct: list[tuple[str, tuple[int, ...], int, dict[str, object]]] = []
        self.c_launcher = c_launcher  # compiled kernels' launchers in Triton 3.6's form
        self.through_wrapper = 0  # calls of such a launcher itself (not its C function)
        self.scratch_size = 0  # global scratch bytes per program of the TMA kernel's launchers
        self.scratch: list[object] = []  # the global scratch each C function call was given

    def getitem(self, kernel, grid):  # type: ignore[no-untyped-def]
        name = kernel.fn.__name__
        names = kernel.arg_names

        def jit(*args, **meta):  # type: ignore[no-untyped-def]
            self.jit.append((name, tuple(grid), {**dict(zip(names, args)), **meta}))

            def run(grid_0, grid_1, grid_2, stream, function, metadata, launch_metadata,
                    enter_hook, exit_hook, *arguments):  # type: ignore[no-untyped-def]
                assert (function, metadata) == (name, "packed")
                assert (launch_metadata, enter_hook, exit_hook) == (None, None, None)
                assert len(arguments) == len(names)
                self.direct.append((name, (grid_0, grid_1, grid_2), stream,
                                    dict(zip(names, arguments))))

            def c_launch(grid_0, grid_1, grid_2, stream, function, cooperative, pdl,
                         global_scratch, profile_scratch, *rest):  # type: ignore[no-untyped-def]
                assert (cooperative, pdl, profile_scratch) == (False, True, None)
                self.scratch.append(global_scratch)
                run(grid_0, grid_1, grid_2, stream, function, *rest)

            launcher = run
            if self.c_launcher:
                launcher = _TritonLauncher(c_launch, self)
                if name == "mm_tma_kernel":
                    launcher.global_scratch_size = self.scratch_size
            return types.SimpleNamespace(run=launcher, function=name, packed_metadata="packed")

        return jit


class _TritonLauncher:
    """A compiled kernel's launcher of Triton 3.6's form (CudaLauncher): its C function
    ``launch`` behind a wrapper that allocates scratch buffers (none here) and counts its
    calls in the recorder."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, launch, record=None) -> None:  # type: ignore[no-untyped-def]
        self.launch, self.record = launch, record

    global_scratch_align = 128

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # type: ignore[no-untyped-def]
        self.record.through_wrapper += 1
        return self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                           self.launch_pdl, None, None, *args)


@pytest.fixture(params=[False, True], ids=["launcher", "c-launcher"])
def recorder(monkeypatch, request):  # type: ignore[no-untyped-def]
    """Launches as on a GPU (compiled kernels, direct launches), recorded instead of run; the
    compiled kernels' launchers plain functions, or of Triton 3.6's form (see _c_launch)."""
    record = _Recorder(c_launcher=request.param)
    monkeypatch.setattr(launcher, "_TRITON_3_6", True)  # the launcher form of that release
    monkeypatch.setattr(launcher, "_LAUNCHER_FORMS", {})
    monkeypatch.setattr(launcher, "_INTERPRETED", False)
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: _STREAM)
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    for kernel in (mm_kernel, mm_tma_kernel, splitk_reduce_kernel):
        if not hasattr(kernel, "params"):  # the interpreter's kernels: the JIT's parameters
            params = [types.SimpleNamespace(name=p.name, default=p.default)
                      for p in inspect.signature(kernel.fn).parameters.values()]
            monkeypatch.setattr(kernel, "params", params, raising=False)
    monkeypatch.setattr(type(mm_kernel), "__getitem__",
                        lambda kernel, grid: record.getitem(kernel, grid))
    return record


def _expect_direct_launches_repeat_the_jit(record: _Recorder, calls: int,
                                           tensors: dict[str, object]) -> None:
    """The first call launched through the JIT; each later call launched the same kernels
    directly, on the current stream, with the JIT launch's arguments (the kernels' defaults
    for parameters the JIT was not given) and this call's tensors, as their addresses
    (integers: the launcher does not look them up again)."""
    kernels = len(record.jit)
    assert kernels >= 1 and len(record.direct) == kernels * (calls - 1)
    assert record.through_wrapper == 0  # Triton 3.6's launchers: their C function directly
    for call in range(calls - 1):
        for (name, grid, by_name), direct in zip(
                record.jit, record.direct[call * kernels:(call + 1) * kernels]):
            direct_name, direct_grid, stream, passed = direct
            assert (direct_name, direct_grid, stream) == (name, (*grid, 1, 1)[:3], _STREAM)
            for param, value in passed.items():
                if param in tensors:
                    tensor = tensors[param]
                    assert value is None if tensor is None else (
                        type(value) is int and value == tensor.data_ptr()), param
                elif isinstance(by_name.get(param), torch.Tensor):
                    # A buffer or padded copy of the call's own: its address.
                    assert type(value) is int and value != 0, param
                elif param in by_name:
                    assert value == by_name[param], param


@pytest.mark.parametrize("bias", [False, True])
def test_direct_launches_repeat_the_jit_launch(recorder, device, bias):
    a = randn((3, 64), torch.float16, device)
    b = randn((48, 64), torch.float16, device).t()
    c = randn((48,), torch.float16, device) if bias else None
    for _ in range(3):
        out = tg.mm(a, b, c, "relu")
    assert out.shape == (3, 48) and out.dtype == torch.float16
    _expect_direct_launches_repeat_the_jit(recorder, 3, {"a_ptr": a, "b_ptr": b, "bias_ptr": c})


def test_plain_eager_grad_tells_plain_calls_and_their_gradients():
    """None for calls a PyTorch subsystem must see (tensor subclasses, torch_dispatch and
    torch_function modes, functorch transforms), else whether autograd records the call."""
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    w = torch.ones(2, 2, requires_grad=True)
    assert launcher.plain_eager_grad(a, b, None) is False
    assert launcher.plain_eager_grad(a, w, None) is True
    assert launcher.plain_eager_grad(a, None, torch.nn.Parameter(torch.ones(2))) is True
    with torch.no_grad():
        assert launcher.plain_eager_grad(a, w) is False
    assert launcher.plain_eager_grad(a, w.detach()) is False

    class Sub(torch.Tensor):
        pass

    assert launcher.plain_eager_grad(a, b.as_subclass(Sub)) is None
    with torch.overrides.TorchFunctionMode():
        assert launcher.plain_eager_grad(a, b) is None
    with torch.utils._python_dispatch.TorchDispatchMode():
        assert launcher.plain_eager_grad(a, b) is None
    seen = []
    torch.func.vmap(lambda x: seen.append(launcher.plain_eager_grad(x, b)) or x)(a)
    assert seen == [None]
    assert launcher.plain_eager(a, b) and not launcher.plain_eager(a.as_subclass(Sub))


def test_only_lone_plain_launches_take_the_short_path(recorder, device, monkeypatch):
    """run_kept's shortest path (``_DirectLaunches.single``) serves a launch that is all its
    call makes, and no launch that needs more: a split's reduction and workspace, a
    transposed plan's swapped operands."""
    # K spans several of any plan's K steps, so that a split of 4 is not clamped to 1.
    a = randn((3, 1024), torch.float16, device)
    b = randn((48, 1024), torch.float16, device).t()

    def kept_direct() -> launcher._DirectLaunches:
        (entry,) = launcher._EAGER_LAUNCHES.values()
        launcher._EAGER_LAUNCHES.clear()
        return entry.prepared.compiled[-1][0]

    for _ in range(2):
        tg.mm(a, b)
    direct = kept_direct()
    assert direct.single is direct.gemm[0] and direct.reduce is None
    plan_mm = mm_module.plan_mm
    for change in (dict(split_k=4), dict(swap_ab=True)):
        monkeypatch.setattr(mm_module, "plan_mm", lambda *args, change=change: (
            dataclasses.replace(plan_mm(*args), **change)))
        for _ in range(2):
            tg.mm(a, b)
        assert kept_direct().single is None, change


def test_direct_launches_repeat_split_k_and_its_reduction(recorder, device, monkeypatch):
    plan_mm = mm_module.plan_mm
    monkeypatch.setattr(mm_module, "plan_mm", lambda *args: dataclasses.replace(
        plan_mm(*args), split_k=4))
    a = randn((2, 1024), torch.float16, device)
    b = randn((1024, 32), torch.float16, device)
    for _ in range(2):
        torch.ops.tgemm.mm(a, b, None, "none", None)
    assert "splitk_reduce_kernel" in [name for name, _, _ in recorder.jit]
    _expect_direct_launches_repeat_the_jit(recorder, 2, {"a_ptr": a, "b_ptr": b})


def test_eager_calls_launch_the_eager_plan_and_captures_the_planners(recorder, device,
                                                                      monkeypatch):
    """A signature whose plain eager calls take a plan of fewer launches than the planner's
    (planner.eager_mm_plan, TORCH_TRITON_GEMM_EAGER_PLANS=1): its first call launches the
    planner's plan (so that its kernels are loaded before any capture), later eager calls the
    eager plan, and a CUDA-graph capture the planner's plan again, each directly once
    compiled."""
    plan_mm = mm_module.plan_mm
    split = lambda *args: dataclasses.replace(plan_mm(*args), split_k=4)  # noqa: E731
    monkeypatch.setattr(mm_module, "plan_mm", split)
    monkeypatch.setattr(mm_module, "eager_mm_plan",
                        lambda a, b, out, plan: dataclasses.replace(plan, split_k=1))
    a = randn((2, 1024), torch.float16, device)
    b = randn((1024, 32), torch.float16, device)

    def launched() -> list[tuple[str, bool]]:
        # Kernel and SPLIT of each launch since the last look, through the JIT or direct.
        found = [(name, by_name.get("SPLIT")) for name, _, by_name in recorder.jit[seen[0]:]]
        found += [(name, None) for name, *_ in recorder.direct[seen[1]:]]
        seen[:] = [len(recorder.jit), len(recorder.direct)]
        return found

    seen = [0, 0]
    tg.mm(a, b)
    assert launched() == [("mm_kernel", True), ("splitk_reduce_kernel", None)]
    tg.mm(a, b)
    assert launched() == [("mm_kernel", False)]  # compiled and kept on first use
    tg.mm(a, b)
    assert launched() == [("mm_kernel", None)]  # direct
    monkeypatch.setattr(launcher, "_capturing", lambda: True)
    tg.mm(a, b)
    assert launched() == [("mm_kernel", None), ("splitk_reduce_kernel", None)]
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    torch.ops.tgemm.mm(a, b, None, "none", None)
    assert launched() == [("mm_kernel", None)]


def _kept_whole_and_split(device: str = "cpu") -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, launcher.PreparedLaunch,
        launcher.PreparedLaunch]:
    """Operands, an output, and the kept launches of an unsplit and a 2-way split plan."""
    a = randn((64, 128), torch.float16, device)
    b = randn((128, 48), torch.float16, device)
    out = torch.empty((64, 48), dtype=torch.float16, device=device)
    tile = tuning.INTERPRETER_TILE
    whole, split = (launcher.kept(launcher.prepare_launch(
        a, b, None, out, "none", False, tuning.MMPlan("portable", tile, split_k=s), None))
        for s in (1, 2))
    return a, b, out, whole, split


def test_eager_or_capture_needs_the_capture_launch_run_once(monkeypatch):
    _, _, _, whole, split = _kept_whole_and_split()
    assert split.reduce is not None and whole.reduce is None
    plain = launcher.eager_or_capture(whole)
    assert plain is whole
    prepared = whole._replace(capture=split)
    assert launcher.eager_or_capture(prepared) is split  # not run yet
    split.compiled[-1][0] = "kept"  # as run_kept keeps its direct launches
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    assert launcher.eager_or_capture(prepared) is prepared
    monkeypatch.setattr(launcher, "_capturing", lambda: True)
    assert launcher.eager_or_capture(prepared) is split


def test_eager_calls_run_a_tma_capture_launch_until_its_host_descriptors_settle(monkeypatch):
    """A kept eager call whose capture launch is of a kernel that captures with host-built
    descriptors runs that launch while its host-descriptor variants are unsettled as of the
    current generation (a capture wanted them, or prepare_capture began): only eager launches
    build and load them. Settled, or of another kernel, the eager launch runs."""
    _, _, _, whole, split = _kept_whole_and_split()
    prepared = whole._replace(capture=split)
    key = None if launcher._INTERPRETED else launcher._current_device()
    direct = launcher._DirectLaunches((), None, None, None, False, 0, [-1])
    split.compiled[-1][key] = direct
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    monkeypatch.setattr(graph_descriptors, "GENERATION", 0)
    monkeypatch.setattr(graph_descriptors, "supports", lambda kernel: kernel is split.kernel)
    assert launcher.eager_or_capture(prepared) is prepared  # nothing ever wanted
    monkeypatch.setattr(graph_descriptors, "GENERATION", 3)
    assert launcher.eager_or_capture(prepared) is split  # wanted since it last settled
    direct.tma_host[0] = 3  # as run_kept records a settled prepare()
    assert launcher.eager_or_capture(prepared) is prepared
    monkeypatch.setattr(graph_descriptors, "GENERATION", 4)
    assert launcher.eager_or_capture(prepared) is split
    monkeypatch.setattr(graph_descriptors, "supports", lambda kernel: False)
    assert launcher.eager_or_capture(prepared) is prepared  # a kernel without host variants
    split.compiled[-1][key] = direct._replace(tma_host=None)
    monkeypatch.setattr(graph_descriptors, "supports", lambda kernel: kernel is split.kernel)
    assert launcher.eager_or_capture(prepared) is prepared


def test_a_capture_launch_run_under_launch_hooks_counts_as_run(monkeypatch, device):
    """Under launch hooks (a profiler's) run_kept launches through the JIT and keeps no
    direct launches; the capture launch still counts as run once it ran (its kernels are
    loaded), so later eager calls take the eager launch, as without hooks."""
    monkeypatch.setattr(launcher, "_launch_hooks_set", lambda: True)
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    a, b, out, whole, split = _kept_whole_and_split(device)
    prepared = whole._replace(capture=split)
    assert launcher.eager_or_capture(prepared) is split
    launcher.run_kept(split, a, b, None, out, None, None)
    assert not [k for k in split.compiled[-1] if k != launcher._RAN]  # no direct launches
    assert launcher.eager_or_capture(prepared) is prepared
    assert rel_error(out, reference(a, b, None, "none")) <= tolerance(torch.float16,
                                                                       torch.float16)


@pytest.mark.parametrize("kernel", ["tma", "portable"])
def test_direct_launches_repeat_launches_on_padded_copies(recorder, device, monkeypatch, kernel):
    """Operands TMA cannot describe (a 37-element pitch: 74 bytes) copied into padded buffers
    first: later calls copy again and launch directly, on the copies (fresh tensors with the
    first copies' layout), not through the JIT and the launch's variant bookkeeping."""
    monkeypatch.setattr(operands._device, "supports_tma", lambda device: True)
    monkeypatch.setattr(graph_descriptors, "prepare", lambda *args: True)
    monkeypatch.setattr(mm_module, "plan_mm", lambda *args: tuning.MMPlan(
        kernel, tuning.TileConfig(16, 32, 32, 1, 4, 2), pad=True))
    through_run_launch = []
    run_launch = launcher.run_launch
    monkeypatch.setattr(launcher, "run_launch",
                        lambda *args: through_run_launch.append(1) or run_launch(*args))
    copies: list[torch.Tensor] = []  # every padded copy made (kept: addresses stay unique)
    copy = operands.Pad.copy
    monkeypatch.setattr(operands.Pad, "copy",
                        lambda pad, t: copies.append(copy(pad, t)) or copies[-1])
    a = randn((3, 37), torch.float16, device)
    b = randn((48, 37), torch.float16, device).t()
    for _ in range(3):
        tg.mm(a, b)
    expected = "mm_tma_kernel" if kernel == "tma" else "mm_kernel"
    assert [name for name, _, _ in recorder.jit] == [expected]
    assert len(through_run_launch) == 1  # the first call only
    _expect_direct_launches_repeat_the_jit(recorder, 3, {})
    first = recorder.jit[0][2]
    pitch = operands.PAD_BYTES // 2
    assert first["a_ptr"].stride() == (pitch, 1) and first["b_ptr"].stride() == (1, pitch)
    made = {c.data_ptr(): c for c in copies}
    for _, _, _, passed in recorder.direct:
        assert passed["a_ptr"] != a.data_ptr() and passed["b_ptr"] != b.data_ptr()
        assert torch.equal(made[passed["a_ptr"]], a) and torch.equal(made[passed["b_ptr"]], b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_direct_launches_repeat_scaled_launches(recorder, device, recipe):
    a = randn((4, 64), torch.float16, device).to(torch.float8_e4m3fn)
    b = randn((32, 64), torch.float16, device).to(torch.float8_e4m3fn).t()
    if recipe == "tensorwise":
        scale_a, scale_b = torch.rand((), device=device), torch.rand((), device=device)
    else:
        scale_a, scale_b = torch.rand((4, 1), device=device), torch.rand((1, 32), device=device)
    for _ in range(3):
        tg.scaled_mm(a, b, scale_a, scale_b)
    _expect_direct_launches_repeat_the_jit(
        recorder, 3, {"a_ptr": a, "b_ptr": b, "sa_ptr": scale_a, "sb_ptr": scale_b})


def test_launch_hooks_send_calls_through_the_jit(recorder, device, monkeypatch):
    """Profilers' launch hooks are called by Triton's JIT path only: with hooks set, every call
    launches through it."""
    a = randn((3, 64), torch.float16, device)
    b = randn((64, 16), torch.float16, device)
    tg.mm(a, b)
    monkeypatch.setattr(launcher, "_launch_hooks_set", lambda: True)
    tg.mm(a, b)
    tg.mm(a, b)
    assert len(recorder.jit) == 3 and recorder.direct == []


def test_kept_tma_launches_prepare_host_descriptor_variants_until_settled(recorder, device,
                                                                          monkeypatch):
    """The persistent TMA kernel's kept eager launches (ops/graph_descriptors.py): each call
    goes through run_launch, which prepares the host-descriptor variant, until that is settled;
    then the direct path, until more variants are wanted (a new generation); a capture goes
    through run_launch, which launches the loaded variant, and leaves the kept state alone."""
    monkeypatch.setattr(operands._device, "supports_tma", lambda device: True)
    monkeypatch.setattr(mm_module, "plan_mm", lambda *args: tuning.MMPlan(
        "tma", tuning.TileConfig(16, 32, 32, 1, 4, 2)))
    monkeypatch.setattr(graph_descriptors, "GENERATION", 5)
    settled, prepared, captured = [False], [], []
    monkeypatch.setattr(graph_descriptors, "prepare",
                        lambda kernel, grid, args, meta, device: prepared.append(args[0])
                        or settled[0])
    monkeypatch.setattr(graph_descriptors, "launch_captured",
                        lambda kernel, grid, args, meta, device, stream:
                        captured.append((args[0], stream)) or True)
    a = randn((3, 64), torch.float16, device)
    b = randn((48, 64), torch.float16, device).t()

    def calls() -> tuple[int, int, int, int]:
        return len(recorder.jit), len(recorder.direct), len(prepared), len(captured)

    tg.mm(a, b)
    tg.mm(a, b)  # not settled: run_launch again (its kept compiled kernel), prepared again
    assert calls() == (1, 1, 2, 0) and recorder.jit[0][0] == "mm_tma_kernel"
    settled[0] = True
    tg.mm(a, b)  # settled now
    tg.mm(a, b)  # direct
    assert calls() == (1, 3, 3, 0)
    monkeypatch.setattr(graph_descriptors, "GENERATION", 6)  # more variants wanted
    tg.mm(a, b)
    tg.mm(a, b)
    assert calls() == (1, 5, 4, 0)
    monkeypatch.setattr(launcher, "_capturing", lambda: True)
    tg.mm(a, b)  # captured: the loaded host variant, nothing else launched
    assert calls() == (1, 5, 4, 1) and captured[0] == (a, _STREAM)
    monkeypatch.setattr(launcher, "_capturing", lambda: False)
    tg.mm(a, b)  # still settled at generation 6: direct
    assert calls() == (1, 6, 4, 1)


def test_c_launch_only_for_the_launcher_form_it_knows(monkeypatch):
    """The C function is called directly only for Triton 3.6's launcher form without scratch
    memory; other launchers (another signature, scratch buffers to allocate, another Triton
    release) are called as they are."""
    def c_launch(*args):  # type: ignore[no-untyped-def]
        return args

    known = _TritonLauncher(c_launch)
    monkeypatch.setattr(launcher, "_LAUNCHER_FORMS", {})
    monkeypatch.setattr(launcher, "_TRITON_3_6", False)
    assert launcher._c_launch(known, (1, 1, 1)) is None
    monkeypatch.setattr(launcher, "_LAUNCHER_FORMS", {})
    monkeypatch.setattr(launcher, "_TRITON_3_6", True)
    assert launcher._c_launch(known, (4, 2, 1)) == (c_launch, (False, True, None, None), 0)
    flagless = _TritonLauncher(c_launch)
    flagless.launch_pdl = None
    assert launcher._c_launch(flagless, (1, 1, 1)) is None
    scratch = _TritonLauncher(c_launch)
    scratch.global_scratch_size = 384  # three TMA descriptors per program
    assert launcher._c_launch(scratch, (132, 1, 1)) == (
        c_launch, (False, True, launcher._SCRATCH, None), 132 * 384)
    scratch.global_scratch_align = 1024  # more than torch's allocations promise
    assert launcher._c_launch(scratch, (132, 1, 1)) is None
    profiled = _TritonLauncher(c_launch)
    profiled.profile_scratch_size = 64
    assert launcher._c_launch(profiled, (1, 1, 1)) is None

    class Other(_TritonLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, metadata,  # type: ignore[no-untyped-def]
                     *args):
            raise AssertionError

    assert launcher._c_launch(Other(c_launch), (1, 1, 1)) is None
    assert launcher._c_launch(lambda *args: None, (1, 1, 1)) is None


def test_direct_tma_launches_get_the_shared_scratch_buffer(recorder, device, monkeypatch):
    """Kept launches of the persistent TMA kernel, whose device-side descriptors need global
    scratch memory, call Triton's C function too: with the address of the shared scratch
    buffer of the current stream, of the size Triton's launcher would have asked for (a slice
    per program), not through the launcher and its allocator. Launchers of other forms are
    called as they are (they allocate their own)."""
    recorder.scratch_size = 384
    monkeypatch.setattr(operands._device, "supports_tma", lambda device: True)
    monkeypatch.setattr(graph_descriptors, "prepare", lambda *args: True)
    monkeypatch.setattr(mm_module, "plan_mm", lambda *args: tuning.MMPlan(
        "tma", tuning.TileConfig(16, 32, 32, 1, 4, 2)))
    buffers: list[tuple[int, int, torch.Tensor]] = []

    def shared_scratch(size: int, stream: int) -> torch.Tensor:
        buffers.append((size, stream, torch.empty(size, dtype=torch.int8)))
        return buffers[-1][2]

    monkeypatch.setattr(launcher._device, "shared_scratch", shared_scratch)
    a = randn((3, 64), torch.float16, device)
    b = randn((48, 64), torch.float16, device).t()
    for _ in range(3):
        tg.mm(a, b)
    assert [name for name, _, _ in recorder.jit] == ["mm_tma_kernel"]
    _expect_direct_launches_repeat_the_jit(recorder, 3, {"a_ptr": a, "b_ptr": b})
    if not recorder.c_launcher:
        assert buffers == [] and recorder.scratch == []
        return
    programs = recorder.direct[0][1][0] * recorder.direct[0][1][1] * recorder.direct[0][1][2]
    assert [(size, stream) for size, stream, _ in buffers] == [(programs * 384, _STREAM)] * 2
    assert recorder.scratch == [buffer.data_ptr() for _, _, buffer in buffers]


@pytest.mark.skipif(not wgmma_fp8.AVAILABLE, reason="Gluon (Triton 3.5+)")
def test_blockwise_scale_a_by_tma_where_its_rows_are_contiguous(monkeypatch):
    """A blockwise launch of the precise fp8 kernel has its loader bring scale_a by TMA
    (SCALE_TMA) where the scales' rows are contiguous (stride (1, M): torch's layout) with
    16-byte aligned K blocks and one scale a row, and the plan leaves shared memory spare;
    not for K-contiguous scales, rows whose K blocks start off 16 bytes, an unaligned base,
    128-row blocks of a, nor a plan within FP8_SCALE_TMA_SPARE_BYTES of the limit."""
    from torch_triton_gemm import device as tgemm_device
    from torch_triton_gemm.ops.launcher import GemmScales

    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 232448)

    plan = tuning.MMPlan(tuning.FP8_PRECISE_KERNEL, tuning.TileConfig(192, 128, 64, 4, 4, 4))

    def scale_tma(m: int, k: int, scale_a: torch.Tensor, a_rows: int = 1) -> bool:
        a = torch.empty(m, k, dtype=torch.float8_e4m3fn)
        w = torch.empty(256, k, dtype=torch.float8_e4m3fn)
        out = torch.empty(m, 256, dtype=torch.bfloat16)
        scale_b = torch.ones(-(-k // 128), 2)
        scales = GemmScales("block", scale_a, scale_b, (*scale_a.stride(), *scale_b.stride()),
                            a_rows, 128)
        ((_, meta, _),) = launcher.prepare_launch(a, w.t(), None, out, "none", False, plan,
                                                  scales).launches
        return meta.get("SCALE_TMA", False)

    assert scale_tma(256, 1000, torch.ones(8, 256).t())  # M-major, a partial last K block
    assert scale_tma(16, 512, torch.ones(4, 16).t())
    assert not scale_tma(256, 1024, torch.ones(256, 8))  # K-contiguous
    assert not scale_tma(258, 1024, torch.ones(8, 258).t())  # 1032-byte K blocks
    assert not scale_tma(256, 1024, torch.ones(8 * 256 + 1)[1:].view(8, 256).t())
    assert not scale_tma(256, 1024, torch.ones(8, 2).t(), a_rows=128)
    needed = tuning._fp8_precise_shared(3, 4, 2) + tuning.FP8_SCALE_TMA_SPARE_BYTES
    for limit, expected in ((needed, True), (needed - 1, False)):
        monkeypatch.setattr(tgemm_device, "shared_memory_per_block",
                            lambda index, limit=limit: limit)
        assert scale_tma(256, 1024, torch.ones(8, 256).t()) == expected


@pytest.mark.skipif(not wgmma_fp8.AVAILABLE, reason="Gluon (Triton 3.5+)")
def test_warp_specialized_k_splits_launch_with_a_reduction():
    """A K-split plan of the warp-specialized kernel launches one persistent program per SM
    (at most one per unit) over tiles x splits units with SPLIT set and no bias (the
    reduction adds it), then splitk_reduce_kernel over the kernel's tiles (its order, a slot
    per unit); an unsplit plan neither splits nor reduces and takes the bias itself."""
    from torch_triton_gemm.kernels import wgmma_fp8

    a = torch.empty(100, 4096, dtype=torch.bfloat16)
    w = torch.empty(1000, 4096, dtype=torch.bfloat16)
    bias = torch.empty(1000, dtype=torch.bfloat16)
    out = torch.empty(100, 1000, dtype=torch.bfloat16)
    tile = tuning.WS_SPLIT_TILES[0]  # 64x128: 2 x 8 tiles
    prepared = launcher.prepare_launch(a, w.t(), bias, out, "none", False,
                                       tuning.MMPlan(tuning.WS_KERNEL, tile, 3), None)
    assert prepared.kernel is wgmma_fp8.ws_gemm_kernel
    ((grid, meta, runtime_args),) = prepared.launches
    splits, k_per_split = tuning.effective_split(4096, 64, 3)
    assert splits == 3 and grid == (min(launcher.num_sms(a.device), 16 * 3),)
    assert meta["SPLIT"] and meta["CONSUMERS"] == 1 and meta["BLOCK_N"] == 128
    params = wgmma_fp8.ws_gemm_kernel.arg_names[8:]
    named = dict(zip(params, runtime_args))
    assert (named["splits"], named["k_per_split"], named["HAS_BIAS"]) == (3, k_per_split, False)
    assert prepared.workspace_shape == (16 * 3, 64, 128)
    reduce_grid, reduce_args, reduce_meta = prepared.reduce
    assert (reduce_meta["SPLIT_K"], reduce_meta["TILE_M"], reduce_meta["TILE_N"],
            reduce_meta["GROUP_M"]) == (3, 64, 128, tile.group_m)
    assert reduce_args[:2] == (100, 1000) and reduce_args[5:7] == (0, True)  # first tile, bias
    whole = launcher.prepare_launch(a, w.t(), bias, out, "none", False,
                                    tuning.MMPlan(tuning.WS_KERNEL, tile), None)
    ((_, meta, runtime_args),) = whole.launches
    named = dict(zip(params, runtime_args))
    assert not meta["SPLIT"] and whole.reduce is None and whole.workspace_shape is None
    assert (named["splits"], named["k_per_split"], named["HAS_BIAS"]) == (1, 4096, True)
