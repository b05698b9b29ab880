"""torch_triton_gemm.override: what it routes, what it leaves alone, gradients, scope, compile.

Routing tests run where tgemm can: on a CUDA GPU with compiled Triton, or on CPU when
TRITON_INTERPRET=1 was set before the package was imported (CI does that). Shapes are tiny there
because the interpreter is slow. Tests marked ``gpu`` need CUDA and check the H100 story: a
Hugging Face Llama and Inductor's output code.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import logging
import pathlib
import re
import sys
import threading
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_triton_gemm as tg
from torch_triton_gemm import device as tg_device
from torch_triton_gemm.override import FAMILIES, GemmOverride


def _routing_device() -> str | None:
    if torch.cuda.is_available() and tg_device.kernel_device_error(torch.device("cuda")) is None:
        return "cuda"
    if tg_device.interpreter_enabled():
        return "cpu"
    return None


DEVICE = _routing_device()
requires_tgemm = pytest.mark.skipif(
    DEVICE is None,
    reason="tgemm runs nowhere here: no CUDA GPU, and TRITON_INTERPRET=1 was not set before "
           "torch_triton_gemm was imported (CPU tensors run only in Triton's interpreter)")
requires_cuda = pytest.mark.skipif(DEVICE != "cuda",
                                   reason="needs a CUDA GPU with compiled Triton kernels")

# tgemm's mm and grouped kernels as they appear in profiler traces and Inductor's code.
TGEMM_KERNEL = re.compile(r"\bmm_(tma_)?kernel\b")
TGEMM_GROUPED_KERNEL = re.compile(r"\bgrouped_mm_kernel\b")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | None = None,
          requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=device or DEVICE, dtype=dtype, requires_grad=requires_grad)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class TgemmCalls(TorchDispatchMode):
    """Counts tgemm op calls below autograd, so calls made by backward formulas count too: ``n``
    all of them, ``ops`` per op name ("mm", "grouped_mm", "scaled_mm")."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tgemm":
            self.n += 1
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def routed_counts(**counts: int) -> dict[str, int]:
    return {**dict.fromkeys(FAMILIES, 0), "fallback": 0, **counts}


# --- what is routed: forward against float64 -----------------------------------------------------
# name -> (family, tgemm calls, function, operand shapes).

def _shared_rhs_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b.unsqueeze(0).expand(a.shape[0], -1, -1))


ROUTED_CASES: dict[str, tuple[str, int, Callable[..., torch.Tensor], list[tuple[int, ...]]]] = {
    "F.linear": ("mm", 1, F.linear, [(10, 24), (40, 24)]),
    "F.linear+bias 3-D": ("addmm", 1, F.linear, [(2, 5, 24), (40, 24), (40,)]),
    "@ 2-D": ("mm", 1, lambda a, b: a @ b, [(10, 24), (24, 40)]),
    "@ 3-D x 2-D": ("mm", 1, lambda a, b: a @ b, [(2, 5, 24), (24, 40)]),
    "@ 3-D x 3-D": ("bmm", 1, lambda a, b: a @ b, [(3, 5, 24), (3, 24, 40)]),
    "@ 4-D x 4-D [B,H,T,D] @ [B,H,D,T]": (
        "bmm", 1, lambda a, b: a @ b, [(2, 3, 5, 8), (2, 3, 8, 5)]),
    "@ [1,M,K] x [B,K,N]": ("bmm", 1, lambda a, b: a @ b, [(1, 5, 24), (3, 24, 40)]),
    "@ [B,1,M,K] x [H,K,N]": ("bmm", 1, torch.matmul, [(2, 1, 5, 24), (3, 24, 40)]),
    "@ 2-D x 3-D": ("bmm", 1, lambda a, b: a @ b, [(5, 24), (3, 24, 40)]),
    "@ 4-D x [1,K,N], shared rhs": ("bmm", 1, lambda a, b: a @ b, [(2, 3, 5, 24), (1, 24, 40)]),
    "torch.matmul": ("mm", 1, torch.matmul, [(10, 24), (24, 40)]),
    "Tensor.matmul 4-D x 2-D": ("mm", 1, torch.Tensor.matmul, [(2, 2, 3, 24), (24, 40)]),
    "__rmatmul__": ("mm", 1, lambda a, b: b.__rmatmul__(a), [(10, 24), (24, 40)]),
    "torch.mm": ("mm", 1, torch.mm, [(10, 24), (24, 40)]),
    "Tensor.mm": ("mm", 1, torch.Tensor.mm, [(10, 24), (24, 40)]),
    "torch.addmm [N]": ("addmm", 1, torch.addmm, [(40,), (10, 24), (24, 40)]),
    "torch.addmm [1, N]": ("addmm", 1, torch.addmm, [(1, 40), (10, 24), (24, 40)]),
    "Tensor.addmm beta=alpha=1": (
        "addmm", 1, lambda c, a, b: c.addmm(a, b, beta=1, alpha=1), [(40,), (10, 24), (24, 40)]),
    "addmm beta, alpha": ("addmm", 1, lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2),
                          [(40,), (10, 24), (24, 40)]),
    "addmm [M, N] input": ("addmm", 1, torch.addmm, [(10, 40), (10, 24), (24, 40)]),
    "addmm [M, 1] input, beta": (
        "addmm", 1, lambda c, a, b: c.addmm(a, b, beta=-1.5), [(10, 1), (10, 24), (24, 40)]),
    "torch.baddbmm": ("bmm", 1, torch.baddbmm, [(3, 5, 40), (3, 5, 24), (3, 24, 40)]),
    "Tensor.baddbmm [1, N] input, beta, alpha": (
        "bmm", 1, lambda c, a, b: c.baddbmm(a, b, beta=0.25, alpha=-3),
        [(1, 40), (3, 5, 24), (3, 24, 40)]),
    "torch.bmm": ("bmm", 1, torch.bmm, [(3, 5, 24), (3, 24, 40)]),
    "Tensor.bmm": ("bmm", 1, torch.Tensor.bmm, [(12, 5, 24), (12, 24, 40)]),
    "bmm batch 1": ("bmm", 1, torch.bmm, [(1, 5, 24), (1, 24, 40)]),
    "bmm shared rhs, one call": ("bmm", 1, _shared_rhs_bmm, [(12, 5, 24), (24, 40)]),
    "transposed operands": ("mm", 1, lambda a, b: a.t() @ b.t(), [(24, 10), (40, 24)]),
}


