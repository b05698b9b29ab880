"""tgemm::scaled_mm: numerics per recipe, scale semantics, errors, gradients, opcheck, fake tensors.

Every case is checked against a float64 dequantize-then-matmul reference. Without a GPU the
kernels run on CPU tensors in Triton's interpreter (see conftest.py); GPU-only tests carry the
``gpu`` marker.
"""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from dataclasses import dataclass

import pytest
import torch
from samples import rel_error
from test_mm import _run_without_interpreter
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_triton_gemm as tg
from torch_triton_gemm import device as tgemm_device
from torch_triton_gemm import tuning
from torch_triton_gemm.ops.scaled_mm import _check_inputs, launch_scaled_mm
from torch_triton_gemm.quantize import RECIPES as QUANTIZE_RECIPES
from torch_triton_gemm.quantize import dequantize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E4M3, E5M2, FP4 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2
TOLERANCE = 1e-2  # DESIGN.md: fp8 against the dequantized float64 reference

# (recipe of a, recipe of b, fp8 dtype of a, fp8 dtype of b, K): one row per recipe family. K is
# a multiple of 128 for blockwise (200, a partial last scale block, is covered below), of the
# scale block for the microscaled recipes, and odd where any K is allowed.
RECIPES = [
    ("tensorwise", "tensorwise", E4M3, E4M3, 70),
    ("tensorwise", "tensorwise", E5M2, E5M2, 45),
    ("rowwise", "rowwise", E4M3, E5M2, 70),
    ("blockwise", "blockwise", E4M3, E4M3, 256),  # 1x128 x 128x128 (DeepSeek-V3)
    ("blockwise_1x128", "blockwise_1x128", E4M3, E4M3, 256),
    ("blockwise_128x128", "blockwise_1x128", E4M3, E4M3, 256),
    ("blockwise_128x128", "blockwise_128x128", E4M3, E4M3, 200),
    ("mxfp8", "mxfp8", E4M3, E4M3, 96),
    ("mxfp8", "mxfp8", E5M2, E4M3, 64),
    ("mxfp4", "mxfp4", None, None, 96),
    ("mxfp8", "mxfp4", E4M3, None, 64),
    ("nvfp4", "nvfp4", None, None, 48),  # a masked K remainder after one 32-wide step
]
B_LAYOUTS = ("nt", "row")  # b as W.t() (K-major, what quantize returns) and b row-major [K, N]


def _recipe_id(row) -> str:
    ra, rb, da, db, k = row
    name = ra if ra == rb else f"{ra}x{rb}"
    dtypes = "-".join(str(d).split("_")[1] for d in (da, db) if d is not None)
    return f"{name}-{dtypes}-K{k}" if dtypes else f"{name}-K{k}"


@dataclass
class ScaledSample:
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    recipe_a: str
    recipe_b: str
    bias: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    name: str = ""

    def args(self) -> tuple:
        return (self.a, self.b, self.scale_a, self.scale_b, self.bias, self.out_dtype)

    def reference(self) -> torch.Tensor:
        return reference(self.a, self.b, self.scale_a, self.scale_b, self.recipe_a,
                         self.recipe_b, self.bias)


def reference(a, b, scale_a, scale_b, recipe_a, recipe_b, bias=None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias in float64 (dequantize, then matmul)."""
    out = dequantize(a, scale_a, recipe_a, "a") @ dequantize(b, scale_b, recipe_b, "b")
    if bias is not None:
        out = out + bias.double()
    return out


def quantized_pair(m: int, n: int, k: int, recipe_a: str, recipe_b: str, device: str,
                   dtype_a=E4M3, dtype_b=E4M3, b_layout: str = "nt"):
    """Fresh random a [M, K] and b [K, N] (b = W.t()), quantized with each recipe."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    a, sa = tg.quantize(x, recipe_a, "a", dtype=dtype_a or E4M3)
    b, sb = tg.quantize(w.t(), recipe_b, "b", dtype=dtype_b or E4M3)
    if b_layout == "row":
        b = b.contiguous()
    return a, b, sa, sb


def sample_inputs(device: str, requires_grad: bool = False) -> list[ScaledSample]:
    """Recipes x out dtypes x b layouts at odd M and N, a bias on every other sample."""
    samples = []
    bias_dtypes = (torch.bfloat16, torch.float32, torch.float16)
    for i, row in enumerate(RECIPES):
        ra, rb, da, db, k = row
        for j, out_dtype in enumerate(OUT_DTYPES):
            for layout in B_LAYOUTS:
                m, n = 37, 21
                a, b, sa, sb = quantized_pair(m, n, k, ra, rb, device, da, db, layout)
                bias = None
                if (i + j) % 2 == 0:
                    bias = torch.randn(n, device=device, dtype=bias_dtypes[(i + j) % 3])
                    bias.requires_grad_(requires_grad)
                samples.append(ScaledSample(
                    a, b, sa, sb, ra, rb, bias, out_dtype,
                    name=f"{_recipe_id(row)}-{str(out_dtype)[6:]}-{layout}"))
    return samples


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# --- numerics -----------------------------------------------------------------------------------

def test_matches_float64_reference(device):
    """Every recipe x out dtype x b layout, through the public function, the registered op and a
    launch into a NaN-filled buffer (every element must be written)."""
    for s in sample_inputs(device):
        ref = s.reference()
        out = tg.scaled_mm(*s.args())
        assert out.shape == ref.shape and out.dtype == s.out_dtype, s.name
        assert out.is_contiguous(), s.name
        err = rel_error(out, ref)
        assert err <= TOLERANCE, f"{s.name}: rel err {err:.3e}"
        assert torch.equal(torch.ops.tgemm.scaled_mm(*s.args()), out), s.name
        out_dtype, recipe = _check_inputs(*s.args())
        poisoned = _poisoned(tuple(ref.shape), out_dtype, device)
        launch_scaled_mm(s.a, s.b, s.scale_a, s.scale_b, s.bias, poisoned, recipe)
        assert torch.equal(poisoned, out), s.name


def test_recipes_read_from_scale_shapes(device):
    """The recipe each sample's scales select, as torch._scaled_mm would read them."""
    expected = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mxfp8": "mxfp8",
                "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
    for s in sample_inputs(device)[:: 2 * len(OUT_DTYPES)]:
        _, recipe = _check_inputs(*s.args())
        if s.recipe_a.startswith("blockwise"):
            a_rows = 128 if s.recipe_a.endswith("128x128") else 1
            b_cols = 1 if s.recipe_b.endswith("1x128") else 128
            assert (recipe.name, recipe.a_rows, recipe.b_cols) == ("blockwise", a_rows, b_cols)
        elif s.recipe_a != s.recipe_b:
            assert recipe.name == f"{s.recipe_a} x {s.recipe_b}"
        else:
            assert recipe.name == expected[s.recipe_a], s.name


def test_default_out_dtype_is_bfloat16(device):
    a, b, sa, sb = quantized_pair(9, 17, 64, "rowwise", "rowwise", device)
    out = tg.scaled_mm(a, b, sa, sb)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, reference(a, b, sa, sb, "rowwise", "rowwise")) <= TOLERANCE


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "mxfp8 x mxfp4"])
def test_dot_scaled_path(device, recipe):
    """The tl.dot_scaled path that Blackwell GPUs take, here in the interpreter (whose dot_scaled
    takes e8m0 scales only), also with a 64-wide K step that leaves a masked remainder."""
    if not tgemm_device.interpreter_enabled() and not tgemm_device.supports_native_fp4(
            torch.device(device)):
        pytest.skip("this GPU has no block-scaled tensor cores; the decode path is tested")
    ra, _, rb = recipe.partition(" x ")
    rb = rb or ra
    a, b, sa, sb = quantized_pair(33, 40, 96, ra, rb, device)
    ref = reference(a, b, sa, sb, ra, rb)
    _, r = _check_inputs(a, b, sa, sb, None, torch.float32)
    for tile in (None, tuning.TileConfig(32, 32, 64, 4, 4, 1)):
        for native in (True, False):
            out = _poisoned((33, 40), torch.float32, device)
            launch_scaled_mm(a, b, sa, sb, None, out, r, native=native, tile=tile)
            assert rel_error(out, ref) <= 1e-5, (tile, native)


def test_partial_blocks_and_k_remainders(device):
    """K steps that end inside a scale block or past K: blockwise K=200 (a 72-wide last block,
    an 8-wide masked step with 32-wide steps); microscaled K=96 in 64-wide steps."""
    cases = [("blockwise", 200, tuning.TileConfig(32, 32, 32, 4, 4, 1)),
             ("blockwise", 200, tuning.TileConfig(16, 32, 64, 4, 4, 1)),
             ("mxfp4", 96, tuning.TileConfig(32, 32, 64, 4, 4, 1)),
             ("nvfp4", 80, tuning.TileConfig(32, 16, 32, 4, 4, 1))]
    for recipe, k, tile in cases:
        a, b, sa, sb = quantized_pair(19, 23, k, recipe, recipe, device)
        _, r = _check_inputs(a, b, sa, sb, None, torch.float32)
        out = _poisoned((19, 23), torch.float32, device)
        launch_scaled_mm(a, b, sa, sb, None, out, r, tile=tile)
        err = rel_error(out, reference(a, b, sa, sb, recipe, recipe))
        assert err <= 1e-5, (recipe, k, tile, err)


