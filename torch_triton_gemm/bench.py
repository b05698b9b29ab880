"""Benchmark tgemm (Triton) against torch.mm (cuBLAS) on a CUDA GPU.

What it measures:

- GEMM suites. For each shape (M, N, K) and dtype (bf16, fp16) it draws fresh ``torch.randn``
  operands and times ``torch_triton_gemm.mm(a, b)`` and ``torch.mm(a, b)`` on the same tensors
  with ``triton.testing.do_bench`` (median, L2 flushed before each run). It reports TFLOP/s
  (2*M*N*K / time) for both, their ratio (tgemm / torch: above 1 means tgemm is faster) and the
  relative error ||out - ref|| / ||ref|| of tgemm's output. ``ref`` is a float64 product on the
  GPU when M*N*K <= 2**31 ("err vs" column: fp64); larger products are compared with torch.mm's
  own output taken to fp32 ("err vs": torch), so that column is agreement with cuBLAS, not error.
  The activation a is row-major [M, K]; the weight is stored [N, K] and passed as ``W.t()``, the
  nn.Linear way, unless the suite says otherwise.

  square   1024^3, 2048^3, 4096^3, 8192^3
  llama    Llama-3-8B linear layers (qkv, o, gate_up, down) for M in 1 .. 8192 tokens
  layouts  4096^3 with both operands row-major, and with both column-major

- e2e: the step time (forward, loss, backward) of a stack of small Llama-style blocks in bf16,
  plain PyTorch against the same model and inputs under ``torch_triton_gemm.override()``.

The first tgemm call for a new power-of-two size bucket autotunes, which can take seconds;
progress goes to stderr, results to stdout.

Run (needs a CUDA GPU; ``pip install matplotlib`` for ``--plot``):

    python -m torch_triton_gemm.bench                    # every suite, bf16 and fp16
    python -m torch_triton_gemm.bench --quick            # a few shapes, a fast check
    python -m torch_triton_gemm.bench --suite llama --dtypes bf16 --csv llama.csv --plot llama.png
    python -m torch_triton_gemm.bench --suite square --markdown   # a table for the README
    python -m torch_triton_gemm.bench --list             # the shapes that would run; no GPU
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.testing import do_bench

import torch_triton_gemm as tg
from torch_triton_gemm import device as _device

# --- what to run --------------------------------------------------------------------------------

GEMM_SUITES = ("square", "llama", "layouts")
ALL_SUITES = (*GEMM_SUITES, "e2e")

SQUARE_SIZES = (1024, 2048, 4096, 8192)
LLAMA_MS = (1, 16, 64, 128, 512, 2048, 8192)
# Llama-3-8B projections as (name, N, K): hidden 4096, q+k+v = 4096 + 2 * 1024 (GQA),
# gate and up fused to 2 * 14336.
LLAMA_LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                ("down", 4096, 14336))
QUICK_SQUARE_SIZES = (4096, 8192)
QUICK_LLAMA_MS = (16, 2048)
LAYOUTS_SIZE = 4096

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16"}

# A float64 reference costs a float64 GEMM (slow even on GPUs with fp64 tensor cores) and 4x
# the memory of the operands, so only small products get one.
FP64_REF_LIMIT = 2**31


@dataclass(frozen=True)
class Case:
    """One GEMM shape: out[M, N] = a[M, K] @ b[K, N], with the operand layouts to build."""

    suite: str
    name: str
    m: int
    n: int
    k: int
    a_layout: str = "row"  # "row": [M, K] contiguous; "col": a [K, M] tensor transposed
    b_layout: str = "col"  # "col": W [N, K] transposed (nn.Linear); "row": [K, N] contiguous

    @property
    def flops(self) -> int:
        """Floating-point operations of the product (a multiply and an add per term)."""
        return 2 * self.m * self.n * self.k

    def label(self) -> str:
        """Short human-readable description for progress lines."""
        if self.suite == "llama":
            return f"llama {self.name} M={self.m}"
        if self.suite == "square":
            return f"square {self.name}"
        return f"{self.suite} {self.name} {self.m}x{self.n}x{self.k}"


@dataclass
class Result:
    """Timings and accuracy of one (case, dtype) pair."""

    case: Case
    dtype: str
    tgemm_ms: float
    torch_ms: float
    rel_err: float
    err_vs: str  # "fp64" or "torch": what rel_err was measured against
    first_call_s: float  # tgemm's first call, autotuning included when the bucket was new

    @property
    def tgemm_tflops(self) -> float:
        """tgemm throughput in TFLOP/s."""
        return self.case.flops / (self.tgemm_ms * 1e-3) / 1e12

    @property
    def torch_tflops(self) -> float:
        """torch.mm throughput in TFLOP/s."""
        return self.case.flops / (self.torch_ms * 1e-3) / 1e12

    @property
    def ratio(self) -> float:
        """tgemm TFLOP/s over torch TFLOP/s: above 1 means tgemm is faster."""
        return self.torch_ms / self.tgemm_ms


@dataclass
class E2EResult:
    """Step times of the e2e model, plain and under ``override()``."""

    description: str
    dtype: str
    plain_ms: float
    override_ms: float
    loss_rel_diff: float  # max over measured steps of |loss_override - loss_plain| / |loss_plain|

    @property
    def ratio(self) -> float:
        """Override step time over plain step time: below 1 means the override is faster."""
        return self.override_ms / self.plain_ms


def build_cases(suites: Sequence[str], quick: bool = False) -> list[Case]:
    """The GEMM cases of ``suites`` in run order; ``quick`` keeps a few representative shapes."""
    cases: list[Case] = []
    if "square" in suites:
        for s in QUICK_SQUARE_SIZES if quick else SQUARE_SIZES:
            cases.append(Case("square", f"{s}^3", s, s, s))
    if "llama" in suites:
        # M outermost: the rows for one batch size read as one forward pass.
        for m in QUICK_LLAMA_MS if quick else LLAMA_MS:
            for name, n, k in LLAMA_LAYERS:
                cases.append(Case("llama", name, m, n, k))
    if "layouts" in suites:
        s = LAYOUTS_SIZE
        cases.append(Case("layouts", "a-row b-row", s, s, s, a_layout="row", b_layout="row"))
        cases.append(Case("layouts", "a-col b-col", s, s, s, a_layout="col", b_layout="col"))
    return cases


# --- GEMM measurement ---------------------------------------------------------------------------

def make_operands(case: Case, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random a [M, K] and b [K, N] with the case's layouts (never zeros: those would
    hide wrong results and, on some GPUs, draw less power and run faster)."""
    m, n, k = case.m, case.n, case.k
    if case.a_layout == "row":
        a = torch.randn(m, k, device=device, dtype=dtype)
    else:
        a = torch.randn(k, m, device=device, dtype=dtype).t()
    if case.b_layout == "col":
        b = torch.randn(n, k, device=device, dtype=dtype).t()
    else:
        b = torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in ref's dtype."""
    return ((out.to(ref.dtype) - ref).norm() / ref.norm()).item()


