"""How the GEMM kernels see their operands: TMA eligibility, padded copies, layout keys.

Beneath the ops, read by the planner (which plan fits these operands), the launcher (what the
kernels are passed) and tuning (the operands it times plans on, keyed as the planner looks them
up). Pure functions of shapes, strides, alignment and the device's TMA support.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import device as _device
from ..kernels import wgmma_fp8

# --- TMA eligibility ----------------------------------------------------------------------------
# A TMA descriptor needs a 16-byte aligned base, a unit stride in its last dimension and the other
# stride a multiple of 16 bytes. Operands that miss this run on the portable kernel.

def base_aligned(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on a 16-byte boundary."""
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # FakeTensor / functional tensor while tracing: storages are aligned
        offset = t.storage_offset()
        return type(offset) is int and offset * t.element_size() % 16 == 0


def on_hopper_with_gluon(device: torch.device) -> bool:
    """Whether Hopper's warp-specialized Gluon kernel (kernels/wgmma_fp8.py) can run on
    ``device``: an sm_90 GPU, not Triton's interpreter, and a Triton that has Gluon."""
    return (wgmma_fp8.AVAILABLE and device.type == "cuda" and not _device.interpreter_enabled()
            and torch.cuda.is_available() and _device.capability(device) == (9, 0))


def warp_specialized_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether Hopper's warp-specialized kernel (kernels/wgmma_fp8.py) reads these operands:
    A and B contiguous along K (b as ``W.t()``), a row-major output, every pitch and base
    pointer 16-byte aligned (its TMA descriptors)."""
    return (a.stride(1) == 1 and b.stride(0) == 1 and out.stride(1) == 1
            and all(base_aligned(t) for t in (a, b, out))
            and all((pitch * t.element_size()) % 16 == 0
                    for pitch, t in ((a.stride(0), a), (b.stride(1), b), (out.stride(0), out))))


def warp_specialized_16_bit(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel runs this 16-bit product here: 16-bit operands it
    reads (``warp_specialized_operands``) on a device it runs on (``on_hopper_with_gluon``).
    Its callers rule out activations, traced calls and (the planner) forced plans."""
    return (a.element_size() == 2 and on_hopper_with_gluon(a.device)
            and warp_specialized_operands(a, b, out))


