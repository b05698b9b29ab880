"""tgemm::scaled_grouped_mm: numerics per form and recipe, offs, scales, errors, opcheck, fake
tensors and graph capture.

Every case is checked against a float64 reference: the fp8 operands dequantized with their
scales, then multiplied group by group (torch._scaled_grouped_mm runs on CUDA only; the GPU
tests compare with it too). Without a GPU the kernels run on CPU tensors in Triton's
interpreter (see conftest.py); GPU-only tests carry the ``gpu`` marker.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass

import pytest
import torch
from samples import rel_error
from test_grouped_mm import make_sample, random_offs
from test_grouped_mm import reference as grouped_reference
from test_mm import _run_without_interpreter
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import tuning
from torch_triton_gemm.kernels import wgmma_fp8
from torch_triton_gemm.ops import grouped_launch
from torch_triton_gemm.ops import scaled_grouped_mm as sgmm_module
from torch_triton_gemm.ops.scaled_grouped_mm import _check_inputs, launch_scaled_grouped_mm

TESTS = os.path.dirname(os.path.abspath(__file__))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OP = "tgemm::scaled_grouped_mm"
FORMS = ["m", "n", "k", "none"]  # 2-D x 3-D, 3-D x 2-D, 2-D x 2-D, 3-D x 3-D
LAYOUTS = ["nt", "row", "tn", "sliced"]  # see test_grouped_mm.make_sample
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = 1e-2  # DESIGN.md: fp8 against the dequantized float64 reference
# Blockwise recipes: (rows of a, columns of b) per scale; "blockwise" is DeepSeek-V3's.
BLOCK_RECIPES = {"blockwise": (1, 128), "blockwise_1x128": (1, 1),
                 "blockwise_128x128": (128, 128)}

# Tiny sizes for the interpreter: the grouped dimension (45 entries, groups cut at random points,
# one empty, a tail after offs[-1]) and K (40 rowwise, 150 blockwise: a partial second scale
# block) are no multiples of 16 or of the interpreter's 32-wide tiles.
G, ROWS, K, N = 3, 45, 40, 24
BLOCK_K = 150


# --- samples and references ---------------------------------------------------------------------

@dataclass
class Sample:
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor | None
    form: str
    recipe: str
    bias: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False
    name: str = ""

    def args(self) -> tuple:
        return (self.a, self.b, self.scale_a, self.scale_b, self.offs, self.bias, None,
                self.out_dtype, self.use_fast_accum)


def extents(form: str, a: torch.Tensor, b: torch.Tensor,
            offs: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(G, M, N, K) of the full operands, as the contract describes them."""
    if form == "m":
        return b.shape[0], a.shape[0], b.shape[2], a.shape[1]
    if form == "n":
        return a.shape[0], a.shape[1], b.shape[1], a.shape[2]
    if form == "k":
        return offs.shape[0], a.shape[0], b.shape[1], a.shape[1]
    return a.shape[0], a.shape[1], b.shape[2], a.shape[2]


