"""The elementwise parts of a gated MLP's activation, act(gate) * up (tgemm::moe_mlp).

``glu_forward_kernel`` applies it to saved pre-activations (moe_mlp's training forward keeps
them for the backward). ``glu_backward_kernel`` is one kernel, so that the backward pass holds
no fp32 temporaries of the [S, 2I] pre-activations: it reads each slot's gate and up values
and the gradient of the gated product, and writes the gradients of gate and up, the gated
product scaled by the slot's router weight (the down projection's gradient reads it), and the
router weight's gradient, a row-wise dot product summed in one program per row
(deterministic).
"""

import triton
import triton.language as tl

from .tiles import activation_and_grad, apply_activation


@triton.jit
def glu_backward_kernel(
    pre_ptr, grad_ptr, weights_ptr, order_ptr, hw_ptr, grad_pre_ptr, grad_weights_ptr,
    S, INTER,
    stride_pre, stride_grad, stride_hw, stride_grad_pre,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program p takes slots [p * BLOCK_M, (p + 1) * BLOCK_M) and walks their INTER columns in
    # BLOCK_N steps: gate = pre[:, n], up = pre[:, INTER + n], g = grad[:, n] (the gradient of
    # act(gate) * up before the router weight w = weights[order[s]]). It stores
    # hw = w * act(gate) * up, grad_pre[:, n] = w * g * up * act'(gate),
    # grad_pre[:, INTER + n] = w * g * act(gate), and
    # after the last step the row sums of g * act(gate) * up, the gradient of w, at the slot's
    # own place order[s] of grad_weights. All arithmetic in fp32.
    rows = tl.program_id(axis=0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < S
    rows_64 = rows.to(tl.int64)
    slot = tl.load(order_ptr + rows, mask=in_rows, other=0)
    weight = tl.load(weights_ptr + slot, mask=in_rows, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n in range(0, INTER, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        mask = in_rows[:, None] & (cols < INTER)[None, :]
        pre_rows = pre_ptr + rows_64[:, None] * stride_pre
        gate = tl.load(pre_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(pre_rows + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + rows_64[:, None] * stride_grad + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        act, d_act = activation_and_grad(gate, ACTIVATION)
        h = act * up
        dot += tl.sum(h * g, axis=1)
        gw = g * weight[:, None]
        tl.store(hw_ptr + rows_64[:, None] * stride_hw + cols[None, :],
                 (h * weight[:, None]).to(hw_ptr.dtype.element_ty), mask=mask)
        grad_rows = grad_pre_ptr + rows_64[:, None] * stride_grad_pre
        tl.store(grad_rows + cols[None, :], (gw * up * d_act).to(grad_pre_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(grad_rows + INTER + cols[None, :], (gw * act).to(grad_pre_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(grad_weights_ptr + slot, dot, mask=in_rows)


@triton.jit
def glu_forward_kernel(
    pre_ptr, h_ptr, S, INTER, stride_pre, stride_h,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (p, q) takes slots [p * BLOCK_M, (p + 1) * BLOCK_M) and columns
    # [q * BLOCK_N, (q + 1) * BLOCK_N): h[:, n] = act(pre[:, n]) * pre[:, INTER + n], in fp32.
    rows = tl.program_id(axis=0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(axis=1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < S)[:, None] & (cols < INTER)[None, :]
    rows_64 = rows.to(tl.int64)
    pre_rows = pre_ptr + rows_64[:, None] * stride_pre
    gate = tl.load(pre_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pre_rows + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = apply_activation(gate, ACTIVATION) * up
    tl.store(h_ptr + rows_64[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask)
