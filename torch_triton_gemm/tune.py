"""Exhaustive tuning of tgemm::mm plans, kept on disk: ``tune(...)`` and ``python -m
torch_triton_gemm.tune``.

No call needs this: untuned shapes run the heuristic's plan. Tuning times every candidate plan
of a shape (tiles, K splits, the persistent TMA kernel and the portable one) as CUDA-graph
replays, keeps the fastest in the tuned table (one JSON file per GPU model, Triton version and
kernel source; see ``plan_cache.cache_path``), and later calls in the same size bucket, in this
process or any later one, launch that plan.

    python -m torch_triton_gemm.tune --shapes 4096x14336x4096,16x6144x4096 --dtypes bf16
    python -m torch_triton_gemm.tune --suite llama --report      # every candidate's time
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from . import device as _device
from . import plan_cache, tuning
from .ops import graph_descriptors
from .ops.checks import check, default_out_dtype
from .ops.launcher import launch_mm
from .ops.operands import (
    kernel_operands,
    layout_key,
    warp_specialized_16_bit,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.float8_e4m3fn}
# Shapes (M, N, K) of the Llama-3-8B projections at the batch sizes of the benchmark.
LLAMA_LAYERS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
LLAMA_MS = (1, 16, 64, 128, 512, 2048, 8192)


@dataclass
class Timing:
    plan: tuning.MMPlan
    # None: the plan failed to compile or launch (e.g. out of shared memory), or its result was
    # not the product
    ms: float | None


# What a candidate's output is checked against before it is timed: torch's fp32 product with
# the same epilogue (activation names as in kernels/tiles.py's ACTIVATIONS).
_ACTIVATIONS = {
    "none": lambda z: z,
    "relu": torch.relu,
    "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "leaky_relu": lambda z: torch.nn.functional.leaky_relu(z, 0.01),
}
# Relative error a candidate may show against it: rounding of 16-bit, fp8 or tf32 products,
# with margin; a kernel that computes something else is far past it.
CANDIDATE_TOLERANCE = 0.05


def reference_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor:
    """activation(a @ b + bias) by torch, in fp32."""
    z = a.float() @ b.float()
    if bias is not None:
        z = z + bias.float()
    return _ACTIVATIONS[activation](z)


def gives_the_product(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a candidate's output is finite and within CANDIDATE_TOLERANCE of the reference
    (relative Frobenius error)."""
    if not bool(torch.isfinite(out).all()):
        return False
    error = (out.float() - reference).norm() / reference.norm().clamp_min(1e-30)
    return bool(error <= CANDIDATE_TOLERANCE)


def _time_ms(fn, rep_ms: int) -> float:  # type: ignore[no-untyped-def]
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def tune_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
            activation: str = "none", rep_ms: int = 20) -> tuple[tuning.MMPlan, list[Timing]]:
    """Time every candidate plan for ``a @ b`` on these tensors, store the fastest in the tuned
    table and return it with all timings (fastest first). ``a``, ``b`` and ``bias`` must be
    valid tgemm::mm operands: tuning times the kernels as the op launches them."""
    device = a.device
    check(device.type == "cuda" and not _device.interpreter_enabled(),
          lambda: "tgemm.tune: tuning times kernels on a CUDA GPU")
    M, K = a.shape
    N = b.shape[1]
    out = a.new_empty((M, N), dtype=default_out_dtype(a.dtype))
    # The operands as the kernels will see them (padded copies included), as the op plans.
    tma_args, _, (_, stride_ak, stride_bk, _) = kernel_operands(a, b, out)
    tma = tma_args is not None and _device.supports_tma(device)
    timings = []
    reference = reference_product(a, b, bias, activation)
    # Plans are timed as eager calls launch them: not with host-built descriptors, which
    # would reach some candidates' captures and not others' (ops/graph_descriptors.py).
    with graph_descriptors.off():
        # Hopper's warp-specialized kernel too where it runs the product (eager calls without
        # activation: what a tuned plan of it is used for, see planner._plan).
        wgmma = activation == "none" and warp_specialized_16_bit(a, b, out)
        for plan in tuning.candidate_plans(M, N, K, a.element_size(), tma, _device.num_sms(device),
                                           a_k_contiguous=stride_ak == 1,
                                           wgmma_out_size=out.element_size() if wgmma else 0):
            def run(plan: tuning.MMPlan = plan) -> None:
                launch_mm(a, b, bias, out, activation, traceable=False, plan=plan)

            try:
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize(device)
                # A candidate must give the product before it may win (twice: a race shows late).
                right = gives_the_product(out, reference)
                run()
                right = right and gives_the_product(out, reference)
                timings.append(Timing(plan, _time_ms(run, rep_ms) if right else None))
            except Exception:  # noqa: BLE001 - a candidate that cannot run is not a candidate
                timings.append(Timing(plan, None))
    timed = sorted((t for t in timings if t.ms is not None), key=lambda t: t.ms)
    check(bool(timed), lambda: f"tgemm.tune: no plan ran for {M}x{N}x{K}")
    best = timed[0].plan
    key = plan_cache.plan_key(M, N, K, a.dtype, layout_key(stride_ak, stride_bk), tma)
    plan_cache.TUNED.put(device, key, best)
    return best, timed + [t for t in timings if t.ms is None]


