"""Launch plans of tgemm::mm: each kernel (persistent TMA, portable) with and without split-K,
the heuristic, and tuned plans kept on disk.

Without a GPU every plan still runs, in Triton's interpreter (which implements TMA descriptors),
so CI checks the Hopper kernel's indexing, edges and split-K reduction on small sizes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from samples import FP8, make_operand, randn, reference, rel_error, tolerance

import torch_triton_gemm as tg
from torch_triton_gemm import plan_cache, plan_model, tuning
from torch_triton_gemm.kernels.matmul import mm_kernel
from torch_triton_gemm.ops import launcher, operands, planner
from torch_triton_gemm.ops.launcher import launch_mm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL_TILE = tuning.TileConfig(16, 32, 32, 1, 4, 2)
PLANS = {
    "portable": tuning.MMPlan("portable", SMALL_TILE),
    "portable-split3": tuning.MMPlan("portable", SMALL_TILE, split_k=3),
    "tma": tuning.MMPlan("tma", SMALL_TILE),
    "tma-split3": tuning.MMPlan("tma", SMALL_TILE, split_k=3),
    # The interpreter counts 4 SMs: outputs of more than 4 tiles run whole waves unsplit.
    "portable-tail-split3": tuning.MMPlan("portable", SMALL_TILE, split_k=3, split_tail=True),
    "tma-tail-split3": tuning.MMPlan("tma", SMALL_TILE, split_k=3, split_tail=True),
    # Splits that finish their own tiles (either kernel).
    "portable-split3-fixup": tuning.MMPlan("portable", SMALL_TILE, split_k=3, split_fixup=True),
    "portable-tail-split3-fixup": tuning.MMPlan("portable", SMALL_TILE, split_k=3,
                                                split_tail=True, split_fixup=True),
    "tma-split3-fixup": tuning.MMPlan("tma", SMALL_TILE, split_k=3, split_fixup=True),
    # Splits in one launch, each program adding its tile's (eager calls; portable kernel).
    "portable-tail-split3-inline": tuning.MMPlan("portable", SMALL_TILE, split_k=3,
                                                 split_tail=True, split_inline=True),
    # 128 columns: partial tiles go out in 64-column slices.
    "tma-wide-split3": tuning.MMPlan("tma", tuning.TileConfig(16, 128, 32, 1, 4, 2), split_k=3),
    "tma-subtile": tuning.MMPlan("tma", tuning.TileConfig(32, 32, 32, 1, 4, 2),
                                 epilogue_subtile=2),
    # Stream-K over the interpreter's 4 programs: the partial wave's tiles (below one wave:
    # every tile) shared by K steps; with stream_k=2 a whole wave more. 128 columns: partials
    # in 64-column slices, the epilogue's TMA stores in halves.
    "tma-stream-k": tuning.MMPlan("tma", SMALL_TILE, stream_k=1),
    "tma-stream-k2": tuning.MMPlan("tma", SMALL_TILE, stream_k=2),
    "tma-wide-stream-k": tuning.MMPlan("tma", tuning.TileConfig(16, 128, 32, 1, 4, 2),
                                       epilogue_subtile=2, stream_k=1),
}
# (M, N, K): edges in every dimension, a K that leaves a ragged last split, M = 1, N = 1.
SHAPES = [(37, 45, 104), (1, 40, 96), (20, 1, 64), (33, 64, 160)]


def _poisoned(m: int, n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _run(plan: tuning.MMPlan, a, b, bias=None, activation="none", out_dtype=None):
    out_dtype = out_dtype or (torch.bfloat16 if a.dtype in FP8 else a.dtype)
    out = _poisoned(a.shape[0], b.shape[1], out_dtype, a.device.type)
    launch_mm(a, b, bias, out, activation, traceable=False, plan=plan)
    return out


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float8_e4m3fn], ids=str)
def test_every_plan_matches_float64(device, plan, dtype, highest_fp32):
    """Layouts TMA can describe (row, col, nt) and ones it cannot (sliced, broadcast: the plan
    falls back to the portable kernel), with bias and activation."""
    for layout in ("row", "col", "nt", "sliced", "broadcast"):
        for m, n, k in SHAPES:
            a = make_operand(m, k, dtype, device, layout, "a")
            b = make_operand(k, n, dtype, device, layout, "b")
            bias = randn((n,), torch.bfloat16 if dtype in FP8 else dtype, device)
            # leaky_relu keeps every output's magnitude: a broadcast operand makes all of a row
            # equal, and gelu or silu of a large negative row would leave nothing to compare.
            out = _run(PLANS[plan], a, b, bias, "leaky_relu")
            ref = reference(a, b, bias, "leaky_relu")
            # Rounding errors scale with |a| @ |b| + |bias|, not with the result: broadcast
            # operands repeat one value, which can cancel to near zero.
            magnitude = reference(a.double().abs(), b.double().abs(),
                                  bias.double().abs()).norm() / ref.norm()
            budget = tolerance(out.dtype, dtype) * max(1.0, magnitude.item())
            assert rel_error(out, ref) <= budget, f"{layout} {m}x{n}x{k}"


@pytest.mark.parametrize("tile", [tuning.TileConfig(128, 64, 64, 1, 4, 2),
                                  tuning.TileConfig(16, 32, 128, 1, 4, 2)], ids=str)
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_remainders_of_k_in_short_steps_match_float64(device, split, dtype, tile, highest_fp32):
    """The portable kernel loads what is left of K (of the whole product or of a split) in
    masked steps: 128x64x64 tiles in steps of 16 (32 for 1-byte inputs), so remainders of one
    to four steps, 16x32x128 tiles in one BLOCK_K step; none (K a multiple of BLOCK_K) and K
    shorter than one step, with bias and activation."""
    plan = tuning.MMPlan("portable", tile, split_k=split)
    for m, n, k in ((9, 40, 8), (20, 33, 200), (17, 64, 695), (5, 31, 256), (3, 8, 127)):
        for layout in ("row", "col"):
            a = make_operand(m, k, dtype, device, layout, "a")
            b = make_operand(k, n, dtype, device, layout, "b")
            bias = randn((n,), torch.bfloat16 if dtype in FP8 else dtype, device)
            out = _run(plan, a, b, bias, "leaky_relu")
            ref = reference(a, b, bias, "leaky_relu")
            assert rel_error(out, ref) <= tolerance(out.dtype, dtype), f"{layout} {m}x{n}x{k}"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16], ids=str)
def test_plans_of_one_block_k_cut_k_alike_for_fp8(device, dtype):
    """fp8 tensor cores round within each dot, so a product's bits depend on how K is cut into
    steps, and eager and compiled calls pick different tiles (the symbolic plan's is 128 x 128,
    8 warps): fp8 plans that share BLOCK_K and the kind of MMA (Hopper's warpgroup MMA, which
    tiles of 64 rows a warpgroup or more run; smaller tiles run the warp-level MMA, which
    rounds otherwise) cut the remainder of K alike and agree bit for bit. 2-byte inputs, whose
    dots round only as fp32 does, cut it by tile size: they agree within rounding."""
    tiles = [tuning.TileConfig(block_m, block_n, 128, 1, warps, 2)
             for block_m, block_n, warps in ((64, 64, 4), (128, 64, 4), (128, 128, 8))]
    for m, n, k in ((37, 21, 70), (19, 40, 300), (130, 72, 200)):
        a = make_operand(m, k, dtype, device, "row", "a")
        b = make_operand(k, n, dtype, device, "col", "b")
        outs = [_run(tuning.MMPlan("portable", tile), a, b, out_dtype=torch.float32)
                for tile in tiles]
        ref = reference(a, b, None, "none")
        for out in outs:
            assert rel_error(out, ref) <= tolerance(torch.float32, dtype), f"{m}x{n}x{k}"
            if dtype in FP8:
                assert torch.equal(out, outs[0]), f"{m}x{n}x{k}"


@pytest.mark.parametrize("plan", ["portable-split3", "tma-split3", "portable-tail-split3",
                                  "tma-tail-split3", "tma-wide-split3", "tma-stream-k",
                                  "tma-stream-k2", "tma-wide-stream-k", "portable-split3-fixup",
                                  "portable-tail-split3-fixup", "tma-split3-fixup"])
def test_split_k_is_deterministic_and_applies_the_epilogue_once(device, plan):
    # 3 x 3 tiles of 16 x 32: the tail-split plans split 1 of them (the interpreter counts 4
    # SMs); 3 x 1 tiles of 16 x 128, whose partials go out in two column slices.
    # One 16 x 32 tile of two K steps: stream-K shares its 2 steps among the 4 programs, two
    # of which get none (the tile's finishing program must not wait for them).
    for m, n, k in ((40, 90, 200), (16, 32, 64)):
        a = randn((m, k), torch.float32, device)
        b = randn((k, n), torch.float32, device)
        bias = randn((n,), torch.float32, device)
        first = _run(PLANS[plan], a, b, bias, "relu", torch.float32)
        # relu(x + bias) applied per split and summed would differ from relu of the sum.
        assert rel_error(first, reference(a, b, bias, "relu")) <= 2e-3
        for _ in range(3):
            assert torch.equal(_run(PLANS[plan], a, b, bias, "relu", torch.float32), first)


@pytest.mark.parametrize("plan", ["portable-split3", "portable-tail-split3", "tma-split3",
                                  "tma-tail-split3", "tma-wide-split3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_splits_that_finish_their_tiles_match_the_reduction_bit_for_bit(device, plan, dtype,
                                                                        highest_fp32):
    """The last split of each tile adds the partials in split order, as the reduction kernel
    does: the same bits, one launch fewer, and the tile counters left at zero for the next
    call (which reuses them)."""
    reduced = PLANS[plan]
    fixed = dataclasses.replace(reduced, split_fixup=True)
    for m, n, k in ((40, 90, 200), (37, 45, 700), (1, 33, 96)):
        a, b = randn((m, k), dtype, device), randn((k, n), dtype, device)
        bias = randn((n,), dtype, device)
        out = a.new_empty((m, n))
        prepared = launcher.prepare_launch(a, b, bias, out, "gelu", False, fixed, None)
        by_reduction = launcher.prepare_launch(a, b, bias, out, "gelu", False, reduced, None)
        assert prepared.reduce is None and by_reduction.reduce is not None
        assert prepared.counters_shape is not None
        assert len(prepared.launches) == len(by_reduction.launches)
        assert prepared.launches[-1][1]["SPLIT_FIXUP"] and prepared.launches[-1][1]["SPLIT_K"] > 1
        want = _run(reduced, a, b, bias, "gelu")
        assert rel_error(want, reference(a, b, bias, "gelu")) <= tolerance(dtype, dtype)
        for _ in range(2):
            assert torch.equal(_run(fixed, a, b, bias, "gelu"), want)
            with tuning.force_plan(fixed):  # the public function, through the eager path
                assert torch.equal(tg.mm(a, b, bias, "gelu"), want)
        counters = launcher.split_counters(prepared.counters_shape[0], a.device, False)
        assert not counters.any()


@pytest.mark.parametrize("plan", ["portable-split3", "portable-tail-split3", "tma-split3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_splits_in_one_launch_match_the_reduction_bit_for_bit(device, plan, dtype,
                                                             highest_fp32):
    """split_inline: one launch whose programs add their tile's K splits in split order, as
    the reduction kernel adds the partials: the same bits with no workspace and no reduction
    (portable kernel; the TMA kernel launches as without it). K whose last split is short, the
    tail split's whole tiles beside split ones (the interpreter counts 4 SMs), an fp32
    output."""
    split = PLANS[plan]
    inline = dataclasses.replace(split, split_inline=True)
    for m, n, k in ((40, 90, 200), (37, 45, 700), (1, 33, 96), (80, 96, 130)):
        a, b = randn((m, k), dtype, device), randn((k, n), dtype, device)
        bias = randn((n,), dtype, device)
        out = a.new_empty((m, n))
        prepared = launcher.prepare_launch(a, b, bias, out, "gelu", False, inline, None)
        by_reduction = launcher.prepare_launch(a, b, bias, out, "gelu", False, split, None)
        if by_reduction.kernel is mm_kernel:  # (a TMA plan the interpreter runs portable)
            assert by_reduction.reduce is not None and by_reduction.workspace_shape is not None
            assert len(prepared.launches) == 1 and prepared.reduce is None
            assert prepared.workspace_shape is None
            assert prepared.launches[0][1]["SPLIT_INLINE"]
            assert prepared.launches[0][0] == (tuning.output_tiles(m, n, split.tile),)
        else:
            assert prepared.launches == by_reduction.launches
        for out_dtype in (None, torch.float32):
            want = _run(split, a, b, bias, "gelu", out_dtype)
            assert rel_error(want, reference(a, b, bias, "gelu")) <= tolerance(dtype, dtype)
            assert torch.equal(_run(inline, a, b, bias, "gelu", out_dtype), want)


# The GEMM kernels compiled for sm_90 without a GPU: a bf16 64x64x64 launch's constants, row-
# major A and B = W.t(); ``portable``: the portable kernel's own.
_HOPPER_MM_PREAMBLE = """
import re
from hopper_compile import compile_for
from torch_triton_gemm.kernels.matmul import mm_kernel, mm_tma_kernel