def time_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int, cuda_graph: bool) -> float:
    """Median time of ``fn`` in ms: eager launches, or replays of a captured CUDA graph.

    Eager timing includes each library's host-side launch cost, which decides small GEMMs in
    eager PyTorch; graph replay removes it and compares the GPU kernels alone (what
    ``torch.compile(mode="reduce-overhead")`` and CUDA-graph serving see).
    """
    if cuda_graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_case(case: Case, dtype_name: str, warmup_ms: int, rep_ms: int,
                 device: torch.device, cuda_graph: bool = False, rounds: int = 2) -> Result:
    """Time tgemm and torch.mm on the same fresh operands and check tgemm's accuracy.

    The two are timed alternately ``rounds`` times and each keeps its best median, so that a
    clock or power dip during one measurement does not decide the ratio.
    """
    dtype = DTYPES[dtype_name]
    a, b = make_operands(case, dtype, device)

    # The first call autotunes when the size bucket is new; time it apart from the benchmark.
    start = time.perf_counter()
    out = tg.mm(a, b)
    torch.cuda.synchronize(device)
    first_call_s = time.perf_counter() - start

    peer = torch.mm(a, b)
    if case.m * case.n * case.k <= FP64_REF_LIMIT:
        ref = torch.mm(a.double(), b.double())
        rel_err, err_vs = relative_error(out, ref), "fp64"
        del ref
    else:
        rel_err, err_vs = relative_error(out, peer.float()), "torch"
    del out, peer

    tgemm_times, torch_times = [], []
    for _ in range(rounds):
        tgemm_times.append(time_ms(lambda: tg.mm(a, b), warmup_ms, rep_ms, cuda_graph))
        torch_times.append(time_ms(lambda: torch.mm(a, b), warmup_ms, rep_ms, cuda_graph))
    tgemm_ms, torch_ms = min(tgemm_times), min(torch_times)
    return Result(case, dtype_name, tgemm_ms, torch_ms, rel_err, err_vs,
                  first_call_s)


