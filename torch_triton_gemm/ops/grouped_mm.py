"""tgemm::grouped_mm — torch._grouped_mm's contract on one persistent Triton kernel, with grads.

Contract (the shapes of ``torch._grouped_mm(a, b, offs=None, bias=None, out_dtype=None)``):

    a [T, K]     x  b [G, K, N]  with offs [G]  ->  out [T, N]     rows of a grouped (MoE forward)
    a [G, M, K]  x  b [K, N]     with offs [G]  ->  out [M, N]     columns of b grouped
    a [M, K]     x  b [K, N]     with offs [G]  ->  out [G, M, N]  the contraction grouped
                                                                   (MoE weight gradient)
    a [G, M, K]  x  b [G, K, N]  without offs   ->  out [G, M, N]  a batch (bmm)

- offs is int32 on a's device: cumulative ends of the groups along the grouped dimension
  (group g is [offs[g-1], offs[g]) with offs[-1] read as 0). Groups may be empty and of any
  size (no multiple of 16 needed); offs[-1] may stop short of the dimension's end.
- Past offs[-1], torch leaves the output unwritten (whatever the fresh tensor held): rows of out
  for 2-D x 3-D, columns for 3-D x 2-D. So does this op, unless ``zero_tail=True`` (an extension:
  zeros there, in the same launch). With the contraction grouped, indices past offs[-1] are
  ignored and an empty group gives zeros.
- Beyond torch: float16 and float32 as well as bfloat16 (fp32 is tf32 unless
  ``torch.get_float32_matmul_precision() == "highest"``), out_dtype float16 / bfloat16 /
  float32, any strides (an expert weight stored [G, N, K] and passed as ``w.transpose(-2, -1)``
  loads through TMA on Hopper), a bias, and gradients for a, b and bias in every form.
- bias: [G, N] (one row per group) when out has one [.., N] block per group, [N] (per column)
  for 3-D x 2-D where groups are column ranges of out; added in fp32 before the cast.
- Bad offs: offs is device data, so by default its values are checked only where reading them
  costs no device sync (tensors in host memory); ``TORCH_TRITON_GEMM_CHECK_OFFS=1`` checks them
  on GPUs too (one sync per call), ``=0`` never. Unchecked, the kernel clamps every group into
  [end of the previous group, the dimension's end]: it never reads or writes out of bounds, an
  entry below its predecessor gives an empty group, an entry past the end stops there.

This module reads top to bottom: forms and checks, the op body (choose loaders and tile,
launch), the fake, registration, autograd, and the typed public function.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

from .. import device as _device
from .. import tuning
from ..kernels.grouped import grouped_mm_kernel
from ._registry import define_triton_op, eager_autograd_function
from .checks import (
    check,
    check_operand_pair,
    check_value,
    float32_precision,
    input_precision,
)
from .launcher import (
    launch_kernel,
    memoised_eager_call,
    needs_grad,
    num_sms,
    plain_eager,
    tensor_key,
)
from .operands import base_aligned, tma_operand

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = INPUT_DTYPES
_INT32_LIMIT = 2**31 - 1
_CHECK_OFFS_ENV = "TORCH_TRITON_GEMM_CHECK_OFFS"


# --- forms and checks ---------------------------------------------------------------------------
# A form names the grouped dimension of the kernel's [G, M, K] x [G, K, N] view of the operands:
# "m" (2-D a x 3-D b), "n" (3-D a x 2-D b), "k" (2-D x 2-D), "none" (3-D x 3-D).

_FORMS = {(2, 3): "m", (3, 2): "n", (2, 2): "k", (3, 3): "none"}
_GROUPED_DIM_NAMES = {"m": "a's rows", "n": "b's columns", "k": "the contraction (a's columns)"}


def _form(a: torch.Tensor, b: torch.Tensor) -> str:
    return _FORMS[(a.dim(), b.dim())]


def _group_count(form: str, a: torch.Tensor, b: torch.Tensor,
                 offs: torch.Tensor | None) -> int | torch.SymInt:
    if form == "m":
        return b.shape[0]
    if form == "k":
        return offs.shape[0]  # type: ignore[union-attr]
    return a.shape[0]


def _grouped_length(form: str, a: torch.Tensor, b: torch.Tensor) -> int | torch.SymInt:
    """The extent of the dimension offs splits."""
    return {"m": lambda: a.shape[0], "n": lambda: b.shape[1], "k": lambda: a.shape[1]}[form]()


def _out_shape(form: str, a: torch.Tensor, b: torch.Tensor,
               offs: torch.Tensor | None) -> tuple[int | torch.SymInt, ...]:
    if form == "m":
        return (a.shape[0], b.shape[2])
    if form == "n":
        return (a.shape[1], b.shape[1])
    if form == "k":
        return (offs.shape[0], a.shape[0], b.shape[1])  # type: ignore[union-attr]
    return (a.shape[0], a.shape[1], b.shape[2])


def _check_inputs(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                  bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                  zero_tail: bool) -> tuple[str, torch.dtype]:
    """Validate everything but offs' values (also under FakeTensor and symbolic shapes); return
    the form and the out dtype."""
    op = "tgemm::grouped_mm"
    check(a.dim() in (2, 3) and b.dim() in (2, 3),
          lambda: f"{op}: a and b must be 2-D or 3-D, got a of shape {tuple(a.shape)} and b of "
                   f"shape {tuple(b.shape)}")
    form = _form(a, b)
    check_operand_pair(op, a, b, INPUT_DTYPES)
    check(a.shape[-1] == b.shape[-2],
          lambda: f"{op}: a has {a.shape[-1]} columns but b has {b.shape[-2]} rows (a is "
                   f"{tuple(a.shape)}, b is {tuple(b.shape)})")
    if form == "none":
        check(offs is None,
              lambda: f"{op}: offs must be None for 3-D a and 3-D b (a batch of "
                       f"{a.shape[0]} products)")
        check(a.shape[0] == b.shape[0],
              lambda: f"{op}: a has {a.shape[0]} groups but b has {b.shape[0]} (a is "
                       f"{tuple(a.shape)}, b is {tuple(b.shape)})")
    else:
        check(offs is not None,
              lambda: f"{op}: offs is required when a or b is 2-D (a is {tuple(a.shape)}, b is "
                       f"{tuple(b.shape)}): int32 cumulative ends of the groups along "
                       f"{_GROUPED_DIM_NAMES[form]}")
        assert offs is not None
        check_value(offs.dtype == torch.int32,
                    lambda: f"{op}: offs must be int32, got {offs.dtype}")
        check(offs.dim() == 1,
              lambda: f"{op}: offs must be 1-D [G], got shape {tuple(offs.shape)}")
        check(offs.device == a.device,
              lambda: f"{op}: offs is on {offs.device} but a is on {a.device}")
        if form in ("m", "n"):
            holder, count = ("b", b.shape[0]) if form == "m" else ("a", a.shape[0])
            check(offs.shape[0] == count,
                  lambda: f"{op}: offs has {offs.shape[0]} entries but {holder} has {count} "
                           f"groups (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
        length = _grouped_length(form, a, b)
        check(length <= _INT32_LIMIT,
              lambda: f"{op}: {_GROUPED_DIM_NAMES[form]} has {length} entries, more than int32 "
                       f"offs can address")
    check_value(not zero_tail or form in ("m", "n"),
                lambda: f"{op}: zero_tail applies when a 2-D a or b is grouped by rows or "
                         f"columns (2-D x 3-D, 3-D x 2-D), not to a{a.dim()}-D x {b.dim()}-D "
                         f"product")
    if out_dtype is None:
        out_dtype = a.dtype
    check_value(
        out_dtype in OUT_DTYPES,
        lambda: f"{op}: out_dtype {out_dtype} is not supported; choose one of {OUT_DTYPES}")
    if bias is not None:
        expected = _bias_shape(form, a, b, offs)
        check(tuple(bias.shape) == expected,
              lambda: f"{op}: bias must have shape {tuple(expected)} "
                       f"({'per column of out' if form == 'n' else '[G, N], a row per group'}), "
                       f"got {tuple(bias.shape)}")
        check_value(bias.dtype in OUT_DTYPES,
                    lambda: f"{op}: bias has dtype {bias.dtype}; supported: {OUT_DTYPES}")
        check(bias.device == a.device,
              lambda: f"{op}: bias is on {bias.device} but a is on {a.device}")
    return form, out_dtype


def _bias_shape(form: str, a: torch.Tensor, b: torch.Tensor,
                offs: torch.Tensor | None) -> tuple[int | torch.SymInt, ...]:
    if form == "n":
        return (b.shape[1],)
    return (_group_count(form, a, b, offs), b.shape[-1])


@functools.cache
def _offs_check_mode() -> str:
    """'auto' (default: check offs' values where reading them needs no device sync), 'always'
    or 'never', from TORCH_TRITON_GEMM_CHECK_OFFS (read once)."""
    value = os.environ.get(_CHECK_OFFS_ENV, "auto").lower()
    return {"1": "always", "always": "always", "0": "never", "never": "never"}.get(value, "auto")


def _holds_data(t: torch.Tensor) -> bool:
    """True for a plain tensor whose values the host may read (not fake, not being traced)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def _check_offs_values(form: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """offs must be non-decreasing, start at 0 or more and end within the grouped dimension."""
    mode = _offs_check_mode()
    # Cheapest first: every eager call on a GPU passes here.
    if mode == "never" or mode == "auto" and offs.device.type != "cpu":
        return
    if not _holds_data(offs):
        return
    values = offs.tolist()
    length = _grouped_length(form, a, b)
    op, where = "tgemm::grouped_mm", _GROUPED_DIM_NAMES[form]
    previous = 0
    for g, end in enumerate(values):
        if end < previous:
            raise ValueError(
                f"{op}: offs must be non-decreasing and start at 0 or more, got offs[{g}] = {end}"
                + (f" after offs[{g - 1}] = {previous}" if g else ""))
        previous = end
    if values and values[-1] > length:
        raise ValueError(f"{op}: offs[-1] = {values[-1]} is past the end of {where} ({length})")


def _max_offset(t: torch.Tensor) -> int:
    if any(s == 0 for s in t.shape):
        return 0
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def _needs_int64_indexing(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and _max_offset(t) > _INT32_LIMIT for t in tensors)


# --- the op body --------------------------------------------------------------------------------

def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     zero_tail: bool = False) -> torch.Tensor:
    """Shapes, dtypes and strides only: a contiguous tensor of the out dtype."""
    form, out_dtype = _check_inputs(a, b, offs, bias, out_dtype, zero_tail)
    return a.new_empty(_out_shape(form, a, b, offs), dtype=out_dtype)


def _grouped_mm_impl(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     zero_tail: bool = False) -> torch.Tensor:
    return _allocate_and_launch(a, b, offs, bias, out_dtype, zero_tail, traceable=True)


def _allocate_and_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                         bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                         zero_tail: bool, traceable: bool) -> torch.Tensor:
    out = _grouped_mm_fake(a, b, offs, bias, out_dtype, zero_tail)
    if offs is not None:
        _check_offs_values(_form(a, b), a, b, offs)
    launch_grouped_mm(a, b, offs, bias, out, zero_tail, traceable)
    return out


