"""tgemm::mm: numerics, errors, gradients, opcheck, fake tensors and graph capture.

Every case is checked against a float64 reference. Without a GPU the kernels run on CPU tensors in
Triton's interpreter (see conftest.py); GPU-only tests carry the ``gpu`` marker.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import expecttest
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from samples import (
    FP8,
    LAYOUTS,
    make_operand,
    randn,
    reference,
    rel_error,
    sample_inputs,
    tolerance,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import plan_model, tuning
from torch_triton_gemm.ops import launcher, planner
from torch_triton_gemm.ops import mm as mm_module
from torch_triton_gemm.ops.launcher import launch_mm
from torch_triton_gemm.ops.planner import plan_mm

DTYPES = [torch.float16, torch.bfloat16, torch.float32, *FP8]
ACTIVATIONS = ["none", "relu", "gelu", "silu", "leaky_relu"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _expected_out_dtype(sample) -> torch.dtype:
    if sample.out_dtype is not None:
        return sample.out_dtype
    return torch.bfloat16 if sample.a.dtype in FP8 else sample.a.dtype


def _poisoned(shape: tuple[int, int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# --- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(device, dtype, highest_fp32):
    """Every layout x shape x epilogue sample, through the op and through a poisoned output."""
    for s in sample_inputs(device, dtype):
        out_dtype = _expected_out_dtype(s)
        ref = reference(s.a, s.b, s.bias, s.activation)
        out = tg.mm(*s.args())
        assert out.shape == ref.shape and out.dtype == out_dtype, s.name
        assert out.is_contiguous(), s.name
        err = rel_error(out, ref)
        assert err <= tolerance(out_dtype, dtype), f"{s.name}: rel err {err:.3e}"
        # tg.mm launches plain eager calls directly; the registered op must agree bitwise.
        assert torch.equal(torch.ops.tgemm.mm(*s.args()), out), s.name
        # The same launch into a NaN-filled buffer: every element must be written.
        poisoned = _poisoned(tuple(ref.shape), out_dtype, device)
        plan = plan_mm(s.a, s.b, s.bias, poisoned, s.activation, True)
        launch_mm(s.a, s.b, s.bias, poisoned, s.activation, True, plan)
        assert rel_error(poisoned, ref) <= tolerance(out_dtype, dtype), s.name


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_k_zero_gives_activation_of_bias(device, dtype, activation):
    bias = randn((24,), dtype, device)
    a = randn((9, 0), dtype, device)
    b = randn((0, 24), dtype, device)
    out = tg.mm(a, b, bias, activation)
    ref = reference(a, b, bias, activation)
    assert rel_error(out, ref) <= 1e-2
    assert torch.equal(tg.mm(a, b), torch.zeros(9, 24, dtype=dtype, device=device))


@pytest.mark.parametrize("shape", [(0, 8, 8), (8, 0, 8), (0, 0, 0)])
def test_empty_results(device, shape):
    m, n, k = shape
    out = tg.mm(randn((m, k), torch.float16, device), randn((k, n), torch.float16, device))
    assert out.shape == (m, n) and out.dtype == torch.float16


@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.float32, torch.bfloat16), (torch.float8_e4m3fn, torch.float16),
     (torch.float8_e5m2, torch.float32)],
    ids=str,
)
def test_out_dtype(device, dtype, out_dtype, highest_fp32):
    a = randn((33, 50), dtype, device)
    b = randn((50, 21), dtype, device)
    bias = randn((21,), torch.float32, device)
    out = tg.mm(a, b, bias, "silu", out_dtype)
    assert out.dtype == out_dtype
    assert rel_error(out, reference(a, b, bias, "silu")) <= tolerance(out_dtype, dtype)


def test_tf32_precision_setting(device):
    """fp32 inputs follow torch.get_float32_matmul_precision (tf32 unless 'highest')."""
    previous = torch.get_float32_matmul_precision()
    try:
        a, b = randn((40, 72), torch.float32, device), randn((72, 30), torch.float32, device)
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            err = rel_error(tg.mm(a, b), reference(a, b))
            assert err <= tolerance(torch.float32, torch.float32), (precision, err)
    finally:
        torch.set_float32_matmul_precision(previous)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(0, 80),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]),
    layout_a=st.sampled_from(LAYOUTS), layout_b=st.sampled_from(LAYOUTS),
    with_bias=st.booleans(), activation=st.sampled_from(ACTIVATIONS),
)
def test_property_random_problems(device, highest_fp32, m, n, k, dtype, layout_a, layout_b,
                                  with_bias, activation):
    a = make_operand(m, k, dtype, device, layout_a, "a")
    b = make_operand(k, n, dtype, device, layout_b, "b")
    bias = randn((n,), torch.float32, device) if with_bias else None
    out = tg.mm(a, b, bias, activation)
    out_dtype = torch.bfloat16 if dtype in FP8 else dtype
    # Each element against the size of its terms, |a| @ |b| + |bias|, rather than of its value:
    # random rows can cancel to a tiny sum (broadcast operands make every element that sum),
    # which any summation order gets right only to the terms' precision. The activations'
    # slopes stay below 1.2.
    ref = reference(a, b, bias, activation)
    terms = reference(a.double().abs(), b.double().abs(), None if bias is None else bias.abs())
    error = ((out.double() - ref).abs() / (1.2 * terms).clamp_min(1e-30)).max().item()
    assert error <= tolerance(out_dtype, dtype), error


def test_deterministic(device):
    a, b = randn((50, 90), torch.bfloat16, device), randn((90, 40), torch.bfloat16, device)
    assert torch.equal(tg.mm(a, b), tg.mm(a, b))


def test_eager_plans_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("TORCH_TRITON_GEMM_EAGER_PLANS", raising=False)
    assert tuning.eager_plans_enabled()
    monkeypatch.setenv("TORCH_TRITON_GEMM_EAGER_PLANS", "0")
    assert not tuning.eager_plans_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, moved", [
    (64, 120, 1160, "inline"), (1536, 1536, 1024, "inline"), (2944, 896, 109, "unpadded"),
    (64, 1472, 120, "twin"), (1280, 176, 216, "twin")])
def test_eager_plans_run_fewer_launches_with_the_bits_of_the_planners(monkeypatch, m, n, k,
                                                                       moved):
    """With eager plans on (the default), later eager calls of a product launch fewer kernels
    than the planner's plan, which the first call and a CUDA-graph capture launch: a portable
    K split (12 ways and its reduction; a tail split in three launches) in one kernel
    ("inline"), and a large product whose pitches TMA cannot describe, which the planner's
    portable plan reads from padded copies of both operands, on the operands as they are
    ("unpadded": with plan_model.PORTABLE_READS_AS_IS off, whose on-rule plans so for graphs
    too); and host-bound products whose pick is an unsplit TMA plan on the portable
    kernel with the same tile ("twin": no device-built descriptors). All give the same bits,
    right to bf16 precision. (The warp-specialized kernel's plans, which take 1536 x 1536 x
    1024 on Hopper, left out: they launch once.)"""
    monkeypatch.setenv("TORCH_TRITON_GEMM_EAGER_PLANS", "1")
    monkeypatch.setattr(plan_model, "WS_PLANS", False)
    a = randn((m, k), torch.bfloat16, "cuda")
    b = randn((n, k), torch.bfloat16, "cuda").t()
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    if moved == "unpadded" and not tgemm_device.supports_tma(a.device):
        pytest.skip("no TMA: the launcher pads no operands")
    if moved == "unpadded":
        as_is = planner.plan_mm(a, b, None, out, "none", False)
        assert as_is.kernel == "portable" and as_is.pad is False
        assert planner.eager_mm_plan(a, b, out, as_is) is None
        # The rule off for this test only: memos of its plans and launches left behind.
        monkeypatch.setattr(plan_model, "PORTABLE_READS_AS_IS", False)
        monkeypatch.setattr(planner, "_PLANS", {})
        monkeypatch.setattr(launcher, "_EAGER_LAUNCHES", {})
    plan = planner.plan_mm(a, b, None, out, "none", False)
    eager = planner.eager_mm_plan(a, b, out, plan)
    if moved == "inline":
        assert plan.split_k > 1 and eager == dataclasses.replace(plan, split_inline=True)
    elif moved == "twin":
        assert plan.kernel == "tma" and plan.split_k == 1
        assert eager == tuning.MMPlan("portable", plan.tile)
    else:
        assert plan.kernel == "portable" and plan.pad is None
        assert eager == dataclasses.replace(plan, pad=False)
    first = tg.mm(a, b)
    later = [tg.mm(a, b) for _ in range(3)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tg.mm(a, b)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got in (*later, captured):
        assert torch.equal(got, first)
    assert rel_error(first, reference(a, b, None, "none")) <= tolerance(torch.bfloat16,
                                                                         torch.bfloat16)


# --- errors -------------------------------------------------------------------------------------

def _bad_inputs(device: str):
    f16 = torch.float16
    a, b = randn((4, 8), f16, device), randn((8, 6), f16, device)
    return [
        ((randn((2, 4, 8), f16, device), b), RuntimeError,
         "tgemm::mm: a must be 2-D [M, K], got 3-D of shape (2, 4, 8)"),
        ((a, randn((8,), f16, device)), RuntimeError,
         "tgemm::mm: b must be 2-D [K, N], got 1-D of shape (8,)"),
        ((a, randn((7, 6), f16, device)), RuntimeError,
         "tgemm::mm: a has 8 columns but b has 7 rows (a is (4, 8), b is (7, 6))"),
        ((a, b.float()), ValueError,
         "tgemm::mm: a and b must have the same dtype, got a torch.float16 and b torch.float32"),
        ((a.double(), b.double()), ValueError, "tgemm::mm: a has dtype torch.float64; supported"),
        ((a.to(torch.int32), b.to(torch.int32)), ValueError, "a has dtype torch.int32"),
        ((a, b.to("meta")), RuntimeError, "tgemm::mm: a is on"),
        ((a, b, randn((5,), f16, device)), RuntimeError,
         "tgemm::mm: bias must be 1-D of size N=6 (b's columns), got shape (5,)"),
        ((a, b, randn((1, 6), f16, device)), RuntimeError, "bias must be 1-D of size N=6"),
        ((a, b, None, "tanh"), ValueError, "tgemm::mm: unknown activation 'tanh'"),
        ((a, b, None, "none", torch.int8), ValueError,
         "tgemm::mm: out_dtype torch.int8 is not supported"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_input_raises_before_launch(device, case, monkeypatch):
    args, error, message = _bad_inputs(device)[case]

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr("torch_triton_gemm.ops.mm.run_launch", no_launch)
    monkeypatch.setattr("torch_triton_gemm.ops.mm.run_kept", no_launch)
    with pytest.raises(error, match=_escape(message)):
        tg.mm(*args)


def _misplaced_arguments(device: str) -> list[tuple[str, object, type[Exception], str]]:
    """(name, call, error, message) of calls with an argument that is not a dense tensor, for
    every public op and its registered op."""
    half = torch.float16
    a = torch.randn(8, 8, device=device, dtype=half)
    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
    w3 = torch.randn(2, 8, 8, device=device, dtype=half)
    a8 = a.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    ids = torch.zeros(8, 1, device=device, dtype=torch.long)
    weights = torch.ones(8, 1, device=device, dtype=half)
    sparse = a.to_sparse()
    return [
        ("mm b None", lambda: tg.mm(a, None), TypeError, "tgemm::mm: b must be a tensor, got "
         "NoneType"),
        ("mm a None", lambda: tg.mm(None, a), TypeError, "tgemm::mm: a must be a tensor"),
        ("mm bias str", lambda: tg.mm(a, a, "x"), TypeError, "bias must be a tensor, got str"),
        ("op mm b None", lambda: torch.ops.tgemm.mm(a, None), TypeError,
         "tgemm::mm: b must be a tensor"),
        ("mm sparse", lambda: tg.mm(sparse, a), RuntimeError,
         "tgemm::mm: a must be a dense (strided) tensor, got torch.sparse_coo"),
        ("grouped b None", lambda: tg.grouped_mm(a, None, offs), TypeError,
         "tgemm::grouped_mm: b must be a tensor"),
        ("grouped sparse", lambda: tg.grouped_mm(sparse, w3, offs), RuntimeError,
         "tgemm::grouped_mm: a must be a dense (strided) tensor"),
        ("scaled b None", lambda: tg.scaled_mm(a8, None, one, one), TypeError,
         "tgemm::scaled_mm: b must be a tensor"),
        ("scaled scale_b None", lambda: tg.scaled_mm(a8, a8.t(), one, None), TypeError,
         "tgemm::scaled_mm: scale_b must be a tensor"),
        ("scaled grouped b None", lambda: tg.scaled_grouped_mm(
            a8, None, torch.ones(8, device=device), torch.ones(2, 8, device=device), offs),
         TypeError, "tgemm::scaled_grouped_mm: b must be a tensor"),
        ("moe w13 None", lambda: tg.moe_mlp(a, None, w3, ids, weights), TypeError,
         "tgemm::moe_mlp: w13 must be a tensor"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_misplaced_arguments_are_named(device, case):
    """None, a non-tensor or a sparse tensor where an op takes a dense tensor: an error naming
    the op and the argument (the eager paths read sizes and pointers before the checks)."""
    name, call, error, message = _misplaced_arguments(device)[case]
    with pytest.raises(error, match=_escape(message)):
        call()


def _escape(message: str) -> str:
    import re

    return re.escape(message)


def test_fp8_inputs_refuse_autograd(device):
    a = randn((8, 16), torch.float32, device).to(torch.float8_e4m3fn).requires_grad_()
    b = randn((16, 8), torch.float8_e4m3fn, device)
    with pytest.raises(RuntimeError, match="have no gradient"):
        tg.mm(a, b)


def test_cpu_tensors_without_interpreter_explain_what_to_do():
    script = textwrap.dedent("""
        import torch, torch_triton_gemm as tg
        try:
            tg.mm(torch.randn(4, 4), torch.randn(4, 4))
        except RuntimeError as e:
            print("ERROR:", e)
    """)
    out = _run_without_interpreter(script)
    assert "ERROR: tgemm::mm: CPU tensors run only in Triton's interpreter: set " \
           "TRITON_INTERPRET=1" in out


def _run_without_interpreter(script: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    # The repository and its tests (for helpers such as hopper_compile.py).
    env["PYTHONPATH"] = os.pathsep.join((REPO, os.path.join(REPO, "tests"),
                                         env.get("PYTHONPATH", "")))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


_WS_COMPILE_SCRIPT = """
import re
from hopper_compile import compile_for
from torch_triton_gemm import tuning
from torch_triton_gemm.kernels.wgmma_fp8 import CONSUMER_REGS, ws_gemm_kernel