pointers = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16",
            "ws_ptr": "*fp32", "locks_ptr": "*i32", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
constants = dict(stride_ak=1, stride_bk=1, stride_cn=1, HAS_BIAS=False, ACTIVATION="none",
                 INPUT_PRECISION=None, UPCAST_TO_FP32=False, INDEX_64=False, SPLIT=False,
                 SCALING="none", SA_ROWS=1, SB_COLS=1, FAST_ACCUM=False, BLOCK_M=64,
                 BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_FIXUP=False, SPLIT_K=1, PDL=False,
                 C_ALIGN=1)
portable = dict(A_M_ALIGN=1, A_K_ALIGN=1, B_K_ALIGN=1, B_N_ALIGN=1, M_ALIGN=1, N_ALIGN=1,
                N_ODD=False)
"""

_FIXUP_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
constants.update(HAS_BIAS=True, ACTIVATION="gelu", SPLIT=True, SPLIT_FIXUP=True, SPLIT_K=4)
tma = dict(A_M_CONTIGUOUS=False, B_K_CONTIGUOUS=True, C_TMA=True, EPILOGUE_SUBTILE=1,
           STREAM_K=False, HOST_DESCRIPTORS=False, c_host_desc=None)
for kernel, extra in ((mm_kernel, portable), (mm_tma_kernel, dict(tma, WARP_SPECIALIZE=False)),
                      (mm_tma_kernel, dict(tma, WARP_SPECIALIZE=True))):
    compiled = compile_for(kernel, pointers, {**constants, **extra},
                           ["a_ptr", "b_ptr", "c_ptr"], num_warps=4, num_stages=4)
    lines = compiled.asm["ptx"].splitlines()
    counted = any("atom" in x and "acq_rel" in x and ".add" in x for x in lines)
    print(counted, any("bar.sync" in x for x in lines), any("mma" in x for x in lines))
"""


def test_splits_that_finish_their_tiles_compile_for_hopper():
    """The counter's acquire-release atomic and the barriers around it, in the sm_90 builds of
    the portable and the persistent TMA kernel (with and without warp specialization),
    compiled without a GPU."""
    from test_mm import _run_without_interpreter

    assert _run_without_interpreter(_FIXUP_COMPILE_SCRIPT).split() == ["True"] * 9


_INLINE_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
constants.update(HAS_BIAS=True, ACTIVATION="gelu")
portable.update(A_M_ALIGN=8, B_N_ALIGN=8)  # pitches of 8 elements: 16-byte rows
for inline in (False, True):
    compiled = compile_for(mm_kernel, pointers, {**constants, **portable, "SPLIT_INLINE": inline},
                           ["a_ptr", "b_ptr", "c_ptr"], num_warps=4, num_stages=4)
    ptx = compiled.asm["ptx"]
    print("mma" in ptx, "cp.async" in ptx)
"""


def test_splits_in_one_launch_compile_for_hopper():
    """The portable kernel with SPLIT_INLINE (its K loop inside a loop over the splits) builds
    for sm_90 with tensor-core MMAs and its loads software-pipelined (asynchronous copies), as
    without it; compiled without a GPU."""
    from test_mm import _run_without_interpreter

    assert _run_without_interpreter(_INLINE_COMPILE_SCRIPT).split() == ["True"] * 4


_PDL_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
from torch_triton_gemm.kernels.matmul import splitk_reduce_kernel

for pdl in (True, False):
    compiled = compile_for(mm_kernel, pointers, {**constants, **portable, "PDL": pdl},
                           ["a_ptr", "b_ptr", "c_ptr"], num_warps=4, num_stages=2,
                           launch_pdl=pdl)
    ptx = compiled.asm["ptx"]
    print(compiled.metadata.launch_pdl, "griddepcontrol.wait" in ptx,
          "griddepcontrol.launch_dependents" in ptx)
reduce = compile_for(splitk_reduce_kernel,
                     {"ws_ptr": "*fp32", "c_ptr": "*bf16", "bias_ptr": "*bf16"},
                     dict(HAS_BIAS=False, ACTIVATION="none", INDEX_64=False, SPLIT_K=3,
                          TILE_M=64, TILE_N=64, GROUP_M=8, BLOCK_M=32, BLOCK_N=64, PDL=True,
                          C_ALIGN=1),
                     ["ws_ptr", "c_ptr"], num_warps=4, launch_pdl=True)
ptx = reduce.asm["ptx"]
print(reduce.metadata.launch_pdl, "griddepcontrol.wait" in ptx,
      "griddepcontrol.launch_dependents" in ptx)
tma = dict(A_M_CONTIGUOUS=False, B_K_CONTIGUOUS=True, C_TMA=True, EPILOGUE_SUBTILE=1,
           STREAM_K=False, HOST_DESCRIPTORS=False, c_host_desc=None)
for warp_specialize in (False, True):
    for pdl in (True, False):
        compiled = compile_for(mm_tma_kernel, pointers,
                               {**constants, **tma, "WARP_SPECIALIZE": warp_specialize,
                                "PDL": pdl}, ["a_ptr", "b_ptr", "c_ptr"], num_warps=4,
                               num_stages=3, launch_pdl=pdl)
        ptx = compiled.asm["ptx"]
        print(compiled.metadata.launch_pdl, "griddepcontrol.wait" in ptx,
              "griddepcontrol.launch_dependents" in ptx)
"""


def test_dependent_launch_compiles_for_hopper():
    """The sm_90 builds with programmatic dependent launch wait for the kernel before and let
    the next one launch (griddepcontrol); the default builds do neither."""
    from test_mm import _run_without_interpreter

    lines = _run_without_interpreter(_PDL_COMPILE_SCRIPT).splitlines()
    # The portable kernel, the reduction, the persistent TMA kernel (plain, warp-specialized).
    assert lines == ["True True True", "False False False", "True True True"] + [
        "True True True", "False False False"] * 2


def test_dependent_launch_for_eager_single_waves_on_hopper(monkeypatch):
    monkeypatch.delenv("TORCH_TRITON_GEMM_PDL", raising=False)
    assert tuning.dependent_launch(132, 132, (9, 0))
    assert not tuning.dependent_launch(133, 132, (9, 0))  # a second wave
    assert not tuning.dependent_launch(1, 132, (8, 0))  # no griddepcontrol before sm_90
    assert not tuning.dependent_launch(1, 132, (0, 0))  # (the launcher's traced launches)
    monkeypatch.setenv("TORCH_TRITON_GEMM_PDL", "0")
    assert not tuning.dependent_launch(1, 132, (9, 0))
    plan = PLANS["portable"]
    meta = tuning.launch_meta(plan, False, pdl=True)
    assert meta["PDL"] and meta["launch_pdl"]
    # Passed either way (torch.compile's Triton kernel wrapper takes no parameter defaults).
    assert tuning.launch_meta(plan, False)["PDL"] is False
    assert "launch_pdl" not in tuning.launch_meta(plan, False)