def make_scales(form: str, recipe: str, a: torch.Tensor, b: torch.Tensor,
                offs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh positive float32 scales of the shapes the recipe takes (the op multiplies by them
    whatever they are; quantization is not under test here)."""
    g, m, n, k = extents(form, a, b, offs)
    if recipe == "rowwise":
        shapes = {"m": ((m,), (g, n)), "n": ((g, m), (n,)), "k": ((g * m,), (g * n,)),
                  "none": ((g, m), (g, n))}[form]
    else:
        a_rows, b_cols = BLOCK_RECIPES[recipe]
        kb = -(-k // 128)
        shapes = ((*([g] if a.dim() == 3 else []), -(-m // a_rows), kb),
                  (*([g] if b.dim() == 3 else []), kb, -(-n // b_cols)))
    return tuple(torch.rand(shape, device=a.device) + 0.5 for shape in shapes)


def _blocks_expanded(scale: torch.Tensor, rows: int, cols: int,
                     shape: torch.Size) -> torch.Tensor:
    """Each [rows, cols] block's scale repeated over its block (last two dims), cut to shape."""
    full = scale.double().repeat_interleave(rows, -2).repeat_interleave(cols, -1)
    return full[..., :shape[-2], :shape[-1]]


def reference(s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, written) in float64: the dequantized operands multiplied group by group (see
    test_grouped_mm.reference), plus bias; written marks the outputs inside a group."""
    a, b = s.a.double(), s.b.double()
    sa, sb = s.scale_a.double(), s.scale_b.double()
    if s.recipe != "rowwise":
        a_rows, b_cols = BLOCK_RECIPES[s.recipe]
        a = a * _blocks_expanded(sa, a_rows, 128, a.shape)
        b = b * _blocks_expanded(sb, 128, b_cols, b.shape)
    elif s.form == "k":
        # Scales per group's rows and columns: they scale each group's [M, N] output.
        g, m, n, _ = extents(s.form, s.a, s.b, s.offs)
        out, written = grouped_reference(a, b, s.offs)
        out = out * sa.view(g, m)[:, :, None] * sb.view(g, n)[:, None, :]
        if s.bias is not None:
            out = out + s.bias.double()[:, None, :]
        return out, written
    elif s.form == "m":
        a, b = a * sa[:, None], b * sb[:, None, :]
    elif s.form == "n":
        a, b = a * sa[:, :, None], b * sb[None, :]
    else:
        a, b = a * sa[:, :, None], b * sb[:, None, :]
    return grouped_reference(a, b, s.offs, s.bias)


def make_scaled_sample(form: str, layout: str, recipe: str, dtype: torch.dtype, device: str,
                       k: int = K, rows: int = ROWS, n: int = N, groups: int = G,
                       bias: bool = False, out_dtype: torch.dtype | None = None,
                       fast: bool = False) -> Sample:
    g = make_sample(form, layout, dtype, device, rows=rows, k=k, n=n, groups=groups)
    scale_a, scale_b = make_scales(form, recipe, g.a, g.b, g.offs)
    bias_t = None
    if bias:
        shape = grouped_launch.bias_shape(form, g.a, g.b, g.offs)
        bias_t = torch.randn(shape, device=device, dtype=out_dtype or torch.bfloat16)
    name = f"{form}-{layout}-{recipe}-{str(dtype)[6:]}-{str(out_dtype)[6:]}" + (
        "-bias" if bias else "") + ("-fast" if fast else "")
    return Sample(g.a, g.b, scale_a, scale_b, g.offs, form, recipe, bias_t, out_dtype, fast,
                  name)


def sample_inputs(device: str) -> list[Sample]:
    """Every form x layout with rowwise scales (e5m2 on the sliced views), and the blockwise
    recipes on the forms they apply to; out dtypes, bias and both accumulation modes spread
    over them."""
    samples = []
    for form in FORMS:
        for i, layout in enumerate(LAYOUTS):
            dtype = E5M2 if layout == "sliced" else E4M3
            samples.append(make_scaled_sample(
                form, layout, "rowwise", dtype, device, bias=i % 2 == 0,
                out_dtype=(None, *OUT_DTYPES)[i], fast=i % 2 == 1))
        if form == "k":
            continue
        for i, recipe in enumerate(BLOCK_RECIPES):
            samples.append(make_scaled_sample(
                form, "nt", recipe, E4M3, device, k=BLOCK_K, bias=i == 0,
                out_dtype=OUT_DTYPES[i], fast=i == 1))
    return samples


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, written: torch.Tensor,
                  what: str) -> None:
    assert out.shape == ref.shape, what
    err = rel_error(out[written], ref[written])
    assert err <= TOLERANCE, f"{what}: rel err {err:.3e}"


# --- numerics -----------------------------------------------------------------------------------

def test_matches_float64_reference(device):
    """Every sample through the public function and the registered op, and launched into a
    NaN-filled buffer with each loader: every output inside a group written, none past
    offs[-1]."""
    for s in sample_inputs(device):
        ref, written = reference(s)
        out = tg.scaled_grouped_mm(*s.args())
        assert out.dtype == (s.out_dtype or torch.bfloat16) and out.is_contiguous(), s.name
        _assert_close(out, ref, written, s.name)
        op_out = torch.ops.tgemm.scaled_grouped_mm(*s.args())
        assert torch.equal(op_out[written], out[written]), s.name
        _, out_dtype, scales = _check_inputs(*s.args())
        for use_tma in (None, False):
            poisoned = _poisoned(tuple(ref.shape), out_dtype, device)
            launch_scaled_grouped_mm(s.a, s.b, scales, s.offs, s.bias, poisoned,
                                     use_tma=use_tma)
            _assert_close(poisoned, ref, written, f"{s.name} (use_tma={use_tma})")
            assert poisoned[~written].isnan().all(), f"{s.name}: wrote past offs[-1]"
            if use_tma is None:
                assert torch.equal(poisoned[written], out[written]), s.name


def test_scales_are_read_from_their_ranks(device):
    """One rank below the operand: rowwise ("outer", torch's); the operand's rank: blockwise,
    its block sizes read from the shapes."""
    for s in sample_inputs(device):
        _, _, scales = _check_inputs(*s.args())
        if s.recipe == "rowwise":
            assert (scales.mode, scales.fast_accum) == ("outer", s.use_fast_accum), s.name
        else:
            assert (scales.mode, scales.a_rows, scales.b_cols) == (
                "block", *BLOCK_RECIPES[s.recipe]), s.name


def test_scale_layouts_any_strides(device):
    """Scales are indexed logically: transposed-contiguous and sliced copies give the same
    bits."""
    s = make_scaled_sample("none", "nt", "rowwise", E4M3, device)
    out = tg.scaled_grouped_mm(*s.args())
    sa = s.scale_a.t().contiguous().t()
    sb = torch.empty(G, 2 * N, device=device)[:, ::2]
    sb.copy_(s.scale_b)
    again = tg.scaled_grouped_mm(s.a, s.b, sa, sb)
    assert torch.equal(again, out)
    s = make_scaled_sample("m", "nt", "blockwise", E4M3, device, k=BLOCK_K)
    _, written = reference(s)
    out = tg.scaled_grouped_mm(*s.args())
    sb = s.scale_b.transpose(-2, -1).contiguous().transpose(-2, -1)
    again = tg.scaled_grouped_mm(s.a, s.b, s.scale_a, sb, s.offs)
    assert torch.equal(again[written], out[written])


def test_fast_accum_within_tolerance(device):
    for form in FORMS:
        s = make_scaled_sample(form, "nt", "rowwise", E4M3, device, k=96)
        ref, written = reference(s)
        for fast in (False, True):
            out = tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs,
                                       out_dtype=torch.float32, use_fast_accum=fast)
            _assert_close(out, ref, written, f"{form} fast={fast}")


def test_default_out_dtype_is_bfloat16(device):
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device)
    out = tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs)
    assert out.dtype == torch.bfloat16


def test_group_edges(device):
    """Groups of one row, all rows in one group, every group empty, offs[-1] at the end."""
    t = 37
    for ends in ([1, 2, t], [0, 0, t], [0, 0, 0], [t - 1] * 3, [16, 32, t]):
        s = make_scaled_sample("m", "nt", "rowwise", E4M3, device, rows=t)
        s.offs = torch.tensor(ends, dtype=torch.int32, device=device)
        ref, written = reference(s)
        _assert_close(tg.scaled_grouped_mm(*s.args()), ref, written, str(ends))


def test_strided_offs_read_as_their_values(device):
    """offs as a strided view of a buffer holding other values in between means its values,
    as in torch._scaled_grouped_mm (the launch reads a contiguous copy)."""
    for form in ("m", "n"):
        s = make_scaled_sample(form, "nt", "rowwise", E4M3, device)
        ref, written = reference(s)
        buffer = torch.stack([s.offs, torch.full_like(s.offs, 10_000)], dim=1).reshape(-1)
        s.offs = buffer[::2]
        assert s.offs.stride(0) == 2
        _assert_close(tg.scaled_grouped_mm(*s.args()), ref, written, f"{form} strided offs")


def test_empty_problems(device):
    e4 = E4M3
    offs0 = torch.zeros(0, dtype=torch.int32, device=device)
    offs2 = torch.zeros(2, dtype=torch.int32, device=device)

    def fp8(*shape):
        return torch.randn(shape, device=device).to(e4)

    def ones(*shape):
        return torch.ones(shape, device=device)

    cases = [
        ((fp8(0, 8), fp8(2, 8, 16), ones(0), ones(2, 16), offs2), (0, 16)),  # no rows
        ((fp8(5, 8), fp8(0, 8, 16), ones(5), ones(0, 16), offs0), (5, 16)),  # no groups
        ((fp8(5, 8), fp8(8, 16), ones(0), ones(0), offs0), (0, 5, 16)),
        ((fp8(2, 5, 8), fp8(2, 8, 0), ones(2, 5), ones(2, 0), None), (2, 5, 0)),
    ]
    for args, shape in cases:
        assert tg.scaled_grouped_mm(*args).shape == shape
    # An empty contraction gives the bias.
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
    bias = torch.randn(2, 16, device=device)
    out = tg.scaled_grouped_mm(fp8(3, 0), fp8(2, 0, 16), ones(3), ones(2, 16), offs, bias,
                               out_dtype=torch.float32)
    assert torch.equal(out, torch.cat([bias[:1], bias[1:].expand(2, 16)]))


def test_zero_negative_and_non_finite_scales_are_used_as_given(device):
    """No host-side check: a zero scale zeroes its row, a negative one negates it, inf and NaN
    reach exactly the outputs they multiply; the other outputs do not change."""
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device)
    s.offs = torch.tensor([10, 10, ROWS], dtype=torch.int32, device=device)
    s.out_dtype = torch.float32
    base = tg.scaled_grouped_mm(*s.args())
    sa = s.scale_a.clone()
    sa[1], sa[2], sa[3], sa[4] = 0.0, -sa[2], float("inf"), float("nan")
    out = tg.scaled_grouped_mm(s.a, s.b, sa, s.scale_b, s.offs, out_dtype=torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[2], -base[2])
    assert (out[3].isinf() | out[3].isnan() | (out[3] == 0)).all()
    assert out[4].isnan().all()
    assert torch.equal(out[5:], base[5:]) and torch.equal(out[0], base[0])


def test_deterministic(device):
    for form in FORMS:
        s = make_scaled_sample(form, "nt", "rowwise", E4M3, device)
        ref, written = reference(s)
        first = tg.scaled_grouped_mm(*s.args())
        assert torch.equal(first[written], tg.scaled_grouped_mm(*s.args())[written]), form


def test_eager_launches_memoised_per_signature_stay_right(device):
    """Eager calls reuse checks and launch arithmetic per call signature: fresh values and new
    offs of the same shapes, another size, through tg.scaled_grouped_mm and torch.ops alike;
    an argument the checks refuse is refused after a good call of the same signature too."""
    from torch_triton_gemm.ops import launcher

    for op in (tg.scaled_grouped_mm, torch.ops.tgemm.scaled_grouped_mm, tg.scaled_grouped_mm):
        for form in ("m", "k"):
            s = make_scaled_sample(form, "nt", "rowwise", E4M3, device)
            ref, written = reference(s)
            _assert_close(op(*s.args()), ref, written, f"{form} {op}")
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device, rows=30)
    ref, written = reference(s)
    _assert_close(tg.scaled_grouped_mm(*s.args()), ref, written, "30 rows")
    for _ in range(2):
        with pytest.raises(ValueError, match="scale_result is not supported"):
            tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs,
                                 scale_result=torch.ones((), device=device))
    keys = [key for key in launcher._EAGER_LAUNCHES if key[0] == OP]
    assert len(keys) >= 3


# --- offs values --------------------------------------------------------------------------------

def test_bad_offs_values_raise_before_launch(device, monkeypatch):
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device)
    monkeypatch.setattr(sgmm_module, "run_grouped_launch", _no_launch)
    monkeypatch.setattr(grouped_launch, "offs_check_mode", lambda: "always")
    for values, message in (([5, 3, 20], "offs must be non-decreasing and start at 0 or more, "
                                          "got offs[1] = 3 after offs[0] = 5"),
                            ([5, 9, ROWS + 1], f"offs[-1] = {ROWS + 1} is past the end of "
                                               f"a's rows ({ROWS})")):
        offs = torch.tensor(values, dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match=re.escape(f"{OP}: {message}")):
            tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, offs)


def test_bad_offs_unchecked_stay_in_bounds(device, monkeypatch):
    """With the value check off, offs is clamped in the kernel (as for tgemm::grouped_mm): each
    end into [previous end, the dimension's end]."""
    monkeypatch.setattr(grouped_launch, "offs_check_mode", lambda: "never")
    for form in ("m", "k"):
        s = make_scaled_sample(form, "nt" if form == "m" else "tn", "rowwise", E4M3, device)
        for values in ([9, 3, 30], [ROWS + 9] * G):
            s.offs = torch.tensor(values, dtype=torch.int32, device=device)
            out = tg.scaled_grouped_mm(*s.args())
            clamped, previous = [], 0
            for end in values:
                previous = min(max(end, previous), ROWS)
                clamped.append(previous)
            s.offs = torch.tensor(clamped, dtype=torch.int32, device=device)
            ref, written = reference(s)
            _assert_close(out, ref, written, f"{form} {values}")


# --- errors -------------------------------------------------------------------------------------

def _bad_inputs(device: str) -> list[tuple[tuple, dict, type[Exception], str]]:
    def fp8(*shape, dtype=E4M3):
        return torch.randn(shape, device=device).to(dtype)

    def ones(*shape):
        return torch.ones(shape, device=device)

    a, b3 = fp8(45, 40), fp8(3, 40, 24)
    a3, b2 = fp8(3, 20, 40), fp8(40, 24)
    offs = torch.tensor([5, 5, 40], dtype=torch.int32, device=device)
    sa, sb = ones(45), ones(3, 24)
    return [
        ((fp8(45), b3, ones(45), sb, offs), {}, RuntimeError,
         f"{OP}: a and b must be 2-D or 3-D, got a of shape (45,)"),
        ((a.to(torch.bfloat16), b3.to(torch.bfloat16), sa, sb, offs), {}, ValueError,
         f"{OP}: a has dtype torch.bfloat16; supported: torch.float8_e4m3fn, "
         "torch.float8_e5m2"),
        ((a, b3.to(E5M2), sa, sb, offs), {}, ValueError,
         f"{OP}: a and b must have the same dtype, got a torch.float8_e4m3fn and b "
         "torch.float8_e5m2"),
        ((a, b3[:, :39], sa, sb, offs), {}, RuntimeError,
         f"{OP}: a has 40 columns but b has 39 rows (a is (45, 40), b is (3, 39, 24))"),
        ((a, b3, sa, sb, offs.long()), {}, ValueError, f"{OP}: offs must be int32"),
        ((a, b3, sa, sb), {}, RuntimeError, f"{OP}: offs is required when a or b is 2-D"),
        ((a3, fp8(3, 40, 24), ones(3, 20), sb, offs), {}, RuntimeError,
         f"{OP}: offs must be None for 3-D a and 3-D b"),
        ((a, b3, sa, sb, offs[:2]), {}, RuntimeError,
         f"{OP}: offs has 2 entries but b has 3 groups"),
        ((a, b3, sa.to(torch.bfloat16), sb, offs), {}, ValueError,
         f"{OP}: scale_a and scale_b must be float32 (rowwise or blockwise fp8 scales), got "
         "scale_a torch.bfloat16 and scale_b torch.float32"),
        ((a, b3, sa[:44], sb, offs), {}, RuntimeError,
         f"{OP}: rowwise scales for a (45, 40) and b (3, 40, 24) (G=3, M=45, N=24) are "
         "scale_a (45,) and scale_b (3, 24), got scale_a (44,) and scale_b (3, 24)"),
        ((a3, b2, ones(3, 20), ones(25), offs), {}, RuntimeError,
         f"{OP}: rowwise scales for a (3, 20, 40) and b (40, 24) (G=3, M=20, N=24) are "
         "scale_a (3, 20) and scale_b (24,)"),
        ((a.t(), a, ones(3 * 40), ones(40), offs), {}, RuntimeError,
         f"{OP}: rowwise scales for a (40, 45) and b (45, 40) (G=3, M=40, N=40) are "
         "scale_a (120,) and scale_b (120,)"),
        ((a, b3, ones(45, 1), sb, offs), {}, RuntimeError,
         f"{OP}: scale shapes fit no recipe: got scale_a (45, 1) and scale_b (3, 24)"),
        ((a.t(), a, ones(40, 1), ones(1, 40), offs), {}, ValueError,
         f"{OP}: blockwise scales do not apply to 2-D a x 2-D b"),
        ((a, b3, ones(45, 2), ones(3, 1, 1), offs), {}, RuntimeError,
         f"{OP}: blockwise scales for a (45, 40) and b (3, 40, 24) (G=3, M=45, N=24, K=40, "
         "kb = ceil(K/128) = 1) are scale_a (45, 1) (1x128 blocks) or (1, 1) (128x128), and "
         "scale_b (3, 1, 24) (1x128) or (3, 1, 1) (128x128); got scale_a (45, 2)"),
        ((a, b3, ones(45, 1), ones(1, 1), offs), {}, RuntimeError,
         f"{OP}: scale shapes fit no recipe"),
        ((a, b3, sa, sb, offs), {"scale_result": ones()}, ValueError,
         f"{OP}: scale_result is not supported (torch._scaled_grouped_mm does not support it "
         "either)"),
        ((a, b3, sa, sb, offs), {"out_dtype": E4M3}, ValueError,
         f"{OP}: out_dtype torch.float8_e4m3fn is not supported"),
        ((a, b3, sa, sb, offs, ones(24)), {}, RuntimeError,
         f"{OP}: bias must have shape (3, 24) ([G, N], a row per group), got (24,)"),
        ((a, b3, sa, sb, offs, ones(3, 24).int()), {}, ValueError,
         f"{OP}: bias has dtype torch.int32"),
        ((a, b3, sa.to("meta"), sb, offs), {}, RuntimeError, f"{OP}: scale_a is on meta but a"),
    ]


def _no_launch(*_args, **_kwargs):
    raise AssertionError("a kernel was launched for bad input")


@pytest.mark.parametrize("case", range(21))
def test_bad_input_raises_before_launch(device, case, monkeypatch):
    args, kwargs, error, message = _bad_inputs(device)[case]
    monkeypatch.setattr(sgmm_module, "run_grouped_launch", _no_launch)
    with pytest.raises(error, match=re.escape(message)):
        tg.scaled_grouped_mm(*args, **kwargs)
    # The registered op (and so its fake) runs the same checks.
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.tgemm.scaled_grouped_mm(*args, **kwargs)


def test_bad_inputs_cover_every_case(device):
    assert len(_bad_inputs(device)) == 21


@pytest.mark.parametrize("which", ["a", "scale_a", "bias"])
def test_gradients_refused(device, which):
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device, bias=True)
    tensors = {"a": s.a, "scale_a": s.scale_a, "bias": s.bias}
    tensors[which].requires_grad_()
    message = (f"{OP}: {which} ({tensors[which].dtype}) requires grad, but scaled_grouped_mm "
               "has no gradients")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        tg.scaled_grouped_mm(*s.args())
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.tgemm.scaled_grouped_mm(*s.args())
    with torch.no_grad():  # without autograd there is nothing to refuse
        tg.scaled_grouped_mm(*s.args())


# --- opcheck, fake tensors, graph capture ------------------------------------------------------

def _make_exact(s: Sample) -> None:
    """Small integers for the operands and bias, powers of two for the scales, so that every
    sum is exact whatever the kernel. opcheck compares eager outputs with traced ones
    elementwise; traced calls with dynamic shapes run another tile, whose fp8 tensor-core sums
    round differently from the eager tile's (Hopper accumulates fp8 products with fewer bits
    than fp32), and where the bias cancels the product that differs by more than opcheck's
    bf16 tolerance (H100: one output in ~7 random samples)."""
    for t, low, high in ((s.a, -4, 5), (s.b, -4, 5), (s.bias, -8, 9)):
        t.copy_(torch.randint(low, high, t.shape, device=t.device).float().to(t.dtype))
    for t in (s.scale_a, s.scale_b):
        t.copy_(torch.exp2(torch.randint(-2, 3, t.shape, device=t.device).float()))


@pytest.mark.parametrize("form", FORMS)
def test_opcheck(device, form):
    recipes = ("rowwise",) if form == "k" else ("rowwise", "blockwise")
    for recipe in recipes:
        s = make_scaled_sample(form, "nt", recipe, E4M3, device, bias=True, rows=24, k=16, n=16,
                               groups=2)
        if form in ("m", "n"):  # outputs past offs[-1] are unwritten: end the groups there
            s.offs[-1] = 24
        _make_exact(s)
        # test_schema compares inputs before and after with torch.allclose, which fp8 tensors
        # do not support; test_op_neither_mutates_nor_aliases checks the same by bytes.
        torch.library.opcheck(
            torch.ops.tgemm.scaled_grouped_mm.default, s.args(),
            test_utils=("test_autograd_registration", "test_faketensor",
                        "test_aot_dispatch_dynamic"))


def test_op_neither_mutates_nor_aliases(device):
    s = make_scaled_sample("m", "nt", "blockwise", E4M3, device, bias=True, k=BLOCK_K)
    inputs = (s.a, s.b, s.scale_a, s.scale_b, s.offs, s.bias)
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone()
              for t in inputs]
    out = torch.ops.tgemm.scaled_grouped_mm(*s.args())
    for t, saved in zip(inputs, before):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, saved)
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def _fake_forms():
    """(args, kwargs) of each form as CUDA FakeTensors; create inside a FakeTensorMode."""
    def e(*shape, dtype=E4M3):
        return torch.empty(*shape, device="cuda", dtype=dtype)

    f32 = torch.float32
    x, w = e(96, 64), e(4, 48, 64)
    offs = e(4, dtype=torch.int32)
    return {
        "m": ((x, w.transpose(-2, -1), e(96, dtype=f32), e(4, 48, dtype=f32), offs,
               e(4, 48, dtype=torch.bfloat16)), {}),
        "n": ((w, x.t(), e(4, 48, dtype=f32), e(96, dtype=f32), offs),
              {"out_dtype": torch.float32}),
        "k": ((x.t(), x, e(4 * 64, dtype=f32), e(4 * 64, dtype=f32), offs), {}),
        "none": ((w, w.transpose(-2, -1), e(4, 48, dtype=f32), e(4, 48, dtype=f32)),
                 {"use_fast_accum": True}),
        "m-blockwise": ((x, w.transpose(-2, -1), e(96, 1, dtype=f32), e(4, 1, 1, dtype=f32),
                         offs), {"out_dtype": torch.float16}),
    }


