"""The grouped suite: ``torch_triton_gemm.grouped_mm`` against ``torch._grouped_mm`` and against a
Python loop of ``torch.mm`` (what MoE code without a grouped kernel does). Needs a CUDA GPU.

Both ops share one contract, ``grouped_mm(a, b, offs=None, bias=None, out_dtype=None)``, with
``offs`` the int32 cumulative row (or, for 2D x 2D, K) ends of the groups. The weights are stored
[G, N, K] and passed transposed, the nn.Linear way. Accuracy is checked against fp32 (IEEE)
products per group: of the output, or for fwd+bwd rows of both gradients.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

import torch_triton_gemm as tg

from .gemm import ieee_fp32, relative_error_of_pieces
from .results import GemmResult
from .suites import GroupedCase
from .timing import Row, TimingSettings, compare, first_call, run_rows, short_error


def missing_reason() -> str | None:
    """Why the suite cannot run with this package, or None."""
    if not hasattr(tg, "grouped_mm"):
        return "torch_triton_gemm has no grouped_mm in this version"
    return None


# The loops split tensors with split / unbind rather than slicing them, so that their backward
# passes gather the pieces' gradients with one cat / stack instead of one full-size zero tensor
# per group; as MoE code with one weight per expert would.

def loop_forward(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """out[rows of g] = a[rows of g] @ b[g], one torch.mm per non-empty group (no autograd)."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    for x, w, o in zip(a.split(sizes), b.unbind(0), out.split(sizes)):
        if x.shape[0]:
            torch.mm(x, w, out=o)
    return out


def loop_forward_autograd(a: torch.Tensor, b: torch.Tensor,
                          sizes: Sequence[int]) -> torch.Tensor:
    """The same product, differentiable: one mm per group, then torch.cat."""
    return torch.cat([x @ w for x, w in zip(a.split(sizes), b.unbind(0))])


def loop_wgrad(x_t: torch.Tensor, dy: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """out[g] = x_t[:, columns of g] @ dy[rows of g]: the 2D x 2D form (zeros for empty
    groups)."""
    out = dy.new_empty(len(sizes), x_t.shape[0], dy.shape[1])
    for x, d, o in zip(x_t.split(sizes, dim=1), dy.split(sizes), out.unbind(0)):
        torch.mm(x, d, out=o)
    return out


def _ops(case: GroupedCase, sizes: Sequence[int]) -> dict[str, Callable[..., torch.Tensor]]:
    """The three implementations of the case's product, as op(a, b, offs)."""
    if case.form == "wgrad":
        loop = lambda a, b, offs: loop_wgrad(a, b, sizes)
    elif case.form == "fwd":
        loop = lambda a, b, offs: loop_forward(a, b, sizes)
    else:
        loop = lambda a, b, offs: loop_forward_autograd(a, b, sizes)
    return {
        "tgemm": lambda a, b, offs: tg.grouped_mm(a, b, offs=offs),
        "torch": lambda a, b, offs: torch._grouped_mm(a, b, offs=offs),
        "loop": loop,
    }


def _with_backward(op: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """fn(a, w, offs, grad_out): the forward on b = w transposed, then the grads of a and w."""
    def step(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
             grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = op(a, w.transpose(-2, -1), offs)
        return torch.autograd.grad(out, (a, w), grad_out)

    return step


def make_inputs(case: GroupedCase, device: torch.device) -> tuple[Any, ...]:
    """Fresh random bf16 inputs: (a, b, offs), or (a, w, offs, grad_out) for fwd+bwd rows."""
    sizes = case.group_sizes()
    offs = torch.tensor(list(itertools.accumulate(sizes)), device=device, dtype=torch.int32)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    t, g, n, k = case.tokens, case.groups, case.n, case.k
    if case.form == "wgrad":
        x, dy = torch.randn(t, k, **bf16), torch.randn(t, n, **bf16)
        return x.t(), dy, offs
    a, w = torch.randn(t, k, **bf16), torch.randn(g, n, k, **bf16)
    if case.form == "fwd":
        return a, w.transpose(-2, -1), offs
    return a.requires_grad_(), w.requires_grad_(), offs, torch.randn(t, n, **bf16)


def _reference_error(case: GroupedCase, sizes: Sequence[int], args: tuple[Any, ...],
                     out: Any) -> float:
    """tgemm's relative error against fp32 products, group by group."""
    with ieee_fp32(), torch.no_grad():
        if case.form == "wgrad":
            x_t, dy, _ = args
            return relative_error_of_pieces(
                (o, x.float() @ d.float())
                for o, x, d in zip(out.unbind(0), x_t.split(sizes, dim=1), dy.split(sizes)))
        if case.form == "fwd":
            a, b, _ = args
            return relative_error_of_pieces(
                (o, x.float() @ w.float())
                for o, x, w in zip(out.split(sizes), a.split(sizes), b.unbind(0)) if x.numel())
        a, w, _, grad_out = args
        grad_a, grad_w = out
        pieces = list(zip(a.split(sizes), w.unbind(0), grad_out.split(sizes)))
        err_a = relative_error_of_pieces(
            (ga, g.float() @ wg.float())
            for ga, (x, wg, g) in zip(grad_a.split(sizes), pieces) if x.numel())
        err_w = relative_error_of_pieces(
            (gw, g.float().t() @ x.float()) for gw, (x, _, g) in zip(grad_w.unbind(0), pieces))
        return max(err_a, err_w)


def measure_grouped(case: GroupedCase, settings: TimingSettings,
                    device: torch.device) -> GemmResult:
    """Time the three implementations on the same inputs; torch._grouped_mm is left out (with
    a note) where this torch cannot run the case."""
    sizes = case.group_sizes()
    args = make_inputs(case, device)
    fns = _ops(case, sizes)
    if case.form == "fwd+bwd":
        fns = {name: _with_backward(op) for name, op in fns.items()}
    out, first_s = first_call(lambda: fns["tgemm"](*args))
    rel_err = _reference_error(case, sizes, args, out)
    del out
    notes = []
    try:
        fns["torch"](*args)
    except Exception as exc:  # reported as n/a: an older torch, or a form it lacks
        notes.append(f"torch._grouped_mm n/a ({short_error(exc)})")
        del fns["torch"]
    timings = compare(fns, args, settings)
    return GemmResult(case, "bf16", timings.kernel_ms, timings.eager_ms, rel_err, "fp32",
                      first_s, note="; ".join(notes + timings.notes))


def run_grouped(cases: Sequence[GroupedCase], settings: TimingSettings,
                device: torch.device) -> list[GemmResult]:
    """Every case of the grouped suite."""
    return run_rows([
        Row(case.label(),
            lambda c=case: measure_grouped(c, settings, device),
            lambda message, c=case: GemmResult(c, "bf16", error=message))
        for case in cases])