@pytest.mark.gpu
def test_gpu_dependent_launches_read_what_the_kernel_before_wrote():
    """On an H100: single-wave eager launches (a plain tile, a split with its reduction or
    finishing its own tiles, the persistent TMA kernel's: split, stream-K, warp-specialized)
    use programmatic dependent launch, a launch of several waves does not; chains of products
    where each reads the one before's output, eager and replayed from a CUDA graph (after
    prepare_capture: the TMA launches' captures pass host-built descriptors), match float64
    references (a launch that read its input before the kernel before had finished would read
    stale or poisoned values)."""
    if launcher._device.capability(torch.device("cuda")) < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    w = randn((256, 256), torch.float16, "cuda") / 16
    cases = {"portable": (64, PLANS["portable"], True),  # 32 tiles
             "split": (64, PLANS["portable-split3"], True),  # 96 units and their reduction
             "waves": (512, tuning.MMPlan("portable", tuning.TileConfig(16, 16, 32, 1, 4, 2)),
                       False),  # 512 tiles
             "tma": (512, PLANS["tma"], True),  # 256 tiles, persistent
             "tma-split": (64, PLANS["tma-split3"], True),
             # Splits that finish their own tiles (counters the kernel resets), stream-K's
             # hand-over of partials, warp specialization.
             "portable-fixup": (64, PLANS["portable-split3-fixup"], True),
             "tma-fixup": (64, PLANS["tma-split3-fixup"], True),
             "tma-stream-k": (512, PLANS["tma-stream-k"], True),
             "tma-ws": (512, tuning.MMPlan("tma", tuning.TileConfig(128, 128, 64, 8, 8, 3),
                                           warp_specialize=True, epilogue_subtile=2), True)}
    for name, (rows, plan, single_wave) in cases.items():
        x = randn((rows, 256), torch.float16, "cuda")
        out = x.new_empty((rows, 256))
        prepared = launcher.prepare_launch(x, w, None, out, "none", False, plan, None)
        metas = [meta for _, meta, _ in prepared.launches]
        if prepared.reduce is not None:
            metas.append(prepared.reduce[2])
        assert all(bool(meta.get("PDL")) == single_wave for meta in metas), name

        def chain(x: torch.Tensor, plan: tuning.MMPlan = plan) -> torch.Tensor:
            with tuning.force_plan(plan):
                for _ in range(8):
                    x = tg.mm(x, w)
            return x

        expected = x.double()
        for _ in range(8):
            expected = expected @ w.double()
        assert rel_error(chain(x), expected) <= 2e-2, name
        static = x.clone()
        tg.prepare_capture(chain, static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = chain(static)
        fresh = randn((rows, 256), torch.float16, "cuda")
        static.copy_(fresh)
        graph.replay()
        expected = fresh.double()
        for _ in range(8):
            expected = expected @ w.double()
        assert rel_error(result, expected) <= 2e-2, name


def test_splits_past_the_fixup_limit_keep_the_reduction(device):
    many = tuning.FIXUP_MAX_SPLITS + 4
    plan = tuning.MMPlan("portable", SMALL_TILE, split_k=many, split_fixup=True)
    a, b = randn((20, 4 * many * 32), torch.float16, device), randn((4 * many * 32, 24),
                                                                   torch.float16, device)
    out = a.new_empty((20, 24))
    prepared = launcher.prepare_launch(a, b, None, out, "none", False, plan, None)
    assert prepared.reduce is not None and prepared.counters_shape is None
    assert not prepared.launches[-1][1]["SPLIT_FIXUP"]
    assert rel_error(_run(plan, a, b), reference(a, b)) <= 1e-2


def test_launch_buffers_are_kept_per_stream_and_fresh_when_traced_or_large(monkeypatch):
    monkeypatch.setattr(launcher, "_STREAM_BUFFERS", {})
    cpu = torch.device("cpu")
    kept = launcher.split_counters(8, cpu, False)
    assert launcher.split_counters(16, cpu, False) is kept and not kept.any()
    assert launcher.split_counters(8, cpu, True) is not kept  # traced launches: their own
    grown = launcher.split_counters(kept.numel() + 1, cpu, False)
    assert grown is not kept and grown.numel() > kept.numel() and not grown.any()
    # Workspaces: their own buffer, at least the size asked; fresh and shaped when traced or
    # past the limit.
    workspace = launcher.split_workspace((3, 16, 32), cpu, False)
    assert workspace.numel() >= 3 * 16 * 32 and workspace is not grown
    assert launcher.split_workspace((2, 16, 32), cpu, False) is workspace
    assert launcher.split_workspace((2, 16, 32), cpu, True).shape == (2, 16, 32)
    monkeypatch.setattr(launcher, "STREAM_BUFFER_LIMIT", 1024)
    large = launcher.split_workspace((2, 16, 32), cpu, False)
    assert large.shape == (2, 16, 32) and large is not workspace


def test_k_zero_on_a_split_plan_gives_the_epilogue_of_bias(device):
    a = randn((5, 0), torch.float16, device)
    b = randn((0, 7), torch.float16, device)
    bias = randn((7,), torch.float16, device)
    out = _run(PLANS["tma-split3"], a, b, bias, "silu")
    assert rel_error(out, reference(a, b, bias, "silu")) <= 1e-2


@pytest.mark.parametrize("m, n, k, split", [(30, 8, 1339, 6), (20, 8, 960, 1)])
def test_one_row_bands_of_16x16_tiles_cover_several_tile_rows(device, m, n, k, split):
    """The plan the model now picks for 17-32 rows against 8 columns: 16x16 tiles in one-row
    bands (GROUP_M = 1) over two tile rows, K split or not, odd K pitches included."""
    plan = tuning.MMPlan("portable", tuning.TileConfig(16, 16, 256, 1, 4, 4), split_k=split)
    a, b = randn((m, k), torch.float16, device), randn((n, k), torch.float16, device).t()
    with tuning.force_plan(plan):
        out = tg.mm(a, b)
    assert rel_error(out, reference(a, b, None, "none")) <= tolerance(torch.float16,
                                                                       torch.float16)


def test_force_plan_reaches_the_public_function(device):
    a = randn((9, 64), torch.float16, device)
    b = randn((64, 16), torch.float16, device)
    with tuning.force_plan(PLANS["tma-split3"]):
        out = tg.mm(a, b)
    assert tuning.forced_plan() is None
    assert rel_error(out, reference(a, b)) <= 1e-2


@pytest.mark.parametrize("plan", ["tma", "portable-split3"])
@pytest.mark.parametrize("layout", ["row", "col", "nt", "sliced", "broadcast"])
def test_operands_tma_cannot_describe_are_copied_padded_for_large_products(device, layout, plan,
                                                                            monkeypatch):
    """Row pitches of 37 and 45 bf16 elements (74 and 90 bytes: not multiples of 16), sliced
    views with unaligned bases, stride-0 broadcasts: above PAD_MIN_SIZE the heuristic's TMA
    plan runs on padded copies (the sizes here are CI-sized: the threshold is lowered), with
    the bias, the activation and the gradients right."""
    monkeypatch.setattr(operands._device, "supports_tma", lambda device: True)
    monkeypatch.setattr(operands, "PAD_MIN_SIZE", 0)
    monkeypatch.setattr(operands, "PAD_MIN_SIDE", 0)
    monkeypatch.setattr(tuning, "heuristic_mm_plan", lambda *args, **kwargs: PLANS[plan])
    # On a GPU the plan model plans 16-bit products; this test is about the heuristic's plans.
    monkeypatch.setattr(planner.plan_model, "modelled_plan", lambda *args, **kwargs: None)
    monkeypatch.setattr(planner, "_PLANS", {})
    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    a = make_operand(33, 37, torch.bfloat16, device, layout, "a").requires_grad_()
    b = make_operand(37, 45, torch.bfloat16, device, layout, "b").requires_grad_()
    bias = randn((45,), torch.bfloat16, device)
    out = a.new_empty((33, 45))
    chosen = planner.plan_mm(a.detach(), b.detach(), bias, out, "leaky_relu", False)
    prepared = launcher.prepare_launch(a.detach(), b.detach(), bias, out, "leaky_relu", False,
                                       chosen, None)
    kernel = launcher.mm_tma_kernel if plan == "tma" else launcher.mm_kernel
    assert prepared.kernel is kernel and prepared.pads is not None
    result = tg.mm(a, b, bias, "leaky_relu")
    ref = reference(a.detach(), b.detach(), bias, "leaky_relu")
    assert rel_error(result, ref) <= 1e-2
    # A repeated call copies again (on a GPU: launched directly) and gives the same bits.
    assert torch.equal(tg.mm(a, b, bias, "leaky_relu"), result)
    grad = randn(result.shape, torch.bfloat16, device)
    result.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    torch.nn.functional.leaky_relu(a64 @ b64 + bias.double()).backward(grad.double())
    assert rel_error(a.grad, a64.grad) <= 1e-2 and rel_error(b.grad, b64.grad) <= 1e-2


def test_small_products_and_forced_plans_read_unaligned_operands_in_place(device, monkeypatch):
    monkeypatch.setattr(operands._device, "supports_tma", lambda device: True)
    a = randn((33, 37), torch.bfloat16, device)
    b = randn((45, 37), torch.bfloat16, device).t()
    out = a.new_empty((33, 45))
    chosen = planner.plan_mm(a, b, None, out, "none", False)
    small = launcher.prepare_launch(a, b, None, out, "none", False, chosen, None)
    forced = launcher.prepare_launch(a, b, None, out, "none", False, PLANS["tma"], None)
    assert small.pads is None and forced.pads is None and forced.kernel is launcher.mm_kernel


# --- plan arithmetic ------------------------------------------------------------------------------

@pytest.mark.parametrize("k, block_k, asked, expected", [
    (4096, 64, 4, (4, 1024)),
    (4096, 64, 1, (1, 4096)),
    (100, 64, 4, (2, 64)),      # only two BLOCK_K steps: no empty splits
    (64, 64, 8, (1, 64)),
    (1000, 64, 3, (3, 384)),    # ragged last split: 384 + 384 + 232
])
def test_effective_split(k, block_k, asked, expected):
    assert tuning.effective_split(k, block_k, asked) == expected


@pytest.mark.parametrize("k, split_k, whole_stages, split_stages", [
    (20, 1, 1, None),     # one K step: unpipelined
    (64, 1, 2, None),     # two steps: two buffers, not the tile's four
    (1024, 1, 4, None),   # enough steps: the tile's depth
    (32 * 24, 8, None, 3),  # 24 steps split 8 ways: 3 per split
])
def test_portable_pipeline_is_no_deeper_than_each_programs_k_loop(k, split_k, whole_stages,
                                                                  split_stages, device):
    tile = tuning.TileConfig(16, 32, 32, 1, 4, 4)
    plan = tuning.MMPlan("portable", tile, split_k=split_k)
    a, b = randn((20, k), torch.float16, device), randn((k, 24), torch.float16, device)
    prepared = launcher.prepare_launch(a, b, None, a.new_empty((20, 24)), "none", False, plan,
                                       None)
    stages = [meta["num_stages"] for _, meta, _ in prepared.launches]
    assert stages == [s for s in (whole_stages, split_stages) if s is not None]
    assert rel_error(_run(plan, a, b), reference(a, b)) <= 1e-2
    assert [tuning.pipeline_stages(4, steps) for steps in (0, 1, 3, 9)] == [1, 1, 3, 4]


def test_heuristic_splits_k_only_when_the_output_cannot_fill_the_gpu(monkeypatch):
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    decode = tuning.heuristic_mm_plan(16, 4096, 4096, 2, True, 132)
    assert decode.split_k > 1
    units = -(-16 // decode.tile.block_m) * -(-4096 // decode.tile.block_n) * decode.split_k
    assert units >= 0.9 * 132
    large = tuning.heuristic_mm_plan(8192, 8192, 8192, 2, True, 132)
    assert large.split_k == 1 and large.tile.block_m * large.tile.block_n >= 128 * 256
    deep = tuning.heuristic_mm_plan(128, 128, 32768, 2, False, 132)
    assert deep.kernel == "portable" and deep.split_k > 1
    assert tuning.heuristic_mm_plan(8192, 8192, 128, 2, True, 132).split_k == 1


@pytest.mark.parametrize("m, n, k", [(0, 8, 8), (8, 0, 8), (8, 8, 0), (0, 0, 0), (4096, 0, 4096),
                                     (0, 4096, 4096), (100, 0, 5)])
def test_gpu_planners_plan_empty_products(monkeypatch, m, n, k):
    """Empty outputs launch nothing, but planning them must not fail (an H100 divided by the
    zero tiles of an empty output)."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)
    for tma in (True, False):
        assert tuning.heuristic_mm_plan(m, n, k, 2, tma, 132).split_k >= 1
        plan = plan_model.modelled_plan(m, n, k, 2, 2, tma, 132, True, False)
        assert plan is None or plan.split_k >= 1


def test_tuned_plans_round_trip_through_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRITON_GEMM_CACHE_DIR", str(tmp_path))
    plan = tuning.MMPlan("tma", tuning.TileConfig(128, 256, 64, 8, 8, 3), 2, True, 2)
    key = plan_cache.plan_key(100, 4096, 4096, torch.bfloat16, 1, True)
    dev = torch.device("cpu")
    plan_cache.TunedPlans().put(dev, key, plan)
    path = plan_cache.cache_path(dev)
    assert path.parent == tmp_path and json.loads(path.read_text())[key]["split_k"] == 2
    assert plan_cache.TunedPlans().get(dev, key) == plan
    # Same bucket, another size: the same tuned plan.
    assert key == plan_cache.plan_key(128, 4096, 4096, torch.bfloat16, 1, True)


def test_candidates_start_with_the_heuristic_and_respect_shared_memory(monkeypatch):
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    plans = list(tuning.candidate_plans(512, 4096, 4096, 2, True, 132))
    assert plans[0] == tuning.heuristic_mm_plan(512, 4096, 4096, 2, True, 132)
    assert len(plans) == len(set(plans)) > 4
    limit = tuning._device.shared_memory_per_block(0)
    assert all(tuning.shared_memory_bytes(p.tile, 2) <= limit for p in plans)
    assert {p.kernel for p in plans} == {"tma", "portable"}
    # Skinny products split K, also with splits that finish their own tiles.
    skinny = list(tuning.candidate_plans(16, 4096, 4096, 2, True, 132))
    fixups = [p for p in skinny if p.split_fixup]
    assert fixups and all(p.kernel in ("portable", "tma") and p.split_k > 1 for p in fixups)
    assert {dataclasses.replace(p, split_fixup=False) for p in fixups} <= set(skinny)


# --- GPU only -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn], ids=str)
def test_heuristic_plans_on_gpu_shape_classes(dtype, highest_fp32):
    """Decode, skinny, deep-K, shallow-K, odd and large shapes, nn.Linear's layout and both
    row-major and both column-major, through whatever plan the heuristic picks."""
    shapes = [(1, 4096, 4096), (16, 6144, 4096), (64, 1024, 4096), (256, 2048, 1024),
              (128, 128, 16384), (2048, 2048, 64), (999, 1003, 1007), (1024, 1024, 1024)]
    for m, n, k in shapes:
        for layout in ("nt", "row", "col"):
            a = make_operand(m, k, dtype, "cuda", layout, "a")
            b = make_operand(k, n, dtype, "cuda", layout, "b")
            bias = randn((n,), torch.bfloat16 if dtype in FP8 else dtype, "cuda")
            out = tg.mm(a, b, bias, "relu")
            assert rel_error(out, reference(a, b, bias, "relu")) <= tolerance(out.dtype, dtype), \
                f"{layout} {m}x{n}x{k}"


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["tma", "tma-split", "tma-ws"])
def test_compiled_tma_plan_matches_eager(plan):
    """Numbers, not just opcheck: TMA descriptors once gave NaN under torch.compile only."""
    tile = tuning.TileConfig(128, 128, 64, 8, 8, 3)
    chosen = {"tma": tuning.MMPlan("tma", tile, epilogue_subtile=2),
              "tma-split": tuning.MMPlan("tma", tile, split_k=4),
              "tma-ws": tuning.MMPlan("tma", tile, warp_specialize=True,
                                      epilogue_subtile=2)}[plan]
    x = randn((300, 512), torch.bfloat16, "cuda")
    w = randn((384, 512), torch.bfloat16, "cuda")
    bias = randn((384,), torch.bfloat16, "cuda")

    def f(x, w, bias):
        return tg.mm(x, w.t(), bias, "gelu") * 2

    torch._dynamo.reset()
    with tuning.force_plan(chosen):
        eager = f(x, w, bias)
        compiled = torch.compile(f, fullgraph=True)(x, w, bias)
    assert rel_error(eager, reference(x, w.t(), bias, "gelu") * 2) <= 1e-2
    assert torch.isfinite(compiled).all()
    # Eager launches the TMA kernel's host-descriptor variant, traced ones its device-descriptor
    # variant (another compiled kernel): fp32 rounding may differ where the sum before the
    # activation cancels to nearly zero, so the bound is on the output's scale (1e-5 absolute
    # once failed at one element of 115200, 1.1e-5 off).
    torch.testing.assert_close(compiled, eager, rtol=1.6e-2, atol=1e-4 * eager.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["tma", "portable"])
def test_tail_split_on_gpu_matches_float64_and_compiles_to_the_same_bits(kernel):
    """More tiles than SMs: whole waves unsplit, the last wave's tiles split along K (two
    launches and the reduction), eager and under torch.compile."""
    from torch_triton_gemm.device import num_sms

    plan = tuning.MMPlan(kernel, tuning.TileConfig(128, 128, 64, 8, 8, 4), split_k=3,
                         split_tail=True, epilogue_subtile=2 if kernel == "tma" else 1)
    sms = num_sms(torch.device("cuda"))
    m = 128 * (sms // 8 + 1) - 37  # (sms // 8 + 1) x 8 tiles: one whole wave and a tail
    x = randn((m, 1024), torch.bfloat16, "cuda")
    w = randn((8 * 128 - 5, 1024), torch.bfloat16, "cuda")
    bias = randn((w.shape[0],), torch.bfloat16, "cuda")

    def f(x, w, bias):
        return tg.mm(x, w.t(), bias, "silu")

    torch._dynamo.reset()
    with tuning.force_plan(plan):
        eager = f(x, w, bias)
        again = f(x, w, bias)
        compiled = torch.compile(f, fullgraph=True)(x, w, bias)
    assert rel_error(eager, reference(x, w.t(), bias, "silu")) <= 1e-2
    assert torch.equal(eager, again)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.gpu
def test_split_k_in_a_cuda_graph_is_deterministic():
    x = randn((16, 4096), torch.bfloat16, "cuda")
    w = randn((4096, 4096), torch.bfloat16, "cuda")
    tg.mm(x, w.t())  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.mm(x, w.t())
    x.copy_(randn((16, 4096), torch.bfloat16, "cuda"))
    graph.replay()
    first = out.clone()
    assert rel_error(first, reference(x, w.t())) <= 1e-2
    for _ in range(5):
        graph.replay()
        assert torch.equal(out, first)


@pytest.mark.gpu
def test_split_fixup_in_a_cuda_graph_beside_eager_calls():
    """A captured fix-up launch (its own counters and workspace, zeroed inside the graph)
    replayed between eager launches of the same plan on the same stream (which take the
    stream's kept buffers): every result right and the same bits each time."""
    plan = tuning.MMPlan("portable", tuning.TileConfig(16, 64, 128, 1, 4, 4), split_k=8,
                         split_fixup=True)
    x, w = randn((16, 4096), torch.bfloat16, "cuda"), randn((512, 4096), torch.bfloat16, "cuda")
    y = randn((16, 4096), torch.bfloat16, "cuda")
    with tuning.force_plan(plan):
        eager = tg.mm(y, w.t())  # compiles outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tg.mm(x, w.t())
        graph.replay()
        first = captured.clone()
        assert rel_error(first, reference(x, w.t())) <= 1e-2
        for _ in range(5):
            again = tg.mm(y, w.t())
            graph.replay()
            assert torch.equal(again, eager) and torch.equal(captured, first)
    assert rel_error(eager, reference(y, w.t())) <= 1e-2


def _compiled_variants(kernel) -> int:  # type: ignore[no-untyped-def]
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.gpu
def test_a_serving_loop_over_every_batch_size_does_not_compile_per_size():
    from torch_triton_gemm.kernels import matmul

    kernels = (matmul.mm_kernel, matmul.mm_tma_kernel, matmul.splitk_reduce_kernel)
    before = sum(_compiled_variants(k) for k in kernels)  # other tests' compiles
    w = randn((1024, 512), torch.bfloat16, "cuda")
    for m in range(1, 300):
        x = randn((m, 512), torch.bfloat16, "cuda")
        out = tg.mm(x, w.t())
    assert rel_error(out, reference(x, w.t())) <= 1e-2
    compiled = sum(_compiled_variants(k) for k in kernels) - before
    # One kernel per plan the heuristic picks across the size classes, not one per size.
    assert compiled <= 30


@pytest.mark.gpu
def test_a_second_process_reuses_tuned_plans_without_tuning(tmp_path):
    env = dict(os.environ, TORCH_TRITON_GEMM_CACHE_DIR=str(tmp_path))
    script = textwrap.dedent("""
        import sys, torch, torch_triton_gemm as tg
        from torch_triton_gemm import plan_cache, tune
        a = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16).t()
        key = plan_cache.plan_key(48, 256, 512, torch.bfloat16, 3, True)
        if sys.argv[1] == "tune":
            best, timings = tune.tune_mm(a, b, rep_ms=5)
            assert len(timings) > 3
            print(best)
        else:
            calls = []
            tune.tune_mm = lambda *a, **k: calls.append(1)
            plan = plan_cache.TUNED.get(torch.device("cuda"), key)
            assert plan is not None
            out = tg.mm(a, b)
            assert calls == [] and torch.isfinite(out).all()
            print(plan)
    """)
    first = subprocess.run([sys.executable, "-c", script, "tune"], cwd=REPO, env=env,
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, "-c", script, "use"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout


def test_eager_launches_memoised_per_signature_stay_right(device):
    """Eager calls reuse checks and launch arithmetic per call signature: fresh values, another
    alignment, another size and bad input after a good call all still give the right answer."""
    w = randn((48, 40), torch.float16, device)
    for _ in range(3):
        x = randn((21, 40), torch.float16, device)
        assert rel_error(tg.mm(x, w.t()), reference(x, w.t())) <= 1e-2
    storage = randn((22 * 40 + 1,), torch.float16, device)
    shifted = storage[1:].view(22, 40)[:21]  # same shape and strides, 2-byte aligned
    assert rel_error(tg.mm(shifted, w.t()), reference(shifted, w.t())) <= 1e-2
    x = randn((5, 40), torch.float16, device)
    assert rel_error(tg.mm(x, w.t(), None, "relu"), reference(x, w.t(), None, "relu")) <= 1e-2
    for _ in range(2):
        with pytest.raises(RuntimeError, match="columns but b has"):
            tg.mm(randn((21, 41), torch.float16, device), w.t())
    assert len(launcher._EAGER_LAUNCHES) >= 3


def test_tma_allocator_reaches_threads_that_never_set_one():
    """Autograd runs backward kernels on its own threads: Triton's allocator for device-side
    TMA descriptors must be there too, not only in the thread that first launched."""
    import threading

    from triton.runtime import _allocation

    from torch_triton_gemm import device as tgemm_device

    tgemm_device.install_tma_allocator()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_allocation._allocator.get()))
    thread.start()
    thread.join()
    assert seen == [tgemm_device._allocate_scratch]


def test_tma_scratch_sharing_rule(monkeypatch):
    """Which launches share the per-stream descriptor scratch buffer, with the CUDA calls
    stubbed: tgemm's eager launches (inside SHARED_SCRATCH) on one device and stream, grown on
    demand; not other launches, other streams or CUDA graph captures."""
    from torch_triton_gemm import device as tgemm_device

    capturing = [False]
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0],
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda size, device=None, dtype=None: empty(size,
                                                                                    dtype=dtype))
    monkeypatch.setattr(tgemm_device, "_SCRATCH_BUFFERS", {})
    allocate = tgemm_device._allocate_scratch
    assert allocate(64, 128, 7) is not allocate(64, 128, 7)
    with tgemm_device.SHARED_SCRATCH:
        first = allocate(64, 128, 7)
        assert allocate(32, 128, 7) is first
        grown = allocate(256, 128, 7)
        assert grown is not first and grown.numel() >= 256
        assert allocate(64, 128, 7) is grown
        assert allocate(64, 128, 8) is not grown
        capturing[0] = True
        assert allocate(64, 128, 7) is not grown
        capturing[0] = False
    assert allocate(64, 128, 7) is not grown