def test_fake_tensor_propagation_cuda():
    expected = {"m": ((96, 48), (48, 1), torch.bfloat16),
                "n": ((48, 96), (96, 1), torch.float32),
                "k": ((4, 64, 64), (4096, 64, 1), torch.bfloat16),
                "none": ((4, 48, 48), (2304, 48, 1), torch.bfloat16),
                "m-blockwise": ((96, 48), (48, 1), torch.float16)}
    with FakeTensorMode():
        for name, (args, kwargs) in _fake_forms().items():
            out = tg.scaled_grouped_mm(*args, **kwargs)
            assert (tuple(out.shape), out.stride(), out.dtype) == expected[name], name
            assert out.device.type == "cuda"
        args, _ = _fake_forms()["m"]
        short = torch.empty(3, device="cuda", dtype=torch.int32)
        with pytest.raises(RuntimeError, match="offs has 3 entries but b has 4 groups"):
            tg.scaled_grouped_mm(*args[:4], short)


def test_traced_without_interpreter_exposes_the_kernel():
    """With compiled Triton (CUDA FakeTensors on a GPU-less host), tgemm::scaled_grouped_mm is
    a triton_op: functional tracing sees the grouped kernel, its form and its scaling."""
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; the GPU tests cover it on a GPU")
    script = f"import sys; sys.path.insert(0, {TESTS!r})\n" + textwrap.dedent("""
        import torch, torch_triton_gemm as tg, test_scaled_grouped_mm as t
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx
        with FakeTensorMode():
            forms = t._fake_forms()
        for name, (args, kwargs) in forms.items():
            f = lambda *args: tg.scaled_grouped_mm(*args, **kwargs) * 2
            gm = make_fx(dispatch_functionalize(f), tracing_mode="fake")(*args)
            for node in gm.graph.nodes:
                if "triton_kernel" in str(node.target):
                    kw = node.kwargs["kwargs"]
                    print(name, kw["GROUPED"], kw["SCALING"], kw["SA_ROWS"], kw["SB_COLS"],
                          kw["FAST_ACCUM"], kw["HAS_BIAS"])
    """)
    out = _run_without_interpreter(script)
    assert out.strip().splitlines() == [
        "m m outer 1 1 False True",
        "n n outer 1 1 False False",
        "k k outer 1 1 False False",
        "none none outer 1 1 True False",
        "m-blockwise m block 1 128 False False",
    ], out


