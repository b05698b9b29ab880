"""tgemm::moe_mlp: numerics against a float64 per-expert loop, gradients of all four inputs,
routing edge cases (empty experts, ids of no expert), layouts, determinism, errors, opcheck and
graph capture.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (fp16 and fp32 only: its
bf16 dot is wrong); GPU-only tests carry the ``gpu`` marker.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from samples import randn, rel_error, tolerance
from test_mm import _run_without_interpreter

import torch_triton_gemm as tg
from torch_triton_gemm.ops import moe_mlp as moe_module

CPU_DTYPES = [torch.float16, torch.float32]
E, H, INTER, TOP_K = 4, 32, 32, 2


# --- samples and reference ----------------------------------------------------------------------

@dataclass
class MoESample:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    name: str

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.w13, self.w2, self.ids, self.weights)


def make_sample(device: str, dtype: torch.dtype, tokens: int = 24, hidden: int = H,
                inter: int = INTER, experts: int = E, top_k: int = TOP_K, layout: str = "row",
                empty_expert: bool = True, ids_dtype: torch.dtype = torch.int64) -> MoESample:
    """Random tokens routed to distinct experts per token (softmax weights); expert 1 gets no
    token when ``empty_expert``. layout "row": contiguous weights; "t": w13 stored [E, H, 2I]
    and w2 [E, I, H], passed transposed; "sliced": views with offsets and padded strides."""
    x = randn((tokens, hidden), dtype, device)
    scale13, scale2 = hidden ** -0.5, inter ** -0.5
    if layout == "t":
        w13 = (randn((experts, hidden, 2 * inter), dtype, device) * scale13).transpose(1, 2)
        w2 = (randn((experts, inter, hidden), dtype, device) * scale2).transpose(1, 2)
    elif layout == "sliced":
        w13 = (randn((experts + 1, 2 * inter + 3, hidden + 5), dtype, device)
               * scale13)[1:, 2:2 + 2 * inter, 3:3 + hidden]
        w2 = (randn((experts, hidden + 2, inter + 7), dtype, device) * scale2)[:, 1:1 + hidden,
                                                                            :inter]
    else:
        w13 = randn((experts, 2 * inter, hidden), dtype, device) * scale13
        w2 = randn((experts, hidden, inter), dtype, device) * scale2
    scores = torch.randn(tokens, experts, device=device)
    if empty_expert:
        scores[:, 1] = -float("inf")
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return MoESample(x, w13, w2, ids.to(ids_dtype), weights.to(dtype),
                     f"{dtype}-{layout}-T{tokens}-I{inter}")


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The block in float64, one expert at a time (ids outside [0, E) select none);
    differentiable in x, w13, w2 and weights."""
    x64, w13_64, w2_64, weights64 = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x64)
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x64[token] @ w13_64[e].t()).chunk(2, dim=-1)
        y = (act(gate) * up) @ w2_64[e].t() * weights64[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def _leaves(s: MoESample) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().requires_grad_() for t in (s.x, s.w13, s.w2, s.weights))


def _grads_match(s: MoESample, activation: str = "silu", factor: float = 2.0) -> None:
    x, w13, w2, weights = _leaves(s)
    out = tg.moe_mlp(x, w13, w2, s.ids, weights, activation)
    grad_out = randn(tuple(out.shape), s.x.dtype, s.x.device)
    grads = torch.autograd.grad(out, (x, w13, w2, weights), grad_out)
    leaves64 = tuple(t.detach().double().requires_grad_() for t in (x, w13, w2, weights))
    ref = reference(leaves64[0], leaves64[1], leaves64[2], s.ids, leaves64[3], activation)
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out.double())
    budget = factor * tolerance(s.x.dtype, s.x.dtype)
    for name, g, r, t in zip(("x", "w13", "w2", "topk_weights"), grads, ref_grads,
                             (x, w13, w2, weights)):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        err = rel_error(g, r)
        assert err <= budget, f"{s.name} grad {name}: rel err {err:.3e} > {budget:.0e}"


# --- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "t", "sliced"])
def test_matches_float64_reference(device, dtype, layout, highest_fp32):
    for tokens, inter in ((24, INTER), (9, 40)):  # a partial tile of gate/up columns too
        s = make_sample(device, dtype, tokens=tokens, inter=inter, layout=layout)
        out = tg.moe_mlp(*s.args())
        ref = reference(*s.args())
        assert out.dtype == dtype and out.shape == s.x.shape
        err = rel_error(out, ref)
        assert err <= tolerance(dtype, dtype), f"{s.name}: rel err {err:.3e}"


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_activations(device, activation, highest_fp32):
    s = make_sample(device, torch.float32, tokens=16, ids_dtype=torch.int32)
    err = rel_error(tg.moe_mlp(*s.args(), activation), reference(*s.args(), activation))
    assert err <= tolerance(torch.float32, torch.float32), f"{activation}: {err:.3e}"