@pytest.mark.gpu
def test_tma_scratch_is_shared_per_stream_and_fresh_in_graph_captures():
    """Eager launches on one stream take one descriptor scratch buffer (kernels on a stream run
    one after another); another stream has its own, and a launch captured into a CUDA graph gets
    one from the graph's pool, since the graph may replay alongside eager work."""
    from torch_triton_gemm import device as tgemm_device

    main = torch.cuda.current_stream()
    with tgemm_device.SHARED_SCRATCH:
        first = tgemm_device._allocate_scratch(1024, 128, main.cuda_stream)
        assert tgemm_device._allocate_scratch(512, 128, main.cuda_stream).data_ptr() == \
            first.data_ptr()
        grown = tgemm_device._allocate_scratch(1 << 20, 128, main.cuda_stream)
        assert grown.numel() >= 1 << 20
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            other = tgemm_device._allocate_scratch(1024, 128, side.cuda_stream)
        assert other.data_ptr() != grown.data_ptr()
    assert tgemm_device._allocate_scratch(1024, 128, main.cuda_stream).data_ptr() != \
        grown.data_ptr()  # launches outside tgemm's eager path get their own

    # A TMA product replayed on a side stream while eager TMA products run on the main stream.
    plan = tuning.MMPlan("tma", tuning.TileConfig(128, 128, 64, 8, 4, 3))
    x, w = randn((1024, 512), torch.bfloat16, "cuda"), randn((768, 512), torch.bfloat16, "cuda")
    y, v = randn((1024, 512), torch.bfloat16, "cuda"), randn((640, 512), torch.bfloat16, "cuda")
    with tuning.force_plan(plan):
        tg.mm(x, w.t())  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tg.mm(x, w.t())
        side.wait_stream(main)
        for _ in range(5):
            with torch.cuda.stream(side):
                graph.replay()
            eager = tg.mm(y, v.t())
            assert rel_error(eager, reference(y, v.t())) <= 1e-2
        main.wait_stream(side)
    assert rel_error(captured, reference(x, w.t())) <= 1e-2