for pingpong, split, tile, dtype, out in (
        (False, False, tuning.WS_TILES[0], "*bf16", "*bf16"),
        (False, False, tuning.WS_TILES[-1], "*fp16", "*fp16"),
        (True, False, tuning.WS_PINGPONG_TILES[0], "*bf16", "*bf16"),
        (False, True, tuning.WS_SPLIT_TILES[0], "*bf16", "*bf16")):
    consumers = 2 if pingpong else tile.block_m // 64
    constants = dict(HAS_BIAS=not split, BLOCKWISE=False, A_ROWS=1, CONSUMERS=consumers,
                     BLOCK_N=tile.block_n, GROUP_M=tile.group_m,
                     STAGES=tile.num_stages, CONSUMER_REGS=CONSUMER_REGS[consumers],
                     PINGPONG=pingpong, SPLIT=split, locks_ptr=None, sa_ptr=None, sb_ptr=None)
    pointers = {"a_ptr": dtype, "b_ptr": dtype, "c_ptr": out, "bias_ptr": dtype,
                "ws_ptr": "*fp32"}
    aligned = ["a_ptr", "b_ptr", "c_ptr", "ws_ptr", "stride_am", "stride_bn", "stride_cm"]
    kernel = compile_for(ws_gemm_kernel, pointers, constants, aligned, num_warps=4)
    ptx = kernel.asm["ptx"]
    shapes = sorted(set(re.findall(r"wgmma.mma_async.sync.aligned.(m64n\\d+k16)", ptx)))
    waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned\\s+(\\d+)", ptx)))
    print(consumers, shapes, len(re.findall(r"wgmma.mma_async", ptx)), waits,
          "setmaxnreg" in ptx, "cp.async.bulk.tensor" in ptx,
          kernel.metadata.shared <= tuning.ws_shared_bytes(tile, 2),
          len(re.findall(r"st.global.v2.b32", ptx)))