_COMPILE_SCRIPT = """
from hopper_compile import compile_for as compile_for_sm90
from torch_triton_gemm.kernels.grouped import grouped_mm_kernel as kernel

def compile_for(scaling, fast, a_rows, b_cols, tile):
    block_m, block_n, block_k, num_warps, num_stages = tile
    # The MoE forward's layout: x row-major, expert weights [G, N, K] passed transposed.
    constants = dict(
        GROUPED="m", ZERO_TAIL=False, HAS_BIAS=False, bias_ptr=None, SCALING=scaling,
        SA_ROWS=a_rows, SB_COLS=b_cols, FAST_ACCUM=fast, USE_TMA=True, A_M_CONTIGUOUS=False,
        B_K_CONTIGUOUS=True, C_TMA=True, EPILOGUE_SUBTILE=2, INPUT_PRECISION=None,
        UPCAST_TO_FP32=False, INDEX_64=False, ROUTE="none", GATE="none",
        rows_ptr=None, pre_ptr=None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, stride_ak=1, stride_bk=1, stride_cn=1)
    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16",
                "offs_ptr": "*i32", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
    aligned = ["a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bn", "stride_cm", "stride_bg",
               "K", "N"]
    compiled = compile_for_sm90(kernel, pointers, constants, aligned, num_warps=num_warps,
                                num_stages=num_stages)
    ir = compiled.asm["ttgir"]
    print(scaling, fast, "warp_group_dot" in ir,
          "tma" if "tensor_desc" in ir or "async_tma" in ir else "pointers",
          compiled.metadata.shared > 0)

compile_for("outer", False, 1, 1, (128, 128, 128, 8, 3))
compile_for("outer", True, 1, 1, (128, 256, 128, 8, 3))
compile_for("block", False, 1, 128, (128, 128, 128, 8, 3))
"""


