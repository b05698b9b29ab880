"""tgemm::grouped_mm and tgemm::grouped_mm_list: numerics, offs handling, errors, gradients,
opcheck, fake tensors and graph capture.

Every case is checked against a float64 reference, and against torch._grouped_mm where PyTorch's
CPU build runs the same problem. Without a GPU the kernels run on CPU tensors in Triton's
interpreter (see conftest.py); GPU-only tests carry the ``gpu`` marker.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import pytest
import torch
from samples import make_operand, randn, rel_error, tolerance
from test_mm import _run_without_interpreter

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import tuning
from torch_triton_gemm.ops import grouped_launch
from torch_triton_gemm.ops import grouped_mm as grouped_module
from torch_triton_gemm.ops import grouped_mm_list as grouped_list_module
from torch_triton_gemm.ops.grouped_mm import launch_grouped_mm

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FORMS = ["m", "n", "k", "none"]  # 2-D x 3-D, 3-D x 2-D, 2-D x 2-D, 3-D x 3-D
LAYOUTS = ["row", "nt", "tn", "sliced", "broadcast"]

# Sizes: multiples of 8 so that row-major and column-major operands of every dtype meet TMA's
# 16-byte rules (the descriptor path); sliced and broadcast layouts take the pointer path.
G, ROWS, K, N = 4, 48, 40, 24


# --- samples and references ---------------------------------------------------------------------

def random_offs(length: int, groups: int, device: str) -> torch.Tensor:
    """Cumulative ends of ``groups`` groups over ``length``: group 1 empty, random cut points (not
    multiples of 16 in general), and a tail of at least 3 entries past offs[-1]."""
    cuts = sorted(torch.randint(0, length - 3, (groups,)).tolist())
    cuts[1] = cuts[0]
    return torch.tensor(cuts, dtype=torch.int32, device=device)


def operand2(rows: int, cols: int, dtype: torch.dtype, device: str, layout: str,
             operand: str) -> torch.Tensor:
    """samples.make_operand, plus "tn": a column-major a with a row-major b."""
    if layout == "tn":
        layout = "col" if operand == "a" else "row"
    return make_operand(rows, cols, dtype, device, layout, operand)


def operand3(groups: int, rows: int, cols: int, dtype: torch.dtype, device: str, layout: str,
             operand: str) -> torch.Tensor:
    """A [groups, rows, cols] tensor laid out as ``layout`` says (see samples.make_operand);
    "nt" makes b an expert weight stored [G, N, K] and passed transposed, "tn" makes a
    column-major."""
    if layout in ("nt", "tn"):
        layout = "row" if (operand == "a") == (layout == "nt") else "col"
    if layout == "row":
        return randn((groups, rows, cols), dtype, device)
    if layout == "col":
        return randn((groups, cols, rows), dtype, device).transpose(-2, -1)
    if layout == "sliced":
        return randn((groups + 1, rows + 3, cols + 5), dtype, device)[1:, 2:2 + rows, 3:3 + cols]
    if layout == "broadcast":  # one matrix shared by every group (stride 0 over G)
        return randn((1, rows, cols), dtype, device).expand(groups, rows, cols)
    raise ValueError(layout)


@dataclass
class GroupedSample:
    a: torch.Tensor
    b: torch.Tensor
    offs: torch.Tensor | None
    bias: torch.Tensor | None
    form: str
    name: str

    def args(self) -> tuple:
        return (self.a, self.b, self.offs, self.bias)


def make_sample(form: str, layout: str, dtype: torch.dtype, device: str, bias: bool = False,
                rows: int = ROWS, k: int = K, n: int = N, groups: int = G) -> GroupedSample:
    """One problem of ``form``; the grouped dimension (if any) has ``rows`` entries."""
    offs = None
    if form == "m":  # a [T, K] x b [G, K, N], T = rows grouped
        a = operand2(rows, k, dtype, device, layout, "a")
        b = operand3(groups, k, n, dtype, device, layout, "b")
        offs = random_offs(rows, groups, device)
        bias_shape: tuple[int, ...] = (groups, n)
    elif form == "n":  # a [G, M, K] x b [K, N_total], N_total = rows grouped
        a = operand3(groups, n, k, dtype, device, layout, "a")
        b = operand2(k, rows, dtype, device, layout, "b")
        offs = random_offs(rows, groups, device)
        bias_shape = (rows,)
    elif form == "k":  # a [M, K_total] x b [K_total, N], K_total = rows grouped
        a = operand2(n, rows, dtype, device, layout, "a")
        b = operand2(rows, n, dtype, device, layout, "b")
        offs = random_offs(rows, groups, device)
        bias_shape = (groups, n)
    else:  # a [G, M, K] x b [G, K, N]
        a = operand3(groups, n, k, dtype, device, layout, "a")
        b = operand3(groups, k, n, dtype, device, layout, "b")
        bias_shape = (groups, n)
    bias_t = randn(bias_shape, dtype, device) if bias else None
    return GroupedSample(a, b, offs, bias_t, form, f"{form}-{layout}" + ("-bias" if bias else ""))


def reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, written) in float64: out is differentiable and holds zeros where no group writes;
    written marks the elements inside a group."""
    a64, b64 = a.double(), b.double()
    bias64 = bias.double() if bias is not None else None
    ends = offs.tolist() if offs is not None else []
    starts = [0, *ends[:-1]]
    if a.dim() == 3 and b.dim() == 3:
        out = a64 @ b64 + (bias64[:, None, :] if bias64 is not None else 0)
        return out, torch.ones_like(out, dtype=torch.bool)
    if a.dim() == 2 and b.dim() == 2:
        blocks = [a64[:, s:e] @ b64[s:e] for s, e in zip(starts, ends)]
        out = torch.stack(blocks) if blocks else a64.new_zeros(0, a.shape[0], b.shape[1])
        if bias64 is not None:
            out = out + bias64[:, None, :]
        return out, torch.ones_like(out, dtype=torch.bool)
    if a.dim() == 2:
        pieces = [a64[s:e] @ b64[g] + (bias64[g] if bias64 is not None else 0)
                  for g, (s, e) in enumerate(zip(starts, ends))]
        tail = a.shape[0] - (ends[-1] if ends else 0)
        out = torch.cat([*pieces, a64.new_zeros(tail, b.shape[2])])
        written = torch.zeros_like(out, dtype=torch.bool)
        written[:ends[-1] if ends else 0] = True
        return out, written
    pieces = [a64[g] @ b64[:, s:e] + (bias64[s:e] if bias64 is not None else 0)
              for g, (s, e) in enumerate(zip(starts, ends))]
    tail = b.shape[1] - (ends[-1] if ends else 0)
    out = torch.cat([*pieces, a64.new_zeros(a.shape[1], tail)], dim=1)
    written = torch.zeros_like(out, dtype=torch.bool)
    written[:, :ends[-1] if ends else 0] = True
    return out, written