def test_top_k_and_skew(device, highest_fp32):
    """top-1 and top-4 routings, and every token on one expert (all the others empty)."""
    for top_k in (1, 4):
        s = make_sample(device, torch.float32, tokens=13, top_k=top_k, empty_expert=False)
        assert rel_error(tg.moe_mlp(*s.args()), reference(*s.args())) <= 1e-5, top_k
    s = make_sample(device, torch.float32, tokens=20, top_k=1)
    s.ids = torch.full_like(s.ids, 3)
    assert rel_error(tg.moe_mlp(*s.args()), reference(*s.args())) <= 1e-5


def test_ids_of_no_expert_add_nothing(device, highest_fp32):
    """Ids outside [0, E) (-1 for another rank's expert, E and beyond) drop their slot: no
    contribution, a zero weight gradient; ``validate_ids=True`` rejects them instead."""
    s = make_sample(device, torch.float32, tokens=12)
    s.ids[0, 0], s.ids[3, 1], s.ids[5] = -1, E, E + 7
    x, w13, w2, weights = _leaves(s)
    out = tg.moe_mlp(x, w13, w2, s.ids, weights)
    assert rel_error(out, reference(*s.args())) <= 1e-5
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    (grad_weights,) = torch.autograd.grad(out.sum(), (weights,))
    dropped = (s.ids < 0) | (s.ids >= E)
    assert torch.equal(grad_weights[dropped], torch.zeros_like(grad_weights[dropped]))
    assert (grad_weights[~dropped] != 0).all()
    with pytest.raises(ValueError, match=re.escape(
            "tgemm::moe_mlp: topk_ids must lie in [0, 4) (E = w13.shape[0]), got values from "
            "-1 to 11")):
        tg.moe_mlp(*s.args(), validate_ids=True)
    good = make_sample(device, torch.float32, tokens=4)
    tg.moe_mlp(*good.args(), validate_ids=True)


def test_no_tokens_and_no_experts_routed(device):
    s = make_sample(device, torch.float16, tokens=0)
    assert tg.moe_mlp(*s.args()).shape == (0, H)
    s = make_sample(device, torch.float16, tokens=5)
    s.ids = torch.full_like(s.ids, -1)
    assert torch.equal(tg.moe_mlp(*s.args()), torch.zeros_like(s.x))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_no_slots_and_no_experts(device, grad):
    """k = 0 (no slot per token) and E = 0 (no expert): zeros, and zero gradients."""
    s = make_sample(device, torch.float16, tokens=5)
    x = s.x.detach().requires_grad_(grad)
    ids, weights = s.ids[:, :0], s.weights[:, :0]
    out = tg.moe_mlp(x, s.w13, s.w2, ids, weights)
    assert torch.equal(out, torch.zeros_like(s.x))
    if grad:
        out.float().sum().backward()
        assert torch.equal(x.grad, torch.zeros_like(s.x))
    no_experts = tg.moe_mlp(x, s.w13[:0], s.w2[:0], s.ids, s.weights)
    assert torch.equal(no_experts, torch.zeros_like(s.x))


def test_deterministic(device, highest_fp32):
    """The same bits every run, without gradients and with them; and the same output both ways:
    the training ops' first launch applies the activation to the fp32 accumulators, as the
    no-grad launch does, and stores the pre-activations beside."""
    s = make_sample(device, torch.float16, tokens=24)
    first = tg.moe_mlp(*s.args())
    assert torch.equal(tg.moe_mlp(*s.args()), first)
    x, w13, w2, weights = _leaves(s)
    runs = []
    for _ in range(2):
        out = tg.moe_mlp(x, w13, w2, s.ids, weights)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (x, w13, w2, weights))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][0], first)


def test_eager_launches_memoised_per_signature_stay_right(device, highest_fp32, monkeypatch):
    """Eager calls (the ops' eager kernels) plan each routed launch once per call signature:
    a training step again with fresh values and another routing of the same shapes plans
    nothing new and still matches the float64 reference, outputs and gradients; another token
    count plans anew. Traced calls never take the memo."""
    from torch_triton_gemm.ops import launcher

    monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    prepared = []
    real = moe_module.prepare_grouped_launch

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        prepared.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_module, "prepare_grouped_launch", counting)
    counts = []
    for tokens, skew in ((16, False), (16, False), (16, True), (10, False)):
        s = make_sample(device, torch.float16, tokens=tokens, empty_expert=not skew)
        if skew:  # every token's first slot to expert 0: other group sizes, same shapes
            s.ids[:, 0] = 0
            s.ids[:, 1] = 1 + torch.arange(tokens, device=device) % (E - 1)
        with torch.no_grad():
            out = torch.ops.tgemm.moe_mlp(*s.args())
        ref = reference(*s.args())
        assert rel_error(out, ref) <= tolerance(torch.float16, torch.float16), s.name
        _grads_match(s)
        counts.append(len(prepared))
    assert counts[0] > 0 and counts[1] == counts[0] and counts[2] == counts[0], counts
    assert counts[3] > counts[2], counts
    keys = [key for key in launcher._EAGER_LAUNCHES if key[0] == moe_module.ROUTED_OP]
    assert len(keys) == counts[3]