def tune_on_first_use(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                      activation: str) -> tuning.MMPlan | None:
    """The plan ``tune_mm`` stores for an eager call under ``TORCH_TRITON_GEMM_AUTOTUNE=1``, or
    None where tuning fails: that call then runs the heuristic's plan (one warning per
    process), since tuning may cost a call speed, never its result."""
    global _tuning_failed
    try:
        return tune_mm(a, b, bias, activation)[0]
    except Exception as error:  # noqa: BLE001 - any failure of the sweep leaves the heuristic
        if not _tuning_failed:
            _tuning_failed = True
            warnings.warn(f"tgemm: tuning on first use failed ({type(error).__name__}: {error}); "
                          "untuned shapes run the heuristic's plan", RuntimeWarning, stacklevel=2)
        return None


_tuning_failed = False  # warned once


def make_operands(m: int, n: int, k: int, dtype: torch.dtype, layout: str = "nt",
                  device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands of one shape; ``layout`` names A's and B's storage: n = row-major
    ("normal"), t = transposed (column-major). "nt" is nn.Linear's x @ W.t()."""
    def operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
        shape = (cols, rows) if transposed else (rows, cols)
        x = torch.randn(shape, device=device).to(dtype)
        return x.t() if transposed else x

    return operand(m, k, layout[0] == "t"), operand(k, n, layout[1] == "t")


def tune(shapes: Iterable[tuple[int, int, int]], dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
         layout: str = "nt", progress: bool = True) -> dict[str, tuning.MMPlan]:
    """Tune every (M, N, K) shape for every dtype and keep the winners on disk.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> tg.tune([(16, 6144, 4096), (4096, 14336, 4096)], dtypes=[torch.bfloat16])
    """
    jobs = [(shape, dtype) for dtype in dtypes for shape in shapes]
    winners = {}
    for i, ((m, n, k), dtype) in enumerate(jobs, 1):
        if progress:
            _progress(i, len(jobs), f"{m}x{n}x{k} {str(dtype).removeprefix('torch.')}")
        a, b = make_operands(m, n, k, dtype, layout)
        best, _ = tune_mm(a, b)
        winners[f"{m}x{n}x{k}/{dtype}"] = best
    if progress:
        print(file=sys.stderr)
    return winners


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<32}", end="",
          file=sys.stderr, flush=True)


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxNxK (e.g. 16x6144x4096)")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def _describe(plan: tuning.MMPlan) -> str:
    t = plan.tile
    extra = " ws" if plan.warp_specialize else ""
    return (f"{plan.kernel:8} {t.block_m}x{t.block_n}x{t.block_k} g{t.group_m} w{t.num_warps} "
            f"s{t.num_stages} split{plan.split_k} sub{plan.epilogue_subtile}{extra}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_triton_gemm.tune",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_parse_shapes, default=[],
                        help="comma-separated MxNxK list")
    parser.add_argument("--suite", choices=("llama",), help="add a suite of shapes")
    parser.add_argument("--dtypes", default="bf16", help=f"comma-separated: {', '.join(DTYPES)}")
    parser.add_argument("--layout", default="nt", choices=("nt", "nn", "tn", "tt"),
                        help="A and B storage: n row-major, t column-major (nt: x @ W.t())")
    parser.add_argument("--report", action="store_true",
                        help="print every candidate's time and cuBLAS's for each shape")
    parser.add_argument("--rep", type=int, default=20, help="ms of replays per candidate")
    args = parser.parse_args(argv)
    shapes = list(args.shapes)
    if args.suite == "llama":
        shapes += [(m, n, k) for m in LLAMA_MS for n, k in LLAMA_LAYERS]
    if not shapes:
        parser.error("give --shapes or --suite")
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA GPU")
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
    jobs = [(shape, dtype) for dtype in dtypes for shape in shapes]
    for i, ((m, n, k), dtype) in enumerate(jobs, 1):
        _progress(i, len(jobs), f"{m}x{n}x{k} {str(dtype).removeprefix('torch.')}")
        a, b = make_operands(m, n, k, dtype, args.layout)
        best, timings = tune_mm(a, b, rep_ms=args.rep)
        if args.report:
            print(file=sys.stderr)
            peer = (_time_ms(lambda a=a, b=b: torch.mm(a, b), args.rep)
                    if dtype != torch.float8_e4m3fn else None)
            flops = 2 * m * n * k
            print(f"== {m}x{n}x{k} {dtype} cuBLAS "
                  + (f"{peer * 1e3:.1f} us {flops / peer * 1e-9:.0f} TFLOP/s" if peer else "n/a"))
            for t in timings:
                if t.ms is None:
                    print(f"   {_describe(t.plan)}  failed")
                    continue
                ratio = f" {peer / t.ms:.2f}x" if peer else ""
                print(f"   {_describe(t.plan)}  {t.ms * 1e3:8.1f} us{ratio}")
    print(file=sys.stderr)
    print(f"tuned plans: {plan_cache.cache_path(torch.device('cuda'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
