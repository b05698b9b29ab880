"""tgemm::mm — out = activation(a @ b + bias), one Triton kernel.

Contract:
    mm(a: Tensor[M, K], b: Tensor[K, N], bias: Tensor[N] | None = None,
       activation: str = "none", out_dtype: torch.dtype | None = None) -> Tensor[M, N]

- a and b share one dtype: float16, bfloat16, float32 (tf32 unless
  ``torch.get_float32_matmul_precision() == "highest"``), float8_e4m3fn or float8_e5m2
  (unscaled). Accumulation is fp32. out_dtype defaults to the input dtype, and to bfloat16 for
  fp8; it may be float16, bfloat16 or float32.
- Any strides (row-major, column-major such as ``W.t()``, sliced views, stride-0 broadcasts) and
  any M, N, K >= 0: K = 0 gives activation(bias) (zeros without bias).
- bias (per output column) and the activation ("none", "relu", "gelu" with the tanh
  approximation, "silu", "leaky_relu" with slope 0.01) run in fp32 in the kernel's epilogue.
- Autograd: gradients for a, b and bias, computed with tgemm::mm itself.

This module reads top to bottom: checks, the op body (choose a kernel, launch), the fake,
registration, autograd, and the typed public function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import triton
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.library import wrap_triton

from .. import device as _device
from .. import plan_cache, tuning
from ..kernels.matmul import mm_kernel, mm_tma_kernel, splitk_reduce_kernel
from ..kernels.tiles import ACTIVATIONS
from ._registry import define_triton_op, eager_autograd_function

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                torch.float8_e5m2)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INT32_LIMIT = 2**31 - 1



# --- checks -------------------------------------------------------------------------------------

def _check(cond: bool | torch.SymBool, message: Callable[[], str],
           error: type[Exception] = RuntimeError) -> None:
    """torch._check / torch._check_value, skipped for a plain True to keep eager launches cheap.

    Symbolic conditions still go to torch._check, which records them without guarding.
    """
    if cond is True:
        return
    if error is ValueError:
        torch._check_value(cond, message)
    else:
        torch._check(cond, message)


def _check_value(cond: bool, message: Callable[[], str]) -> None:
    _check(cond, message, ValueError)


def _check_operand_pair(op: str, a: torch.Tensor, b: torch.Tensor,
                        dtypes: tuple[torch.dtype, ...]) -> None:
    """The checks of a and b that every two-operand op makes: a supported dtype shared by
    both, one device, dense layouts; messages start with the op's name ``op``."""
    _check_value(
        a.dtype in dtypes,
        lambda: f"{op}: a has dtype {a.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    _check_value(
        a.dtype == b.dtype,
        lambda: f"{op}: a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    _check(a.device == b.device, lambda: f"{op}: a is on {a.device} but b is on {b.device}")
    _check(a.layout == torch.strided and b.layout == torch.strided,
           lambda: f"{op}: a and b must be dense (strided) tensors, got {a.layout} and "
                   f"{b.layout}")


def _check_inputs(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  out_dtype: torch.dtype | None) -> torch.dtype:
    """Validate the arguments (also under FakeTensor and symbolic shapes); return the out dtype."""
    _check(
        a.dim() == 2,
        lambda: f"tgemm::mm: a must be 2-D [M, K], got {a.dim()}-D of shape {tuple(a.shape)}")
    _check(
        b.dim() == 2,
        lambda: f"tgemm::mm: b must be 2-D [K, N], got {b.dim()}-D of shape {tuple(b.shape)}")
    _check(
        a.shape[1] == b.shape[0],
        lambda: f"tgemm::mm: a has {a.shape[1]} columns but b has {b.shape[0]} rows "
                f"(a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    _check_operand_pair("tgemm::mm", a, b, INPUT_DTYPES)
    _check_value(
        activation in ACTIVATIONS,
        lambda: f"tgemm::mm: unknown activation {activation!r}; choose one of {ACTIVATIONS}")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in _FP8_DTYPES else a.dtype
    check_epilogue_args("tgemm::mm", out_dtype, bias, b.shape[1])
    if bias is not None:
        _check(bias.device == a.device,
               lambda: f"tgemm::mm: bias is on {bias.device} but a is on {a.device}")
    return out_dtype


def check_epilogue_args(op: str, out_dtype: torch.dtype, bias: torch.Tensor | None,
                        n: int) -> None:
    """The out dtype and the [N] bias of an op whose epilogue adds bias in fp32 and casts."""
    _check_value(
        out_dtype in OUT_DTYPES,
        lambda: f"{op}: out_dtype {out_dtype} is not supported; choose one of {OUT_DTYPES}")
    if bias is not None:
        _check(
            bias.dim() == 1 and bias.shape[0] == n,
            lambda: f"{op}: bias must be 1-D of size N={n} (b's columns), got shape "
                    f"{tuple(bias.shape)}")
        _check_value(
            bias.dtype in OUT_DTYPES,
            lambda: f"{op}: bias has dtype {bias.dtype}; supported: {OUT_DTYPES}")


def _needs_int64_indexing(shape_and_strides: tuple[tuple[int, ...], ...]) -> bool:
    """True when an element offset of some 2-D tensor (its shape and strides) may not fit in
    int32."""
    for rows, cols, row_stride, col_stride in shape_and_strides:
        if rows == 0 or cols == 0:
            continue
        if (rows - 1) * row_stride + (cols - 1) * col_stride > _INT32_LIMIT:
            return True
    return False


def _input_precision(dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _layout_key(stride_ak: int, stride_bk: int) -> int:
    # Whether each operand is contiguous along K; the best tile differs between layouts.
    return 2 * int(stride_ak == 1) + int(stride_bk == 1)


# --- TMA eligibility ----------------------------------------------------------------------------
# A TMA descriptor needs a 16-byte aligned base, a unit stride in its last dimension and the other
# stride a multiple of 16 bytes. Operands that miss this run on the portable kernel.

def _base_aligned(t: torch.Tensor) -> bool:
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # FakeTensor / functional tensor while tracing: storages are aligned
        offset = t.storage_offset()
        return type(offset) is int and offset * t.element_size() % 16 == 0


def _tma_operand(rows: int, cols: int, stride_rows: int, stride_cols: int,
                 element_size: int) -> tuple[bool, int, int] | None:
    """(rows contiguous?, stride of rows, stride of columns) as the TMA kernel should see a
    [rows, cols] operand, or None when TMA cannot describe it. A dimension of size 1 has no
    meaningful stride: it gets one that satisfies the rules."""
    def padded(n: int) -> int:
        return -(-n * element_size // 16) * 16 // element_size

    if rows == 1:
        stride_rows = padded(cols)
    if cols == 1:
        stride_cols = padded(rows)
    if stride_cols == 1 and stride_rows > 0 and stride_rows * element_size % 16 == 0:
        return False, stride_rows, 1
    if stride_rows == 1 and stride_cols > 0 and stride_cols * element_size % 16 == 0:
        return True, 1, stride_cols
    return None


def _tma_arguments(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   pads: tuple[Pad | None, Pad | None] = (None, None)
                   ) -> tuple[tuple[int, ...], dict[str, bool]] | None:
    """Strides and layout flags for mm_tma_kernel, or None when the operands need the portable
    kernel; an operand with a ``Pad`` is seen as its padded copy."""
    M, K = a.shape
    N = b.shape[1]
    if K == 0:
        return None
    size = a.element_size()
    descs = []
    for t, pad, rows, cols in ((a, pads[0], M, K), (b, pads[1], K, N)):
        if pad is None:
            if not _base_aligned(t):
                return None
            descs.append(_tma_operand(rows, cols, *t.stride(), size))
        else:
            descs.append(_tma_operand(rows, cols, *pad.strides(), size))
    a_desc, b_desc = descs
    if a_desc is None or b_desc is None:
        return None
    strides = (a_desc[1], a_desc[2], b_desc[1], b_desc[2])
    flags = {"A_M_CONTIGUOUS": a_desc[0], "B_K_CONTIGUOUS": b_desc[0],
             "C_TMA": N * out.element_size() % 16 == 0}
    return strides, flags


# --- padded copies for TMA ----------------------------------------------------------------------
# An operand TMA cannot describe (a row pitch that is not a multiple of 16 bytes, as in
# 999 x 1007 bf16, or an unaligned base) would send a large product to the portable kernel
# reading it without vector loads. Copying it into a buffer whose rows start every PAD_BYTES
# bytes costs one pass over it; on an H100, 1000^3 to 2048^3 products with odd sizes then ran
# 1.3-2x faster, copies included (rows at 128 bytes beat 16). Small products read the operands
# as they are.
PAD_BYTES = 128
PAD_MIN_SIZE = 1 << 27  # M * N * K
# Each copied element must be reused by many output tiles: skinny products (decode) are bound
# by reading the operands once, and a copy would double that.
PAD_MIN_SIDE = 512


class Pad(NamedTuple):
    """A padded copy of a [rows, cols] operand: row-major (or column-major: ``columns``) with
    ``pitch`` elements between the starts of consecutive rows (columns)."""
    columns: bool
    pitch: int

    def strides(self) -> tuple[int, int]:
        return (1, self.pitch) if self.columns else (self.pitch, 1)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        rows, cols = t.shape
        if self.columns:
            buffer = t.new_empty((cols, self.pitch))[:, :rows].t()
        else:
            buffer = t.new_empty((rows, self.pitch))[:, :cols]
        return buffer.copy_(t)


def kernel_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    pad: bool | None = None
                    ) -> tuple[tuple[tuple[int, ...], dict[str, bool]] | None,
                               tuple[Pad | None, Pad | None], tuple[int, int, int, int]]:
    """How the kernels see a and b (sizes known): the TMA kernel's arguments (None: portable
    kernel only), the padded copies made first (see PAD_BYTES; any plan reads them), and the
    strides (am, ak, bk, bn) the kernels read. Operands TMA cannot describe are copied when
    ``pad`` says so (None: for large products, PAD_MIN_SIZE and PAD_MIN_SIDE). Tuning keys its
    plans by the same view."""
    device = a.device
    strides = (*a.stride(), *b.stride())
    tma_args = _tma_arguments(a, b, out)
    # The interpreter runs the TMA kernel too (for tests), but only when a plan asks for it.
    if not (_device.supports_tma(device) or _device.interpreter_enabled()):
        return None, (None, None), strides
    (M, K), N = a.shape, b.shape[1]
    if pad is None:
        pad = M * N * K >= PAD_MIN_SIZE and min(M, N) >= PAD_MIN_SIDE
    if tma_args is None and _device.supports_tma(device) and pad:
        pads = _pads(a, b)
        padded = _tma_arguments(a, b, out, pads)
        if padded is not None:
            a_strides = pads[0].strides() if pads[0] else strides[:2]
            b_strides = pads[1].strides() if pads[1] else strides[2:]
            return padded, pads, (*a_strides, *b_strides)
    return tma_args, (None, None), strides


def _pads(a: torch.Tensor, b: torch.Tensor) -> tuple[Pad | None, Pad | None]:
    """The padded copies a large product needs for the TMA kernel (None: used as it is)."""
    size = a.element_size()

    def pad(t: torch.Tensor) -> Pad | None:
        rows, cols = t.shape
        if _base_aligned(t) and _tma_operand(rows, cols, *t.stride(), size) is not None:
            return None
        columns = t.stride(0) == 1 and t.stride(1) != 1  # keep a column-major operand so
        inner = rows if columns else cols
        step = PAD_BYTES // size
        return Pad(columns, -(-inner // step) * step)

    return pad(a), pad(b)


def _plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
          out_size: int, layout: int, tma: bool, eager: bool,
          scales: GemmScales | None = None) -> tuning.MMPlan:
    """The launch plan: a forced one (tests, tuning), else the tuned table's, else the
    heuristic's. Tuning happens here only when TORCH_TRITON_GEMM_AUTOTUNE=1 asks for it, on a
    plain eager call outside CUDA-graph capture. Scaled products (``scales``) take the
    heuristic's plan for their recipe: tuned plans were timed on unscaled products."""
    forced = tuning.forced_plan()
    if forced is not None:
        return forced
    (M, K), N, device = a.shape, b.shape[1], a.device
    scaling, fast_accum = ("none", False) if scales is None else (scales.mode, scales.fast_accum)
    # Memoised per shape: an eager call of a small GEMM cannot afford to rebuild the plan.
    memo_key = (M, N, K, a.dtype, out_size, layout, tma, device, plan_cache.TUNED.version, scaling,
                fast_accum)
    plan = _PLANS.get(memo_key)
    if plan is not None:
        return plan
    if device.type == "cuda" and scales is None:
        plan = plan_cache.TUNED.get(device, plan_cache.plan_key(M, N, K, a.dtype, layout, tma))
        if plan is None and eager and tuning.autotune_enabled() and (
                not torch.cuda.is_current_stream_capturing()):
            from ..tune import tune_on_first_use

            tuned = tune_on_first_use(a, b, bias, activation)
            if tuned is not None:
                return tuned
    if plan is None:
        plan = tuning.heuristic_mm_plan(M, N, K, a.element_size(), tma, _num_sms(device),
                                        out_size, a_k_contiguous=bool(layout & 2),
                                        scaling=scaling, fast_accum=fast_accum)
    if len(_PLANS) >= _PLANS_LIMIT:
        _PLANS.clear()
    _PLANS[memo_key] = plan
    return plan


_PLANS: dict[tuple[Any, ...], tuning.MMPlan] = {}
_PLANS_LIMIT = 4096


def _num_sms(device: torch.device) -> int:
    # The interpreter runs programs one after another: a few persistent programs suffice there.
    return _device.num_sms(device) if device.type == "cuda" else 4


# --- the op body --------------------------------------------------------------------------------

def _mm_fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Shapes, dtypes and strides only: a row-major [M, N] tensor of the out dtype."""
    out_dtype = _check_inputs(a, b, bias, activation, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mm_impl(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=True)


def _mm_eager(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op body for eager calls on real tensors: the kernels launched without wrap_triton,
    checks and launch arithmetic memoised per call signature."""
    return _eager_allocate_and_launch(a, b, bias, activation, out_dtype)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                         activation: str, out_dtype: torch.dtype | None,
                         traceable: bool) -> torch.Tensor:
    out = _mm_fake(a, b, bias, activation, out_dtype)
    launch_mm(a, b, bias, out, activation, traceable)
    return out


class GemmScales(NamedTuple):
    """fp8 scales for the GEMM kernels (tgemm::scaled_mm's tensorwise, rowwise and blockwise
    recipes). "outer": scale_a per row of a, scale_b per column of b (stride 0 for one scale);
    "block": scale_a per ``a_rows`` rows x 128 K elements, scale_b per 128 K x ``b_cols``
    columns, indexed [row block, K block] and [K block, column block] through the strides."""
    mode: str
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    strides: tuple[int, int, int, int]  # scale_a: rows, K blocks; scale_b: K blocks, columns
    a_rows: int = 1
    b_cols: int = 1
    fast_accum: bool = False


# Scale strides and (SCALING, SA_ROWS, SB_COLS, FAST_ACCUM) of an unscaled GEMM.
_NO_SCALES = ((0, 0, 0, 0), ("none", 1, 1, False))


class PreparedLaunch(NamedTuple):
    """Everything a GEMM launch needs but the tensors: kernel, its launches (grid, meta-
    parameters, the runtime arguments after the tensor pointers; a tail split has two), and the
    split-K reduction if any."""
    kernel: Any
    launches: tuple[tuple[tuple[int], Mapping[str, Any], tuple[Any, ...]], ...]
    workspace_shape: tuple[Any, ...] | None
    reduce: tuple[tuple[int], tuple[Any, ...], Mapping[str, Any]] | None
    pads: tuple[Pad | None, Pad | None] | None = None  # operands to copy first (TMA rules)
    locks_shape: tuple[int] | None = None  # stream-K's flags, zeroed per launch
    plan: tuning.MMPlan | None = None  # the plan as launched (for benchmarks and tests)
    # Compiled kernels, one cache per launch and the reduction's last (see _launch_compiled),
    # for prepared launches that are kept and reused (memoised eager calls); else empty.
    compiled: tuple[dict[Any, Any], ...] = ()


def launch_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              activation: str, traceable: bool = True, plan: tuning.MMPlan | None = None,
              scales: GemmScales | None = None) -> None:
    """Launch the GEMM kernels writing activation(a @ b + bias) into ``out`` (checked inputs),
    the product scaled by ``scales`` when given (fp8 recipes of tgemm::scaled_mm).

    ``traceable=False`` launches the Triton kernels directly instead of through ``wrap_triton``,
    for plain eager calls that nothing traces. ``plan`` replaces the plan choice (tuning); a
    "tma" plan runs on the portable kernel when the operands cannot be described for TMA.
    """
    error = _device.kernel_device_error(a.device)
    _check(error is None, lambda: f"tgemm::mm: {error}")
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    prepared = prepare_launch(a, b, bias, out, activation, traceable, plan, scales)
    scale_a, scale_b = (None, None) if scales is None else (scales.scale_a, scales.scale_b)
    run_launch(prepared, a, b, bias, out, scale_a, scale_b, traceable)


def prepare_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, activation: str, traceable: bool,
                   plan: tuning.MMPlan | None, scales: GemmScales | None) -> PreparedLaunch:
    """Choose the plan and work out the launch (see ``launch_mm``); M and N are non-zero."""
    device = a.device
    M, K = a.shape
    N = b.shape[1]
    stride_am, stride_ak = a.stride()
    stride_bk, stride_bn = b.stride()
    stride_cm, stride_cn = out.stride()
    tma_args = None
    pads = (None, None)
    if type(M) is int and type(N) is int and type(K) is int:
        tma_args, pads, (stride_am, stride_ak, stride_bk, stride_bn) = kernel_operands(
            a, b, out, None if plan is None else plan.pad)
        if plan is None:
            plan = _plan(a, b, bias, activation, out.element_size(),
                         _layout_key(stride_ak, stride_bk),
                         tma_args is not None and _device.supports_tma(device), not traceable,
                         scales)
        if plan.kernel == "tma" and tma_args is None:
            plan = dataclasses.replace(plan, kernel="portable", epilogue_subtile=1,
                                       warp_specialize=False, stream_k=0)
        if scales is not None:
            plan = tuning.scaled_plan(plan, scales.mode)
        split_k, k_per_split = tuning.effective_split(K, plan.tile.block_k, plan.split_k)
    else:
        # Symbolic sizes (torch.compile with dynamic shapes): one plan for every size, so that
        # nothing guards on them; the portable kernel takes any strides.
        plan = tuning.symbolic_mm_plan(a.element_size())
        split_k, k_per_split = 1, K
    tile = plan.tile
    tiles = tuning.output_tiles(M, N, tile)
    programs = _num_sms(device) * plan.programs_per_sm  # of the persistent kernel
    sk_tiles = 0
    if plan.stream_k and plan.kernel == "tma" and split_k == 1:
        sk_tiles = tuning.stream_k_tiles(tiles, programs, plan.stream_k)
    whole_tiles, split_k = tuning.split_tiles(tiles, split_k, plan.split_tail, _num_sms(device))
    split_units = (tiles - whole_tiles) * split_k if split_k > 1 else 0
    index_64 = _needs_int64_indexing(((M, K, stride_am, stride_ak), (K, N, stride_bk, stride_bn),
                                      (M, N, stride_cm, stride_cn),
                                      (max(split_units, programs) * tile.block_m, tile.block_n,
                                       tile.block_n, 1)))
    stride_bias = bias.stride(0) if bias is not None else 0
    if scales is None:
        scale_strides, scaling = _NO_SCALES
    else:
        scale_strides = scales.strides
        scaling = (scales.mode, scales.a_rows, scales.b_cols, scales.fast_accum)
    if plan.kernel == "tma":
        strides, flags = tma_args
        kernel = mm_tma_kernel
    else:
        strides, flags = (stride_am, stride_ak, stride_bk, stride_bn), {}
        kernel = mm_kernel

    def gemm_launch(first_tile: Any, units: Any, split: bool, k_per_split: Any
                    ) -> tuple[tuple[int], Mapping[str, Any], tuple[Any, ...]]:
        # Runtime arguments after the tensors (a, b, out, bias, workspace, locks, scale_a,
        # scale_b), in the kernels' shared order; the plan's meta-parameters come after them.
        runtime_args = (
            M, N, K, *strides, stride_cm, stride_cn, stride_bias, *scale_strides, k_per_split,
            first_tile, units, sk_tiles, bias is not None, activation, _input_precision(a.dtype),
            _device.interpreter_enabled() and a.dtype == torch.bfloat16, index_64,
        )
        meta = tuning.launch_meta(plan, split, scaling, sk_tiles > 0)
        # Stream-K needs every program (each takes a share of the shared tiles' K steps).
        grid = ((programs if sk_tiles else min(programs, units)),) if (
            kernel is mm_tma_kernel) else (units,)
        return grid, {**meta, **flags} if flags else meta, runtime_args

    launches = []
    if sk_tiles:
        launches.append(gemm_launch(sk_tiles, tiles - sk_tiles, False, K))
    elif split_k == 1 or whole_tiles > 0:  # (split_k first: no guard on symbolic sizes)
        launches.append(gemm_launch(0, whole_tiles, False, K))
    reduce = None
    if split_k > 1:
        launches.append(gemm_launch(whole_tiles, split_units, True, k_per_split))
        block_m, block_n, num_warps = tuning.reduce_tile(tiles - whole_tiles, tile.block_m,
                                                         tile.block_n, _num_sms(device))
        blocks = (tile.block_m // block_m) * (tile.block_n // block_n)
        reduce = (
            ((tiles - whole_tiles) * blocks,),
            (M, N, stride_cm, stride_cn, stride_bias, whole_tiles, bias is not None,
             activation, index_64),
            {"SPLIT_K": split_k, "TILE_M": tile.block_m, "TILE_N": tile.block_n,
             "GROUP_M": tile.group_m, "BLOCK_M": block_m, "BLOCK_N": block_n,
             "num_warps": num_warps},
        )
    workspace = locks = None
    if split_k > 1:
        workspace = (split_units, tile.block_m, tile.block_n)
    elif sk_tiles:
        # A partial tile per program at most, and the program's flag.
        workspace, locks = (programs, tile.block_m, tile.block_n), (programs,)
    return PreparedLaunch(kernel, tuple(launches), workspace, reduce,
                          None if pads == (None, None) else pads, locks_shape=locks, plan=plan)


def run_launch(prepared: PreparedLaunch, a: torch.Tensor, b: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, scale_a: torch.Tensor | None,
               scale_b: torch.Tensor | None, traceable: bool) -> None:
    """Launch a prepared GEMM on these tensors (and its split-K reduction); scale_a and scale_b
    are the scales of a prepared scaled product, else None."""
    if prepared.kernel is mm_tma_kernel:
        _device.install_tma_allocator()  # per thread where Triton needs it (autograd's too)
    if prepared.pads is not None:
        pad_a, pad_b = prepared.pads
        a = a if pad_a is None else pad_a.copy(a)
        b = b if pad_b is None else pad_b.copy(b)
    workspace = None
    if prepared.workspace_shape is not None:
        workspace = torch.empty(prepared.workspace_shape, device=a.device, dtype=torch.float32)
    locks = None
    if prepared.locks_shape is not None:
        locks = torch.zeros(prepared.locks_shape, device=a.device, dtype=torch.int32)
    caches = prepared.compiled or (None,) * (len(prepared.launches) + 1)
    for (grid, meta, runtime_args), cache in zip(prepared.launches, caches):
        _launch(prepared.kernel, grid,
                (a, b, out, bias, workspace, locks, scale_a, scale_b, *runtime_args), meta,
                traceable,
                cache)
    if prepared.reduce is not None:
        grid, runtime_args, meta = prepared.reduce
        _launch(splitk_reduce_kernel, grid, (workspace, out, bias, *runtime_args), meta,
                traceable, caches[-1])


def _launch(kernel: Any, grid: tuple[int], args: tuple[Any, ...], meta: Mapping[str, Any],
            traceable: bool, compiled: dict[int, Any] | None = None) -> None:
    """Launch ``kernel``: through wrap_triton where tracing may see it, else directly; with
    ``compiled`` (a memoised eager launch's cache), through its compiled kernel
    (_launch_compiled)."""
    # Interpreted kernels are plain Python that no tracer sees through (the op is then an opaque
    # custom_op), and torch 2.11's wrap_triton refuses them: they always launch directly.
    if traceable and not _INTERPRETED:
        # Arguments may be symbolic here: pass them by name, as wrap_triton expects.
        wrap_triton(kernel)[grid](**dict(zip(kernel.arg_names, args)), **meta)
        return
    with _device.SHARED_SCRATCH:
        if compiled is None or not _launch_compiled(compiled, kernel, grid, args, meta):
            kernel[grid](*args, **meta)


def _launch_compiled(cache: dict[int, Any], kernel: Any, grid: tuple[int],
                     args: tuple[Any, ...], meta: Mapping[str, Any]) -> bool:
    """Launch a memoised eager launch through the kernel Triton compiled for it; False where the
    caller must launch through Triton's JIT.

    The launch's memo key (each op's ``_eager_signature``) fixes everything Triton specialises
    on: every argument but the tensors, and of the tensors their dtypes and 16-byte alignment
    (inputs by ``tensor_key``, outputs and workspaces by being fresh allocations). So one compiled
    kernel per device serves every call with that key. Launching it directly skips the JIT's
    argument binding and specialisation, about two thirds of the host time of a small GEMM.
    Triton's launch hooks (profilers) need the JIT's path, which calls them.
    """
    if _INTERPRETED or _launch_hooks_set():
        return False
    device = torch._C._cuda_getDevice()
    entry = cache.get(device)
    if entry is None:
        launched = kernel[grid](*args, **meta)
        if launched is not None and hasattr(launched, "result"):
            launched = launched.result()
        # The launcher takes every parameter, constexprs included, in signature order.
        tail = tuple(meta[param.name] if param.name in meta else param.default
                     for param in kernel.params[len(args):])
        cache[device] = (launched, (*grid, 1, 1)[:3], tail)
        return True
    launched, (grid_0, grid_1, grid_2), tail = entry
    launched.run(grid_0, grid_1, grid_2, torch._C._cuda_getCurrentRawStream(device),
                 launched.function, launched.packed_metadata, None, None, None, *args, *tail)
    return True


# Fixed for the process once kernels are decorated (see device.interpreter_enabled).
_INTERPRETED = _device.interpreter_enabled()
# Triton's runtime knobs (3.4+), where its launch hooks live; direct launches rely on the
# launcher contract of those versions (grid, stream, function, metadata, hooks, arguments) and
# are not used on older ones.
_TRITON_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks_set() -> bool:
    if _TRITON_RUNTIME is None:
        return True
    enter, leave = _TRITON_RUNTIME.launch_enter_hook, _TRITON_RUNTIME.launch_exit_hook
    # Triton 3.5+ keeps hook chains (empty when unused); earlier versions a callable or None.
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


# --- plain eager calls ----------------------------------------------------------------------------
# An eager call of a small GEMM is host-bound: checks, plan and launch arithmetic cost more than
# the kernel. They depend only on the call's signature (shapes, strides, dtypes, devices, the
# 16-byte alignment of operands and bias, activation, out dtype, fp32 precision, tuned-plan
# version), so eager calls memoise them per signature; a signature seen once needs no checks
# again, and its kernels launch without Triton's JIT (see _launch_compiled).

def tensor_key(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What an eager call's signature holds of a tensor argument (None stays None): shape,
    strides, dtype, device and 16-byte alignment, all that checks, plans and Triton's
    specialisation read of it."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _eager_signature(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     activation: str, out_dtype: torch.dtype | None) -> tuple[Any, ...]:
    return (tensor_key(a), tensor_key(b), tensor_key(bias), activation, out_dtype,
            _float32_precision(), plan_cache.TUNED.version)


# torch.get_float32_matmul_precision without its Python wrapper (read on every eager call).
_float32_precision = torch._C._get_float32_matmul_precision


# Signature -> (out's shape, strides and dtype, the prepared launch or None).
_EAGER_LAUNCHES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...], torch.dtype,
                                             Any]] = {}