def blockwise_scale_tma(scale_a: torch.Tensor, a_rows: int, stride_sam: int, stride_sak: int,
                        M: int, K: int) -> bool:
    """Whether the warp-specialized kernel's loader brings blockwise ``scale_a`` (one scale per
    ``a_rows`` rows and 128 of K, read through its strides) by TMA (its SCALE_TMA): one scale
    a row, the rows contiguous (the M-major layout torch's blockwise scaled_mm takes), each K
    block's first row 16-byte aligned, and the flat vector they span within 2^31 elements."""
    return (a_rows == 1 and stride_sam == 1 and stride_sak % 4 == 0 and base_aligned(scale_a)
            and (-(-K // wgmma_fp8.SCALE_BLOCK) - 1) * stride_sak + M < 2 ** 31)


def tma_operand(rows: int, cols: int, stride_rows: int, stride_cols: int,
                element_size: int) -> tuple[bool, int, int] | None:
    """(rows contiguous?, stride of rows, stride of columns) as the TMA kernel should see a
    [rows, cols] operand, or None when TMA cannot describe it. A dimension of size 1 has no
    meaningful stride: it gets one that satisfies the rules."""
    def padded(n: int) -> int:
        return -(-n * element_size // 16) * 16 // element_size

    if rows == 1:
        stride_rows = padded(cols)
    if cols == 1:
        stride_cols = padded(rows)
    if stride_cols == 1 and stride_rows > 0 and stride_rows * element_size % 16 == 0:
        return False, stride_rows, 1
    if stride_rows == 1 and stride_cols > 0 and stride_cols * element_size % 16 == 0:
        return True, 1, stride_cols
    return None


def _tma_arguments(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   pads: tuple[Pad | None, Pad | None] = (None, None)
                   ) -> tuple[tuple[int, ...], dict[str, bool]] | None:
    """Strides and layout flags for mm_tma_kernel, or None when the operands need the portable
    kernel; an operand with a ``Pad`` is seen as its padded copy."""
    M, K = a.shape
    N = b.shape[1]
    if K == 0:
        return None
    size = a.element_size()
    descs = []
    for t, pad, rows, cols in ((a, pads[0], M, K), (b, pads[1], K, N)):
        if pad is None:
            if not base_aligned(t):
                return None
            descs.append(tma_operand(rows, cols, *t.stride(), size))
        else:
            descs.append(tma_operand(rows, cols, *pad.strides(), size))
    a_desc, b_desc = descs
    if a_desc is None or b_desc is None:
        return None
    strides = (a_desc[1], a_desc[2], b_desc[1], b_desc[2])
    flags = {"A_M_CONTIGUOUS": a_desc[0], "B_K_CONTIGUOUS": b_desc[0],
             "C_TMA": N * out.element_size() % 16 == 0}
    return strides, flags


# --- padded copies for TMA ----------------------------------------------------------------------
# An operand TMA cannot describe (a row pitch that is not a multiple of 16 bytes, as in
# 999 x 1007 bf16, or an unaligned base) would send a large product to the portable kernel
# reading it without vector loads. Copying it into a buffer whose rows start every PAD_BYTES
# bytes costs one pass over it; on an H100, 1000^3 to 2048^3 products with odd sizes then ran
# 1.3-2x faster, copies included (rows at 128 bytes beat 16). Small products read the operands
# as they are.
PAD_BYTES = 128
PAD_MIN_SIZE = 1 << 27  # M * N * K
# Each copied element must be reused by many output tiles: skinny products (decode) are bound
# by reading the operands once, and a copy would double that.
PAD_MIN_SIDE = 512


class Pad(NamedTuple):
    """A padded copy of a [rows, cols] operand: row-major (or column-major: ``columns``) with
    ``pitch`` elements between the starts of consecutive rows (columns)."""
    columns: bool
    pitch: int

    def strides(self) -> tuple[int, int]:
        return (1, self.pitch) if self.columns else (self.pitch, 1)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        # One allocation with the padded strides (an eager call makes this copy every time).
        return torch.empty_strided(t.shape, self.strides(), dtype=t.dtype,
                                   device=t.device).copy_(t)


def kernel_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    pad: bool | None = None
                    ) -> tuple[tuple[tuple[int, ...], dict[str, bool]] | None,
                               tuple[Pad | None, Pad | None], tuple[int, int, int, int]]:
    """How the kernels see a and b (sizes known): the TMA kernel's arguments (None: portable
    kernel only), the padded copies made first (see PAD_BYTES; any plan reads them), and the
    strides (am, ak, bk, bn) the kernels read. Operands TMA cannot describe are copied when
    ``pad`` says so (None: for large products, PAD_MIN_SIZE and PAD_MIN_SIDE). Tuning keys its
    plans by the same view."""
    device = a.device
    strides = (*a.stride(), *b.stride())
    tma_args = _tma_arguments(a, b, out)
    # The interpreter runs the TMA kernel too (for tests), but only when a plan asks for it.
    if not (_device.supports_tma(device) or _device.interpreter_enabled()):
        return None, (None, None), strides
    (M, K), N = a.shape, b.shape[1]
    if pad is None:
        pad = M * N * K >= PAD_MIN_SIZE and min(M, N) >= PAD_MIN_SIDE
    if tma_args is None and _device.supports_tma(device) and pad:
        pads = _pads(a, b)
        padded = _tma_arguments(a, b, out, pads)
        if padded is not None:
            a_strides = pads[0].strides() if pads[0] else strides[:2]
            b_strides = pads[1].strides() if pads[1] else strides[2:]
            return padded, pads, (*a_strides, *b_strides)
    return tma_args, (None, None), strides


def _pads(a: torch.Tensor, b: torch.Tensor) -> tuple[Pad | None, Pad | None]:
    """The padded copies a large product needs for the TMA kernel (None: used as it is)."""
    size = a.element_size()

    def pad(t: torch.Tensor) -> Pad | None:
        rows, cols = t.shape
        if base_aligned(t) and tma_operand(rows, cols, *t.stride(), size) is not None:
            return None
        columns = t.stride(0) == 1 and t.stride(1) != 1  # keep a column-major operand so
        inner = rows if columns else cols
        step = PAD_BYTES // size
        return Pad(columns, -(-inner // step) * step)

    return pad(a), pad(b)


def layout_key(stride_ak: int, stride_bk: int) -> int:
    """Whether each operand is contiguous along K, as one key (2 for a, 1 for b): the best tile
    differs between layouts, so plans are memoised and tuned per layout."""
    return 2 * int(stride_ak == 1) + int(stride_bk == 1)
