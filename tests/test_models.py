"""Real ``transformers`` models under torch_triton_gemm.override(): forward and backward, eager and
compiled.

Three models, built from configs with random weights (nothing is downloaded), cover the GEMMs a
model calls: a Llama (nn.Linear without bias, the rotary embedding's batched product; SDPA
attention), a GPT-2 with eager attention (Conv1D's ``torch.addmm``, 4-D ``@`` for scores and
values, the tied lm_head) and a Mixtral whose experts run ``torch._grouped_mm``
(``experts_implementation="grouped_mm"``). Each test runs a model plainly and a deep copy of it
under the override on the same tokens, then checks

- where the GEMMs ran: no GEMM left to PyTorch (aten GEMM ops seen by a dispatch mode, or in the
  compiled graphs; on a GPU, vendor GEMM kernels in the profiler trace), tgemm present, and the
  override's ``counts``;
- what they computed: loss, logits and every parameter's gradient against the plain run, within
  the dtype's tolerance.

The tiny tests run where tgemm runs (CPU tensors in Triton's interpreter without a GPU); the
``gpu`` tests use larger bf16 models, Inductor, and the CUDA profiler. transformers is imported on
first use, so collecting this file costs the rest of the suite nothing.
"""

from __future__ import annotations

import copy
import functools
import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from samples import rel_error
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

import torch_triton_gemm as tg
import torch_triton_gemm.kernels
from torch_triton_gemm.override import FAMILIES


@functools.cache
def _transformers() -> Any:
    import transformers

    return transformers


# --- the models ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    experts: int
    batch: int
    seq: int


TINY = Size(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64, experts=4,
            batch=2, seq=12)
# Head dim 64, so SDPA takes its fused (flash) kernels on the GPU.
SMALL = Size(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024, experts=8,
             batch=2, seq=128)


def build_llama(size: Size) -> nn.Module:
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq)
    return t.LlamaForCausalLM(config)


def build_gpt2(size: Size) -> nn.Module:
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=size.vocab, n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
        n_positions=size.seq, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # both runs must compute the same
        attn_implementation="eager")
    model = t.GPT2LMHeadModel(config)
    assert model.config._attn_implementation == "eager"
    # GPT-2 names no loss type; transformers then warns once per call, which Dynamo cannot trace.
    model.loss_type = "ForCausalLM"
    return model


def build_mixtral(size: Size) -> nn.Module:
    t = _transformers()
    config = t.MixtralConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate // 2,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq,
        num_local_experts=size.experts, num_experts_per_tok=2,
        experts_implementation="grouped_mm")
    model = t.MixtralForCausalLM(config)
    assert model.config._experts_implementation == "grouped_mm"
    return model


class ModelSpec(NamedTuple):
    build: Callable[[Size], nn.Module]
    # The override families its forward and backward route, all others staying at zero calls
    # but those of ``optional``.
    families: frozenset[str]
    # The class of its MoE router, whose top-k choice the runs share (see SharedRouting).
    router: Callable[[], type] | None = None
    # Attention through torch's scaled_dot_product_attention.
    sdpa: bool = False
    # Families routed in some transformers versions only.
    optional: frozenset[str] = frozenset()


# The rotary embedding's K = 1 product inv_freq @ positions: a bmm in transformers 5.17, not in
# 5.23 (which Inductor turns into pointwise code anyway).
ROTARY = frozenset({"bmm"})


def assert_routed(counts: dict[str, int], spec: ModelSpec, exact: bool = True) -> None:
    """The routed families are the model's (``exact``), or include them (the aten level, which
    also sees the products inside other aten ops)."""
    routed = routed_families(counts)
    assert routed >= spec.families, counts
    if exact:
        assert routed <= spec.families | spec.optional, counts


MODELS = {
    # mm: the projections and lm_head.
    "llama": ModelSpec(build_llama, frozenset({"mm"}), sdpa=True, optional=ROTARY),
    # addmm: Conv1D; bmm: attention's q @ k^T and probs @ v; mm: the tied lm_head.
    "gpt2": ModelSpec(build_gpt2, frozenset({"mm", "addmm", "bmm"})),
    # grouped: the experts' up and down projections, through torch.nn.functional.grouped_mm.
    "mixtral": ModelSpec(
        build_mixtral, frozenset({"mm", "grouped"}),
        lambda: _transformers().models.mixtral.modeling_mixtral.MixtralTopKRouter, sdpa=True,
        optional=ROTARY),
}