_EAGER_LAUNCHES_LIMIT = 4096


def _eager_allocate_and_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                               activation: str, out_dtype: torch.dtype | None,
                               signature: tuple[Any, ...] | None = None) -> torch.Tensor:
    """A plain eager call (see _plain_eager) without autograd; ``signature``, when the caller
    has it, is this call's ``_eager_signature``."""
    if tuning.forced_plan() is not None:
        return _allocate_and_launch(a, b, bias, activation, out_dtype, traceable=False)
    if signature is None:
        signature = _eager_signature(a, b, bias, activation, out_dtype)

    def first_call() -> tuple[torch.Tensor, PreparedLaunch | None]:
        out = _mm_fake(a, b, bias, activation, out_dtype)  # the checks
        error = _device.kernel_device_error(a.device)
        _check(error is None, lambda: f"tgemm::mm: {error}")
        if out.numel() == 0:
            return out, None
        return out, kept(prepare_launch(a, b, bias, out, activation, False, None, None))

    out, prepared = memoised_eager_call(signature, first_call, a)
    if prepared is not None:
        run_launch(prepared, a, b, bias, out, None, None, False)
    return out


def kept(prepared: PreparedLaunch) -> PreparedLaunch:
    """``prepared`` with caches for the kernels it launches, to be kept and reused."""
    return prepared._replace(compiled=tuple({} for _ in range(len(prepared.launches) + 1)))


