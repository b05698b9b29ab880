"""Tensor parallel: tgemm's ops on DTensors, and override() in a tensor-parallel MLP, on 2 ranks.

One spawn of two processes runs every check on its rank and saves what it measured; the tests
read both ranks' measurements. The ranks talk through gloo and run tgemm on CPU in Triton's
interpreter (tiny shapes), on any machine; the test marked ``gpu`` does the same with NCCL on two
GPUs.

What is checked, against float64 references of the full (unsharded) tensors:

- the sharding rules: ``torch.ops.tgemm.mm`` / ``grouped_mm`` / ``scaled_mm`` on DTensors give
  the right values, the output placement aten's rules give, and the collectives aten makes for
  the same DTensors (counted with CommDebugMode);
- override() in a ColwiseParallel -> gelu -> RowwiseParallel MLP, at the Python and the aten
  level: the same output and local weight-gradient shards as without it, the same collectives,
  and tgemm launched on the shards;
- a small Llama (transformers, built from a config) whose attention and MLP projections are
  column- and row-wise parallel, one training step's forward and backward under override() at
  both levels: loss, logits and every gradient against the same model unsharded on one device
  (fp32 on CPU ranks, bf16 on GPUs), every linear routed, none left to PyTorch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pathlib
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

# tests/ is on the path of the test process and of the ranks it spawns.
from test_models import Results, Size, assert_close_results, build_llama, forward_backward
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm.ops import mm as mm_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORLD = 2
PLACEMENTS = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "P": Partial()}


# --- helpers that run on a rank -------------------------------------------------------------------

def _distribute(full: torch.Tensor, mesh: DeviceMesh, placement: str) -> DTensor:
    """This rank's part of ``full`` as a DTensor, without communication (every rank holds the
    same ``full``, drawn from the same seed): gloo cannot send fp8."""
    p = PLACEMENTS[placement]
    local = full.chunk(WORLD, p.dim)[mesh.get_local_rank()] if isinstance(p, Shard) else full
    return DTensor.from_local(local, mesh, [p], run_check=False)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _comms(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, int]]:
    """fn(*args) and the collectives it made, by name."""
    with CommDebugMode() as comm:
        out = fn(*args)
    return out, {str(op): n for op, n in comm.get_comm_counts().items()}


def _placement(t: DTensor) -> str:
    return ",".join(str(p) for p in t.placements)


def _reference_act(z: torch.Tensor, activation: str) -> torch.Tensor:
    return {"none": z, "relu": F.relu(z), "gelu": F.gelu(z, approximate="tanh")}[activation]


# Sharding rules of tgemm::mm. name -> (a, b, bias placements or None, activation).
MM_CASES = {
    "rows: Shard(0) x Replicate": ("S0", "R", None, "none"),
    "columns: Replicate x Shard(1), bias Shard(0), gelu": ("R", "S1", "S0", "gelu"),
    "contraction: Shard(1) x Shard(0), Partial out": ("S1", "S0", None, "none"),
    "contraction with a replicated bias": ("S1", "S0", "R", "none"),
    # Same placements and out_dtype as the Partial case before it: DTensor's cache of sharding
    # decisions must not hand relu that Partial output.
    "contraction + relu: gathered, not Partial": ("S1", "S0", None, "relu"),
}


def _aten_and_routed(fn: Callable[..., Any], args: tuple[DTensor, ...],
                     ref: torch.Tensor) -> dict[str, Any]:
    """``fn`` on DTensors without and with override(): placements, collectives, routed counts
    and the routed result's error against ``ref``. Where aten raises (a PyTorch version whose
    DTensor cannot propagate the sharding), the error of each."""
    try:
        aten, aten_comms = _comms(fn, *args)
    except RuntimeError as aten_error:
        error = None
        with tg.override() as ov:
            try:
                fn(*args)
            except RuntimeError as routed_error:
                error = str(routed_error)
        return {"counts": dict(ov.counts), "aten_error": str(aten_error), "error": error}
    with tg.override() as ov:
        routed, comms = _comms(fn, *args)
    return {
        "counts": dict(ov.counts), "placement": _placement(routed), "comms": comms,
        "aten_placement": _placement(aten), "aten_comms": aten_comms,
        "err": _rel_err(routed.full_tensor(), ref),
    }


def _folds(t: DTensor, shape: tuple[int, ...]) -> bool:
    """Whether this PyTorch's DTensor reshapes ``t`` to ``shape`` without redistribution
    (torch 2.11 refuses to fold a sharded dim after the first into one)."""
    try:
        t.reshape(shape)
    except RuntimeError:
        return False
    return True


def _check_mm(mesh: DeviceMesh, device: str) -> dict[str, Any]:
    m, k, n = 16, 32, 16
    results = {}
    for name, (pa, pb, pbias, activation) in MM_CASES.items():
        a, b, bias = (torch.randn(*s, device=device) for s in ((m, k), (k, n), (n,)))
        da, db = _distribute(a, mesh, pa), _distribute(b, mesh, pb)
        dbias = None if pbias is None else _distribute(bias, mesh, pbias)
        out, comms = _comms(torch.ops.tgemm.mm, da, db, dbias, activation, torch.float32)
        # aten on the same DTensors: mm, or addmm when there is a bias (before the activation).
        aten, aten_comms = (_comms(torch.mm, da, db) if dbias is None
                            else _comms(torch.addmm, dbias, da, db))
        ref = a.double() @ b.double() + (0 if pbias is None else bias.double())
        results[name] = {
            "err": _rel_err(out.full_tensor(), _reference_act(ref, activation)),
            "placement": _placement(out), "aten_placement": _placement(aten),
            "comms": comms, "aten_comms": aten_comms,
        }
    # override() routes torch.mm on DTensors to tgemm::mm, with aten's placements.
    da, db = _distribute(torch.randn(m, k, device=device), mesh, "S1"), _distribute(
        torch.randn(k, n, device=device), mesh, "S0")
    with tg.override() as ov:
        routed = torch.mm(da, db)
    results["override torch.mm"] = {
        "counts": dict(ov.counts), "placement": _placement(routed),
        "err": _rel_err(routed.full_tensor(),
                        da.full_tensor().double() @ db.full_tensor().double()),
    }
    # F.linear folds [B, T, K] into [B*T, K] and back, as aten's linear does: on a sequence-
    # sharded input both make the same redistributions.
    x, w, bias = (torch.randn(*s, device=device) for s in ((2, 4, k), (n, k), (n,)))
    args = (_distribute(x, mesh, "S1"), _distribute(w, mesh, "R"), _distribute(bias, mesh, "R"))
    results["override F.linear, sequence-sharded"] = {
        **_aten_and_routed(F.linear, args, F.linear(x.double(), w.double(), bias.double())),
        "folds": _folds(args[0], (-1, k))}
    # Attention's [B, H, T, D] @ [B, H, D, T] with the heads sharded: override() flattens the
    # batch as aten's matmul does, into one tgemm::grouped_mm that keeps the heads local.
    q, kt = torch.randn(2, 4, 8, 8, device=device), torch.randn(2, 4, 8, 8, device=device)
    args = (_distribute(q, mesh, "S1"), _distribute(kt, mesh, "S1"))
    results["override @, head-sharded 4-D"] = {
        **_aten_and_routed(torch.matmul, args, q.double() @ kt.double()),
        "folds": _folds(args[0], (-1, 8, 8)) and _folds(args[1], (-1, 8, 8))}
    # DTensor with a plain tensor: left to PyTorch (which refuses it).
    with tg.override() as ov:
        with contextlib.suppress(RuntimeError):
            torch.mm(da, db.full_tensor())
    results["override mixed"] = {"counts": dict(ov.counts)}
    return results


# Sharding rules of tgemm::grouped_mm. name -> (a shape, b shape, group sizes or None,
# placements of a, b, bias, the output placement aten gives).
GROUPED_CASES = {
    "3-D x 3-D, the batch: Shard(0)": ((4, 8, 16), (4, 16, 8), None, ("S0", "S0", "S0"), "S0"),
    "3-D x 3-D, columns: Shard(2)": ((2, 8, 16), (2, 16, 8), None, ("R", "S2", "S1"), "S2"),
    "2-D x 3-D with offs, experts' columns: Shard(2)": (
        (16, 16), (2, 16, 16), (6, 10), ("R", "S2", "S1"), "S1"),
    "2-D x 3-D with offs, contraction": (
        (16, 16), (2, 16, 16), (6, 10), ("S1", "S1", "R"), "P"),
}


def _grouped_reference(a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, ...] | None,
                       bias: torch.Tensor) -> torch.Tensor:
    a, b, bias = a.double(), b.double(), bias.double()
    if sizes is None:
        return a @ b + bias[:, None, :]
    rows = a.split(list(sizes))
    return torch.cat([r @ b[g] + bias[g] for g, r in enumerate(rows)])


def _check_grouped(mesh: DeviceMesh, device: str) -> dict[str, Any]:
    results = {}
    for name, (sa, sb, sizes, (pa, pb, pbias), _) in GROUPED_CASES.items():
        a, b = torch.randn(*sa, device=device), torch.randn(*sb, device=device)
        bias = torch.randn(sb[0], sb[-1], device=device)
        da, db, dbias = (_distribute(t, mesh, p) for t, p in ((a, pa), (b, pb), (bias, pbias)))
        offs = None
        if sizes is not None:
            offs = torch.tensor(sizes, device=device, dtype=torch.int32).cumsum(0).int()
            offs = _distribute(offs, mesh, "R")
        out, comms = _comms(torch.ops.tgemm.grouped_mm, da, db, offs, dbias)
        ref = _grouped_reference(a, b, sizes, bias)
        results[name] = {"err": _rel_err(out.full_tensor(), ref), "placement": _placement(out),
                         "comms": comms}
        if sizes is not None:  # override() routes torch._grouped_mm on DTensors too
            with tg.override() as ov:
                routed = torch._grouped_mm(da, db, offs=offs, bias=dbias)
            results[name]["override"] = {
                "counts": dict(ov.counts), "placement": _placement(routed),
                "err": _rel_err(routed.full_tensor(), ref)}
    return results


# Sharding rules of tgemm::scaled_mm. name -> (recipe, K, placements of a and b, the placements
# of scale_a and scale_b that DTensor must not have to change, output placement).
SCALED_CASES = {
    "rowwise, rows: Shard(0)": ("rowwise", 32, ("S0", "R"), ("S0", "R"), "S0"),
    "rowwise, columns: Shard(1)": ("rowwise", 32, ("R", "S1"), ("R", "S1"), "S1"),
    "tensorwise, contraction": ("tensorwise", 32, ("S1", "S0"), ("R", "R"), "P"),
    "mxfp8, contraction: scale blocks sharded": ("mxfp8", 128, ("S1", "S0"), ("S1", "S0"), "P"),
}


def _check_scaled(mesh: DeviceMesh, device: str) -> dict[str, Any]:
    m, n = 16, 16
    results = {}
    for name, (recipe, k, (pa, pb), (psa, psb), _) in SCALED_CASES.items():
        aq, sa = tg.quantize(torch.randn(m, k, device=device), recipe, "a")
        bq, sb = tg.quantize(torch.randn(n, k, device=device).t(), recipe, "b")
        bias = torch.randn(n, device=device)
        args = [_distribute(t, mesh, p) for t, p in ((aq, pa), (bq, pb), (sa, psa), (sb, psb))]
        dbias = _distribute(bias, mesh, "R")
        out, comms = _comms(torch.ops.tgemm.scaled_mm, *args, dbias, torch.float32)
        ref = (tg.dequantize(aq, sa, recipe, "a") @ tg.dequantize(bq, sb, recipe, "b")
               + bias.double())
        results[name] = {"err": _rel_err(out.full_tensor(), ref), "placement": _placement(out),
                         "comms": comms}
        with tg.override() as ov:  # override() routes torch._scaled_mm on DTensors too
            routed = torch._scaled_mm(*args, bias=dbias, out_dtype=torch.float32)
        results[name]["override"] = {
            "counts": dict(ov.counts), "placement": _placement(routed),
            "err": _rel_err(routed.full_tensor(), ref)}
    return results


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


MLP_DIM, MLP_HIDDEN = 24, 32


@contextlib.contextmanager
def _mm_launches() -> Iterator[list[tuple[int, int, int]]]:
    """(M, K, N) of every tgemm::mm kernel launch in the block: the tensors the kernel sees."""
    launches: list[tuple[int, int, int]] = []
    # Traced and first calls launch through run_launch, later eager calls through run_kept.
    originals = {name: getattr(mm_module, name) for name in ("run_launch", "run_kept")}

    def logger(run: Any) -> Any:
        def logged(prepared: Any, a: torch.Tensor, b: torch.Tensor, *args: Any) -> None:
            launches.append((a.shape[0], a.shape[1], b.shape[1]))
            run(prepared, a, b, *args)
        return logged

    for name, run in originals.items():
        setattr(mm_module, name, logger(run))
    try:
        yield launches
    finally:
        for name, run in originals.items():
            setattr(mm_module, name, run)


def _train_step(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.backward(grad_out)
    return out


def _check_mlp(mesh: DeviceMesh, device: str) -> dict[str, Any]:
    """One forward and backward of a ColwiseParallel -> gelu -> RowwiseParallel MLP, without
    and with override()."""
    model = _MLP(MLP_DIM, MLP_HIDDEN).to(device)
    x = torch.randn(2, 3, MLP_DIM, device=device, requires_grad=True)
    grad_out = torch.randn(2, 3, MLP_DIM, device=device)
    reference = copy.deepcopy(model).double()
    x_ref = x.detach().double().requires_grad_()
    ref_out = reference(x_ref)
    ref_out.backward(grad_out.double())
    runs: dict[str, Any] = {}
    for name in ("aten", "override", "override aten"):
        tp = parallelize_module(copy.deepcopy(model), mesh,
                                {"up": ColwiseParallel(), "down": RowwiseParallel()})
        x.grad = None
        # The aten level sees the local products DTensor issues on each rank's shards.
        ov = tg.override(level="aten" if name == "override aten" else "python")
        with _mm_launches() as launches, ov if name != "aten" else contextlib.nullcontext():
            out, comms = _comms(_train_step, tp, x, grad_out)
        runs[name] = {
            "err": _rel_err(out, ref_out), "x_grad_err": _rel_err(x.grad, x_ref.grad),
            "comms": comms, "counts": dict(ov.counts),
            "launches": launches,
            "grads": {p: w.grad.to_local().cpu() for p, w in tp.named_parameters()},
            "grad_err": {p: _rel_err(w.grad.full_tensor(), reference.get_parameter(p).grad)
                         for p, w in tp.named_parameters()},
        }
    return runs


# Each rank holds one of the 2 key-value heads; the intermediate size (and each projection's
# output) differs from every other dimension, so a launch shows whether it ran on a shard.
LLAMA_SIZES = {
    "cpu": Size(hidden=32, layers=2, heads=2, kv_heads=2, intermediate=96, vocab=64, experts=0,
                batch=2, seq=8),
    "cuda": Size(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=768, vocab=512,
                 experts=0, batch=2, seq=64),
}
# Megatron-style: q, k, v, gate and up split by output columns (heads), o and down by input
# rows; embedding, norms and lm_head stay replicated.
LLAMA_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def _full_results(got: Results) -> tuple[Any, ...]:
    """``got`` on the CPU, sharded gradients gathered (a collective: every rank calls it), as
    a plain tuple (what a rank's saved results may hold)."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    return (full(got.loss), full(got.logits),
            {name: full(grad) for name, grad in got.grads.items()})