def _with_nan_block_after(scale: torch.Tensor, dim: int) -> torch.Tensor:
    """``scale`` as a view whose memory continues with NaN one K block further along ``dim``:
    a kernel that read the scale of a K block past the end would produce NaN."""
    pad_shape = list(scale.shape)
    pad_shape[dim] = 1
    padded = torch.cat([scale, torch.full(pad_shape, float("nan"), device=scale.device)], dim)
    return padded.narrow(dim, 0, scale.shape[dim])


@pytest.mark.parametrize("kernel", ["tma", "portable"])
def test_blockwise_split_steps_past_k_read_no_scale(device, kernel):
    """A K split of the persistent kernel runs whole steps, so its last split may step past K
    (K=640 in 32-wide steps, 3 splits of 7 steps: the last one steps past K once). Those steps'
    operands read as zeros, and their scales must not be read at all (the next K block's memory
    holds NaN here)."""
    a, b, sa, sb = quantized_pair(19, 23, 640, "blockwise", "blockwise", device)
    ref = reference(a, b, sa, sb, "blockwise", "blockwise")
    sa, sb = _with_nan_block_after(sa, 1), _with_nan_block_after(sb, 0)
    plan = tuning.MMPlan(kernel, tuning.TileConfig(16, 32, 32, 1, 4, 2), split_k=3)
    with tuning.force_plan(plan):
        out = tg.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert rel_error(out, ref) <= (1e-5 if tgemm_device.interpreter_enabled() else 1e-3)


def test_any_operand_layout(device):
    """a column-major, a sliced view, b row-major: the same product (beyond torch's layouts)."""
    x = torch.randn(45, 160, device=device)
    w = torch.randn(160, 27, device=device)
    a, sa = tg.quantize(x, "blockwise", "a")
    b, sb = tg.quantize(w, "blockwise", "b")
    ref = reference(a, b, sa, sb, "blockwise", "blockwise")
    a_col = a.t().contiguous().t()
    big = torch.zeros(50, 170, device=device).to(E4M3)
    big[3:48, 5:165] = a
    a_sliced = big[3:48, 5:165]
    for aa, bb in ((a_col, b), (a_sliced, b.contiguous()), (a_col, b.t().contiguous().t())):
        out = tg.scaled_mm(aa, bb, sa, sb, out_dtype=torch.float32)
        # Exact in the interpreter; Hopper's fp8 tensor cores add a K step's products at
        # reduced precision (about 2^-13 relative) before they reach the fp32 accumulator.
        assert rel_error(out, ref) <= (1e-5 if tgemm_device.interpreter_enabled() else 1e-3)


def test_scale_layouts_any_strides(device):
    """Scales are indexed logically: a transposed-contiguous or strided copy gives the same."""
    a, b, sa, sb = quantized_pair(21, 33, 128, "mxfp8", "mxfp8", device)
    out = tg.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    sa2 = sa.t().contiguous().t()
    sb2 = sb.contiguous()
    assert torch.equal(tg.scaled_mm(a, b, sa2, sb2, out_dtype=torch.float32), out)


def test_empty_and_k_zero(device):
    for m, n in ((0, 8), (8, 0)):
        a, b, sa, sb = quantized_pair(m, n, 32, "tensorwise", "tensorwise", device)
        assert tg.scaled_mm(a, b, sa, sb).shape == (m, n)
    a, b, sa, sb = quantized_pair(5, 7, 0, "rowwise", "rowwise", device)
    bias = torch.randn(7, device=device)
    out = tg.scaled_mm(a, b, sa, sb, bias, torch.float32)
    assert torch.equal(out, bias.expand(5, 7))


def test_fast_accum_within_tolerance(device):
    a, b, sa, sb = quantized_pair(40, 24, 256, "rowwise", "rowwise", device)
    ref = reference(a, b, sa, sb, "rowwise", "rowwise")
    for fast in (False, True):
        out = tg.scaled_mm(a, b, sa, sb, None, torch.float32, use_fast_accum=fast)
        assert rel_error(out, ref) <= TOLERANCE


def test_deterministic(device):
    for recipe in ("rowwise", "blockwise", "nvfp4"):
        a, b, sa, sb = quantized_pair(40, 36, 128, recipe, recipe, device)
        assert torch.equal(tg.scaled_mm(a, b, sa, sb), tg.scaled_mm(a, b, sa, sb))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_matches_torch_scaled_mm_small(device, recipe):
    """torch._scaled_mm (CPU kernels here, cuBLAS on a GPU) computes the same product."""
    a, b, sa, sb = quantized_pair(40, 48, 128, recipe, recipe, device)
    bias = torch.randn(48, device=device, dtype=torch.bfloat16)
    ours = tg.scaled_mm(a, b, sa, sb, bias, torch.bfloat16)
    theirs = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    ref = reference(a, b, sa, sb, recipe, recipe, bias)
    assert rel_error(ours, ref) <= TOLERANCE and rel_error(theirs, ref) <= TOLERANCE
    assert rel_error(ours, theirs.double()) <= TOLERANCE


def test_eager_launches_memoised_per_signature_stay_right(device):
    """Eager calls of the fp8 recipes reuse checks and launch arithmetic per call signature:
    fresh values and scales, another recipe on the same operands, scales at another alignment,
    another size, bad input after a good call, through tg.scaled_mm and torch.ops alike."""
    from torch_triton_gemm.ops import launcher

    def check(a, b, sa, sb, recipe, bias=None, op=tg.scaled_mm):
        out = op(a, b, sa, sb, bias, torch.float32)
        assert rel_error(out, reference(a, b, sa, sb, recipe, recipe, bias)) <= TOLERANCE

    for recipe in ("rowwise", "tensorwise", "blockwise"):
        for _ in range(2):
            check(*quantized_pair(21, 40, 256, recipe, recipe, device), recipe)
        check(*quantized_pair(21, 40, 256, recipe, recipe, device), recipe,
              op=torch.ops.tgemm.scaled_mm)
    a, b, sa, sb = quantized_pair(21, 40, 256, "rowwise", "rowwise", device)
    shifted = torch.empty(sa.numel() + 1, device=device)[1:].view_as(sa).copy_(sa)  # 4-byte
    check(a, b, shifted, sb, "rowwise")
    check(a, b, sa, sb, "rowwise", torch.randn(40, device=device, dtype=torch.bfloat16))
    check(*quantized_pair(5, 40, 256, "rowwise", "rowwise", device), "rowwise")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="fit no recipe"):
            tg.scaled_mm(a, b, sa[:20], sb)
    keys = [key for key in launcher._EAGER_LAUNCHES if key[0] == "tgemm::scaled_mm"]
    assert len(keys) >= 6


# --- scales are multipliers, used as given ------------------------------------------------------

def test_zero_negative_and_non_finite_scales_are_used_as_given(device):
    """No host-side check: a zero scale zeroes its rows, a negative one negates them, inf and NaN
    reach exactly the outputs they multiply; the other outputs do not change."""
    a, b, sa, sb = quantized_pair(12, 20, 64, "rowwise", "rowwise", device)
    base = tg.scaled_mm(a, b, sa, sb, None, torch.float32)
    sa2 = sa.clone()
    sa2[1] = 0.0
    sa2[2] = -sa[2]
    sa2[3] = float("inf")
    sa2[4] = float("nan")
    out = tg.scaled_mm(a, b, sa2, sb, None, torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[2], -base[2])
    assert not torch.isfinite(out[3]).any()
    assert torch.isnan(out[4]).all()
    keep = [0, *range(5, 12)]
    assert torch.equal(out[keep], base[keep])


def test_microscaled_special_scales(device):
    """e8m0 byte 255 is NaN: it poisons the rows of its block; an nvfp4 e4m3 scale of zero
    zeroes its block's contribution and a negative one negates it."""
    a, b, sa, sb = quantized_pair(8, 16, 64, "mxfp4", "mxfp4", device)
    bytes_a = sa.view(torch.uint8).clone()
    bytes_a[5, 1] = 255
    out = tg.scaled_mm(a, b, bytes_a.view(torch.float8_e8m0fnu), sb, None, torch.float32)
    assert torch.isnan(out[5]).all()
    assert torch.isfinite(out[[0, 1, 2, 3, 4, 6, 7]]).all()

    a, b, sa, sb = quantized_pair(8, 16, 32, "nvfp4", "nvfp4", device)
    sa2 = sa.clone()
    sa2[:, 0] = 0.0  # drop K 0..15
    sa2[:, 1] = -sa[:, 1].float()
    out = tg.scaled_mm(a, b, sa2, sb, None, torch.float32)
    ref = reference(a, b, sa2, sb, "nvfp4", "nvfp4")
    assert rel_error(out, ref) <= 1e-5


# --- errors -------------------------------------------------------------------------------------