def test_scaled_plans_keep_k_steps_inside_scale_blocks_and_deepen_precise_ones(monkeypatch):
    """Any plan is made valid for a recipe (blockwise K steps inside one scale block); the
    heuristic picks the recipe's plan: 64x128 tiles two per SM for blockwise, split 64-wide
    tiles for blockwise products of few rows and tiles, 128x128 tiles with 256-deep K steps for
    precise rowwise / tensorwise, its fp8 plan for fast accumulation."""
    skinny = tuning.MMPlan("portable", tuning.TileConfig(16, 128, 256, 1, 4, 4), 4)
    assert tuning.scaled_plan(skinny, "block").tile.block_k == 128
    assert tuning.scaled_plan(skinny, "outer") == skinny
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)

    def plan(scaling, fast=False, m=8192):
        return tuning.heuristic_mm_plan(m, 8192, 8192, 1, True, 132, 2, scaling=scaling,
                                        fast_accum=fast)

    fast = plan("outer", fast=True)
    assert (fast.tile.block_m, fast.tile.block_n, fast.tile.block_k) == (128, 256, 128)
    assert plan("none") == fast
    deep = plan("outer")
    assert (deep.tile.block_m, deep.tile.block_n, deep.tile.block_k) == (128, 128, 256)
    assert deep.split_k == 1 and deep.epilogue_subtile == 2
    blocked = plan("block")
    assert (blocked.tile.block_m, blocked.tile.block_n, blocked.tile.block_k) == (64, 128, 128)
    assert blocked.programs_per_sm == 2 and blocked.split_k == 1
    # Blockwise, few rows: 64-wide tiles of one scale block's K, split to about three waves
    # (128 tiles: 3 x 132 // 128 = 3 splits), unless the tiles fill the SMs.
    for m, n, rows in ((16, 8192, 16), (100, 4096, 64)):
        small = tuning.heuristic_mm_plan(m, n, 8192, 1, True, 132, 2, scaling="block")
        assert (small.kernel, small.tile.block_m, small.tile.block_n, small.tile.block_k,
                small.split_k) == ("portable", rows, 64, 128, 3)
    wide = tuning.heuristic_mm_plan(16, 28672, 4096, 1, True, 132, 2, scaling="block")
    assert wide == tuning.heuristic_mm_plan(16, 28672, 4096, 1, True, 132, 2)
    # Tensorwise / rowwise, 33-256 rows: 64x64 portable tiles while they fill at most 3.5
    # waves; 256-deep steps (K split to fill the SMs) up to one wave, 128-deep and 5 stages
    # beyond. Not where 256+ rows have a wave of 128x128 TMA tiles, nor with more tiles.
    def outer(m, n, k, fast=False):
        p = tuning.heuristic_mm_plan(m, n, k, 1, True, 132, 2, scaling="outer", fast_accum=fast)
        return p.kernel, p.tile.block_m, p.tile.block_n, p.tile.block_k, p.tile.num_stages, \
            p.split_k
    assert outer(128, 4096, 4096) == ("portable", 64, 64, 256, 4, 1)  # 128 tiles
    assert outer(64, 4096, 4096) == ("portable", 64, 64, 256, 4, 2)  # 64 tiles: split
    assert outer(64, 28672, 4096, True) == ("portable", 64, 64, 128, 5, 1)  # 448 tiles
    assert outer(256, 4096, 14336) == ("portable", 64, 64, 128, 5, 1)
    assert outer(256, 6144, 4096)[:2] == ("tma", 128)  # 96 TMA tiles of 128x128
    assert outer(128, 28672, 4096, True)[:2] == ("tma", 128)  # 896 narrow tiles
    assert outer(32, 4096, 4096) == outer(32, 4096, 4096, True)
    # Below two waves of 128x256 tiles, 128x128 ones with 4 warps where their last wave is
    # fuller by 0.1: 384 tiles in 2.9 waves against 192 in 1.45; not where both fill alike,
    # nor from two waves on (M = 512 x 28672: 448 tiles in 3.4 waves, 896 in 6.8).
    assert outer(1024, 6144, 4096, True)[:3] == ("tma", 128, 128)
    assert tuning.heuristic_mm_plan(1024, 6144, 4096, 1, True, 132, 2, scaling="outer",
                                    fast_accum=True).tile.num_warps == 4
    assert tuning.heuristic_mm_plan(1024, 6144, 4096, 2, True, 132, 2).tile.block_n == 256
    assert outer(256, 28672, 4096, True)[:3] == ("tma", 128, 256)  # 224 and 448 tiles
    assert outer(2048, 6144, 4096, True)[:3] == ("tma", 128, 256)
    assert outer(512, 28672, 4096, True)[:3] == ("tma", 128, 256)
    # Precise products the Gluon kernel does not take keep the deep-step plan there.
    assert outer(1024, 6144, 4096)[:4] == ("tma", 128, 128, 256)
    assert outer(32, 4096, 4096)[1] == 32  # decode rows keep their tiles
    # Tensorwise / rowwise, 2-16 rows: 16-row tiles unsplit, the widest of 128, 64 and 32
    # columns whose tiles number 0.55 of the SMs; else (and at one row) the K-split rule.
    assert outer(16, 4096, 4096) == ("portable", 16, 32, 256, 6, 1)  # 128 tiles
    assert outer(2, 6144, 4096, True) == ("portable", 16, 64, 256, 6, 1)  # 96 tiles
    assert outer(8, 28672, 4096) == ("portable", 16, 128, 256, 4, 1)
    split_rule = tuning.heuristic_mm_plan(1, 4096, 4096, 1, True, 132, 2)
    assert split_rule.split_k > 1
    assert tuning.heuristic_mm_plan(1, 4096, 4096, 1, True, 132, 2, scaling="outer") == split_rule
    narrow = tuning.heuristic_mm_plan(16, 2048, 4096, 1, True, 132, 2)  # 64 tiles of 32
    assert narrow.split_k > 1
    assert tuning.heuristic_mm_plan(16, 2048, 4096, 1, True, 132, 2, scaling="outer") == narrow


