"""Sample inputs and references shared by the tgemm tests (the op's specification as data)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Relative-error budgets against a float64 reference, by the dtype the result is rounded through.
TOLERANCE = {
    torch.float32: 1e-5,   # IEEE fp32 ("highest" matmul precision)
    "tf32": 2e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}

# (M, N, K): odd sizes, sizes below one tile, exact tiles, a K remainder after full K steps,
# skinny M, and the empty cases.
SHAPES = [
    (37, 45, 70),
    (64, 32, 64),
    (1, 33, 40),
    (5, 7, 3),
    (20, 70, 33),
    (16, 16, 0),
    (0, 8, 8),
    (8, 0, 8),
]

LAYOUTS = ("row", "col", "nt", "sliced", "broadcast")


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Fresh standard-normal values in ``dtype`` (fp8 drawn in fp32 and rounded)."""
    x = torch.randn(shape, device=device)
    return x.to(dtype)


def make_operand(rows: int, cols: int, dtype: torch.dtype, device: str, layout: str,
                 operand: str) -> torch.Tensor:
    """A [rows, cols] tensor laid out as ``layout`` says.

    row: contiguous; col: a transposed contiguous tensor; nt: a row-major A with B as W.t()
    (nn.Linear's call); sliced: a view with a storage offset and padded strides;
    broadcast: a stride-0 expand along the rows (A) or columns (B).
    """
    if layout == "nt":
        layout = "row" if operand == "a" else "col"
    if layout == "row":
        return randn((rows, cols), dtype, device)
    if layout == "col":
        return randn((cols, rows), dtype, device).t()
    if layout == "sliced":
        return randn((rows + 3, cols + 5), dtype, device)[2:2 + rows, 3:3 + cols]
    if layout == "broadcast":
        # Positive values: with both operands broadcast the product is one K-term dot product
        # repeated, and random signs could cancel it far below its terms (condition ~800 seen:
        # torch's own fp32 product then misses fp32's budget too).
        shape = (1, cols) if operand == "a" else (rows, 1)
        values = (torch.randn(shape, device=device).abs() + 0.5).to(dtype)
        return values.expand(rows, cols)
    raise ValueError(layout)


@dataclass
class MMSample:
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None = None
    activation: str = "none"
    out_dtype: torch.dtype | None = None
    name: str = ""
    kwargs: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (self.a, self.b, self.bias, self.activation, self.out_dtype)


def sample_inputs(device: str, dtype: torch.dtype = torch.float32,
                  requires_grad: bool = False) -> list[MMSample]:
    """The interesting mm cases for one dtype: layouts x shapes, then the epilogue variants."""
    samples = []
    for layout in LAYOUTS:
        for m, n, k in SHAPES:
            a = make_operand(m, k, dtype, device, layout, "a")
            b = make_operand(k, n, dtype, device, layout, "b")
            samples.append(MMSample(a, b, name=f"{layout}-{m}x{n}x{k}"))
    bias_dtype = torch.bfloat16 if dtype in FP8 else dtype
    for activation in ("none", "relu", "gelu", "silu", "leaky_relu"):
        m, n, k = 19, 40, 36
        a = randn((m, k), dtype, device)
        b = randn((n, k), dtype, device).t()
        bias = randn((n,), bias_dtype, device)
        samples.append(MMSample(a, b, bias, activation, name=f"bias-{activation}"))
    if requires_grad:
        for s in samples:
            s.a = s.a.detach().clone().requires_grad_()
            s.b = s.b.detach().clone().requires_grad_()
            if s.bias is not None:
                s.bias = s.bias.detach().clone().requires_grad_()
    return samples


def reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str = "none") -> torch.Tensor:
    """activation(a @ b + bias) in float64 (differentiable)."""
    z = a.double() @ b.double()
    if bias is not None:
        z = z + bias.double()
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    if activation == "leaky_relu":
        return F.leaky_relu(z, 0.01)
    return z


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere fails every budget."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    if out.numel() == 0:
        return 0.0
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def tolerance(out_dtype: torch.dtype, input_dtype: torch.dtype) -> float:
    """The budget for a result rounded to ``out_dtype`` from inputs of ``input_dtype``."""
    if input_dtype in FP8:
        # Against the dequantized (exact fp8 values) reference; Hopper's fp8 MMA accumulates
        # with reduced precision, so an fp32 output is not fp32-exact.
        return 1e-2
    if input_dtype == torch.float32 and out_dtype == torch.float32:
        if torch.get_float32_matmul_precision() != "highest":
            return TOLERANCE["tf32"]
    return TOLERANCE[out_dtype]