def _bad_inputs(device: str):
    a, b, sa, sb = quantized_pair(4, 6, 64, "rowwise", "rowwise", device)
    ma, mb, msa, msb = quantized_pair(4, 6, 64, "mxfp8", "mxfp8", device)
    fa, fb, fsa, fsb = quantized_pair(4, 6, 64, "nvfp4", "nvfp4", device)
    ba, bb, bsa, bsb = quantized_pair(4, 6, 256, "blockwise", "blockwise", device)
    e8m0 = torch.float8_e8m0fnu
    return [
        ((a.float(), b, sa, sb), ValueError,
         "tgemm::scaled_mm: a has dtype torch.float32; scaled_mm takes quantized operands"),
        ((a, b.to(torch.bfloat16), sa, sb), ValueError, "b has dtype torch.bfloat16"),
        ((a.unsqueeze(0), b, sa, sb), RuntimeError, "a must be 2-D [M, K], got 3-D"),
        ((a, b[:32], sa, sb), RuntimeError,
         "tgemm::scaled_mm: a has K=64 but b has K=32"),
        ((a, b, sa.half(), sb.half()), ValueError,
         "scale_a and scale_b must share one scale dtype: float32"),
        ((a, b, sa, sb.double()), ValueError, "got scale_a torch.float32 and scale_b "
                                              "torch.float64"),
        ((a, b, sa[:3], sb), RuntimeError,
         "tgemm::scaled_mm: scale shapes fit no recipe: got scale_a (3, 1) and scale_b (1, 6)"),
        ((a, b, sa.reshape(4), sb), RuntimeError, "scale shapes fit no recipe"),
        ((ba, bb, bsa[:, :1], bsb), RuntimeError,
         "Blockwise (kb = ceil(K/128) = 2): scale_a (4, 2) for 1x128"),
        ((ma[:, :48], mb[:48], msa[:, :1], msb[:1]), ValueError,
         "tgemm::scaled_mm: mxfp8 scales cover 32 elements of K, so K must be a multiple of "
         "32; got K=48"),
        ((fa[:, :4], fb[:4], fsa[:, :1], fsb[:1]), ValueError,
         "nvfp4 scales cover 16 elements of K, so K must be a multiple of 16; got K=8"),
        ((ma, mb, msa[:, :1], msb), RuntimeError,
         "mxfp8 takes one torch.float8_e8m0fnu scale per 32 elements along K: scale_a (4, 2)"),
        ((fa, fb, fsa.float(), fsb.float()), ValueError,
         "float32 scales (tensorwise, rowwise, blockwise) go with fp8 operands"),
        ((ma, mb, msa.view(torch.uint8).view(E4M3), msb.view(torch.uint8).view(E4M3)),
         ValueError, "float8_e4m3fn scales are nvfp4's and go with float4_e2m1fn_x2"),
        ((ma, mb, msa, msb.view(torch.uint8).view(E4M3)), ValueError,
         "must share one scale dtype"),
        ((a, b, sa, sb, torch.randn(5, device=device)), RuntimeError,
         "tgemm::scaled_mm: bias must be 1-D of size N=6 (b's columns), got shape (5,)"),
        ((a, b, sa, sb, torch.ones(6, device=device, dtype=torch.int32)), ValueError,
         "bias has dtype torch.int32"),
        ((a, b, sa, sb, None, E4M3), ValueError,
         "tgemm::scaled_mm: out_dtype torch.float8_e4m3fn is not supported"),
        ((a, b, sa.to("meta"), sb), RuntimeError, "scale_a is on meta but a is on"),
        ((fa, fb, fsa.view(torch.uint8).view(e8m0), fsb), ValueError,
         "must share one scale dtype"),
    ]


@pytest.mark.parametrize("case", range(20))
def test_bad_input_raises_before_launch(device, case, monkeypatch):
    args, error, message = _bad_inputs(device)[case]

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr("torch_triton_gemm.ops.scaled_mm.launch_scaled_mm", no_launch)
    monkeypatch.setattr("torch_triton_gemm.ops.scaled_mm.run_kept", no_launch)
    with pytest.raises(error, match=re.escape(message)):
        tg.scaled_mm(*args)
    # The registered op (and so its fake) runs the same checks.
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.tgemm.scaled_mm(*args)


def test_bad_inputs_cover_every_case(device):
    assert len(_bad_inputs(device)) == 20


# --- gradients ----------------------------------------------------------------------------------

def test_gradients_flow_to_bias(device):
    for s in sample_inputs(device, requires_grad=True)[:12]:
        if s.bias is None:
            continue
        out = tg.scaled_mm(*s.args())
        grad_out = torch.randn_like(out)
        (grad_bias,) = torch.autograd.grad(out, (s.bias,), grad_out)
        assert grad_bias.dtype == s.bias.dtype and grad_bias.shape == s.bias.shape
        assert rel_error(grad_bias, grad_out.double().sum(0)) <= TOLERANCE, s.name
        out_op = torch.ops.tgemm.scaled_mm(*s.args())
        assert torch.equal(torch.autograd.grad(out_op, (s.bias,), grad_out)[0], grad_bias)


@pytest.mark.parametrize("which", ["a", "b", "scale_a"])
def test_quantized_operand_gradients_refused(device, which):
    a, b, sa, sb = quantized_pair(8, 12, 64, "rowwise", "rowwise", device)
    tensors = {"a": a, "b": b, "scale_a": sa}
    tensors[which].requires_grad_()
    message = (f"tgemm::scaled_mm: {which} ({tensors[which].dtype}) requires grad, but "
               "scaled_mm's quantized operands and their scales have no gradient")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        tg.scaled_mm(a, b, sa, sb)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.tgemm.scaled_mm(a, b, sa, sb)
    with torch.no_grad():  # without autograd there is nothing to refuse
        tg.scaled_mm(a, b, sa, sb)


# --- quantize / dequantize ----------------------------------------------------------------------

def _unit_data(data: torch.Tensor) -> torch.Tensor:
    """Data of the same dtype and layout holding 1.0 everywhere (e2m1 code 2, twice a byte)."""
    if data.dtype == FP4:
        return torch.full_like(data.view(torch.uint8), 0x22).view(FP4)
    return torch.ones_like(data, dtype=torch.float32).to(data.dtype)


@pytest.mark.parametrize("recipe", QUANTIZE_RECIPES)
@pytest.mark.parametrize("operand", ["a", "b"])
def test_quantize_round_trip(device, recipe, operand):
    """dequantize(quantize(x)) is x up to the element format's rounding: half an ulp of e4m3
    (2^-4 relative) plus half its subnormal spacing times the scale; for e2m1, a third of |x|
    plus a quarter of the scale (its widest gaps)."""
    x = torch.randn(96, 160, device=device, dtype=torch.bfloat16)  # K = 160 for a, 96 for b
    data, scale = tg.quantize(x, recipe, operand)
    approx = tg.dequantize(data, scale, recipe, operand)
    assert approx.shape == x.shape and approx.dtype == torch.float64
    assert not data.requires_grad and not scale.requires_grad
    assert data.stride(1 if operand == "a" else 0) == 1  # K-major: a row-major, b column-major
    per_element_scale = tg.dequantize(_unit_data(data), scale, recipe, operand)
    err = (approx - x.double()).abs()
    if data.dtype == FP4:
        bound = x.double().abs() / 3 + 0.25 * per_element_scale
    else:
        bound = 2.0**-4 * x.double().abs() + 2.0**-10 * per_element_scale
    assert (err <= bound).all(), (err - bound).max()