class SharedRouting:
    """Route each token, in every model attached, to the experts that the first run chose.

    Top-k expert choice is discontinuous: router logits that differ by one rounding can send a
    token to another expert, and then two runs differ by far more than any GEMM tolerance. With
    the choice shared, each run still computes its own routing weights (softmax of its own
    logits over the chosen experts, normalized, as Mixtral's router does) and their gradients.
    """

    def __init__(self) -> None:
        self.chosen: dict[str, torch.Tensor] = {}

    def attach(self, model: nn.Module, router: type) -> None:
        hooked = 0
        for name, module in model.named_modules():
            if isinstance(module, router):
                module.register_forward_hook(functools.partial(self._hook, name))
                hooked += 1
        assert hooked > 0, f"no {router.__name__} in the model"

    def _hook(self, name: str, module: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, _, experts = output
        experts = self.chosen.setdefault(name, experts)
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        return logits, probs / probs.sum(dim=-1, keepdim=True), experts


def model_pair(name: str, size: Size, device: str,
               dtype: torch.dtype) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A fresh model, a deep copy of it for the routed run, and tokens for both."""
    spec = MODELS[name]
    model = spec.build(size).to(device, dtype)
    routed_model = copy.deepcopy(model)
    if spec.router is not None:
        # After the copy: deepcopy would copy the hook's SharedRouting along with the model.
        routing = SharedRouting()
        for m in (model, routed_model):
            routing.attach(m, spec.router())
    tokens = torch.randint(size.vocab, (size.batch, size.seq), device=device)
    return model, routed_model, tokens


class Results(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def forward_backward(step: Callable[..., Any], model: nn.Module, tokens: torch.Tensor) -> Results:
    """One training step's forward and backward through ``step`` (the model, or the model
    compiled), with ``model``'s gradients reset first."""
    model.zero_grad(set_to_none=True)
    out = step(input_ids=tokens, labels=tokens)
    out.loss.backward()
    return Results(out.loss.detach(), out.logits.detach(),
                   {name: p.grad for name, p in model.named_parameters()})


class Tolerance(NamedTuple):
    outputs: float  # loss and logits
    each_grad: float  # every parameter's gradient on its own
    all_grads: float  # all gradients as one vector


# Routed against plain, relative Frobenius errors. bf16: two runs that each round every GEMM
# result to bf16 differ by about 1% on the gradients that sum small contributions (norm weights,
# the router, the q and k projections); Triton's interpreter rounds fp32 to bf16 toward zero,
# which doubles that on CPU. Over 25 seeds of the tiny models on CPU the worst differences were,
# in fp32: logits 1.4e-7, a gradient 5.2e-7, all gradients 1.9e-7; in bf16: logits 0.57%, a
# gradient 2.1%, all gradients 0.8%.
TOLERANCE = {
    torch.float32: Tolerance(outputs=1e-5, each_grad=1e-5, all_grads=1e-5),
    torch.bfloat16: Tolerance(outputs=1e-2, each_grad=5e-2, all_grads=2e-2),
}


def assert_close_results(got: Results, expected: Results, dtype: torch.dtype,
                         scale: float = 1.0) -> None:
    """Loss, logits and every gradient within the dtype's tolerance (times ``scale``)."""
    tol = Tolerance(*(scale * t for t in TOLERANCE[dtype]))
    errors = {"loss": rel_error(got.loss, expected.loss),
              "logits": rel_error(got.logits, expected.logits)}
    for name, error in errors.items():
        assert error <= tol.outputs, f"{name}: relative error {error:.3g} > {tol.outputs}"
    assert got.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        routed = got.grads[name]
        assert grad is not None and routed is not None, f"{name}: no gradient"
        assert routed.dtype == grad.dtype and routed.shape == grad.shape, name
        error = rel_error(routed, grad)
        assert error <= tol.each_grad, f"grad of {name}: relative error {error:.3g}"
    flat = [torch.cat([g.flatten().double() for g in r.grads.values()]) for r in (got, expected)]
    error = rel_error(*flat)
    assert error <= tol.all_grads, f"all gradients: relative error {error:.3g}"