"""


def test_warp_specialized_16_bit_kernel_compiles_for_hopper():
    """Without a GPU, Triton compiles the warp-specialized kernel's 16-bit plans for sm_90
    (the widest and the three-consumer tile, a ping-pong one, and a one-consumer K split, which
    stores its fp32 partial in pairs of columns): per consumer one K step of
    four k16 wgmmas of the tile's width (ping-pong: two 64-row halves, eight), waits that leave
    one wgmma (ping-pong: one pair) in flight (1, 2) and drain them (0), register
    reallocation between the partitions, TMA copies, and the shared memory that
    tuning.ws_shared_bytes counts."""
    if torch.cuda.is_available():
        pytest.skip("compiles for a fixed GPU target on a GPU-less host; the GPU tests run it")
    out = _run_without_interpreter(_WS_COMPILE_SCRIPT).split("\n")
    assert out[:4] == ["2 ['m64n256k16'] 8 ['0', '1'] True True True 0",
                       "3 ['m64n128k16'] 12 ['0', '1'] True True True 0",
                       "2 ['m64n128k16'] 16 ['0', '2'] True True True 0",
                       "1 ['m64n128k16'] 4 ['0', '1'] True True True 32"], out


# --- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_float64_autograd(device, dtype, activation, highest_fp32):
    a = make_operand(23, 37, dtype, device, "row", "a").requires_grad_()
    b = make_operand(37, 29, dtype, device, "col", "b").detach().requires_grad_()
    bias = randn((29,), dtype, device).requires_grad_()
    out = tg.mm(a, b, bias, activation)
    grad_out = randn(tuple(out.shape), dtype, device)
    grads = torch.autograd.grad(out, (a, b, bias), grad_out)

    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref = reference(a64, b64, bias64, activation)
    ref_grads = torch.autograd.grad(ref, (a64, b64, bias64), grad_out.double())
    for name, g, r, t in zip("a b bias".split(), grads, ref_grads, (a, b, bias)):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        err = rel_error(g, r)
        assert err <= tolerance(dtype, dtype) * 2, f"grad {name}: rel err {err:.3e}"
    # The registered op's autograd formula (what torch.compile sees) gives the same gradients.
    op_out = torch.ops.tgemm.mm(a, b, bias, activation, None)
    op_grads = torch.autograd.grad(op_out, (a, b, bias), grad_out)
    assert torch.equal(op_out, out)
    for g, op_g in zip(grads, op_grads):
        assert torch.equal(g, op_g)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 on purpose: the op has no fp64
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_fp32(device, activation, highest_fp32):
    eps = 1e-2
    for _ in range(50):
        a = randn((4, 5), torch.float32, device)
        b = randn((5, 3), torch.float32, device)
        bias = randn((3,), torch.float32, device)
        # Finite differences across relu's kink are wrong by construction: keep every
        # pre-activation further than the perturbation can move it.
        if (a.double() @ b.double() + bias.double()).abs().min() > 10 * eps:
            break
    a, b, bias = (t.requires_grad_() for t in (a, b, bias))
    assert torch.autograd.gradcheck(
        lambda a, b, bias: tg.mm(a, b, bias, activation), (a, b, bias),
        eps=eps, atol=5e-3, rtol=5e-3, nondet_tol=0.0)


def test_gradients_keep_the_operands_layout(device, highest_fp32):
    # nn.Linear passes its weight W [N, K] as W.t(): W.grad must come out contiguous, as aten's
    # formulas make it, or autograd copies every weight gradient to fix its layout.
    w = torch.randn(24, 40, device=device, requires_grad=True)
    x_storage = torch.randn(40, 10, device=device)
    x = x_storage.t().requires_grad_()  # a column-major leaf [10, 40]
    grad_out = torch.randn(10, 24, device=device)
    tg.mm(x, w.t()).backward(grad_out)
    assert w.grad.is_contiguous() and x.grad.stride() == x.stride()
    ref_x, ref_w = grad_out.double() @ w.double(), grad_out.double().t() @ x.double()
    assert rel_error(x.grad, ref_x) <= 1e-5 and rel_error(w.grad, ref_w) <= 1e-5


def test_bias_alignment_changes_between_calls(device):
    # Eager launches reuse the kernel compiled for a call signature; a bias that moves off a
    # 16-byte boundary must get a kernel compiled for it, not the aligned one.
    a, b = torch.randn(32, 64, device=device), torch.randn(64, 48, device=device)
    storage = torch.randn(49, device=device)
    for bias in (storage[:48], storage[1:], storage[:48]):
        ref = a.double() @ b.double() + bias.double()
        assert rel_error(tg.mm(a, b, bias), ref) <= 1e-2  # tf32 on a GPU


def test_only_needed_gradients(device):
    a = randn((6, 10), torch.float16, device).requires_grad_()
    b = randn((10, 4), torch.float16, device)
    out = tg.mm(a, b, None, "relu")
    (grad_a,) = torch.autograd.grad(out.sum(), (a,))
    assert grad_a.shape == a.shape and b.grad is None


class _PassThrough(TorchDispatchMode):
    """Runs every op unchanged; its presence sends tgemm::mm through PyTorch's generic
    custom-op autograd kernel instead of the eager kernels."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_op_eager_autograd_matches_generic_kernel(device, activation):
    """Eager torch.ops.tgemm.mm (its light autograd kernel) and the generic custom-op autograd
    kernel give bitwise equal outputs and gradients, for every subset of inputs needing them."""
    a0 = randn((19, 24), torch.bfloat16, device)
    b0 = make_operand(24, 13, torch.bfloat16, device, "col", "b")
    bias0 = randn((13,), torch.bfloat16, device)
    grad_out = randn((19, 13), torch.bfloat16, device)
    for wanted in ("a", "b", "bias", "a b bias"):
        results = []
        for mode in (None, _PassThrough):
            a, b, bias = (t.detach().requires_grad_(name in wanted.split())
                          for name, t in (("a", a0), ("b", b0), ("bias", bias0)))
            if mode is None:
                out = torch.ops.tgemm.mm(a, b, bias, activation, None)
            else:
                with mode():
                    out = torch.ops.tgemm.mm(a, b, bias, activation, None)
            inputs = [t for t in (a, b, bias) if t.requires_grad]
            results.append((out, torch.autograd.grad(out, inputs, grad_out)))
        (out, grads), (generic_out, generic_grads) = results
        assert type(out.grad_fn) is not type(generic_out.grad_fn)  # two different paths
        assert torch.equal(out, generic_out), wanted
        for g, generic_g in zip(grads, generic_grads, strict=True):
            assert torch.equal(g, generic_g), wanted