def test_kernel_compiles_for_hopper():
    """Triton compiles the scaled grouped kernel for sm_90 without a GPU: rowwise (both
    accumulation modes) and blockwise scales on the MoE forward's TMA path, with Hopper's wgmma
    and shared-memory stages."""
    if torch.cuda.is_available():
        pytest.skip("compiles for a fixed GPU target on a GPU-less host; the GPU tests run it")
    out = _run_without_interpreter(_COMPILE_SCRIPT).split("\n")
    assert out[:3] == ["outer False True tma True", "outer True True tma True",
                       "block False True tma True"], out


def test_fp32_step_products_take_128_wide_tiles(monkeypatch):
    """Where every K step's product is added in fp32 (rowwise without fast accumulation,
    blockwise), the grouped heuristic keeps to 128x128 tiles: 128x256 ones spill registers
    (see tuning.heuristic_grouped_tile); with fast accumulation wide MoE outputs keep them."""
    monkeypatch.setattr(tuning._device, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning._device, "shared_memory_per_block", lambda index: 232448)
    for fp32_steps, block_n in ((False, 256), (True, 128)):
        tile, _ = grouped_launch.choose_tile("m", 8, 32768, 14336, 1, True, 0, 132, fp32_steps)
        assert (tile.block_m, tile.block_n, tile.block_k) == (128, block_n, 128)
        assert tuning.shared_memory_bytes(tile, 1) <= 232448