# --- where the GEMMs ran -------------------------------------------------------------------------

# aten's GEMM ops, by overload-packet name: what a dispatch mode or a compiled graph shows when a
# matrix product is left to PyTorch.
ATEN_GEMMS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot",
    "_addmm_activation", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "einsum",
})


@pytest.fixture(params=["python", "aten"])
def override_level(request: pytest.FixtureRequest) -> str:
    """Where the override hooks in; every model test runs at every level."""
    return request.param


def families_left_to_pytorch(level: str, spec: ModelSpec, compiled: bool) -> frozenset[str]:
    """The families a routed run at ``level`` leaves to PyTorch by design.

    At the Python level, compiled code keeps torch._grouped_mm: Dynamo hands a TorchFunctionMode
    only the functions of torch.overrides.get_overridable_functions(), which leaves out private
    ones (see override's docstring).
    """
    if level == "python" and compiled:
        return spec.families & {"grouped"}
    return frozenset()


def aten_gemms_of(families: frozenset[str]) -> frozenset[str]:
    return frozenset({"grouped": "_grouped_mm", "scaled": "_scaled_mm"}[f]
                     for f in families & {"grouped", "scaled"})


class GemmWitness(TorchDispatchMode):
    """Records the aten GEMM ops and the tgemm ops that run below autograd, backward included."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: set[str] = set()
        self.tgemm: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name in ATEN_GEMMS:
            self.aten.add(name)
        elif func.namespace == "tgemm":
            self.tgemm.add(name)
        return func(*args, **(kwargs or {}))


def graph_ops(code: str, namespace: str) -> set[str]:
    return set(re.findall(rf"torch\.ops\.{namespace}\.(\w+)\.", code))


def routed_families(counts: dict[str, int]) -> frozenset[str]:
    return frozenset(f for f in FAMILIES if counts[f] > 0)


# --- the tiny models: eager ---------------------------------------------------------------------

def _case_id(value: object) -> str:
    return str(value).removeprefix("torch.")


EAGER_CASES = [(name, dtype) for name in MODELS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("name", "dtype"), EAGER_CASES, ids=_case_id)
def test_eager(name, dtype, override_level, device, highest_fp32):
    spec = MODELS[name]
    model, routed_model, tokens = model_pair(name, TINY, device, dtype)
    expected = forward_backward(model, model, tokens)
    with tg.override(level=override_level) as ov:
        got = forward_backward(routed_model, routed_model, tokens)
    assert_close_results(got, expected, dtype)
    # Every GEMM entry point the models call is routed: no fall-through at all (the override
    # counts only the entry points it knows, GEMM-shaped or not).
    assert ov.counts["fallback"] == 0, ov.counts
    if override_level == "aten":
        # The aten level also sees the GEMMs inside other aten ops (attention's math path):
        # more families, never fewer. Its aten GEMM ops still run (with tgemm kernels), so a
        # dispatch mode cannot witness it; the counts, kept for every call, do.
        assert_routed(ov.counts, spec, exact=False)
        return
    assert_routed(ov.counts, spec)

    # Where the GEMMs ran, below autograd, in a second step: a dispatch mode takes tgemm's ops
    # off their eager fast path, so the results above come from a step without one.
    with GemmWitness() as plain_witness:
        forward_backward(model, model, tokens)
    with tg.override(level=override_level), GemmWitness() as witness:
        forward_backward(routed_model, routed_model, tokens)
    assert plain_witness.aten >= aten_gemms_of(spec.families) | {"mm"}, plain_witness.aten
    # On CUDA, float32 attention takes SDPA's math path, whose products are aten bmm calls made
    # inside another aten op: below the Python level (the aten level routes them).
    inside_sdpa = {"bmm"} if spec.sdpa and device == "cuda" and dtype == torch.float32 else set()
    assert witness.aten <= inside_sdpa, f"GEMMs left to PyTorch: {witness.aten}"
    assert witness.tgemm >= ({"mm", "grouped_mm"} if "grouped" in spec.families else {"mm"})


# --- the tiny models: compiled (graph capture) ----------------------------------------------------

# Mixtral compiles in bf16 only: for other dtypes transformers' grouped_mm experts switch to its
# own fallback op under torch.compile, whose backward does not trace (a data-dependent guard).
COMPILE_CASES = [("llama", torch.float32), ("gpt2", torch.float32), ("mixtral", torch.bfloat16)]


def recording_backend(graphs: list[str]) -> Callable:
    """AOTAutograd with eager forward and backward graphs, whose code is kept in ``graphs``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