class _Problem:
    """The kernel's view of the operands: a [G, M, K] x b [G, K, N] -> c [G, M, N] with a
    stride of 0 over G for a 2-D operand, the grouped dimension at its full extent."""

    def __init__(self, form: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 offs: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        self.G = _group_count(form, a, b, offs)
        if form == "m":
            (self.M, self.K), self.N = a.shape, b.shape[2]
        elif form == "n":
            self.M, self.K, self.N = a.shape[1], a.shape[2], b.shape[1]
        else:
            self.M, self.K, self.N = a.shape[-2], a.shape[-1], b.shape[-1]
        self.a_strides = _grouped_strides(a)
        self.b_strides = _grouped_strides(b)
        self.c_strides = _grouped_strides(out)
        if bias is None:
            self.bias_strides = (0, 0)
        elif bias.dim() == 1:
            self.bias_strides = (0, bias.stride(0))
        else:
            self.bias_strides = bias.stride()


def _grouped_strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride()) if t.dim() == 3 else (0, *t.stride())


def _tma_loads(form: str, a: torch.Tensor, b: torch.Tensor,
               p: _Problem) -> tuple[bool, tuple[int, ...], tuple[int, ...], dict[str, bool]]:
    """Whether the operands can load through TMA descriptors, with the [G, rows, cols] strides
    of a and b as the kernel should see them and its layout flags (A_M_CONTIGUOUS: a's unit
    stride along M, not K; B_K_CONTIGUOUS: b's along K, not N).

    TMA needs Hopper, a 16-byte aligned base (for every group, in a 3-D operand), a unit stride
    in one of the last two dims and 16-byte multiples for the others (operands.py's rules). A TMA
    read must also start on a 16-byte boundary along the contiguous dim, so that dim must not be
    the grouped one (group starts are arbitrary): the MoE layouts (forward, input and weight
    gradients) all qualify; the others take the pointer loaders. Triton's interpreter emulates
    the descriptors, so CPU runs take the same path.
    """
    pointers = _pointer_loads(p)
    ready = _device.supports_tma(a.device) or _device.interpreter_enabled()
    strides = (*p.a_strides, *p.b_strides)
    # Symbolic strides (dynamic shapes) would guard on their alignment: pointers then.
    if not ready or p.K == 0 or any(type(x) is not int for x in strides):
        return pointers
    a_desc = _tma_grouped_operand(a, p.M, p.K, p.a_strides)
    b_desc = _tma_grouped_operand(b, p.K, p.N, p.b_strides)
    if a_desc is None or b_desc is None:
        return pointers
    a_m, b_k = a_desc[0], b_desc[0]
    grouped_contiguous = {"m": a_m, "n": not b_k, "k": not a_m or b_k, "none": False}[form]
    if grouped_contiguous:
        return pointers
    return (True, (p.a_strides[0], *a_desc[1:]), (p.b_strides[0], *b_desc[1:]),
            {"A_M_CONTIGUOUS": a_m, "B_K_CONTIGUOUS": b_k})