@pytest.mark.parametrize("layout", ["nt", "row", "col", "sliced", "broadcast"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_transposed_plans_of_16_bit_products(device, layout, split_k):
    """A transposed plan (swap_ab) forced on tgemm.mm: the kernel computes C^T = B^T A^T on the
    same memory, for any operand layout, whole or split into K splits, with an activation,
    forward and the backward's products, against float64; a bias is refused."""
    plan = tuning.MMPlan("portable", tuning.TileConfig(32, 16, 32, 8, 4, 2), split_k=split_k,
                         swap_ab=True)
    a = make_operand(13, 100, torch.float16, device, layout, "a").requires_grad_()
    b = make_operand(100, 40, torch.float16, device, layout, "b").requires_grad_()
    with tuning.force_plan(plan):
        out = tg.mm(a, b, None, "relu")
        assert out.shape == (13, 40) and out.stride() == (40, 1)
        assert rel_error(out, reference(a.detach(), b.detach(), None, "relu")) <= 1e-2
        grad = randn(out.shape, torch.float16, device)
        out.backward(grad)
        with pytest.raises(RuntimeError, match="swap_ab"):
            tg.mm(a.detach(), b.detach(), randn((40,), torch.float16, device))
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    torch.relu(a64 @ b64).backward(grad.double())
    assert rel_error(a.grad, a64.grad) <= 1e-2 and rel_error(b.grad, b64.grad) <= 1e-2


# DRAM bandwidths (GB/s) of an H100 SXM and an H200.
H100_GBPS, H200_GBPS = 3352.32, 4814.3


def test_products_of_few_rows_run_transposed(monkeypatch):
    """Tensorwise / rowwise fp8 and 16-bit products of 2-32 rows whose weight rows make 0.45
    (at most 16 rows: fp8 0.3, 16-bit 0.35) to one wave of 64-row tiles, or (4 rows and more;
    16-bit at most 16; K a multiple of 128; GPUs with an H200's bandwidth per SM, not an
    H100's) two waves and more, K at least 2048 (within a wave 16-bit from 256, fp8 from 1024
    but from 2048 at 16 rows): transposed 64x16
    tiles (64x32 above 16 rows) on the portable kernel, 256-byte K steps in 6 stages within a
    wave (64-deep below K 1024) and 128-deep in 4 from two waves (fewer stages where shared
    memory is smaller); not at one row nor at 1-2 waves, nor for fp32. Tuned plans are never
    transposed."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)

    def swap(m, n, k, size=1, dram_gbps=H200_GBPS):
        p = tuning.swap_plan(m, n, k, size, 132, dram_gbps)
        return p and (p.kernel, p.swap_ab, p.tile.block_m, p.tile.block_n, p.tile.block_k,
                      p.tile.num_stages, p.split_k)

    assert swap(16, 6144, 4096) == ("portable", True, 64, 16, 256, 6, 1)  # 96 tiles
    assert swap(2, 4096, 14336) == ("portable", True, 64, 16, 256, 6, 1)  # 64 tiles
    assert swap(8, 8448, 4096) == ("portable", True, 64, 16, 256, 6, 1)  # 132 tiles
    assert swap(32, 4096, 4096) == ("portable", True, 64, 32, 256, 6, 1)
    assert swap(17, 6144, 4096, 2) == ("portable", True, 64, 32, 128, 6, 1)
    assert swap(2, 6144, 4096, 2) == ("portable", True, 64, 16, 128, 6, 1)
    assert swap(16, 28672, 4096) == ("portable", True, 64, 16, 128, 4, 1)  # 448 tiles
    assert swap(32, 28672, 4096) == ("portable", True, 64, 32, 128, 4, 1)
    assert swap(4, 16896, 4096) == ("portable", True, 64, 16, 128, 4, 1)  # 264 tiles
    assert swap(16, 28672, 4096, 2) == ("portable", True, 64, 16, 128, 4, 1)
    assert swap(17, 28672, 4096, 2) is None and swap(3, 28672, 4096) is None
    assert swap(16, 28672, 4160) is None and swap(8, 28672, 4160, 2) is None  # a K tail
    assert swap(16, 6144, 4160) == ("portable", True, 64, 16, 256, 6, 1)  # within a wave
    assert swap(16, 10240, 8192) is None  # 160 tiles: 1.2 waves
    assert swap(1, 6144, 4096) is None and swap(33, 6144, 4096) is None
    # Within a wave, at most 16 rows: from 0.3 of one for fp8 (40 of 132 tiles), 0.35 for
    # 16-bit (47 tiles); above 16 rows from 0.45 (60 tiles).
    assert swap(16, 3712, 4096) == ("portable", True, 64, 16, 256, 6, 1)  # 58 tiles
    assert swap(16, 2560, 4096)[:2] == ("portable", True) and swap(16, 2496, 4096) is None
    assert swap(16, 3008, 4096, 2)[:2] == ("portable", True) and swap(16, 2944, 4096, 2) is None
    assert swap(17, 3712, 4096) is None and swap(17, 3712, 4096, 2) is None
    assert swap(17, 3840, 4096)[:4] == ("portable", True, 64, 32)
    assert swap(16, 6144, 1024) is None and swap(16, 6144, 1008) is None  # shallow K
    # 16-bit within a wave from K 256: 64-deep K steps below K 1024; never from two waves.
    assert swap(16, 6144, 1024, 2) == ("portable", True, 64, 16, 128, 6, 1)
    assert swap(16, 6144, 1008, 2) == ("portable", True, 64, 16, 64, 6, 1)
    assert swap(17, 6144, 256, 2) == ("portable", True, 64, 32, 64, 6, 1)
    assert swap(16, 6144, 240, 2) is None and swap(16, 2944, 512, 2) is None
    assert swap(16, 28672, 1024, 2) is None and swap(16, 10240, 1024, 2) is None
    shallow = tuning.SWAP_MIN_K_WITHIN_WAVE_16BIT
    monkeypatch.setattr(tuning, "SWAP_MIN_K_WITHIN_WAVE_16BIT", 2048)  # --swap-from-k-2048
    assert swap(16, 6144, 1024, 2) is None and swap(16, 6144, 2048, 2)[4] == 128
    monkeypatch.setattr(tuning, "SWAP_MIN_K_WITHIN_WAVE_16BIT", shallow)
    # fp8 within a wave from K 1024 (256-deep K steps), below K 2048 not at 16 rows;
    # --fp8-swap-from-k-2048 from 2048 only.
    assert swap(4, 4096, 1024) == ("portable", True, 64, 16, 256, 6, 1)
    assert swap(32, 3840, 1280) == ("portable", True, 64, 32, 256, 6, 1)
    assert swap(15, 6144, 2047)[:2] == swap(17, 6144, 2047)[:2] == ("portable", True)
    assert swap(16, 6144, 2047) is None and swap(16, 6144, 2048)[:2] == ("portable", True)
    assert swap(4, 4096, 1023) is None and swap(4, 28672, 1024) is None
    monkeypatch.setattr(tuning, "SWAP_MIN_K_WITHIN_WAVE_FP8", 2048)
    assert swap(4, 4096, 1024) is None and swap(4, 4096, 2048)[:2] == ("portable", True)
    monkeypatch.setattr(tuning, "SWAP_MIN_K_WITHIN_WAVE_FP8", 1024)
    assert swap(16, 6144, 4096, 4) is None
    # An H100's 25 GB/s per SM: within a wave as above, never from two waves.
    assert swap(16, 6144, 4096, 1, H100_GBPS) == swap(16, 6144, 4096)
    assert swap(17, 6144, 4096, 2, H100_GBPS) == swap(17, 6144, 4096, 2)
    assert all(swap(m, 28672, 4096, size, H100_GBPS) is None for m in (4, 16, 32)
               for size in (1, 2))
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 101376)
    assert swap(16, 6144, 4096)[5] == 4
    transposed = tuning.MMPlan("portable", tuning.TileConfig(64, 16, 256, 8, 4, 6), swap_ab=True)
    assert not plan_cache._launchable(transposed)
    assert plan_cache._launchable(dataclasses.replace(transposed, swap_ab=False))


def test_dram_bandwidth_of_the_device(monkeypatch):
    """device.dram_gbps: the memory clock and bus width's peak, which the transposed rule reads;
    an H100's where no GPU can be asked or the driver does not say."""
    from torch_triton_gemm import device

    assert device.dram_gbps(torch.device("cpu")) == H100_GBPS
    if torch.cuda.is_available():
        import triton.testing

        assert device.dram_gbps(torch.device("cuda")) == pytest.approx(
            triton.testing.get_dram_gbps(), rel=1e-6)
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    device._dram_gbps.cache_clear()
    monkeypatch.setattr(device, "_index", lambda d: 0)
    for props, gbps in (({"mem_clock_rate": 2619000, "mem_bus_width": 5120}, 3352.32),
                        ({}, H100_GBPS), ({"mem_clock_rate": 0, "mem_bus_width": 0}, H100_GBPS)):
        monkeypatch.setattr(device, "_driver_properties", lambda index, props=props: props)
        assert device.dram_gbps(torch.device("cuda")) == pytest.approx(gbps)
        device._dram_gbps.cache_clear()


class _CudaOperand:
    """What planner.swap_plan reads of a CUDA operand (sizes, strides, element size), so its
    layout rules can be checked without a GPU."""

    def __init__(self, shape, strides, element_size):
        self.shape, self._strides, self._element_size = shape, strides, element_size
        self.device = torch.device("cuda", 0)

    def stride(self, dim):
        return self._strides[dim]

    def element_size(self):
        return self._element_size


def test_transposed_products_need_pitches_it_won_on(monkeypatch):
    """planner.swap_plan on CUDA operands: 16-bit rows need pitches that are multiples of 32
    bytes (K an odd multiple of 8 lost transposed), fp8 ones of 16; both operands contiguous
    along K (b as W.t()), no bias."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)
    monkeypatch.setattr(planner, "num_sms", lambda device: 132)
    monkeypatch.setattr(planner._device, "dram_gbps", lambda device: H200_GBPS)
    one = torch.ones(())
    outer = launcher.GemmScales("outer", one, one, (0, 0, 0, 0))

    def transposed(m, n, k, size, pitch=None, bias=None, b_t=True):
        pitch = pitch or k
        a = _CudaOperand((m, k), (pitch, 1), size)
        b = _CudaOperand((k, n), (1, pitch) if b_t else (n, 1), size)
        plan = planner.swap_plan(a, b, bias, outer if size == 1 else None)
        return plan is not None and plan.swap_ab

    for size, ok, off in ((2, (4096, 4112), 4104), (1, (4096, 4112), 4104)):
        assert all(transposed(16, 6144, k, size) for k in ok)
        assert not transposed(16, 6144, off, size)  # 16-bit: 8208-byte rows; fp8: 4104-byte
        assert not transposed(16, 6144, 4096, size, pitch=4096 + 8)
    assert transposed(16, 6144, 4104, 2, pitch=4112)  # padded rows of 8224 bytes
    assert transposed(16, 6144, 4096, 1, pitch=4112)
    assert not transposed(16, 6144, 4096, 2, bias=one) and not transposed(16, 6144, 4096, 2,
                                                                           b_t=False)


@pytest.mark.parametrize("tiles, programs, stream_k, expected", [
    (6, 4, 1, 2), (6, 4, 2, 6), (3, 4, 1, 3), (3, 4, 2, 3), (8, 4, 1, 0), (144, 132, 1, 12),
    (144, 132, 2, 144), (300, 132, 2, 168), (300, 132, 0, 0)])
def test_stream_k_shares_the_partial_wave_and_whole_waves_before_it(tiles, programs, stream_k,
                                                                     expected):
    assert tuning.stream_k_tiles(tiles, programs, stream_k) == expected


def test_stream_k_plans_launch_once_with_a_flag_per_program(device, monkeypatch):
    """A stream-K plan is one launch of every persistent program (no reduction kernel), with a
    partial tile and a flag per program; where the waves come out even it runs as a plain
    persistent launch. Four persistent programs (the interpreter's count) on every device."""
    monkeypatch.setattr(launcher, "num_sms", lambda device: 4)
    prepare_launch = launcher.prepare_launch
    a = randn((37, 104), torch.float16, device)
    b = randn((45, 104), torch.float16, device).t()  # rows of 90 bytes would need pointers
    out = torch.empty((37, 45), dtype=torch.float16, device=device)
    prepared = prepare_launch(a, b, None, out, "none", False, PLANS["tma-stream-k"], None)
    assert len(prepared.launches) == 1 and prepared.reduce is None
    assert prepared.locks_shape == (4,) and prepared.workspace_shape == (4, 16, 32)
    assert prepared.launches[0][0] == (4,) and prepared.launches[0][1]["STREAM_K"]
    # 64 x 64 outputs: 4 x 2 tiles of 16 x 32, two whole waves of the interpreter's 4 programs.
    a, b = randn((64, 104), torch.float16, device), randn((104, 64), torch.float16, device)
    assert prepare_launch(a, b, None, torch.empty((64, 64), dtype=torch.float16, device=device),
                          "none", False, PLANS["tma-stream-k"], None).kernel.fn.__name__ == \
        "mm_tma_kernel"
    out = torch.empty((64, 64), dtype=torch.float16, device=device)
    prepared = prepare_launch(a, b, None, out, "none", False, PLANS["tma-stream-k"], None)
    assert prepared.locks_shape is None and not prepared.launches[0][1]["STREAM_K"]


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "silu", "leaky_relu"])
def test_tuning_times_only_candidates_that_give_the_product(device, activation):
    """tune_mm checks each candidate's output against torch's product before timing it: what
    tgemm computes passes; a wrong, partly unwritten or non-finite output does not."""
    from torch_triton_gemm import tune
    from torch_triton_gemm.kernels.tiles import ACTIVATIONS

    assert set(tune._ACTIVATIONS) == set(ACTIVATIONS)
    a, b = randn((40, 96), torch.float16, device), randn((96, 56), torch.float16, device)
    bias = randn((56,), torch.float16, device)
    reference = tune.reference_product(a, b, bias, activation)
    out = tg.mm(a, b, bias, activation)
    assert tune.gives_the_product(out, reference)
    assert not tune.gives_the_product(out.flip(0), reference)
    unwritten = out.clone()
    unwritten[:8] = 0
    assert not tune.gives_the_product(unwritten, reference)
    unwritten[:8] = float("nan")
    assert not tune.gives_the_product(unwritten, reference)


# --- pitch hints (TORCH_TRITON_GEMM_PITCH_HINTS) ------------------------------------------------

def test_pitch_alignment():
    bf16, fp32, fp8 = 2, 4, 1
    # Triton knows unit strides and multiples of 16 elements itself; symbolic strides get none.
    for stride in (0, 1, 16, 48, 4096):
        assert tuning.pitch_alignment(stride, bf16) == 1
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    symbolic = ShapeEnv().create_unbacked_symint() * 8 + 200  # traced: no guard on it
    assert tuning.pitch_alignment(symbolic, bf16) == 1
    # The largest power of two dividing the stride, up to one 16-byte vector.
    assert [tuning.pitch_alignment(s, bf16) for s in (200, 204, 202, 201, 4360)] == [8, 4, 2, 1, 8]
    assert [tuning.pitch_alignment(s, fp32) for s in (200, 204, 202, 8)] == [4, 4, 2, 4]
    assert [tuning.pitch_alignment(s, fp8) for s in (200, 204, 40, 24)] == [8, 4, 8, 8]
    for stride in range(2, 400):
        for size in (bf16, fp32, fp8):
            align = tuning.pitch_alignment(stride, size)
            assert stride % align == 0 and align * size <= 16


@pytest.mark.parametrize("hints", [False, True])
def test_pitch_hints_in_the_portable_launch(monkeypatch, device, hints):
    """Only with the switch on, only on the portable kernel, and each stride's own alignment."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1" if hints else "0")
    k = 204
    a = randn((40, k), torch.float16, device)  # row-major, pitch 204: 4 elements
    b = randn((96, k), torch.float16, device).t()  # W.t(), pitch 204
    out = a.new_empty((40, 96))
    portable = tuning.MMPlan("portable", SMALL_TILE)
    meta = launcher.prepare_launch(a, b, None, out, "none", False, portable, None).launches[0][1]
    aligns = tuple(meta[f] for f in ("A_M_ALIGN", "A_K_ALIGN", "B_K_ALIGN", "B_N_ALIGN"))
    assert aligns == ((4, 1, 1, 4) if hints else (1, 1, 1, 1))
    assert (meta["M_ALIGN"], meta["N_ALIGN"]) == (1, 1)  # neither operand contiguous along M, N
    x = randn((k, 44), torch.float16, device)[:, :40].t()  # A M-contiguous: pitch 44
    w = randn((k, 200), torch.float16, device)[:, :96]  # B row-major, pitch 200
    meta = launcher.prepare_launch(x, w, None, out, "none", False, portable, None).launches[0][1]
    aligns = tuple(meta[f] for f in ("A_M_ALIGN", "A_K_ALIGN", "B_K_ALIGN", "B_N_ALIGN"))
    assert aligns == ((1, 4, 8, 1) if hints else (1, 1, 1, 1))
    # M = 40 (not specialised: 8 is all that is known), N = 96 (Triton knows multiples of 16).
    assert (meta["M_ALIGN"], meta["N_ALIGN"]) == ((8, 1) if hints else (1, 1))
    w = randn((k, 200), torch.float16, device)[:, :36]  # N = 36: 4
    meta = launcher.prepare_launch(x, w, None, out[:, :36], "none", False, portable,
                                   None).launches[0][1]
    assert (meta["M_ALIGN"], meta["N_ALIGN"]) == ((8, 4) if hints else (1, 1))
    assert meta["N_ODD"] is False
    w = randn((k, 200), torch.float16, device)[:, :37]  # N = 37, B contiguous along it
    meta = launcher.prepare_launch(x, w, None, out[:, :37], "none", False, portable,
                                   None).launches[0][1]
    assert (meta["N_ALIGN"], meta["N_ODD"]) == (1, hints)
    meta = launcher.prepare_launch(x, w.t().contiguous().t(), None, out[:, :37], "none", False,
                                   portable, None).launches[0][1]
    assert meta["N_ODD"] is False  # B contiguous along K


def test_odd_contiguous():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert [tuning.odd_contiguous(s) for s in (0, 1, 2, 3, 37, 40, 965)] == [
        False, False, False, True, True, False, True]
    assert not tuning.odd_contiguous(ShapeEnv().create_unbacked_symint())


def test_size_alignment():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert [tuning.size_alignment(s, False) for s in (0, 1, 2, 3, 40, 36, 48, 4096, 50)] == [
        1, 1, 2, 1, 8, 4, 16, 16, 2]
    # Specialised sizes: Triton knows multiples of 16 itself.
    assert [tuning.size_alignment(s, True) for s in (40, 48, 4096, 24)] == [8, 1, 1, 8]
    assert tuning.size_alignment(ShapeEnv().create_unbacked_symint() * 8, False) == 1


@pytest.mark.parametrize("hints", [False, True])
def test_the_plan_model_sees_pitches_off_multiples_of_16_as_narrow(monkeypatch, hints):
    """A pitch that is not a multiple of 16 elements is narrow for the plan model with or
    without the hints (hinted portable loads still trail TMA on such pitches); with the hints
    the portable kernel copies along it in the widest cp.async vector (4-16 bytes) that the
    narrowest pitch allows, and element by element below 4 bytes or without them."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1" if hints else "0")

    def view(a_pitch: int, b_pitch: int, dtype: torch.dtype = torch.bfloat16):
        a = torch.empty((8, a_pitch), dtype=dtype)[:, :192]  # K = 192 along pitches >= 200
        w = torch.empty((64, b_pitch), dtype=dtype)[:, :192]
        return planner._pitches(a, w.t())

    vector = (lambda v: v) if hints else (lambda v: 0)
    assert view(200, 200) == (True, vector(16))  # 400 bytes: 16 divides them
    assert view(204, 200) == (True, vector(8))  # 408 bytes: 8 and no more
    assert view(202, 208) == (True, vector(4))
    assert view(201, 208) == (True, 0)  # 402 bytes: no copy of 4 bytes fits every row
    assert view(208, 208) == (False, 16)
    assert view(200, 200, torch.float32) == (True, vector(16))  # 800 bytes
    assert view(201, 208, torch.float32) == (True, vector(4))  # 804 bytes