def test_training_step_routes_once(device, highest_fp32, monkeypatch):
    """An eager training step routes its ids once: tgemm::moe_down reuses tgemm::moe_gate_up's
    routing inside moe_mlp's call, and only for that very ids tensor (moe_down called on its
    own, or on other ids, routes); the backward reuses the ops' saved routing."""
    real = moe_module.route
    calls = []
    monkeypatch.setattr(moe_module, "route", lambda *a: calls.append(a) or real(*a))
    s = make_sample(device, torch.float16, tokens=12)
    x, w13, w2, weights = _leaves(s)
    out = tg.moe_mlp(x, w13, w2, s.ids, weights)
    assert len(calls) == 1
    grads = torch.autograd.grad(out, (x, w13, w2, weights), torch.ones_like(out))
    assert len(calls) == 1
    ref = reference(*s.args())
    assert rel_error(out, ref) <= tolerance(torch.float16, torch.float16)
    assert all(torch.isfinite(g).all() for g in grads)
    pre, h, *routing = torch.ops.tgemm.moe_gate_up(x, w13, s.ids)
    with moe_module._handing_routing(s.ids, E, tuple(routing)):
        torch.ops.tgemm.moe_down(pre, w2, s.ids.clone(), weights, "silu", h)
    assert len(calls) == 3  # gate_up's own, and moe_down's for other ids
    torch.ops.tgemm.moe_down(pre, w2, s.ids, weights, "silu", h)
    assert len(calls) == 4


def test_routed_launches_write_only_their_rows(device, highest_fp32):
    """Into NaN-poisoned outputs: the gathering launch writes the slots inside offs (the rest
    keep their poison); the combining one writes every token's row, a slot of no expert adding
    nothing (the rows past offs[-1] of the product it sums were never written)."""
    s = make_sample(device, torch.float32, tokens=10)
    s.ids[2, 1] = -1  # one slot of no expert, sorted past offs[-1]
    order, tokens, offs = moe_module.route(s.ids, E)
    slots = order.shape[0]
    assert offs[-1].item() == slots - 1
    h = torch.full((slots, INTER), float("nan"), device=device)
    moe_module.launch_routed(s.x, s.w13.transpose(1, 2), offs, tokens, None, h, "gather",
                             "silu", False, traceable=False)
    assert h[-1].isnan().all() and not h[:-1].isnan().any()
    expert = torch.repeat_interleave(torch.arange(E, device=device),
                                     torch.diff(offs, prepend=offs.new_zeros(1)).long())
    gate, up = torch.einsum("sh,sih->si", s.x[tokens[:-1].long()].double(),
                            s.w13[expert].double()).chunk(2, dim=-1)
    assert rel_error(h[:-1], F.silu(gate) * up) <= 1e-5
    out = torch.full((s.x.shape[0], H), float("nan"), device=device)
    h[-1] = float("nan")  # the slot of no expert: its product row must not be read
    positions = moe_module.slot_positions(order, *s.ids.shape)
    assert torch.equal(order[positions.reshape(-1).long()],
                       torch.arange(slots, device=device, dtype=torch.int32))
    moe_module.launch_routed(h, s.w2.transpose(1, 2), offs, positions, s.weights, out, "combine",
                             "none", False, traceable=False)
    assert not out.isnan().any()
    per_slot = torch.zeros(slots, H, dtype=torch.float64, device=device)
    per_slot[order[:-1].long()] = torch.einsum("si,shi->sh", h[:-1].double(),
                                               s.w2[expert].double())
    ref = (per_slot.view(*s.ids.shape, H) * s.weights.double()[..., None]).sum(1)
    assert rel_error(out, ref) <= 1e-5


def test_strided_router_weights_and_ids(device):
    """Router weights and ids given as column-major views ([T, k] with a column stride of T)
    give the same output, bit for bit, as contiguous ones (the combine reads the weights
    through both strides)."""
    s = make_sample(device, torch.float16, tokens=12)
    weights = s.weights.t().contiguous().t()
    ids = s.ids.t().contiguous().t()
    assert weights.stride(1) == s.weights.shape[0]
    torch.testing.assert_close(tg.moe_mlp(s.x, s.w13, s.w2, ids, weights),
                               tg.moe_mlp(s.x, s.w13, s.w2, s.ids, s.weights), rtol=0, atol=0)


