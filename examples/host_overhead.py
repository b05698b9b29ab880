"""Host time of one eager call: torch.mm against tgemm's entry points, in microseconds per call.

A small GEMM finishes on the GPU in a few microseconds, so an eager call costs what the host
spends on it: argument checks, dispatch, and the kernel launch. This script times each entry
point on tiny operands, in a loop that the GPU keeps up with:

- ``torch.mm`` (cuBLAS), for reference;
- ``tg.mm``: the package function, which launches directly for plain eager calls;
- ``torch.ops.tgemm.mm``: the registered op, through PyTorch's dispatcher (what graphs call);
- the op with ``requires_grad`` operands and under ``torch.inference_mode()``;
- the op body called directly, and the same op registered as a bare ``triton_op`` (what the
  dispatcher costs without the light eager kernels of ``define_triton_op``).

Without a GPU (and without TRITON_INTERPRET) the kernels cannot run, so the launch itself is
replaced by a no-op and the numbers show the dispatch, checks and allocation alone.

    python examples/host_overhead.py [--calls 2000] [--size 64] [--dtypes bf16,fp16,fp32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import torch_triton_gemm as tg
from torch_triton_gemm.ops import mm as mm_module
from torch_triton_gemm.ops._registry import define_triton_op

GPU = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def per_call_us(cases: dict[str, Callable[[], object]], calls: int,
                rounds: int = 7) -> dict[str, float]:
    """Best host time per call of each case over ``rounds`` interleaved loops of ``calls`` calls.

    A loop does not wait for the GPU, so on a GPU the number is host time while the GPU keeps
    up. Without a GPU it is this thread's CPU time, which other busy processes disturb less than
    wall time.
    """
    clock = time.perf_counter if GPU else time.thread_time
    for fn in cases.values():
        for _ in range(min(calls, 200)):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for case, fn in cases.items():
            if GPU:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(calls):
                fn()
            best[case] = min(best[case], (clock() - start) / calls * 1e6)
    if GPU:
        torch.cuda.synchronize()
    return best


def _in_inference_mode(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.inference_mode():
            return fn()
    return run


def entry_points(a: torch.Tensor, b: torch.Tensor,
                 bare: Callable[..., torch.Tensor]) -> dict[str, Callable[[], object]]:
    """One call of each entry point on ``a @ b``, by name."""
    a_grad = a.clone().requires_grad_()
    op = torch.ops.tgemm.mm
    return {
        "torch.mm": lambda: torch.mm(a, b),
        "tg.mm": lambda: tg.mm(a, b),
        "tg.mm, grad": lambda: tg.mm(a_grad, b),
        "torch.ops.tgemm.mm": lambda: op(a, b, None, "none", None),
        "torch.ops.tgemm.mm, grad": lambda: op(a_grad, b, None, "none", None),
        "torch.ops.tgemm.mm, inference": _in_inference_mode(lambda: op(a, b, None, "none", None)),
        "op body, called directly": lambda: mm_module.mm_eager_call(a, b, None, "none", None),
        "bare triton_op (no eager kernels)": lambda: bare(a, b, None, "none", None),
        "bare triton_op, grad": lambda: bare(a_grad, b, None, "none", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--size", type=int, default=64 if GPU else 8, help="M = N = K")
    args = parser.parse_args()

    device = "cuda" if GPU else "cpu"
    if not GPU:
        if tg.device.interpreter_enabled():
            raise SystemExit("unset TRITON_INTERPRET: the interpreter's launches would dominate")
        # No GPU: time everything but the launch (CPU tensors pass the device check, and
        # the launches, first and kept, do nothing).
        tg.device.kernel_device_error = lambda device: None
        mm_module.run_launch = mm_module.run_kept = lambda *a, **k: None
        print("no GPU: kernel launches replaced by a no-op\n")
    # The same op body, registered without eager kernels: what a bare triton_op costs.
    bare = define_triton_op("tgemm_host_overhead::mm", mm_module._mm_impl, mm_module._mm_fake)
    bare.register_autograd(mm_module._backward, setup_context=mm_module._setup_context)

    dtypes = args.dtypes.split(",")
    columns: list[dict[str, float]] = []
    for name in dtypes:
        a = torch.randn(args.size, args.size, device=device, dtype=DTYPES[name])
        b = torch.randn(args.size, args.size, device=device, dtype=DTYPES[name])
        columns.append(per_call_us(entry_points(a, b, bare), args.calls))
    print(f"{'us per call, ' + str(args.size) + '^3':34s}" + "".join(f"{d:>9s}" for d in dtypes))
    for case in columns[0]:
        print(f"{case:34s}" + "".join(f"{column[case]:9.1f}" for column in columns))


if __name__ == "__main__":
    main()