@requires_tgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ROUTED_CASES)
def test_routed_forward_matches_float64(case, dtype, highest_fp32):
    family, calls, fn, shapes = ROUTED_CASES[case]
    operands = [randn(*shape, dtype=dtype) for shape in shapes]
    ref = fn(*[t.double() for t in operands])
    plain = fn(*operands)
    with tg.override() as ov, TgemmCalls() as launched:
        out = fn(*operands)
    assert ov.counts == routed_counts(**{family: 1})
    assert launched.n == calls
    assert out.dtype == plain.dtype and out.shape == plain.shape
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@requires_tgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_nn_linear(bias, dtype, highest_fp32):
    linear = nn.Linear(24, 40, bias=bias, device=DEVICE, dtype=dtype)
    x = randn(2, 6, 24, dtype=dtype)
    ref = x.double() @ linear.weight.double().t()
    if bias:
        ref = ref + linear.bias.double()
    with tg.override() as ov:
        out = linear(x)
    assert ov.counts == routed_counts(**{"addmm" if bias else "mm": 1})
    assert out.dtype == dtype and out.shape == (2, 6, 40)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@requires_tgemm
def test_autocast_casts_like_aten():
    linear = nn.Linear(24, 40, device=DEVICE)
    x = randn(10, 24)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        plain = linear(x)
        with tg.override() as ov:
            out = linear(x)
    assert ov.counts == routed_counts(addmm=1)
    assert out.dtype == plain.dtype == torch.bfloat16
    ref = x.bfloat16().double() @ linear.weight.bfloat16().double().t() + linear.bias.bfloat16()
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


# --- gradients ---------------------------------------------------------------------------------

GRAD_CASES = ["F.linear", "F.linear+bias 3-D", "@ 3-D x 2-D", "torch.mm", "torch.addmm [N]",
              "torch.addmm [1, N]", "addmm beta, alpha", "addmm [M, 1] input, beta", "torch.bmm",
              "bmm shared rhs, one call", "Tensor.baddbmm [1, N] input, beta, alpha"]


@requires_tgemm
@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_match_autograd(case, highest_fp32):
    _, _, fn, shapes = ROUTED_CASES[case]
    operands = [randn(*shape, requires_grad=True) for shape in shapes]
    plain = fn(*operands)
    grad_out = torch.randn_like(plain)
    expected = torch.autograd.grad(plain, operands, grad_out)
    with tg.override():
        out = fn(*operands)
    with TgemmCalls() as launched:
        grads = torch.autograd.grad(out, operands, grad_out)
    assert launched.n > 0, "the backward pass did not run on tgemm::mm"
    for grad, ref in zip(grads, expected):
        assert grad.shape == ref.shape
        assert rel_err(grad, ref) <= TOLERANCE[torch.float32]


# --- what falls through ------------------------------------------------------------------------

def _fallthrough_cases() -> dict[str, Callable[[], tuple[Callable[..., torch.Tensor], tuple]]]:
    # Each makes fresh operands; CPU tensors where the dtype has no CUDA matmul (ints, complex).
    return {
        "float64": lambda: (torch.mm, (randn(8, 16, dtype=torch.float64),
                                       randn(16, 8, dtype=torch.float64))),
        "int64": lambda: (torch.mm, (torch.randint(-4, 4, (8, 16)),
                                     torch.randint(-4, 4, (16, 8)))),
        "complex64": lambda: (torch.matmul, (randn(8, 16, dtype=torch.complex64, device="cpu"),
                                             randn(16, 8, dtype=torch.complex64, device="cpu"))),
        "out=": lambda: (lambda a, b, c: torch.mm(a, b, out=c),
                         (randn(8, 16), randn(16, 8), torch.empty(8, 8, device=DEVICE))),
        "vector @ matrix": lambda: (torch.matmul, (randn(16), randn(16, 8))),
        "matrix @ vector": lambda: (torch.matmul, (randn(8, 16), randn(16))),
        "F.linear 1-D input": lambda: (F.linear, (randn(16), randn(8, 16))),
        "bmm empty batch": lambda: (torch.bmm, (randn(0, 4, 8), randn(0, 8, 4))),
        "matmul empty batch": lambda: (torch.matmul, (randn(2, 0, 4, 8), randn(1, 8, 4))),
        "float64 4-D": lambda: (torch.matmul, (randn(2, 2, 4, 8, dtype=torch.float64),
                                               randn(2, 8, 4, dtype=torch.float64))),
        "meta tensors": lambda: (torch.mm, (randn(8, 16, device="meta"),
                                            randn(16, 8, device="meta"))),
    }


@requires_tgemm
@pytest.mark.parametrize("case", list(_fallthrough_cases()))
def test_falls_through_unchanged(case, highest_fp32):
    fn, operands = _fallthrough_cases()[case]()
    plain = fn(*operands)
    with tg.override() as ov, TgemmCalls() as launched:
        out = fn(*operands)
    assert ov.counts == routed_counts(fallback=1)
    assert launched.n == 0
    assert out.dtype == plain.dtype and out.shape == plain.shape
    if out.device.type != "meta":
        assert torch.equal(out, plain)


@requires_tgemm
@pytest.mark.parametrize("level", ["python", "aten"])
def test_beta_zero_ignores_input(level, highest_fp32):
    # aten's addmm / baddbmm with beta = 0 do not read input: NaN there must not reach out.
    a, b, a3, b3 = randn(6, 16), randn(16, 8), randn(2, 6, 16), randn(2, 16, 8)
    with tg.override(level=level) as ov:
        out = torch.addmm(torch.full((6, 8), float("nan"), device=DEVICE), a, b, beta=0, alpha=3)
        out3 = torch.baddbmm(torch.full((2, 6, 8), float("nan"), device=DEVICE), a3, b3, beta=0)
    assert ov.counts == routed_counts(addmm=1, bmm=1)
    assert rel_err(out, 3 * (a.double() @ b.double())) <= TOLERANCE[torch.float32]
    assert rel_err(out3, a3.double() @ b3.double()) <= TOLERANCE[torch.float32]


