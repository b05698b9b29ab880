"""tgemm::moe_mlp — a routed mixture-of-experts MLP (Mixtral / Qwen-MoE block) in two fused
grouped launches, with gradients.

Contract:

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k], topk_weights [T, k]  ->  out [T, H]
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(gate) * up),   e = topk_ids[t, j],
    gate, up = the first and second I rows of w13[e] @ x[t]

- x, w13 and w2 share one dtype: float16, bfloat16 or float32 (any strides); topk_ids int32 or
  int64; topk_weights any of those float dtypes; out has x's dtype. activation: "silu"
  (SwiGLU) or "gelu" (tanh approximation, GeGLU).
- Routing stays on the device (a stable sort of the T * k slots by expert and a search for the
  group ends): no host sync, so the op captures into CUDA graphs and compiles into one graph.
  Experts may receive no tokens.
- Ids outside [0, E) select no expert: the slot adds nothing to out and its weight gets a zero
  gradient (expert parallelism marks tokens of other ranks' experts with -1 this way). Checking
  ids costs a device sync, so only ``moe_mlp(..., validate_ids=True)`` does it (eager calls; it
  raises ValueError naming the op).
- Deterministic: no atomics. The first launch reads the rows of x through the sorted slots'
  token index (no permuted copy of x) and applies act(gate) * up in its epilogue: a tile
  accumulates gate columns n..n+BN and up columns I+n..I+n+BN in one dot. The second launch
  is a plain grouped product over the sorted slots (whole tiles stored through TMA); the
  combine (kernels/combine.py) then sums each token's k slot rows, found through the slots'
  sorted positions, times their router weights, in fp32 and slot order. (Scattering the rows
  to the slots' places from the second launch's epilogue and summing over k ran its launch
  1.06x slower on an H100: scattered rows store through pointers.)

Training: calls of ``moe_mlp`` that need gradients run two ops, tgemm::moe_gate_up (the
first launch, its gated epilogue also storing the gate/up pre-activations [T * k, 2I] in x's
dtype) and tgemm::moe_down (the second launch and the combine on act(gate) * up), so that the
backward reads the pre-activations instead of running the first launch again (a third of the
forward's FLOPs), and autograd frees them once the down half's backward has used them, before
the gate/up half's allocates w13's gradient; act(gate) * up is freed after the forward (the
backward differentiates through the pre-activations). Each returns its routing (order, token
rows, offs) beside its output, which its backward reuses. The output is the no-grad call's, to
the bit. Called as an op with gradients, tgemm::moe_mlp keeps only its inputs and its backward
recomputes the pre-activations (tgemm::moe_gate_up's launch), to the same bits.

Backward: grad_out's rows are copied into slot order once (w2's gradient reads the same
copy) and multiplied by w2 in a plain grouped launch; one elementwise kernel (kernels/glu.py) then
gives the gradients of gate and up (router weight applied), the router weights' gradient (a
row-wise dot of act(gate) * up with grad_out @ w2, one program per row: deterministic) and
w * act(gate) * up for w2's gradient, with no fp32 temporaries. The input gradient goes out
through the grouped product over the sorted slots and the same combine (weights 1); the
weight gradients are
tgemm::grouped_mm's 2-D x 2-D form on gathered copies of x's and grad_out's rows.

This module reads top to bottom: checks, routing, the routed grouped product
(tgemm::moe_routed_mm, used by the backward), the gated activation's backward
(tgemm::moe_glu_backward) and forward, the op bodies (tgemm::moe_mlp, tgemm::moe_gate_up,
tgemm::moe_down) and fakes, autograd, public API.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .. import device as _device
from .. import tuning
from ..kernels.combine import combine_kernel
from ..kernels.glu import glu_backward_kernel, glu_forward_kernel
from ._registry import define_triton_op, explain_bad_arguments
from .checks import check, check_value, float32_precision
from .grouped_launch import (
    GroupedLaunch,
    GroupedRouting,
    check_grouping,
    prepare_grouped_launch,
    run_grouped_launch,
)
from .grouped_mm import grouped_mm
from .launcher import launch_kernel, memoised_launch, tensor_key

OP = "tgemm::moe_mlp"
ROUTED_OP = "tgemm::moe_routed_mm"
GLU_BACKWARD_OP = "tgemm::moe_glu_backward"
GATE_UP_OP = "tgemm::moe_gate_up"
DOWN_OP = "tgemm::moe_down"
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = ("silu", "gelu")
_INT32_LIMIT = 2**31 - 1


# --- checks -------------------------------------------------------------------------------------

def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str, op: str = OP) -> None:
    """Shapes, dtypes, devices and the activation (also under FakeTensor and symbolic shapes);
    the ids' values are data (see the module docstring)."""
    check(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3,
          lambda: f"{op}: x must be 2-D [T, H], w13 3-D [E, 2I, H] and w2 3-D [E, H, I]; got "
                   f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    _check_gate_up(x, w13, topk_ids, op)
    _check_down(w2, w13.shape[0], x.shape[1], w13.shape[1] // 2, x, topk_ids, topk_weights,
                activation, op, "x")


def _check_gate_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                   op: str = GATE_UP_OP) -> None:
    """The checks of x, w13 and topk_ids (see ``_check_inputs``)."""
    check(x.dim() == 2 and w13.dim() == 3,
          lambda: f"{op}: x must be 2-D [T, H] and w13 3-D [E, 2I, H]; got x {tuple(x.shape)}, "
                   f"w13 {tuple(w13.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
          lambda: f"{op}: topk_ids must be [T, k] with T = {x.shape[0]} (x's rows), got "
                   f"{tuple(topk_ids.shape)}")
    check_value(x.dtype in INPUT_DTYPES,
                lambda: f"{op}: x has dtype {x.dtype}; supported: {INPUT_DTYPES}")
    check_value(w13.dtype == x.dtype,
                lambda: f"{op}: w13 ({w13.dtype}) must have x's dtype {x.dtype}")
    check_value(topk_ids.dtype in ID_DTYPES,
                lambda: f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    _, width, hidden = w13.shape
    check(hidden == x.shape[1],
          lambda: f"{op}: w13 is [E, 2I, H] with H = {hidden} but x has {x.shape[1]} columns")
    check(width % 2 == 0,
          lambda: f"{op}: w13 must stack gate and up rows, [E, 2I, H]; got {width} rows")
    for name, t in (("w13", w13), ("topk_ids", topk_ids)):
        check(t.device == x.device,
              lambda name=name, t=t: f"{op}: {name} is on {t.device} but x is on {x.device}")
    slots = topk_ids.numel()
    check(slots <= _INT32_LIMIT, lambda: f"{op}: T * k = {slots} slots exceed int32 indexing")


def _check_down(w2: torch.Tensor, experts: int, hidden: int, inter: int, x: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str,
                op: str = DOWN_OP, name: str = "pre") -> None:
    """The checks of w2 ([experts, hidden, inter], the dtype and device of ``x``, which the
    messages call ``name``), topk_weights and the activation (see ``_check_inputs``)."""
    check(tuple(topk_weights.shape) == tuple(topk_ids.shape),
          lambda: f"{op}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                   f"{tuple(topk_weights.shape)}")
    check_value(w2.dtype == x.dtype,
                lambda: f"{op}: w2 ({w2.dtype}) must have {name}'s dtype {x.dtype}")
    check_value(topk_weights.dtype in INPUT_DTYPES,
                lambda: f"{op}: topk_weights has dtype {topk_weights.dtype}; supported: "
                         f"{INPUT_DTYPES}")
    check_value(activation in ACTIVATIONS,
                lambda: f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(w2.dim() == 3 and tuple(w2.shape) == (experts, hidden, inter),
          lambda: f"{op}: w2 must be [E, H, I] = {(experts, hidden, inter)}, got "
                   f"{tuple(w2.shape)}")
    for what, t in (("w2", w2), ("topk_weights", topk_weights)):
        check(t.device == x.device,
              lambda what=what, t=t: f"{op}: {what} is on {t.device} but {name} is on "
                                     f"{x.device}")


def check_ids_in_range(topk_ids: torch.Tensor, experts: int) -> None:
    """Raise ValueError if an id is outside [0, experts): one reduction and a host sync, so
    eager calls only (traced calls skip it)."""
    if torch.compiler.is_compiling() or topk_ids.numel() == 0:
        return
    bad = ((topk_ids < 0) | (topk_ids >= experts)).any()
    if bool(bad):
        low, high = int(topk_ids.min()), int(topk_ids.max())
        raise ValueError(f"{OP}: topk_ids must lie in [0, {experts}) (E = w13.shape[0]), got "
                         f"values from {low} to {high}")


# --- routing ------------------------------------------------------------------------------------

def route(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """Sort the T * k slots by expert on the device: (order, tokens, offs).

    order[s] is the flat slot index t * k + j of sorted slot s (int32), tokens[s] its token t
    (int32), offs the int32 cumulative ends of the experts' slot ranges. Slots of ids outside
    [0, E) sort after the last expert (past offs[-1]): no group reads or writes them.
    """
    flat = topk_ids.reshape(-1)
    # The narrowest key that holds every expert and the one past them: a radix sort's passes
    # go by key width (H100, 8 192 slots: int16 keys route in 49 us, int64 ones in 97).
    key_dtype = torch.int16 if experts < torch.iinfo(torch.int16).max else torch.int32
    # Ids outside [0, E) become E: clamped into [-1, E], then -1 wraps to E. (Each torch op
    # here is a launch and several microseconds of host time: as few as give the same keys.)
    key = flat.clamp(-1, experts).remainder(experts + 1).to(key_dtype)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(experts, device=flat.device, dtype=key_dtype)
    offs = torch.searchsorted(sorted_key, bounds, right=True, out_int32=True)
    order = order.to(torch.int32)
    tokens = torch.div(order, topk_ids.shape[1], rounding_mode="floor")
    return order, tokens, offs


# moe_mlp's training path runs two ops that each route the same ids. Its eager calls hand
# tgemm::moe_gate_up's routing to the tgemm::moe_down call right after it (about ten launches
# fewer a step): only inside that call, where nothing can change the ids in between, and only
# for the very ids tensor it was computed from. Traced calls always route.
_HANDED = threading.local()


@contextlib.contextmanager
def _handing_routing(topk_ids: torch.Tensor, experts: int,
                     routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                     ) -> Iterator[None]:
    """Within the block, eager tgemm::moe_down calls on ``topk_ids`` itself (and ``experts``)
    take ``routing`` (tgemm::moe_gate_up's) instead of routing again."""
    _HANDED.routing = (topk_ids, experts, routing)
    try:
        yield
    finally:
        _HANDED.routing = None


def _route_or_handed(topk_ids: torch.Tensor, experts: int, traceable: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``route``'s result, from the routing handed over for these ids where an eager call has
    one (see ``_handing_routing``)."""
    handed = getattr(_HANDED, "routing", None)
    if not traceable and handed is not None and handed[0] is topk_ids and handed[1] == experts:
        return handed[2]
    return route(topk_ids, experts)


# --- the routed grouped product -----------------------------------------------------------------
# tgemm::grouped_mm's 2-D x 3-D form with its rows routed: "gather" reads A's rows through an
# index (kernels/grouped.py's ROUTE flag); "combine" sums each token's slot rows of the product
# (kernels/combine.py). moe_mlp's forward launches it directly; its backward calls it as an op,
# which tracing sees.

def slot_positions(order: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """[T, k] int32: where slot t * k + j sits in the sorted order (the inverse of ``order``)."""
    ranks = torch.arange(order.shape[0], device=order.device, dtype=torch.int32)
    positions = torch.empty_like(ranks).scatter(0, order.long(), ranks)
    return positions.view(tokens, top_k)


def _routed_shape(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                  gate: str) -> tuple[int | torch.SymInt, int | torch.SymInt]:
    return (rows.shape[0], b.shape[2] // 2 if gate != "none" else b.shape[2])


def _check_routed(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor,
                  row_weights: torch.Tensor | None, route: str, gate: str) -> None:
    check_grouping(ROUTED_OP, a, b, offs, INPUT_DTYPES)
    check(a.dim() == 2 and b.dim() == 3,
          lambda: f"{ROUTED_OP}: a must be 2-D and b 3-D, got {tuple(a.shape)} and "
                   f"{tuple(b.shape)}")
    check_value(route in ("gather", "combine"),
                lambda: f"{ROUTED_OP}: route must be 'gather' or 'combine', got {route!r}")
    check_value(gate == "none" or gate in ACTIVATIONS and route == "gather",
                lambda: f"{ROUTED_OP}: gate must be 'none' or, gathering, one of {ACTIVATIONS}; "
                         f"got {gate!r}")
    check(rows.dtype == torch.int32 and rows.device == a.device
          and rows.dim() == (1 if route == "gather" else 2),
          lambda: f"{ROUTED_OP}: rows must be int32 on {a.device}, [S] token rows gathering or "
                   f"[T, k] slot positions combining; got {rows.dtype} {tuple(rows.shape)}")
    check(route == "gather" or a.shape[0] == rows.numel(),
          lambda: f"{ROUTED_OP}: combining, a must have one row per slot ({rows.numel()}), got "
                   f"{a.shape[0]}")
    check(gate == "none" or b.shape[2] % 2 == 0,
          lambda: f"{ROUTED_OP}: a gated product needs an even column count, got {b.shape[2]}")
    if row_weights is not None:
        check(route == "combine" and row_weights.shape == rows.shape
              and row_weights.dtype in INPUT_DTYPES and row_weights.device == a.device,
              lambda: f"{ROUTED_OP}: row_weights must be float [T, k] like rows, combining")


def _moe_routed_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                        rows: torch.Tensor, row_weights: torch.Tensor | None, route: str,
                        gate: str, zero_tail: bool) -> torch.Tensor:
    _check_routed(a, b, offs, rows, row_weights, route, gate)
    return a.new_empty(_routed_shape(a, b, rows, gate))


def launch_routed(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor,
                  row_weights: torch.Tensor | None, out: torch.Tensor, route: str, gate: str,
                  zero_tail: bool, traceable: bool, pre: torch.Tensor | None = None) -> None:
    """Write the routed product into ``out`` (checked inputs); e is slot s's group in offs.

    "gather": out[s] = gate(a[rows[s]] @ b[e]), one launch; zero_tail writes zeros for the
    slots past offs[-1]. A gated launch given ``pre`` (contiguous [S, 2N]) also stores
    a[rows[s]] @ b[e] there, before the activation. "combine": rows [T, k] holds each token
    slot's sorted position p, and out[t] = sum_j row_weights[t, j] * (a[p] @ b[e]) (weights 1
    without row_weights), the slots past offs[-1] adding nothing: the plain grouped launch
    into a [S, N] buffer (whole tiles stored through TMA where it can), then
    kernels/combine.py."""
    if route == "gather":
        routing = GroupedRouting(rows.shape[0], gate, pre is not None)
        launch = _grouped_launch(a, b, offs, out, zero_tail, routing, traceable)
        if launch is not None:
            run_grouped_launch(launch, a, b, offs, None, out, traceable, rows=rows, pre=pre)
        return
    tokens, top_k = rows.shape
    if out.numel() == 0:
        return
    if top_k == 0 or offs.shape[0] == 0:
        out.zero_()
        return
    per_slot = a.new_empty(a.shape[0], out.shape[1])
    launch = _grouped_launch(a, b, offs, per_slot, False, None, traceable)
    if launch is not None:
        run_grouped_launch(launch, a, b, offs, None, per_slot, traceable)
    block_t, block_n, num_warps = tuning.moe_elementwise_tile()
    grid = ((tokens + block_t - 1) // block_t, (out.shape[1] + block_n - 1) // block_n)
    weights = row_weights if row_weights is not None else rows
    launch_kernel(combine_kernel, grid,
                  (per_slot, rows, weights, offs, out, tokens, out.shape[1], offs.shape[0],
                   top_k, per_slot.stride(0), *rows.stride(), *weights.stride(), out.stride(0),
                   row_weights is not None),
                  {"BLOCK_T": block_t, "BLOCK_N": block_n, "num_warps": num_warps}, traceable)


def _grouped_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                    zero_tail: bool, routing: GroupedRouting | None,
                    traceable: bool) -> GroupedLaunch | None:
    """The grouped launch of a routed product; for plain eager calls (not ``traceable``)
    memoised per call signature, since it depends on the tensors' layouts alone (offs and rows
    are read on the device), so that a training step does not plan its launches again."""
    if traceable:
        return prepare_grouped_launch(ROUTED_OP, a, b, offs, None, out, zero_tail,
                                      routing=routing)
    signature = (ROUTED_OP, tensor_key(a), tensor_key(b), tensor_key(offs), tensor_key(out),
                 bool(zero_tail), routing, float32_precision())
    return memoised_launch(signature, prepare_grouped_launch, ROUTED_OP, a, b, offs, None, out,
                           zero_tail, None, None, routing)


def _moe_routed_mm_impl(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                        rows: torch.Tensor, row_weights: torch.Tensor | None, route: str,
                        gate: str, zero_tail: bool) -> torch.Tensor:
    return _routed_mm(a, b, offs, rows, row_weights, route, gate, zero_tail, True)


def _moe_routed_mm_eager(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                         rows: torch.Tensor, row_weights: torch.Tensor | None, route: str,
                         gate: str, zero_tail: bool) -> torch.Tensor:
    return _routed_mm(a, b, offs, rows, row_weights, route, gate, zero_tail, False)


def _routed_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor,
               row_weights: torch.Tensor | None, route: str, gate: str, zero_tail: bool,
               traceable: bool) -> torch.Tensor:
    out = _moe_routed_mm_fake(a, b, offs, rows, row_weights, route, gate, zero_tail)
    launch_routed(a, b, offs, rows, row_weights, out, route, gate, zero_tail, traceable)
    return out


# Every op of this module has eager kernels (``define_triton_op``'s ``eager_impl``): the same
# body launching directly, without wrap_triton, and without the generic custom-op wrappers
# that cost tens of microseconds a call (a training step calls seven of these ops).
moe_routed_mm_op = define_triton_op(ROUTED_OP, _moe_routed_mm_impl, _moe_routed_mm_fake,
                                    eager_impl=_moe_routed_mm_eager)


# --- the gated activation's backward ----------------------------------------------------------

def _glu_backward_fake(pre: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor,
                       order: torch.Tensor, activation: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots, width = pre.shape
    check(grad.shape == (slots, width // 2) and weights.shape == (slots,)
          and order.shape == (slots,) and pre.stride(1) == 1 and grad.stride(1) == 1,
          lambda: f"{GLU_BACKWARD_OP}: pre [S, 2I], grad [S, I] (unit column strides), weights "
                   f"and order [S] expected; got {tuple(pre.shape)}, {tuple(grad.shape)}, "
                   f"{tuple(weights.shape)}, {tuple(order.shape)}")
    return (pre.new_empty(slots, width // 2), pre.new_empty(slots, width),
            pre.new_empty(slots, dtype=torch.float32))


def _glu_backward_impl(pre: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor,
                       order: torch.Tensor, activation: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _glu_backward(pre, grad, weights, order, activation, True)


def _glu_backward_eager(pre: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor,
                        order: torch.Tensor, activation: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _glu_backward(pre, grad, weights, order, activation, False)


def _glu_backward(pre: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor,
                  order: torch.Tensor, activation: str, traceable: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/glu.py: (w * act(gate) * up, the gradients of gate and up, the router weights'
    gradient at each slot's own place), from the pre-activations and the gradient of the gated
    product of every sorted slot."""
    h_weighted, grad_pre, grad_weights = _glu_backward_fake(pre, grad, weights, order,
                                                            activation)
    slots, inter = h_weighted.shape
    if slots == 0:
        return h_weighted, grad_pre, grad_weights
    error = _device.kernel_device_error(pre.device)
    check(error is None, lambda: f"{GLU_BACKWARD_OP}: {error}")
    block_m, block_n, num_warps = tuning.moe_glu_backward_tile()
    grid = ((slots + block_m - 1) // block_m,)
    launch_kernel(glu_backward_kernel, grid,
                  (pre, grad, weights, order, h_weighted, grad_pre, grad_weights, slots, inter,
                   pre.stride(0), grad.stride(0), h_weighted.stride(0), grad_pre.stride(0),
                   activation),
                  {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps}, traceable)
    return h_weighted, grad_pre, grad_weights


glu_backward_op = define_triton_op(GLU_BACKWARD_OP, _glu_backward_impl, _glu_backward_fake,
                                   eager_impl=_glu_backward_eager)


def glu_forward(pre: torch.Tensor, activation: str, traceable: bool) -> torch.Tensor:
    """kernels/glu.py: act(gate) * up, [S, I], of saved pre-activations [S, 2I] (unit column
    stride), in pre's dtype (the training op's body)."""
    slots, width = pre.shape
    h = pre.new_empty(slots, width // 2)
    if slots == 0 or width == 0:
        return h
    block_m, block_n, num_warps = tuning.moe_elementwise_tile()
    grid = ((slots + block_m - 1) // block_m, (width // 2 + block_n - 1) // block_n)
    launch_kernel(glu_forward_kernel, grid,
                  (pre, h, slots, width // 2, pre.stride(0), h.stride(0), activation),
                  {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps}, traceable)
    return h


# --- the op body --------------------------------------------------------------------------------

def _moe_mlp_fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    _check_inputs(x, w13, w2, topk_ids, topk_weights, activation)
    return x.new_empty(x.shape)


def _down_and_combine(h: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                      order: torch.Tensor, topk_weights: torch.Tensor,
                      traceable: bool) -> torch.Tensor:
    """The second launch and the combine: h times w2, each token's slot rows times their
    router weights summed (the slots of no expert, past offs[-1], add nothing)."""
    out = h.new_empty(topk_weights.shape[0], w2.shape[1])
    launch_routed(h, w2.transpose(-2, -1), offs, slot_positions(order, *topk_weights.shape),
                  topk_weights, out, "combine", "none", False, traceable)
    return out


def _moe_mlp_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    return _moe_mlp(x, w13, w2, topk_ids, topk_weights, activation, True)


def _moe_mlp_eager(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   activation: str = "silu") -> torch.Tensor:
    return _moe_mlp(x, w13, w2, topk_ids, topk_weights, activation, False)


def _moe_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor, activation: str, traceable: bool) -> torch.Tensor:
    _check_inputs(x, w13, w2, topk_ids, topk_weights, activation)
    order, token_rows, offs = route(topk_ids, w13.shape[0])
    # Launch 1: gathered rows of x times gate and up columns, act(gate) * up in the epilogue.
    h = x.new_empty(order.shape[0], w2.shape[2])
    launch_routed(x, w13.transpose(-2, -1), offs, token_rows, None, h, "gather", activation,
                  False, traceable)
    return _down_and_combine(h, w2, offs, order, topk_weights, traceable)


moe_mlp_op = define_triton_op(OP, _moe_mlp_impl, _moe_mlp_fake, eager_impl=_moe_mlp_eager)


# The training path: two ops, so that autograd frees the pre-activations (saved by the second)
# once its backward has used them, before the first one's backward allocates w13's gradient.
# Each returns its routing (order, token rows, offs) beside its output for its own backward.

def _routing_fakes(x: torch.Tensor, topk_ids: torch.Tensor,
                   experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = topk_ids.numel()
    index = dict(dtype=torch.int32, device=x.device)
    return x.new_empty(slots, **index), x.new_empty(slots, **index), x.new_empty(experts, **index)


_GateUp = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _check_gate_up_op(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str) -> None:
    _check_gate_up(x, w13, topk_ids)
    check_value(activation in ACTIVATIONS,
                lambda: f"{GATE_UP_OP}: activation must be one of {ACTIVATIONS}, got "
                         f"{activation!r}")


def _moe_gate_up_fake(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str = "silu") -> _GateUp:
    _check_gate_up_op(x, w13, topk_ids, activation)
    slots, width = topk_ids.numel(), w13.shape[1]
    return (x.new_empty(slots, width), x.new_empty(slots, width // 2),
            *_routing_fakes(x, topk_ids, w13.shape[0]))


def _moe_gate_up_impl(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str = "silu") -> _GateUp:
    return _moe_gate_up(x, w13, topk_ids, activation, True)


def _moe_gate_up_eager(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                       activation: str = "silu") -> _GateUp:
    return _moe_gate_up(x, w13, topk_ids, activation, False)


def _moe_gate_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                 traceable: bool) -> _GateUp:
    """(the sorted slots' gate/up pre-activations [T * k, 2I] and act(gate) * up [T * k, I],
    zeros for slots of no expert; order, token rows, offs): the first launch, its gated
    epilogue storing the pre-activations beside its output (tgemm::moe_down's backward reads
    them; act(gate) * up carries no gradient of its own)."""
    _check_gate_up_op(x, w13, topk_ids, activation)
    order, token_rows, offs = route(topk_ids, w13.shape[0])
    pre = x.new_empty(order.shape[0], w13.shape[1])
    h = x.new_empty(order.shape[0], w13.shape[1] // 2)
    launch_routed(x, w13.transpose(-2, -1), offs, token_rows, None, h, "gather", activation,
                  True, traceable, pre=pre)
    return pre, h, order, token_rows, offs


moe_gate_up_op = define_triton_op(GATE_UP_OP, _moe_gate_up_impl, _moe_gate_up_fake,
                                  eager_impl=_moe_gate_up_eager)


def _check_down_op(pre: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, activation: str,
                   h: torch.Tensor | None) -> None:
    check(pre.dim() == 2 and pre.shape[0] == topk_ids.numel() and pre.shape[1] % 2 == 0,
          lambda: f"{DOWN_OP}: pre must be [T * k, 2I] = [{topk_ids.numel()}, 2I], got "
                   f"{tuple(pre.shape)}")
    check_value(pre.dtype in INPUT_DTYPES,
                lambda: f"{DOWN_OP}: pre has dtype {pre.dtype}; supported: {INPUT_DTYPES}")
    check(topk_ids.dim() == 2 and topk_ids.dtype in ID_DTYPES and topk_ids.device == pre.device,
          lambda: f"{DOWN_OP}: topk_ids must be int32 or int64 [T, k] on {pre.device}")
    check(topk_ids.numel() <= _INT32_LIMIT,
          lambda: f"{DOWN_OP}: T * k = {topk_ids.numel()} slots exceed int32 indexing")
    check(w2.dim() == 3, lambda: f"{DOWN_OP}: w2 must be 3-D [E, H, I], got {tuple(w2.shape)}")
    _check_down(w2, w2.shape[0], w2.shape[1], pre.shape[1] // 2, pre, topk_ids, topk_weights,
                activation)
    if h is not None:
        check(h.dim() == 2 and tuple(h.shape) == (pre.shape[0], pre.shape[1] // 2)
              and h.dtype == pre.dtype and h.device == pre.device,
              lambda: f"{DOWN_OP}: h must be act(gate) * up of pre, [T * k, I] = "
                       f"{(pre.shape[0], pre.shape[1] // 2)} with pre's dtype and device; got "
                       f"{h.dtype} {tuple(h.shape)} on {h.device}")


def _moe_down_fake(pre: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, activation: str = "silu",
                   h: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_down_op(pre, w2, topk_ids, topk_weights, activation, h)
    return (pre.new_empty(topk_ids.shape[0], w2.shape[1]),
            *_routing_fakes(pre, topk_ids, w2.shape[0]))


def _moe_down_impl(pre: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, activation: str = "silu",
                   h: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _moe_down(pre, w2, topk_ids, topk_weights, activation, h, True)


def _moe_down_eager(pre: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, activation: str = "silu",
                    h: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _moe_down(pre, w2, topk_ids, topk_weights, activation, h, False)


def _moe_down(pre: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: str, h: torch.Tensor | None,
              traceable: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H]; order, token rows, offs): the second launch and the combine on
    act(gate) * up, ``h`` where the caller has it (tgemm::moe_gate_up's), else from the
    pre-activations by an elementwise kernel. The backward differentiates through ``pre``
    alone: ``h`` must be act(gate) * up of it."""
    _check_down_op(pre, w2, topk_ids, topk_weights, activation, h)
    order, token_rows, offs = _route_or_handed(topk_ids, w2.shape[0], traceable)
    if h is None:
        h = glu_forward(pre, activation, traceable)
    out = _down_and_combine(h, w2, offs, order, topk_weights, traceable)
    return out, order, token_rows, offs


moe_down_op = define_triton_op(DOWN_OP, _moe_down_impl, _moe_down_fake,
                               eager_impl=_moe_down_eager)


# --- autograd -----------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w13, w2, topk_ids, topk_weights, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights)


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    """tgemm::moe_mlp's backward: both halves' gradients, recomputing the pre-activations
    (tgemm::moe_gate_up's launch, so that they are the training path's bits), freed once the
    down half has used them."""
    x, w13, w2, topk_ids, topk_weights = ctx.saved_tensors
    need_x, need_w13, need_w2, _, need_weights = ctx.needs_input_grad[:5]
    gate_up = torch.ops.tgemm.moe_gate_up(x, w13, topk_ids, ctx.activation)
    pre, (order, token_rows, offs) = gate_up[0], gate_up[2:]
    del gate_up  # act(gate) * up: the backward does not read it
    grad_pre, grad_w2, grad_weights = _down_gradients(
        grad_out, pre, w2, topk_weights, order, token_rows, offs, ctx.activation, need_w2,
        need_weights)
    del pre
    grad_x, grad_w13 = _gate_up_gradients(grad_pre, x, w13, order, token_rows, offs,
                                          topk_ids.shape[1], need_x, need_w13)
    return grad_x, grad_w13, grad_w2, None, grad_weights, None


def _setup_gate_up_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w13, topk_ids, _ = inputs
    _, h, order, token_rows, offs = output
    ctx.top_k = topk_ids.shape[1]
    ctx.save_for_backward(x, w13, order, token_rows, offs)
    # act(gate) * up is the pre-activations' function: gradients reach it through them
    # (tgemm::moe_down's backward), and the routing outputs have none.
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)


def _backward_gate_up(ctx, grad_pre: torch.Tensor | None,  # type: ignore[no-untyped-def]
                      *_other_grads: object):
    x, w13, order, token_rows, offs = ctx.saved_tensors
    if grad_pre is None:
        return None, None, None, None
    need_x, need_w13 = ctx.needs_input_grad[:2]
    grad_x, grad_w13 = _gate_up_gradients(grad_pre, x, w13, order, token_rows, offs, ctx.top_k,
                                          need_x, need_w13)
    return grad_x, grad_w13, None, None


def _setup_down_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    pre, w2, topk_ids, topk_weights, activation, _ = inputs
    _, order, token_rows, offs = output
    ctx.activation = activation
    ctx.save_for_backward(pre, w2, topk_weights, order, token_rows, offs)
    ctx.set_materialize_grads(False)


def _backward_down(ctx, grad_out: torch.Tensor | None,  # type: ignore[no-untyped-def]
                   *_routing_grads: object):
    pre, w2, topk_weights, order, token_rows, offs = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    need_pre, need_w2, _, need_weights = ctx.needs_input_grad[:4]
    grad_pre, grad_w2, grad_weights = _down_gradients(
        grad_out, pre, w2, topk_weights, order, token_rows, offs, ctx.activation, need_w2,
        need_weights)
    return grad_pre if need_pre else None, grad_w2, None, grad_weights, None, None


def _down_gradients(grad_out: torch.Tensor, pre: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, order: torch.Tensor, token_rows: torch.Tensor,
                    offs: torch.Tensor, activation: str, need_w2: bool, need_weights: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of the pre-activations [S, 2I], w2 and topk_weights.

    grad_out's rows copied into slot order (w2's gradient reads them too) times w2 give the
    gradient of act(gate) * up before the router weight, [S, I] (zeros for slots of no expert,
    so that everything derived from them is zero too): a plain grouped product, which loads
    through TMA where the gathering launch loads through pointers (on an H100 the first MoE
    GEMM ran 743 TFLOP/s on copied rows against 657-671 gathering them, at 4096 rows an
    expert). One elementwise kernel turns it into the pre-activations' gradient, w * act(gate)
    * up for w2's gradient and the router weights' gradient. Each [S, I]-sized buffer goes as
    soon as it is used."""
    tokens, top_k = topk_weights.shape
    slot_grad = grad_out.to(pre.dtype).index_select(0, token_rows)
    grad_h = grouped_mm(slot_grad, w2, offs, zero_tail=True)
    weights = topk_weights.reshape(-1).contiguous()
    h_weighted, grad_pre, grad_weights = torch.ops.tgemm.moe_glu_backward(
        pre, grad_h, weights, order, activation)
    del grad_h
    grad_w2 = grouped_mm(slot_grad.t(), h_weighted, offs) if need_w2 else None
    del slot_grad, h_weighted
    grad_weights = (grad_weights.view(tokens, top_k).to(topk_weights.dtype) if need_weights
                    else None)
    return grad_pre, grad_w2, grad_weights


def _gate_up_gradients(grad_pre: torch.Tensor, x: torch.Tensor, w13: torch.Tensor,
                       order: torch.Tensor, token_rows: torch.Tensor, offs: torch.Tensor,
                       top_k: int, need_x: bool, need_w13: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of x (the grouped product and the combine over k) and w13 (the 2-D x 2-D
    grouped product on gathered rows of x) from the pre-activations' gradient."""
    grad_x = grad_w13 = None
    grad_pre = grad_pre.to(x.dtype)
    if need_x:
        positions = slot_positions(order, x.shape[0], top_k)
        grad_x = torch.ops.tgemm.moe_routed_mm(grad_pre, w13, offs, positions, None, "combine",
                                               "none", False)
    if need_w13:
        grad_w13 = grouped_mm(grad_pre.t(), x.index_select(0, token_rows), offs)
    return grad_x, grad_w13


moe_mlp_op.register_autograd(_backward, setup_context=_setup_context)
moe_gate_up_op.register_autograd(_backward_gate_up, setup_context=_setup_gate_up_context)
moe_down_op.register_autograd(_backward_down, setup_context=_setup_down_context)


# --- public API ---------------------------------------------------------------------------------

def moe_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor, activation: str = "silu", *,
            validate_ids: bool = False) -> torch.Tensor:
    """A routed mixture-of-experts MLP in two fused grouped launches (see the module docstring).

    Args:
        x: [T, H] tokens; float16, bfloat16 or float32.
        w13: [E, 2I, H] gate rows then up rows of every expert, x's dtype, any strides.
        w2: [E, H, I] down projections, x's dtype, any strides.
        topk_ids: [T, k] int32 or int64 expert of each token's slots; ids outside [0, E)
            select no expert (the slot adds nothing).
        topk_weights: [T, k] router weights (float16, bfloat16 or float32).
        activation: "silu" (SwiGLU) or "gelu" (tanh approximation).
        validate_ids: raise ValueError for ids outside [0, E) instead (one host sync; eager
            calls only).

    Returns:
        out [T, H] in x's dtype: sum_j topk_weights[t, j] * w2[e] @ (act(gate) * up).

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
        >>> w13 = torch.randn(8, 2 * 2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
        >>> w2 = torch.randn(8, 1024, 2048, device="cuda", dtype=torch.bfloat16) / 45
        >>> weights, ids = torch.randn(4096, 8, device="cuda").softmax(-1).topk(2)
        >>> out = tg.moe_mlp(x, w13, w2, ids, weights)   # [4096, 1024]
    """
    try:
        if validate_ids:
            _check_inputs(x, w13, w2, topk_ids, topk_weights, activation)
            check_ids_in_range(topk_ids, w13.shape[0])
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
            # Training: keep the pre-activations for the backward rather than recompute them.
            pre, h, *routing = torch.ops.tgemm.moe_gate_up(x, w13, topk_ids, activation)
            handing = (contextlib.nullcontext() if torch.compiler.is_compiling() else
                       _handing_routing(topk_ids, w13.shape[0], tuple(routing)))
            with handing:
                return torch.ops.tgemm.moe_down(pre, w2, topk_ids, topk_weights, activation,
                                                h)[0]
        return torch.ops.tgemm.moe_mlp(x, w13, w2, topk_ids, topk_weights, activation)
    except (AttributeError, TypeError, RuntimeError):
        explain_bad_arguments(moe_mlp_op, (x, w13, w2, topk_ids, topk_weights, activation))
        raise