def _tma_stores(form: str, out: torch.Tensor, p: _Problem) -> bool:
    """Whether the TMA path can also store C through descriptors: a unit stride along N, the
    other strides (and every group's base) on 16-byte boundaries, and groups that start on
    whole rows of C (not the "n" form, whose groups are column ranges)."""
    size = out.element_size()
    strides = p.c_strides
    return (form != "n" and all(type(x) is int for x in strides) and strides[2] == 1
            and strides[1] * size % 16 == 0 and strides[0] * size % 16 == 0
            and base_aligned(out))


def _pointer_loads(p: _Problem) -> tuple[bool, tuple[int, ...], tuple[int, ...], dict[str, bool]]:
    """``_tma_loads``'s answer for the pointer loaders: the operands' own strides."""
    return False, p.a_strides, p.b_strides, {"A_M_CONTIGUOUS": False, "B_K_CONTIGUOUS": False}


def _tma_grouped_operand(t: torch.Tensor, rows: int, cols: int,
                         strides: tuple[int, ...]) -> tuple[bool, int, int] | None:
    """operands.py's ``tma_operand`` for one [G, rows, cols] operand (2-D: one group of stride
    0), which also needs every group's base on a 16-byte boundary."""
    if not base_aligned(t) or strides[0] * t.element_size() % 16 != 0:
        return None
    return tma_operand(rows, cols, strides[1], strides[2], t.element_size())