# --- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "t"])
def test_gradients_match_float64_autograd(device, dtype, layout, highest_fp32):
    _grads_match(make_sample(device, dtype, tokens=16, layout=layout))


def test_gradients_gelu_and_odd_sizes(device, highest_fp32):
    _grads_match(make_sample(device, torch.float32, tokens=11, inter=40, top_k=3), "gelu")


def test_only_needed_gradients(device):
    s = make_sample(device, torch.float16, tokens=8)
    w2 = s.w2.detach().requires_grad_()
    out = tg.moe_mlp(s.x, s.w13, w2, s.ids, s.weights)
    (grad_w2,) = torch.autograd.grad(out.sum(), (w2,))
    assert grad_w2.shape == w2.shape and s.x.grad is None


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 on purpose: the op has no fp64
def test_gradcheck_fp32(device, highest_fp32):
    s = make_sample(device, torch.float32, tokens=4, hidden=8, inter=8, experts=3)
    assert torch.autograd.gradcheck(
        lambda x, w13, w2, weights: tg.moe_mlp(x, w13, w2, s.ids, weights),
        _leaves(s), eps=1e-2, atol=5e-3, rtol=5e-3, nondet_tol=0.0, fast_mode=True)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_training_forward_keeps_pre_activations_for_the_backward(device, activation,
                                                                  highest_fp32):
    """Calls that need gradients run tgemm::moe_gate_up (one gated launch: act(gate) * up and,
    beside it, the sorted slots' pre-activations, zeros past the last expert's slots; the
    routing) and tgemm::moe_down on act(gate) * up; the backward reads the pre-activations
    where the op's recomputes them, to the same bits. The op path still gives gradients (by
    recomputing); moe_down without act(gate) * up applies the activation itself."""
    s = make_sample(device, torch.float16, tokens=24, top_k=3, empty_expert=True)
    s.ids[0, 0] = -1  # a slot of no expert: sorted past the last one
    x, w13, w2, weights = _leaves(s)
    grad_out = randn(tuple(s.x.shape), s.x.dtype, s.x.device)
    pre, h, *routing = torch.ops.tgemm.moe_gate_up(x, w13, s.ids, activation)
    assert not h.requires_grad and pre.requires_grad
    order, tokens, offs = moe_module.route(s.ids, E)
    assert all(torch.equal(a, b) for a, b in zip(routing, (order, tokens, offs)))
    routed = int(offs[-1])
    assert routed < pre.shape[0] and not pre[routed:].any() and not h[routed:].any()
    w13_t = s.w13.transpose(1, 2)
    expected = torch.ops.tgemm.moe_routed_mm(s.x, w13_t, offs, tokens, None, "gather", "none",
                                             True)
    assert rel_error(pre, expected) <= tolerance(torch.float16, torch.float16)
    gated = torch.ops.tgemm.moe_routed_mm(s.x, w13_t, offs, tokens, None, "gather", activation,
                                          True)
    assert torch.equal(h, gated)  # the no-grad forward's launch, to the bit
    out, *down_routing = torch.ops.tgemm.moe_down(pre, w2, s.ids, weights, activation, h)
    assert all(torch.equal(a, b) for a, b in zip(down_routing, (order, tokens, offs)))
    from_pre = torch.ops.tgemm.moe_down(pre, w2, s.ids, weights, activation)[0]
    assert rel_error(from_pre, out) <= tolerance(torch.float16, torch.float16)
    assert rel_error(out, reference(*s.args(), activation)) <= tolerance(torch.float16,
                                                                         torch.float16)
    kept = torch.autograd.grad(out, (x, w13, w2, weights), grad_out)
    recomputed = torch.autograd.grad(
        torch.ops.tgemm.moe_mlp(x, w13, w2, s.ids, weights, activation), (x, w13, w2, weights),
        grad_out)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    public = tg.moe_mlp(x, w13, w2, s.ids, weights, activation)
    assert torch.equal(public, out)
    for a, b in zip(kept, torch.autograd.grad(public, (x, w13, w2, weights), grad_out)):
        assert torch.equal(a, b)


def test_only_the_down_half_keeps_the_pre_activations(device):
    """The pre-activations are saved by the down half's autograd node alone, which autograd
    frees once that node's backward ran, before the gate/up half's backward allocates w13's
    gradient (the forward + backward's peak memory)."""
    s = make_sample(device, torch.float16, tokens=8)
    x, w13, w2, weights = _leaves(s)
    out = tg.moe_mlp(x, w13, w2, s.ids, weights)
    pre_shape = (s.ids.numel(), 2 * INTER)
    down = out.grad_fn
    gate_up = next(f for f, _ in down.next_functions if f is not None and f.name() != down.name()
                   and "AccumulateGrad" not in f.name())
    assert any(tuple(t.shape) == pre_shape for t in down.saved_tensors)
    assert not any(tuple(t.shape) == pre_shape for t in gate_up.saved_tensors)
    gated_shape = (s.ids.numel(), INTER)  # act(gate) * up: used by the forward alone
    assert not any(tuple(t.shape) == gated_shape
                   for node in (down, gate_up) for t in node.saved_tensors)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 on purpose: the op has no fp64
