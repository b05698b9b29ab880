"""Quickstart: a fused Linear + bias + GELU on tgemm, checked against PyTorch and timed.

On a CUDA GPU it runs a Llama-sized projection (M=4096 tokens, 4096 -> 14336) in bf16 and prints
TFLOP/s for tgemm and torch. Without a GPU it switches Triton to its CPU interpreter and runs a
small problem instead (correctness only; the interpreter is slow).

    python examples/quickstart.py [--m 4096 --n 14336 --k 4096]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096 if GPU else 48)
    parser.add_argument("--n", type=int, default=14336 if GPU else 80)
    parser.add_argument("--k", type=int, default=4096 if GPU else 64)
    args = parser.parse_args()

    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    x = torch.randn(args.m, args.k, device=device, dtype=dtype)
    linear = torch.nn.Linear(args.k, args.n, device=device, dtype=dtype)

    with torch.no_grad():
        out = tg.mm(x, linear.weight.t(), linear.bias, activation="gelu")
        ref = torch.nn.functional.gelu(
            x.double() @ linear.weight.double().t() + linear.bias.double(), approximate="tanh")
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"tgemm.mm(x, W.t(), bias, 'gelu'): shape {tuple(out.shape)} {out.dtype} on {device}, "
          f"relative error vs float64 {err:.2e}")

    if not GPU:
        print("No CUDA GPU: ran in Triton's CPU interpreter (correctness only, not speed).")
        return

    import triton

    flops = 2 * args.m * args.n * args.k
    with torch.no_grad():
        ms_tgemm = triton.testing.do_bench(
            lambda: tg.mm(x, linear.weight.t(), linear.bias, activation="gelu"),
            return_mode="median")
        ms_torch = triton.testing.do_bench(
            lambda: torch.nn.functional.gelu(linear(x), approximate="tanh"), return_mode="median")
    print(f"tgemm (fused):      {ms_tgemm:.3f} ms  {flops / ms_tgemm * 1e-9:.0f} TFLOP/s")
    print(f"torch linear+gelu:  {ms_torch:.3f} ms  {flops / ms_torch * 1e-9:.0f} TFLOP/s")
    print(f"speed-up: {ms_torch / ms_tgemm:.2f}x")


if __name__ == "__main__":
    main()
