"""Training steps of a small Llama-style model with and without ``torch_triton_gemm.override()``.

The model is plain ``torch.nn`` (embedding, RMSNorm, attention with q/k/v/o ``nn.Linear`` and
``F.scaled_dot_product_attention``, a SwiGLU MLP, an ``lm_head``; defined in
``torch_triton_gemm/bench/model.py``, which the benchmark shares): nothing in it knows about
tgemm. Wrapping the step in ``override()`` moves every ``nn.Linear`` (forward and backward) onto
tgemm::mm: at the aten level for eager steps (it adds the least host time per GEMM, which a
model this small feels), at the Python level under ``--compile`` (the graph then holds tgemm
ops that Inductor schedules with the rest).

On a GPU it prints the median step time each way (CUDA events, after a warm-up that includes
tgemm's kernel compiles) and the losses. Without a GPU it runs one tiny step each way in Triton's
CPU interpreter and prints the losses; timings there mean nothing.

    python examples/dropin.py                          # GPU
    python examples/dropin.py --compile                # GPU, both runs under torch.compile
    python examples/dropin.py --level python           # GPU, eager, the Python-level override
    python examples/dropin.py --hidden 64 --layers 2   # CPU (no GPU found): tiny sizes by default
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

# Without a GPU, tgemm's kernels run in Triton's interpreter, which must be switched on before
# torch_triton_gemm (and so Triton's kernels) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch_triton_gemm as tg  # noqa: E402
from torch_triton_gemm.bench.model import TinyLlama, train_step  # noqa: E402
from torch_triton_gemm.device import interpreter_enabled  # noqa: E402

# The GPU when tgemm can run there (not under TRITON_INTERPRET=1), else the CPU interpreter.
GPU = torch.cuda.is_available() and not interpreter_enabled()


def run(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, steps: int, warmup: int,
        compile_model: bool) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps after ``warmup``; return the losses and step times (ms)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_model = torch.compile(model) if compile_model else model
    losses: list[float] = []
    times: list[float] = []
    for i in range(warmup + steps):
        if tokens.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = train_step(step_model, optimizer, tokens, targets)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            begin = time.perf_counter()
            loss = train_step(step_model, optimizer, tokens, targets)
            elapsed = (time.perf_counter() - begin) * 1e3
        if i >= warmup:
            losses.append(loss.item())
            times.append(elapsed)
    return losses, times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024 if GPU else 32)
    parser.add_argument("--heads", type=int, default=8 if GPU else 2)
    parser.add_argument("--layers", type=int, default=4 if GPU else 1)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default: 8/3 x hidden, rounded up to a multiple of 64)")
    parser.add_argument("--vocab", type=int, default=32000 if GPU else 64)
    parser.add_argument("--seq", type=int, default=1024 if GPU else 8)
    parser.add_argument("--batch", type=int, default=8 if GPU else 2)
    parser.add_argument("--steps", type=int, default=20 if GPU else 1)
    parser.add_argument("--warmup", type=int, default=5 if GPU else 0)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16" if GPU else "float32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--level", choices=("python", "aten"), default=None,
                        help="override level (default: aten for eager steps, whose host time "
                             "it keeps lowest; python with --compile, whose graphs then hold "
                             "tgemm ops)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.level is None:
        args.level = "python" if args.compile else "aten"
    if args.intermediate is None:
        args.intermediate = -(-8 * args.hidden // 3 // 64) * 64
    return args


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Run the comparison and print it; return the losses of each run (for tests)."""
    args = parse_args(argv)
    device = "cuda" if GPU else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = TinyLlama(args.vocab, args.hidden, args.heads, args.layers, args.intermediate,
                      max_seq=args.seq).to(device=device, dtype=dtype)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)
    tokens, targets = tokens[:, :-1], tokens[:, 1:]

    print(f"TinyLlama: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, "
          f"MLP {args.intermediate}, vocab {args.vocab}; batch {args.batch} x seq {args.seq}, "
          f"{args.dtype} on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}"
          f"{', compiled' if args.compile else ''}; override level {args.level}")
    # Both runs start from the same weights.
    plain_model, tgemm_model = model, copy.deepcopy(model)
    plain = run(plain_model, tokens, targets, args.steps, args.warmup, args.compile)
    with tg.override(level=args.level) as ov:
        routed = run(tgemm_model, tokens, targets, args.steps, args.warmup, args.compile)

    for name, (losses, times) in (("PyTorch", plain), ("tgemm override", routed)):
        print(f"{name:>15}: loss {' '.join(f'{x:.4f}' for x in losses)}")
        if device == "cuda":
            print(f"{'':>15}  median step {statistics.median(times):.2f} ms "
                  f"over {len(times)} steps")
    if device == "cuda":
        ratio = statistics.median(plain[1]) / statistics.median(routed[1])
        print(f"speed-up of the override: {ratio:.2f}x")
    else:
        print("(Triton's CPU interpreter: step times mean nothing here; run on a GPU to compare)")
    print(f"calls routed to tgemm::mm: {ov.counts}"
          f"{' (compiled code is not counted)' if args.compile and args.level == 'python' else ''}")
    return {"plain": plain[0], "override": routed[0]}


if __name__ == "__main__":
    main()