def test_fp4_encoding_exact_values(device):
    """Values on the e2m1 grid (times the block's power-of-two scale) round-trip exactly; ties
    round to the even code; packing puts the even K index in the low nibble."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6] * 2,
                        device=device)
    x = grid.reshape(1, 32) * 4.0
    data, scale = tg.quantize(x, "mxfp4", "a")
    assert torch.equal(tg.dequantize(data, scale, "mxfp4", "a"), x.double())
    assert scale.view(torch.uint8).item() == 127 + 2  # amax 24 = 6 * 2^2
    assert data.view(torch.uint8)[0, 0].item() == 0x10  # codes 0 (low) and 1 (0.5, high)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4], device=device)
    data, scale = tg.quantize(ties, "mxfp4", "a")
    expected = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6] * 4, dtype=torch.float64, device=device)
    assert torch.equal(tg.dequantize(data, scale, "mxfp4", "a")[0], expected)


def test_quantize_rejects_bad_arguments(device):
    x = torch.randn(8, 40, device=device)
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        tg.quantize(x, "fp8")
    with pytest.raises(ValueError, match="operand must be 'a'"):
        tg.quantize(x, "rowwise", "c")
    with pytest.raises(ValueError, match="mxfp4 scales cover 32 elements of K"):
        tg.quantize(x, "mxfp4")
    with pytest.raises(ValueError, match="high-precision floating tensor"):
        tg.quantize(x.to(E4M3), "rowwise")


# --- opcheck, fake tensors, graph capture ------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    samples = sample_inputs(device, requires_grad=requires_grad)
    chosen = [s for s in samples if s.name in (
        "tensorwise-e4m3fn-e4m3fn-K70-bfloat16-nt", "rowwise-e4m3fn-e5m2-K70-float32-row",
        "blockwise-e4m3fn-e4m3fn-K256-bfloat16-nt", "mxfp8-e4m3fn-e4m3fn-K96-bfloat16-row",
        "mxfp4-K96-bfloat16-nt", "nvfp4-K48-float16-row")]
    assert len(chosen) == 6
    for s in chosen:
        # test_schema compares inputs before and after with torch.allclose, which fp8 tensors do
        # not support; test_op_neither_mutates_nor_aliases checks the same by bytes.
        torch.library.opcheck(
            torch.ops.tgemm.scaled_mm.default, (*s.args(), False),
            test_utils=("test_autograd_registration", "test_faketensor",
                        "test_aot_dispatch_dynamic"))


def test_op_neither_mutates_nor_aliases(device):
    for recipe in ("blockwise", "nvfp4"):
        a, b, sa, sb = quantized_pair(19, 24, 128, recipe, recipe, device)
        bias = torch.randn(24, device=device)
        inputs = (a, b, sa, sb, bias)
        before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone()
                  for t in inputs]
        out = torch.ops.tgemm.scaled_mm(a, b, sa, sb, bias, torch.float32, False)
        for t, saved in zip(inputs, before):
            now = t.view(torch.uint8) if t.element_size() == 1 else t
            assert torch.equal(now, saved)
            assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def _fake_recipes():
    """(a, b, scale_a, scale_b) as CUDA FakeTensors for each recipe, M=70, N=45, K=256."""
    def e(*shape, dtype):
        return torch.empty(*shape, device="cuda", dtype=dtype)

    f32, e8m0 = torch.float32, torch.float8_e8m0fnu
    a8, b8 = e(70, 256, dtype=E4M3), e(45, 256, dtype=E4M3).t()
    a4, b4 = e(70, 128, dtype=FP4), e(45, 128, dtype=FP4).t()
    return {
        "tensorwise": (a8, b8, e((), dtype=f32), e(1, dtype=f32)),
        "rowwise": (a8, b8, e(70, 1, dtype=f32), e(1, 45, dtype=f32)),
        "blockwise": (a8, b8, e(70, 2, dtype=f32), e(1, 2, dtype=f32).t()),
        "mxfp8": (a8, b8, e(70, 8, dtype=e8m0), e(45, 8, dtype=e8m0).t()),
        "mxfp4": (a4, b4, e(70, 8, dtype=e8m0), e(45, 8, dtype=e8m0).t()),
        "nvfp4": (a4, b4, e(70, 16, dtype=E4M3), e(45, 16, dtype=E4M3).t()),
    }


def test_fake_tensor_propagation_cuda():
    with FakeTensorMode():
        for name, (a, b, sa, sb) in _fake_recipes().items():
            bias = torch.empty(45, device="cuda", dtype=torch.bfloat16)
            out = tg.scaled_mm(a, b, sa, sb, bias, torch.float16)
            assert out.shape == (70, 45) and out.stride() == (45, 1), name
            assert out.device.type == "cuda" and out.dtype == torch.float16, name
            assert tg.scaled_mm(a, b, sa, sb).dtype == torch.bfloat16
        a, b, _, sb = _fake_recipes()["rowwise"]
        sa = torch.empty(5, 1, device="cuda", dtype=torch.float32)
        with pytest.raises(RuntimeError, match="scale shapes fit no recipe"):
            tg.scaled_mm(a, b, sa, sb)


def test_traced_without_interpreter_exposes_the_kernel():
    """With compiled Triton (here CUDA FakeTensors on a GPU-less host), tgemm::scaled_mm is a
    triton_op: its fake runs, and functional tracing sees the kernel and the recipe it chose
    (the in-register decode path for microscaling, as no GPU says it has fp4 tensor cores)."""
    if torch.cuda.is_available():
        pytest.skip("runs the GPU-less tracing path; the GPU tests cover the GPU")
    script = f"import sys; sys.path.insert(0, {os.path.join(REPO, 'tests')!r})\n"
    script += textwrap.dedent("""
        import torch, torch_triton_gemm as tg, test_scaled_mm as t
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch._subclasses.functional_tensor import dispatch_functionalize
        from torch.fx.experimental.proxy_tensor import make_fx
        with FakeTensorMode():
            recipes = t._fake_recipes()
            bias = torch.empty(45, device="cuda", dtype=torch.float32)
        for name, (a, b, sa, sb) in recipes.items():
            f = lambda a, b, sa, sb, bias: tg.scaled_mm(a, b, sa, sb, bias) * 2
            gm = make_fx(dispatch_functionalize(f), tracing_mode="fake")(a, b, sa, sb, bias)
            for node in gm.graph.nodes:
                if "triton_kernel" in str(node.target):
                    kw = node.kwargs["kwargs"]
                    if kw["SCALING"] in ("outer", "block"):  # the shared GEMM kernels
                        print(name, kw["SCALING"], kw["SA_ROWS"], kw["SB_COLS"],
                              kw["FAST_ACCUM"], kw["HAS_BIAS"])
                    else:
                        print(name, kw["SCALING"], kw["FORMAT_A"], kw["FORMAT_B"],
                              kw["SCALE_FORMAT"], kw["SCALE_K"], kw["HAS_BIAS"])
    """)
    out = _run_without_interpreter(script)
    assert out.split("\n")[:6] == [
        "tensorwise outer 1 1 False True",
        "rowwise outer 1 1 False True",
        "blockwise block 1 128 False True",
        "mxfp8 micro e4m3 e4m3 e8m0 32 True",
        "mxfp4 micro e2m1 e2m1 e8m0 32 True",
        "nvfp4 micro e2m1 e2m1 e4m3 16 True",
    ], out


_COMPILE_SCRIPT = """
from hopper_compile import compile_for as compile_for_target
from torch_triton_gemm.kernels.matmul import mm_kernel, mm_tma_kernel
from torch_triton_gemm.kernels.scaled import scaled_mm_kernel

POINTER = {"e4m3": "*fp8e4nv", "e5m2": "*fp8e5", "e2m1": "*u8", "fp32": "*fp32", "e8m0": "*u8"}
POINTERS = {"a_ptr": "ab", "b_ptr": "ab", "c_ptr": "*bf16", "bias_ptr": "*fp32",
            "ws_ptr": "*fp32", "locks_ptr": "*i32", "sa_ptr": "s", "sb_ptr": "s"}
ALIGNED = ["a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "stride_am", "stride_bn",
           "stride_cm", "K"]

def compile_for(kernel, arch, fmt, scale_fmt, tile, **constants):
    block_m, block_n, block_k, num_warps, num_stages = tile
    # b = W.t(): both operands K-major, as a launch specialises unit strides.
    constants.update(stride_ak=1, stride_bk=1, stride_cn=1, HAS_BIAS=True,
                     UPCAST_TO_FP32=False, INDEX_64=False, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, GROUP_M=8)
    pointers = {name: POINTER[fmt] if kind == "ab" else POINTER[scale_fmt] if kind == "s"
                else kind for name, kind in POINTERS.items()}
    compiled = compile_for_target(kernel, pointers, constants, ALIGNED, arch,
                                  num_warps=num_warps, num_stages=num_stages)
    ir = compiled.asm["ttgir"]
    mma = [op for op in ("warp_group_dot", "tc_gen5_mma_scaled", "tc_gen5_mma") if op in ir]
    print(arch, constants["SCALING"], fmt, scale_fmt, mma[0] if mma else "none",
          "tma" if "tensor_desc" in ir or "async_tma" in ir else "pointers",
          compiled.metadata.shared > 0)

# fp8 recipes on the shared persistent TMA kernel (outer: rowwise / tensorwise scales).
gemm = dict(ACTIVATION="none", INPUT_PRECISION=None, SPLIT=False, A_M_CONTIGUOUS=False,
            B_K_CONTIGUOUS=True, C_TMA=True, EPILOGUE_SUBTILE=2, WARP_SPECIALIZE=False,
            STREAM_K=False, SPLIT_FIXUP=False, SPLIT_K=1, HOST_DESCRIPTORS=False,
            c_host_desc=None, PDL=False, C_ALIGN=1)
compile_for(mm_tma_kernel, 90, "e4m3", "fp32", (128, 128, 128, 8, 3), SCALING="outer",
            SA_ROWS=1, SB_COLS=1, FAST_ACCUM=False, **gemm)
compile_for(mm_tma_kernel, 90, "e5m2", "fp32", (128, 128, 128, 8, 3), SCALING="outer",
            SA_ROWS=1, SB_COLS=1, FAST_ACCUM=True, **gemm)
compile_for(mm_tma_kernel, 90, "e4m3", "fp32", (128, 128, 128, 8, 3), SCALING="block",
            SA_ROWS=1, SB_COLS=128, FAST_ACCUM=False, **gemm)
# Blockwise on the pointer loaders: 64-row tiles load each step's scales a step ahead, 16-row
# tiles in the step (kernels/tiles.py's k_loop).
portable = dict(ACTIVATION="none", INPUT_PRECISION=None, SPLIT=True, SA_ROWS=1, SB_COLS=128,
                FAST_ACCUM=False, SPLIT_FIXUP=False, SPLIT_K=1, A_M_ALIGN=1, A_K_ALIGN=1,
                B_K_ALIGN=1, B_N_ALIGN=1, M_ALIGN=1, N_ALIGN=1, N_ODD=False, C_ALIGN=1)
for rows in (64, 16):
    compile_for(mm_kernel, 90, "e4m3", "fp32", (rows, 64, 128, 4, 4), SCALING="block",
                **portable)
# Microscaled formats on their own kernel.
micro = dict(FORMAT_A="e2m1", FORMAT_B="e2m1")
compile_for(scaled_mm_kernel, 90, "e2m1", "e4m3", (128, 128, 64, 8, 3), SCALING="micro",
            SCALE_FORMAT="e4m3", SCALE_K=16, **micro)