@requires_tgemm
@pytest.mark.parametrize("level", ["python", "aten"])
def test_beta_zero_keeps_an_input_that_requires_grad(level, highest_fp32):
    """With beta = 0 aten's result still depends on input, with a zero gradient: an input
    that requires grad stays in the graph (the Python level leaves such calls to PyTorch)."""
    a, b, a3, b3 = randn(6, 16), randn(16, 8), randn(2, 6, 16), randn(2, 16, 8)
    inp, inp3 = randn(6, 8, requires_grad=True), randn(2, 6, 8, requires_grad=True)
    with tg.override(level=level):
        out = torch.addmm(inp, a, b, beta=0)
        out3 = torch.baddbmm(inp3, a3, b3, beta=0)
        assert out.requires_grad and out3.requires_grad
        grads = torch.autograd.grad((out.sum() + out3.sum()), (inp, inp3))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert rel_err(out, a.double() @ b.double()) <= TOLERANCE[torch.float32]


@requires_tgemm
def test_torch_func_transforms_and_forward_ad_stay_with_pytorch(highest_fp32):
    """torch.func transforms and forward-mode AD get PyTorch's products (tgemm's formulas are
    reverse-mode autograd only, which grad rejects and jvp would silently drop): results as
    without the override."""
    a, w, t = randn(5, 7), randn(7, 3), randn(7, 3)

    def loss(w: torch.Tensor) -> torch.Tensor:
        return (a @ w).tanh().sum()

    def tangent_of_linear() -> torch.Tensor:
        with fwAD.dual_level():
            out = F.linear(a, fwAD.make_dual(w.t(), t.t()))
            return fwAD.unpack_dual(out).tangent

    expected = (torch.func.grad(loss)(w), torch.func.jvp(lambda w: a @ w, (w,), (t,))[1],
                tangent_of_linear())
    with tg.override() as ov:
        got = (torch.func.grad(loss)(w), torch.func.jvp(lambda w: a @ w, (w,), (t,))[1],
               tangent_of_linear())
    assert ov.counts["mm"] == 0 and ov.counts["fallback"] >= 3
    for value, reference in zip(got, expected, strict=True):
        assert value is not None and rel_err(value, reference) <= TOLERANCE[torch.float32]
    assert rel_err(got[1], a.double() @ t.double()) <= TOLERANCE[torch.float32]


@requires_tgemm
@pytest.mark.parametrize("level", ["python", "aten"])
def test_products_are_not_views(level, highest_fp32):
    """As aten's (an _unsafe_view where matmul folds), routed products of 3-D operands are
    not views of a 2-D result: detach_() works, and so does an in-place op needing gradients
    on a result made under no_grad."""
    x, w, b3 = randn(2, 5, 7), randn(3, 7), randn(2, 7, 3)
    p = randn(3, requires_grad=True)
    with tg.override(level=level) as ov:
        outs = [x @ w.t(), F.linear(x, w), torch.bmm(x, b3), torch.matmul(x, b3),
                x @ w.t().expand(2, 7, 3)]
        assert all(out._base is None for out in outs)
        outs[0].detach_()
        with torch.no_grad():
            y = x @ w.t()
        y.add_(p)
    assert ov.counts["mm"] + ov.counts["bmm"] == 6
    assert rel_err(y, x.double() @ w.double().t() + p.double()) <= TOLERANCE[torch.float32]


@requires_tgemm
@pytest.mark.parametrize("level", ["python", "aten"])
def test_expanded_right_operand_gets_its_own_gradient(level, highest_fp32):
    """A right operand that is an expand()ed tensor requiring grad has a gradient per batch
    entry: bmm and matmul must not fold its batch into M (which gives the whole gradient to
    the first entry)."""
    x, w = randn(2, 5, 7), randn(7, 3, requires_grad=True)
    x4 = randn(2, 2, 5, 7)
    for product, expanded in ((lambda b: torch.bmm(x, b), w.expand(2, 7, 3)),
                              (lambda b: torch.matmul(x4, b), w.expand(2, 2, 7, 3))):
        expected, = torch.autograd.grad(product(expanded).sum(), expanded)
        with tg.override(level=level) as ov:
            got, = torch.autograd.grad(product(expanded).sum(), expanded)
        assert ov.counts["bmm"] >= 1  # (the aten level counts the backward's products too)
        assert rel_err(got, expected) <= TOLERANCE[torch.float32]