def test_op_without_autograd(device):
    a, b = randn((9, 16), torch.float16, device), randn((16, 7), torch.float16, device)
    expected = tg.mm(a, b, None, "silu")
    a.requires_grad_()
    with torch.no_grad():
        out = torch.ops.tgemm.mm(a, b, None, "silu", None)
    assert out.grad_fn is None and torch.equal(out, expected)
    with torch.inference_mode():
        out = torch.ops.tgemm.mm(a, b, None, "silu", None)
    assert out.is_inference() and torch.equal(out, expected)


# --- opcheck, fake tensors, graph capture ------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    samples = sample_inputs(device, torch.float16, requires_grad=requires_grad)
    chosen = [s for s in samples if s.name in ("nt-37x45x70", "sliced-5x7x3", "col-16x16x0",
                                                "bias-gelu", "bias-relu")]
    for s in chosen:
        torch.library.opcheck(torch.ops.tgemm.mm.default, s.args())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_tensor_propagation_cuda(dtype):
    with FakeTensorMode():
        a = torch.empty(70, 33, device="cuda", dtype=dtype)
        w = torch.empty(45, 33, device="cuda", dtype=dtype)
        bias = torch.empty(45, device="cuda", dtype=torch.float32)
        out = tg.mm(a, w.t(), bias, "gelu")
        assert out.shape == (70, 45) and out.stride() == (45, 1)
        assert out.device.type == "cuda"
        assert out.dtype == (torch.bfloat16 if dtype in FP8 else dtype)
        out = tg.mm(a.t(), torch.empty(70, 8, device="cuda", dtype=dtype), out_dtype=torch.float32)
        assert out.shape == (33, 8) and out.dtype == torch.float32
        with pytest.raises(RuntimeError, match="a has 33 columns but b has 32 rows"):
            tg.mm(a, torch.empty(32, 8, device="cuda", dtype=dtype))


