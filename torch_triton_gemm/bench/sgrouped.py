"""The sgrouped suite: ``torch_triton_gemm.scaled_grouped_mm`` against
``torch._scaled_grouped_mm`` on MoE expert GEMMs, rowwise float8_e4m3fn to bfloat16. Needs a
CUDA GPU of sm_90 or later (torch's grouped fp8 kernels); the inputs and the reference build
anywhere.

Both ops share one contract; the rows use its MoE form, 2-D x 3-D with offs over the routed
rows: a [T, K] e4m3 row-major with scale_a [T], the expert weights stored [G, N, K] e4m3 and
passed transposed (b [G, K, N], column-major per expert, as torch wants it) with scale_b
[G, N], offs int32 [G] (cumulative ends, every group a multiple of 16 rows: torch's kernels
need that), bf16 out [T, N]. Scales are amax-based, one per row of the activations and one per
output channel of each expert's weight (``scaled.quantize``). Each row runs one accumulation
mode, ``use_fast_accum`` the same for both ops.

Accuracy, two ways: tgemm against a float64 product of the dequantized operands on a sample of
the output (the first and last rows of up to REF_GROUPS experts; the worst expert's
||out - ref|| / ||ref|| is reported), and against torch's output in full (relative difference,
and whether the two outputs are bitwise equal).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

import torch_triton_gemm as tg

from .gemm import relative_error_of_pieces
from .results import GemmResult
from .scaled import FP8, OUT_DTYPE, quantize
from .suites import ScaledGroupedCase
from .timing import Row, TimingSettings, compare, first_call, run_rows, short_error

# The float64 reference covers this many experts (spread over the non-empty ones) and at most
# this many rows of each (its first and last rows): enough to see a wrong group, scale or tile
# edge, cheap at every size.
REF_GROUPS = 16
REF_ROWS = 64
# Rows per piece when comparing with torch's output, so that no fp32 copy of a large output
# exists whole.
COMPARE_ROWS = 4096
ERR_VS = "fp64 deq"

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def missing_reason(device: torch.device | None = None) -> str | None:
    """Why the suite cannot run with this package, torch and GPU, or None."""
    if not hasattr(tg, "scaled_grouped_mm"):
        return "torch_triton_gemm has no scaled_grouped_mm in this version"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "this torch has no torch._scaled_grouped_mm (the peer)"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch._scaled_grouped_mm runs on sm_90 and later)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"torch._scaled_grouped_mm runs on sm_90 and later; this GPU is "
                f"sm_{major}{minor}")
    return None


def make_inputs(case: ScaledGroupedCase, device: torch.device | str) -> Operands:
    """Fresh random operands of the case, quantized rowwise: (a, b, scale_a, scale_b, offs)."""
    sizes = case.group_sizes()
    offs = torch.tensor(list(itertools.accumulate(sizes)), device=device, dtype=torch.int32)
    a, scale_a = quantize(torch.randn(case.tokens, case.k, device=device), 1, case.k)
    w = torch.empty(case.groups, case.n, case.k, device=device, dtype=FP8)
    scale_b = torch.empty(case.groups, case.n, device=device)
    # One expert at a time: DeepSeek-like weights in fp32 all at once would take 30 GB.
    for g in range(case.groups):
        q, scale = quantize(torch.randn(case.n, case.k, device=device), 1, case.k)
        w[g].copy_(q)
        scale_b[g].copy_(scale.reshape(case.n))
    return a, w.transpose(-2, -1), scale_a.reshape(case.tokens), scale_b, offs


def _ops(fast_accum: bool) -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "tgemm": lambda a, b, sa, sb, offs: tg.scaled_grouped_mm(
            a, b, sa, sb, offs, out_dtype=OUT_DTYPE, use_fast_accum=fast_accum),
        "torch": lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(
            a, b, sa, sb, offs, out_dtype=OUT_DTYPE, use_fast_accum=fast_accum),
    }


def reference_rows(case: ScaledGroupedCase) -> list[tuple[int, int, int]]:
    """The sampled output rows as (expert, first row, end row) blocks: the first and last
    REF_ROWS / 2 rows of up to REF_GROUPS experts, spread over the non-empty ones."""
    sizes = case.group_sizes()
    starts = [0, *itertools.accumulate(sizes)]
    nonempty = [g for g, size in enumerate(sizes) if size]
    step = max(1, math.ceil(len(nonempty) / REF_GROUPS))
    half = REF_ROWS // 2
    blocks = []
    for g in nonempty[::step]:
        start, end = starts[g], starts[g + 1]
        if end - start <= REF_ROWS:
            blocks.append((g, start, end))
        else:
            blocks += [(g, start, start + half), (g, end - half, end)]
    return blocks


def reference_error(case: ScaledGroupedCase, args: Operands, out: torch.Tensor) -> float:
    """The worst sampled expert's ||out - ref|| / ||ref||, ref the float64 product of the
    dequantized operands."""
    a, b, scale_a, scale_b, _ = args
    by_group: dict[int, list[tuple[int, int]]] = {}
    for g, start, end in reference_rows(case):
        by_group.setdefault(g, []).append((start, end))
    worst = 0.0
    for g, spans in by_group.items():
        weight = b[g].double() * scale_b[g].double()  # [K, N]
        x = torch.cat([a[s:e].double() * scale_a[s:e, None].double() for s, e in spans])
        got = torch.cat([out[s:e].double() for s, e in spans])
        ref = x @ weight
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def compare_with_peer(out: torch.Tensor, peer: torch.Tensor) -> tuple[float, bool]:
    """(||out - peer|| / ||peer||, whether the two are bitwise equal)."""
    pieces = zip(out.split(COMPARE_ROWS), peer.split(COMPARE_ROWS))
    diff = relative_error_of_pieces((o, p.float()) for o, p in pieces)
    equal = out.shape == peer.shape and out.dtype == peer.dtype and torch.equal(
        out.view(torch.int16), peer.view(torch.int16))
    return diff, bool(equal)


def measure_sgrouped(case: ScaledGroupedCase, settings: TimingSettings,
                     device: torch.device) -> GemmResult:
    """Time tgemm.scaled_grouped_mm and torch._scaled_grouped_mm on the same operands and
    accumulation mode; check tgemm against the sampled float64 reference and torch's output."""
    args = make_inputs(case, device)
    fns = _ops(case.fast_accum)
    out, first_s = first_call(lambda: fns["tgemm"](*args))
    rel_err = reference_error(case, args, out)
    notes = []
    peer_diff, peer_equal = math.nan, None
    try:
        peer = fns["torch"](*args)
        torch.cuda.synchronize()
    except Exception as exc:  # reported as n/a: a torch or GPU its kernels do not cover
        notes.append(f"torch._scaled_grouped_mm n/a ({short_error(exc)})")
        del fns["torch"]
    else:
        peer_diff, peer_equal = compare_with_peer(out, peer)
        del peer
    del out
    timings = compare(fns, args, settings)
    return GemmResult(case, "fp8", timings.kernel_ms, timings.eager_ms, rel_err, ERR_VS,
                      first_s, note="; ".join(notes + timings.notes), peer_diff=peer_diff,
                      peer_equal=peer_equal)


def run_sgrouped(cases: Sequence[ScaledGroupedCase], settings: TimingSettings,
                 device: torch.device) -> list[GemmResult]:
    """Every case of the sgrouped suite."""
    return run_rows([
        Row(case.label(),
            lambda c=case: measure_sgrouped(c, settings, device),
            lambda message, c=case: GemmResult(c, "fp8", error=message))
        for case in cases])