def _sym_min(a: int, b: int | torch.SymInt) -> int | torch.SymInt:
    return min(a, b) if type(b) is int else torch.sym_min(a, b)


class GroupedLaunch(NamedTuple):
    """Everything a grouped launch needs but the tensors (a, b, out, bias, offs): the grid, the
    runtime arguments after the tensors, the tile's meta-parameters, whether it loads through
    TMA, and (for a launch that is kept and reused) a cache of its compiled kernel."""
    grid: tuple[Any]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    tma: bool
    compiled: dict[Any, Any] | None = None


def launch_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                      bias: torch.Tensor | None, out: torch.Tensor, zero_tail: bool = False,
                      traceable: bool = True, use_tma: bool | None = None) -> None:
    """Launch the grouped kernel writing a x b (+ bias) into ``out`` (checked inputs).

    ``traceable=False`` launches the Triton kernel directly instead of through ``wrap_triton``,
    for plain eager calls that nothing traces; ``use_tma=False`` keeps to the pointer loaders.
    """
    launch = prepare_grouped_launch(a, b, offs, bias, out, zero_tail, use_tma)
    if launch is not None:
        _run_grouped_launch(launch, a, b, offs, bias, out, traceable)


def prepare_grouped_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                           bias: torch.Tensor | None, out: torch.Tensor, zero_tail: bool,
                           use_tma: bool | None = None) -> GroupedLaunch | None:
    """Choose loaders and tile and work out the launch (see ``launch_grouped_mm``); None when
    there is nothing to write. Raises where no kernel can run on the operands' device."""
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"tgemm::grouped_mm: {error}")
    form = _form(a, b)
    p = _Problem(form, a, b, out, offs, bias)
    G, M, N, K = p.G, p.M, p.N, p.K
    if out.numel() == 0 or G == 0 and not zero_tail:
        return None
    loads = _tma_loads(form, a, b, p) if use_tma is not False else _pointer_loads(p)
    tma, a_strides, b_strides, flags = loads
    c_tma = tma and _tma_stores(form, out, p)
    tile, c_tma = _tile(form, G, M, N, a.element_size(), tma and _device.supports_tma(a.device),
                        out.element_size() if c_tma else 0, num_sms(a.device))
    stride_bias_g, stride_bias_n = p.bias_strides
    # Runtime arguments in grouped_mm_kernel's order after the tensors; the tile's
    # meta-parameters come after them.
    args = (
        G, M, N, K,
        *a_strides, *b_strides, *p.c_strides, stride_bias_g, stride_bias_n,
        form, zero_tail, bias is not None, tma, flags["A_M_CONTIGUOUS"], flags["B_K_CONTIGUOUS"],
        c_tma, tuning.epilogue_subtile(tile) if c_tma else 1,
        input_precision(a.dtype), _device.interpreter_enabled() and a.dtype == torch.bfloat16,
        _needs_int64_indexing(a, b, out),
    )
    # Persistent: at most one program per SM, fewer when the groups have fewer tiles.
    grid = (_sym_min(num_sms(a.device),
                     _tile_bound(form, G, M, N, tile.block_m, tile.block_n, zero_tail)),)
    return GroupedLaunch(grid, args, tuning.tile_meta(tile), tma)


