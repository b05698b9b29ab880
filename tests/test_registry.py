"""define_triton_op's eager kernels: which implementation each kind of call reaches.

The ops here are made of PyTorch operations only (no Triton kernel), so they run on CPU tensors
in both registrations: the ``custom_op`` used under Triton's interpreter (this session in CI) and
the ``triton_op`` used with compiled Triton, which ``test_triton_op_registration`` checks by
running this file again in a process without the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm.ops._registry import define_triton_op

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS: list[str] = []


def _axpy_impl(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    CALLS.append("impl")
    return x + alpha * y


def _axpy_fake(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    CALLS.append("fake")
    return torch.empty_like(x)


def _axpy_eager(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    CALLS.append("eager")
    return x + alpha * y


def _axpy_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.alpha = inputs[2]


def _axpy_backward(ctx, grad):  # type: ignore[no-untyped-def]
    CALLS.append("backward")
    return grad, grad * ctx.alpha, None


axpy = define_triton_op("tgemm_registry_test::axpy", _axpy_impl, _axpy_fake,
                        eager_impl=_axpy_eager)
axpy.register_autograd(_axpy_backward, setup_context=_axpy_setup_context)


def _scale_impl(x: torch.Tensor, *, factor: float = 3.0) -> torch.Tensor:
    return x * factor


def _scale_eager(x: torch.Tensor, *, factor: float = 3.0) -> torch.Tensor:
    CALLS.append("eager")
    return x * factor


scale = define_triton_op("tgemm_registry_test::scale", _scale_impl, _scale_impl,
                         eager_impl=_scale_eager)
scale.register_autograd(lambda ctx, grad: grad * ctx.factor,
                        setup_context=lambda ctx, inputs, keyword_only_inputs, output:
                        setattr(ctx, "factor", keyword_only_inputs["factor"]))


@pytest.fixture(autouse=True)
def clear_calls():
    CALLS.clear()


def _inputs(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    return x.requires_grad_(requires_grad), y.requires_grad_(requires_grad)


def test_eager_call_runs_eager_impl():
    x, y = _inputs()
    for out in (torch.ops.tgemm_registry_test.axpy(x, y),
                torch.ops.tgemm_registry_test.axpy.default(x, y, 0.5)):
        assert out.grad_fn is None
    assert torch.equal(torch.ops.tgemm_registry_test.axpy(x, y), x + 2.0 * y)
    with torch.no_grad():
        torch.ops.tgemm_registry_test.axpy(x.requires_grad_(), y)
    with torch.inference_mode():
        torch.ops.tgemm_registry_test.axpy(x, y)
    assert CALLS == ["eager"] * 5


@pytest.mark.parametrize("grad_inputs", ["x", "y", "both"])
def test_gradients_use_the_registered_formula(grad_inputs):
    x, y = _inputs()
    x.requires_grad_(grad_inputs in ("x", "both"))
    y.requires_grad_(grad_inputs in ("y", "both"))
    out = torch.ops.tgemm_registry_test.axpy(x, y, 0.5)
    grad_out = torch.randn_like(out)
    wanted = [t for t in (x, y) if t.requires_grad]
    grads = torch.autograd.grad(out, wanted, grad_out)
    expected = {"x": [grad_out], "y": [grad_out * 0.5], "both": [grad_out, grad_out * 0.5]}
    for g, e in zip(grads, expected[grad_inputs], strict=True):
        assert torch.equal(g, e)
    assert CALLS == ["eager", "backward"]


def test_gradcheck():
    x, y = (t.double() for t in _inputs())
    assert torch.autograd.gradcheck(torch.ops.tgemm_registry_test.axpy,
                                     (x.requires_grad_(), y.requires_grad_(), 0.5))


def test_generic_autograd_path_agrees():
    """Under a torch_dispatch mode the op takes PyTorch's generic autograd kernel; values,
    gradients and the implementation reached are the same."""

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = _inputs(requires_grad=True)
    grad_out = torch.randn(5, 3)
    fast = torch.ops.tgemm_registry_test.axpy(x, y)
    fast_grads = torch.autograd.grad(fast, (x, y), grad_out)
    with Record() as mode:
        generic = torch.ops.tgemm_registry_test.axpy(x, y)
    generic_grads = torch.autograd.grad(generic, (x, y), grad_out)
    assert "tgemm_registry_test.axpy.default" in mode.ops
    assert torch.equal(fast, generic)
    for f, g in zip(fast_grads, generic_grads, strict=True):
        assert torch.equal(f, g)
    assert CALLS == ["eager", "backward", "eager", "backward"]


def test_keyword_only_arguments():
    x = torch.randn(4, requires_grad=True)
    out = torch.ops.tgemm_registry_test.scale(x, factor=0.5)
    assert torch.equal(out, x * 0.5)
    (grad,) = torch.autograd.grad(out.sum(), (x,))
    assert torch.equal(grad, torch.full_like(x, 0.5))
    assert torch.equal(torch.ops.tgemm_registry_test.scale(x.detach()), x.detach() * 3.0)
    assert CALLS == ["eager", "eager"]


def test_fake_tensors_and_tracing_do_not_run_eager_impl():
    # (Autograd on CUDA FakeTensors needs a CUDA build of PyTorch: gradients use CPU here.)
    with FakeTensorMode():
        x, y = torch.empty(5, 3, device="cuda"), torch.empty(5, 3, device="cuda")
        out = torch.ops.tgemm_registry_test.axpy(x, y)
        assert out.shape == (5, 3) and out.device.type == "cuda"
        x, y = torch.empty(5, 3, requires_grad=True), torch.empty(5, 3)
        out = torch.ops.tgemm_registry_test.axpy(x, y)
        assert out.requires_grad
        (grad,) = torch.autograd.grad(out.sum(), (x,))
        assert grad.shape == (5, 3)

    def forward_backward(x, y):  # type: ignore[no-untyped-def]
        out = torch.ops.tgemm_registry_test.axpy(x, y) * 2
        return torch.autograd.grad(out.sum(), (x, y))

    gm = make_fx(forward_backward, tracing_mode="symbolic")(*_inputs(requires_grad=True))
    assert "torch.ops.tgemm_registry_test.axpy.default" in gm.code
    assert "eager" not in CALLS


def test_opcheck():
    x, y = _inputs(requires_grad=True)
    torch.library.opcheck(torch.ops.tgemm_registry_test.axpy.default, (x, y, 0.5))
    torch.library.opcheck(torch.ops.tgemm_registry_test.scale.default, (x,), {"factor": 0.5})


def test_compile_keeps_the_op():
    graphs = []

    def record(gm, _inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    def f(x, y):  # type: ignore[no-untyped-def]
        return torch.ops.tgemm_registry_test.axpy(x, y).relu()

    x, y = _inputs(requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(f, backend=record, fullgraph=True)(x, y)
    assert "tgemm_registry_test.axpy" in graphs[0].code
    assert torch.equal(out, f(x, y))


def test_eager_kernels_are_hidden_from_dynamo():
    """A frame TorchDynamo skips still calls ops with TorchDynamo's frame hook active; the eager
    kernels (called by the dispatcher) must not be traced then."""
    from torch._dynamo.utils import counters

    def skipped(x, y):  # type: ignore[no-untyped-def]
        torch._dynamo.skip_frame()
        return torch.ops.tgemm_registry_test.axpy(x, y)

    torch._dynamo.reset()
    counters.clear()
    x, y = _inputs(requires_grad=True)
    torch.compile(skipped, backend="eager")(x, y)
    torch.compile(skipped, backend="eager")(x.detach(), y.detach())
    assert counters["frames"]["ok"] == 0 and not counters["graph_break"]
    assert CALLS == ["eager", "eager"]


def test_redefinition_replaces_the_eager_kernels():
    def eager(x: torch.Tensor) -> torch.Tensor:
        CALLS.append("eager")
        return x.clone()

    def other_eager(x: torch.Tensor) -> torch.Tensor:
        CALLS.append("other")
        return x.clone()

    def impl(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    define_triton_op("tgemm_registry_test::copy", impl, impl, eager_impl=eager)
    define_triton_op("tgemm_registry_test::copy", impl, impl, eager_impl=other_eager)
    torch.ops.tgemm_registry_test.copy(torch.randn(3))
    assert CALLS == ["other"]


def test_eager_impl_must_take_the_same_parameters():
    def impl(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return x * alpha

    def eager(x: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
        return x * alpha

    with pytest.raises(TypeError, match="eager_impl must take the parameters of impl"):
        define_triton_op("tgemm_registry_test::mismatch", impl, impl, eager_impl=eager)

    def takes_more(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
        return x * alpha

    with pytest.raises(TypeError, match="eager_impl must take the parameters of impl"):
        define_triton_op("tgemm_registry_test::mismatch", impl, impl, eager_impl=takes_more)


def test_eager_impl_may_take_more_parameters_with_defaults():
    """Parameters after impl's, with defaults, serve other callers; the op never passes them."""
    seen = []

    def impl(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return x * alpha

    def eager(x: torch.Tensor, alpha: float = 1.0, note: str | None = None) -> torch.Tensor:
        seen.append(note)
        return x * alpha

    define_triton_op("tgemm_registry_test::more", impl, impl, eager_impl=eager)
    x = torch.randn(3)
    assert torch.equal(torch.ops.tgemm_registry_test.more(x, 2.0), x * 2.0)
    assert seen == [None]


@pytest.mark.skipif(not tgemm_device.interpreter_enabled(),
                    reason="this session already uses the triton_op registration")
def test_triton_op_registration():
    """The tests above, in a process without Triton's interpreter (ops are triton_ops there)."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_host_overhead_example_runs_without_a_gpu():
    """examples/host_overhead.py on a CPU-only machine (launches replaced by no-ops): every
    entry point's row is printed with a time."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "host_overhead.py"), "--calls", "5",
         "--dtypes", "bf16,fp16"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    entries = ("torch.", "tg.", "op body", "bare")
    rows = [line.rsplit(None, 2) for line in proc.stdout.splitlines() if line.startswith(entries)]
    assert len(rows) == 9 and all(float(t) > 0 for row in rows for t in row[1:]), proc.stdout