def test_pitch_vectors_of_the_plan_model():
    """The widest copy along every narrow pitch (bytes), and the cost kernel each selects in a
    longer K loop (fitted tiles for 4-8-byte copies); one K step and the wide kernels keep
    theirs."""
    assert plan_model.pitch_vector([(200, 2), (204, 2)]) == 8  # 400 and 408 bytes
    assert plan_model.pitch_vector([(33, 2)]) == 0 and plan_model.pitch_vector([]) == 16
    assert plan_model.pitch_vector([(201, 4)]) == 4 and plan_model.pitch_vector([(200, 1)]) == 8
    assert plan_model.pitch_vector([(200, 2)], hinted=False) == 0
    assert plan_model.pitch_vector([], hinted=False) == 16
    kernel = plan_model.cost_kernel
    assert kernel("portable", True, pitch_vector=0) == "portable-narrow"
    assert kernel("portable", True, pitch_vector=4) == "portable-narrow-vector"
    assert kernel("portable", True, pitch_vector=8) == "portable-narrow-vector"
    # 16-byte copies: TMA reads such pitches as they are, and the element-wise constants keep
    # the portable kernel from taking those products over.
    assert kernel("portable", True, pitch_vector=16) == "portable-narrow"
    assert kernel("portable", True, one_step=True, pitch_vector=8) == (
        "portable-narrow-one-step")
    assert kernel("portable", False, pitch_vector=16) == "portable"
    assert kernel("tma", True, pitch_vector=0) == "tma"


def test_the_fit_tool_sees_the_pitches_the_planner_sees(monkeypatch):
    """The fit tool's view of a timed row (narrow, copy width) is the planner's view of the
    operands the benchmark made for it, on sweep shapes of every layout and padding."""
    from torch_triton_gemm.bench import fit, gemm, suites

    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1")
    meta = torch.device("meta")
    widths = set()
    for case in suites.sweep_cases(3, 120):
        a, b = gemm.make_operands(case, torch.bfloat16, meta)
        row = {**case.record(), "dtype": "bf16", "pitch_hints": "True"}
        narrow, vector = planner._pitches(a, b)
        assert (fit.narrow_row(row), fit.pitch_vector_row(row)) == (narrow, vector), case
        widths.add(vector if narrow else None)
    assert {None, 0, 4, 8, 16} <= widths  # every kind of pitch was met


def test_pitch_hints_are_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("TORCH_TRITON_GEMM_PITCH_HINTS", raising=False)
    assert tuning.pitch_hints_enabled()
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "0")
    assert not tuning.pitch_hints_enabled()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_every_narrow_pitch_matches_float64_with_hints(monkeypatch, device, dtype):
    """Pitches of 8, 4, 2 and 1 elements past a multiple of 16, each operand row- and
    column-major, through unsplit, split and tail-split portable plans with the hints on."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1")
    m, n, k = 37, 45, 104
    for pad in (8, 4, 2, 1, 12):
        operands = {
            "a row": randn((m, k + pad), dtype, device)[:, :k],
            "a col": randn((k, m + pad), dtype, device)[:, :m].t(),
            "b row": randn((k, n + pad), dtype, device)[:, :n],
            "b col": randn((n, k + pad), dtype, device)[:, :k].t(),
        }
        for a_layout in ("a row", "a col"):
            for b_layout in ("b row", "b col"):
                a, b = operands[a_layout], operands[b_layout]
                for name in ("portable", "portable-split3", "portable-tail-split3"):
                    out = _run(PLANS[name], a, b)
                    ref = reference(a, b)
                    assert rel_error(out, ref) <= tolerance(out.dtype, dtype), (
                        name, pad, a_layout, b_layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_operands_contiguous_along_m_or_n_match_float64_with_size_hints(monkeypatch, device,
                                                                          dtype):
    """A contiguous along M and B along N, with M and N multiples of 16, 8, 4 and 2 but not of
    the tile (rows and columns wrap inside a tile), or odd (N_ODD: the wrap falls inside a run
    the kernel is told is contiguous), through unsplit, split and tail-split portable plans
    with the hints on; K leaves a partial last step."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1")
    k = 72
    for m, n in ((48, 40), (40, 36), (36, 50), (50, 24), (8, 8), (112, 18), (37, 45), (9, 3),
                 (64, 33)):
        a = randn((k, m), dtype, device).t()  # x.t(): contiguous along M
        b = randn((k, n), dtype, device)  # row-major [K, N]: contiguous along N
        for name in ("portable", "portable-split3", "portable-tail-split3"):
            out = _run(PLANS[name], a, b)
            assert rel_error(out, reference(a, b)) <= tolerance(out.dtype, dtype), (name, m, n)


_PITCH_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
# Pitches stride_am and stride_bn not specialised as multiples of 16 (a narrow launch).
for align in (1, 4, 8):
    hinted = {**constants, **portable, "A_M_ALIGN": align, "B_N_ALIGN": align}
    compiled = compile_for(mm_kernel, pointers, hinted,
                           ["a_ptr", "b_ptr", "c_ptr", "stride_cm"], num_warps=4, num_stages=4)
    ptx = compiled.asm["ptx"]
    widths = {int(w, 0) for w in re.findall(
        r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*\\], (0x[0-9a-f]+|\\d+)", ptx)}
    print(align, ",".join(map(str, sorted(widths))) or "-")
"""


def test_pitch_hints_give_narrow_pitches_vector_copies_for_hopper():
    """The sm_90 build of the portable kernel, pitches known only as multiples of 8 or 4
    elements: 16- and 8-byte cp.async copies into the pipeline's buffers; without the hint,
    none (scalar loads, no pipeline)."""
    from test_mm import _run_without_interpreter

    lines = _run_without_interpreter(_PITCH_COMPILE_SCRIPT).splitlines()
    assert lines == ["1 -", "4 8", "8 16"]


_SIZE_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
# A contiguous along M (x.t()) and B along N (row-major [K, N], N not a multiple of 16): the
# wrapped rows / columns are contiguous only as far as the size hints say.
shared = {k: v for k, v in constants.items() if k not in ("stride_ak", "stride_bk")}
layouts = {"a": (dict(stride_am=1, stride_bk=1), ["stride_ak", "stride_bn", "N"], "M_ALIGN"),
           "b": (dict(stride_ak=1, stride_bn=1), ["stride_am", "stride_bk"], "N_ALIGN")}
for operand, (strides, aligned, hint) in layouts.items():
    for align in (1, 8):
        compiled = compile_for(mm_kernel, pointers,
                               {**shared, **portable, **strides, hint: align},
                               ["a_ptr", "b_ptr", "c_ptr", "stride_cm", "K", *aligned],
                               num_warps=4, num_stages=4)
        print(operand, align, len(re.findall(r"ld\\.global", compiled.asm["ptx"])))
"""


_ODD_N_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
# B row-major [K, N] with N odd (2536x965x64's launch: one K step, no pipeline): the B tile's
# load layout (its threads' order) and the widths of its global loads, with and without N_ODD.
shared = {k: v for k, v in constants.items() if k not in ("stride_ak", "stride_bk")}
pointers = {**pointers, "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16"}
for odd in (False, True):
    compiled = compile_for(mm_kernel, pointers,
                           {**shared, **portable, "stride_ak": 1, "stride_bn": 1, "N_ODD": odd},
                           ["a_ptr", "b_ptr", "c_ptr", "stride_am", "K"], num_warps=4,
                           num_stages=1)
    ir = compiled.asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\\d*) = #ttg\\.blocked<\\{(.*)\\}>", ir, re.M))
    b_load = re.search(r"tt\\.load .*b_.*: tensor<64x64x!tt\\.ptr<f16>, (#blocked\\d*)>", ir)
    order = re.search(r"order = \\[(\\d), (\\d)\\]", layouts[b_load.group(1)]).groups()
    loads = sorted(set(re.findall(r"ld\\.global[\\w.]*", compiled.asm["ptx"])))
    print(odd, "".join(order), ",".join(loads))