def _linear_gelu(a, w, bias):
    return torch.relu(tg.mm(a, w.t(), bias, "gelu")) * 2


class TestGraphCapture(expecttest.TestCase):
    def test_make_fx_keeps_the_op(self):
        """make_fx keeps tgemm::mm as one node: from CUDA FakeTensors and, where kernels run on
        this machine's CPU (the interpreter), with symbolic shapes."""
        with FakeTensorMode():
            a = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
            w = torch.empty(48, 32, device="cuda", dtype=torch.bfloat16)
            bias = torch.empty(48, device="cuda", dtype=torch.bfloat16)
        traces = [make_fx(_linear_gelu, tracing_mode="fake")(a, w, bias)]
        if tgemm_device.interpreter_enabled():
            traces.append(make_fx(_linear_gelu, tracing_mode="symbolic")(
                torch.randn(12, 8), torch.randn(6, 8), torch.randn(6)))
        for gm in traces:
            self.assertExpectedInline(gm.code.strip(), """\
def forward(self, a_1, w_1, bias_1):
    t = torch.ops.aten.t.default(w_1);  w_1 = None
    mm = torch.ops.tgemm.mm.default(a_1, t, bias_1, 'gelu');  a_1 = t = bias_1 = None
    relu = torch.ops.aten.relu.default(mm);  mm = None
    mul = torch.ops.aten.mul.Tensor(relu, 2);  relu = None
    return mul""")

    def test_functional_trace_exposes_the_kernel(self):
        """Without the interpreter, AOT-style functional tracing sees the Triton kernel itself
        (what Inductor compiles), traced here on CUDA FakeTensors with no GPU."""
        script = textwrap.dedent("""
            import torch, torch_triton_gemm as tg
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch._subclasses.functional_tensor import dispatch_functionalize
            from torch.fx.experimental.proxy_tensor import make_fx
            def f(a, w, bias):
                return torch.relu(tg.mm(a, w.t(), bias, "gelu")) * 2
            with FakeTensorMode():
                a = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
                w = torch.empty(48, 32, device="cuda", dtype=torch.bfloat16)
                bias = torch.empty(48, device="cuda", dtype=torch.bfloat16)
            gm = make_fx(dispatch_functionalize(f), tracing_mode="fake")(a, w, bias)
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    name = getattr(node.target, "__name__", str(node.target))
                    extra = ""
                    if "triton_kernel" in name:
                        kw = node.kwargs["kwargs"]
                        extra = f" ACTIVATION={kw['ACTIVATION']} HAS_BIAS={kw['HAS_BIAS']}"
                    print(name + extra)
        """)
        if torch.cuda.is_available():
            self.skipTest("runs the GPU-less tracing path; covered by the GPU tests on a GPU")
        out = _run_without_interpreter(script)
        self.assertExpectedInline(out.strip(), """\
t.default
new_empty.default
triton_kernel_wrapper_functional ACTIVATION=gelu HAS_BIAS=True
getitem
getitem
getitem
getitem
t.default
t.default
relu.default
mul.Tensor""")


