"""A mixture-of-experts layer on tgemm.grouped_mm: forward and backward, eager and compiled.

Each token goes to its top-k experts. The token slots are sorted by expert, so every expert's
SwiGLU MLP reads one contiguous block of rows: ``offs`` holds the blocks' cumulative ends, and
each projection of all experts is one grouped_mm launch (weights stored [G, N, K], the
nn.Linear way, and passed transposed). The backward pass is grouped_mm again (input gradients
in the same form, weight gradients in the 2-D x 2-D form). Routing stays on the device: no host
sync, so the layer compiles into one graph.

The layer's output and gradients are checked against a float64 per-expert loop, eager and under
torch.compile. On a CUDA GPU it also times a training step against the same layer on
torch._grouped_mm. Without a GPU it runs a tiny layer in Triton's CPU interpreter.

    python examples/moe.py [--tokens 4096 --dim 1024 --hidden 2048 --experts 8 --top-k 2]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

GPU = torch.cuda.is_available()
if not GPU:
    # Must be set before the package (and its kernels) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch_triton_gemm as tg  # noqa: E402

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoE(torch.nn.Module):
    """Top-k routed experts, each a SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int,
                 grouped_mm: GroupedMM = tg.grouped_mm, **factory) -> None:
        super().__init__()
        self.top_k, self.grouped_mm = top_k, grouped_mm
        self.router = torch.nn.Linear(dim, experts, bias=False, **factory)
        # Gate and up projections stacked, [G, 2 * hidden, dim]; down, [G, dim, hidden].
        self.w13 = torch.nn.Parameter(torch.randn(experts, 2 * hidden, dim, **factory) / dim**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden, **factory) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        slots = experts.flatten()                      # expert of each (token, k) slot
        order = slots.argsort(stable=True)              # slots sorted by expert
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, slots, torch.ones_like(slots))
        offs = counts.cumsum(0).to(torch.int32)         # cumulative ends, on the device
        rows = x[order // self.top_k]                   # [T * k, dim], grouped by expert
        gate, up = self.grouped_mm(rows, self.w13.transpose(-2, -1), offs).chunk(2, dim=-1)
        y = self.grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs)
        y = y * weights.flatten()[order, None]
        # Back to (token, k) order, then sum each token's k slots: no atomics, deterministic.
        return y[order.argsort()].view(x.shape[0], self.top_k, -1).sum(1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router(x).float().softmax(dim=-1)
        weights, experts = scores.topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer in float64, one expert at a time (routing taken from ``moe``)."""
    weights, experts = moe.route(x)
    x64, out = x.double(), x.new_zeros(x.shape, dtype=torch.float64)
    w13, w2 = moe.w13.double(), moe.w2.double()
    for e in range(w13.shape[0]):
        token, k = (experts == e).nonzero(as_tuple=True)
        gate, up = (x64[token] @ w13[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t() * weights[token, k, None].double()
        out = out.index_add(0, token, y)
    return out


def check(name: str, moe: MoE, forward: Callable[[torch.Tensor], torch.Tensor],
          x: torch.Tensor, budget: float) -> None:
    """Forward and backward of ``forward`` against the float64 reference."""
    params = (moe.w13, moe.w2)
    x = x.detach().requires_grad_()
    out = forward(x)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, *params), grad_out)
    ref = reference(moe, x)
    ref_grads = torch.autograd.grad(ref, (x, *params), grad_out.double())
    errors = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(grads, ref_grads)]
    print(f"{name}: relative error vs float64 — out {errors[0]:.1e}, grad x {errors[1]:.1e}, "
          f"grad w13 {errors[2]:.1e}, grad w2 {errors[3]:.1e}")
    assert max(errors) <= budget, errors


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096 if GPU else 24)
    parser.add_argument("--dim", type=int, default=1024 if GPU else 32)
    parser.add_argument("--hidden", type=int, default=2048 if GPU else 16)
    parser.add_argument("--experts", type=int, default=8 if GPU else 4)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    factory = dict(device=device, dtype=dtype)
    moe = MoE(args.dim, args.hidden, args.experts, args.top_k, **factory)
    x = torch.randn(args.tokens, args.dim, **factory)
    budget = 3e-2 if dtype == torch.bfloat16 else 1e-3

    check("eager", moe, moe, x, budget)
    try:
        compiled = torch.compile(moe, fullgraph=True)
        check("torch.compile(fullgraph=True)", moe, compiled, x, budget)
    except Exception as e:  # noqa: BLE001 - CPU builds without a working C++ toolchain
        if GPU:
            raise
        print(f"torch.compile unavailable on this CPU host ({type(e).__name__}); eager only")

    if not GPU:
        print("No CUDA GPU: ran in Triton's CPU interpreter (correctness only, not speed).")
        return

    import triton

    peer = MoE(args.dim, args.hidden, args.experts, args.top_k,
               grouped_mm=lambda a, b, offs: torch._grouped_mm(a, b, offs), **factory)
    peer.load_state_dict(moe.state_dict())
    x = x.detach().requires_grad_()
    for name, layer in (("tgemm", moe), ("tgemm compiled", torch.compile(moe)),
                        ("torch._grouped_mm", peer)):
        def step(layer=layer) -> None:
            layer(x).square().mean().backward()

        ms = triton.testing.do_bench(step)
        print(f"{name:>18}: forward + backward {ms:.3f} ms")


if __name__ == "__main__":
    main()