@requires_tgemm
def test_mixed_dtypes_fall_through_to_aten_error():
    a, b = randn(8, 16), randn(16, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as plain_error:
        torch.mm(a, b)
    with tg.override() as ov, pytest.raises(RuntimeError) as routed_error:
        torch.mm(a, b)
    assert str(routed_error.value) == str(plain_error.value)
    assert ov.counts == routed_counts(fallback=1)


@requires_tgemm
def test_min_size():
    a, b = randn(8, 16), randn(16, 4)  # M * N * K = 512
    with tg.override(min_size=513) as ov:
        a @ b
    assert ov.counts == routed_counts(fallback=1)
    with tg.override(min_size=512) as ov:
        a @ b
    assert ov.counts == routed_counts(mm=1)


@requires_tgemm
def test_ops_selects_families():
    linear = nn.Linear(16, 8, device=DEVICE)
    x, a3, b3 = randn(4, 16), randn(2, 4, 16), randn(2, 16, 8)
    with tg.override(ops=("addmm",)) as ov:
        linear(x), x @ linear.weight.t(), torch.bmm(a3, b3)
    assert ov.counts == routed_counts(addmm=1, fallback=2)
    with tg.override(ops="bmm") as ov:
        linear(x), x @ linear.weight.t(), torch.bmm(a3, b3)
    assert ov.counts == routed_counts(bmm=1, fallback=2)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown ops"):
        tg.override(ops=("mm", "conv"))
    with pytest.raises(ValueError, match="min_size"):
        tg.override(min_size=-1)
    ov = tg.override(ops="mm", min_size=4096)
    assert isinstance(ov, GemmOverride) and ov.ops == {"mm"}
    assert repr(ov) == "override(ops=('mm',), min_size=4096, log=False)"


@requires_tgemm
def test_log(caplog):
    a, b = randn(8, 16), randn(16, 8)
    with caplog.at_level(logging.DEBUG, logger="torch_triton_gemm.override"):
        with tg.override(log=True):
            a @ b
            a.double() @ b.double()
        with tg.override():
            a @ b
    # Only the override's records: a first call can also log its wait for a kernel compile.
    messages = [(r.levelno, r.getMessage()) for r in caplog.records
                if r.name == "torch_triton_gemm.override"]
    assert messages == [
        (logging.DEBUG, "Tensor.matmul([8, 16] torch.float32, [16, 8] torch.float32) -> "
                        "tgemm::mm [mm]"),
        (logging.INFO, "Tensor.matmul([8, 16] torch.float64, [16, 8] torch.float64) stays with "
                       "PyTorch: dtype is not float16, bfloat16 or float32"),
    ]


# --- batched products of any rank: one launch, gradients against float64 -------------------------

BATCHED_GRAD_SHAPES = {
    "bmm": ((3, 5, 8), (3, 8, 6)),
    "[B,H,T,D] @ [B,H,D,T]": ((2, 3, 5, 8), (2, 3, 8, 5)),
    "[1,M,K] @ [B,K,N]": ((1, 5, 8), (3, 8, 6)),
    "[B,1,M,K] @ [H,K,N]": ((2, 1, 5, 8), (3, 8, 6)),
    "[M,K] @ [B,K,N]": ((5, 8), (3, 8, 6)),
    "[B,H,M,K] @ [1,K,N] shared": ((2, 3, 5, 8), (1, 8, 6)),
}


@requires_tgemm
@pytest.mark.parametrize("case", BATCHED_GRAD_SHAPES)
def test_batched_gradients_match_float64(case, highest_fp32):
    shape_a, shape_b = BATCHED_GRAD_SHAPES[case]
    a, b = randn(*shape_a, requires_grad=True), randn(*shape_b, requires_grad=True)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ref = a64 @ b64
    grad_out = torch.randn_like(ref)
    with tg.override() as ov, TgemmCalls() as launched:
        out = a @ b
    assert ov.counts == routed_counts(bmm=1)
    shared = case.endswith("shared")
    assert launched.ops == ({"mm": 1} if shared else {"grouped_mm": 1})
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    grads = torch.autograd.grad(out, (a, b), grad_out.float())
    expected = torch.autograd.grad(ref, (a64, b64), grad_out)
    for grad, want in zip(grads, expected):
        assert grad.shape == want.shape
        assert rel_err(grad, want) <= TOLERANCE[torch.float32]


@requires_tgemm
def test_batched_flatten_copies_only_when_forced(monkeypatch, highest_fp32):
    # b [B, H, K, N] flattens to [B * H, K, N] as a view; a [B, 1, M, K] broadcast over H cannot
    # merge its batch strides, so only a is copied (by reshape).
    module = sys.modules["torch_triton_gemm.routing"]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = module._tgemm_grouped

    def spy(a3: torch.Tensor, b3: torch.Tensor, *rest) -> torch.Tensor:
        seen.append((a3, b3))
        return real(a3, b3, *rest)

    monkeypatch.setattr(module, "_tgemm_grouped", spy)
    a, b = randn(2, 1, 5, 8), randn(2, 3, 8, 6)
    with tg.override():
        out = a @ b
    (a3, b3), = seen
    assert b3.shape == (6, 8, 6) and b3.data_ptr() == b.data_ptr()
    assert a3.shape == (6, 5, 8) and a3.data_ptr() != a.data_ptr()
    assert rel_err(out, a.double() @ b.double()) <= TOLERANCE[torch.float32]


NOT_BROADCASTING = {
    "matmul batch dims": lambda: (torch.matmul, (randn(2, 4, 8), randn(3, 8, 4))),
    "addmm input": lambda: (torch.addmm, (randn(3, 8), randn(8, 16), randn(16, 8))),
    "baddbmm input": lambda: (torch.baddbmm, (randn(3, 8, 8), randn(2, 8, 16), randn(2, 16, 8))),
}


@requires_tgemm
@pytest.mark.parametrize("case", NOT_BROADCASTING)
def test_shapes_that_do_not_broadcast_fall_through_to_aten_error(case):
    fn, operands = NOT_BROADCASTING[case]()
    with pytest.raises(RuntimeError) as plain_error:
        fn(*operands)
    with tg.override() as ov, pytest.raises(RuntimeError) as routed_error:
        fn(*operands)
    assert str(routed_error.value) == str(plain_error.value)
    assert ov.counts == routed_counts(fallback=1)


# --- torch._grouped_mm -------------------------------------------------------------------------

def _grouped_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """torch._grouped_mm's contract in float64, one group at a time."""
    a, b = a.double(), b.double()
    ends = [] if offs is None else offs.tolist()
    starts = [0, *ends[:-1]]
    if a.dim() == 3 and b.dim() == 3:
        out = a @ b
        return out if bias is None else out + bias.double()[:, None, :]
    if a.dim() == 2 and b.dim() == 3:
        out = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])
        rows = torch.cat([bias.double()[g].expand(e - s, -1)
                          for g, (s, e) in enumerate(zip(starts, ends))]) if bias is not None else 0
        return out + rows
    if a.dim() == 3 and b.dim() == 2:
        return torch.cat([a[g] @ b[:, s:e] for g, (s, e) in enumerate(zip(starts, ends))], dim=1)
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


GROUPED_CASES = {
    # name -> (a shape, b shape, offs, bias shape)
    "3-D x 3-D": ((3, 5, 8), (3, 8, 6), None, None),
    "3-D x 3-D bias": ((3, 5, 8), (3, 8, 6), None, (3, 6)),
    "2-D x 3-D (MoE)": ((11, 8), (3, 8, 6), [4, 4, 11], None),
    "2-D x 3-D bias": ((11, 8), (3, 8, 6), [2, 7, 11], (3, 6)),
    "3-D x 2-D": ((3, 5, 8), (8, 10), [3, 7, 10], None),
    "2-D x 2-D (weight grad)": ((5, 12), (12, 6), [5, 5, 12], None),
}


def _grouped_operands(case: str, dtype: torch.dtype = torch.float32,
                      requires_grad: bool = False) -> tuple:
    shape_a, shape_b, offs, bias = GROUPED_CASES[case]
    a = randn(*shape_a, dtype=dtype, requires_grad=requires_grad)
    b = randn(*shape_b, dtype=dtype, requires_grad=requires_grad)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    bias = None if bias is None else randn(*bias, dtype=dtype, requires_grad=requires_grad)
    return a, b, offs, bias