def _run_grouped_launch(launch: GroupedLaunch, a: torch.Tensor, b: torch.Tensor,
                        offs: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
                        traceable: bool) -> None:
    if launch.tma:
        _device.install_tma_allocator()  # per thread where Triton needs it (autograd's too)
    launch_kernel(grouped_mm_kernel, launch.grid, (a, b, out, bias, offs, *launch.args),
                  launch.meta, traceable, launch.compiled)


def _tile(form: str, G: Any, M: Any, N: Any, element_size: int, tma: bool,
          tma_out_size: int, num_sms: int) -> tuple[tuning.TileConfig, bool]:
    """The heuristic's tile for a group's average extents (offs' values stay on the device),
    and whether C goes out through TMA (``tma_out_size``: C's element size where it can, else
    0); one tile and pointer stores for all sizes when they are symbolic."""
    if any(type(x) is not int for x in (G, M, N)):
        return tuning.symbolic_tile(element_size), False
    groups = max(G, 1)
    m_per_group = M // groups if form == "m" else M
    n_per_group = N // groups if form == "n" else N
    tile = tuning.heuristic_grouped_tile(m_per_group, n_per_group, element_size, tma,
                                         tma_out_size)
    return tile, tma_out_size > 0 and tuning.grouped_tma_store(tile, m_per_group, n_per_group,
                                                               num_sms)


