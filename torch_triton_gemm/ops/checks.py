"""Argument checks and per-call facts that the ops share: the bottom of ops/, plain torch.

Each op (ops/mm.py, grouped_mm.py, scaled_mm.py, scaled_grouped_mm.py, grouped_mm_list.py)
checks its own contract with these helpers, and tuning its device; the launcher and the ops'
eager paths read the facts (int64 indexing, tl.dot's input precision, fp32 matmul precision,
the default out dtype). No plan, no kernel, no import from the package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCKWISE_K = 128  # K elements per blockwise fp8 scale (1x128 and 128x128 blocks)
_INT32_LIMIT = 2**31 - 1


def check(cond: bool | torch.SymBool, message: Callable[[], str],
          error: type[Exception] = RuntimeError) -> None:
    """torch._check / torch._check_value, skipped for a plain True to keep eager launches cheap.

    Symbolic conditions still go to torch._check, which records them without guarding.
    """
    if cond is True:
        return
    if error is ValueError:
        torch._check_value(cond, message)
    else:
        torch._check(cond, message)


def check_value(cond: bool, message: Callable[[], str]) -> None:
    """``check`` raising ValueError: for arguments of the right type but a wrong value."""
    check(cond, message, ValueError)


def check_operand_pair(op: str, a: torch.Tensor, b: torch.Tensor,
                       dtypes: tuple[torch.dtype, ...]) -> None:
    """The checks of a and b that every two-operand op makes: a supported dtype shared by
    both, one device, dense layouts; messages start with the op's name ``op``."""
    check_value(
        a.dtype in dtypes,
        lambda: f"{op}: a has dtype {a.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    check_value(
        a.dtype == b.dtype,
        lambda: f"{op}: a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    check(a.device == b.device, lambda: f"{op}: a is on {a.device} but b is on {b.device}")
    check(a.layout == torch.strided and b.layout == torch.strided,
          lambda: f"{op}: a and b must be dense (strided) tensors, got {a.layout} and "
                   f"{b.layout}")


def default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The out dtype of a GEMM on ``dtype`` inputs whose caller names none: the input dtype,
    bfloat16 for fp8."""
    return torch.bfloat16 if dtype in FP8_DTYPES else dtype


def check_epilogue_args(op: str, out_dtype: torch.dtype, bias: torch.Tensor | None,
                        n: int) -> None:
    """The out dtype and the [N] bias of an op whose epilogue adds bias in fp32 and casts."""
    check_value(
        out_dtype in OUT_DTYPES,
        lambda: f"{op}: out_dtype {out_dtype} is not supported; choose one of {OUT_DTYPES}")
    if bias is not None:
        check(
            bias.dim() == 1 and bias.shape[0] == n,
            lambda: f"{op}: bias must be 1-D of size N={n} (b's columns), got shape "
                    f"{tuple(bias.shape)}")
        check_value(
            bias.dtype in OUT_DTYPES,
            lambda: f"{op}: bias has dtype {bias.dtype}; supported: {OUT_DTYPES}")


def ceil_div(x: Any, y: int) -> Any:
    return (x + y - 1) // y


def blockwise_scale_blocks(scale_a_shape: tuple[Any, ...], scale_b_shape: tuple[Any, ...],
                           m: Any, n: Any, k: Any) -> tuple[int | None, int | None]:
    """How blockwise fp8 scales of an [M, K] x [K, N] product cover their operands, read from
    their shapes as torch._scaled_mm reads them: rows of a per scale_a entry (1 for 1x128
    blocks, scale_a [M, kb]; 128 for 128x128 blocks, [ceil(M/128), kb]) and columns of b per
    scale_b entry (1: [kb, N]; 128: [kb, ceil(N/128)]), with kb = ceil(K/128); None for a
    shape that fits neither (1x128 is read first where both fit)."""
    kb = ceil_div(k, BLOCKWISE_K)
    a_rows = b_cols = None
    if scale_a_shape == (m, kb):
        a_rows = 1
    elif scale_a_shape == (ceil_div(m, BLOCKWISE_K), kb):
        a_rows = BLOCKWISE_K
    if scale_b_shape == (kb, n):
        b_cols = 1
    elif scale_b_shape == (kb, ceil_div(n, BLOCKWISE_K)):
        b_cols = BLOCKWISE_K
    return a_rows, b_cols


def needs_int64_indexing(shape_and_strides: tuple[tuple[int, ...], ...]) -> bool:
    """True when an element offset of some 2-D tensor (its shape and strides) may not fit in
    int32."""
    for rows, cols, row_stride, col_stride in shape_and_strides:
        if rows == 0 or cols == 0:
            continue
        if (rows - 1) * row_stride + (cols - 1) * col_stride > _INT32_LIMIT:
            return True
    return False


def input_precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input precision for ``dtype`` operands: for float32 "ieee" where
    ``torch.get_float32_matmul_precision()`` is "highest", else "tf32"; None for the others."""
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# torch.get_float32_matmul_precision without its Python wrapper (read on every eager call).
float32_precision = torch._C._get_float32_matmul_precision