@requires_tgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_mm_routed(case, dtype, highest_fp32):
    a, b, offs, bias = _grouped_operands(case, dtype)
    with tg.override() as ov, TgemmCalls() as launched:
        out = torch._grouped_mm(a, b, offs, bias=bias)
    assert ov.counts == routed_counts(grouped=1)
    assert launched.ops == {"grouped_mm": 1}
    assert out.dtype == dtype
    assert rel_err(out, _grouped_reference(a, b, offs, bias)) <= TOLERANCE[dtype]


@requires_tgemm
def test_grouped_mm_out_dtype_and_gradients(highest_fp32):
    a, b, offs, bias = _grouped_operands("2-D x 3-D bias", requires_grad=True)
    with tg.override() as ov:
        out = torch._grouped_mm(a, b, offs=offs, bias=bias, out_dtype=torch.float32)
    assert ov.counts == routed_counts(grouped=1)
    leaves = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    ref = _grouped_reference(leaves[0], leaves[1], offs, leaves[2])
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (a, b, bias), grad_out.float())
    for grad, want in zip(grads, torch.autograd.grad(ref, leaves, grad_out)):
        assert rel_err(grad, want) <= TOLERANCE[torch.float32]


@requires_tgemm
def test_grouped_mm_falls_through():
    a, b = randn(2, 16, 16), randn(2, 16, 16)
    cases = {  # what tgemm rejects; torch raises for float64 as well
        "float64": lambda: torch._grouped_mm(a.double(), b.double()),
        "meta": lambda: torch._grouped_mm(a.to("meta"), b.to("meta")),
    }
    for name, fn in cases.items():
        with tg.override(log=True) as ov, TgemmCalls() as launched:
            try:
                fn()
            except RuntimeError:
                pass
        assert ov.counts == routed_counts(fallback=1), name
        assert launched.n == 0, name
    with torch.autocast(a.device.type, dtype=torch.bfloat16), tg.override() as ov:
        out = torch._grouped_mm(a, b)
    assert ov.counts == routed_counts(fallback=1)
    assert torch.equal(out, torch._grouped_mm(a, b))


@requires_tgemm
def test_ops_selects_grouped():
    a, b = randn(2, 4, 8), randn(2, 8, 4)
    with tg.override(ops=("mm", "bmm")) as ov:
        torch._grouped_mm(a, b)
        a @ b
    assert ov.counts == routed_counts(bmm=1, fallback=1)


# --- torch._scaled_mm --------------------------------------------------------------------------

def _scaled_operands(recipe: str, m: int = 12, n: int = 16, k: int = 32) -> tuple:
    # N and K multiples of 16: calls that fall through reach cuBLAS's fp8 kernels on a GPU.
    x, w = randn(m, k), randn(n, k)
    xq, xs = tg.quantize(x, recipe, "a")
    wq, ws = tg.quantize(w.t(), recipe, "b")
    ref = tg.dequantize(xq, xs, recipe, "a") @ tg.dequantize(wq, ws, recipe, "b")
    return xq, wq, xs, ws, ref


@requires_tgemm
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_routed(recipe, out_dtype):
    xq, wq, xs, ws, ref = _scaled_operands(recipe)
    bias = randn(wq.shape[1], dtype=torch.bfloat16)
    with tg.override() as ov, TgemmCalls() as launched:
        out = torch._scaled_mm(xq, wq, xs, ws, bias, None, out_dtype, use_fast_accum=True)
        out_kw = torch._scaled_mm(xq, wq, scale_a=xs, scale_b=ws, out_dtype=out_dtype)
    assert ov.counts == routed_counts(scaled=2)
    assert launched.ops == {"scaled_mm": 2}
    assert out.dtype == out_kw.dtype == out_dtype
    assert rel_err(out, ref + bias.double()) <= 1e-2
    assert rel_err(out_kw, ref) <= 1e-2


@requires_tgemm
def test_scaled_mm_falls_through():
    xq, wq, xs, ws, _ = _scaled_operands("tensorwise")
    cases = {
        "out_dtype default (fp8 out)": lambda: torch._scaled_mm(xq, wq, xs, ws),
        "scale_result": lambda: torch._scaled_mm(xq, wq, xs, ws, scale_result=xs,
                                                 out_dtype=torch.bfloat16),
        "out_dtype float64": lambda: torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.float64),
        "scale requires grad": lambda: torch._scaled_mm(
            xq, wq, xs.clone().requires_grad_(), ws, out_dtype=torch.float32),
    }
    for name, fn in cases.items():
        try:
            plain, plain_error = fn(), None
        except RuntimeError as error:
            plain, plain_error = None, str(error)
        with tg.override() as ov, TgemmCalls() as launched:
            try:
                out, error = fn(), None
            except RuntimeError as raised:
                out, error = None, str(raised)
        assert ov.counts == routed_counts(fallback=1), name
        assert launched.n == 0, name
        assert error == plain_error, name
        if plain is not None:
            assert out.dtype == plain.dtype and torch.equal(out.float(), plain.float()), name


@requires_tgemm
def test_grouped_and_scaled_log_and_min_size(caplog):
    xq, wq, xs, ws, _ = _scaled_operands("tensorwise")  # M * N * K = 12 * 16 * 32
    # G * M * N * K = 512; bf16 with 16-byte rows, as torch's CUDA grouped GEMM needs.
    a, b = randn(2, 4, 8, dtype=torch.bfloat16), randn(2, 8, 8, dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="torch_triton_gemm.override"):
        with tg.override(log=True, min_size=513) as ov:
            torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.float32)
            torch._grouped_mm(a, b)
            torch._scaled_mm(xq, wq, xs, ws)
            with pytest.raises(RuntimeError):  # PyTorch rejects it too
                torch._grouped_mm(a, b, out_dtype=torch.float64)
    assert ov.counts == routed_counts(scaled=1, fallback=3)
    records = [r for r in caplog.records if r.name == "torch_triton_gemm.override"]
    messages = [(r.levelno, r.getMessage().split("stays with PyTorch: ")[1])
                for r in records if r.levelno == logging.INFO]
    assert messages[0] == (logging.INFO, "M * N * K is below min_size")
    assert messages[1][1].startswith("out_dtype is not given")
    assert messages[2][1].startswith("tgemm rejects the arguments: tgemm::grouped_mm: out_dtype")
    assert [r.getMessage().split(" -> ")[1] for r in records
            if r.levelno == logging.DEBUG] == ["tgemm::scaled_mm [scaled]"]