def test_eager_op_matches_traceable_body(device, highest_fp32):
    """Eager calls of the op run its eager body (a direct launch); the traceable body that
    make_fx and torch.compile see launches through wrap_triton. Both compute the same bits."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for s in sample_inputs(device, dtype)[::3]:
            eager = torch.ops.tgemm.mm(*s.args())
            traced_body = mm_module._mm_impl(*s.args())
            assert torch.equal(eager, traced_body), s.name


def test_op_traces_without_interpreter():
    """With compiled Triton (no interpreter) the op is a triton_op with eager kernels on the CPU
    and CUDA keys: FakeTensor and make_fx still see one tgemm::mm node, and a real call reaches
    the eager body (which explains that CPU tensors need the interpreter)."""
    script = textwrap.dedent("""
        import torch, torch_triton_gemm as tg
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        for key in ("CUDA", "AutogradCUDA", "CPU", "AutogradCPU"):
            print(key, torch._C._dispatch_has_kernel_for_dispatch_key("tgemm::mm", key))
        def f(a, w, bias):
            return torch.ops.tgemm.mm(a, w.t(), bias, "relu", None) + 1
        with FakeTensorMode():
            a = torch.empty(64, 32, device="cuda", dtype=torch.float16)
            w = torch.empty(48, 32, device="cuda", dtype=torch.float16)
            bias = torch.empty(48, device="cuda", dtype=torch.float16)
            out = f(a, w, bias)
            print("fake", tuple(out.shape), out.dtype, out.device.type)
        gm = make_fx(f, tracing_mode="fake")(a, w, bias)
        print("make_fx", [str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        try:
            torch.ops.tgemm.mm(torch.randn(4, 4), torch.randn(4, 4))
        except RuntimeError as e:
            print("ERROR:", str(e).split(": set ")[0])
    """)
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; covered by the GPU tests on a GPU")
    out = _run_without_interpreter(script)
    ops = "['aten.t.default', 'tgemm.mm.default', 'aten.add.Tensor']"
    assert out.splitlines() == [
        "CUDA True", "AutogradCUDA True", "CPU True", "AutogradCPU True",
        "fake (64, 48) torch.float16 cuda", f"make_fx {ops}",
        "ERROR: tgemm::mm: CPU tensors run only in Triton's interpreter",
    ], out


def test_eager_backend_compile(device):
    """torch.compile with an eager backend keeps tgemm::mm in the graph (CPU-runnable check)."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    a = randn((17, 24), torch.float32, device)
    w = randn((10, 24), torch.float32, device)
    bias = randn((10,), torch.float32, device)
    compiled = torch.compile(_linear_gelu, backend=record, fullgraph=True)
    out = compiled(a, w, bias)
    assert "tgemm.mm" in graphs[0].code
    torch.testing.assert_close(out, _linear_gelu(a, w, bias))


# --- GPU only -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_inductor_fullgraph_forward_backward(dtype, highest_fp32):
    def f(x, w, bias):
        y = tg.mm(x, w.t(), bias, "silu")
        return (torch.sigmoid(y) * 3 + y).sum(dim=1)

    x = randn((257, 192), dtype, "cuda").requires_grad_()
    w = randn((129, 192), dtype, "cuda").requires_grad_()
    bias = randn((129,), dtype, "cuda").requires_grad_()
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x, w, bias)
    grads = torch.autograd.grad(out.sum(), (x, w, bias))

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    y = reference(x64, w64.t(), b64, "silu")
    ref = (torch.sigmoid(y) * 3 + y).sum(dim=1)
    ref_grads = torch.autograd.grad(ref.sum(), (x64, w64, b64))
    assert rel_error(out, ref) <= tolerance(dtype, dtype)
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) <= 2 * tolerance(dtype, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_aot_eager_compile_matches_eager_op_bitwise(dtype):
    """aot_eager runs the traced body (the kernel through triton_kernel_wrapper_functional);
    eager calls run the eager body. Same kernel, same plan: the same bits, gradients included."""
    def f(x, w, bias):
        return torch.ops.tgemm.mm(x, w.t(), bias, "gelu", None)

    x = randn((96, 160), dtype, "cuda").requires_grad_()
    w = randn((72, 160), dtype, "cuda").requires_grad_()
    bias = randn((72,), dtype, "cuda").requires_grad_()
    grad_out = randn((96, 72), dtype, "cuda")
    eager = f(x, w, bias)
    eager_grads = torch.autograd.grad(eager, (x, w, bias), grad_out)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=False)(x, w, bias)
    compiled_grads = torch.autograd.grad(compiled, (x, w, bias), grad_out)
    assert torch.equal(eager, compiled)
    for g, c in zip(eager_grads, compiled_grads, strict=True):
        assert torch.equal(g, c)


def _replayed_graph_error(a: torch.Tensor, w: torch.Tensor) -> float:
    """tg.mm(a, w.t()) captured in a CUDA graph and replayed after new values are copied into
    ``a`` (in place): the replay's error against float64 on those values."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.mm(a, w.t())
    a.copy_(randn(tuple(a.shape), a.dtype, "cuda"))
    graph.replay()
    return rel_error(out, reference(a, w.t()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_decode_products_run_transposed(dtype, monkeypatch):
    """Where the planner runs a 16-bit product of few rows transposed (tuning.swap_plan): eager
    (first and memoised call), with an activation, torch.compile, a CUDA graph replayed with new
    tokens and the backward's products, against float64; with a bias it is not transposed."""
    # 96 tiles of 64 weight rows (one wave); 65 tiles, the last ragged, 32-wide, a K tail;
    # 448 tiles (3.4 waves: transposed on every GPU here, not only where the bandwidth per SM
    # takes them, so that their tiles run on any GPU); K under 2048 in 64-deep steps with a
    # K tail (96 and 64 tiles) and 128-deep ones with a tail (48 tiles).
    monkeypatch.setattr(tuning, "SWAP_MULTI_WAVE_MIN_GBPS_PER_SM", 0.0)
    for m, n, k in ((2, 6144, 4096), (24, 4112, 2064), (8, 28672, 4096), (16, 6144, 1008),
                    (20, 4096, 784), (8, 3072, 1296)):
        x = randn((m, k), dtype, "cuda").requires_grad_()
        w = randn((n, k), dtype, "cuda").requires_grad_()
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        assert plan_mm(x.detach(), w.detach().t(), None, out, "none", False).swap_ab, (m, n, k)
        bound = tolerance(dtype, dtype)
        for _ in range(2):  # the second call runs the memoised launch
            assert rel_error(tg.mm(x.detach(), w.detach().t()),
                             reference(x.detach(), w.detach().t())) <= bound
        y = tg.mm(x, w.t(), None, "silu")
        assert rel_error(y, reference(x.detach(), w.detach().t(), None, "silu")) <= bound
        grad = randn((m, n), dtype, "cuda")
        y.backward(grad)
        x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
        reference(x64, w64.t(), None, "silu").backward(grad.double())
        assert rel_error(x.grad, x64.grad) <= 2 * bound and rel_error(w.grad, w64.grad) <= 2 * bound
        xs, ws = x.detach(), w.detach()
        compiled = torch.compile(lambda x, w: tg.mm(x, w.t()) * 2, fullgraph=True)
        assert rel_error(compiled(xs, ws), 2 * reference(xs, ws.t())) <= bound
        assert _replayed_graph_error(xs, ws) <= bound
        bias = randn((n,), dtype, "cuda")
        assert not plan_mm(xs, ws.t(), bias, out, "none", False).swap_ab
        assert rel_error(tg.mm(xs, ws.t(), bias), reference(xs, ws.t(), bias)) <= bound


