"""Operand tiles through Hopper's tensor memory accelerator (TMA), shared by every tgemm kernel.

Descriptors are built on the device (``tl.make_tensor_descriptor``), inside the kernel, from the
pointer, sizes and strides the kernel already receives: they then work under torch.compile and
CUDA graphs like any pointer argument (host-built descriptors passed into a traced op did not).
A descriptor needs a unit stride in its last dimension, so an operand is described along its
contiguous dimension and a tile of a transposed operand is loaded as such and transposed in
registers, which Triton folds into the shared-memory layout the tensor cores read.
Loads past the described extent come back as zeros: tiles on the M, N and K edges need no masks.
"""

import triton
import triton.language as tl

from .tiles import column_halves


@triton.jit
def operand_descriptor(ptr, rows, cols, stride_rows, stride_cols,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       ROWS_CONTIGUOUS: tl.constexpr):
    """Descriptor of a [rows, cols] operand whose unit stride is along its rows
    (``ROWS_CONTIGUOUS``: described as its transpose [cols, rows]) or along its columns."""
    if ROWS_CONTIGUOUS:
        return tl.make_tensor_descriptor(ptr, shape=[cols, rows], strides=[stride_cols, 1],
                                         block_shape=[BLOCK_COLS, BLOCK_ROWS])
    else:
        return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[stride_rows, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def load_operand(desc, row, col, ROWS_CONTIGUOUS: tl.constexpr):
    """The [BLOCK_ROWS, BLOCK_COLS] tile at (row, col) of an operand described by
    ``operand_descriptor`` with the same ``ROWS_CONTIGUOUS``."""
    if ROWS_CONTIGUOUS:
        return desc.load([col, row]).T
    else:
        return desc.load([row, col])


@triton.jit
def store_tile(desc, c, row, col, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SUBTILE: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_N] tile c at (row, col) through a descriptor of
    [BLOCK_M, BLOCK_N // SUBTILE] blocks (SUBTILE 1 or 2). Stores are asynchronous and clipped
    at the described extent; in two column halves, the staging buffer is half the size and the
    first half is on its way while the second is written to shared memory."""
    if SUBTILE == 2:
        c0, c1 = column_halves(c, BLOCK_M, BLOCK_N)
        desc.store([row, col], c0)
        desc.store([row, col + BLOCK_N // 2], c1)
    else:
        desc.store([row, col], c)