def memoised_eager_call(signature: tuple[Any, ...],
                        first_call: Callable[[], tuple[torch.Tensor, Any]],
                        like: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The output and the prepared launch (None: nothing to launch) of an eager GEMM call, from
    the memo of its ``signature``, which must fix everything the checks and the launch depend
    on (the op's name among them where two ops share a form).

    The first call of a signature runs ``first_call``: the checks, then the output and the
    prepared launch. Later calls only allocate the output, as the first call made it, on
    ``like``'s device (``empty_strided``, the cheapest of torch's allocating calls: no option
    parsing from a template tensor as in ``new_empty``).
    """
    known = _EAGER_LAUNCHES.get(signature)
    if known is None:
        out, prepared = first_call()
        if len(_EAGER_LAUNCHES) >= _EAGER_LAUNCHES_LIMIT:
            _EAGER_LAUNCHES.clear()
        _EAGER_LAUNCHES[signature] = (tuple(out.shape), out.stride(), out.dtype, prepared)
        return out, prepared
    shape, strides, dtype, prepared = known
    return torch.empty_strided(shape, strides, dtype=dtype, device=like.device), prepared


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True for a call no PyTorch subsystem needs to see as an op: no tracing, compile, modes or
    tensor subclasses. Such calls skip the dispatcher (autograd still applies, through
    ``_EagerMM``), whose Python custom-op path costs more host time than a small GEMM takes on
    the GPU."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.mm on real tensors reach _mm_eager through light kernels (see
# define_triton_op); tracing and compile see the triton_op _mm_impl.
mm_op = define_triton_op("tgemm::mm", _mm_impl, _mm_fake, eager_impl=_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# out = act(z), z = a @ b + bias. relu and leaky_relu take their derivative from the output;
# gelu and silu recompute z with one more tgemm::mm (in fp32) rather than keep it alive.

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, bias, activation, _ = inputs
    _check(
        a.dtype not in _FP8_DTYPES or not (a.requires_grad or b.requires_grad),
        lambda: f"tgemm::mm: {a.dtype} inputs have no gradient; keep fp8 operands out of autograd")
    ctx.activation = activation
    ctx.has_bias = bias is not None
    recompute = activation in ("gelu", "silu")
    need_a = b.requires_grad or recompute
    need_b = a.requires_grad or recompute
    ctx.save_for_backward(
        a if need_a else None,
        b if need_b else None,
        bias if recompute else None,
        output if activation in ("relu", "leaky_relu") else None,
    )
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
    ctx.a_transposed, ctx.b_transposed = _is_transposed(a), _is_transposed(b)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _is_transposed(t: torch.Tensor) -> bool:
    """A column-major matrix (the ``.t()`` of a contiguous one), whose gradient should be too."""
    rows, cols = t.shape
    # guard_or_false: under torch.compile with dynamic shapes, no guard on the sizes.
    return guard_or_false((t.stride(0) == 1) & (t.stride(1) == rows) & (rows != 1) & (cols != 1))


def _activation_grad(ctx, grad_out: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    a, b, bias, out = ctx.saved_tensors
    if ctx.activation == "none":
        return grad_out
    if ctx.activation == "relu":
        return torch.ops.aten.threshold_backward(grad_out, out, 0)
    if ctx.activation == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward(grad_out, out, 0.01, True)
    z = mm(a, b, bias, out_dtype=torch.float32)
    if ctx.activation == "gelu":
        return torch.ops.aten.gelu_backward(grad_out.float(), z, approximate="tanh")
    return torch.ops.aten.silu_backward(grad_out.float(), z)


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    a, b, _, _ = ctx.saved_tensors
    grad_z = _activation_grad(ctx, grad_out)
    grad_a = grad_b = grad_bias = None
    # Each gradient in its input's layout, as aten's mm formulas give it: a weight passed as
    # W.t() gets a W.t()-shaped gradient, so W.grad is contiguous and autograd copies nothing.
    if ctx.needs_input_grad[0]:
        if ctx.a_transposed:
            grad_a = mm(b, grad_z.to(ctx.b_dtype).t(), out_dtype=ctx.a_dtype).t()
        else:
            grad_a = mm(grad_z.to(ctx.b_dtype), b.t(), out_dtype=ctx.a_dtype)
    if ctx.needs_input_grad[1]:
        if ctx.b_transposed:
            grad_b = mm(grad_z.to(ctx.a_dtype).t(), a, out_dtype=ctx.b_dtype).t()
        else:
            grad_b = mm(a.t(), grad_z.to(ctx.a_dtype), out_dtype=ctx.b_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_z.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_a, grad_b, grad_bias, None, None


mm_op.register_autograd(_backward, setup_context=_setup_context)


# The same forward and formulas for plain eager calls of tg.mm, which skip the dispatcher.
_EagerMM = eager_autograd_function(mm_op)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


# --- public API ---------------------------------------------------------------------------------

def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
       activation: str = "none", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Matrix product ``activation(a @ b + bias)`` on a Triton kernel.

    Args:
        a: [M, K] tensor, any strides.
        b: [K, N] tensor of a's dtype, any strides (``weight.t()`` of an ``nn.Linear`` is fine).
        bias: optional [N] tensor added to every row, in fp32, before the activation.
        activation: "none", "relu", "gelu" (tanh approximation), "silu" or "leaky_relu".
        out_dtype: float16, bfloat16 or float32; defaults to a's dtype (bfloat16 for fp8).

    Returns:
        A new row-major [M, N] tensor.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
        >>> y = tg.mm(x, w.t(), activation="gelu")   # [64, 256]
    """
    if _plain_eager(a, b, bias):
        if _needs_grad(a, b, bias):
            return _EagerMM.apply(a, b, bias, activation, out_dtype)
        return _eager_allocate_and_launch(a, b, bias, activation, out_dtype)
    return torch.ops.tgemm.mm(a, b, bias, activation, out_dtype)