# transformers' MoE code calls lru_cache'd version checks, which Dynamo warns it traces through.
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize(("name", "dtype"), COMPILE_CASES, ids=_case_id)
def test_compiled(name, dtype, override_level, device, highest_fp32, fresh_dynamo):
    spec = MODELS[name]
    model, routed_model, tokens = model_pair(name, TINY, device, dtype)
    expected = forward_backward(model, model, tokens)
    graphs: list[str] = []
    compiled = torch.compile(routed_model, backend=recording_backend(graphs), fullgraph=True)
    with tg.override(level=override_level) as ov:
        got = forward_backward(compiled, routed_model, tokens)

    assert len(graphs) == 2, "expected one forward and one backward graph"
    code = "\n".join(graphs)
    assert_close_results(got, expected, dtype)
    if override_level == "aten":
        # The graphs hold aten's GEMMs, as without the override; running them with the aten
        # level open put every one of them on tgemm.
        assert graph_ops(code, "aten") & ATEN_GEMMS, graph_ops(code, "aten")
        assert_routed(ov.counts, spec, exact=False)
        assert ov.counts["fallback"] == 0, ov.counts
        return
    left = families_left_to_pytorch(override_level, spec, compiled=True)
    assert graph_ops(code, "aten") & ATEN_GEMMS == aten_gemms_of(left), graph_ops(code, "aten")
    # Under the interpreter tgemm's ops are opaque in the graph; with compiled Triton AOTAutograd
    # traces into them, and their kernels appear as functional Triton kernel wrappers.
    assert graph_ops(code, "tgemm") or "triton_kernel_wrapper_functional(" in code
    for graph in graphs:  # the backward runs on tgemm too
        assert graph_ops(graph, "tgemm") or "triton_kernel_wrapper_functional(" in graph


# --- kernel names in a GPU profile ----------------------------------------------------------------

def _tgemm_kernel_names() -> frozenset[str]:
    """The names of every @triton.jit function in torch_triton_gemm.kernels: a launched kernel
    shows up in traces under its function's name."""
    names = set()
    package = torch_triton_gemm.kernels
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names.update(name for name, obj in vars(module).items()
                     if isinstance(obj, KernelInterface))
    return frozenset(names)


TGEMM_KERNELS = _tgemm_kernel_names()
# Fused attention (FlashAttention, memory-efficient and cuDNN SDPA) kernels: CUTLASS-based and
# named so, but attention rather than GEMM calls; the override leaves SDPA to PyTorch.
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)
# cuBLAS / cuBLASLt (Hopper's nvjet and sm90_xmma, Ampere's s16816gemm, gemv, split-K reduce),
# CUTLASS, and Inductor's own GEMM templates.
_GEMM = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|^triton_tem_", re.IGNORECASE)
# CUTLASS 3's grouped GEMM, which torch._grouped_mm runs on Hopper, and the kernel that lays out
# its per-group arguments.
_GROUPED_GEMM = re.compile(r"GroupProblemShape|prepare_grouped_gemm_data")


def kernel_kind(name: str) -> str:
    """What a GPU kernel name says the kernel is: "tgemm" (one of tgemm's Triton kernels),
    "grouped gemm" or "gemm" (a GEMM from anywhere else), "attention", or "other"."""
    if re.sub(r"_\d+$", "", name) in TGEMM_KERNELS:  # Inductor may number a kernel it emits
        return "tgemm"
    if _ATTENTION.search(name):
        return "attention"
    if _GROUPED_GEMM.search(name):
        return "grouped gemm"
    if _GEMM.search(name):
        return "gemm"
    return "other"