for block_m, block_n, block_k, stages, split in ((16, 64, 128, 6, False), (16, 64, 128, 6, True),
                                                 (64, 64, 64, 4, False),
                                                 (128, 128, 64, 4, False)):
    kinds = []
    for odd in (False, True):
        compiled = compile_for(mm_kernel, pointers,
                               {**shared, **portable, "stride_ak": 1, "stride_bn": 1,
                                "N_ODD": odd, "BLOCK_M": block_m, "BLOCK_N": block_n,
                                "BLOCK_K": block_k, "SPLIT": split},
                               ["a_ptr", "b_ptr", "c_ptr", "stride_am", "K"], num_warps=4,
                               num_stages=stages)
        ptx = compiled.asm["ptx"]
        # Every global load's opcode and every cp.async copy's size, with their counts.
        kinds.append(sorted(re.findall(r"(ld\\.global[\\w.]*)|cp\\.async\\.c[ag]\\.shared"
                                       r"\\.global \\[[^\\]]*\\], \\[[^\\]]*\\], (\\w+)", ptx)))
    print(block_m, block_n, block_k, stages, split, "same" if kinds[0] == kinds[1] else kinds)
import triton
print(triton.__version__)
"""


_TAIL_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
# Pitches multiples of 16 but K not (a padded operand, K = 695): the masked remainder's loads
# are scalar. Per tile of the planner's space: the global loads each thread issues (the full
# steps go through cp.async) and the stack it spills to, from the cubin's resource usage.
import os, subprocess, tempfile, triton
from torch_triton_gemm.tuning import PLAN_SPACE_TILES
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
pointers = {**pointers, "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16"}
for tile in PLAN_SPACE_TILES:
    compiled = compile_for(mm_kernel, pointers,
                           {**constants, **portable, "BLOCK_M": tile.block_m,
                            "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k},
                           ["a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bn", "stride_cm"],
                           num_warps=tile.num_warps, num_stages=tile.num_stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    loads = len(re.findall(r"ld\\.global", compiled.asm["ptx"]))
    print(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, loads,
          re.search(r"STACK:(\\d+)", usage).group(1))
"""


def test_the_remainder_of_k_loads_in_short_steps_and_spills_nothing_on_hopper():
    """The sm_90 build of the portable kernel for K not a multiple of 16 (pitches that are):
    no tile of the planner's space spills registers, small tiles load the remainder in one
    BLOCK_K step and larger ones in shorter steps (each of the 128 threads loads
    (BLOCK_M + BLOCK_N) * step / 128 elements a step). Loading it as one masked BLOCK_K step
    on every tile held up to eight times as many loads in registers; with Triton 3.6 that
    spilled (600 bytes of stack per thread for 64x64x128, 3.9 KB for 32x128x128; an H100 ran
    64 x 128 x 695 in 149 us on the latter, 6.7 on 64x64x64 tiles)."""
    from test_mm import _run_without_interpreter

    from torch_triton_gemm.tuning import PLAN_SPACE_TILES

    lines = _run_without_interpreter(_TAIL_COMPILE_SCRIPT).splitlines()
    assert len(lines) == len(PLAN_SPACE_TILES), lines
    loads = {}
    for line in lines:
        block_m, block_n, block_k, warps, count, stack = map(int, line.split())
        assert stack == 0, lines
        loads[block_m, block_n, block_k, warps] = count
    # One BLOCK_K step on small tiles; 64, 32 and 16 columns of K on larger ones: the step
    # the plan model counts (tuning.remainder_step) is the one the kernel builds.
    assert loads[16, 64, 128, 4] == loads[64, 16, 128, 4] == 80, lines
    assert loads[32, 32, 128, 4] == loads[16, 16, 256, 4] == 64, lines
    assert loads[64, 64, 128, 4] == 64 and loads[16, 64, 256, 4] == 80, lines
    assert loads[32, 128, 128, 4] == 40 and loads[64, 128, 64, 4] == 48, lines
    assert loads[128, 128, 64, 4] == 32 and loads[128, 128, 64, 8] == 16, lines
    for tile in PLAN_SPACE_TILES:
        step = tuning.remainder_step(tile, 2)
        assert loads[tile.block_m, tile.block_n, tile.block_k, tile.num_warps] == (
            (tile.block_m + tile.block_n) * step // (32 * tile.num_warps)), (tile, lines)


_STORE_COMPILE_SCRIPT = _HOPPER_MM_PREAMBLE + """
# C's pitch and N not specialised (e.g. N = 1000): the widths of the pointer stores of the
# portable kernel, the split-K reduction and the TMA kernel's pointer epilogue, by C_ALIGN.
from torch_triton_gemm.kernels.matmul import splitk_reduce_kernel

tma = dict(A_M_CONTIGUOUS=False, B_K_CONTIGUOUS=True, C_TMA=False, EPILOGUE_SUBTILE=1,
           STREAM_K=False, HOST_DESCRIPTORS=False, c_host_desc=None, WARP_SPECIALIZE=False)
for align in (1, 2, 4, 8):
    builds = [compile_for(mm_kernel, pointers, {**constants, **portable, "C_ALIGN": align},
                          ["a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bn", "K"],
                          num_warps=4, num_stages=3),
              compile_for(splitk_reduce_kernel,
                          {"ws_ptr": "*fp32", "c_ptr": "*bf16", "bias_ptr": "*bf16"},
                          dict(HAS_BIAS=True, ACTIVATION="none", INDEX_64=False, SPLIT_K=3,
                               TILE_M=64, TILE_N=64, GROUP_M=8, BLOCK_M=32, BLOCK_N=64,
                               PDL=False, C_ALIGN=align, stride_cn=1), ["ws_ptr", "c_ptr"],
                          num_warps=4),
              compile_for(mm_tma_kernel, pointers, {**constants, **tma, "C_ALIGN": align},
                          ["a_ptr", "b_ptr", "c_ptr"], num_warps=4, num_stages=3)]
    print(align, *(",".join(sorted(set(re.findall(r"st\\.global[\\w.]*", b.asm["ptx"]))))
                   for b in builds))
"""


def test_store_alignment_gives_c_vector_stores_for_hopper():
    """The sm_90 builds' pointer stores of C, its pitch and N known to divide by 2, 4 or 8
    (C_ALIGN) but not by 16: 4-, 8- and 16-byte stores instead of one 2-byte store per element
    (the portable kernel, the split-K reduction, the TMA kernel where C is not described)."""
    from test_mm import _run_without_interpreter

    lines = _run_without_interpreter(_STORE_COMPILE_SCRIPT).splitlines()
    widths = {"1": "st.global.b16", "2": "st.global.b32", "4": "st.global.v2.b32",
              "8": "st.global.v4.b32"}
    assert [line.split()[0] for line in lines] == ["1", "2", "4", "8"], lines
    for line in lines:
        align, *stores = line.split()
        assert stores == [widths[align]] * 3, lines


@pytest.mark.parametrize("plan", ["portable", "portable-split3", "portable-split3-fixup", "tma",
                                  "tma-split3-fixup"])
def test_c_stored_in_vectors_matches_float64(device, plan, monkeypatch):
    """Outputs whose N (and pitch) divide by 8, 4 or 2 but not 16, or are odd, their last tile
    cut inside a tile's columns: every element of the poisoned output right (C_ALIGN's mask,
    compared in runs of columns, is the plain one)."""
    monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "1")
    for m, n, k in ((40, 40, 72), (33, 36, 40), (19, 50, 64), (8, 18, 96), (21, 37, 24)):
        a = randn((m, k), torch.float16, device)
        b = randn((n, k), torch.float16, device).t()
        bias = randn((n,), torch.float16, device)
        out = _run(PLANS[plan], a, b, bias, "gelu")
        assert rel_error(out, reference(a, b, bias, "gelu")) <= 1e-2, (plan, m, n, k)


def test_store_alignment():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert [tuning.store_alignment(n, n, 2) for n in (1000, 36, 50, 37, 1024, 0)] == [
        8, 4, 2, 1, 8, 1]
    assert tuning.store_alignment(1024, 1000, 2) == 8 and tuning.store_alignment(1000, 36, 2) == 4
    assert tuning.store_alignment(1000, 1000, 4) == 4  # fp32 C: one 16-byte vector
    assert tuning.store_alignment(ShapeEnv().create_unbacked_symint(), 8, 2) == 1


def test_odd_n_lays_b_loads_along_n_for_hopper():
    """The sm_90 build of the portable kernel for B row-major with N odd: with N_ODD the B
    tile's loads run along N (order [1, 0]), and B's loads stay scalar 16-bit ones either way
    (the hint claims no alignment, so no vector load spans the wrap of the columns). Without
    it Triton 3.6 (what the GPU runs) lays them down K (order [0, 1]: each thread of a warp on
    another row); later Triton releases already choose N."""
    from test_mm import _run_without_interpreter

    *lines, version = _run_without_interpreter(_ODD_N_COMPILE_SCRIPT).splitlines()
    lines, widths = lines[:2], lines[2:]
    # Other tiles, pipeline depths and splits: the hint changes no load's width (nothing
    # becomes a vector load or a cp.async copy that could span the wrap).
    assert widths and all(line.endswith("same") for line in widths), widths
    without = "01" if version.startswith("3.6.") else lines[0].split()[1]
    assert [line.split()[:2] for line in lines] == [["False", without], ["True", "10"]], lines
    # A's 16-byte loads and B's (and nothing else's) scalar 16-bit ones, the same both ways.
    assert lines[0].split()[2] == lines[1].split()[2] == "ld.global.b16,ld.global.v4.b32", lines


def test_size_hints_give_operands_contiguous_along_m_or_n_vector_copies_for_hopper():
    """The sm_90 build of the portable kernel, A contiguous along M (M not specialised) or B
    along N (N not a multiple of 16): without the size hint its tile loads element by element
    (dozens of scalar global loads); with M or N known as a multiple of 8, the pipeline's
    cp.async copies take it (the masked remainder's steps too, K being a multiple of 16)."""
    from test_mm import _run_without_interpreter

    counts = {}
    for line in _run_without_interpreter(_SIZE_COMPILE_SCRIPT).splitlines():
        operand, align, loads = line.split()
        counts[operand, int(align)] = int(loads)
    for operand in ("a", "b"):
        assert counts[operand, 1] >= max(16, 4 * counts[operand, 8]), counts


def test_the_model_view_says_where_the_launcher_copies_operands(monkeypatch):
    """``planner.model_view``'s last entry: whether the launcher copies operands TMA cannot
    describe for plans that leave ``pad`` unset (large products, either operand); not for a
    small product or aligned pitches."""
    from torch_triton_gemm import device as tgemm_device

    monkeypatch.setattr(tgemm_device, "supports_tma", lambda device: True)

    def view(m: int, n: int, k: int, a_pitch: int, b_pitch: int) -> planner.ModelView:
        a = torch.empty(m, a_pitch, dtype=torch.float16)[:, :k]
        b = torch.empty(n, b_pitch, dtype=torch.float16)[:, :k].t()
        return planner.model_view(a, b, torch.empty(m, n, dtype=torch.float16))

    assert view(3200, 832, 756, 756, 756) == (False, True, False, 8, True)
    assert view(3200, 832, 756, 768, 756)[4]  # B copied
    assert not view(64, 832, 756, 756, 756)[4]
    assert view(3200, 832, 768, 768, 768) == (True, False, False, 16, False)