def _on_hopper_with_gluon() -> bool:
    from torch_triton_gemm.kernels import wgmma_fp8

    return wgmma_fp8.AVAILABLE and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_warp_specialized_plans_against_float64(dtype):
    """Every 16-bit plan of Hopper's warp-specialized kernel (tuning.ws_plans), on products
    with ragged M, N and K edges, with and without a bias, into NaN-poisoned outputs (bf16, and
    fp32 where its tile fits): every element written, within the dtype's tolerance of float64,
    the same bits again, through tg.mm under the forced plan and replayed in a CUDA graph with
    new operands. The planner says the kernel runs such operands (ws_applies), not a
    column-major a nor a pitch of 8 bytes, on which the forced plan explains itself."""
    if not _on_hopper_with_gluon():
        pytest.skip("the warp-specialized kernel runs on sm_90 GPUs with a Triton that has Gluon")
    bound = tolerance(dtype, dtype)
    # (2200 x 2112: more output tiles than twice the SMs, so the ping-pong consumers alternate)
    for m, n, k in ((1000, 1000, 1000), (385, 520, 136), (3072, 200, 72), (2200, 2112, 200)):
        a = randn((m, k), dtype, "cuda")
        w = randn((n, k), dtype, "cuda")
        bias = randn((n,), dtype, "cuda")
        assert planner.ws_applies(a, w.t(), torch.empty(m, n, device="cuda", dtype=dtype))
        for out_dtype in (dtype, torch.float32):
            for plan in tuning.ws_plans(torch.tensor([], dtype=out_dtype).element_size()):
                for b in (None, bias):
                    out = _poisoned((m, n), out_dtype, "cuda")
                    launch_mm(a, w.t(), b, out, "none", False, plan)
                    ref = reference(a, w.t(), b)
                    assert rel_error(out, ref) <= bound, (m, n, k, plan.tile, out_dtype)
                    again = _poisoned((m, n), out_dtype, "cuda")
                    launch_mm(a, w.t(), b, again, "none", False, plan)
                    assert torch.equal(out, again)
        plan = tuning.ws_plans(2)[-1]
        with tuning.force_plan(plan):
            assert rel_error(tg.mm(a, w.t(), bias), reference(a, w.t(), bias)) <= bound
            assert _replayed_graph_error(a.clone(), w) <= bound
    # K = 260 on 528-byte pitches (16-byte aligned), then a column-major a and a 524-byte one.
    a = randn((256, 264), dtype, "cuda")[:, :260]
    w = randn((192, 264), dtype, "cuda")[:, :260]
    out = torch.empty(256, 192, device="cuda", dtype=dtype)
    assert planner.ws_applies(a, w.t(), out)
    assert not planner.ws_applies(a.t().contiguous().t(), w.t(), out)
    odd = randn((256, 262), dtype, "cuda")[:, :260]  # a 524-byte pitch: not
    assert not planner.ws_applies(odd, w.t(), out)
    with pytest.raises(RuntimeError, match="16-byte aligned pitches"):
        launch_mm(odd, w.t(), None, out, "none", False, tuning.ws_plans(2)[0])


def a_gpu() -> torch.device:
    return torch.device("cuda")


def _split_plans_to_test(m: int, n: int, k: int, out_size: int) -> list[tuning.MMPlan]:
    """Of each tile of ``tuning.ws_split_plans``, its fewest and most K splits (and the
    64-row tiles unsplit)."""
    plans = tuning.ws_split_plans(m, n, k, 2, out_size, tgemm_device.num_sms(a_gpu()))
    kept = []
    for tile in dict.fromkeys(p.tile for p in plans):
        splits = sorted(p.split_k for p in plans if p.tile == tile)
        kept += [tuning.MMPlan(tuning.WS_KERNEL, tile, s) for s in dict.fromkeys(
            (splits[0], splits[-1]) if splits[0] > 1 else (1, splits[1], splits[-1])
            if len(splits) > 1 else (1,))]
    return kept


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_warp_specialized_k_splits_against_float64(dtype):
    """The warp-specialized kernel's K splits (tuning.ws_split_plans; 64-row tiles unsplit
    too) on products of few rows with ragged M, N and K edges, with and without a bias, into
    NaN-poisoned outputs (the dtype, and fp32): every element written, within the dtype's
    tolerance of float64, the same bits again; tg.mm under a forced split plan and replayed in
    a CUDA graph with new operands."""
    if not _on_hopper_with_gluon():
        pytest.skip("the warp-specialized kernel runs on sm_90 GPUs with a Triton that has Gluon")
    bound = tolerance(dtype, dtype)
    for m, n, k in ((16, 1000, 4104), (64, 2056, 2000), (130, 520, 1032)):
        a = randn((m, k), dtype, "cuda")
        w = randn((n, k), dtype, "cuda")
        bias = randn((n,), dtype, "cuda")
        ref = {b is None: reference(a, w.t(), b) for b in (None, bias)}
        for out_dtype in (dtype, torch.float32):
            plans = _split_plans_to_test(m, n, k, out_dtype.itemsize)
            assert any(p.split_k > 2 for p in plans), (m, n, k)
            for plan in plans:
                for b in (None, bias):
                    out = _poisoned((m, n), out_dtype, "cuda")
                    launch_mm(a, w.t(), b, out, "none", False, plan)
                    assert rel_error(out, ref[b is None]) <= bound, (m, n, k, plan, out_dtype)
                    again = _poisoned((m, n), out_dtype, "cuda")
                    launch_mm(a, w.t(), b, again, "none", False, plan)
                    assert torch.equal(out, again), (m, n, k, plan)
        plan = max(_split_plans_to_test(m, n, k, 2), key=lambda p: p.split_k)
        with tuning.force_plan(plan):
            assert rel_error(tg.mm(a, w.t(), bias), ref[False]) <= bound
            assert _replayed_graph_error(a.clone(), w) <= bound