def run_gemm_suites(cases: Sequence[Case], dtype_names: Sequence[str], warmup_ms: int,
                    rep_ms: int, device: torch.device, cuda_graph: bool = False,
                    rounds: int = 2) -> list[Result]:
    """Measure every (dtype, case) pair, reporting progress on stderr."""
    results: list[Result] = []
    total = len(cases) * len(dtype_names)
    index = 0
    for dtype_name in dtype_names:
        for case in cases:
            index += 1
            print(f"[{index}/{total}] {case.label()} {dtype_name}: tuning + timing ...",
                  end=" ", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                result = measure_case(case, dtype_name, warmup_ms, rep_ms, device, cuda_graph,
                                      rounds)
            except torch.cuda.OutOfMemoryError:
                # One oversized shape should not throw away the rows measured so far.
                print("out of GPU memory; skipped", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
                continue
            elapsed = time.perf_counter() - start
            print(f"{elapsed:.1f} s (first tgemm call {result.first_call_s:.1f} s)",
                  file=sys.stderr, flush=True)
            results.append(result)
            # Give the cached blocks back so that large shapes do not stack up.
            torch.cuda.empty_cache()
    return results


# --- reporting ----------------------------------------------------------------------------------

TABLE_HEADERS = ("suite", "name", "M", "N", "K", "dtype", "tgemm TFLOP/s", "torch TFLOP/s",
                 "ratio", "rel err", "err vs")
_LEFT_ALIGNED = {"suite", "name", "dtype", "err vs"}


def _format_tflops(value: float) -> str:
    # Decode-sized rows run at a few TFLOP/s; keep two decimals there so they are not all "1.0".
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def result_cells(result: Result) -> list[str]:
    """One table row as strings, in TABLE_HEADERS order."""
    c = result.case
    return [c.suite, c.name, str(c.m), str(c.n), str(c.k), result.dtype,
            _format_tflops(result.tgemm_tflops), _format_tflops(result.torch_tflops),
            f"{result.ratio:.2f}", f"{result.rel_err:.2e}", result.err_vs]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 left: set[str] | frozenset[str] = frozenset()) -> str:
    """Plain-text table: columns padded to their widest cell, text left, numbers right."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.ljust(w) if h in left else cell.rjust(w)
                 for cell, w, h in zip(cells, widths, headers, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def format_markdown(headers: Sequence[str], rows: Sequence[Sequence[str]],
                    left: set[str] | frozenset[str] = frozenset()) -> str:
    """GitHub markdown table with the same alignment as ``format_table``."""
    align = [":---" if h in left else "---:" for h in headers]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def results_table(results: Sequence[Result], markdown: bool = False) -> str:
    """The GEMM results as a plain-text (or markdown) table."""
    rows = [result_cells(r) for r in results]
    if markdown:
        return format_markdown(TABLE_HEADERS, rows, _LEFT_ALIGNED)
    return format_table(TABLE_HEADERS, rows, _LEFT_ALIGNED)


def geometric_mean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values, or None when there are none."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def summary_lines(results: Sequence[Result]) -> list[str]:
    """Per dtype: the ratio at 4096^3 and 8192^3, geometric means over llama M >= 512 and all."""
    lines = ["summary (ratio = tgemm TFLOP/s / torch TFLOP/s; above 1: tgemm faster)"]
    dtype_names = list(dict.fromkeys(r.dtype for r in results))
    for dtype_name in dtype_names:
        rows = [r for r in results if r.dtype == dtype_name]
        parts = []
        for size in (4096, 8192):
            # The square suite's shape, not a layouts row of the same size.
            match = [r.ratio for r in rows
                     if r.case.suite == "square" and r.case.m == r.case.n == r.case.k == size]
            parts.append(f"{size}^3 {_fmt_ratio(match[0] if match else None)}")
        llama = [r.ratio for r in rows if r.case.suite == "llama" and r.case.m >= 512]
        parts.append(f"geomean llama M>=512 {_fmt_ratio(geometric_mean(llama))} "
                     f"({len(llama)} rows)")
        everything = [r.ratio for r in rows]
        parts.append(f"geomean all {_fmt_ratio(geometric_mean(everything))} "
                     f"({len(everything)} rows)")
        lines.append(f"  {dtype_name}: " + " | ".join(parts))
    if len(dtype_names) > 1:
        all_ratios = [r.ratio for r in results]
        lines.append(f"  all dtypes: geomean {_fmt_ratio(geometric_mean(all_ratios))} "
                     f"({len(all_ratios)} rows)")
    return lines


E2E_HEADERS = ("model", "plain ms", "override ms", "override/plain", "max loss rel diff")


def e2e_table(result: E2EResult, markdown: bool = False) -> str:
    """The e2e row as a table (override/plain below 1: the override is faster)."""
    row = [result.description, f"{result.plain_ms:.2f}", f"{result.override_ms:.2f}",
           f"{result.ratio:.3f}", f"{result.loss_rel_diff:.2e}"]
    if markdown:
        return format_markdown(E2E_HEADERS, [row], {"model"})
    return format_table(E2E_HEADERS, [row], {"model"})


CSV_FIELDS = ("suite", "name", "M", "N", "K", "dtype", "a_layout", "b_layout", "tgemm_ms",
              "torch_ms", "tgemm_tflops", "torch_tflops", "ratio", "rel_err", "err_vs",
              "first_call_s")


def write_csv(path: str, results: Sequence[Result], e2e: E2EResult | None = None) -> None:
    """All rows, full precision. ratio is always speed tgemm / speed torch (above 1: tgemm
    faster); the e2e row puts the override step in tgemm_ms, the plain one in torch_ms and the
    loss difference in rel_err."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            c = r.case
            writer.writerow({
                "suite": c.suite, "name": c.name, "M": c.m, "N": c.n, "K": c.k,
                "dtype": r.dtype, "a_layout": c.a_layout, "b_layout": c.b_layout,
                "tgemm_ms": r.tgemm_ms, "torch_ms": r.torch_ms,
                "tgemm_tflops": r.tgemm_tflops, "torch_tflops": r.torch_tflops,
                "ratio": r.ratio, "rel_err": r.rel_err, "err_vs": r.err_vs,
                "first_call_s": r.first_call_s,
            })
        if e2e is not None:
            writer.writerow({
                "suite": "e2e", "name": e2e.description, "dtype": e2e.dtype,
                "tgemm_ms": e2e.override_ms, "torch_ms": e2e.plain_ms,
                "ratio": e2e.plain_ms / e2e.override_ms, "rel_err": e2e.loss_rel_diff,
                "err_vs": "loss",
            })


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (checked before a long run, imported only to plot)."""
    return importlib.util.find_spec("matplotlib") is not None


_NO_MATPLOTLIB = ("--plot needs matplotlib, which is not installed "
                  "(pip install matplotlib, or the package's [bench] extra); no plot is written")


def write_plot(path: str, results: Sequence[Result]) -> bool:
    """Bar chart of tgemm vs torch TFLOP/s per shape, one panel per dtype; False if no plot."""
    try:
        import matplotlib
    except ImportError:
        print(_NO_MATPLOTLIB, file=sys.stderr)
        return False
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    dtype_names = list(dict.fromkeys(r.dtype for r in results))
    widest = max(sum(r.dtype == d for r in results) for d in dtype_names)
    fig, axes = plt.subplots(len(dtype_names), 1, squeeze=False,
                             figsize=(max(8.0, 0.4 * widest + 2), 4.5 * len(dtype_names)))
    bar = 0.4
    for ax, dtype_name in zip(axes[:, 0], dtype_names, strict=True):
        rows = [r for r in results if r.dtype == dtype_name]
        x = range(len(rows))
        ax.bar([i - bar / 2 for i in x], [r.tgemm_tflops for r in rows], bar, label="tgemm")
        ax.bar([i + bar / 2 for i in x], [r.torch_tflops for r in rows], bar,
               label="torch (cuBLAS)")
        labels = [f"{r.case.suite} {r.case.name}" if r.case.suite != "llama"
                  else f"{r.case.name} M={r.case.m}" for r in rows]
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=90, fontsize=8)
        # Log scale: decode rows (a few TFLOP/s) stay readable next to the large GEMMs.
        ax.set_yscale("log")
        ax.set_ylabel("TFLOP/s (log scale)")
        ax.set_title(f"tgemm vs torch.mm, {dtype_name}")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- e2e: a Llama-style block, plain vs override ------------------------------------------------

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


def _load_override() -> Callable[[], Any] | None:
    """The ``override`` context-manager factory, or None when the package does not have one."""
    try:
        from torch_triton_gemm import override
    except ImportError:
        return None
    # Without a re-export in __init__, the import yields the module rather than the function.
    if isinstance(override, types.ModuleType):
        override = getattr(override, "override", None)
    return override if callable(override) else None


def _time_steps(variants: dict[str, Callable[[], torch.Tensor]], warmup_steps: int, steps: int,
                device: torch.device) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each variant up, then time ``steps`` steps of each; returns ms and losses per step.

    Steps alternate between the variants (the order flips every round) so that clock and
    thermal drift affect all alike. Each step is bracketed by CUDA events and followed by a
    synchronisation, so its time includes any launch overhead the GPU cannot hide.
    """
    for name, step in variants.items():
        # The override's warm-up also autotunes every new GEMM bucket, forward and backward.
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
            device: torch.device | None = None) -> E2EResult | None:
    """Median step time (forward, loss = out.float().square().mean(), backward, grads set to
    None before each step) of ``layers`` stacked blocks: plain PyTorch vs the same weights and
    input under ``torch_triton_gemm.override()``. None (with a message) when the package has
    no override.
    """
    override = _load_override()
    if override is None:
        # On stdout too: it explains a missing row of the results.
        print("override not available (torch_triton_gemm.override); skipping e2e", flush=True)
        return None
    device = device or torch.device("cuda")
    description = (f"{layers} Llama blocks, hidden {hidden}, {heads} heads, ffn {intermediate}, "
                   f"{batch}x{seq} tokens, {_DTYPE_NAMES.get(dtype, dtype)}, fwd+bwd")
    print(f"e2e: {description}", file=sys.stderr, flush=True)
    try:
        plain_ms, override_ms, loss_diff = _measure_e2e(
            override, layers, batch, seq, hidden, heads, intermediate, dtype, warmup_steps,
            steps, device)
    finally:
        torch.cuda.empty_cache()
    return E2EResult(description, _DTYPE_NAMES.get(dtype, str(dtype)), plain_ms, override_ms,
                     loss_diff)


