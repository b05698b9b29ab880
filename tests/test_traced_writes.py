"""What torch.compile believes each traced kernel launch writes.

AOTAutograd functionalizes every Triton launch it traces into (``triton_kernel_wrapper_functional``)
and copies each tensor the launch is found to write. PyTorch finds those from the kernel's
Triton IR; where its analysis sees a store address derived from an operand, the operand counts as
written: the compiled graph then copies A and B before every launch, and writes the copy back
into the operand's base, which breaks the partitioner where that base is also a forward output
("Node ... was invalid, but is output"). Every launch of every op may write only buffers the op
itself allocated. Runs without the interpreter and without a GPU: the kernels' IR is built for
sm_90 (what the H100s that run these ops compile for).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_mm import _run_without_interpreter

_SCRIPT = """
import torch, triton
from triton.backends.compiler import GPUTarget
import torch_triton_gemm as tg
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table


class Hopper:  # the target PyTorch's write analysis builds the kernels' IR for
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "zeros", "new_zeros",
               "full", "new_full", "zeros_like", "empty_like", "full_like"}
fp8, bf16, fp32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32


def allocated(node):
    # A view of an allocation counts as one (split-K workspaces are views).
    while node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in ALLOCATIONS:
            return True
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        if name not in {"view", "reshape", "_unsafe_view", "as_strided", "slice", "t",
                        "transpose", "permute", "expand", "select", "unsqueeze", "squeeze"}:
            return False
        node = node.args[0]
    return False


def check(label, fn, *make):
    with FakeTensorMode():
        args = [m() for m in make]
    gm = make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*args)
    launches = tma = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and "triton_kernel" in str(node.target):
            launches += 1
            kwargs = node.kwargs["kwargs"]
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            tma += bool(kwargs.get("USE_TMA")) or "tma" in getattr(kernel, "fn", kernel).__name__
            bad = [name for name in node.kwargs["tensors_to_clone"]
                   if not allocated(kwargs[name])]
            if bad:
                print(label, "WRITES OPERANDS", bad)
    print(label, "launches", launches, "tma", tma)


def t(*shape, dtype=bf16):
    return lambda: torch.empty(*shape, device="cuda", dtype=dtype)


def offs(*ends):
    return lambda: torch.tensor(ends, device="cuda", dtype=torch.int32)


def ids(tokens, k, experts):
    return lambda: torch.randint(experts, (tokens, k), device="cuda")


FIXUP = tg.tuning.MMPlan("portable", tg.tuning.TileConfig(16, 64, 128, 1, 4, 4), split_k=4,
                        split_fixup=True)


FIXUP_TMA = tg.tuning.MMPlan("tma", tg.tuning.TileConfig(64, 64, 64, 8, 4, 4), split_k=4,
                            split_fixup=True)


def split_fixup_mm(a, b):
    # K splits that finish their own tiles (one launch, counters the op allocates).
    with tg.tuning.force_plan(FIXUP):
        return tg.mm(a, b)


def split_fixup_tma_mm(a, b):
    # The same on the Hopper kernel (the portable one where TMA is not there).
    with tg.tuning.force_plan(FIXUP_TMA):
        return tg.mm(a, b)