def test_eager_backend_compile(device):
    """torch.compile (an eager backend, CPU-runnable, fullgraph) keeps the op as one node."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def f(a, b, sa, sb, offs):
        return torch.relu(tg.scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.float32)) + 1

    s = make_scaled_sample("m", "nt", "rowwise", E4M3, device)
    s.offs = torch.tensor([10, 20, ROWS], dtype=torch.int32, device=device)
    out = torch.compile(f, backend=record, fullgraph=True)(s.a, s.b, s.scale_a, s.scale_b,
                                                           s.offs)
    assert "tgemm.scaled_grouped_mm" in graphs[0].code
    assert torch.equal(out, f(s.a, s.b, s.scale_a, s.scale_b, s.offs))


# --- GPU only -----------------------------------------------------------------------------------

def _aligned_sample(form: str, recipe: str, tokens: int, k: int, n: int, groups: int,
                    empty_group: bool) -> Sample:
    """A problem in torch._scaled_grouped_mm's layouts (a row-major, b column-major) with group
    sizes that are multiples of 16, as its kernels need (they assert on the device otherwise,
    which ends the process's use of the GPU); an empty group where asked."""
    s = make_scaled_sample(form, "nt" if form != "k" else "row", recipe, E4M3, "cuda",
                           k=k, rows=tokens, n=n, groups=groups)
    if form == "k":
        s.b = s.b.t().contiguous().t()
    if s.offs is not None:
        sizes = torch.full((groups,), tokens // groups // 16 * 16, dtype=torch.int32)
        if empty_group:
            sizes[0] += sizes[1]
            sizes[1] = 0
        s.offs = sizes.cumsum(0).to(device="cuda", dtype=torch.int32)
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_matches_torch_scaled_grouped_mm(form, fast):
    """The same operands and scales through torch._scaled_grouped_mm (sm_90's CUTLASS kernels;
    sm_100 too), in both accumulation modes: both within the budget of the float64 reference
    and close to each other."""
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip("torch._scaled_grouped_mm runs on sm_90 / sm_100 only")
    # torch's weight-gradient form asserts on empty groups; the others take them.
    s = _aligned_sample(form, "rowwise", 2048, 512, 384, 8, empty_group=form != "k")
    ref, written = reference(s)
    ours = tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs, use_fast_accum=fast)
    try:
        theirs = torch._scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs,
                                          use_fast_accum=fast)
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"this torch build's _scaled_grouped_mm refuses the {form} form: {e}")
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.bfloat16
    _assert_close(ours, ref, written, "tgemm")
    _assert_close(theirs, ref, written, "torch")
    assert rel_error(ours[written], theirs[written].double()) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "blockwise_128x128"])
