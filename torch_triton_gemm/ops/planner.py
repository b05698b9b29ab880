"""The planner: which plan a GEMM launch of tgemm::mm's kernels runs (kernel, tile, split-K),
for tgemm::mm and the fp8 recipes of tgemm::scaled_mm.

Data flow: ops -> planner -> launcher -> kernels. A plan is a function of shapes, strides,
dtypes and device properties: a forced plan, else the tuned table's, else the heuristic's,
memoised per shape. The planner launches nothing: the ops hand its plan to the launcher. Where
TORCH_TRITON_GEMM_AUTOTUNE=1 asks for it, it runs tune.py on first use, which times explicit
plans through the launcher and never asks the planner (no import cycle).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import device as _device
from .. import plan_cache, plan_model, tuning
from ..kernels import wgmma_fp8
from .launcher import GemmScales, num_sms
from .operands import (
    kernel_operands,
    layout_key,
    on_hopper_with_gluon,
    warp_specialized_16_bit,
    warp_specialized_operands,
)


def plan_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            activation: str, traceable: bool, scales: GemmScales | None = None, *,
            tune: bool = True) -> tuning.MMPlan:
    """The plan of a GEMM launch writing activation(a @ b + bias) into ``out`` (checked inputs,
    M and N non-zero), for the launcher's ``prepare_launch``. Symbolic sizes (torch.compile with
    dynamic shapes) get one plan for every size, so that nothing guards on them; known sizes get
    ``_plan``'s, for the operands as the kernels will see them (padded copies included).
    ``traceable=False`` marks a plain eager call, the only kind that may tune on first use
    (``tune=False``: an eager call's plan without tuning, as compiling ahead plans it)."""
    (M, K), N = a.shape, b.shape[1]
    if not (type(M) is int and type(N) is int and type(K) is int):
        return tuning.symbolic_mm_plan(a.element_size())
    swapped = swap_plan(a, b, bias, scales)
    if swapped is not None:
        return swapped
    # Inductor re-parses the kernels a traced launch names, and cannot parse Gluon: a traced
    # call that this plan suits goes through an opaque op instead (ops/scaled_mm.py).
    if scales is not None and not traceable:
        plan = fp8_precise_plan(a, b, out, scales)
        if plan is not None:
            return plan
    tma_args, pads, (_, stride_ak, stride_bk, _) = kernel_operands(a, b, out)
    # Inductor cannot parse Gluon either: traced calls keep the Triton kernels.
    wgmma = not traceable and activation == "none" and ws_applies(a, b, out)
    return _plan(a, b, bias, activation, out.element_size(), layout_key(stride_ak, stride_bk),
                 tma_args is not None and _device.supports_tma(a.device), tune and not traceable,
                 scales, _model_view(a, b, tma_args, pads), wgmma)


def ws_applies(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the 16-bit plans of Hopper's warp-specialized kernel (``tuning.WS_KERNEL``) can
    run this product (``operands.warp_specialized_16_bit``) and no plan is forced. The caller
    rules out activations and traced calls."""
    return tuning.forced_plan() is None and warp_specialized_16_bit(a, b, out)


def _hopper_gluon(device: torch.device) -> bool:
    """An sm_90 GPU (not Triton's interpreter) whose Triton has Gluon, and no forced plan."""
    return tuning.forced_plan() is None and on_hopper_with_gluon(device)


def modelled_mm_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuning.MMPlan | None:
    """The plan model's plan for a 16-bit product with these operands (known sizes), as
    ``plan_mm`` picks it for an eager call without activation on an sm_90 GPU where no plan is
    forced or tuned; None where no plan of the space fits. The device's numbers come from
    ``device``'s queries, so a benchmark can ask what the planner would pick on a GPU it is not
    running on (bench/picks.py)."""
    (M, K), N = a.shape, b.shape[1]
    wgmma = a.element_size() == 2 and wgmma_fp8.AVAILABLE and warp_specialized_operands(a, b, out)
    return _modelled(M, N, K, out.element_size(), a.device, model_view(a, b, out), wgmma)


def model_view(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> ModelView:
    """How the plan model sees these operands (known sizes): whether TMA reads them as they
    are (no padded copies), whether a pitch is not a multiple of 16 elements, whether A's
    columns are contiguous, the widest copy the portable kernel makes along narrow pitches
    (``_pitches``), and whether the launcher copies operands (``_model_view``)."""
    tma_args, pads, _ = kernel_operands(a, b, out)
    return _model_view(a, b, tma_args, pads)


def eager_mm_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                  plan: tuning.MMPlan) -> tuning.MMPlan | None:
    """The plan that plain eager calls of a 16-bit product take instead of ``plan`` (the plan
    model's, which CUDA-graph captures of them keep), or None where eager calls take ``plan``
    too: ``plan``'s portable kernel reading operands as they are where the launcher would
    copy them first, and its K split in one launch, with its bits, where the copies and the
    split's extra launches (its reduction, a tail split's whole tiles) cost the host more than
    they save the GPU, and an unsplit TMA plan on the portable kernel with the same tile where
    that kernel stays within the host's time for a call (no device-built descriptors to pay
    for; ``plan_model.eager_plan``). None with ``TORCH_TRITON_GEMM_EAGER_PLANS=0``
    (``tuning.eager_plans_enabled``), for forced, tuned, transposed and warp-specialized
    plans (one launch already) and off CUDA."""
    (M, K), N = a.shape, b.shape[1]
    if (plan.swap_ab or tuning.warp_specialized(plan) or tuning.forced_plan() is not None
            or a.device.type != "cuda"
            or not tuning.eager_plans_enabled()
            or a.element_size() != 2 or not (type(M) is int and type(N) is int
                                             and type(K) is int)):
        return None
    tma_args, pads, _ = kernel_operands(a, b, out)
    view = _model_view(a, b, tma_args, pads)
    if plan != _modelled(M, N, K, out.element_size(), a.device, view):
        return None
    return plan_model.eager_plan(plan, M, N, K, 2, out.element_size(),
                                 _device.num_sms(a.device), *view[:4],
                                 copies=sum(pad is not None for pad in pads),
                                 l2_bytes=_device.l2_cache_bytes(a.device),
                                 dram_gbps=_device.dram_gbps(a.device))


# How the plan model sees a product's operands (_model_view).
ModelView = tuple[bool, bool, bool, int, bool]


def _modelled(M: int, N: int, K: int, out_size: int, device: torch.device,
              view: ModelView, wgmma: bool = False) -> tuning.MMPlan | None:
    # The plan model weighs copying operands TMA cannot describe as they are.
    return plan_model.modelled_plan(M, N, K, 2, out_size, _device.supports_tma(device),
                                    _device.num_sms(device), *view[:4],
                                    l2_bytes=_device.l2_cache_bytes(device), wgmma=wgmma,
                                    dram_gbps=_device.dram_gbps(device),
                                    launcher_copies=view[4])


def _model_view(a: torch.Tensor, b: torch.Tensor, tma_args: Any,
                pads: tuple[Any, Any]) -> ModelView:
    """How the plan model sees the operands (``_plan``'s ``view``): TMA reads them as they are
    (it needs no padded copies; where the GPU has no TMA, the plan model offers no TMA plans
    and this is not asked), a pitch is not a multiple of 16 elements, A's columns are
    contiguous, the widest copy the portable kernel makes along such pitches (``_pitches``),
    and the launcher copies operands for plans that leave ``pad`` unset
    (``plan_model.PORTABLE_READS_AS_IS``)."""
    aligned = tma_args is not None and pads == (None, None)
    narrow, pitch_vector = _pitches(a, b)
    a_m_contiguous = a.stride(0) == 1 and a.stride(1) != 1 and a.shape[0] > 1
    return aligned, narrow, a_m_contiguous, pitch_vector, pads != (None, None)


def swap_plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
              scales: GemmScales | None) -> tuning.MMPlan | None:
    """The transposed plan (``tuning.swap_plan``) of a 16-bit product, or a tensorwise or
    rowwise fp8 one, of a few rows (known sizes), or None: only without bias (the transposed
    product's epilogue would add it along its rows), with both operands contiguous along K and
    pitches of ``tuning.SWAP_PITCH_BYTES`` (16 bytes for fp8, 32 for 16-bit: the layouts it won
    on; ``b`` as ``W.t()``), and no forced plan. It comes before the tuned table: the tuner's
    space has no transposed plans."""
    size = a.element_size()
    pitch = tuning.SWAP_PITCH_BYTES.get(size, 16)
    if (bias is not None or a.device.type != "cuda" or b.element_size() != size
            or (scales is not None and scales.mode != "outer")
            or (scales is None and size != 2)
            or a.stride(1) != 1 or b.stride(0) != 1
            or (a.stride(0) * size) % pitch or (b.stride(1) * size) % pitch
            or tuning.forced_plan() is not None):
        return None
    return tuning.swap_plan(a.shape[0], b.shape[1], a.shape[1], size, num_sms(a.device),
                            _device.dram_gbps(a.device))


def fp8_precise_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     scales: GemmScales) -> tuning.MMPlan | None:
    """The plan of Hopper's warp-specialized fp8 kernel for this scaled product (known sizes),
    or None where that kernel does not run it (see ``_fp8_precise_applies`` and
    ``tuning.fp8_precise_plan``)."""
    if not _fp8_precise_applies(a, b, out, scales):
        return None
    return tuning.fp8_precise_plan(a.shape[0], b.shape[1], num_sms(a.device),
                                   out.element_size(), a.shape[1], scales.mode)


def _fp8_precise_applies(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                         scales: GemmScales) -> bool:
    """Whether Hopper's warp-specialized precise fp8 kernel can run this product: tensorwise or
    rowwise scales without fast accumulation, or blockwise ones with 128x128 blocks for b, on an
    sm_90 GPU, fp8 operands both contiguous along K (b as ``W.t()``), TMA-aligned pitches and
    pointers, and a row-major output. A forced plan (tests, tuning) wins."""
    precise = scales.mode == "outer" and not scales.fast_accum
    blockwise = scales.mode == "block" and scales.b_cols == 128
    return ((precise or blockwise) and a.element_size() == 1 and _hopper_gluon(a.device)
            and warp_specialized_operands(a, b, out))


def _pitches(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """Whether a pitch of the operands is not a multiple of 16 elements (narrow), and the
    widest copy the portable kernel makes along such pitches (``plan_model.pitch_vector``).
    The plan model weighs both, with whether TMA reads the operands as they are (``view`` of
    ``_plan``): narrow pitches still cost TMA its padded copies (5312 x 64 x 11176 bf16 on an
    H100: 207 us portable with pitch hints, 65 us TMA on a 16-byte aligned pitch)."""
    narrow = [(pitch, t.element_size()) for t in (a, b)
              for size, pitch in zip(t.shape, t.stride()) if size > 1 and pitch != 1 and pitch % 16]
    if not narrow:
        return False, 16
    return True, plan_model.pitch_vector(narrow, tuning.pitch_hints_enabled())


def _plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str,
          out_size: int, layout: int, tma: bool, eager: bool,
          scales: GemmScales | None = None,
          view: ModelView | None = None,
          wgmma: bool = False) -> tuning.MMPlan:
    """The launch plan: a forced one (tests, tuning), else the tuned table's, else, for 16-bit
    operands on a GPU, the plan model's (``view``: ``_model_view``'s), else the heuristic's.
    Tuning happens here only when TORCH_TRITON_GEMM_AUTOTUNE=1 asks for it, on a plain eager
    call outside CUDA-graph capture. Scaled products (``scales``) take the
    heuristic's plan for their recipe: tuned plans were timed on unscaled products.
    ``wgmma``: the plan model may weigh Hopper's warp-specialized kernel (``ws_applies``)."""
    forced = tuning.forced_plan()
    if forced is not None:
        return forced
    (M, K), N, device = a.shape, b.shape[1], a.device
    scaling, fast_accum = ("none", False) if scales is None else (scales.mode, scales.fast_accum)
    # Memoised per shape: an eager call of a small GEMM cannot afford to rebuild the plan.
    memo_key = (M, N, K, a.dtype, out_size, layout, tma, device, plan_cache.TUNED.version,
                scaling, fast_accum, view, wgmma)
    plan = _PLANS.get(memo_key)
    if plan is not None:
        return plan
    # A plan made without the tuning an eager call would do (tuning on first use) is not kept
    # for that call: one planned ahead (compile_ahead) or for a traced call.
    skipped_tuning = False
    if device.type == "cuda" and scales is None:
        plan = plan_cache.TUNED.get(device, plan_cache.plan_key(M, N, K, a.dtype, layout, tma))
        if plan is not None and tuning.warp_specialized(plan) and not wgmma:
            plan = None  # tuned on an eager call; traced ones and activations cannot run it
        skipped_tuning = plan is None and not eager and tuning.autotune_enabled()
        if plan is None and eager and tuning.autotune_enabled() and (
                not torch.cuda.is_current_stream_capturing()):
            from ..tune import tune_on_first_use

            tuned = tune_on_first_use(a, b, bias, activation)
            if tuned is not None:
                return tuned
    if plan is None and view is not None and device.type == "cuda" and scales is None and (
            a.element_size() == 2):
        plan = _modelled(M, N, K, out_size, device, view, wgmma)
    if plan is None:
        plan = tuning.heuristic_mm_plan(M, N, K, a.element_size(), tma, num_sms(device),
                                        out_size, a_k_contiguous=bool(layout & 2),
                                        scaling=scaling, fast_accum=fast_accum)
    if not skipped_tuning:
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        _PLANS[memo_key] = plan
    return plan


_PLANS: dict[tuple[Any, ...], tuning.MMPlan] = {}
_PLANS_LIMIT = 4096


def forget_plans() -> None:
    """Forget every memoised plan: the next call of each product plans it again (after a change
    to what plans depend on but memo keys do not hold: the plan model's rule constants, a new
    tuned-plan table object)."""
    _PLANS.clear()
