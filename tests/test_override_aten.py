"""override(level="aten"): tgemm's kernels stand in for aten's GEMM kernels while it is open.

Runs where tgemm runs: CUDA, or CPU under TRITON_INTERPRET=1 (CI). The routing decisions are
routing.py's planners, tested in test_override.py; these tests check what only the aten level
does: callers below Python (einsum, aten's own formulas, C++ paths, compiled code) are routed,
out= forms, process-wide scope, and that what it declines reaches the kernels registered before.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_override import (
    DEVICE,
    GROUPED_CASES,
    ROUTED_CASES,
    TOLERANCE,
    _grouped_operands,
    _grouped_reference,
    _scaled_grouped_operands,
    _scaled_operands,
    randn,
    rel_err,
    requires_cuda,
    requires_tgemm,
    routed_counts,
)
from torch import nn

import torch_triton_gemm as tg
from torch_triton_gemm import aten_override
from torch_triton_gemm.override import FAMILIES

pytestmark = requires_tgemm


def routed(counts: dict[str, int]) -> int:
    return sum(counts[family] for family in FAMILIES)


# --- the Python entry points reach tgemm through aten ---------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ROUTED_CASES)
def test_routed_forward_matches_float64(case, dtype, highest_fp32):
    _, _, fn, shapes = ROUTED_CASES[case]
    operands = [randn(*shape, dtype=dtype) for shape in shapes]
    ref = fn(*[t.double() for t in operands])
    plain = fn(*operands)
    with tg.override(level="aten") as ov:
        out = fn(*operands)
    # aten's matmul may reach mm or bmm where the Python level sees one entry point: count all.
    assert routed(ov.counts) >= 1 and ov.counts["fallback"] == 0, ov.counts
    assert out.dtype == plain.dtype and out.shape == plain.shape
    assert rel_err(out, ref) <= TOLERANCE[dtype]


# --- what only the aten level sees ---------------------------------------------------------------

EINSUMS = {
    "ij,jk->ik": ((10, 24), (24, 12)),
    "bi,oi->bo": ((10, 24), (12, 24)),
    "bij,bjk->bik": ((3, 5, 24), (3, 24, 12)),
    "bhqd,bhkd->bhqk": ((2, 3, 5, 8), (2, 3, 7, 8)),
    "ijk,kl->ijl": ((2, 5, 24), (24, 12)),
}


@pytest.mark.parametrize("equation", EINSUMS)
def test_einsum_forward_and_backward(equation, highest_fp32):
    operands = [randn(*shape, requires_grad=True) for shape in EINSUMS[equation]]
    leaves = [t.detach().double().requires_grad_() for t in operands]
    ref = torch.einsum(equation, *leaves)
    grad_out = torch.randn_like(ref)
    with tg.override(level="aten") as ov:
        out = torch.einsum(equation, *operands)
        forward = routed(ov.counts)
        grads = torch.autograd.grad(out, operands, grad_out.float())
    assert forward >= 1, "einsum's forward product did not run on tgemm"
    assert routed(ov.counts) >= forward + 2, "its backward products did not run on tgemm"
    assert ov.counts["fallback"] == 0
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    for grad, want in zip(grads, torch.autograd.grad(ref, leaves, grad_out)):
        assert rel_err(grad, want) <= TOLERANCE[torch.float32]


class EinsumBlock(nn.Module):
    """Attention and an MLP written with einsum only, as some research code does."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Parameter(torch.randn(3, heads, dim, dim // heads) / dim**0.5)
        self.proj = nn.Parameter(torch.randn(heads, dim // heads, dim) / dim**0.5)
        self.up = nn.Parameter(torch.randn(dim, 2 * dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(2 * dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.einsum("btd,shde->sbhte", x, self.qkv)
        scores = torch.einsum("bhqe,bhke->bhqk", q, k) / q.shape[-1] ** 0.5
        attended = torch.einsum("bhqk,bhke->bhqe", scores.softmax(-1), v)
        x = x + torch.einsum("bhte,hed->btd", attended, self.proj)
        return x + torch.einsum("btf,fd->btd", F.gelu(torch.einsum("btd,df->btf", x, self.up)),
                                self.down)


def test_einsum_heavy_module(highest_fp32):
    block = EinsumBlock(16, 2).to(DEVICE)
    reference = EinsumBlock(16, 2).double().to(DEVICE)
    reference.load_state_dict(block.state_dict())
    x = randn(2, 6, 16)
    ref = reference(x.double())
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(reference.parameters()), grad_out)
    with tg.override(level="aten") as ov:
        out = block(x)
        grads = torch.autograd.grad(out, list(block.parameters()), grad_out.float())
    # Six einsums forward, each a product with two products behind it in backward, except the
    # first, whose input x needs no gradient.
    assert routed(ov.counts) >= 17 and ov.counts["fallback"] == 0, ov.counts
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    for grad, want in zip(grads, ref_grads):
        assert rel_err(grad, want) <= TOLERANCE[torch.float32]


def test_autocast_leaves_fp32_products_of_fp32_ops_in_fp32(highest_fp32):
    # cdist runs in float32 under autocast, and computes its distances with an aten mm below the
    # autocast layer: the aten level must keep that product in float32, not cast it as
    # autocast casts calls made by the user (which aten has already cast when they arrive).
    x, y = randn(40, 8), randn(30, 8)
    ref = torch.cdist(x.double(), y.double())
    linear = nn.Linear(8, 16, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), tg.override(level="aten") as ov:
        out = torch.cdist(x, y)
        hidden = linear(x)
    assert ov.counts["mm"] >= 1 and ov.counts["addmm"] == 1, ov.counts
    assert out.dtype == torch.float32 and rel_err(out, ref) <= 1e-5
    assert hidden.dtype == torch.bfloat16


OUT_FORMS = {
    "mm": (lambda a, b, c, out: torch.mm(a, b, out=out), (10, 24), (24, 12), None),
    "addmm": (lambda a, b, c, out: torch.addmm(c, a, b, beta=0.5, out=out),
              (10, 24), (24, 12), (12,)),
    "bmm": (lambda a, b, c, out: torch.bmm(a, b, out=out), (3, 5, 24), (3, 24, 12), None),
    "baddbmm": (lambda a, b, c, out: torch.baddbmm(c, a, b, alpha=2, out=out),
                (3, 5, 24), (3, 24, 12), (3, 5, 12)),
}


@pytest.mark.parametrize("form", OUT_FORMS)
def test_out_forms(form, highest_fp32):
    fn, shape_a, shape_b, shape_c = OUT_FORMS[form]
    a, b = randn(*shape_a), randn(*shape_b)
    c = None if shape_c is None else randn(*shape_c)
    ref = fn(a.double(), b.double(), None if c is None else c.double(), None)
    out = torch.full(ref.shape, float("nan"), device=DEVICE)
    wrong = torch.empty(ref.shape, device=DEVICE, dtype=torch.float64)
    with tg.override(level="aten") as ov:
        result = fn(a, b, c, out)
        assert result is out
        assert routed(ov.counts) == 1
        # An out of another dtype: aten decides (and raises as it does without the override).
        with pytest.raises(RuntimeError) as routed_error:
            fn(a, b, c, wrong)
    with pytest.raises(RuntimeError) as plain_error:
        fn(a, b, c, wrong)
    assert str(routed_error.value) == str(plain_error.value)
    assert ov.counts["fallback"] == 1
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_out_of_another_shape_is_resized_as_aten_does(highest_fp32):
    """An out= tensor of the wrong shape is resized, with PyTorch's deprecation warning where it
    had elements and without one where it had none."""
    a, b = randn(10, 24), randn(24, 12)
    with tg.override(level="aten") as ov:
        with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
            out = torch.mm(a, b, out=torch.empty(3, 3, device=DEVICE))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            empty = torch.mm(a, b, out=torch.empty(0, device=DEVICE))
    assert routed(ov.counts) == 2
    for result in (out, empty):
        assert result.shape == (10, 12)
        assert rel_err(result, a.double() @ b.double()) <= TOLERANCE[torch.float32]


def test_declined_calls_reach_the_previous_kernels():
    a, b = randn(8, 16, dtype=torch.float64), randn(16, 8, dtype=torch.float64)
    a3, b3 = randn(2, 8, 16, dtype=torch.complex64), randn(2, 16, 8, dtype=torch.complex64)
    plain = (a @ b, torch.bmm(a3, b3), torch.addmm(a[:, 0], a, b, beta=2))
    with tg.override(level="aten") as ov:
        out = (a @ b, torch.bmm(a3, b3), torch.addmm(a[:, 0], a, b, beta=2))
    assert ov.counts == routed_counts(fallback=3)
    for got, want in zip(out, plain):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_ops_and_min_size():
    a, b, a3, b3 = randn(8, 16), randn(16, 8), randn(2, 8, 16), randn(2, 16, 8)
    with tg.override(level="aten", ops=("bmm",)) as ov:
        a @ b, torch.bmm(a3, b3)
    assert ov.counts == routed_counts(bmm=1, fallback=1)
    with tg.override(level="aten", min_size=8 * 16 * 8 + 1) as ov:
        a @ b, torch.bmm(a3, b3)
    assert ov.counts == routed_counts(bmm=1, fallback=1)


def _spied_planners(monkeypatch) -> dict[str, int]:
    """Count the planner calls of the aten-level kernels registered from now on; start with no
    routed signatures remembered."""
    calls = {op.name: 0 for op in aten_override._ATEN_OPS}

    def spy(op):  # type: ignore[no-untyped-def]
        def planner(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[op.name] += 1
            return op.planner(*args, **kwargs)
        return op._replace(planner=planner)

    monkeypatch.setattr(aten_override, "_ATEN_OPS", tuple(map(spy, aten_override._ATEN_OPS)))
    monkeypatch.setattr(aten_override, "_ROUTED_CALLS", {})
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repeated_plain_products_skip_the_planner(monkeypatch, dtype, highest_fp32):
    calls = _spied_planners(monkeypatch)
    x, weight, bias = randn(12, 40, dtype=dtype), randn(24, 40, dtype=dtype), randn(24, dtype=dtype)
    q, k = randn(3, 10, 16, dtype=dtype), randn(3, 12, 16, dtype=dtype)  # attention scores
    refs = (x.double() @ weight.double().t(),
            x.double() @ weight.double().t() + bias.double(),
            q.double() @ k.double().transpose(1, 2))
    with tg.override(level="aten") as ov:
        outs = [(torch.mm(x, weight.t()), F.linear(x, weight, bias),
                 torch.bmm(q, k.transpose(1, 2))) for _ in range(3)]
    # The first call of each signature is planned; the others reuse its decision.
    assert calls["mm"] == 1 and calls["addmm"] == 1 and calls["bmm"] == 1, calls
    assert ov.counts == routed_counts(mm=3, addmm=3, bmm=3)
    for out in outs:
        for got, ref in zip(out, refs):
            assert got.dtype == dtype and rel_err(got, ref) <= TOLERANCE[dtype]
        for got, first in zip(out, outs[0]):
            assert torch.equal(got, first)  # same kernels, same bits


def test_remembered_products_respect_settings_and_arguments(monkeypatch, highest_fp32):
    calls = _spied_planners(monkeypatch)
    a, b, bias = randn(8, 16), randn(16, 8), randn(8)
    with tg.override(level="aten") as ov:
        a @ b, torch.addmm(bias, a, b)
    assert ov.counts == routed_counts(mm=1, addmm=1)
    # Routers with other settings decide for themselves: the remembered signatures were routed
    # under ops and min_size they do not share.
    with tg.override(level="aten", ops=("bmm",)) as ov:
        plain = a @ b
    assert ov.counts == routed_counts(fallback=1) and torch.equal(plain, torch.mm(a, b))
    with tg.override(level="aten", min_size=8 * 16 * 8 + 1) as ov:
        torch.addmm(bias, a, b)
    assert ov.counts == routed_counts(fallback=1)
    # beta / alpha other than 1, biases that are not [N] and logging routers are planned every
    # time.
    planned = dict(calls)
    with tg.override(level="aten") as ov:
        for _ in range(2):
            scaled = torch.addmm(bias, a, b, beta=0.5, alpha=2)
            broadcast = torch.addmm(bias[:1], a, b)
            row = torch.addmm(bias[None], a, b)  # a [1, N] bias: fused, after a reshape
    assert calls["addmm"] - planned["addmm"] == 6
    assert ov.counts == routed_counts(addmm=6)
    assert rel_err(row, bias.double() + a.double() @ b.double()) <= TOLERANCE[torch.float32]
    assert rel_err(scaled, 0.5 * bias.double() + 2 * (a.double() @ b.double())) <= TOLERANCE[
        torch.float32]
    assert rel_err(broadcast, bias[:1].double() + a.double() @ b.double()) <= TOLERANCE[
        torch.float32]
    with tg.override(level="aten", log=True) as ov:
        for _ in range(2):
            a @ b
    assert calls["mm"] - planned["mm"] == 2 and ov.counts == routed_counts(mm=2)
    # A batch that b shares (a stride-0 batch, or one entry) folds into M of one tgemm.mm:
    # planned every time.
    a3, shared = randn(3, 8, 16), b.expand(3, 16, 8)
    with tg.override(level="aten") as ov:
        for _ in range(2):
            folded = torch.bmm(a3, shared)
            single = torch.bmm(a3[:1], shared[:1])
    assert calls["bmm"] - planned["bmm"] == 4 and ov.counts == routed_counts(bmm=4)
    assert rel_err(folded, a3.double() @ b.double()) <= TOLERANCE[torch.float32]
    assert rel_err(single, a3[:1].double() @ b.double()) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_mm(case, dtype, highest_fp32):
    a, b, offs, bias = _grouped_operands(case, dtype)
    with tg.override(level="aten") as ov:
        out = torch._grouped_mm(a, b, offs, bias=bias)
    assert ov.counts == routed_counts(grouped=1)
    assert out.dtype == dtype
    assert rel_err(out, _grouped_reference(a, b, offs, bias)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm(recipe):
    xq, wq, xs, ws, ref = _scaled_operands(recipe)
    out = torch.full(ref.shape, float("nan"), device=DEVICE, dtype=torch.bfloat16)
    with tg.override(level="aten") as ov:
        result = torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.bfloat16)
        torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.bfloat16, out=out)
    assert ov.counts == routed_counts(scaled=2)
    assert rel_err(result, ref) <= 1e-2 and rel_err(out, ref) <= 1e-2


def test_scaled_grouped_mm():
    a, b, sa, sb, offs, ref = _scaled_grouped_operands()
    with tg.override(level="aten") as ov:
        out = torch._scaled_grouped_mm(a, b, sa, sb, offs)
    assert ov.counts == routed_counts(scaled=1)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 1e-2
    # A declined call reaches PyTorch's kernel, which refuses scale_result; without one (CPU
    # builds) it fails as it does without the override.
    with tg.override(level="aten") as ov:
        with pytest.raises((RuntimeError, ValueError)):
            torch._scaled_grouped_mm(a, b, sa, sb, offs, scale_result=sa)
    assert ov.counts == routed_counts(fallback=1)


# --- scope ---------------------------------------------------------------------------------------

def test_scope_is_restored_on_exit_and_on_exceptions():
    a, b = randn(8, 16), randn(16, 8)
    ov = tg.override(level="aten")
    with pytest.raises(KeyError):
        with ov:
            a @ b
            raise KeyError("boom")
    assert aten_override.active() is None
    a @ b
    with ov:
        with ov:  # the same object nests; its kernels stay until the outer exit
            a @ b
        a @ b
    a @ b
    assert ov.counts == routed_counts(mm=3)
    assert aten_override.active() is None


def test_one_open_at_a_time():
    first = tg.override(level="aten")
    with first:
        with pytest.raises(RuntimeError, match="only one can be open"):
            with tg.override(level="aten"):
                pass
        assert aten_override.active() is first
    with tg.override(level="aten") as second:
        assert aten_override.active() is second


def test_process_wide_every_thread_is_routed():
    a, b = randn(8, 16), randn(16, 8)
    seen = {}

    def other_thread() -> None:
        seen["out"] = a @ b

    with tg.override(level="aten") as ov:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert ov.counts == routed_counts(mm=1)
    assert rel_err(seen["out"], a.double() @ b.double()) <= TOLERANCE[torch.float32]


def test_python_and_aten_levels_together():
    linear = nn.Linear(16, 8, device=DEVICE)
    x = randn(4, 16)
    with tg.override(level="aten") as aten_level, tg.override(ops=("mm",)) as python_level:
        linear(x)  # addmm: declined by the Python level, so aten's addmm runs: the aten level's
        x @ linear.weight.t()  # routed above aten
        torch.einsum("ij,kj->ik", x, linear.weight)  # the Python level does not see einsum
    assert python_level.counts == routed_counts(mm=1, fallback=1)
    assert aten_level.counts["addmm"] == 1 and aten_level.counts["bmm"] + \
        aten_level.counts["mm"] == 1


def test_level_is_checked():
    with pytest.raises(ValueError, match="level must be"):
        tg.override(level="dispatch")
    assert repr(tg.override(level="aten", ops="mm")) == \
        "override(ops=('mm',), min_size=0, log=False, level='aten')"


# --- torch.compile -------------------------------------------------------------------------------

def test_compiled_code_runs_on_tgemm_while_open(fresh_dynamo, highest_fp32):
    # A compiled graph holds aten ops; its GEMMs are Inductor's calls into aten (extern kernels),
    # which reach tgemm whenever they run with the aten level open, wherever it was compiled.
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE)
    x = randn(4, 16, requires_grad=True)
    y = randn(2, 16, 3)

    def step(x: torch.Tensor) -> torch.Tensor:
        # Elementwise results, not one summed scalar: a sum of signed terms cancels, and its
        # relative error would measure the cancellation rather than the products.
        products = torch.einsum("bij,bjk->bik", x.view(2, 2, 16), y)
        return torch.cat([mlp(x).flatten(), products.flatten()])

    ref = step(x)
    upstream = torch.randn_like(ref)
    ref_grad, = torch.autograd.grad(ref, x, upstream)
    compiled = torch.compile(step)
    with tg.override(level="aten"):
        # Compiles forward and backward; Inductor may time GEMMs while it compiles (padding
        # choices), and those products run on tgemm too, so they are counted apart.
        torch.autograd.grad(compiled(x), x, upstream)
    with tg.override(level="aten") as ov:
        out = compiled(x)
        forward = routed(ov.counts)
        grad, = torch.autograd.grad(out, x, upstream)
    assert forward >= 3, ov.counts
    assert routed(ov.counts) > forward, "the compiled backward did not run on tgemm"
    assert ov.counts["fallback"] == 0
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    assert rel_err(grad, ref_grad) <= TOLERANCE[torch.float32]
    with tg.override(level="aten") as again:
        compiled(x)  # the same graph, routed at run time
    assert routed(again.counts) == forward
    compiled(x)  # closed: the graph's GEMMs run on aten's kernels
    assert routed(again.counts) == forward


@requires_cuda
@pytest.mark.gpu
def test_compiled_grouped_and_scaled_run_on_tgemm(fresh_dynamo):
    # The Python level cannot route torch._grouped_mm / torch._scaled_mm in compiled code (Dynamo
    # hands TorchFunctionModes public functions only); the aten level can.
    # Rows of 16 bytes and more: PyTorch's meta function for _grouped_mm, which compile runs,
    # insists on them.
    a, b = randn(24, 16, dtype=torch.bfloat16), randn(3, 16, 16, dtype=torch.bfloat16)
    offs = torch.tensor([5, 16, 24], dtype=torch.int32, device=DEVICE)
    xq, wq, xs, ws, ref = _scaled_operands("rowwise")

    @torch.compile
    def moe_and_fp8(a, b, offs, xq, wq, xs, ws):
        return (torch._grouped_mm(a, b, offs),
                torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.bfloat16))

    with tg.override(level="aten") as ov:
        grouped, scaled = moe_and_fp8(a, b, offs, xq, wq, xs, ws)
    assert ov.counts["grouped"] == 1 and ov.counts["scaled"] == 1, ov.counts
    assert rel_err(grouped, _grouped_reference(a, b, offs, None)) <= TOLERANCE[torch.bfloat16]
    assert rel_err(scaled, ref) <= 1e-2