def test_gpu_larger_shapes(form, fast, recipe):
    if form == "k" and recipe != "rowwise":
        pytest.skip("blockwise scales do not apply to groups along K")
    for tokens, k, n, layout in ((2000, 1024, 768, "nt"), (999, 384, 1003, "row"),
                                 (64, 4096, 512, "nt")):
        if form == "k":
            layout = "tn"  # the weight gradient's layout (x.t() against grad_out)
        s = make_scaled_sample(form, layout, recipe, E4M3, "cuda", k=k, rows=tokens, n=n,
                               groups=8, bias=True, fast=fast)
        for out_dtype in OUT_DTYPES:
            s.out_dtype = out_dtype
            s.bias = s.bias.to(out_dtype)
            ref, written = reference(s)
            _assert_close(tg.scaled_grouped_mm(*s.args()), ref, written,
                          f"{tokens}x{k}x{n} {layout} {out_dtype}")


@pytest.mark.gpu
def test_gpu_hopper_loads_through_tma():
    if not tgemm_device.supports_tma(torch.device("cuda")):
        pytest.skip("needs sm_90+")
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, "cuda", k=512, rows=1024, n=1024,
                           groups=8)
    _, _, scales = _check_inputs(*s.args())
    out = torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)
    launch = grouped_launch.prepare_grouped_launch(OP, s.a, s.b, s.offs, None, out, False,
                                                   None, scales)
    assert launch.tma
    ref, written = reference(s)
    _assert_close(tg.scaled_grouped_mm(*s.args()), ref, written, "tma")
    launch_scaled_grouped_mm(s.a, s.b, scales, s.offs, None, out, use_tma=False)
    _assert_close(out, ref, written, "pointers")