def check_all(prefix):
    for dtype in (bf16, torch.float16, fp32):
        check(prefix + f"mm {dtype}", lambda a, b: tg.mm(a, b), t(96, 64, dtype=dtype),
              t(64, 80, dtype=dtype))
    check(prefix + "mm bias gelu", lambda a, b, c: tg.mm(a, b, c, "gelu"), t(96, 64),
          lambda: torch.empty(80, 64, device="cuda", dtype=bf16).t(), t(80))
    check(prefix + "mm split-k", lambda a, b: tg.mm(a, b), t(16, 8192), t(8192, 64))
    check(prefix + "mm split fix-up", split_fixup_mm, t(16, 8192), t(8192, 64))
    check(prefix + "mm split fix-up, tma plan", split_fixup_tma_mm, t(64, 8192), t(8192, 64))
    check(prefix + "mm odd", lambda a, b: tg.mm(a, b), t(37, 1003), t(1003, 29))
    check(prefix + "mm large", lambda a, b: tg.mm(a, b), t(2048, 1024),
          lambda: torch.empty(2048, 1024, device="cuda", dtype=bf16).t())
    check(prefix + "grouped 3d", lambda a, b: tg.grouped_mm(a, b), t(4, 12, 16, dtype=fp32),
          lambda: torch.empty(4, 12, 16, device="cuda", dtype=fp32).transpose(-2, -1))
    check(prefix + "grouped 2d x 3d", lambda a, b, o: tg.grouped_mm(a, b, o), t(96, 64),
          t(4, 64, 48), offs(16, 40, 40, 96))
    check(prefix + "grouped 2d x 2d", lambda a, b, o: tg.grouped_mm(a, b, o),
          lambda: torch.empty(96, 64, device="cuda", dtype=bf16).t(), t(96, 48),
          offs(16, 40, 40, 96))
    check(prefix + "grouped 3d x 2d", lambda a, b, o: tg.grouped_mm(a, b, o), t(4, 32, 64),
          t(64, 96), offs(16, 40, 40, 96))
    for fast in (False, True):
        check(prefix + f"scaled tensorwise fast={fast}",
              lambda a, b, sa, sb: tg.scaled_mm(a, b, sa, sb, use_fast_accum=fast),
              t(256, 256, dtype=fp8), lambda: torch.empty(128, 256, device="cuda", dtype=fp8).t(),
              t((), dtype=fp32), t((), dtype=fp32))
        check(prefix + f"scaled rowwise fast={fast}",
              lambda a, b, sa, sb: tg.scaled_mm(a, b, sa, sb, use_fast_accum=fast),
              t(64, 256, dtype=fp8), lambda: torch.empty(128, 256, device="cuda", dtype=fp8).t(),
              t(64, 1, dtype=fp32), t(1, 128, dtype=fp32))
    check(prefix + "scaled large",
          lambda a, b, sa, sb: tg.scaled_mm(a, b, sa, sb, use_fast_accum=True),
          t(2048, 2048, dtype=fp8), lambda: torch.empty(2048, 2048, device="cuda", dtype=fp8).t(),
          t((), dtype=fp32), t((), dtype=fp32))
    check(prefix + "scaled blockwise", lambda a, b, sa, sb: tg.scaled_mm(a, b, sa, sb),
          t(64, 256, dtype=fp8), lambda: torch.empty(128, 256, device="cuda", dtype=fp8).t(),
          t(64, 2, dtype=fp32), t(2, 1, dtype=fp32))
    for fast in (False, True):
        check(prefix + f"scaled grouped fast={fast}",
              lambda a, b, sa, sb, o: tg.scaled_grouped_mm(a, b, sa, sb, o, use_fast_accum=fast),
              t(96, 64, dtype=fp8),
              lambda: torch.empty(4, 48, 64, device="cuda", dtype=fp8).transpose(-2, -1),
              t(96, dtype=fp32), t(4, 48, dtype=fp32), offs(16, 40, 40, 96))
    check(prefix + "moe_mlp", lambda x, w13, w2, i, w: tg.moe_mlp(x, w13, w2, i, w), t(96, 64),
          t(4, 96, 64), t(4, 64, 48), ids(96, 2, 4), t(96, 2, dtype=fp32))
    check(prefix + "moe_gate_up", lambda x, w13, i: torch.ops.tgemm.moe_gate_up(x, w13, i),
          t(96, 64), t(4, 96, 64), ids(96, 2, 4))
    check(prefix + "moe_down",
          lambda p, w2, i, w: torch.ops.tgemm.moe_down(p, w2, i, w, "silu"),
          t(192, 96), t(4, 64, 48), ids(96, 2, 4), t(96, 2, dtype=fp32))
    check(prefix + "moe_glu_backward",
          lambda p, g, w, o: torch.ops.tgemm.moe_glu_backward(p, g, w, o, "silu"),
          t(192, 96), t(192, 48), t(192, dtype=fp32), t(192, dtype=torch.int32))


check_all("")
# As on an H100 (TMA descriptors, its shared memory): the TMA variants of every kernel.
import torch_triton_gemm.device as device
device.supports_tma = lambda _: True
device.shared_memory_per_block = lambda _: 232448
check_all("tma ")
"""


def test_traced_launches_write_only_what_the_op_allocates():
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; the GPU tests compile the models")
    lines = _run_without_interpreter(textwrap.dedent(_SCRIPT)).strip().splitlines()
    assert not [line for line in lines if "WRITES OPERANDS" in line], lines
    counts = {}
    for line in lines:
        if " launches " in line:
            label, rest = line.split(" launches ")
            launches, tma = rest.split(" tma ")
            counts[label] = (int(launches), int(tma))
    assert len(counts) == 2 * 25, lines
    assert counts["mm split fix-up"] == (1, 0), counts
    assert counts["tma mm split fix-up, tma plan"] == (1, 1), counts
    # Every op traced into kernel launches (none fell back to an opaque op), and as on an H100
    # the TMA variants were among them.
    assert all(launches >= 1 for launches, _ in counts.values()), counts
    assert sum(tma for label, (_, tma) in counts.items() if label.startswith("tma ")) >= 6, counts