compile_for(scaled_mm_kernel, 100, "e2m1", "e8m0", (128, 128, 128, 4, 3),
            SCALING="micro_native", SCALE_FORMAT="e8m0", SCALE_K=32, **micro)
"""


def test_kernel_compiles_for_hopper_and_blackwell():
    """Triton compiles the kernels for sm_90 and sm_100 without a GPU: the fp8 recipes on the
    shared persistent kernel with TMA loads and Hopper's wgmma, decoded microscaling on wgmma,
    the block-scaled tensor-core MMA for mxfp4 on Blackwell; each with shared-memory stages."""
    if torch.cuda.is_available():
        pytest.skip("compiles for fixed GPU targets on a GPU-less host; the GPU tests run it")
    out = _run_without_interpreter(_COMPILE_SCRIPT).split("\n")
    assert out[:7] == [
        "90 outer e4m3 fp32 warp_group_dot tma True",
        "90 outer e5m2 fp32 warp_group_dot tma True",
        "90 block e4m3 fp32 warp_group_dot tma True",
        "90 block e4m3 fp32 warp_group_dot pointers True",
        "90 block e4m3 fp32 none pointers True",  # 16 rows: below a warpgroup MMA's 64
        "90 micro e2m1 e4m3 warp_group_dot pointers True",
        "100 micro_native e2m1 e8m0 tc_gen5_mma_scaled pointers True",
    ], out


def test_eager_backend_compile(device):
    """torch.compile (eager backend, fullgraph) keeps tgemm::scaled_mm as one node."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def f(a, b, sa, sb, bias):
        return torch.relu(tg.scaled_mm(a, b, sa, sb, bias, torch.float32)) + 1

    a, b, sa, sb = quantized_pair(17, 24, 64, "rowwise", "rowwise", device)
    bias = torch.randn(24, device=device)
    out = torch.compile(f, backend=record, fullgraph=True)(a, b, sa, sb, bias)
    assert "tgemm.scaled_mm" in graphs[0].code
    assert torch.equal(out, f(a, b, sa, sb, bias))