def _moe_fp8(x, wq, xs, ws, offs):
    return torch.nn.functional.silu(tg.scaled_grouped_mm(x, wq, xs, ws, offs)) * 2


@pytest.mark.gpu
def test_gpu_inductor_fullgraph_matches_eager():
    s = _aligned_sample("m", "rowwise", 1024, 256, 384, 8, empty_group=True)
    args = (s.a, s.b, s.scale_a, s.scale_b, s.offs)
    eager = _moe_fp8(*args)
    compiled = torch.compile(_moe_fp8, fullgraph=True)(*args)
    ref, written = reference(s)
    assert rel_error(compiled[written], eager[written].double()) <= TOLERANCE
    assert rel_error(compiled[written],
                     (torch.nn.functional.silu(ref) * 2)[written]) <= TOLERANCE


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_offs():
    """offs is read on the device: a captured launch follows new routing on replay (no host
    sync), under torch.cuda.graph and mode="reduce-overhead"."""
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, "cuda", k=128, rows=768, n=256,
                           groups=8)
    static_offs = s.offs.clone()
    tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, static_offs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tg.scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, static_offs)
    compiled = torch.compile(_moe_fp8, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        new_offs = random_offs(768, 8, "cuda")
        static_offs.copy_(new_offs)
        s.scale_a.copy_(torch.rand_like(s.scale_a) + 0.5)
        graph.replay()
        s.offs = new_offs
        ref, written = reference(s)
        _assert_close(static_out, ref, written, "graph replay")
        out = compiled(s.a, s.b, s.scale_a, s.scale_b, new_offs)
        assert rel_error(out[written], (torch.nn.functional.silu(ref) * 2)[written]) <= TOLERANCE


@pytest.mark.gpu
def test_gpu_dynamic_shapes_do_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_moe_fp8, dynamic=True)
    for tokens in (300, 517, 1024, 2000):
        s = make_scaled_sample("m", "nt", "rowwise", E4M3, "cuda", k=128, rows=tokens, n=256,
                               groups=8)
        ref, written = reference(s)
        out = compiled(s.a, s.b, s.scale_a, s.scale_b, s.offs)
        assert rel_error(out[written], (torch.nn.functional.silu(ref) * 2)[written]) <= TOLERANCE
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,n", [(2048, 512, 2048), (6000, 528, 2304)],
                         ids=["2048x512x2048", "6000x528x2304"])
def test_gpu_precise_kernel_on_hopper(tokens, k, n):
    """Eager MoE-forward products with rowwise scales and precise accumulation on an sm_90 GPU
    run Hopper's warp-specialized kernel (two and three consumer warpgroups here): uneven
    groups (one empty, sizes not multiples of 64), a bias per group, fp32 and bf16 out. Every
    row inside a group written (NaN-poisoned output), rows past the last group left alone; fp32
    out within 1e-3 of float64 (promotion every 128 of K), and without bias as close to float64
    as torch._scaled_grouped_mm's precise mode (within 1.25x its error)."""
    if torch.cuda.get_device_capability() != (9, 0) or not wgmma_fp8.AVAILABLE:
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    groups = 8
    s = make_scaled_sample("m", "nt", "rowwise", E4M3, "cuda", k=k, rows=tokens, n=n,
                           groups=groups, bias=True)
    sizes = torch.tensor([tokens // groups + 37 * (i % 3) - 24 for i in range(groups)])
    sizes[2] = 0
    sizes = sizes // 16 * 16  # torch's kernels want multiples of 16
    s.offs = sizes.cumsum(0).to(device="cuda", dtype=torch.int32)
    last = int(s.offs[-1])
    assert last < tokens
    for out_dtype in (torch.float32, torch.bfloat16):
        s.out_dtype = out_dtype
        s.bias = s.bias.to(out_dtype)
        _, _, scales = _check_inputs(*s.args())
        out = _poisoned((tokens, n), out_dtype, "cuda")
        launch = grouped_launch.prepare_fp8_grouped_precise(s.a, s.b, s.offs, s.bias, out,
                                                            scales)
        assert launch is not None and launch.kernel is wgmma_fp8.fp8_grouped_precise_kernel
        grouped_launch.run_grouped_launch(launch, s.a, s.b, s.offs, s.bias, out, False,
                                          s.scale_a, s.scale_b)
        ref, written = reference(s)
        assert torch.isnan(out[last:]).all()  # past the last group: not written
        budget = 1e-3 if out_dtype == torch.float32 else TOLERANCE
        assert rel_error(out[written], ref[written]) <= budget, out_dtype
        assert rel_error(tg.scaled_grouped_mm(*s.args())[written], ref[written]) <= budget
    s.bias, s.out_dtype = None, None
    ref, written = reference(s)
    ours = tg.scaled_grouped_mm(*s.args())
    theirs = torch._scaled_grouped_mm(s.a, s.b, s.scale_a, s.scale_b, s.offs)
    theirs_err = rel_error(theirs[written], ref[written])
    assert rel_error(ours[written], ref[written]) <= 1.25 * theirs_err + 1e-7
