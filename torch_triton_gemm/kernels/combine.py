"""The combine of a routed mixture-of-experts product (tgemm::moe_mlp).

moe_mlp's down launch (and its backward's input-gradient launch) writes one row per token slot
in the slots' sorted order, so that whole tiles store through TMA like any grouped product's;
``combine_kernel`` then gives each token the sum of its k slots' rows, found through the slots'
sorted positions, each times the slot's router weight. The sum runs in fp32 in slot order
(deterministic) and rounds once.
"""

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    y_ptr, positions_ptr, weights_ptr, offs_ptr, out_ptr,
    T, N, E, TOP_K,
    stride_y, stride_positions_t, stride_positions_j, stride_weights_t, stride_weights_j,
    stride_out,
    HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (p, q) takes tokens [p * BLOCK_T, (p + 1) * BLOCK_T) and columns
    # [q * BLOCK_N, (q + 1) * BLOCK_N): out[t, n] = sum_j w[t, j] * y[positions[t, j], n], over
    # the slots j whose position is below offs[E - 1], the end of the last expert's rows (a slot
    # of no expert adds nothing; its row of y was never written), and not negative (no read
    # outside y whatever positions holds). Without HAS_WEIGHTS, w = 1.
    tokens = tl.program_id(axis=0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(axis=1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_tokens = tokens < T
    in_cols = cols < N
    routed = tl.load(offs_ptr + E - 1)
    tokens_64 = tokens.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in range(TOP_K):
        position = tl.load(positions_ptr + tokens_64 * stride_positions_t
                           + j * stride_positions_j, mask=in_tokens, other=0)
        valid = in_tokens & (position >= 0) & (position < routed)
        rows = y_ptr + position.to(tl.int64)[:, None] * stride_y
        y = tl.load(rows + cols[None, :], mask=valid[:, None] & in_cols[None, :], other=0.0)
        y = y.to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + tokens_64 * stride_weights_t + j * stride_weights_j,
                             mask=valid, other=0.0)
            y = y * weight.to(tl.float32)[:, None]
        acc += y
    tl.store(out_ptr + tokens_64[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=in_tokens[:, None] & in_cols[None, :])