def test_torch_export_keeps_the_op(device):
    class Fp8Linear(torch.nn.Module):
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
            super().__init__()
            wq, ws = tg.quantize(weight.t(), "rowwise", "b")
            self.register_buffer("wq", wq)
            self.register_buffer("ws", ws)
            self.register_buffer("bias", bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xq, xs = tg.quantize(x, "rowwise", "a")
            return tg.scaled_mm(xq, self.wq, xs, self.ws, self.bias, torch.float32)

    model = Fp8Linear(torch.randn(24, 64, device=device), torch.randn(24, device=device))
    x = torch.randn(13, 64, device=device)
    exported = torch.export.export(model, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "tgemm.scaled_mm.default" in targets
    x2 = torch.randn(13, 64, device=device)
    assert torch.equal(exported.module()(x2), model(x2))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_transposed_plans_of_few_rows(recipe, fast, device):
    """A transposed plan (swap_ab: the kernel computes C^T = B^T A^T on the same memory, the
    scales swapped) forced on products of 1-16 rows with ragged N and a K tail, through the
    eager call and the traced op, every out dtype, against float64; with a bias it refuses."""
    tile = tuning.TileConfig(32, 16, 32, 8, 4, 2)
    plan = tuning.MMPlan("portable", tile, swap_ab=True)
    for m, n, k in ((1, 40, 80), (7, 72, 96), (16, 33, 48)):
        a, b, sa, sb = quantized_pair(m, n, k, recipe, recipe, device)
        ref = reference(a, b, sa, sb, recipe, recipe)
        with tuning.force_plan(plan):
            for out_dtype in OUT_DTYPES:
                out = tg.scaled_mm(a, b, sa, sb, None, out_dtype, use_fast_accum=fast)
                assert out.shape == (m, n) and out.stride() == (n, 1)
                assert rel_error(out, ref) <= TOLERANCE, (m, n, k, out_dtype)
            traced = torch.ops.tgemm.scaled_mm(a, b, sa, sb, None, None, fast)
            assert rel_error(traced, ref) <= TOLERANCE, (m, n, k)
            bias = torch.randn(n, device=device, dtype=torch.bfloat16)
            with pytest.raises(RuntimeError, match="swap_ab"):
                tg.scaled_mm(a, b, sa, sb, bias)


# --- GPU only -----------------------------------------------------------------------------------

GPU_RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"]


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_larger_shapes(recipe, fast):
    for m, n, k in ((512, 384, 1024), (1, 4096, 4096), (999, 1003, 1024), (4096, 4096, 4096)):
        a, b, sa, sb = quantized_pair(m, n, k, recipe, recipe, "cuda")
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ref = reference(a, b, sa, sb, recipe, recipe, bias)
        for out_dtype in OUT_DTYPES:
            out = tg.scaled_mm(a, b, sa, sb, bias, out_dtype, use_fast_accum=fast)
            assert rel_error(out, ref) <= TOLERANCE, (m, n, k, out_dtype)
        row_major_b = tg.scaled_mm(a, b.contiguous(), sa, sb, bias, torch.float32)
        assert rel_error(row_major_b, ref) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_inductor_fullgraph_matches_eager(recipe):
    def f(a, b, sa, sb, bias):
        y = tg.scaled_mm(a, b, sa, sb, bias)
        return torch.nn.functional.silu(y.float()) * 3

    a, b, sa, sb = quantized_pair(257, 192, 512, recipe, recipe, "cuda")
    bias = torch.randn(192, device="cuda", dtype=torch.bfloat16)
    eager = f(a, b, sa, sb, bias)
    compiled = torch.compile(f, fullgraph=True)(a, b, sa, sb, bias)
    assert rel_error(compiled, eager) <= TOLERANCE
    ref = torch.nn.functional.silu(reference(a, b, sa, sb, recipe, recipe, bias)) * 3
    assert rel_error(compiled, ref) <= TOLERANCE


@pytest.mark.gpu
def test_inductor_bias_gradient():
    a, b, sa, sb = quantized_pair(64, 96, 256, "rowwise", "rowwise", "cuda")
    bias = torch.randn(96, device="cuda", dtype=torch.float32, requires_grad=True)
    compiled = torch.compile(lambda *t: tg.scaled_mm(*t).float().square().sum(), fullgraph=True)
    (grad,) = torch.autograd.grad(compiled(a, b, sa, sb, bias), (bias,))
    out = tg.scaled_mm(a, b, sa, sb, bias).float()
    assert rel_error(grad, (2 * out).double().sum(0)) <= TOLERANCE


def _refill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), through bytes for 1-byte dtypes (fp8, fp4, e8m0)."""
    if dst.element_size() == 1:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp4"])
def test_cuda_graph_capture(recipe):
    a, b, sa, sb = quantized_pair(64, 128, 256, recipe, recipe, "cuda")
    bias = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    tg.scaled_mm(a, b, sa, sb, bias)  # tune outside capture
    compiled = torch.compile(lambda *t: tg.scaled_mm(*t) * 2, mode="reduce-overhead",
                             fullgraph=True)
    for _ in range(3):
        a2, _, sa2, _ = quantized_pair(64, 128, 256, recipe, recipe, "cuda")
        _refill(a, a2)
        _refill(sa, sa2)
        out = compiled(a, b, sa, sb, bias)
        assert rel_error(out, 2 * reference(a, b, sa, sb, recipe, recipe, bias)) <= TOLERANCE

    graph = torch.cuda.CUDAGraph()
    static_out = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.graph(graph):
        static_out.copy_(tg.scaled_mm(a, b, sa, sb, bias))
    a2, _, sa2, _ = quantized_pair(64, 128, 256, recipe, recipe, "cuda")
    _refill(a, a2)
    _refill(sa, sa2)
    graph.replay()
    assert rel_error(static_out, reference(a, b, sa, sb, recipe, recipe, bias)) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_matches_torch_scaled_mm(recipe, out_dtype):
    """The same operands and scales through torch._scaled_mm (cuBLAS): both within the budget
    of the float64 reference and close to each other."""
    a, b, sa, sb = quantized_pair(256, 512, 1024, recipe, recipe, "cuda")
    if recipe == "tensorwise":
        sa, sb = sa.reshape(()), sb.reshape(())
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16) if out_dtype != torch.float32 \
        else None
    ours = tg.scaled_mm(a, b, sa, sb, bias, out_dtype)
    theirs = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    ref = reference(a, b, sa, sb, recipe, recipe, bias)
    assert rel_error(ours, ref) <= TOLERANCE
    assert rel_error(theirs, ref) <= TOLERANCE
    assert rel_error(ours, theirs.double()) <= TOLERANCE


@pytest.mark.gpu
def test_matches_torch_scaled_mm_blockwise():
    """1x128 x 128x128 blockwise against torch._scaled_mm where this torch and cuBLAS (12.9+)
    support it; cuBLAS wants 1x128 scales outer-dim-major."""
    a, b, sa, sb = quantized_pair(256, 768, 512, "blockwise", "blockwise", "cuda")
    sa_torch = sa.t().contiguous().t()
    try:
        theirs = torch._scaled_mm(a, b, sa_torch, sb, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"torch._scaled_mm has no blockwise scaling here: {e}")
    ours = tg.scaled_mm(a, b, sa, sb)
    ref = reference(a, b, sa, sb, "blockwise", "blockwise")
    assert rel_error(ours, ref) <= TOLERANCE
    assert rel_error(theirs, ref) <= TOLERANCE


@pytest.mark.gpu
def test_dynamic_shapes_do_not_recompile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda *t: tg.scaled_mm(*t), dynamic=True)
    _, b, _, sb = quantized_pair(1, 64, 256, "rowwise", "rowwise", "cuda")
    for m in (33, 70, 129, 300):
        a, _, sa, _ = quantized_pair(m, 64, 256, "rowwise", "rowwise", "cuda")
        out = compiled(a, b, sa, sb)
        assert rel_error(out, reference(a, b, sa, sb, "rowwise", "rowwise")) <= TOLERANCE
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_native_fp4_query_matches_the_gpu():
    major = torch.cuda.get_device_capability()[0]
    assert tgemm_device.supports_native_fp4(torch.device("cuda")) == (major == 10)


# --- Hopper's warp-specialized precise fp8 kernel -------------------------------------------------

def test_fp8_precise_plans(monkeypatch):
    """Which products the precise kernel takes (128x128 tiles for 0.7 of a wave of SMs), how
    many consumer warpgroups, and stages that fit the shared memory with every output dtype (an
    H100's: 227 KB a block)."""
    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 227 * 1024)
    assert tuning.fp8_precise_plan(128, 6144, 132, 2) is None  # 48 tiles: split-K plans
    assert tuning.fp8_precise_plan(16, 28672, 132, 2) is None  # decode: 16-row tiles
    # Grouped: the average group's rows pick the tile; small groups keep the Triton kernel.
    assert tuning.fp8_grouped_precise_tile(32768, 2048, 512, 132, 2) is None  # 64 rows each
    assert tuning.fp8_grouped_precise_tile(2048, 2048, 8, 132, 2).block_m == 128
    # ... in bands of 8 tile rows; single products in bands of 4.
    assert tuning.fp8_grouped_precise_tile(16384, 2048, 8, 132, 4) == dataclasses.replace(
        tuning.fp8_precise_plan(2048, 2048, 132, 4).tile, group_m=8)
    assert tuning.fp8_precise_plan(2048, 2048, 132, 4).tile.group_m == 4
    assert tuning.fp8_precise_plan(256, 4096, 132, 2) is None  # 64 tiles: 64-row tiles
    assert tuning.fp8_precise_plan(256, 5888, 132, 2) is None  # 92 tiles: under 0.7 wave
    most = tuning.fp8_precise_plan(256, 6016, 132, 2)  # 94 tiles
    assert (most.kernel, most.tile.block_m) == (tuning.FP8_PRECISE_KERNEL, 128)
    # Three consumers: 0.7 wave of their 192-row tiles (64 at M = 192, N = 8192: no), or a
    # wave of 128x128 tiles (M = 768, N = 2816: 88 192-row tiles, 132 of 128 rows: yes).
    assert tuning.fp8_precise_plan(192, 8192, 132, 2) is None
    # Under 256 rows, a full wave of 128x128 tiles as before (M = 128: 112 tiles, no; 132, yes).
    assert tuning.fp8_precise_plan(128, 14336, 132, 2) is None
    assert tuning.fp8_precise_plan(128, 16896, 132, 2) is not None
    assert tuning.fp8_precise_plan(768, 2816, 132, 2).tile.block_m == 192


def test_blockwise_ws_split_plans(monkeypatch):
    """Blockwise products of 65-128 rows, K of 3072 or more, whose 128x128 tiles leave half
    the SMs idle take the warp-specialized kernel's K splits: as many as one wave holds, each
    of at least WS_MIN_STEPS_PER_SPLIT steps of 128; other row counts, wider outputs, shallow
    K and the other recipes keep their plans."""
    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 227 * 1024)
    monkeypatch.setattr(tgemm_device, "interpreter_enabled", lambda: False)

    def split(m, n, k, scaling="block"):
        plan = tuning.fp8_precise_plan(m, n, 132, 2, k, scaling)
        if plan is None or plan.split_k == 1:
            return None
        assert plan.kernel == tuning.FP8_PRECISE_KERNEL
        assert (plan.tile.block_m, plan.tile.block_n) == (128, 128)
        return plan.split_k

    # Llama-3-8B's qkv (48 tiles), o (32) and down (32) at 128 rows; 65-127 rows likewise.
    assert split(128, 6144, 4096) == 2
    assert split(128, 4096, 4096) == 4
    assert split(128, 4096, 14336) == 4
    assert split(80, 4096, 14336) == 4
    assert split(128, 1024, 6144) == 12  # 8 tiles: the most splits counted
    assert split(128, 1024, 8192) == 8  # (12 splits of 64 steps would come out as 11)
    assert split(128, 1024, 3072) == 6  # 24 steps: 6 of 4
    # 67+ tiles (two splits would overflow the wave), 64 rows or fewer, over 128, no K given,
    # K under BLOCKWISE_WS_SPLIT_MIN_K, and tensorwise / rowwise products: no split.
    for m, n, k in ((128, 8576, 4096), (64, 4096, 4096), (16, 4096, 4096), (192, 4096, 4096),
                    (128, 4096, 0), (128, 7168, 2048), (128, 1024, 2048)):
        assert split(m, n, k) is None, (m, n, k)
    assert split(128, 4096, 4096, "outer") is None
    # Off (the A/B's other arm): the size rules' plan again.
    monkeypatch.setattr(tuning, "BLOCKWISE_WS_SPLIT_MIN_ROWS", 129)
    assert split(128, 4096, 4096) is None
    assert tuning.heuristic_mm_plan(128, 4096, 4096, 1, True, 132, 2, True, "block").kernel == (
        "portable")


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_mid_row_plans(monkeypatch, fast):
    """Tensorwise and rowwise products of 33-512 rows (an H100's numbers): deep K takes the
    precise kernel from 0.45 of a wave of 128x128 tiles and 64 rows (129-192 rows on one row of
    192-row tiles); a sliver of a second wave of 128x128 tiles gives way to 64x128 tiles on
    the portable kernel, in both accumulation modes; 128-row tiles spilling into a second wave
    take 192-row ones that fit one. Blockwise products (the default recipe) keep the rules as
    they were."""
    monkeypatch.setattr(tgemm_device, "shared_memory_per_block", lambda index: 227 * 1024)
    monkeypatch.setattr(tgemm_device, "interpreter_enabled", lambda: False)

    def plan(m, n, k):
        precise = None if fast else tuning.fp8_precise_plan(m, n, 132, 2, k, "outer")
        return precise or tuning.heuristic_mm_plan(m, n, k, 1, True, 132, 2, True, "outer",
                                                   fast)

    def rows(p):
        return (p.kernel, p.tile.block_m, p.tile.block_n)

    wgmma = tuning.FP8_PRECISE_KERNEL
    if not fast:
        assert rows(plan(91, 9856, 9456)) == (wgmma, 128, 128)  # 77 tiles, K deep
        assert rows(plan(174, 6576, 13360)) == (wgmma, 192, 128)  # one row of tiles
        assert rows(plan(357, 4576, 13440)) == (wgmma, 128, 128)  # 108 tiles
        assert tuning.fp8_precise_plan(91, 9856, 132, 2, 9456) is None  # blockwise: as before
        assert rows(plan(397, 4736, 4496)) == (wgmma, 192, 128)  # 148 -> 111 tiles
        assert tuning.fp8_precise_plan(397, 4736, 132, 2).tile.block_m == 128
        assert rows(plan(211, 10864, 16256)) == (wgmma, 128, 128)  # 1.29 waves: as before
        assert rows(plan(200, 9216, 4096)) == (wgmma, 128, 128)  # a sliver above 192 rows
    # Under half a wave of 128x128 tiles, and 129-192 rows that the narrow rule takes.
    for m, n, k in ((80, 7680, 10240), (150, 5120, 12288), (179, 4352, 14848)):
        assert rows(plan(m, n, k)) == ("portable", 64, 64), (m, n, k)
    # Shallow K, few rows or under 0.45 of a wave: the portable kernel's tiles as before.
    for m, n, k in ((256, 4096, 4096), (128, 6144, 4096), (35, 8992, 11680), (63, 3968, 11808)):
        assert plan(m, n, k).kernel == "portable", (m, n, k)
    # A second wave of 8-14 tiles of 128 rows: 64x128 tiles, two to an SM.
    slivers = [(140, 9232, 4160), (184, 8976, 6144)] + [(200, 9216, 4096)] * fast
    for m, n, k in slivers:
        assert tuning.fp8_second_wave_sliver(m, n, 132)
        assert rows(plan(m, n, k)) == ("portable", 64, 128)
        assert plan(m, n, k).split_k == 1 and plan(m, n, k).tile.block_k == 128
    for m, n in ((211, 10864), (227, 12448), (100, 9232), (300, 9232)):
        assert not tuning.fp8_second_wave_sliver(m, n, 132), (m, n)
    # 65-128 rows, deep K, 0.55 of a wave to one of 128x128 tiles: fast accumulation takes
    # 64x128 portable tiles (the precise kernel, above, with precise accumulation).
    for m, n, k in ((96, 10240, 8192), (120, 13824, 10240), (80, 14336, 8192)):
        assert tuning.fp8_deep_k_half_rows(m, n, k, 132)
        assert rows(plan(m, n, k)) == (("portable", 64, 128) if fast else (wgmma, 128, 128))
    for m, n, k in ((64, 10240, 8192), (96, 8192, 28672), (96, 10240, 4096)):
        assert not tuning.fp8_deep_k_half_rows(m, n, k, 132), (m, n, k)
        if fast or k < tuning.FP8_PRECISE_DEEP_K:
            assert rows(plan(m, n, k)) == ("portable", 64, 64), (m, n, k)
    small = tuning.fp8_precise_plan(1024, 2304, 132, 2)  # 192-row tiles: 1152 rows
    large = tuning.fp8_precise_plan(2048, 8192, 132, 2)  # 2112 rows
    fp32_out = tuning.fp8_precise_plan(8192, 8192, 132, 4)
    assert small.kernel == large.kernel == fp32_out.kernel == tuning.FP8_PRECISE_KERNEL
    assert (small.tile.block_m, small.tile.num_stages) == (128, 4)
    assert (large.tile.block_m, large.tile.num_stages) == (192, 4)
    assert (fp32_out.tile.block_m, fp32_out.tile.num_stages) == (192, 3)
    for out_size in (2, 4):
        for m in (1024, 8192):
            tile = tuning.fp8_precise_plan(m, 8192, 132, out_size).tile
            consumers = tile.block_m // 64
            shared = (tile.num_stages * (tile.block_m + tile.block_n) * 128
                      + consumers * 64 * tile.block_n * out_size)
            assert shared <= 227 * 1024 and tile.num_stages >= 2