def assert_close_in_groups(out: torch.Tensor, ref: torch.Tensor, written: torch.Tensor,
                           dtype: torch.dtype, what: str, factor: float = 1.0) -> None:
    assert out.shape == ref.shape, what
    err = rel_error(out[written], ref[written])
    budget = factor * tolerance(out.dtype, dtype)
    assert err <= budget, f"{what}: rel err {err:.3e} > {budget:.0e}"


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# --- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(device, dtype, highest_fp32):
    """Every form x layout: through the op, and launched into a NaN-filled buffer with the other
    loader, where every element inside a group must be written and none past offs[-1]."""
    for form in FORMS:
        for layout in LAYOUTS:
            s = make_sample(form, layout, dtype, device, bias=layout == "row")
            ref, written = reference(*s.args())
            out = tg.grouped_mm(*s.args())
            assert out.dtype == dtype and out.is_contiguous(), s.name
            assert_close_in_groups(out, ref, written, dtype, s.name)
            use_tma, _, _ = _loaders(s)
            poisoned = _poisoned(tuple(ref.shape), dtype, device)
            launch_grouped_mm(s.a, s.b, s.offs, s.bias, poisoned, use_tma=not use_tma)
            assert_close_in_groups(poisoned, ref, written, dtype, s.name + " (other loader)")
            assert poisoned[~written].isnan().all(), f"{s.name}: wrote past offs[-1]"


def _loaders(s: GroupedSample) -> tuple[bool, bool, bool]:
    """(TMA loads?, a contiguous along M?, b contiguous along K?) as the launch chooses them."""
    problem = grouped_launch.Problem(s.form, s.a, s.b, torch.empty(0), s.offs, s.bias)
    use_tma, _, _, flags = grouped_launch.tma_loads(s.form, s.a, s.b, problem)
    return use_tma, flags["A_M_CONTIGUOUS"], flags["B_K_CONTIGUOUS"]


# The layouts that load through TMA descriptors: their contiguous dims are never the grouped one
# (a TMA read must start on a 16-byte boundary along the contiguous dim; group starts are
# arbitrary). The MoE forward (m-nt), input gradient (m-row) and weight gradient (k-tn) are.
TMA_LAYOUTS = {("m", "row"), ("m", "nt"), ("n", "nt"), ("k", "tn"), ("none", "row"),
               ("none", "nt"), ("none", "tn"), ("none", "broadcast")}


def test_loader_choice(device):
    """Aligned layouts load through TMA descriptors (also emulated by the interpreter); others,
    sliced views and stride-0 rows take the pointer loaders. Transposed operands keep their
    layout (a descriptor on the transposed view)."""
    if not tg_device_has_tma(device):
        pytest.skip("this GPU has no TMA")
    for form in FORMS:
        for layout in LAYOUTS:
            s = make_sample(form, layout, torch.bfloat16, device)
            use_tma, a_m, b_k = _loaders(s)
            assert use_tma == ((form, layout) in TMA_LAYOUTS), s.name
            if use_tma:
                assert a_m == (layout == "tn") and b_k == (layout == "nt"), s.name


def test_heuristic_tiles(monkeypatch):
    """The GPU tile choice by a group's average size (see tuning.heuristic_grouped_tile): 16- and
    64-row tiles for small groups, 128x256 for wide MoE outputs loaded by TMA or gathered, 128x128
    otherwise; BLOCK_K rescaled per dtype; stages shed to fit smaller shared memories."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    h100_smem = 232448
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: h100_smem)
    tile = tuning.heuristic_grouped_tile
    assert tile(4096, 14336, 2, True) == tuning.TileConfig(128, 256, 64, 16, 8, 3)  # Mixtral
    assert tile(128, 2048, 2, True) == tuning.TileConfig(128, 256, 64, 16, 8, 3)  # DeepSeek-V3
    # C stored by TMA: its staging buffer (half a tile) still leaves room for 3 stages, in
    # every output dtype.
    for out_size in (2, 4):
        assert tile(4096, 14336, 2, True, out_size) == tile(4096, 14336, 2, True)
    assert tile(4096, 14336, 2, False) == tuning.TileConfig(128, 128, 64, 8, 8, 4)
    # moe_mlp's gathered rows (pointer loaders) take the wide tile too, narrow outputs do not.
    assert tile(1024, 28672, 2, False, gathered=True) == tuning.TileConfig(128, 256, 64, 16, 8, 3)
    assert tile(1024, 1024, 2, False, gathered=True) == tuning.TileConfig(128, 128, 64, 8, 8, 4)
    assert tile(4096, 1024, 2, True) == tuning.TileConfig(128, 128, 64, 8, 8, 4)
    assert tile(127, 14336, 2, True).block_m == 64
    assert tile(1, 4096, 2, True).block_m == 16
    assert (tile(4096, 64, 2, True).block_m, tile(4096, 64, 2, True).block_n) == (128, 64)
    assert tile(4096, 4096, 4, False).block_k == 32 and tile(4096, 4096, 1, False).block_k == 128
    for smem in (101376, 166912):  # sm_86 / sm_89, sm_80
        monkeypatch.setattr(tuning._device, "shared_memory_per_block",
                            lambda index, smem=smem: smem)
        for element_size in (2, 4):
            for m, n, tma in ((4096, 14336, True), (4096, 1024, False), (64, 512, False)):
                t = tile(m, n, element_size, tma)
                assert tuning.shared_memory_bytes(t, element_size) <= smem, (smem, t)
                assert t.num_stages >= 2


def tg_device_has_tma(device: str) -> bool:
    from torch_triton_gemm import device as tgemm_device

    return (tgemm_device.supports_tma(torch.device(device))
            or tgemm_device.interpreter_enabled())


def _torch_accepts_groups(s) -> bool:  # type: ignore[no-untyped-def]
    """Whether torch._grouped_mm's CUDA kernels take these groups: 16-byte aligned sizes (they
    assert on the device otherwise, which ends the process's use of the GPU)."""
    if s.offs is None or s.a.device.type != "cuda":
        return True
    offs = s.offs.cpu()
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return bool((sizes * s.a.element_size() % 16 == 0).all())


@pytest.mark.parametrize("form", ["m", "n", "k", "none"])
def test_matches_torch_grouped_mm(device, form, highest_fp32):
    """torch._grouped_mm as a second reference (its CPU path needs 16-byte aligned strides, its
    CUDA path 16-byte aligned group sizes too)."""
    for dtype in DTYPES:
        s = make_sample(form, "nt", dtype, device)
        if not _torch_accepts_groups(s):
            continue
        expected = torch._grouped_mm(s.a, s.b, s.offs)
        out = tg.grouped_mm(s.a, s.b, s.offs)
        ref, written = reference(s.a, s.b, s.offs)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert_close_in_groups(out, ref, written, dtype, f"{s.name} {dtype}")
        assert_close_in_groups(out, expected.double(), written, dtype, f"{s.name} {dtype} torch",
                               factor=2)


