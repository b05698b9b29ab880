"""End-to-end suites: training step time of Llama blocks (e2e), and the first training step of
the drop-in example's model in fresh processes (coldstart). Need a CUDA GPU.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_triton_gemm as tg

from .results import ColdStartResult, E2EResult
from .suites import COLDSTART_RUNS
from .timing import short_error

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# --- e2e: Llama-style blocks, plain vs override -------------------------------------------------

class _RMSNorm(torch.nn.Module):
    """RMSNorm as in Llama: normalise in fp32, scale in the activation dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class _Block(torch.nn.Module):
    """Pre-norm transformer block: causal attention and a SwiGLU MLP, no biases."""

    def __init__(self, hidden: int, heads: int, intermediate: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.heads = heads

        def linear(fan_in: int, fan_out: int) -> torch.nn.Linear:
            return torch.nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)

        self.attn_norm = _RMSNorm(hidden, device=device, dtype=dtype)
        self.q, self.k, self.v, self.o = (linear(hidden, hidden) for _ in range(4))
        self.mlp_norm = _RMSNorm(hidden, device=device, dtype=dtype)
        self.gate, self.up = linear(hidden, intermediate), linear(hidden, intermediate)
        self.down = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn_norm(x)

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            # [B, S, H*D] -> [B, H, S, D]; unflatten accepts any strides an override may return.
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        attn = torch.nn.functional.scaled_dot_product_attention(
            split_heads(self.q(y)), split_heads(self.k(y)), split_heads(self.v(y)),
            is_causal=True)
        x = x + self.o(attn.transpose(1, 2).flatten(2))
        y = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def _time_steps(variants: dict[str, Callable[[], torch.Tensor]], warmup_steps: int, steps: int,
                device: torch.device) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each variant up, then time ``steps`` steps of each; returns ms and losses per step.

    Steps alternate between the variants (the order flips every round) so that clock and
    thermal drift affect all alike. Each step is bracketed by CUDA events and followed by a
    synchronisation, so its time includes any launch overhead the GPU cannot hide.
    """
    for name, step in variants.items():
        # The override's warm-up also compiles tgemm's kernels for every GEMM, forward and backward.
        print(f"e2e: {warmup_steps} warm-up steps, {name} ...", end=" ", file=sys.stderr,
              flush=True)
        start = time.perf_counter()
        for _ in range(warmup_steps):
            step()
        torch.cuda.synchronize(device)
        print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    print(f"e2e: timing {steps} steps of each ...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    for i in range(steps):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            losses[name].append(variants[name]())
            end.record()
            torch.cuda.synchronize(device)
            times[name].append(begin.elapsed_time(end))
    print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return times, {name: [loss.item() for loss in ls] for name, ls in losses.items()}


def _measure_e2e(override: Callable[[], Any], layers: int, batch: int, seq: int, hidden: int,
                 heads: int, intermediate: int, dtype: torch.dtype, warmup_steps: int,
                 steps: int, device: torch.device) -> tuple[float, float, float]:
    """Build the model and input, time both variants; (plain ms, override ms, loss diff).

    The model lives only in this frame, so its memory is free once it returns.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(_Block(hidden, heads, intermediate, device, dtype) for _ in range(layers)))
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)

    def plain_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        return loss.detach()

    def override_step() -> torch.Tensor:
        with override():
            return plain_step()

    times, losses = _time_steps({"plain": plain_step, "override": override_step},
                                warmup_steps, steps, device)
    loss_diff = max(abs(o - p) / abs(p)
                    for p, o in zip(losses["plain"], losses["override"], strict=True))
    return statistics.median(times["plain"]), statistics.median(times["override"]), loss_diff


def run_e2e(layers: int = 2, batch: int = 4, seq: int = 2048, hidden: int = 4096,
            heads: int = 32, intermediate: int = 14336, dtype: torch.dtype = torch.bfloat16,
            warmup_steps: int = 3, steps: int = 20,
            device: torch.device | None = None) -> E2EResult:
    """Median step time (forward, loss = out.float().square().mean(), backward, grads set to
    None before each step) of ``layers`` stacked blocks: plain PyTorch vs the same weights and
    input under ``torch_triton_gemm.override()``.
    """
    device = device or torch.device("cuda")
    description = (f"{layers} Llama blocks, hidden {hidden}, {heads} heads, ffn {intermediate}, "
                   f"{batch}x{seq} tokens, {_DTYPE_NAMES.get(dtype, dtype)}, fwd+bwd")
    print(f"e2e: {description}", file=sys.stderr, flush=True)
    try:
        plain_ms, override_ms, loss_diff = _measure_e2e(
            tg.override, layers, batch, seq, hidden, heads, intermediate, dtype, warmup_steps,
            steps, device)
    finally:
        torch.cuda.empty_cache()
    return E2EResult(description, _DTYPE_NAMES.get(dtype, str(dtype)), plain_ms, override_ms,
                     loss_diff)


# --- coldstart: the first training step in fresh processes --------------------------------------

def _child_env(cache_dir: str) -> dict[str, str]:
    """The environment of a cold-start process: Triton's cache in ``cache_dir``, and this very
    package importable (installed or run from a checkout)."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    root = str(pathlib.Path(tg.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def parse_child_output(run: str, stdout: str, process_s: float) -> ColdStartResult:
    """The result of one cold-start process from its JSON line (see coldstart.py)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError("the process printed no result line")
    data = json.loads(lines[-1])
    steps = [float(s) for s in data["step_s"]]
    later_ms = statistics.median(steps[1:]) * 1e3 if len(steps) > 1 else math.nan
    return ColdStartResult(run, steps[0], later_ms, process_s, float(data["loss"]))


def run_coldstart(timeout_s: float = 300.0) -> list[ColdStartResult]:
    """The first training steps of the drop-in example's model in fresh processes, one after
    the other (``COLDSTART_RUNS``): plain PyTorch, then twice under ``override()``, then twice
    under ``override(level="aten")``, then each level once more with
    ``while_compiling="pytorch"``. The processes of one mode (and its arguments) share a new,
    empty Triton cache directory, so its first override process compiles every kernel it needs
    and the second finds them on disk (a user's second run)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="tgemm-coldstart-") as caches:
        for run, mode in COLDSTART_RUNS.items():
            env = _child_env(os.path.join(caches, "".join(c if c.isalnum() else "_"
                                                          for c in mode)))
            print(f"coldstart: {run} ...", end=" ", file=sys.stderr, flush=True)
            start = time.perf_counter()
            command = [sys.executable, "-m", "torch_triton_gemm.bench.coldstart",
                       *mode.split()]
            try:
                proc = subprocess.run(command, env=env, capture_output=True, text=True,
                                      timeout=timeout_s)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
                    raise RuntimeError(f"exit status {proc.returncode}: {last}")
                result = parse_child_output(run, proc.stdout, time.perf_counter() - start)
            except (subprocess.TimeoutExpired, RuntimeError, ValueError, KeyError) as exc:
                print(f"failed: {short_error(exc)}", file=sys.stderr, flush=True)
                result = ColdStartResult(run, error=short_error(exc))
            else:
                print(f"first step {result.first_step_s:.1f} s, process {result.process_s:.1f} s",
                      file=sys.stderr, flush=True)
            results.append(result)
    return results
