"""One cold-start measurement, run in a fresh process by the benchmark's coldstart suite:

    python -m torch_triton_gemm.bench.coldstart plain|override|override-aten|warmup \
        [--while-compiling wait|pytorch] [--compile-processes N]

It builds the drop-in example's model (its GPU defaults, bf16), then times the first training
steps (forward, cross-entropy, backward, AdamW step, each to completion), plainly or inside
``torch_triton_gemm.override()`` (``override(level="aten")`` for "override-aten"). The first
step pays every one-time cost the process has not paid yet: CUDA and cuBLAS initialisation, and
under the override Triton's compilation of tgemm's kernels (no tuning sweeps: untuned shapes
run the heuristic's plans), unless Triton's on-disk cache (``TRITON_CACHE_DIR``) already holds
them. "warmup" runs ``torch_triton_gemm.warmup`` on
the model first (its seconds as "warmup_s"), then the override's steps. ``--while-compiling``
is the override's ``while_compiling`` (default: its own); ``--compile-processes N`` compiles in
N worker processes (TORCH_TRITON_GEMM_COMPILE_PROCESSES). It prints one JSON line: {"mode",
"step_s": [seconds per step], "loss": first step's loss, "warmup_s" for "warmup",
"ran_while_compiling": the override's count of calls run on PyTorch while their kernels
compiled}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

import torch_triton_gemm as tg
from torch_triton_gemm.bench.model import TinyLlama, train_step

# examples/dropin.py's defaults on a GPU.
MODEL = dict(vocab=32000, hidden=1024, heads=8, layers=4, intermediate=2752)
BATCH, SEQ = 8, 1024
STEPS = 3
MODES = ("plain", "override", "override-aten", "warmup")


def measure(mode: str, steps: int = STEPS, while_compiling: str | None = None
            ) -> dict[str, object]:
    """Build the model and time ``steps`` training steps in ``mode`` (the override's
    ``while_compiling`` as given); the result as a dict."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.manual_seed(0)
    model = TinyLlama(**MODEL, max_seq=SEQ).to(device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(MODEL["vocab"], (BATCH, SEQ + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.cuda.synchronize()
    extra = {}
    if mode == "warmup":
        start = time.perf_counter()
        tg.warmup(model, tokens=BATCH * SEQ, progress=False)
        extra["warmup_s"] = time.perf_counter() - start
    times, losses = [], []
    if mode == "plain":
        context = contextlib.nullcontext()
    else:
        context = tg.override(level="aten" if mode == "override-aten" else "python",
                              while_compiling=while_compiling)
    with context:
        for _ in range(steps):
            start = time.perf_counter()
            loss = train_step(model, optimizer, inputs, targets)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    if mode != "plain":
        extra["ran_while_compiling"] = context.ran_while_compiling
    return {"mode": mode, "step_s": times, "loss": losses[0], **extra}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.bench.coldstart",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--while-compiling", choices=("wait", "pytorch"), default=None,
                        help="the override's while_compiling (default: its own)")
    parser.add_argument("--compile-processes", type=int, default=None, metavar="N",
                        help="compile in N worker processes "
                             "(TORCH_TRITON_GEMM_COMPILE_PROCESSES)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        parser.error("the cold-start measurement needs a CUDA GPU")
    if args.compile_processes is not None:
        # Read when the compile pool starts its workers, on the first compilation.
        os.environ["TORCH_TRITON_GEMM_COMPILE_PROCESSES"] = str(args.compile_processes)
    print(json.dumps(measure(args.mode, while_compiling=args.while_compiling)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