@requires_tgemm
def test_ops_selects_scaled():
    xq, wq, xs, ws, _ = _scaled_operands("tensorwise")
    with tg.override(ops=("grouped",)) as ov:
        torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.bfloat16)
    assert ov.counts == routed_counts(fallback=1)


# --- torch._scaled_grouped_mm --------------------------------------------------------------------

def _scaled_grouped_operands() -> tuple:
    """fp8 MoE operands with rowwise scales (x [T, K]; expert weights stored [G, N, K], passed
    transposed), an empty group, group sizes that are multiples of 16 (as torch's CUDA kernels
    need), and the float64 reference of the dequantized product."""
    e4m3 = torch.float8_e4m3fn
    x, w = randn(64, 32), randn(4, 16, 32)
    xs, ws = x.abs().amax(1) / 448, w.abs().amax(2) / 448
    xq, wq = (x / xs[:, None]).to(e4m3), (w / ws[..., None]).to(e4m3)
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32, device=DEVICE)
    x64, w64 = xq.double() * xs.double()[:, None], wq.double() * ws.double()[..., None]
    ref = torch.cat([x64[s:e] @ w64[g].t()
                     for g, (s, e) in enumerate(zip([0, 16, 16, 48], offs.tolist()))])
    return xq, wq.transpose(-2, -1), xs, ws, offs, ref


@requires_tgemm
def test_scaled_grouped_mm_routed():
    a, b, sa, sb, offs, ref = _scaled_grouped_operands()
    with tg.override() as ov, TgemmCalls() as launched:
        out = torch._scaled_grouped_mm(a, b, sa, sb, offs)
        out_kw = torch._scaled_grouped_mm(a, b, scale_a=sa, scale_b=sb, offs=offs,
                                          out_dtype=torch.bfloat16, use_fast_accum=True)
    assert ov.counts == routed_counts(scaled=2)
    assert launched.ops == {"scaled_grouped_mm": 2}
    assert out.dtype == out_kw.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2 and rel_err(out_kw, ref) <= 1e-2


@requires_tgemm
def test_scaled_grouped_mm_falls_through():
    """What tgemm declines reaches PyTorch, which runs it or raises as it does without the
    override (its kernels run on CUDA only)."""
    a, b, sa, sb, offs, _ = _scaled_grouped_operands()
    cases = {
        "scale_result": lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs, scale_result=sa),
        "offs int64": lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs.long()),
        "scale requires grad": lambda: torch._scaled_grouped_mm(
            a, b, sa.clone().requires_grad_(), sb, offs),
    }
    for name, fn in cases.items():
        try:
            plain, plain_error = fn(), None
        except (RuntimeError, ValueError) as error:
            plain, plain_error = None, str(error)
        with tg.override() as ov, TgemmCalls() as launched:
            try:
                out, error = fn(), None
            except (RuntimeError, ValueError) as raised:
                out, error = None, str(raised)
        assert ov.counts == routed_counts(fallback=1), name
        assert launched.n == 0, name
        assert error == plain_error, name
        if plain is not None:
            assert torch.equal(out, plain), name


# --- scope: exceptions, nesting, decorator, threads ----------------------------------------------

@requires_tgemm
def test_exception_in_body_restores():
    a, b = randn(8, 16), randn(16, 8)
    ov = tg.override()
    with pytest.raises(KeyError):
        with ov:
            a @ b
            raise KeyError("boom")
    assert torch._C._len_torch_function_stack() == 0
    a @ b
    assert ov.counts == routed_counts(mm=1)


@requires_tgemm
def test_nesting_inner_settings_win():
    linear = nn.Linear(16, 8, device=DEVICE)
    x = randn(4, 16)
    with tg.override() as outer:
        with tg.override(ops=("mm",)) as inner:
            linear(x)  # addmm: the inner override declines it, so the outer must not route it
            x @ linear.weight.t()
        assert inner.counts == routed_counts(mm=1, fallback=1)
        assert outer.counts == routed_counts()
        linear(x)
    assert outer.counts == routed_counts(addmm=1)

    with tg.override(min_size=10**9) as outer:
        with tg.override() as inner:
            linear(x)
        linear(x)
    assert inner.counts == routed_counts(addmm=1)
    assert outer.counts == routed_counts(fallback=1)


@requires_tgemm
def test_reentering_and_self_nesting():
    a, b = randn(8, 16), randn(16, 8)
    ov = tg.override()
    with ov:
        a @ b
    a @ b
    with ov:
        with ov:
            a @ b
        a @ b
    assert torch._C._len_torch_function_stack() == 0
    assert ov.counts == routed_counts(mm=3)


@requires_tgemm
def test_decorator():
    ov = tg.override(ops=("mm",))

    @ov
    def product(a: torch.Tensor, b: torch.Tensor, depth: int = 0) -> torch.Tensor:
        assert torch._C._len_torch_function_stack() == depth + 1
        return a @ b if depth == 1 else product(a, b, depth + 1)

    a, b = randn(8, 16), randn(16, 8)
    out = product(a, b)
    assert torch._C._len_torch_function_stack() == 0
    assert ov.counts == routed_counts(mm=1)
    assert torch.equal(out, tg.mm(a, b))
    product(a, b)
    assert ov.counts == routed_counts(mm=2)


@requires_tgemm
def test_override_is_per_thread():
    a, b = randn(8, 16), randn(16, 8)
    seen = {}

    def other_thread() -> None:
        seen["modes"] = torch._C._len_torch_function_stack()
        with TgemmCalls() as launched:
            seen["out"] = a @ b
        seen["launched"] = launched.n

    with tg.override() as ov:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert ov.counts == routed_counts()
        a @ b
    assert seen == {"modes": 0, "out": seen["out"], "launched": 0}
    assert ov.counts == routed_counts(mm=1)