_PRECISE_COMPILE_SCRIPT = """
import re
from hopper_compile import compile_for
from torch_triton_gemm.kernels.wgmma_fp8 import fp8_grouped_precise_kernel
from torch_triton_gemm.kernels.wgmma_fp8 import ws_gemm_kernel

for kernel, consumers, stages, regs, out in (
        (ws_gemm_kernel, 2, 4, 232, "*bf16"), (ws_gemm_kernel, 3, 3, 160, "*fp32"),
        (fp8_grouped_precise_kernel, 2, 4, 232, "*bf16")):
    constants = dict(HAS_BIAS=True, CONSUMERS=consumers, BLOCK_N=128, GROUP_M=8,
                     STAGES=stages, CONSUMER_REGS=regs)
    if kernel is fp8_grouped_precise_kernel:
        constants.update(rows_ptr=None)
    else:
        constants.update(BLOCKWISE=consumers == 3, A_ROWS=1, ws_ptr=None, locks_ptr=None)
    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e5", "c_ptr": out, "bias_ptr": "*bf16",
                "sa_ptr": "*fp32", "sb_ptr": "*fp32", "offs_ptr": "*i32"}
    aligned = ["a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bn", "stride_cm"]
    ptx = compile_for(kernel, pointers, constants, aligned, num_warps=4).asm["ptx"]
    waits = re.findall(r"wgmma.wait_group.sync.aligned\\s+(\\d+)", ptx)
    print(consumers, len(re.findall(r"wgmma.mma_async.sync.aligned.m64n128k32", ptx)),
          sorted(set(waits)), len(waits), "setmaxnreg" in ptx, "cp.async.bulk.tensor" in ptx)

# Blockwise scale_a by TMA (SCALE_TMA): 1-D copies into the slots, and per consumer the two
# loads of scale_a a step gone (scale_b's stays).
constants = dict(HAS_BIAS=False, CONSUMERS=3, BLOCK_N=128, GROUP_M=8, STAGES=4,
                 CONSUMER_REGS=160, BLOCKWISE=True, A_ROWS=1, ws_ptr=None, locks_ptr=None)
for scale_tma in (False, True):
    ptx = compile_for(ws_gemm_kernel, pointers, dict(constants, SCALE_TMA=scale_tma),
                      aligned, num_warps=4).asm["ptx"]
    print(scale_tma, "cp.async.bulk.tensor.1d" in ptx, len(re.findall(r"ld\\.global", ptx)))
"""


def test_fp8_precise_kernel_compiles_for_hopper():
    """Without a GPU, Triton compiles the Gluon kernels (plain and grouped) for sm_90: per
    consumer warpgroup one K step of four m64n128k32 wgmmas and one full wait (the promotion),
    warp specialization (register reallocation between the partitions) and TMA copies."""
    if torch.cuda.is_available():
        pytest.skip("compiles for a fixed GPU target on a GPU-less host; the GPU tests run it")
    from torch_triton_gemm.kernels import wgmma_fp8

    assert wgmma_fp8.AVAILABLE  # the Triton these tests run on has Gluon
    out = _run_without_interpreter(_PRECISE_COMPILE_SCRIPT).split("\n")
    assert out[:3] == ["2 8 ['0'] 2 True True", "3 12 ['0'] 3 True True",
                       "2 8 ['0'] 2 True True"], out
    (loads, tma_1d, loads_left), (by_tma, tma_1d_by_tma, loads_left_by_tma) = (
        line.split() for line in out[3:5])
    assert (loads, tma_1d, by_tma, tma_1d_by_tma) == ("False", "False", "True", "True"), out
    assert int(loads_left_by_tma) == int(loads_left) - 3 * 2 * 2, out  # before and in the loop


def _on_hopper_with_gluon() -> bool:
    from torch_triton_gemm.kernels import wgmma_fp8

    return wgmma_fp8.AVAILABLE and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(1024, 2304, 1024), (1000, 2320, 1008), (4100, 4112, 528),
                                   (1024, 2304, 16384)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_precise_kernel_within_torchs_error(recipe, shape):
    """On an H100 the planner gives these precise products the warp-specialized kernel; every
    output element is written (NaN-poisoned output), and its error against float64 stays
    within 1.25x that of torch._scaled_mm's precise mode on the same operands (fp32 out: the
    accumulation's error; bf16 out with a bias), odd M, N and K included."""
    if not _on_hopper_with_gluon():
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm.ops.planner import plan_mm
    from torch_triton_gemm.ops.scaled_mm import _gemm_scales

    m, n, k = shape
    a, b, sa, sb = quantized_pair(m, n, k, recipe, recipe, "cuda", E4M3, E4M3)
    if recipe == "tensorwise":
        sa, sb = sa.reshape(()), sb.reshape(())
    for out_dtype, bias in ((torch.float32, None),
                            (torch.bfloat16, torch.randn(n, device="cuda",
                                                         dtype=torch.bfloat16))):
        out_dtype, checked = _check_inputs(a, b, sa, sb, bias, out_dtype)
        out = _poisoned((m, n), out_dtype, "cuda")
        plan = plan_mm(a, b, bias, out, "none", False, _gemm_scales(checked, sa, sb, False))
        assert plan.kernel == tuning.FP8_PRECISE_KERNEL
        launch_scaled_mm(a, b, sa, sb, bias, out, checked, False, traceable=False)
        ref = reference(a, b, sa, sb, recipe, recipe, bias)
        theirs = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
        assert rel_error(out, ref) <= 1.25 * rel_error(theirs, ref) + 1e-7, out_dtype
        assert rel_error(tg.scaled_mm(a, b, sa, sb, bias, out_dtype), ref) <= TOLERANCE


