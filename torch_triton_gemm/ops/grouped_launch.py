"""The grouped launcher: what tgemm::grouped_mm and tgemm::scaled_grouped_mm share beneath them.

Both ops take torch._grouped_mm's forms and offs, and both run kernels/grouped.py's
``grouped_mm_kernel``. This module holds those shared pieces: the forms and the checks of their
shapes and of offs (each op adds its dtypes, scales and bias), the kernel's [G, M, K] x [G, K, N]
view of the operands, the choice of loaders (TMA descriptors or pointers) and tile, and the
launch, unscaled or with fp8 scales. It imports no op: data flows down.

Forms name the grouped dimension of the kernel's view: "m" (2-D a x 3-D b: rows of a and of
out), "n" (3-D a x 2-D b: columns of b and of out), "k" (2-D x 2-D: the contraction, one
[M, N] output per group), "none" (3-D x 3-D: a batch, no offs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from .. import device as _device
from .. import env, tuning
from ..kernels import wgmma_fp8
from ..kernels.grouped import grouped_mm_kernel
from .checks import check, check_operand_pair, check_value, input_precision
from .launcher import launch_kernel, num_sms
from .operands import base_aligned, tma_operand

_INT32_LIMIT = 2**31 - 1
CHECK_OFFS_ENV = "TORCH_TRITON_GEMM_CHECK_OFFS"


# --- forms and checks ---------------------------------------------------------------------------

_FORMS = {(2, 3): "m", (3, 2): "n", (2, 2): "k", (3, 3): "none"}
GROUPED_DIM_NAMES = {"m": "a's rows", "n": "b's columns", "k": "the contraction (a's columns)"}


def form_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """The form of 2-D or 3-D operands a and b."""
    return _FORMS[(a.dim(), b.dim())]


def group_count(form: str, a: torch.Tensor, b: torch.Tensor,
                offs: torch.Tensor | None) -> int | torch.SymInt:
    if form == "m":
        return b.shape[0]
    if form == "k":
        return offs.shape[0]  # type: ignore[union-attr]
    return a.shape[0]


def grouped_length(form: str, a: torch.Tensor, b: torch.Tensor) -> int | torch.SymInt:
    """The extent of the dimension offs splits."""
    return {"m": lambda: a.shape[0], "n": lambda: b.shape[1], "k": lambda: a.shape[1]}[form]()


def out_shape(form: str, a: torch.Tensor, b: torch.Tensor,
              offs: torch.Tensor | None) -> tuple[int | torch.SymInt, ...]:
    if form == "m":
        return (a.shape[0], b.shape[2])
    if form == "n":
        return (a.shape[1], b.shape[1])
    if form == "k":
        return (offs.shape[0], a.shape[0], b.shape[1])  # type: ignore[union-attr]
    return (a.shape[0], a.shape[1], b.shape[2])


def check_grouping(op: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                   dtypes: tuple[torch.dtype, ...]) -> str:
    """The checks every grouped op makes (also under FakeTensor and symbolic shapes): 2-D or
    3-D operands of one of ``dtypes`` with matching K, and offs as the form needs it (not its
    values); messages start with ``op``. Returns the form."""
    check(a.dim() in (2, 3) and b.dim() in (2, 3),
          lambda: f"{op}: a and b must be 2-D or 3-D, got a of shape {tuple(a.shape)} and b of "
                   f"shape {tuple(b.shape)}")
    form = form_of(a, b)
    check_operand_pair(op, a, b, dtypes)
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
        return form
    check(offs is not None,
          lambda: f"{op}: offs is required when a or b is 2-D (a is {tuple(a.shape)}, b is "
                   f"{tuple(b.shape)}): int32 cumulative ends of the groups along "
                   f"{GROUPED_DIM_NAMES[form]}")
    assert offs is not None
    check_value(offs.dtype == torch.int32, lambda: f"{op}: offs must be int32, got {offs.dtype}")
    check(offs.dim() == 1, lambda: f"{op}: offs must be 1-D [G], got shape {tuple(offs.shape)}")
    check(offs.device == a.device,
          lambda: f"{op}: offs is on {offs.device} but a is on {a.device}")
    if form in ("m", "n"):
        holder, count = ("b", b.shape[0]) if form == "m" else ("a", a.shape[0])
        check(offs.shape[0] == count,
              lambda: f"{op}: offs has {offs.shape[0]} entries but {holder} has {count} "
                       f"groups (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    length = grouped_length(form, a, b)
    check(length <= _INT32_LIMIT,
          lambda: f"{op}: {GROUPED_DIM_NAMES[form]} has {length} entries, more than int32 "
                   f"offs can address")
    return form


def bias_shape(form: str, a: torch.Tensor, b: torch.Tensor,
               offs: torch.Tensor | None) -> tuple[int | torch.SymInt, ...]:
    """[G, N] (a row per group), or [N] for 3-D a x 2-D b, whose groups are columns of out."""
    if form == "n":
        return (b.shape[1],)
    return (group_count(form, a, b, offs), b.shape[-1])


def check_epilogue(op: str, form: str, a: torch.Tensor, b: torch.Tensor,
                   offs: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
                   dtypes: tuple[torch.dtype, ...]) -> None:
    """The out dtype and the bias (if any) of a grouped op, whose epilogue adds bias in fp32 and
    casts to one of ``dtypes``."""
    check_value(
        out_dtype in dtypes,
        lambda: f"{op}: out_dtype {out_dtype} is not supported; choose one of {dtypes}")
    if bias is not None:
        check_bias(op, form, a, b, offs, bias, dtypes)


def check_bias(op: str, form: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
               bias: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    expected = bias_shape(form, a, b, offs)
    check(tuple(bias.shape) == expected,
          lambda: f"{op}: bias must have shape {tuple(expected)} "
                   f"({'per column of out' if form == 'n' else '[G, N], a row per group'}), "
                   f"got {tuple(bias.shape)}")
    check_value(bias.dtype in dtypes,
                lambda: f"{op}: bias has dtype {bias.dtype}; supported: {dtypes}")
    check(bias.device == a.device, lambda: f"{op}: bias is on {bias.device} but a is on {a.device}")


@functools.cache
def offs_check_mode() -> str:
    """'auto' (default: check offs' values where reading them needs no device sync), 'always'
    or 'never', from TORCH_TRITON_GEMM_CHECK_OFFS (read once)."""
    return env.choice(CHECK_OFFS_ENV, {"auto": "auto", "always": "always", "1": "always",
                                       "true": "always", "never": "never", "0": "never",
                                       "false": "never"}, "auto")


def _holds_data(t: torch.Tensor) -> bool:
    """True for a plain tensor whose values the host may read (not fake, not being traced)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def check_offs_values(op: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """offs must be non-decreasing, start at 0 or more and end within the grouped dimension;
    checked where ``offs_check_mode`` says."""
    mode = offs_check_mode()
    # Cheapest first: every eager call on a GPU passes here.
    if mode == "never" or mode == "auto" and offs.device.type != "cpu":
        return
    if not _holds_data(offs):
        return
    values = offs.tolist()
    form = form_of(a, b)
    length = grouped_length(form, a, b)
    previous = 0
    for g, end in enumerate(values):
        if end < previous:
            raise ValueError(
                f"{op}: offs must be non-decreasing and start at 0 or more, got offs[{g}] = {end}"
                + (f" after offs[{g - 1}] = {previous}" if g else ""))
        previous = end
    if values and values[-1] > length:
        raise ValueError(f"{op}: offs[-1] = {values[-1]} is past the end of "
                         f"{GROUPED_DIM_NAMES[form]} ({length})")


def _max_offset(t: torch.Tensor) -> int:
    if any(s == 0 for s in t.shape):
        return 0
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def _needs_int64_indexing(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and _max_offset(t) > _INT32_LIMIT for t in tensors)


# --- the kernel's view of the operands ------------------------------------------------------------

class GroupedScales(NamedTuple):
    """fp8 scales as the grouped kernel reads them (tgemm::scaled_grouped_mm).

    "outer": scale_a per row of a, scale_b per column of b, applied after the K loop; "block":
    one scale per ``a_rows`` rows (per ``b_cols`` columns) and 128 elements of K, applied to
    every K step's product. ``strides``: scale_a's over groups, rows and K blocks, then
    scale_b's over groups, K blocks and columns, as the kernel indexes them (rows and columns of
    the full operands; 0 where the scales do not vary)."""
    mode: str
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    strides: tuple[Any, ...]
    a_rows: int = 1
    b_cols: int = 1
    fast_accum: bool = False


class Problem:
    """The kernel's view of the operands: a [G, M, K] x b [G, K, N] -> c [G, M, N] with a
    stride of 0 over G for a 2-D operand, the grouped dimension at its full extent."""

    def __init__(self, form: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 offs: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        self.G = group_count(form, a, b, offs)
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


def tma_loads(form: str, a: torch.Tensor, b: torch.Tensor,
              p: Problem) -> tuple[bool, tuple[int, ...], tuple[int, ...], dict[str, bool]]:
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
    pointers = pointer_loads(p)
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


def _tma_stores(form: str, out: torch.Tensor, p: Problem) -> bool:
    """Whether the TMA path can also store C through descriptors: a unit stride along N, the
    other strides (and every group's base) on 16-byte boundaries, and groups that start on
    whole rows of C (not the "n" form, whose groups are column ranges)."""
    size = out.element_size()
    strides = p.c_strides
    return (form != "n" and all(type(x) is int for x in strides) and strides[2] == 1
            and strides[1] * size % 16 == 0 and strides[0] * size % 16 == 0
            and base_aligned(out))


def pointer_loads(p: Problem) -> tuple[bool, tuple[int, ...], tuple[int, ...], dict[str, bool]]:
    """``tma_loads``'s answer for the pointer loaders: the operands' own strides."""
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


# --- the launch -----------------------------------------------------------------------------------

class GroupedLaunch(NamedTuple):
    """Everything a grouped launch needs but the tensors (a, b, out, bias, offs and the
    scales): the grid, the runtime arguments after the tensors, the tile's meta-parameters,
    whether it loads through TMA, and (for a launch that is kept and reused) a cache of its
    compiled kernel."""
    grid: tuple[Any]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    tma: bool
    compiled: dict[Any, Any] | None = None
    kernel: Any = None  # grouped_mm_kernel, or Hopper's precise fp8 kernel


# Scale strides and (SCALING, SA_ROWS, SB_COLS, FAST_ACCUM) of an unscaled product.
_NO_SCALES = ((0, 0, 0, 0, 0, 0), ("none", 1, 1, False))


class GroupedRouting(NamedTuple):
    """Rows of a 2-D a x 3-D b product gathered through an int32 index (tgemm::moe_mlp): the
    kernel's rows are ``slots`` token slots sorted by expert, and slot s reads a's row
    ``rows[s]``. ``gate``: an activation name for a gated product (b holds 2N columns, out N:
    act(first half) * second half), or "none"; ``keep_pre``: a gated launch also stores both
    halves before the activation into a contiguous [slots, 2N] buffer (``run_grouped_launch``'s
    ``pre``)."""
    slots: int | torch.SymInt
    gate: str = "none"
    keep_pre: bool = False


_NOT_ROUTED = ("none", "none")


def prepare_grouped_launch(op: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                           bias: torch.Tensor | None, out: torch.Tensor, zero_tail: bool,
                           use_tma: bool | None = None,
                           scales: GroupedScales | None = None,
                           routing: GroupedRouting | None = None) -> GroupedLaunch | None:
    """Choose loaders and tile and work out the launch writing a x b (+ bias) into ``out``
    (checked inputs), scaled by ``scales`` when given, its rows routed as ``routing`` says;
    None when there is nothing to write. ``use_tma=False`` keeps to the pointer loaders (as
    routed rows do). Raises (naming ``op``) where no kernel can run on the operands' device."""
    error = _device.kernel_device_error(a.device)
    check(error is None, lambda: f"{op}: {error}")
    form = form_of(a, b)
    p = Problem(form, a, b, out, offs, bias)
    if routing is not None:
        # Routed rows are the sorted slots; a gated product's out is half as wide as b.
        # Gathered rows load through pointers, and so does b then: in a loop that also loads
        # through TMA, Triton 3.6 leaves the gathered loads unpipelined (synchronous).
        p.M, p.N = routing.slots, out.shape[1]
        use_tma = False
    G, M, N = p.G, p.M, p.N
    if out.numel() == 0 or G == 0 and not zero_tail:
        return None
    loads = tma_loads(form, a, b, p) if use_tma is not False else pointer_loads(p)
    tma, a_strides, b_strides, flags = loads
    c_tma = tma and routing is None and _tma_stores(form, out, p)
    # A step's product added in fp32 keeps a second fp32 tile live (see the tile heuristic).
    fp32_steps = scales is not None and (scales.mode == "block" or not scales.fast_accum)
    gated = routing is not None and routing.gate != "none"
    tma_device = _device.supports_tma(a.device)
    gathered = routing is not None and tma_device
    tile, c_tma = choose_tile(form, G, M, 2 * N if gated else N, a.element_size(),
                              tma and tma_device, out.element_size() if c_tma else 0,
                              num_sms(a.device), fp32_steps, gathered)
    if gated:
        # The tile's accumulator holds both halves: the tile chosen for 2N columns, N wide.
        tile = dataclasses.replace(tile, block_n=max(16, tile.block_n // 2))
    stride_bias_g, stride_bias_n = p.bias_strides
    if scales is None:
        scale_strides, scaling = _NO_SCALES
    else:
        scale_strides = scales.strides
        scaling = (scales.mode, scales.a_rows, scales.b_cols, scales.fast_accum)
    # Runtime arguments in grouped_mm_kernel's order after the tensors; the tile's
    # meta-parameters come after them.
    args = (
        G, M, N, p.K,
        *a_strides, *b_strides, *p.c_strides, stride_bias_g, stride_bias_n, *scale_strides,
        form, zero_tail, bias is not None, *scaling,
        tma, flags["A_M_CONTIGUOUS"], flags["B_K_CONTIGUOUS"],
        c_tma, tuning.epilogue_subtile(tile) if c_tma else 1,
        input_precision(a.dtype), _device.interpreter_enabled() and a.dtype == torch.bfloat16,
        _needs_int64_indexing(a, b, out) or (routing is not None and routing.keep_pre
                                             and 2 * M * N > _INT32_LIMIT),
        *(_NOT_ROUTED if routing is None else ("gather", routing.gate)),
    )
    # Persistent: at most one program per SM, fewer when the groups have fewer tiles.
    grid = (_sym_min(num_sms(a.device),
                     _tile_bound(form, G, M, N, tile.block_m, tile.block_n, zero_tail)),)
    return GroupedLaunch(grid, args, tuning.tile_meta(tile), tma)


def run_grouped_launch(launch: GroupedLaunch, a: torch.Tensor, b: torch.Tensor,
                       offs: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
                       traceable: bool, scale_a: torch.Tensor | None = None,
                       scale_b: torch.Tensor | None = None,
                       rows: torch.Tensor | None = None,
                       pre: torch.Tensor | None = None) -> None:
    """Launch a prepared grouped launch on these tensors (with the scales, or the routing
    index and the buffer of kept pre-activations, it was prepared for). ``traceable=False``
    launches the Triton kernel directly instead of through ``wrap_triton``, for plain eager
    calls that nothing traces."""
    if launch.tma:
        _device.install_tma_allocator()  # per thread where Triton needs it (autograd's too)
    if offs is not None:
        # The kernels read offs[g] at offs_ptr + g: a strided or expanded offs (a view, as
        # torch._grouped_mm accepts) is read as its contiguous copy (itself when contiguous).
        offs = offs.contiguous()
    tensors = (a, b, out, bias, offs, scale_a, scale_b, rows)
    if launch.kernel is None:  # grouped_mm_kernel (Hopper's precise fp8 kernel keeps nothing)
        tensors += (pre,)
    launch_kernel(launch.kernel or grouped_mm_kernel, launch.grid, (*tensors, *launch.args),
                  launch.meta, traceable, launch.compiled)


def prepare_fp8_grouped_precise(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                                bias: torch.Tensor | None, out: torch.Tensor,
                                scales: GroupedScales | None) -> GroupedLaunch | None:
    """The launch of Hopper's warp-specialized precise fp8 kernel (kernels/wgmma_fp8.py) for an
    eager 2-D a x 3-D b product with rowwise scales and ``use_fast_accum=False``, or None where
    it does not apply: another form or recipe, no sm_90 GPU or no Gluon, operands not
    K-contiguous with TMA-aligned pitches (b's groups dense: one [G * N, K] descriptor), an
    output TMA cannot store, groups too small (``tuning.fp8_grouped_precise_tile``). Known
    sizes only (real tensors, or fake ones with concrete shapes)."""
    if (scales is None or scales.mode != "outer" or scales.fast_accum or offs is None
            or a.dim() != 2 or b.dim() != 3 or not wgmma_fp8.AVAILABLE
            or a.device.type != "cuda" or _device.interpreter_enabled()
            or not torch.cuda.is_available() or _device.capability(a.device) != (9, 0)):
        return None
    (M, K), (G, _, N) = a.shape, b.shape
    if any(type(x) is not int for x in (M, K, G, N, *a.stride(), *b.stride(), *out.stride())):
        return None
    if not (a.stride(1) == 1 and a.stride(0) % 16 == 0 and b.stride(1) == 1
            and b.stride(2) % 16 == 0 and b.stride(0) == N * b.stride(2)
            and out.stride(1) == 1 and out.stride(0) * out.element_size() % 16 == 0
            and base_aligned(a) and base_aligned(b) and base_aligned(out) and G > 0):
        return None
    tile = tuning.fp8_grouped_precise_tile(M, N, G, num_sms(a.device), out.element_size())
    if tile is None:
        return None
    consumers = tile.block_m // wgmma_fp8.ROWS_PER_CONSUMER
    sa_g, sa_m, _, sb_g, _, sb_n = scales.strides
    stride_bias_g, stride_bias_n = Problem("m", a, b, out, offs, bias).bias_strides
    args = (G, M, N, K, a.stride(0), b.stride(2), out.stride(0), stride_bias_g, stride_bias_n,
            sa_m, sb_g, sb_n, bias is not None)
    meta = {"CONSUMERS": consumers, "BLOCK_N": tile.block_n, "GROUP_M": tile.group_m,
            "STAGES": tile.num_stages, "CONSUMER_REGS": wgmma_fp8.CONSUMER_REGS[consumers],
            "num_warps": 4}
    grid = (min(num_sms(a.device), _tile_bound("m", G, M, N, tile.block_m, tile.block_n,
                                               False)),)
    return GroupedLaunch(grid, args, meta, True, kernel=wgmma_fp8.fp8_grouped_precise_kernel)


def choose_tile(form: str, G: Any, M: Any, N: Any, element_size: int, tma: bool,
                tma_out_size: int, num_sms: int, fp32_steps: bool = False,
                gathered: bool = False) -> tuple[tuning.TileConfig, bool]:
    """The heuristic's tile for a group's average extents (offs' values stay on the device),
    and whether C goes out through TMA (``tma_out_size``: C's element size where it can, else
    0); one tile and pointer stores for all sizes when they are symbolic. ``fp32_steps`` and
    ``gathered``: see ``tuning.heuristic_grouped_tile``."""
    if any(type(x) is not int for x in (G, M, N)):
        return tuning.symbolic_tile(element_size), False
    groups = max(G, 1)
    m_per_group = M // groups if form == "m" else M
    n_per_group = N // groups if form == "n" else N
    tile = tuning.heuristic_grouped_tile(m_per_group, n_per_group, element_size, tma,
                                         tma_out_size, fp32_steps, gathered)
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
