"""Benchmark torch_triton_gemm against torch (cuBLAS) on a CUDA GPU.

    python -m torch_triton_gemm.bench                   # mm suites, latency, e2e, coldstart
    python -m torch_triton_gemm.bench --quick           # a representative subset, bf16
    python -m torch_triton_gemm.bench --suite grouped,scaled
    python -m torch_triton_gemm.bench --suite moe          # moe_mlp vs the unfused MoE MLP
    python -m torch_triton_gemm.bench --suite sgrouped     # fp8 scaled_grouped_mm, sm_90+
    python -m torch_triton_gemm.bench --suite sweep --seed 1 --count 400 --plot sweep.png
    python -m torch_triton_gemm.bench --suite classes --inductor   # + Inductor's Triton GEMMs
    python -m torch_triton_gemm.bench --list            # the suites and their rows; no GPU
    python -m torch_triton_gemm.bench --out bench-out   # also results.csv and results.md

Every GEMM row times tgemm and its torch peer on the same tensors two ways, kernel-only (CUDA
graph replays) and eager (back-to-back Python calls), and reports TFLOP/s and the speed ratio
(above 1: tgemm faster). Shape suites follow the project's benchmark shape list; the planner
suites (classes, sweep) also summarise the spread of the ratios by class and size.

Modules, in the order a run uses them:

    cli.py        options, the order of the suites, what is printed and written
    suites.py     the shapes of every suite, as data (no GPU needed)
    timing.py     eager and CUDA-graph timing, host time per call, running rows safely
    gemm.py       the mm suites (with --inductor, a compiled peer) and the host-latency suite
    grouped.py    grouped_mm vs torch._grouped_mm and a loop of torch.mm
    scaled.py     scaled_mm vs torch._scaled_mm, with the fp8 quantization of the inputs
    sgrouped.py   scaled_grouped_mm vs torch._scaled_grouped_mm (rowwise fp8 MoE experts)
    moe.py        moe_mlp vs the unfused torch._grouped_mm MoE MLP, with peak memory
    e2e.py        Llama-block step time, and cold start in fresh processes
    coldstart.py  the program each cold-start process runs
    model.py      the drop-in example's model (shared with examples/dropin.py)
    results.py    what a row holds: times, TFLOP/s, ratios, GB/s, CSV fields
    report.py     tables, summary, CSV, markdown, plot (matplotlib only when plotting)
"""

from .cli import build_parser, main, parse_args

__all__ = ["build_parser", "main", "parse_args"]