@pytest.mark.gpu
def test_gpu_precise_kernel_compiled_and_in_cuda_graphs():
    """A product the precise kernel takes in eager calls, under torch.compile (fullgraph: the
    graph calls the opaque tgemm::_scaled_mm_hopper, as Inductor cannot parse Gluon) and
    replayed in a CUDA graph with new operands, against float64."""
    if not _on_hopper_with_gluon():
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm.ops.planner import plan_mm
    from torch_triton_gemm.ops.scaled_mm import _gemm_scales

    m, n, k = 1024, 2304, 512
    a, b, sa, sb = quantized_pair(m, n, k, "rowwise", "rowwise", "cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _, checked = _check_inputs(a, b, sa, sb, bias, None)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    scales = _gemm_scales(checked, sa, sb, False)
    assert plan_mm(a, b, bias, out, "none", False, scales).kernel == tuning.FP8_PRECISE_KERNEL
    assert plan_mm(a, b, bias, out, "none", True, scales).kernel != tuning.FP8_PRECISE_KERNEL
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(lambda *t: tg.scaled_mm(*t) * 2, fullgraph=True)
    ref = reference(a, b, sa, sb, "rowwise", "rowwise", bias)
    result, code = run_and_get_code(compiled, a, b, sa, sb, bias)
    assert rel_error(result, 2 * ref) <= TOLERANCE
    assert "_scaled_mm_hopper" in "\n".join(code)  # the opaque op, not a parsed kernel
    tg.scaled_mm(a, b, sa, sb, bias)  # compiled and memoised outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tg.scaled_mm(a, b, sa, sb, bias)
    a2, _, sa2, _ = quantized_pair(m, n, k, "rowwise", "rowwise", "cuda")
    _refill(a, a2)
    _refill(sa, sa2)
    graph.replay()
    ref = reference(a, b, sa, sb, "rowwise", "rowwise", bias)
    assert rel_error(static_out, ref) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("recipes", [("blockwise", "blockwise"), ("blockwise", "k-major"),
                                     ("blockwise_128x128", "blockwise_128x128")], ids=str)
@pytest.mark.parametrize("shape", [(1024, 2304, 1024), (1000, 2320, 1008), (4100, 4112, 528)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_precise_kernel_blockwise(recipes, shape):
    """Blockwise products with 128x128 blocks for b on the precise kernel (scales applied at
    each K step's promotion, a partial last K block included; a's 1x128 scales as quantize
    gives them, rows-contiguous, which the loader brings by TMA, or "k-major": each row's
    contiguous): every output written, with fp32 out
    within 1e-3 of the float64 reference (fp32 promotion every 128 of K; the fp8 budget is
    1e-2), and as close to the Triton kernels' result."""
    if not _on_hopper_with_gluon():
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm.ops.launcher import prepare_launch
    from torch_triton_gemm.ops.planner import plan_mm
    from torch_triton_gemm.ops.scaled_mm import _gemm_scales

    (ra, rb), (m, n, k) = recipes, shape
    k_major = rb == "k-major"
    rb = ra if k_major else rb
    a, b, sa, sb = quantized_pair(m, n, k, ra, rb, "cuda")
    if k_major:
        sa = sa.contiguous()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out_dtype, checked = _check_inputs(a, b, sa, sb, bias, torch.float32)
    out = _poisoned((m, n), out_dtype, "cuda")
    scales = _gemm_scales(checked, sa, sb, False)
    plan = plan_mm(a, b, bias, out, "none", False, scales)
    assert plan.kernel == tuning.FP8_PRECISE_KERNEL
    ((_, meta, _),) = prepare_launch(a, b, bias, out, "none", False, plan, scales).launches
    assert meta.get("SCALE_TMA", False) == (ra == "blockwise" and not k_major)
    launch_scaled_mm(a, b, sa, sb, bias, out, checked, False, traceable=False)
    ref = reference(a, b, sa, sb, ra, rb, bias)
    assert rel_error(out, ref) <= 1e-3
    triton_out = _poisoned((m, n), out_dtype, "cuda")
    launch_scaled_mm(a, b, sa, sb, bias, triton_out, checked, False, traceable=True)
    assert rel_error(out, triton_out.double()) <= 1e-3


@pytest.mark.gpu
def test_gpu_blockwise_scales_by_tma_compiled_and_in_cuda_graphs():
    """Blockwise with a's scales rows-contiguous (quantize's layout: brought by TMA, built on the
    device even where a CUDA graph's launch takes host-built operand descriptors): eager,
    under torch.compile and replayed in a CUDA graph with new operands and scales, each
    against float64 (bf16 out: the fp8 tolerance)."""
    if not _on_hopper_with_gluon():
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    from torch_triton_gemm.ops.planner import plan_mm
    from torch_triton_gemm.ops.scaled_mm import _gemm_scales

    m, n, k = 1024, 2304, 2048
    a, b, sa, sb = quantized_pair(m, n, k, "blockwise", "blockwise", "cuda")
    assert sa.stride() == (1, m)  # (quantize's layout: rows-contiguous)
    _, checked = _check_inputs(a, b, sa, sb, None, None)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    scales = _gemm_scales(checked, sa, sb, False)
    assert plan_mm(a, b, None, out, "none", False, scales).kernel == tuning.FP8_PRECISE_KERNEL
    assert rel_error(tg.scaled_mm(a, b, sa, sb), reference(
        a, b, sa, sb, "blockwise", "blockwise")) <= TOLERANCE
    compiled = torch.compile(lambda *t: tg.scaled_mm(*t) * 2, fullgraph=True)
    assert rel_error(compiled(a, b, sa, sb), 2 * reference(
        a, b, sa, sb, "blockwise", "blockwise")) <= TOLERANCE
    for _ in range(3):  # the host-descriptor variant built and loaded by eager calls
        tg.scaled_mm(a, b, sa, sb)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tg.scaled_mm(a, b, sa, sb)
    for _ in range(2):
        a2, _, sa2, _ = quantized_pair(m, n, k, "blockwise", "blockwise", "cuda")
        _refill(a, a2)
        _refill(sa, sa2)
        static_out.fill_(float("nan"))
        graph.replay()
        ref = reference(a, b, sa, sb, "blockwise", "blockwise")
        assert rel_error(static_out, ref) <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_gpu_precise_kernel_k_splits(recipe):
    """The precise kernel's K splits (tuning.ws_split_plans for fp8: each split's partial
    scaled, or its blockwise scales applied at each step, then added by the reduction, which
    adds the bias), forced, on products of few rows with ragged edges: every output element
    written (NaN-poisoned), fp32 out (no bias: torch takes none there) within 1.25x
    torch._scaled_mm's precise error against float64 (blockwise: 1e-3, the unsplit kernel's
    bound), bf16 out with a bias within the fp8 tolerance, the same bits again."""
    if not _on_hopper_with_gluon():
        pytest.skip("the precise kernel runs on sm_90 GPUs with a Triton that has Gluon")
    for m, n, k in ((16, 1040, 4224), (130, 2064, 2048)):  # (torch: N a multiple of 16)
        a, b, sa, sb = quantized_pair(m, n, k, recipe, recipe, "cuda", E4M3, E4M3)
        if recipe == "tensorwise":
            sa, sb = sa.reshape(()), sb.reshape(())
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        bound = 1e-3
        if recipe != "blockwise":
            theirs = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
            bound = 1.25 * rel_error(theirs, reference(a, b, sa, sb, recipe, recipe)) + 1e-7
        plans = tuning.ws_split_plans(m, n, k, 1, 4, tgemm_device.num_sms(a.device))
        assert {p.tile.block_m for p in plans if p.split_k > 2} == {64, 128}, (m, n, k)
        for plan in plans:
            for out_dtype, b_in, limit in ((torch.float32, None, bound),
                                           (torch.bfloat16, bias, TOLERANCE)):
                out_dtype, checked = _check_inputs(a, b, sa, sb, b_in, out_dtype)
                outs = []
                for _ in range(2):
                    outs.append(_poisoned((m, n), out_dtype, "cuda"))
                    with tuning.force_plan(plan):
                        launch_scaled_mm(a, b, sa, sb, b_in, outs[-1], checked, False,
                                         traceable=False)
                assert torch.equal(outs[0], outs[1]), (m, n, k, plan)
                ref = reference(a, b, sa, sb, recipe, recipe, b_in)
                assert rel_error(outs[0], ref) <= limit, (m, n, k, plan, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_few_rows_run_transposed(recipe, fast, monkeypatch):
    """Where the planner runs a product of few rows transposed (tuning.swap_plan): the
    first and the memoised eager call, torch.compile and a CUDA graph replayed with new
    operands, against float64 and torch._scaled_mm's error; with a bias the plan is not
    transposed and the answer still right."""
    from torch_triton_gemm.ops.planner import plan_mm
    from torch_triton_gemm.ops.scaled_mm import _gemm_scales

    # One wave of 96 tiles; 65 tiles, the last one ragged, and a K tail; 448 tiles (3.4 waves);
    # 27 rows on 32-wide tiles; K under 2048 within a wave (4 and 24 rows). (N a multiple of 16:
    # torch._scaled_mm, the error bound, needs it.)
    # Two waves and more transposed on every GPU here, not only where the bandwidth per SM takes
    # them, so that their tiles run on any GPU.
    monkeypatch.setattr(tuning, "SWAP_MULTI_WAVE_MIN_GBPS_PER_SM", 0.0)
    for m, n, k in ((2, 6144, 4096), (5, 4112, 2064), (16, 28672, 4096), (27, 4096, 14336),
                    (4, 4096, 1024), (24, 6400, 1600)):
        a, b, sa, sb = quantized_pair(m, n, k, recipe, recipe, "cuda")
        _, checked = _check_inputs(a, b, sa, sb, None, None)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        scales = _gemm_scales(checked, sa, sb, fast)
        assert plan_mm(a, b, None, out, "none", False, scales).swap_ab, (m, n, k)
        ref = reference(a, b, sa, sb, recipe, recipe)
        theirs = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        bound = max(TOLERANCE, 1.25 * rel_error(theirs, ref))
        for _ in range(2):  # the second call runs the memoised launch
            out = tg.scaled_mm(a, b, sa, sb, use_fast_accum=fast)
            assert rel_error(out, ref) <= bound, (m, n, k)
        compiled = torch.compile(lambda *t: tg.scaled_mm(*t, use_fast_accum=fast) * 2,
                                 fullgraph=True)
        assert rel_error(compiled(a, b, sa, sb), 2 * ref) <= bound
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tg.scaled_mm(a, b, sa, sb, use_fast_accum=fast)
        a2, b2, sa2, sb2 = quantized_pair(m, n, k, recipe, recipe, "cuda")
        for dst, src in ((a, a2), (b, b2), (sa, sa2), (sb, sb2)):
            _refill(dst, src)
        graph.replay()
        assert rel_error(static_out, reference(a, b, sa, sb, recipe, recipe)) <= bound
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        assert not plan_mm(a, b, bias, out, "none", False, scales).swap_ab
        with_bias = tg.scaled_mm(a, b, sa, sb, bias, use_fast_accum=fast)
        assert rel_error(with_bias, reference(a, b, sa, sb, recipe, recipe, bias)) <= bound