@requires_tgemm
def test_counts_are_exact_with_threads():
    # One override object entered by several threads at once: counts must add up. Calls that
    # fall through (float64) are cheap, so each thread makes many; a tiny switch interval makes
    # the threads interleave inside the increments.
    ov = tg.override()
    a, b = randn(4, 8), randn(8, 4)
    a64, b64 = a.double(), b.double()
    threads, calls = 8, 300
    barrier = threading.Barrier(threads)
    # Triton's interpreter patches module globals during a launch, so CPU launches from several
    # threads would collide: routed calls take turns; the counting still races in the rest.
    launch_lock = threading.Lock()

    def work() -> None:
        with ov:
            barrier.wait()
            with launch_lock:
                a @ b
            for _ in range(calls):
                a64 @ b64

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ov.counts == routed_counts(mm=threads, fallback=threads * calls)


# --- torch.compile -----------------------------------------------------------------------------

@requires_tgemm
def test_compile_graph_follows_the_context(highest_fp32, fresh_dynamo):
    graphs: list[torch.fx.GraphModule] = []
    ran: list[int] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        index = len(graphs)
        graphs.append(gm)

        def run(*args):
            ran.append(index)
            return gm.forward(*args)

        return run

    linear = nn.Linear(24, 16, device=DEVICE)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return linear(x).relu() @ y

    compiled = torch.compile(fn, backend=recording_backend, fullgraph=True)
    x, y = randn(6, 24), randn(16, 8)
    expected = fn(x, y)

    with tg.override():
        inside = compiled(x, y)
    outside = compiled(x, y)
    with tg.override():
        inside_again = compiled(x, y)
    assert ran == [0, 1, 0], "the graph compiled inside the context must not run outside it"
    assert graphs[0].code.count("tgemm.mm") == 2
    assert "tgemm" not in graphs[1].code
    for out in (inside, outside, inside_again):
        assert rel_err(out, expected) <= TOLERANCE[torch.float32]

    # Other settings are other guards: only the linear (addmm) is routed now.
    with tg.override(ops=("addmm",)):
        compiled(x, y)
    assert ran[-1] == 2 and graphs[2].code.count("tgemm.mm") == 1


@requires_tgemm
def test_compiled_private_ops_stay_with_pytorch(fresh_dynamo):
    # Dynamo hands a TorchFunctionMode only the functions of get_overridable_functions(), which
    # leaves out private ones: compiled torch._grouped_mm keeps aten's kernel inside the context
    # (eager calls are routed). Should a PyTorch release list it, this test shows it.
    graphs: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm.code)
        return gm.forward

    a, b = randn(2, 16, 16, dtype=torch.bfloat16), randn(2, 16, 16, dtype=torch.bfloat16)
    compiled = torch.compile(torch._grouped_mm, backend=recording_backend, fullgraph=True)
    with tg.override():
        out = compiled(a, b)
    assert "tgemm" not in graphs[0] and "_grouped_mm" in graphs[0]
    assert rel_err(out, a.double() @ b.double()) <= TOLERANCE[torch.bfloat16]


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 32)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.up(x))
        return self.down(h) + (h @ h.transpose(1, 2)).mean()  # bmm: one grouped_mm


@requires_tgemm
def test_compile_aot_eager_forward_backward(highest_fp32, fresh_dynamo):
    model = _TwoLayers().to(DEVICE)
    x = randn(2, 5, 24, requires_grad=True)
    grad_out = torch.randn(2, 5, 16, device=DEVICE)

    def forward_backward(module: nn.Module) -> list[torch.Tensor]:
        out = module(x)
        return [out, *torch.autograd.grad(out, [x, *model.parameters()], grad_out)]

    expected = forward_backward(model)
    with tg.override():
        got = forward_backward(torch.compile(model, backend="aot_eager", fullgraph=True))
    for out, ref in zip(got, expected):
        assert rel_err(out, ref) <= TOLERANCE[torch.float32]


@requires_tgemm
def test_compile_backward_graph_uses_tgemm(fresh_dynamo):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: dict[str, str] = {}

    def recorder(kind: str) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs[kind] = gm.code
            return make_boxed_func(gm.forward)
        return compiler

    def tgemm_calls(code: str) -> int:
        # Under the interpreter tgemm::mm is an opaque op; with compiled Triton AOTAutograd traces
        # into it, and each launch appears as a functional Triton kernel wrapper.
        return (len(re.findall(r"tgemm\.(mm|grouped_mm)\b", code))
                + code.count("triton_kernel_wrapper_functional("))

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    model = _TwoLayers().to(DEVICE)
    x = randn(2, 5, 24, requires_grad=True)
    with tg.override():
        torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    assert tgemm_calls(graphs["forward"]) == 3
    assert tgemm_calls(graphs["backward"]) > 0
    for code in graphs.values():
        assert "aten.mm" not in code and "aten.addmm" not in code and "aten.bmm" not in code


# --- a Llama-style model from plain torch.nn ------------------------------------------------------