KERNEL_SAMPLES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
    "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
    "__nv_bfloat16, false, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
    "__nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, "
    "float const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
    "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, "
    "float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
    "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, "
    "float>, float, float)": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t, "
    "cutlass::bfloat16_t, float, cute::tuple<int, int, int> >(cutlass::bfloat16_t*, int const*, "
    "int, int, int, long, long, bool, bool)": "grouped gemm",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
    "kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, "
    "cutlass::gemm::collective::CollectiveMma<...> > > >(...)": "grouped gemm",
    "mm_kernel": "tgemm",
    "mm_tma_kernel": "tgemm",
    "splitk_reduce_kernel": "tgemm",
    "grouped_mm_kernel": "tgemm",
    "scaled_mm_kernel": "tgemm",
    "mm_tma_kernel_0": "tgemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
    "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, "
    "false, true, false, false, true, true, false, false>(FLASH_NAMESPACE::Flash_fwd_params)":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::"
    "bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0":
        "attention",
    "triton_poi_fused_add_mul_0": "other",
    "triton_red_fused__to_copy_mean_pow_1": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, "
    "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, "
    "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<"
    "float> >, std::array<char*, 3ul>)": "other",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)":
        "other",
    "my_gemm_kernel": "gemm",  # only tgemm's own kernel names count as tgemm
}


def test_tgemm_kernel_names():
    assert {"mm_kernel", "mm_tma_kernel", "splitk_reduce_kernel", "grouped_mm_kernel",
            "scaled_mm_kernel"} <= TGEMM_KERNELS


@pytest.mark.parametrize("name", KERNEL_SAMPLES, ids=lambda n: n[:40])
def test_kernel_kind(name):
    assert kernel_kind(name) == KERNEL_SAMPLES[name]


# --- GPU: bf16 models, eager and Inductor, in the CUDA profiler -----------------------------------

def profile_kernels(fn: Callable[[], Results]) -> tuple[list[str], Results]:
    """The CUDA kernels ``fn`` launches, by name, and what it returns."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        result = fn()
        torch.cuda.synchronize()
    names = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names, result


def kernels_of_kind(names: list[str], *kinds: str) -> list[str]:
    return sorted({name for name in names if kernel_kind(name) in kinds})


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_profile(name, compiled, override_level, fresh_dynamo):
    spec = MODELS[name]
    model, routed_model, tokens = model_pair(name, SMALL, "cuda", torch.bfloat16)
    routed_step = torch.compile(routed_model, fullgraph=True) if compiled else routed_model

    forward_backward(model, model, tokens)  # warm-up: cuBLAS handles, lazy initialisation
    plain_kernels, expected = profile_kernels(lambda: forward_backward(model, model, tokens))
    with tg.override(level=override_level) as ov:
        forward_backward(routed_step, routed_model, tokens)  # warm-up: compilation, tuning
        kernels, got = profile_kernels(
            lambda: forward_backward(routed_step, routed_model, tokens))

    assert kernels_of_kind(plain_kernels, "gemm", "grouped gemm"), "no GEMM seen in the plain run"
    assert not kernels_of_kind(plain_kernels, "tgemm")
    left_to_pytorch = families_left_to_pytorch(override_level, spec, compiled)
    allowed = {"grouped gemm"} if left_to_pytorch else set()
    left = kernels_of_kind(kernels, *({"gemm", "grouped gemm"} - allowed))
    assert not left, f"GEMM kernels not from tgemm: {left}"
    assert kernels_of_kind(kernels, "tgemm"), sorted(set(kernels))
    if "grouped" in spec.families and not allowed:
        assert "grouped_mm_kernel" in kernels
    if override_level == "aten":  # counted at run time, compiled or not
        assert_routed(ov.counts, spec, exact=False)
        assert ov.counts["fallback"] == 0, ov.counts
    elif not compiled:  # compiled calls are decided when Dynamo traces, and not counted
        assert_routed(ov.counts, spec)
        assert ov.counts["fallback"] == 0, ov.counts
    assert_close_results(got, expected, torch.bfloat16)