def _check_llama(mesh: DeviceMesh, device: str) -> dict[str, Any]:
    """One training step of a small Llama: unsharded on this rank's device, then tensor
    parallel without override(), and under it at the Python and the aten level."""
    size = LLAMA_SIZES[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_llama(size).to(device, dtype)
    tokens = torch.randint(size.vocab, (size.batch, size.seq), device=device)
    runs: dict[str, Any] = {
        "one device": {"results": _full_results(forward_backward(model, model, tokens))}}
    for name in ("tensor parallel", "override", "override aten"):
        tp = copy.deepcopy(model)
        for layer in tp.model.layers:
            parallelize_module(layer, mesh, LLAMA_PLAN)
        ov = tg.override(level="aten" if name == "override aten" else "python")
        routing = ov if name != "tensor parallel" else contextlib.nullcontext()
        with _mm_launches() as launches, routing:
            got = forward_backward(tp, tp, tokens)
        runs[name] = {"results": _full_results(got), "counts": dict(ov.counts),
                      "launches": launches}
    return {"dtype": dtype, "size": dataclasses.asdict(size), "runs": runs}


CHECKS: dict[str, Callable[[DeviceMesh, str], dict[str, Any]]] = {
    "mm": _check_mm, "grouped_mm": _check_grouped, "scaled_mm": _check_scaled, "mlp": _check_mlp,
    "llama": _check_llama,
}


def _worker(rank: int, store: str, backend: str, seed: int, out_dir: str) -> None:
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        torch.set_float32_matmul_precision("highest")
        mesh = init_device_mesh(device, (WORLD,))
        results = {}
        for name, check in CHECKS.items():
            torch.manual_seed(seed)  # every rank draws the same full tensors
            results[name] = check(mesh, device)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_ranks(directory: pathlib.Path, backend: str) -> list[dict[str, Any]]:
    """Every check on WORLD ranks; each rank's measurements. gloo ranks run on CPU in Triton's
    interpreter, also on a machine with GPUs (the variable is read when the ranks import
    torch_triton_gemm); nccl ranks on one GPU each."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"ranks seeded with torch.manual_seed({seed})")
    with pytest.MonkeyPatch.context() as env:
        if backend == "gloo":
            env.setenv("TRITON_INTERPRET", "1")
        mp.spawn(_worker, args=(str(directory / "store"), backend, seed, str(directory)),
                 nprocs=WORLD)
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD)]


# --- what the ranks measured ----------------------------------------------------------------------

FP32_TOLERANCE = 1e-5  # IEEE fp32 products (the ranks set "highest" precision)


def _assert_mm(results: list[dict[str, Any]]) -> None:
    for rank in results:
        for name in MM_CASES:
            case = rank["mm"][name]
            assert case["err"] <= FP32_TOLERANCE, (name, case)
            if name.startswith("contraction + relu"):
                # aten reduces the Partial product before relu; tgemm's fused relu needs the
                # whole contraction, so DTensor gathers the operands instead.
                assert case["placement"] == str(PLACEMENTS["R"]), (name, case)
                assert case["comms"] and case["comms"] != case["aten_comms"], (name, case)
            else:
                assert case["placement"] == case["aten_placement"], (name, case)
                assert case["comms"] == case["aten_comms"], (name, case)
        partial = str(PLACEMENTS["P"])
        assert rank["mm"]["contraction: Shard(1) x Shard(0), Partial out"]["placement"] == partial
        routed = rank["mm"]["override torch.mm"]
        assert routed["counts"]["mm"] == 1 and routed["counts"]["fallback"] == 0, routed
        assert routed["placement"] == partial, routed
        assert routed["err"] <= FP32_TOLERANCE, routed
        for name, family in (("override F.linear, sequence-sharded", "addmm"),
                             ("override @, head-sharded 4-D", "bmm")):
            routed = rank["mm"][name]
            if not routed["folds"]:
                family = "fallback"  # left to aten, whose sharding rules then decide
            assert routed["counts"][family] == sum(routed["counts"].values()) == 1, routed
            if "aten_error" in routed:  # this PyTorch refuses the call: so must the override
                assert routed["error"] == routed["aten_error"], (name, routed)
                continue
            assert routed["placement"] == routed["aten_placement"], (name, routed)
            assert routed["comms"] == routed["aten_comms"] == {}, (name, routed)
            assert routed["err"] <= FP32_TOLERANCE, (name, routed)
        mixed = rank["mm"]["override mixed"]["counts"]
        assert mixed["mm"] == 0 and mixed["fallback"] == 1, mixed


def _assert_sharded_op(results: list[dict[str, Any]], op: str, cases: dict[str, Any],
                       family: str, tolerance: float, every_case_routed: bool) -> None:
    """Each rank's results of ``op`` (grouped_mm, scaled_mm): error, output placement, no
    redistribution, and the override's run of the case routed once with the same placement."""
    for rank in results:
        for name, (*_, placement) in cases.items():
            case = rank[op][name]
            assert case["err"] <= tolerance, (name, case)
            assert case["placement"] == str(PLACEMENTS[placement]), (name, case)
            assert case["comms"] == {}, (name, case)  # no redistribution
            assert "override" in case or not every_case_routed, (name, case)
            if "override" in case:
                routed = case["override"]
                assert routed["counts"][family] == 1 and routed["counts"]["fallback"] == 0
                assert routed["placement"] == case["placement"], (name, routed)
                assert routed["err"] <= tolerance, (name, routed)


def _assert_grouped(results: list[dict[str, Any]]) -> None:
    _assert_sharded_op(results, "grouped_mm", GROUPED_CASES, "grouped", FP32_TOLERANCE, False)


def _assert_scaled(results: list[dict[str, Any]], tolerance: float) -> None:
    _assert_sharded_op(results, "scaled_mm", SCALED_CASES, "scaled", tolerance, True)


def _assert_mlp(results: list[dict[str, Any]]) -> None:
    shard = MLP_HIDDEN // WORLD
    for rank in results:
        aten, routed = rank["mlp"]["aten"], rank["mlp"]["override"]
        for run in (aten, routed):
            assert run["err"] <= FP32_TOLERANCE, run["err"]
            assert max(run["grad_err"].values()) <= FP32_TOLERANCE, run["grad_err"]
            assert run["x_grad_err"] <= FP32_TOLERANCE, run["x_grad_err"]
        for name, grad in routed["grads"].items():
            assert _rel_err(grad, aten["grads"][name]) <= FP32_TOLERANCE, name
        # The same collectives, and at least the all-reduce of RowwiseParallel's output.
        assert routed["comms"] == aten["comms"] and aten["comms"], (routed["comms"],
                                                                     aten["comms"])
        # Both linears routed (with their bias); tgemm ran on the shards: the forward's two
        # products and the backward's four (weight and input gradients of both), each with the
        # sharded hidden dim at its local size.
        assert routed["counts"]["addmm"] == 2 and routed["counts"]["fallback"] == 0, routed
        assert aten["launches"] == []
        assert len(routed["launches"]) == 6, routed["launches"]
        for launch in routed["launches"]:
            assert shard in launch and MLP_HIDDEN not in launch, routed["launches"]
        # The aten level: the same values and collectives, every local product on tgemm.
        below = rank["mlp"]["override aten"]
        assert below["comms"] == aten["comms"], (below["comms"], aten["comms"])
        for name, grad in below["grads"].items():
            assert _rel_err(grad, aten["grads"][name]) <= FP32_TOLERANCE, name
        assert below["err"] <= FP32_TOLERANCE and below["x_grad_err"] <= FP32_TOLERANCE
        assert below["counts"]["fallback"] == 0 and len(below["launches"]) >= 6, below
        for launch in below["launches"]:
            assert shard in launch and MLP_HIDDEN not in launch, below["launches"]


def _assert_llama(results: list[dict[str, Any]]) -> None:
    for rank in results:
        llama, runs = rank["llama"], rank["llama"]["runs"]
        size, dtype = Size(**llama["size"]), llama["dtype"]
        one_device = Results(*runs["one device"]["results"])
        sharded = Results(*runs["tensor parallel"]["results"])
        # Against the same sharding on aten (only the GEMMs differ): the dtype's tolerance.
        # Against one device: twice that in bf16, where the row-parallel layers round each
        # rank's partial sum before the all-reduce adds them.
        for name in ("override", "override aten"):
            got = Results(*runs[name]["results"])
            assert_close_results(got, sharded, dtype)
            assert_close_results(got, one_device, dtype, 1.0 if dtype == torch.float32 else 2.0)
        assert_close_results(sharded, one_device, dtype, 1.0 if dtype == torch.float32 else 2.0)
        # Python level: each layer's 7 projections and lm_head, all through F.linear without
        # bias; nothing left to PyTorch. Versions of transformers that compute the rotary
        # embedding's angles as a matmul (inv_freq [.., D/2, 1] @ positions [.., 1, S], K = 1)
        # route that one too, as a folded bmm with no gradient.
        counts = runs["override"]["counts"]
        assert counts["mm"] == 7 * size.layers + 1 and counts["fallback"] == 0, counts
        assert counts["bmm"] <= 1, counts
        assert sum(runs["override aten"]["counts"].values()) > 0
        assert runs["override aten"]["counts"]["fallback"] == 0, runs["override aten"]["counts"]
        assert runs["tensor parallel"]["launches"] == []
        # tgemm ran the sharded projections on their local shards: the MLP's on half the
        # intermediate size, never on all of it.
        for name in ("override", "override aten"):
            launches = [launch for launch in runs[name]["launches"] if launch[1] != 1]
            rotary = [launch for launch in runs[name]["launches"] if launch[1] == 1]
            # forward, input and weight gradients of every projection and of lm_head
            assert len(launches) == 3 * (7 * size.layers + 1), (name, launches)
            assert len(rotary) <= 1 and all(launch[2] == size.seq for launch in rotary), rotary
            assert not any(size.intermediate in launch for launch in launches), launches
            assert any(size.intermediate // WORLD in launch for launch in launches), launches


# A loop bounded by a scalar argument, in Triton's interpreter: what every tgemm kernel runs.
_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def count(out_ptr, n):
    total = 0
    for _ in range(0, n):
        total += 1
    tl.store(out_ptr, total)
out = torch.zeros(1, dtype=torch.int32)
count[(1,)](out, 3)
assert out.item() == 3
"""


@pytest.fixture(scope="module")
def cpu_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not tgemm_device.interpreter_enabled():
        # This session runs compiled kernels; the CPU ranks need Triton's interpreter. Some
        # pairings cannot run it (Triton 3.6's interpreter with numpy 2.5 fails on every loop
        # bounded by a scalar argument): then the ranks could only fail inside Triton.
        probe = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], capture_output=True,
                               text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
            pytest.skip(f"Triton's interpreter cannot run tgemm's loops here: {last}")
    return _run_ranks(tmp_path_factory.mktemp("tp"), "gloo")


def test_mm_sharding_rules(cpu_ranks):
    _assert_mm(cpu_ranks)


def test_grouped_mm_sharding_rules(cpu_ranks):
    _assert_grouped(cpu_ranks)


def test_scaled_mm_sharding_rules(cpu_ranks):
    _assert_scaled(cpu_ranks, FP32_TOLERANCE)


def test_tensor_parallel_mlp_under_override(cpu_ranks):
    _assert_mlp(cpu_ranks)


def test_tensor_parallel_llama_under_override(cpu_ranks):
    _assert_llama(cpu_ranks)


class _Tagged(torch.Tensor):
    """A tensor subclass of the kind override() leaves to PyTorch (not a DTensor)."""


def test_other_tensor_subclasses_fall_through(device):
    a = torch.randn(8, 16, device=device).as_subclass(_Tagged)
    b = torch.randn(16, 8, device=device)
    with tg.override() as ov:
        out = a @ b
    assert ov.counts["fallback"] == 1 and ov.counts["mm"] == 0, ov.counts
    assert type(out) is _Tagged
    ref = a.as_subclass(torch.Tensor).double() @ b.double()
    assert _rel_err(out.as_subclass(torch.Tensor), ref) <= 1e-3  # tf32 allowed on a GPU


@pytest.mark.gpu
def test_tensor_parallel_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs for NCCL ranks, found {torch.cuda.device_count()}")
    results = _run_ranks(tmp_path, "nccl")
    _assert_mm(results)
    _assert_grouped(results)
    _assert_scaled(results, 1e-3)
    _assert_mlp(results)
    _assert_llama(results)


# Sharding propagation computes an op's output metadata on FakeTensors (torch 2.11 builds them on
# the CPU whatever the mesh's device), outside any graph; tracing that records the kernels must
# still refuse tensors they cannot run on. Run with compiled Triton (the ops are triton_ops).
_METADATA_SCRIPT = """
import torch, torch_triton_gemm as tg
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
with FakeTensorMode(), disable_proxy_modes_tracing():
    a = torch.empty(6, 8, dtype=torch.bfloat16)
    w = torch.empty(10, 8, dtype=torch.bfloat16)
    out = torch.ops.tgemm.mm(a, w.t(), None, "relu", torch.float32)
    print("mm", tuple(out.shape), out.stride(), out.dtype, out.device.type)
    ga, gb = torch.empty(3, 6, 8, dtype=torch.float16), torch.empty(3, 8, 5, dtype=torch.float16)
    out = torch.ops.tgemm.grouped_mm(ga, gb)
    print("grouped_mm", tuple(out.shape), out.dtype)
    fa = torch.empty(16, 32, dtype=torch.float8_e4m3fn)
    fb = torch.empty(16, 32, dtype=torch.float8_e4m3fn).t()
    one = torch.empty((), dtype=torch.float32)
    out = torch.ops.tgemm.scaled_mm(fa, fb, one, one, None, torch.bfloat16)
    print("scaled_mm", tuple(out.shape), out.dtype)
    try:
        torch.ops.tgemm.mm(a, torch.empty(7, 10, dtype=torch.bfloat16))
    except RuntimeError as error:
        print("checked:", str(error).splitlines()[0])
with FakeTensorMode():
    a, w = torch.empty(6, 8), torch.empty(10, 8)
try:
    # Functional tracing (what AOT and Inductor run) traces the op's body, kernels included.
    make_fx(dispatch_functionalize(lambda x, y: torch.ops.tgemm.mm(x, y.t())),
            tracing_mode="fake")(a, w)
except RuntimeError as error:
    print("traced:", str(error).splitlines()[0])
"""


def test_metadata_of_cpu_fake_tensors_without_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _METADATA_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines == [
        "mm (6, 10) (10, 1) torch.float32 cpu",
        "grouped_mm (3, 6, 5) torch.float16",
        "scaled_mm (16, 16) torch.bfloat16",
        "checked: tgemm::mm: a has 8 columns but b has 7 rows (a is (6, 8), b is (7, 10))",
        "traced: tgemm::mm: CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 "
        "before importing torch_triton_gemm (slow; meant for small sizes), or move the tensors to "
        "a CUDA GPU",
    ], proc.stdout