def _tile_bound(form: str, G: Any, M: Any, N: Any, block_m: int, block_n: int,
                zero_tail: bool) -> Any:
    """An upper bound on the output tiles of all groups, from shapes alone: a group adds at most
    one partial tile along the grouped dimension, and the zeroed tail counts as one more group."""
    tiles_m = (M + block_m - 1) // block_m
    tiles_n = (N + block_n - 1) // block_n
    if form == "m":
        return (tiles_m + G + int(zero_tail)) * tiles_n
    if form == "n":
        return tiles_m * (tiles_n + G + int(zero_tail))
    return G * tiles_m * tiles_n


# --- plain eager calls ----------------------------------------------------------------------------
# As for tgemm::mm (see memoised_eager_call): checks and launch arithmetic are memoised per
# call signature (shapes, strides, dtypes, devices and 16-byte alignment of every tensor, out
# dtype, zero_tail, fp32 precision). offs' values are not in it: they are checked (where
# TORCH_TRITON_GEMM_CHECK_OFFS asks) on every call.

def grouped_eager_signature(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                            bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                            zero_tail: bool) -> tuple[Any, ...]:
    """The memo key of a plain eager call (see memoised_eager_call)."""
    return ("tgemm::grouped_mm", tensor_key(a), tensor_key(b), tensor_key(offs),
            tensor_key(bias), out_dtype, bool(zero_tail), float32_precision())


def _grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      zero_tail: bool = False) -> torch.Tensor:
    """The op body for eager calls on real tensors: the kernel launched without wrap_triton,
    checks and launch arithmetic memoised per call signature."""
    return grouped_eager_call(a, b, offs, bias, out_dtype, zero_tail,
                              grouped_eager_signature(a, b, offs, bias, out_dtype, zero_tail))


def grouped_eager_call(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                       bias: torch.Tensor | None, out_dtype: torch.dtype | None, zero_tail: bool,
                       signature: tuple[Any, ...]) -> torch.Tensor:
    """``_grouped_mm_eager`` for a caller that has the call's ``grouped_eager_signature``."""

    def first_call() -> tuple[torch.Tensor, GroupedLaunch | None]:
        out = _grouped_mm_fake(a, b, offs, bias, out_dtype, zero_tail)  # the checks
        launch = prepare_grouped_launch(a, b, offs, bias, out, zero_tail)
        return out, None if launch is None else launch._replace(compiled={})

    out, launch = memoised_eager_call(signature, first_call, a)
    if offs is not None:
        _check_offs_values(_form(a, b), a, b, offs)
    if launch is not None:
        _run_grouped_launch(launch, a, b, offs, bias, out, False)
    return out


# --- registration -------------------------------------------------------------------------------

# Eager calls of torch.ops.tgemm.grouped_mm on real tensors reach _grouped_mm_eager through light
# kernels (see define_triton_op); tracing and compile see the triton_op _grouped_mm_impl.
grouped_mm_op = define_triton_op("tgemm::grouped_mm", _grouped_mm_impl, _grouped_mm_fake,
                                 eager_impl=_grouped_mm_eager)


# --- autograd -----------------------------------------------------------------------------------
# Every form's gradients are grouped products of the same family (a 2-D x 3-D forward has a
# 2-D x 3-D input gradient and a 2-D x 2-D weight gradient, and so on), so the backward pass is
# tgemm::grouped_mm again. Inputs past offs[-1] do not reach the output: their gradient is zero,
# written by zero_tail in the same launch. A per-group bias sums its group's rows of grad_out
# with one more grouped product against a ones vector (deterministic, no host sync).