@pytest.mark.parametrize("form", ["m", "n"])
def test_rows_past_offs_follow_torch_or_zero(device, form):
    """Past offs[-1], torch._grouped_mm leaves the output unwritten (whatever its fresh
    torch.empty tensor held); so does grouped_mm. zero_tail=True writes zeros there instead."""
    s = make_sample(form, "nt", torch.bfloat16, device)
    ref, written = reference(*s.args())
    assert not written.all()
    poisoned = _poisoned(tuple(ref.shape), torch.bfloat16, device)
    launch_grouped_mm(s.a, s.b, s.offs, None, poisoned)
    assert poisoned[~written].isnan().all() and not poisoned[written].isnan().any()
    zeroed = tg.grouped_mm(s.a, s.b, s.offs, zero_tail=True)
    assert torch.equal(zeroed[~written], torch.zeros_like(zeroed[~written]))
    assert_close_in_groups(zeroed, ref, written, torch.bfloat16, s.name)
    assert torch.equal(zeroed[written], tg.grouped_mm(s.a, s.b, s.offs)[written])


@pytest.mark.parametrize("form", ["m", "n", "k"])
def test_offs_views_read_as_their_values(device, form, highest_fp32):
    """offs given as a strided view (every other entry of a buffer holding other values) or an
    expanded one (stride 0, one stored entry) means its values, as torch._grouped_mm reads it:
    the kernels index offs as contiguous, so the launch reads a contiguous copy."""
    s = make_sample(form, "row", torch.float32, device)
    ends = s.offs
    buffer = torch.stack([ends, torch.full_like(ends, 10_000)], dim=1).reshape(-1)
    strided = buffer[::2]
    assert strided.stride(0) == 2 and torch.equal(strided, ends)
    ref, written = reference(s.a, s.b, ends)
    assert_close_in_groups(tg.grouped_mm(s.a, s.b, strided), ref, written, torch.float32,
                           f"{form} strided offs")
    # Every group ending at the same row: one group with rows, the others empty, zeros after.
    end = int(ends[-1])
    expanded = torch.tensor([end], dtype=torch.int32, device=device).expand(ends.shape[0])
    ref, written = reference(s.a, s.b, expanded.contiguous())
    zero_tail = form != "k"  # (the contraction grouped has no tail in its output)
    out = tg.grouped_mm(s.a, s.b, expanded, zero_tail=zero_tail)
    assert_close_in_groups(out, ref, written, torch.float32, f"{form} expanded offs")
    assert torch.equal(out[~written], torch.zeros_like(out[~written]))


def test_odd_sizes_and_group_edges(device, highest_fp32):
    """Sizes that are no tile multiple, groups of one row, all rows in one group, every group
    empty, offs[-1] at the very end."""
    t, k, n = 45, 37, 29
    a, b = randn((t, k), torch.float32, device), randn((3, n, k), torch.float32, device)
    for ends in ([1, 2, 45], [0, 0, 45], [0, 0, 0], [44, 44, 44], [16, 32, 45]):
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        out = tg.grouped_mm(a, b.transpose(-2, -1), offs, zero_tail=True)
        ref, _ = reference(a, b.transpose(-2, -1), offs)
        assert rel_error(out, ref) <= tolerance(torch.float32, torch.float32), ends


def test_empty_problems(device):
    f16 = torch.float16
    offs0 = torch.zeros(0, dtype=torch.int32, device=device)
    cases = [
        # no rows, no groups, no columns
        (randn((0, 8), f16, device), randn((2, 8, 16), f16, device),
         torch.zeros(2, dtype=torch.int32, device=device), (0, 16)),
        (randn((5, 8), f16, device), randn((0, 8, 16), f16, device), offs0, (5, 16)),
        (randn((5, 8), f16, device), randn((8, 16), f16, device), offs0, (0, 5, 16)),
        (randn((2, 5, 8), f16, device), randn((2, 8, 0), f16, device), None, (2, 5, 0)),
    ]
    for a, b, offs, shape in cases:
        assert tg.grouped_mm(a, b, offs).shape == shape
    # An empty contraction gives zeros (plus bias), as torch does.
    a, b = randn((3, 0), f16, device), randn((2, 0, 16), f16, device)
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
    assert torch.equal(tg.grouped_mm(a, b, offs), torch.zeros(3, 16, dtype=f16, device=device))
    bias = randn((2, 16), f16, device)
    out = tg.grouped_mm(a, b, offs, bias)
    assert torch.equal(out, torch.cat([bias[:1], bias[1:].expand(2, 16)]))


