"""The moe suite: ``torch_triton_gemm.moe_mlp`` against the unfused MoE MLP that PyTorch code
writes with ``torch._grouped_mm``. Needs a CUDA GPU.

The unfused peer sorts the token slots by expert, copies the tokens' rows into that order,
runs the gate/up and down projections as two torch._grouped_mm calls with SwiGLU between
them, scales each slot's row by its router weight and adds the rows back to their tokens with
index_add. moe_mlp does the same block in two fused launches (gathered rows, SwiGLU epilogue;
then the sorted slots times w2) and a combine kernel (each token's slot rows times their
router weights, summed). Both get the same inputs;
rows report speed, the peak memory a call adds on top of its inputs, and moe_mlp's error
against a per-expert fp32 loop (fwd+bwd: the worst of its four gradients).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import torch_triton_gemm as tg

from .gemm import ieee_fp32
from .results import GemmResult
from .suites import MoECase
from .timing import Row, TimingSettings, compare, first_call, run_rows, short_error


def missing_reason() -> str | None:
    """Why the suite cannot run with this package or torch, or None."""
    if not hasattr(tg, "moe_mlp"):
        return "torch_triton_gemm has no moe_mlp in this version"
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm (the peer)"
    return None


def unfused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The unfused block: routing, a row copy, two torch._grouped_mm, SwiGLU, weighted
    index_add (no host sync)."""
    experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    tokens = order // top_k
    gate, up = torch._grouped_mm(x[tokens], w13.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
    y = y * weights.flatten()[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, tokens, y)


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """The block in fp32, one expert at a time (differentiable)."""
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[token].float() @ w13[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].float().t() * weights[token, slot, None].float()
        out = out.index_add(0, token, y)
    return out


def make_inputs(case: MoECase, device: torch.device) -> tuple[Any, ...]:
    """Fresh bf16 inputs (x, w13, w2, ids, weights), with grad_out for fwd+bwd rows; routing
    from a softmax over random logits, top-k weights renormalised (as Mixtral and Qwen3-MoE)."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    t, e, h, i = case.tokens, case.experts, case.hidden, case.inter
    x = torch.randn(t, h, **bf16)
    w13 = torch.randn(e, 2 * i, h, **bf16) * h ** -0.5
    w2 = torch.randn(e, h, i, **bf16) * i ** -0.5
    probs = torch.randn(t, e, device=device).softmax(-1)
    weights, ids = probs.topk(case.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    if case.form == "fwd":
        return x, w13, w2, ids, weights
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights)]
    return leaves[0], leaves[1], leaves[2], ids, leaves[3], torch.randn(t, h, **bf16)


def _with_backward(block: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def step(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = block(x, w13, w2, ids, weights)
        return torch.autograd.grad(out, (x, w13, w2, weights), grad_out)

    return step


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _reference_error(case: MoECase, args: tuple[Any, ...], out: Any) -> float:
    with ieee_fp32():
        if case.form == "fwd":
            with torch.no_grad():
                return _rel_error(out, reference_moe(*args))
        x, w13, w2, ids, weights, grad_out = args
        leaves = [t.detach().float().requires_grad_() for t in (x, w13, w2, weights)]
        ref = reference_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        ref_grads = torch.autograd.grad(ref, leaves, grad_out.float())
        return max(_rel_error(g, r) for g, r in zip(out, ref_grads))


def peak_mib(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    """MiB that one call of ``fn`` allocates on top of what is allocated before it (its
    output and temporaries, at their peak)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def measure_moe(case: MoECase, settings: TimingSettings, device: torch.device) -> GemmResult:
    """Time moe_mlp and the unfused peer on the same inputs, with their peak memory."""
    args = make_inputs(case, device)
    fns: dict[str, Callable[..., Any]] = {"tgemm": tg.moe_mlp, "torch": unfused_moe}
    if case.form == "fwd+bwd":
        fns = {name: _with_backward(fn) for name, fn in fns.items()}
    out, first_s = first_call(lambda: fns["tgemm"](*args))
    rel_err = _reference_error(case, args, out)
    del out
    notes = []
    try:
        fns["torch"](*args)
    except Exception as exc:  # reported as n/a: a torch whose _grouped_mm cannot run it
        notes.append(f"unfused torch n/a ({short_error(exc)})")
        del fns["torch"]
    peaks = {name: peak_mib(fn, args) for name, fn in fns.items()}
    # Tens of milliseconds of large grouped GEMMs per call: the clocks show a power limit.
    timings = compare(fns, args, dataclasses.replace(settings, sample_clocks=True))
    return GemmResult(case, "bf16", timings.kernel_ms, timings.eager_ms, rel_err, "fp32 loop",
                      first_s, note="; ".join(notes + timings.notes), peak_mib=peaks,
                      sm_mhz=timings.sm_mhz, power_w=timings.power_w)


def run_moe(cases: Sequence[MoECase], settings: TimingSettings,
            device: torch.device) -> list[GemmResult]:
    """Every case of the moe suite."""
    return run_rows([
        Row(case.label(),
            lambda c=case: measure_moe(c, settings, device),
            lambda message, c=case: GemmResult(c, "bf16", error=message))
        for case in cases])
