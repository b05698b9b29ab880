"""Test session setup: choose where kernels run before the package is imported.

With a CUDA GPU the tests run compiled kernels on it. Without one they run on CPU tensors in
Triton's interpreter, which Triton only enables if TRITON_INTERPRET is set before any kernel is
decorated, hence before torch_triton_gemm is imported.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch_triton_gemm import device as tgemm_device  # noqa: E402


def kernel_device() -> str:
    """Where this session's kernels run: 'cuda', or 'cpu' under the interpreter."""
    return "cpu" if tgemm_device.interpreter_enabled() else "cuda"


@pytest.fixture
def device() -> str:
    return kernel_device()


@pytest.fixture
def fresh_dynamo():
    """Compiled-code tests start and end with Dynamo's caches empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def highest_fp32():
    """IEEE fp32 products (no tf32) in aten and tgemm alike, for fp32's 1e-5 budget."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest) -> int:
    """Draw fresh random inputs in every test, and say which seed a failure used."""
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    if call.excinfo is not None:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            item.add_report_section(call.when, "seed", f"torch.manual_seed({seeds[0]})")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available() and not tgemm_device.interpreter_enabled():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compiled Triton")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
