"""A Hugging Face Mixtral sparse-MoE block with its experts on tgemm.moe_mlp.

transformers' ``MixtralExperts`` stores every expert's gate and up projections stacked as
``gate_up_proj`` [E, 2I, H] and the down projections as ``down_proj`` [E, H, I]: exactly
moe_mlp's w13 and w2. Swapping the experts' forward for one moe_mlp call (two fused grouped
launches: gathered token rows, SwiGLU epilogue, router weights and top-k combine) keeps the
router, the parameters and the block's output. This script builds a block from a small config
with random weights, swaps a copy's experts, and checks the output and the gradients of the
input, the expert weights and the router's weight (through topk_weights) against the original
block. On a CUDA GPU it also times forward + backward of both.

    python examples/moe_mlp_hf.py [--tokens 4096 --hidden 1024 --intermediate 2048 --experts 8]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    # Must be set before the package (and its kernels) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

import torch_triton_gemm as tg  # noqa: E402


class TgemmExperts(torch.nn.Module):
    """transformers' MixtralExperts on tgemm.moe_mlp, sharing its parameters."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return tg.moe_mlp(hidden_states, self.gate_up_proj, self.down_proj, top_k_index,
                          top_k_weights)


def build_block(args: argparse.Namespace, device: str, dtype: torch.dtype,
                experts_implementation: str = "eager") -> torch.nn.Module:
    """A block with random weights; ``experts_implementation``: transformers' per-expert loop
    ("eager") or its torch._grouped_mm path ("grouped_mm")."""
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                           hidden_act="silu", experts_implementation=experts_implementation)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():  # the experts' parameters start uninitialised
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype)


class SameExperts(torch.nn.Module):
    """A router that chooses the experts given (those the block under test chose) and weighs
    them as Mixtral's router does, in its own parameters' precision: a float64 reference that
    routes like a bf16 block, whose router could otherwise break near-ties differently."""

    def __init__(self, gate: torch.nn.Module, indices: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.indices = gate.weight, indices

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        chosen = logits.softmax(dim=-1).gather(1, self.indices)
        return logits, chosen / chosen.sum(dim=-1, keepdim=True), self.indices


def outputs_and_grads(block: torch.nn.Module, x: torch.Tensor,
                      grad_out: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = block(x)
    params = (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight)
    return [out, *torch.autograd.grad(out, (x, *params), grad_out)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096 if GPU else 24)
    parser.add_argument("--hidden", type=int, default=1024 if GPU else 32)
    parser.add_argument("--intermediate", type=int, default=2048 if GPU else 32)
    parser.add_argument("--experts", type=int, default=8 if GPU else 4)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    if not GPU:
        torch.set_float32_matmul_precision("highest")
    block = build_block(args, device, dtype)
    swapped = copy.deepcopy(block)
    swapped.experts = TgemmExperts(swapped.experts)

    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    grad_out = torch.randn_like(x)
    ours = outputs_and_grads(swapped, x, grad_out)
    # The reference: the original block (its per-expert loop) in float64, routed to the same
    # experts.
    reference_block = copy.deepcopy(block).double()
    with torch.no_grad():
        _, _, chosen = swapped.gate(x.view(-1, args.hidden))
    reference_block.gate = SameExperts(reference_block.gate, chosen)
    reference = outputs_and_grads(reference_block, x.double(), grad_out.double())
    budget = 3e-2 if dtype == torch.bfloat16 else 1e-4
    names = ("out", "grad x", "grad gate_up_proj", "grad down_proj", "grad router")
    errors = [rel_error(o, r) for o, r in zip(ours, reference)]
    print("moe_mlp vs the original Mixtral block in float64, relative error: "
          + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors)))
    assert max(errors) <= budget, errors

    if not GPU:
        print("No CUDA GPU: ran in Triton's CPU interpreter (correctness only, not speed).")
        return

    import triton

    grouped = build_block(args, device, dtype, "grouped_mm")
    grouped.load_state_dict(block.state_dict())
    x = x.detach().requires_grad_()
    for name, layer in (("transformers, per-expert loop", block),
                        ("transformers, torch._grouped_mm", grouped),
                        ("tgemm.moe_mlp", swapped)):
        def step(layer=layer) -> None:
            layer(x).float().square().mean().backward()

        ms = triton.testing.do_bench(step)
        print(f"{name:>32}: forward + backward {ms:.3f} ms")


if __name__ == "__main__":
    main()