def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, offs, bias, _, _ = inputs
    ctx.form = _form(a, b)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(a if b.requires_grad else None, b if a.requires_grad else None, offs)
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    a, b, offs = ctx.saved_tensors
    form = ctx.form
    grad = grad_out.to(ctx.a_dtype)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        if form == "m":
            grad_a = grouped_mm(grad, b.transpose(-2, -1), offs, zero_tail=True)
        elif form == "n":
            grad_a = grouped_mm(grad, b.t(), offs)
        elif form == "k":
            grad_a = grouped_mm(grad, b.t(), offs, zero_tail=True)
        else:
            grad_a = grouped_mm(grad, b.transpose(-2, -1))
    if ctx.needs_input_grad[1]:
        if form == "m":
            grad_b = grouped_mm(a.t(), grad, offs)
        elif form == "n":
            grad_b = grouped_mm(a.transpose(-2, -1), grad, offs, zero_tail=True)
        elif form == "k":
            grad_b = grouped_mm(a.t(), grad, offs, zero_tail=True)
        else:
            grad_b = grouped_mm(a.transpose(-2, -1), grad)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = _bias_grad(form, grad_out, offs).to(ctx.bias_dtype)
    return grad_a, grad_b, None, grad_bias, None, None


def _bias_grad(form: str, grad_out: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Sum of grad_out over each bias entry's outputs, in fp32."""
    if form == "m":
        # [G, 1, N] = ones [1, T] x grad_out [T, N], the contraction grouped by offs.
        ones = grad_out.new_ones(()).expand(1, grad_out.shape[0])
        return grouped_mm(ones, grad_out, offs, out_dtype=torch.float32).squeeze(1)
    if form == "n":
        # [1, N] = ones [G, 1, M] x grad_out [M, N], columns grouped by offs, zeros past them.
        ones = grad_out.new_ones(()).expand(offs.shape[0], 1, grad_out.shape[0])
        return grouped_mm(ones, grad_out, offs, out_dtype=torch.float32,
                          zero_tail=True).squeeze(0)
    return grad_out.sum(1, dtype=torch.float32)


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# The same forward and formulas for plain eager calls of tg.grouped_mm, which skip the
# dispatcher.
_EagerGroupedMM = eager_autograd_function(grouped_mm_op)


# --- public API ---------------------------------------------------------------------------------

def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
               zero_tail: bool = False) -> torch.Tensor:
    """Grouped matrix product with ``torch._grouped_mm``'s contract, in one Triton launch.

    Args:
        a: [T, K] (groups of rows), [G, M, K] (one matrix per group) or [M, K] (groups of
            columns, with a 2-D b); float16, bfloat16 or float32, any strides.
        b: [G, K, N], [K, N] (groups of columns, or of rows with a 2-D a); a's dtype, any
            strides (``w.transpose(-2, -1)`` of expert weights stored [G, N, K] is fast).
        offs: int32 [G] cumulative ends of the groups along the grouped dimension; required
            when a or b is 2-D, None for 3-D x 3-D. Groups may be empty.
        bias: optional [G, N] (one row per group), or [N] for 3-D a x 2-D b; added in fp32.
        out_dtype: float16, bfloat16 or float32; defaults to a's dtype.
        zero_tail: write zeros to the output rows (2-D a x 3-D b) or columns (3-D a x 2-D b)
            past offs[-1], which are otherwise left unwritten, as torch leaves them.

    Returns:
        A new contiguous tensor: [T, N], [M, N_total], [G, M, N] or [G, M, N] by form.

    Example:
        >>> import torch, torch_triton_gemm as tg
        >>> x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)   # routed tokens
        >>> w = torch.randn(8, 2048, 512, device="cuda", dtype=torch.bfloat16)  # [G, N, K]
        >>> counts = torch.tensor([120, 0, 300, 80, 200, 100, 150, 50], device="cuda")
        >>> offs = counts.cumsum(0).to(torch.int32)
        >>> y = tg.grouped_mm(x, w.transpose(-2, -1), offs)   # [1000, 2048]
    """
    if plain_eager(a, b, offs, bias):
        if needs_grad(a, b, bias):
            return _EagerGroupedMM.apply(a, b, offs, bias, out_dtype, zero_tail)
        return _grouped_mm_eager(a, b, offs, bias, out_dtype, zero_tail)
    return torch.ops.tgemm.grouped_mm(a, b, offs, bias, out_dtype, zero_tail)