def _load_dropin_example():
    # The example's TinyLlama is the model under test, so the example is tested as well.
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dropin.py"
    spec = importlib.util.spec_from_file_location("dropin_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_tgemm
def test_llama_like_model_fp32(highest_fp32):
    dropin = _load_dropin_example()
    model = dropin.TinyLlama(vocab=64, hidden=32, heads=2, layers=1, intermediate=64,
                             max_seq=8).to(DEVICE)
    routed_model = copy.deepcopy(model)
    tokens = torch.randint(64, (2, 9), device=DEVICE)

    def loss_and_grads(module: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = module(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in module.named_parameters()}

    loss, grads = loss_and_grads(model)
    with tg.override() as ov, TgemmCalls() as launched:
        routed_loss, routed_grads = loss_and_grads(routed_model)

    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert ov.counts == routed_counts(mm=linears)
    assert launched.n == 3 * linears  # forward, then grad of input and of weight
    assert rel_err(routed_loss, loss) <= TOLERANCE[torch.float32]
    assert routed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert rel_err(routed_grads[name], grad) <= TOLERANCE[torch.float32], name


@requires_tgemm
@pytest.mark.parametrize("level", [None, "python", "aten"])
def test_dropin_example_runs(capsys, level):
    dropin = _load_dropin_example()
    tiny = ["--hidden", "32", "--heads", "2", "--layers", "1", "--vocab", "64", "--seq", "8",
            "--batch", "2", "--steps", "2", "--warmup", "0", "--dtype", "float32"]
    losses = dropin.main(tiny + ([] if level is None else ["--level", level]))
    assert len(losses["override"]) == 2
    for routed, plain in zip(losses["override"], losses["plain"]):
        assert abs(routed - plain) <= 1e-3 * abs(plain)
    out = capsys.readouterr().out
    assert f"override level {level or 'aten'}" in out  # eager steps default to the aten level
    counts = re.search(r"calls routed to tgemm::mm: (\{.*\})", out)
    assert counts is not None and ast.literal_eval(counts.group(1))["mm"] > 0


# --- GPU: a Hugging Face Llama, profiler and Inductor's code --------------------------------------

# Substrings of cuBLAS / cuBLASLt GEMM kernel names (Hopper's nvjet and sm90_xmma among them).
CUBLAS_MARKERS = ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")
# SDPA's flash / memory-efficient kernels are CUTLASS-based and named so; they are not GEMM calls.
ATTENTION_MARKERS = ("flash", "fmha", "attention")


def _cuda_kernels(fn: Callable[[], object]) -> set[str]:
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _cublas_gemms(kernels: set[str]) -> list[str]:
    return sorted(k for k in kernels
                  if any(m in k.lower() for m in CUBLAS_MARKERS)
                  and not any(m in k.lower() for m in ATTENTION_MARKERS))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_hf_llama_bf16_gpu(compiled, fresh_dynamo):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=512, vocab_size=1000, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    routed_model = copy.deepcopy(model)
    ids = torch.randint(config.vocab_size, (2, 64), device="cuda")

    def step(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        module(input_ids=ids, labels=ids).loss.backward()

    def results(module: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            loss = module(input_ids=ids, labels=ids).loss
        return loss, {n: p.grad for n, p in module.named_parameters()}

    plain_step = torch.compile(model) if compiled else model
    routed_step = torch.compile(routed_model) if compiled else routed_model
    step(plain_step)  # warm-up: compilation, cuBLAS handles
    plain_kernels = _cuda_kernels(lambda: step(plain_step))
    with tg.override():
        step(routed_step)  # warm-up: compilation, tgemm autotuning
        routed_kernels = _cuda_kernels(lambda: step(routed_step))
        routed_loss, routed_grads = results(routed_step)
    loss, grads = results(plain_step)

    assert _cublas_gemms(plain_kernels), f"no cuBLAS GEMM seen in the plain run: {plain_kernels}"
    assert not _cublas_gemms(routed_kernels), _cublas_gemms(routed_kernels)
    assert any(TGEMM_KERNEL.search(k) for k in routed_kernels)
    assert rel_err(routed_loss, loss) <= 2e-2
    for name, grad in grads.items():
        assert rel_err(routed_grads[name], grad) <= 2e-2, name


@pytest.mark.gpu
@requires_cuda
def test_inductor_code_uses_tgemm_gpu(fresh_dynamo):
    from torch._inductor.utils import run_and_get_code

    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256, bias=False))
    model = model.to("cuda", torch.bfloat16)
    compiled = torch.compile(model)
    x = randn(64, 256, dtype=torch.bfloat16, device="cuda")
    with tg.override():
        inside, inside_code = run_and_get_code(compiled, x)
    outside, outside_code = run_and_get_code(compiled, x)
    inside_code, outside_code = "\n".join(inside_code), "\n".join(outside_code)
    assert TGEMM_KERNEL.search(inside_code)
    assert "extern_kernels.mm" not in inside_code and "extern_kernels.addmm" not in inside_code
    assert not TGEMM_KERNEL.search(outside_code)
    assert "extern_kernels.mm" in outside_code or "extern_kernels.addmm" in outside_code
    assert rel_err(inside, outside) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_shaped_bmm_gpu(compiled, fresh_dynamo):
    # Attention scores and values: [B, H, T, D] @ [B, H, D, T], then @ [B, H, T, D].
    q, k, v = (randn(2, 8, 256, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-2, -1) / 8, dim=-1) @ v

    fn = torch.compile(attention, fullgraph=True) if compiled else attention
    with tg.override() as ov:
        fn(q, k, v)  # warm-up: compilation, tuning
        kernels = _cuda_kernels(lambda: fn(q, k, v))
        out = fn(q, k, v)
    assert not _cublas_gemms(kernels), _cublas_gemms(kernels)
    assert any(TGEMM_GROUPED_KERNEL.search(name) for name in kernels), kernels
    if not compiled:
        assert ov.counts["bmm"] == 6
    ref = attention(q.double(), k.double(), v.double())
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@requires_cuda
def test_grouped_and_scaled_routed_gpu():
    # Eager only: Dynamo sends just the functions of torch.overrides.get_overridable_functions()
    # to a TorchFunctionMode, and that list leaves out private ones such as torch._grouped_mm and
    # torch._scaled_mm, so compiled code keeps PyTorch's kernels for them.
    experts, tokens, hidden, inter = 4, 512, 256, 512
    x = randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = randn(experts, inter, hidden, dtype=torch.bfloat16, device="cuda") / 16
    offs = torch.tensor([100, 100, 300, 512], dtype=torch.int32, device="cuda")
    xq, xs = tg.quantize(randn(128, hidden, device="cuda"), "rowwise", "a")
    wq, ws = tg.quantize(randn(inter, hidden, device="cuda").t(), "rowwise", "b")

    def fn() -> tuple[torch.Tensor, torch.Tensor]:
        moe = torch._grouped_mm(x, w.transpose(-2, -1), offs)
        fp8 = torch._scaled_mm(xq, wq, xs, ws, out_dtype=torch.bfloat16)
        return moe, fp8

    plain = fn()
    with tg.override() as ov:
        routed = fn()  # warm-up: tuning
        kernels = _cuda_kernels(fn)
    assert ov.counts == routed_counts(grouped=2, scaled=2)
    assert not _cublas_gemms(kernels), _cublas_gemms(kernels)
    assert any(TGEMM_GROUPED_KERNEL.search(name) for name in kernels), kernels
    for out, ref in zip(routed, plain):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) <= 2e-2