def test_training_ops_gradcheck_through_the_pre_activations(device, highest_fp32):
    """The two training ops composed, with the pre-activations also used outside: their
    gradients add up."""
    s = make_sample(device, torch.float32, tokens=4, hidden=8, inter=8, experts=3)

    def both(x, w13, w2, weights):  # type: ignore[no-untyped-def]
        pre = torch.ops.tgemm.moe_gate_up(x, w13, s.ids)[0]
        return torch.ops.tgemm.moe_down(pre, w2, s.ids, weights, "gelu")[0], pre

    def kept(x, w13, w2, weights):  # type: ignore[no-untyped-def]
        pre, h = torch.ops.tgemm.moe_gate_up(x, w13, s.ids, "gelu")[:2]
        return torch.ops.tgemm.moe_down(pre, w2, s.ids, weights, "gelu", h)[0], pre

    for fn in (both, kept):
        assert torch.autograd.gradcheck(fn, _leaves(s), eps=1e-2, atol=5e-3, rtol=5e-3,
                                        nondet_tol=0.0, fast_mode=True)


# --- errors -------------------------------------------------------------------------------------

def _bad_inputs(device: str) -> list[tuple[tuple, dict, type, str]]:
    s = make_sample(device, torch.float16, tokens=6)
    x, w13, w2, ids, weights = s.args()
    op = "tgemm::moe_mlp"
    return [
        ((x[0], w13, w2, ids, weights), {}, RuntimeError, f"{op}: x must be 2-D [T, H]"),
        ((x, w13, w2, ids[:5], weights), {}, RuntimeError,
         f"{op}: topk_ids must be [T, k] with T = 6 (x's rows), got (5, 2)"),
        ((x, w13, w2, ids, weights[:, :1]), {}, RuntimeError,
         f"{op}: topk_weights must have topk_ids' shape (6, 2), got (6, 1)"),
        ((x.double(), w13, w2, ids, weights), {}, ValueError, f"{op}: x has dtype torch.float64"),
        ((x, w13.float(), w2, ids, weights), {}, ValueError,
         f"{op}: w13 (torch.float32) must have x's dtype torch.float16"),
        ((x, w13, w2, ids.float(), weights), {}, ValueError,
         f"{op}: topk_ids must be int32 or int64, got torch.float32"),
        ((x, w13, w2, ids, weights.double()), {}, ValueError,
         f"{op}: topk_weights has dtype torch.float64"),
        ((x, w13, w2, ids, weights, "relu"), {}, ValueError,
         f"{op}: activation must be one of ('silu', 'gelu'), got 'relu'"),
        ((x, w13[..., :16], w2, ids, weights), {}, RuntimeError,
         f"{op}: w13 is [E, 2I, H] with H = 16 but x has 32 columns"),
        ((x, w13[:, :63], w2, ids, weights), {}, RuntimeError,
         f"{op}: w13 must stack gate and up rows, [E, 2I, H]; got 63 rows"),
        ((x, w13, w2[:3], ids, weights), {}, RuntimeError,
         f"{op}: w2 must be [E, H, I] = (4, 32, 32), got (3, 32, 32)"),
        ((x, w13, w2.to("meta"), ids, weights), {}, RuntimeError,
         f"{op}: w2 is on meta but x is on {x.device}"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_input_raises_before_launch(device, case, monkeypatch):
    args, kwargs, error, message = _bad_inputs(device)[case]

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(moe_module, "run_grouped_launch", no_launch)
    with pytest.raises(error, match=re.escape(message)):
        tg.moe_mlp(*args, **kwargs)


def test_training_ops_check_their_inputs(device):
    """tgemm::moe_gate_up and tgemm::moe_down name themselves and what is wrong."""
    s = make_sample(device, torch.float16, tokens=6)
    x, w13, w2, ids, weights = s.args()
    pre = torch.zeros(ids.numel(), 2 * INTER, dtype=x.dtype, device=device)
    cases = [
        (lambda: torch.ops.tgemm.moe_gate_up(x[0], w13, ids), "tgemm::moe_gate_up: x must be 2-D"),
        (lambda: torch.ops.tgemm.moe_gate_up(x, w13, ids[:5]),
         "tgemm::moe_gate_up: topk_ids must be [T, k] with T = 6"),
        (lambda: torch.ops.tgemm.moe_down(pre[1:], w2, ids, weights),
         f"tgemm::moe_down: pre must be [T * k, 2I] = [{ids.numel()}, 2I]"),
        (lambda: torch.ops.tgemm.moe_down(pre[:, :-2], w2, ids, weights),
         "tgemm::moe_down: w2 must be [E, H, I]"),
        (lambda: torch.ops.tgemm.moe_down(pre, w2.float(), ids, weights),
         "tgemm::moe_down: w2 (torch.float32) must have pre's dtype torch.float16"),
        (lambda: torch.ops.tgemm.moe_down(pre, w2, ids, weights[:, :1]),
         "tgemm::moe_down: topk_weights must have topk_ids' shape"),
    ]
    for call, message in cases:
        with pytest.raises((RuntimeError, ValueError), match=re.escape(message)):
            call()


# --- opcheck, graph capture ---------------------------------------------------------------------

def test_opcheck(device):
    for requires_grad in (False, True):
        s = make_sample(device, torch.float16, tokens=8)
        args = list(s.args())
        if requires_grad:
            args[0] = s.x.detach().requires_grad_()
            args[4] = s.weights.detach().requires_grad_()
        torch.library.opcheck(torch.ops.tgemm.moe_mlp.default, (*args, "silu"))
        torch.library.opcheck(torch.ops.tgemm.moe_gate_up.default, (args[0], args[1], args[3]))
        torch.library.opcheck(torch.ops.tgemm.moe_gate_up.default,
                              (args[0], args[1], args[3], "gelu"))
        pre = randn((s.ids.numel(), 2 * INTER), torch.float16, device)
        h = randn((s.ids.numel(), INTER), torch.float16, device)
        if requires_grad:
            pre.requires_grad_()
        torch.library.opcheck(torch.ops.tgemm.moe_down.default, (pre, *args[2:], "gelu"))
        torch.library.opcheck(torch.ops.tgemm.moe_down.default, (pre, *args[2:], "gelu", h))
    order, tokens, offs = moe_module.route(s.ids, E)
    torch.library.opcheck(torch.ops.tgemm.moe_routed_mm.default,
                          (s.x, s.w13.transpose(1, 2), offs, tokens, None, "gather", "silu",
                           True))
    pre = randn((order.shape[0], 2 * INTER), torch.float16, device)
    grad = randn((order.shape[0], INTER), torch.float16, device)
    torch.library.opcheck(torch.ops.tgemm.moe_glu_backward.default,
                          (pre, grad, s.weights.reshape(-1), order, "gelu"))


def test_compile_fullgraph_forward_and_backward(device, fresh_dynamo, highest_fp32):
    """torch.compile(fullgraph=True) with AOT autograd (CPU-runnable): the op and its backward
    (routing, the routed op, grouped_mm) trace into graphs, and match eager bitwise."""
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=_keep, bw_compiler=_keep)(
            gm, inputs)

    def block(x, w13, w2, ids, weights):
        return tg.moe_mlp(x, w13, w2, ids, weights).square().sum()

    s = make_sample(device, torch.float32, tokens=12)
    leaves = _leaves(s)
    compiled = torch.compile(block, backend=record, fullgraph=True)
    loss = compiled(leaves[0], leaves[1], leaves[2], s.ids, leaves[3])
    grads = torch.autograd.grad(loss, leaves)
    # Training: the two halves (see test_training_forward_keeps_pre_activations_...).
    assert "tgemm.moe_gate_up" in graphs[0].code and "tgemm.moe_down" in graphs[0].code
    eager_loss = block(leaves[0], leaves[1], leaves[2], s.ids, leaves[3])
    assert torch.equal(loss, eager_loss)
    for g, e in zip(grads, torch.autograd.grad(eager_loss, leaves)):
        assert torch.equal(g, e)
    backward_ops = [str(n.target) for n in _KEPT[-1].graph.nodes if n.op == "call_function"]
    if device == "cpu":
        assert {"tgemm.moe_routed_mm.default", "tgemm.grouped_mm.default"} <= set(backward_ops)
    else:  # compiled Triton: the ops trace into their kernels' launches
        assert _KEPT[-1].code.count("triton_kernel_wrapper_functional(") >= 3, backward_ops


def test_traces_on_cuda_fake_tensors():
    """Without the interpreter, the triton_op body traces on CUDA FakeTensors (no GPU needed):
    the output's metadata, and both routed launches of the grouped kernel in the functional
    trace with their flags (pointer loaders for the gathered rows, TMA descriptors for the
    sorted slots' product), then the combine."""
    script = textwrap.dedent("""
        import torch, torch_triton_gemm as tg
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx

        def block(x, w13, w2, ids, weights):
            return tg.moe_mlp(x, w13, w2, ids, weights)

        with FakeTensorMode():
            bf16 = dict(device="cuda", dtype=torch.bfloat16)
            x = torch.empty(96, 64, **bf16)
            w13 = torch.empty(4, 96, 64, **bf16)
            w2 = torch.empty(4, 64, 48, **bf16)
            ids = torch.empty(96, 2, device="cuda", dtype=torch.int64)
            weights = torch.empty(96, 2, device="cuda", dtype=torch.float32)
            out = block(x, w13, w2, ids, weights)
            print(tuple(out.shape), out.dtype, out.device.type)
        gm = make_fx(dispatch_functionalize(block), tracing_mode="fake")(x, w13, w2, ids, weights)
        for node in gm.graph.nodes:
            if node.op == "call_function" and "triton_kernel" in str(node.target):
                kw = node.kwargs["kwargs"]
                if "ROUTE" not in kw:
                    print("kernel combine HAS_WEIGHTS=%s N=%s" % (kw["HAS_WEIGHTS"], kw["N"]))
                    continue
                print("kernel ROUTE=%s GATE=%s ZERO_TAIL=%s USE_TMA=%s N=%s" % (
                    kw["ROUTE"], kw["GATE"], kw["ZERO_TAIL"], kw["USE_TMA"], kw["N"]))

        # The backward's own kernel (the autograd engine needs a CUDA build to trace it whole).
        def glu_backward(pre, grad, weights, order):
            return torch.ops.tgemm.moe_glu_backward(pre, grad, weights, order, "silu")

        with FakeTensorMode():
            pre = torch.empty(192, 96, **bf16)
            grad = torch.empty(192, 48, **bf16)
            flat = torch.empty(192, device="cuda", dtype=torch.float32)
            order = torch.empty(192, device="cuda", dtype=torch.int32)
        gm = make_fx(dispatch_functionalize(glu_backward), tracing_mode="fake")(
            pre, grad, flat, order)
        for node in gm.graph.nodes:
            if node.op == "call_function" and "triton_kernel" in str(node.target):
                print("kernel ACTIVATION=%s" % node.kwargs["kwargs"]["ACTIVATION"])
    """)
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; the GPU tests cover it on a GPU")
    lines = _run_without_interpreter(script).strip().splitlines()
    assert lines == [
        "(96, 64) torch.bfloat16 cuda",
        "kernel ROUTE=gather GATE=silu ZERO_TAIL=False USE_TMA=False N=48",
        "kernel ROUTE=none GATE=none ZERO_TAIL=False USE_TMA=False N=64",
        "kernel combine HAS_WEIGHTS=True N=64",
        "kernel ACTIVATION=silu",
    ]


_COMPILE_SCRIPT = """
from hopper_compile import compile_for as compile_for_sm90
from torch_triton_gemm.kernels.grouped import grouped_mm_kernel as kernel

def compile_for(route, gate, tile, keep=False):
    block_m, block_n, block_k, num_warps, num_stages = tile
    constants = dict(
        GROUPED="m", ZERO_TAIL=keep, HAS_BIAS=False, bias_ptr=None,
        SCALING="none", SA_ROWS=1, SB_COLS=1, FAST_ACCUM=False, sa_ptr=None, sb_ptr=None,
        USE_TMA=False, A_M_CONTIGUOUS=False, B_K_CONTIGUOUS=False, C_TMA=False,
        EPILOGUE_SUBTILE=1, INPUT_PRECISION=None, UPCAST_TO_FP32=False, INDEX_64=False,
        ROUTE=route, GATE=gate, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, stride_ak=1, stride_bk=1, stride_cn=1)
    pointers = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "offs_ptr": "*i32",
                "rows_ptr": "*i32"}
    if keep:  # training: the pre-activations stored beside
        pointers["pre_ptr"] = "*bf16"
    else:
        constants["pre_ptr"] = None
    aligned = ["a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bn", "stride_cm", "stride_bg",
               "K", "N"] + (["pre_ptr"] if keep else [])
    compiled = compile_for_sm90(kernel, pointers, constants, aligned, num_warps=num_warps,
                                num_stages=num_stages)
    ir = compiled.asm["ttgir"]
    print(route, gate + (" keep" if keep else ""), "warp_group_dot" in ir,
          "tma" if "tensor_desc" in ir or "async_tma" in ir else "pointers")

compile_for("gather", "silu", (128, 128, 64, 8, 3))  # the wide tile, halved
compile_for("gather", "silu", (128, 128, 64, 8, 3), keep=True)
compile_for("gather", "gelu", (64, 128, 64, 4, 3))
compile_for("gather", "gelu", (64, 128, 64, 4, 3), keep=True)
compile_for("gather", "none", (128, 256, 64, 8, 3))

from torch_triton_gemm.kernels.combine import combine_kernel
for weights in (True, False):
    types = {"y_ptr": "*bf16", "positions_ptr": "*i32", "weights_ptr": "*fp32",
             "offs_ptr": "*i32", "out_ptr": "*bf16"}
    compile_for_sm90(combine_kernel, types, {"HAS_WEIGHTS": weights, "BLOCK_T": 32,
                                             "BLOCK_N": 128}, num_warps=4)
    print("combine", weights)

from torch_triton_gemm.kernels.glu import glu_backward_kernel as glu
for activation in ("silu", "gelu"):
    constants = {"ACTIVATION": activation, "BLOCK_M": 32, "BLOCK_N": 128}
    types = {"pre_ptr": "*bf16", "grad_ptr": "*bf16", "weights_ptr": "*fp32",
             "order_ptr": "*i32", "hw_ptr": "*bf16", "grad_pre_ptr": "*bf16",
             "grad_weights_ptr": "*fp32"}
    compile_for_sm90(glu, types, constants, num_warps=4)
    print("glu", activation)

from torch_triton_gemm.kernels.glu import glu_forward_kernel
for activation in ("silu", "gelu"):
    constants = {"ACTIVATION": activation, "BLOCK_M": 32, "BLOCK_N": 128}
    compile_for_sm90(glu_forward_kernel, {"pre_ptr": "*bf16", "h_ptr": "*bf16"}, constants,
                     num_warps=4)
    print("glu forward", activation)
"""


def test_routed_kernel_compiles_for_hopper():
    """Triton compiles the routed launches of the grouped kernel for sm_90 without a GPU:
    gathered rows with the SwiGLU / GeGLU epilogue (both halves in one wgmma tile), also
    keeping the pre-activations (training), plain gathered rows (moe_routed_mm); the combine;
    and the gated activation's elementwise kernels."""
    if torch.cuda.is_available():
        pytest.skip("compiles for a fixed GPU target on a GPU-less host; the GPU tests run it")
    out = _run_without_interpreter(_COMPILE_SCRIPT).strip().splitlines()
    assert out == ["gather silu True pointers", "gather silu keep True pointers",
                   "gather gelu True pointers", "gather gelu keep True pointers",
                   "gather none True pointers", "combine True", "combine False", "glu silu",
                   "glu gelu", "glu forward silu", "glu forward gelu"]


_KEPT: list[torch.fx.GraphModule] = []


def _keep(gm, _inputs):  # type: ignore[no-untyped-def]
    _KEPT.append(gm)
    return make_boxed_func(gm.forward)


# --- GPU ----------------------------------------------------------------------------------------

def _torch_moe(x, w13, w2, ids, weights):  # type: ignore[no-untyped-def]
    """The unfused PyTorch block: sort slots by expert, copy rows, torch._grouped_mm, SwiGLU,
    weight, back to slot order and sum over k."""
    top_k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    offs = torch.bincount(ids.flatten(), minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    rows = x[order // top_k]
    gate, up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
    y = y * weights.flatten()[order, None]
    return y[order.argsort()].view(x.shape[0], top_k, -1).sum(1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_matches_reference_and_torch(dtype):
    s = make_sample("cuda", dtype, tokens=1000, hidden=512, inter=768, experts=8, top_k=2)
    x, w13, w2, weights = _leaves(s)
    out = tg.moe_mlp(x, w13, w2, s.ids, weights)
    assert rel_error(out, reference(*s.args())) <= tolerance(dtype, dtype)
    if dtype == torch.bfloat16:  # torch._grouped_mm's dtype
        peer = _torch_moe(*s.args())
        assert rel_error(out, peer.double()) <= 2 * tolerance(dtype, dtype)
    _grads_match(s)


@pytest.mark.gpu
def test_gpu_no_host_sync():
    """Forward and backward never wait for the GPU (routing and offs stay on the device)."""
    s = make_sample("cuda", torch.bfloat16, tokens=256, hidden=128, inter=256, experts=8)
    leaves = _leaves(s)
    tg.moe_mlp(leaves[0], leaves[1], leaves[2], s.ids, leaves[3]).sum().backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tg.moe_mlp(leaves[0], leaves[1], leaves[2], s.ids, leaves[3])
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_inductor_and_cuda_graphs(fresh_dynamo):
    s = make_sample("cuda", torch.bfloat16, tokens=512, hidden=256, inter=512, experts=8)
    leaves = _leaves(s)

    def step(x, w13, w2, ids, weights):
        return tg.moe_mlp(x, w13, w2, ids, weights)

    eager = step(leaves[0], leaves[1], leaves[2], s.ids, leaves[3])
    for mode in ("default", "reduce-overhead"):
        compiled = torch.compile(step, fullgraph=True, mode=mode)
        for _ in range(2):
            out = compiled(leaves[0], leaves[1], leaves[2], s.ids, leaves[3])
        assert rel_error(out, eager.double()) <= 1e-2, mode
        grads = torch.autograd.grad(out.float().square().sum(), leaves)
        assert all(torch.isfinite(g).all() for g in grads), mode