# --- command line -------------------------------------------------------------------------------

def _parse_list(text: str, allowed: Sequence[str], what: str,
                aliases: dict[str, str] | None = None) -> list[str]:
    """Comma-separated names, canonicalised, deduplicated in order; ArgumentTypeError if bad."""
    names = []
    for raw in text.split(","):
        raw = raw.strip().lower()
        if not raw:
            continue
        name = aliases.get(raw, raw) if aliases else raw
        if name not in allowed:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {raw!r}; choose from {', '.join(allowed)}")
        if name not in names:
            names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_triton_gemm.bench",
        description="Benchmark tgemm (Triton) against torch.mm (cuBLAS) on a CUDA GPU. "
                    "Results go to stdout, progress to stderr.")
    parser.add_argument(
        "--suite", type=lambda s: _parse_list(s, ALL_SUITES, "suite"), default=None,
        help="comma-separated suites from square, llama, layouts, e2e (default: all; with "
             "--quick: square,llama)")
    parser.add_argument(
        "--dtypes", type=lambda s: _parse_list(s, tuple(DTYPES), "dtype", _DTYPE_ALIASES),
        default=list(DTYPES), help="comma-separated GEMM dtypes (default: bf16,fp16)")
    parser.add_argument(
        "--quick", action="store_true",
        help="only 4096^3, 8192^3 and the llama rows with M in {16, 2048}, for a fast check")
    parser.add_argument("--warmup", type=_positive_int, default=25,
                        help="do_bench warm-up time per measurement, ms (default: 25)")
    parser.add_argument("--rep", type=_positive_int, default=100,
                        help="do_bench measurement time per measurement, ms (default: 100)")
    parser.add_argument("--rounds", type=_positive_int, default=2,
                        help="alternating tgemm/torch measurements per shape; each side keeps "
                             "its best median (default: 2)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time replays of captured CUDA graphs (kernels without host "
                             "launch cost) instead of eager calls")
    parser.add_argument("--csv", metavar="PATH", help="write every row to a CSV file")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG bar chart of TFLOP/s per shape (needs matplotlib)")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the tables as GitHub markdown")
    parser.add_argument("--e2e-layers", type=_positive_int, default=2,
                        help="blocks stacked in the e2e model (default: 2)")
    parser.add_argument("--e2e-steps", type=_positive_int, default=20,
                        help="timed steps per variant in the e2e suite (default: 20)")
    parser.add_argument("--list", action="store_true",
                        help="print the GEMM shapes that would run and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.suite is None:
        # --quick is about a fast check: the layouts and e2e suites run only when named.
        args.suite = ["square", "llama"] if args.quick else list(ALL_SUITES)
    return args


def _header_line(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device)
    return (f"# {name} | torch {torch.__version__} | triton {triton.__version__} | "
            f"tgemm {tg.__version__}")


def main(argv: list[str] | None = None) -> int:
    """Run the selected suites and print the results; returns the process exit status."""
    args = parse_args(argv)
    cases = build_cases(args.suite, args.quick)

    if args.list:
        rows = [[c.suite, c.name, str(c.m), str(c.n), str(c.k), c.a_layout, c.b_layout]
                for c in cases]
        print(format_table(("suite", "name", "M", "N", "K", "a", "b"), rows,
                           {"suite", "name", "a", "b"}))
        print(f"{len(cases)} shapes x {len(args.dtypes)} dtypes ({', '.join(args.dtypes)})"
              + ("; plus e2e" if "e2e" in args.suite else ""))
        return 0

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    error = _device.kernel_device_error(device)
    if error is not None:
        print(f"cannot benchmark: {error}", file=sys.stderr)
        return 2
    if args.plot and not matplotlib_available():
        print(_NO_MATPLOTLIB, file=sys.stderr)

    print(_header_line(device))
    timing = ("CUDA-graph replay (do_bench_cudagraph)" if args.cuda_graph
              else f"eager calls (do_bench, warmup {args.warmup} ms)")
    print(f"# median of {timing}, rep {args.rep} ms, best of {args.rounds} alternating rounds; "
          "a row-major [M, K], b = W.t() with W [N, K] unless the name says otherwise")
    torch.manual_seed(0)
    results = run_gemm_suites(cases, args.dtypes, args.warmup, args.rep, device,
                              args.cuda_graph, args.rounds)
    if results:
        print()
        print(results_table(results))
        print()
        print("\n".join(summary_lines(results)))
        if args.markdown:
            print()
            print(results_table(results, markdown=True))
        sys.stdout.flush()

    e2e = None
    if "e2e" in args.suite:
        try:
            e2e = run_e2e(layers=args.e2e_layers, steps=args.e2e_steps, device=device)
        except Exception:
            # The override is developed separately; report its failure, keep the GEMM results.
            print("e2e failed (traceback on stderr); no e2e row", flush=True)
            traceback.print_exc()
            torch.cuda.empty_cache()
        if e2e is not None:
            print()
            print("e2e (override/plain: step time ratio, below 1 means the override is faster)")
            print(e2e_table(e2e))
            if args.markdown:
                print()
                print(e2e_table(e2e, markdown=True))

    if args.csv:
        write_csv(args.csv, results, e2e)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot and results and write_plot(args.plot, results):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