@pytest.mark.gpu
def test_gpu_tuning_times_warp_specialized_plans(monkeypatch):
    """Autotuning times the warp-specialized kernel's plans too where it runs the product, each
    giving the product; a tuned plan of it serves eager calls without activation, while traced
    calls and activations keep the Triton kernels' plans."""
    if not _on_hopper_with_gluon():
        pytest.skip("the warp-specialized kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm import plan_cache, tune

    monkeypatch.setattr(plan_cache.TUNED, "put", lambda *args: None)  # the user's table stays
    monkeypatch.setattr(planner, "_PLANS", {})
    a = randn((1536, 1536), torch.bfloat16, "cuda")
    b = randn((1536, 1536), torch.bfloat16, "cuda").t()
    _, timings = tune.tune_mm(a, b, rep_ms=5)
    ws = [t for t in timings if tuning.warp_specialized(t.plan)]  # (fastest first)
    assert {t.plan for t in ws} == set(tuning.ws_plans(2)) | set(tuning.ws_split_plans(
        1536, 1536, 1536, 2, 2, tgemm_device.num_sms(a_gpu()))) and all(
        t.ms is not None for t in ws)
    monkeypatch.setattr(plan_cache.TUNED, "get", lambda device, key: ws[0].plan)
    out = torch.empty(1536, 1536, device="cuda", dtype=torch.bfloat16)
    assert plan_mm(a, b, None, out, "none", False) == ws[0].plan
    assert not tuning.warp_specialized(plan_mm(a, b, None, out, "none", True))
    assert not tuning.warp_specialized(plan_mm(a, b, None, out, "relu", False))
    bound = tolerance(torch.bfloat16, torch.bfloat16)
    assert rel_error(tg.mm(a, b), reference(a, b)) <= bound
    compiled = torch.compile(lambda a, b: tg.mm(a, b) * 2, fullgraph=True)
    assert rel_error(compiled(a, b), 2 * reference(a, b)) <= bound


@pytest.mark.gpu
def test_inductor_output_code_has_the_kernel():
    from torch._inductor.utils import run_and_get_code

    x = randn((128, 64), torch.bfloat16, "cuda")
    w = randn((96, 64), torch.bfloat16, "cuda")
    out, code = run_and_get_code(torch.compile(_linear_gelu, fullgraph=True), x, w,
                                 randn((96,), torch.bfloat16, "cuda"))
    assert re.search(r"\bmm_(tma_)?kernel\b", "\n".join(code))
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_cuda_graph_capture_reduce_overhead():
    x = randn((64, 128), torch.bfloat16, "cuda")
    w = randn((32, 128), torch.bfloat16, "cuda")
    bias = randn((32,), torch.bfloat16, "cuda")
    tg.mm(x, w.t(), bias, "gelu")  # tune outside capture
    compiled = torch.compile(_linear_gelu, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x.copy_(randn((64, 128), torch.bfloat16, "cuda"))
        out = compiled(x, w, bias)
        ref = torch.relu(reference(x, w.t(), bias, "gelu")) * 2
        assert rel_error(out, ref) <= 1e-2

    graph = torch.cuda.CUDAGraph()
    static_out = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.graph(graph):
        static_out.copy_(tg.mm(x, w.t(), bias, "relu"))
    x.copy_(randn((64, 128), torch.bfloat16, "cuda"))
    graph.replay()
    assert rel_error(static_out, reference(x, w.t(), bias, "relu")) <= 1e-2


@pytest.mark.gpu
def test_dynamic_shapes_do_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    w = randn((64, 96), torch.float16, "cuda")
    compiled = torch.compile(lambda x, w: tg.mm(x, w.t(), None, "relu"), dynamic=True)
    for m in (33, 70, 129, 300):
        x = randn((m, 96), torch.float16, "cuda")
        assert rel_error(compiled(x, w), reference(x, w.t(), None, "relu")) <= 1e-2
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_int64_indexing_large_operand():
    # a has more than 2**31 elements, so offsets into it overflow int32.
    m, k, n = 65600, 32768, 16
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = tg.mm(a, b)
    rows = torch.tensor([0, 1, m // 2, m - 2, m - 1], device="cuda")
    ref = a[rows].double() @ b.double()
    assert rel_error(out[rows], ref) <= 1e-2
    del a


def test_torch_export_keeps_the_op(device):
    class Projection(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(randn((24, 40), torch.float32, device))
            self.bias = torch.nn.Parameter(randn((24,), torch.float32, device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return tg.mm(x, self.weight.t(), self.bias, "silu")

    model = Projection()
    x = randn((13, 40), torch.float32, device)
    exported = torch.export.export(model, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "tgemm.mm.default" in targets
    x2 = randn((13, 40), torch.float32, device)
    with torch.no_grad():
        out = exported.module()(x2)
    assert rel_error(out, reference(x2, model.weight.t(), model.bias, "silu")) <= 2e-3
