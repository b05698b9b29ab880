"""Scaled fp8 / fp4 GEMMs: quantize a Linear layer's input and weight with each recipe and run
tgemm.scaled_mm, checked against a float64 dequantize-then-matmul reference.

On a CUDA GPU it runs a Llama-sized projection (M=2048 tokens, 4096 -> 14336) and prints TFLOP/s
for each recipe, next to torch._scaled_mm where torch supports the recipe and to a bf16 tgemm.mm.
Without a GPU it switches Triton to its CPU interpreter and runs a small problem instead
(correctness only; the interpreter is slow).

    python examples/fp8.py [--m 2048 --n 14336 --k 4096]
"""

from __future__ import annotations

import argparse
import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    # Must be set before the package (and its kernels) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch_triton_gemm as tg  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")


def run_recipe(recipe: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               exact: torch.Tensor, flops: int) -> str:
    """Quantize x and the weight with ``recipe``, run scaled_mm, and describe the result."""
    # x is the a operand [M, K]; the weight goes in as b = W.t() [K, N], K-major.
    xq, x_scale = tg.quantize(x, recipe, "a")
    wq, w_scale = tg.quantize(weight.t(), recipe, "b")
    out = tg.scaled_mm(xq, wq, x_scale, w_scale, bias, out_dtype=torch.bfloat16)
    ref = (tg.dequantize(xq, x_scale, recipe, "a") @ tg.dequantize(wq, w_scale, recipe, "b")
           + bias.double())
    err = ((out.double() - ref).norm() / ref.norm()).item()
    quant_err = ((ref - exact).norm() / exact.norm()).item()
    line = (f"{recipe:>11}: a {tuple(xq.shape)} {str(xq.dtype)[6:]}, scale_a "
            f"{tuple(x_scale.shape)} {str(x_scale.dtype)[6:]}; error vs the dequantized "
            f"product {err:.1e} (quantization itself: {quant_err:.1e})")
    if GPU:
        from triton.testing import do_bench

        ms = do_bench(lambda: tg.scaled_mm(xq, wq, x_scale, w_scale, bias), return_mode="median")
        line += f"; {flops / ms * 1e-9:.0f} TFLOP/s"
        if recipe in ("tensorwise", "rowwise"):
            ms = do_bench(lambda: torch._scaled_mm(xq, wq, x_scale, w_scale, bias=bias,
                                                   out_dtype=torch.bfloat16),
                          return_mode="median")
            line += f" (torch._scaled_mm {flops / ms * 1e-9:.0f})"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=2048 if GPU else 48)
    parser.add_argument("--n", type=int, default=14336 if GPU else 80)
    parser.add_argument("--k", type=int, default=4096 if GPU else 256)
    args = parser.parse_args()

    device = "cuda" if GPU else "cpu"
    x = torch.randn(args.m, args.k, device=device, dtype=torch.bfloat16)
    linear = torch.nn.Linear(args.k, args.n, device=device, dtype=torch.bfloat16)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    exact = x.double() @ weight.double().t() + bias.double()
    flops = 2 * args.m * args.n * args.k
    if GPU:
        from triton.testing import do_bench

        ms = do_bench(lambda: tg.mm(x, weight.t(), bias), return_mode="median")
        print(f"{'bf16 tgemm.mm':>11}: {flops / ms * 1e-9:7.0f} TFLOP/s")

    for recipe in RECIPES:
        print(run_recipe(recipe, x, weight, bias, exact, flops))
    if not GPU:
        print("No CUDA GPU: ran in Triton's CPU interpreter (correctness only, not speed).")


if __name__ == "__main__":
    main()