@pytest.mark.parametrize(
    "dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)], ids=str)
def test_out_dtype(device, dtype, out_dtype, highest_fp32):
    s = make_sample("m", "nt", dtype, device, bias=True)
    out = tg.grouped_mm(*s.args(), out_dtype=out_dtype)
    ref, written = reference(*s.args())
    assert out.dtype == out_dtype
    assert rel_error(out[written], ref[written]) <= tolerance(out_dtype, dtype)


def test_tf32_precision_setting(device):
    previous = torch.get_float32_matmul_precision()
    try:
        s = make_sample("m", "nt", torch.float32, device)
        ref, written = reference(*s.args())
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            err = rel_error(tg.grouped_mm(*s.args())[written], ref[written])
            assert err <= tolerance(torch.float32, torch.float32), (precision, err)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_deterministic(device):
    s = make_sample("m", "nt", torch.bfloat16, device)
    first = tg.grouped_mm(*s.args(), zero_tail=True)
    assert torch.equal(first, tg.grouped_mm(*s.args(), zero_tail=True))


# --- offs values: checks, and the kernel's clamping ----------------------------------------------

def _clamped(offs: list[int], length: int) -> list[int]:
    """What the kernel does with any offs: each end clamped into [previous end, length]."""
    out, previous = [], 0
    for end in offs:
        previous = min(max(end, previous), length)
        out.append(previous)
    return out


_NON_DECREASING = "tgemm::grouped_mm: offs must be non-decreasing and start at 0 or more, got "
BAD_OFFS = [
    ([5, 3, 20, 40], _NON_DECREASING + "offs[1] = 3 after offs[0] = 5"),
    ([-2, 3, 20, 40], _NON_DECREASING + "offs[0] = -2"),
    ([5, 9, 20, 49], "tgemm::grouped_mm: offs[-1] = 49 is past the end of a's rows (48)"),
    ([5, 60, 20, 40], _NON_DECREASING + "offs[2] = 20 after offs[1] = 60"),
]


@pytest.mark.parametrize("case", range(len(BAD_OFFS)))
def test_bad_offs_values_raise_before_launch(device, case, monkeypatch):
    values, message = BAD_OFFS[case]
    s = make_sample("m", "nt", torch.float16, device)
    offs = torch.tensor(values, dtype=torch.int32, device=device)
    monkeypatch.setattr(grouped_module, "run_grouped_launch", _no_launch)
    # GPU offs are checked only on request (reading them syncs with the device).
    monkeypatch.setattr(grouped_launch, "offs_check_mode", lambda: "always")
    with pytest.raises(ValueError, match=re.escape(message)):
        tg.grouped_mm(s.a, s.b, offs)


def test_eager_launches_memoised_per_signature_stay_right(device, highest_fp32):
    """Eager calls reuse checks and launch arithmetic per call signature: fresh values and new
    offs values of the same shape, another size, bad offs after good ones of the same
    signature (still checked on every call where checking is on), through tg.grouped_mm,
    torch.ops and the gradient path alike."""
    from torch_triton_gemm.ops import launcher

    dtype = torch.float16
    for form in ("m", "k"):
        for op in (tg.grouped_mm, torch.ops.tgemm.grouped_mm, tg.grouped_mm):
            s = make_sample(form, "nt", dtype, device)
            ref, written = reference(s.a, s.b, s.offs)
            assert_close_in_groups(op(s.a, s.b, s.offs), ref, written, dtype, s.name)
    s = make_sample("m", "nt", dtype, device, rows=30)
    ref, written = reference(s.a, s.b, s.offs)
    assert_close_in_groups(tg.grouped_mm(s.a, s.b, s.offs), ref, written, dtype, s.name)
    a, b = s.a.detach().clone().requires_grad_(), s.b.detach().clone().requires_grad_()
    grad = randn(ref.shape, dtype, device)
    tg.grouped_mm(a, b, s.offs).backward(grad)
    a64, b64 = s.a.double().requires_grad_(), s.b.double().requires_grad_()
    (reference(a64, b64, s.offs)[0] * written).backward(grad.double())
    assert rel_error(a.grad, a64.grad) <= 1e-2 and rel_error(b.grad, b64.grad) <= 1e-2
    if torch.device(device).type == "cpu":  # offs in host memory: checked by default
        bad = torch.tensor([5, 3, 20, 30], dtype=torch.int32, device=device)
        for _ in range(2):
            with pytest.raises(ValueError, match="offs must be non-decreasing"):
                tg.grouped_mm(s.a, s.b, bad)
    keys = [key for key in launcher._EAGER_LAUNCHES if key[0] == "tgemm::grouped_mm"]
    assert len(keys) >= 3


def test_bad_offs_unchecked_stay_in_bounds(device, monkeypatch):
    """With the value check off (the default for GPU tensors), any offs is clamped in the
    kernel: operands and output sit inside NaN-filled buffers, and no NaN is read into a group
    or written outside the output."""
    monkeypatch.setattr(grouped_launch, "offs_check_mode", lambda: "never")
    dtype = torch.float16
    for form, layout in (("m", "nt"), ("n", "nt"), ("k", "tn")):  # layouts TMA can load
        s = make_sample(form, layout, dtype, device)
        length = grouped_launch.grouped_length(form, s.a, s.b)
        for i, values in enumerate(([9, 3, 30, 41], [-5, 100, 2, 7], [length + 9] * G,
                                    [-1, -1, -1, -1])):
            pad = 7 + i % 2  # misaligned (pointer loaders) or 16-byte aligned (TMA) operands
            a, b = _inside_nan(s.a, pad), _inside_nan(s.b, pad)
            offs = torch.tensor(values, dtype=torch.int32, device=device)
            shape = tuple(reference(s.a, s.b, s.offs)[0].shape)
            store = _poisoned((2 * pad + _numel(shape),), dtype, device)
            out = store[pad:pad + _numel(shape)].view(shape)
            launch_grouped_mm(a, b, offs, None, out)
            clamped = torch.tensor(_clamped(values, length), dtype=torch.int32, device=device)
            ref, written = reference(s.a, s.b, clamped)
            assert_close_in_groups(out, ref, written, dtype, f"{form} {values}")
            assert out[~written].isnan().all(), f"{form} {values}: wrote outside the groups"
            assert store[:pad].isnan().all() and store[pad + out.numel():].isnan().all()
            # The op itself behaves the same, without raising.
            out = tg.grouped_mm(a, b, offs)
            assert_close_in_groups(out, ref, written, dtype, f"{form} {values} (op)")


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def _inside_nan(t: torch.Tensor, pad: int) -> torch.Tensor:
    """A copy of t, with t's strides, that lives inside a larger NaN-filled buffer."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    store = _poisoned((span + 2 * pad,), t.dtype, t.device.type)
    inner = store.as_strided(t.shape, t.stride(), pad)
    inner.copy_(t)
    return inner


def test_offs_check_setting(monkeypatch):
    for value, mode in (("1", "always"), ("always", "always"), ("0", "never"), ("", "auto"),
                        ("auto", "auto")):
        monkeypatch.setenv("TORCH_TRITON_GEMM_CHECK_OFFS", value)
        grouped_launch.offs_check_mode.cache_clear()
        assert grouped_launch.offs_check_mode() == mode
    grouped_launch.offs_check_mode.cache_clear()


# --- errors -------------------------------------------------------------------------------------

def _bad_inputs(device: str) -> list[tuple[tuple, dict, type[Exception], str]]:
    f16 = torch.float16
    a, b3 = randn((48, 40), f16, device), randn((4, 40, 24), f16, device)
    a3, b2 = randn((4, 20, 40), f16, device), randn((40, 24), f16, device)
    offs = torch.tensor([5, 5, 20, 40], dtype=torch.int32, device=device)
    return [
        ((randn((48,), f16, device), b3, offs), {}, RuntimeError,
         "tgemm::grouped_mm: a and b must be 2-D or 3-D, got a of shape (48,) and b of shape "
         "(4, 40, 24)"),
        ((a, b3, offs.long()), {}, ValueError,
         "tgemm::grouped_mm: offs must be int32, got torch.int64"),
        ((a, b3, offs.view(1, 4)), {}, RuntimeError,
         "tgemm::grouped_mm: offs must be 1-D [G], got shape (1, 4)"),
        ((a, b3, offs[:3]), {}, RuntimeError,
         "tgemm::grouped_mm: offs has 3 entries but b has 4 groups"),
        ((a3, b2, offs[:2]), {}, RuntimeError,
         "tgemm::grouped_mm: offs has 2 entries but a has 4 groups"),
        ((a, b3), {}, RuntimeError,
         "tgemm::grouped_mm: offs is required when a or b is 2-D (a is (48, 40), b is "
         "(4, 40, 24)): int32 cumulative ends of the groups along a's rows"),
        ((a3, b3, offs), {}, RuntimeError,
         "tgemm::grouped_mm: offs must be None for 3-D a and 3-D b"),
        ((a3, b3[:3]), {}, RuntimeError, "tgemm::grouped_mm: a has 4 groups but b has 3"),
        ((a, b3[:, :39], offs), {}, RuntimeError,
         "tgemm::grouped_mm: a has 40 columns but b has 39 rows (a is (48, 40), b is "
         "(4, 39, 24))"),
        ((a, b3.float(), offs), {}, ValueError,
         "tgemm::grouped_mm: a and b must have the same dtype, got a torch.float16 and b "
         "torch.float32"),
        ((a.double(), b3.double(), offs), {}, ValueError,
         "tgemm::grouped_mm: a has dtype torch.float64; supported"),
        ((a, b3.to("meta"), offs), {}, RuntimeError, "tgemm::grouped_mm: a is on"),
        ((a, b3, offs.to("meta")), {}, RuntimeError, "tgemm::grouped_mm: offs is on meta"),
        ((a, b3, offs, randn((24,), f16, device)), {}, RuntimeError,
         "tgemm::grouped_mm: bias must have shape (4, 24) ([G, N], a row per group), got (24,)"),
        ((a3, b2, offs, randn((4, 24), f16, device)), {}, RuntimeError,
         "tgemm::grouped_mm: bias must have shape (24,) (per column of out), got (4, 24)"),
        ((a, b3, offs, None, torch.int8), {}, ValueError,
         "tgemm::grouped_mm: out_dtype torch.int8 is not supported"),
        ((a3, b3), {"zero_tail": True}, ValueError,
         "tgemm::grouped_mm: zero_tail applies when a 2-D a or b is grouped by rows or columns"),
    ]


def _no_launch(*_args, **_kwargs):
    raise AssertionError("a kernel was launched for bad input")


@pytest.mark.parametrize("case", range(17))
def test_bad_input_raises_before_launch(device, case, monkeypatch):
    args, kwargs, error, message = _bad_inputs(device)[case]
    monkeypatch.setattr(grouped_module, "run_grouped_launch", _no_launch)
    with pytest.raises(error, match=re.escape(message)):
        tg.grouped_mm(*args, **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.tgemm.grouped_mm(*args, **kwargs)


# --- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_float64_autograd(device, form, dtype, highest_fp32):
    """Grads of a, b and bias against float64 autograd; inputs that reach no output (past
    offs[-1]) get exact zeros; the registered op's formula agrees bitwise with the eager one."""
    s = make_sample(form, "nt", dtype, device, bias=True)
    a, b, bias = (t.detach().requires_grad_() for t in (s.a, s.b, s.bias))
    out = tg.grouped_mm(a, b, s.offs, bias)
    ref_out, written = reference(s.a, s.b, s.offs, s.bias)
    grad_out = randn(tuple(out.shape), dtype, device)
    grads = torch.autograd.grad(out, (a, b, bias), grad_out)

    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref, _ = reference(a64, b64, s.offs, bias64)
    # Outputs past offs[-1] are undefined: their incoming gradient must not matter.
    ref_grads = torch.autograd.grad(ref, (a64, b64, bias64), grad_out.double() * written)
    for name, g, r, t in zip(("a", "b", "bias"), grads, ref_grads, (a, b, bias)):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        err = rel_error(g, r)
        assert err <= 2 * tolerance(dtype, dtype), f"{s.name} grad {name}: rel err {err:.3e}"
        unreached = r == 0
        assert torch.equal(g[unreached], torch.zeros_like(g[unreached])) or form == "none", name
    op_out = torch.ops.tgemm.grouped_mm(a, b, s.offs, bias)
    op_grads = torch.autograd.grad(op_out, (a, b, bias), grad_out)
    assert torch.equal(op_out[written], out[written])
    for g, op_g in zip(grads, op_grads):
        assert torch.equal(g, op_g)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # fp32 on purpose: the op has no fp64
@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_fp32(device, form, highest_fp32):
    s = make_sample(form, "row", torch.float32, device, bias=True, rows=8, k=3, n=2, groups=3)
    if s.offs is not None:  # an empty group, two others, a tail
        s.offs = torch.tensor([3, 3, 7], dtype=torch.int32, device=device)
    inputs = tuple(t.detach().requires_grad_() for t in (s.a, s.b, s.bias))
    assert torch.autograd.gradcheck(
        lambda a, b, bias: tg.grouped_mm(a, b, s.offs, bias, zero_tail=form in ("m", "n")),
        inputs, eps=1e-2, atol=5e-3, rtol=5e-3, nondet_tol=0.0, fast_mode=True)


def test_only_needed_gradients(device):
    s = make_sample("m", "nt", torch.float16, device)
    a = s.a.detach().requires_grad_()
    out = tg.grouped_mm(a, s.b, s.offs)
    (grad_a,) = torch.autograd.grad(out.sum(), (a,))
    assert grad_a.shape == a.shape and s.b.grad is None


# --- opcheck, fake tensors, graph capture ------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_opcheck(device, form):
    for requires_grad in (False, True):
        s = make_sample(form, "nt", torch.float16, device, bias=True, rows=24, k=16, n=16,
                        groups=2)
        args = [s.a, s.b, s.offs, s.bias]
        if requires_grad:
            args[0] = s.a.detach().requires_grad_()
            args[1] = s.b.detach().requires_grad_()
        zero_tail = form in ("m", "n")
        torch.library.opcheck(torch.ops.tgemm.grouped_mm.default, (*args, None, zero_tail))


def test_fake_tensors_and_traces_cuda():
    """Without the interpreter, the triton_op body traces on CUDA FakeTensors (no GPU needed):
    shapes, dtypes and strides of every form (and of the list op's fake), errors, and the Triton
    kernel with its grouped dimension in the functional trace."""
    script = textwrap.dedent("""
        import torch, torch_triton_gemm as tg
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx
        bf16 = torch.bfloat16

        def forms(x, w, offs, bias):
            return (
                tg.grouped_mm(x, w.transpose(-2, -1), offs, bias),
                tg.grouped_mm(w, x.t(), offs, out_dtype=torch.float32, zero_tail=True),
                tg.grouped_mm(x.t(), x, offs),
                tg.grouped_mm(w, w.transpose(-2, -1), None, bias),
            )

        with FakeTensorMode():
            x = torch.empty(96, 64, device="cuda", dtype=bf16)
            w = torch.empty(4, 48, 64, device="cuda", dtype=bf16)
            offs = torch.empty(4, device="cuda", dtype=torch.int32)
            bias = torch.empty(4, 48, device="cuda", dtype=bf16)
            for out in forms(x, w, offs, bias):
                print(tuple(out.shape), out.stride(), out.dtype, out.device.type)
            listed = tg.grouped_mm_list(
                [x, torch.empty(5, 48, device="cuda", dtype=bf16)],
                [x.t(), torch.empty(48, 7, device="cuda", dtype=bf16)])
            print([tuple(o.shape) for o in listed], listed[0].device.type)
            try:
                short = torch.empty(3, device="cuda", dtype=torch.int32)
                tg.grouped_mm(x, w.transpose(-2, -1), short)
            except RuntimeError as e:
                print("ERROR:", e)
        gm = make_fx(dispatch_functionalize(forms), tracing_mode="fake")(x, w, offs, bias)
        for node in gm.graph.nodes:
            if node.op == "call_function" and "triton_kernel" in str(node.target):
                kw = node.kwargs["kwargs"]
                print("kernel GROUPED=%s ZERO_TAIL=%s HAS_BIAS=%s" % (
                    kw["GROUPED"], kw["ZERO_TAIL"], kw["HAS_BIAS"]))
    """)
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; the GPU tests cover it on a GPU")
    out = _run_without_interpreter(script)
    assert out.strip().splitlines() == [
        "(96, 48) (48, 1) torch.bfloat16 cuda",
        "(48, 96) (96, 1) torch.float32 cuda",
        "(4, 64, 64) (4096, 64, 1) torch.bfloat16 cuda",
        "(4, 48, 48) (2304, 48, 1) torch.bfloat16 cuda",
        "[(96, 96), (5, 7)] cuda",
        "ERROR: tgemm::grouped_mm: offs has 3 entries but b has 4 groups (a is (96, 64), b is "
        "(4, 64, 48))",
        "kernel GROUPED=m ZERO_TAIL=False HAS_BIAS=True",
        "kernel GROUPED=n ZERO_TAIL=True HAS_BIAS=False",
        "kernel GROUPED=k ZERO_TAIL=False HAS_BIAS=False",
        "kernel GROUPED=none ZERO_TAIL=False HAS_BIAS=True",
    ]


def test_backward_traces_to_grouped_mm(device):
    """make_fx of a forward and backward pass: the backward is tgemm::grouped_mm again (input
    gradient with zero_tail, weight gradient in the 2-D x 2-D form, bias by a ones product)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def moe(x, w, offs, bias):
        y = tg.grouped_mm(x, w.transpose(-2, -1), offs, bias)
        return torch.autograd.grad(y.square().sum(), (x, w, bias))

    s = make_sample("m", "nt", torch.float32, device, bias=True)
    x, w, bias = (t.detach().requires_grad_() for t in (s.a, s.b.transpose(-2, -1), s.bias))
    gm = make_fx(moe, tracing_mode="fake")(x, w, s.offs, bias)
    calls = [n for n in gm.graph.nodes if n.target == torch.ops.tgemm.grouped_mm.default]
    shapes = [(tuple(n.args[0].meta["val"].shape), tuple(n.args[1].meta["val"].shape),
               n.kwargs.get("zero_tail", n.args[5] if len(n.args) > 5 else False))
              for n in calls]
    assert shapes == [
        ((ROWS, K), (G, K, N), False),   # forward
        ((ROWS, N), (G, N, K), True),    # grad x: 2-D x 3-D, zeros past offs[-1]
        ((K, ROWS), (ROWS, N), False),   # grad w: 2-D x 2-D, the contraction grouped
        ((1, ROWS), (ROWS, N), False),   # grad bias: ones x grad, per group
    ]


def _moe_step(x, w, offs):
    return torch.relu(tg.grouped_mm(x, w.transpose(-2, -1), offs)) * 2


def test_eager_backend_compile(device):
    """torch.compile (an eager backend, CPU-runnable) keeps both ops in one graph."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    s = make_sample("m", "nt", torch.float32, device)
    w = s.b.transpose(-2, -1)

    def f(x, w, offs, a_list, b_list):
        return _moe_step(x, w, offs), tg.grouped_mm_list(a_list, b_list)

    pairs = ([randn((5, 8), torch.float32, device)], [randn((8, 3), torch.float32, device)])
    compiled = torch.compile(f, backend=record, fullgraph=True)
    out, listed = compiled(s.a, w, s.offs, *pairs)
    assert "tgemm.grouped_mm" in graphs[0].code and "tgemm.grouped_mm_list" in graphs[0].code
    _, written = reference(s.a, s.b, s.offs)
    assert torch.equal(out[written], _moe_step(s.a, w, s.offs)[written])
    assert torch.equal(listed[0], tg.grouped_mm_list(*pairs)[0])


def test_torch_export_keeps_the_op(device):
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(randn((G, N, K), torch.float32, device))

        def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return tg.grouped_mm(x, self.weight.transpose(-2, -1), offs, zero_tail=True)

    model = Experts()
    x = randn((ROWS, K), torch.float32, device)
    offs = random_offs(ROWS, G, device)
    exported = torch.export.export(model, (x, offs))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "tgemm.grouped_mm.default" in targets
    with torch.no_grad():
        out = exported.module()(x, offs)
    ref, _ = reference(x, model.weight.transpose(-2, -1), offs)
    assert rel_error(out, ref) <= 2e-3


# --- the list form ------------------------------------------------------------------------------

LIST_SIZES = [(37, 45, 70), (64, 32, 64), (1, 33, 40), (0, 8, 8), (8, 0, 8), (5, 7, 0),
              (48, 32, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_list_matches_float64_reference(device, dtype, highest_fp32):
    """Pairs of any sizes and layouts in one launch; an all-aligned list takes the kernel's
    ALIGNED specialisation."""
    layouts = ["row", "nt", "col", "sliced", "broadcast", "row", "row"]
    a = [make_operand(m, k, dtype, device, layout, "a")
         for (m, _, k), layout in zip(LIST_SIZES, layouts)]
    b = [make_operand(k, n, dtype, device, layout, "b")
         for (_, n, k), layout in zip(LIST_SIZES, layouts)]
    aligned = ([randn((32, 16), dtype, device), randn((16, 48), dtype, device)],
               [randn((16, 32), dtype, device), randn((48, 16), dtype, device)])
    assert all(grouped_list_module._aligned(x, y, torch.empty(x.shape[0], y.shape[1]))
               for x, y in zip(*aligned))
    for xs, ys in ((a, b), aligned):
        outs = tg.grouped_mm_list(xs, ys)
        assert len(outs) == len(xs)
        for i, (x, y, out) in enumerate(zip(xs, ys, outs)):
            assert out.shape == (x.shape[0], y.shape[1]) and out.dtype == dtype, i
            err = rel_error(out, x.double() @ y.double())
            assert err <= tolerance(dtype, dtype), f"pair {i}: rel err {err:.3e}"
    assert tg.grouped_mm_list([], []) == []
    out = tg.grouped_mm_list(a[:2], b[:2], out_dtype=torch.float32)
    assert all(o.dtype == torch.float32 for o in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_list_gradients(device, dtype, highest_fp32):
    a = [randn((m, k), dtype, device).requires_grad_() for m, _, k in LIST_SIZES[:4]]
    b = [randn((n, k), dtype, device).t().detach().requires_grad_()
         for _, n, k in LIST_SIZES[:4]]
    outs = tg.grouped_mm_list(a, b)
    grad_outs = [randn(tuple(o.shape), dtype, device) for o in outs]
    grads = torch.autograd.grad(outs, a + b, grad_outs)
    refs = [x.detach().double().requires_grad_() for x in a + b]
    ref_outs = [x @ y for x, y in zip(refs[:4], refs[4:])]
    ref_grads = torch.autograd.grad(ref_outs, refs, [g.double() for g in grad_outs])
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == r.shape and rel_error(g, r) <= 2 * tolerance(dtype, dtype), i
    # Only the needed gradients: b alone.
    outs = tg.grouped_mm_list([x.detach() for x in a], b)
    assert len(torch.autograd.grad(outs[1].sum(), b[1:2])) == 1


def test_list_opcheck(device):
    for requires_grad in (False, True):
        a = [randn((9, 16), torch.float16, device), randn((4, 7), torch.float16, device)]
        b = [randn((16, 5), torch.float16, device), randn((7, 20), torch.float16, device)]
        if requires_grad:
            a = [x.requires_grad_() for x in a]
        torch.library.opcheck(torch.ops.tgemm.grouped_mm_list.default, (a, b, None))


def test_list_bad_input(device):
    f16 = torch.float16
    a, b = [randn((4, 8), f16, device)], [randn((8, 3), f16, device)]
    cases = [
        ((a, b + b), RuntimeError, "tgemm::grouped_mm_list: a has 1 matrices but b has 2"),
        ((a, [randn((7, 3), f16, device)]), RuntimeError,
         "tgemm::grouped_mm_list: a[0] has 8 columns but b[0] has 7 rows"),
        ((a + a, b + [b[0].float()]), ValueError,
         "tgemm::grouped_mm_list: every matrix must have a[0]'s dtype torch.float16, got a[1] "
         "torch.float16 and b[1] torch.float32"),
        ((a, [randn((2, 8, 3), f16, device)]), RuntimeError, "must be 2-D"),
        (([a[0].double()], [b[0].double()]), ValueError, "a[0] has dtype torch.float64"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            tg.grouped_mm_list(*args)


# --- GPU only -----------------------------------------------------------------------------------

def _moe_problem(tokens: int, experts: int, k: int, n: int, skewed: bool,
                 dtype: torch.dtype = torch.bfloat16):
    """Routed tokens x [T, K], expert weights w [G, N, K] (passed transposed), and offs; skewed
    counts follow a Zipf-like law with some experts empty."""
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    w = torch.randn(experts, n, k, device="cuda", dtype=dtype) / k**0.5
    if skewed:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        weights[::7] = 0
        counts = torch.distributions.Multinomial(tokens, weights / weights.sum()).sample()
    else:
        counts = torch.full((experts,), tokens // experts, dtype=torch.float64)
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    return x, w, offs


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True])
def test_gpu_moe_shapes_match_torch(skewed):
    x, w, offs = _moe_problem(4096, 16, 1024, 1536, skewed)
    out = tg.grouped_mm(x, w.transpose(-2, -1), offs)
    expected = torch._grouped_mm(x, w.transpose(-2, -1), offs)
    ref, written = reference(x, w.transpose(-2, -1), offs)
    assert rel_error(out[written], ref[written]) <= 1e-2
    assert rel_error(out[written], expected[written].double()) <= 1e-2
    # The weight-gradient form on the same routing.
    grad = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    wgrad = tg.grouped_mm(x.t(), grad, offs)
    ref_wgrad, _ = reference(x.t(), grad, offs)
    assert rel_error(wgrad, ref_wgrad) <= 1e-2
    assert rel_error(wgrad, torch._grouped_mm(x.t(), grad, offs).double()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,experts,n,block,skewed", [
    (2048, 8, 2048, (128, 256), False),  # long groups, wide output (128x256 where TMA loads)
    (2048, 8, 2048, (128, 256), True),   # groups ending inside tiles: stores clipped there
    (2048, 8, 1024, (128, 128), False),
    (2048, 8, 64, (128, 64), False),
    (512, 16, 512, (64, 128), False),    # T/G = 32 rows
    (64, 8, 256, (16, 128), False),      # T/G = 8 rows
])
def test_gpu_heuristic_tile_classes_match_torch(tokens, experts, n, block, skewed):
    x, w, offs = _moe_problem(tokens, experts, 512, n, skewed=skewed)
    s = GroupedSample(x, w.transpose(-2, -1), offs, None, "m", "moe")
    tile, _ = grouped_launch.choose_tile("m", experts, tokens, n, 2, _loaders(s)[0], 2, 132)
    if block == (128, 256) and not _loaders(s)[0]:
        block = (128, 128)  # GPUs without TMA
    assert (tile.block_m, tile.block_n) == block
    out = tg.grouped_mm(x, w.transpose(-2, -1), offs)
    ref, written = reference(x, w.transpose(-2, -1), offs)
    assert rel_error(out[written], ref[written]) <= 1e-2
    expected = torch._grouped_mm(x, w.transpose(-2, -1), offs)
    assert rel_error(out[written], expected[written].double()) <= 1e-2


def test_tma_stores_only_for_groups_of_many_tiles(monkeypatch):
    """C goes out through TMA where a group averages GROUPED_TMA_STORE_TILES_PER_SM output
    tiles per SM or more (Mixtral's weight gradient), through pointers for groups of a few
    tiles per SM (an MoE layer at 1024 tokens per expert, DeepSeek's 128-row groups), and
    always under the interpreter."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    wide = tuning.TileConfig(128, 256, 64, 16, 8, 3)
    assert tuning.grouped_tma_store(wide, 4096, 14336, 132)
    assert not tuning.grouped_tma_store(wide, 1024, 4096, 132)
    assert not tuning.grouped_tma_store(wide, 128, 2048, 132)
    tiles = tuning.GROUPED_TMA_STORE_TILES_PER_SM * 132
    assert tuning.grouped_tma_store(wide, 128 * tiles, 256, 132)
    assert not tuning.grouped_tma_store(wide, 128 * tiles - 128, 256, 132)
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: True)
    assert tuning.grouped_tma_store(wide, 16, 16, 132)


def _runtime_arg_index(name: str) -> int:
    """Where the grouped kernel's argument ``name`` sits in a GroupedLaunch's ``args`` (the
    runtime arguments after the tensors, from G on)."""
    names = grouped_launch.grouped_mm_kernel.arg_names
    return names.index(name) - names.index("G")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_gpu_weight_gradients_store_through_tma(tokens):
    """The weight-gradient form with few (128) and many (1024) tokens per expert and groups of
    many tiles, loading and storing through TMA where the GPU has it, in the wide tile: matches
    float64 and torch._grouped_mm, and the same bits run to run."""
    experts, k, n = 8, 4096, 6144  # 768 tiles of 128x256 per group: >= 4 per SM up to 192 SMs
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
    out = torch.full((experts, k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch = grouped_launch.prepare_grouped_launch(grouped_module.OP, x.t(), grad, offs, None,
                                                   out, False)
    tma = tgemm_device.supports_tma(x.device)
    c_tma = _runtime_arg_index("C_TMA")
    assert launch.tma == tma and launch.args[c_tma] == tma
    if tma:
        assert (launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]) == (128, 256)
    grouped_launch.run_grouped_launch(launch, x.t(), grad, offs, None, out, traceable=False)
    rows = tokens // experts
    ref = torch.stack([xg.double().t() @ gg.double()
                       for xg, gg in zip(x.split(rows), grad.split(rows))])
    assert rel_error(out, ref) <= 1e-2
    assert rel_error(out, torch._grouped_mm(x.t(), grad, offs).double()) <= 1e-2
    assert torch.equal(tg.grouped_mm(x.t(), grad, offs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("subtile", [1, 2])
def test_gpu_tma_stores_clip_at_group_ends(subtile):
    """The TMA store path forced on small groups (the heuristic keeps it for large ones): MoE
    rows routed unevenly (groups ending inside tiles, some empty, rows left after the last
    group) and the weight gradient of the same routing. Every group matches float64, and the
    rows after the last group keep their poison."""
    if not tgemm_device.supports_tma(torch.device("cuda")):
        pytest.skip("needs TMA (Hopper or newer)")
    x, w, offs = _moe_problem(1963, 8, 512, 2048, skewed=True)
    x = torch.cat([x, torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)])  # past offs
    grad = torch.randn(2000, 768, device="cuda", dtype=torch.bfloat16)
    c_tma = _runtime_arg_index("C_TMA")
    for a, b in ((x, w.transpose(-2, -1)), (x.t(), grad)):
        ref, written = reference(a, b, offs)
        out = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        launch = grouped_launch.prepare_grouped_launch(grouped_module.OP, a, b, offs, None,
                                                       out, False)
        assert launch.tma
        args = (*launch.args[:c_tma], True, subtile, *launch.args[c_tma + 2:])
        grouped_launch.run_grouped_launch(launch._replace(args=args), a, b, offs, None, out,
                                           traceable=False)
        assert rel_error(out[written], ref[written]) <= 1e-2
        assert out[~written].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", ["row", "nt", "tn", "sliced"])
def test_gpu_every_form_matches_torch(form, layout):
    s = make_sample(form, layout, torch.bfloat16, "cuda", bias=True, rows=2000, k=512, n=384,
                    groups=8)
    out = tg.grouped_mm(*s.args())
    ref, written = reference(*s.args())
    assert_close_in_groups(out, ref, written, torch.bfloat16, s.name)
    # torch's kernels need 16-byte aligned strides and group sizes (it asserts on the device
    # otherwise); ours take any, checked against float64 above.
    if layout != "sliced" and _torch_accepts_groups(s):
        expected = torch._grouped_mm(s.a, s.b, s.offs)
        out = tg.grouped_mm(s.a, s.b, s.offs)
        assert rel_error(out[written], expected[written].double()) <= 2e-2


@pytest.mark.gpu
def test_gpu_hopper_loads_through_tma():
    from torch_triton_gemm import device as tgemm_device

    if not tgemm_device.supports_tma(torch.device("cuda")):
        pytest.skip("needs sm_90+")
    x, w, offs = _moe_problem(512, 8, 256, 512, skewed=True)
    s = GroupedSample(x, w.transpose(-2, -1), offs, None, "m", "moe")
    assert _loaders(s) == (True, False, True)
    out = tg.grouped_mm(x, w.transpose(-2, -1), offs)
    pointer = torch.empty_like(out)
    launch_grouped_mm(x, w.transpose(-2, -1), offs, None, pointer, use_tma=False)
    _, written = reference(x, w.transpose(-2, -1), offs)
    assert rel_error(out[written], pointer[written]) <= 1e-2


def _moe_layer(x, w1, w2, offs):
    h = tg.grouped_mm(x, w1.transpose(-2, -1), offs, zero_tail=True)
    return tg.grouped_mm(torch.nn.functional.silu(h), w2.transpose(-2, -1), offs, zero_tail=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_inductor_fullgraph_forward_backward(dtype, highest_fp32):
    x, w1, offs = _moe_problem(1000, 8, 256, 384, skewed=True, dtype=dtype)
    w2 = torch.randn(8, 256, 384, device="cuda", dtype=dtype) / 384**0.5
    x, w1, w2 = (t.requires_grad_() for t in (x, w1, w2))
    compiled = torch.compile(_moe_layer, fullgraph=True)
    out = compiled(x, w1, w2, offs)
    grads = torch.autograd.grad(out.float().square().sum(), (x, w1, w2))
    eager = _moe_layer(x, w1, w2, offs)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), (x, w1, w2))
    budget = 2 * tolerance(dtype, dtype)
    assert rel_error(out, eager.double()) <= budget
    for g, e in zip(grads, eager_grads):
        assert rel_error(g, e.double()) <= budget


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_offs():
    """offs is read on the device: a captured launch follows new routing on replay (no host
    sync, no host copy of offs), under torch.cuda.graph and mode="reduce-overhead"."""
    x, w, offs = _moe_problem(768, 8, 128, 256, skewed=True)
    static_offs = offs.clone()
    tg.grouped_mm(x, w.transpose(-2, -1), static_offs, zero_tail=True)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tg.grouped_mm(x, w.transpose(-2, -1), static_offs, zero_tail=True)
    for _ in range(3):
        _, _, new_offs = _moe_problem(768, 8, 128, 256, skewed=True)
        static_offs.copy_(new_offs)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref, _ = reference(x, w.transpose(-2, -1), new_offs)
        assert rel_error(static_out, ref) <= 1e-2

    compiled = torch.compile(_moe_step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        _, _, new_offs = _moe_problem(768, 8, 128, 256, skewed=True)
        out = compiled(x, w, new_offs)
        ref, written = reference(x, w.transpose(-2, -1), new_offs)
        assert rel_error(out[written], (torch.relu(ref) * 2)[written]) <= 1e-2


@pytest.mark.gpu
def test_gpu_dynamic_shapes_do_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_moe_step, dynamic=True)
    for tokens in (300, 517, 1024, 2000):
        x, w, offs = _moe_problem(tokens, 8, 128, 256, skewed=True)
        ref, written = reference(x, w.transpose(-2, -1), offs)
        out = compiled(x, w, offs)
        assert rel_error(out[written], (torch.relu(ref) * 2)[written]) <= 1e-2
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_gpu_checked_offs_mode(monkeypatch):
    x, w, _ = _moe_problem(256, 4, 64, 128, skewed=False)
    bad = torch.tensor([64, 32, 200, 300], dtype=torch.int32, device="cuda")
    out = tg.grouped_mm(x, w.transpose(-2, -1), bad)  # default: clamped, no sync, no error
    ref, written = reference(x, w.transpose(-2, -1),
                             torch.tensor(_clamped(bad.tolist(), 256), dtype=torch.int32))
    assert rel_error(out[written], ref[written]) <= 1e-2
    monkeypatch.setattr(grouped_launch, "offs_check_mode", lambda: "always")
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        tg.grouped_mm(x, w.transpose(-2, -1), bad)


@pytest.mark.gpu
def test_gpu_int64_indexing_large_expert_weights():
    # b holds more than 2**31 elements, so offsets into it overflow int32.
    experts, k, n = 33, 8192, 8192
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(96, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([0] * (experts - 2) + [32, 96], dtype=torch.int32, device="cuda")
    out = tg.grouped_mm(x, w.transpose(-2, -1), offs)
    ref = torch.cat([x[:32].double() @ w[-2].double().t(), x[32:].double() @ w[-1].double().t()])
    assert rel_error(out, ref) <= 1e-2
    del w


@pytest.mark.gpu
def test_gpu_list_form_any_sizes():
    sizes = [(1024, 512, 256), (128, 4096, 64), (300, 77, 1000), (0, 64, 64), (1, 1, 1)]
    a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for m, _, k in sizes]
    b = [torch.randn(n, k, device="cuda", dtype=torch.float16).t() for _, n, k in sizes]
    for out, x, y in zip(tg.grouped_mm_list(a, b), a, b):
        assert rel_error(out, x.double() @ y.double()) <= 1e-2
    compiled = torch.compile(lambda a, b: [o.relu() for o in tg.grouped_mm_list(a, b)])
    for out, x, y in zip(compiled(a, b), a, b):
        assert rel_error(out, torch.relu(x.double() @ y.double())) <= 1e-2
