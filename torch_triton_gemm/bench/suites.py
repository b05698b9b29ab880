"""What the benchmark runs: the shape suites, as data.

An mm shape is (M, N, K): a row-major activation a [M, K] times b [K, N], where b is a weight
stored [N, K] and passed as ``W.t()`` (the way ``nn.Linear`` calls mm) unless the case says
otherwise (a transposed a, a row-major b, or an operand sliced out of a wider buffer). Nothing
here touches a GPU, so the suites can be listed and tested anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

MM_SUITES = ("square", "llama", "layouts", "decode", "odd", "deepk", "shallowk")
DEFAULT_SUITES = (*MM_SUITES, "latency", "e2e", "coldstart")
# mm suites that judge the planner on shapes nobody tuned for; long, so they run when named.
PLANNER_SUITES = ("training", "classes", "sweep")
ALL_SUITES = (*DEFAULT_SUITES, "grouped", "scaled", "sgrouped", "moe", *PLANNER_SUITES)
# Names that stand for several suites on the command line.
SUITE_GROUPS = {"mm": MM_SUITES, "default": DEFAULT_SUITES, "all": ALL_SUITES}

SUITE_DESCRIPTIONS = {
    "square": "1024^3, 2048^3, 4096^3, 8192^3",
    "llama": "Llama-3-8B qkv, o, gate_up, down for M = 1 .. 8192 tokens",
    "layouts": "4096^3 with both operands row-major, and with both column-major",
    "decode": "the Llama-3-8B layers at M = 2, 4, 8, 32; memory-bound, so GB/s too",
    "odd": "999x1003x1007, 1500^3, 2047x2049x2051, 3000^3",
    "deepk": "few output tiles, long K: 128x128x32768, 512x512x65536, 1024x1024x16384",
    "shallowk": "short K: 8192x8192x128, 32768x4096x32",
    "latency": "host time per eager call (64^3, M=1 qkv): torch.ops.tgemm.mm, tgemm.mm, "
               "torch.mm; and the fp8 scaled_mm path against torch._scaled_mm",
    "e2e": "step time of Llama blocks (bf16, fwd+bwd), plain vs override()",
    "coldstart": "first training step of the drop-in example's model in fresh processes",
    "grouped": "grouped_mm vs torch._grouped_mm and a torch.mm loop (Mixtral, DeepSeek-like)",
    "scaled": "scaled_mm (fp8 e4m3 -> bf16) vs torch._scaled_mm, three scaling recipes, "
              "precise and fast accumulation",
    "sgrouped": "scaled_grouped_mm (rowwise fp8 e4m3 -> bf16) vs torch._scaled_grouped_mm, both "
                "accumulation modes (Mixtral, DeepSeek-V3-like experts)",
    "moe": "moe_mlp vs the unfused torch._grouped_mm MoE MLP (Mixtral, Qwen3-MoE), with peak "
           "memory",
    "training": "a training step's GEMMs, forward, input and weight gradients (Llama-3-8B "
                "layers at 4096 tokens, the drop-in example's model at 8192)",
    "classes": "named shapes the planner finds hard: near1000, overwave, near3000, decode32, "
               "decode1, wideN, deepK",
    "sweep": "--count random shapes of --seed: M, N, K log-uniform over 1..16384, odd sizes "
             "and layouts",
}

# --- mm suites ----------------------------------------------------------------------------------

SQUARE_SIZES = (1024, 2048, 4096, 8192)
QUICK_SQUARE_SIZES = (4096, 8192)
LLAMA_MS = (1, 16, 64, 128, 512, 2048, 8192)
QUICK_LLAMA_MS = (16, 2048)
DECODE_MS = (2, 4, 8, 32)
QUICK_DECODE_MS = (8,)
# Llama-3-8B projections as (name, N, K): hidden 4096, q+k+v = 4096 + 2 * 1024 (GQA),
# gate and up fused to 2 * 14336.
LLAMA_LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                ("down", 4096, 14336))
LAYOUTS_SIZE = 4096
# (M, N, K) lists; the quick subset is the first entries named by the QUICK_* index tuples.
ODD_SHAPES = ((999, 1003, 1007), (1500, 1500, 1500), (2047, 2049, 2051), (3000, 3000, 3000))
QUICK_ODD = (0, 2)
DEEP_K_SHAPES = ((128, 128, 32768), (512, 512, 65536), (1024, 1024, 16384))
QUICK_DEEP_K = (0, 1)
SHALLOW_K_SHAPES = ((8192, 8192, 128), (32768, 4096, 32))
QUICK_SHALLOW_K = (0, 1)
LATENCY_SHAPES = (("64^3", 64, 64, 64), ("qkv", 1, 6144, 4096))

# Rows at or below this many FLOPs per byte of operands and output are limited by memory
# bandwidth on any current GPU (an H100's bf16 ridge point is near 300), so they report GB/s.
MEMORY_BOUND_INTENSITY = 64


@dataclass(frozen=True)
class Case:
    """One mm shape: out[M, N] = a[M, K] @ b[K, N], with the operand layouts to build."""

    suite: str
    name: str
    m: int
    n: int
    k: int
    a_layout: str = "row"  # "row": [M, K] contiguous; "col": a [K, M] tensor transposed
    b_layout: str = "col"  # "col": W [N, K] transposed (nn.Linear); "row": [K, N] contiguous
    # Extra columns of the buffer an operand is sliced from (its first columns), so that the
    # operand's row stride, in the layout above, exceeds its width.
    a_pad: int = 0
    b_pad: int = 0
    shape_class: str = ""  # what the planner suites group rows by in their summaries

    @property
    def flops(self) -> int:
        """Floating-point operations of the product (a multiply and an add per term)."""
        return 2 * self.m * self.n * self.k

    def bytes_moved(self, element_size: int) -> int:
        """Bytes that must cross memory at least once: both operands and the output."""
        return (self.m * self.k + self.k * self.n + self.m * self.n) * element_size

    @property
    def memory_bound(self) -> bool:
        """Whether bandwidth, not arithmetic, limits this shape (16-bit operands)."""
        return self.flops <= MEMORY_BOUND_INTENSITY * self.bytes_moved(2)

    def stored(self, operand: str) -> tuple[int, int, int, bool]:
        """How ``operand`` ("a" or "b") is held: (rows, columns, pad, transposed), where the
        operand is the first ``columns`` columns of a row-major [rows, columns + pad] buffer,
        transposed when ``transposed``."""
        if operand == "a":
            return (self.m, self.k, self.a_pad, False) if self.a_layout == "row" else (
                self.k, self.m, self.a_pad, True)
        return (self.n, self.k, self.b_pad, True) if self.b_layout == "col" else (
            self.k, self.n, self.b_pad, False)

    @property
    def display_name(self) -> str:
        """The name, after the shape class where the case has one."""
        return f"{self.shape_class} {self.name}" if self.shape_class else self.name

    def label(self) -> str:
        """Short human-readable description for progress lines and the summary."""
        if self.suite in ("llama", "decode") or (self.suite == "latency" and self.m == 1):
            return f"{self.suite} {self.name} M={self.m}"
        return f"{self.suite} {self.display_name}"

    def record(self) -> dict[str, object]:
        """The shape as CSV fields."""
        return {"M": self.m, "N": self.n, "K": self.k, "a_layout": self.a_layout,
                "b_layout": self.b_layout, "a_pad": self.a_pad, "b_pad": self.b_pad,
                "class": self.shape_class}


def _shape_name(m: int, n: int, k: int) -> str:
    return f"{m}^3" if m == n == k else f"{m}x{n}x{k}"


def _pick(full: Sequence, quick_indices: Sequence[int], quick: bool) -> list:
    return [full[i] for i in quick_indices] if quick else list(full)


def shape_cases(suite: str, shapes: Sequence[tuple[int, int, int]]) -> list[Case]:
    """``shapes`` (M, N, K) as cases of ``suite``, in nn.Linear's layout (a row-major, b =
    W.t())."""
    return [Case(suite, _shape_name(m, n, k), m, n, k) for m, n, k in shapes]


def _llama_cases(suite: str, ms: Sequence[int]) -> list[Case]:
    # M outermost: the rows for one batch size read as one forward pass.
    return [Case(suite, name, m, n, k) for m in ms for name, n, k in LLAMA_LAYERS]


# Training steps as (model, tokens, its nn.Linear layers as (name, N = out, K = in)): the
# Llama-3-8B projections, and the drop-in example's model as the coldstart suite builds it
# (bench/model.py on a GPU: hidden 1024, MLP 2752, vocab 32000, 8 x 1024 tokens).
TRAINING_MODELS = (
    ("llama3-8b", 4096, LLAMA_LAYERS),
    ("dropin", 8192, (("attn", 1024, 1024), ("gate", 2752, 1024), ("down", 1024, 2752),
                      ("lm_head", 32000, 1024))),
)
QUICK_TRAINING_LAYERS = 2  # of the first model


def _training_cases(suite: str, quick: bool) -> list[Case]:
    """Each layer's three GEMMs, as autograd runs them for y = x @ W.t(): the forward, the
    input gradient dy @ W (W row-major as [K, N]) and the weight gradient dy.t() @ x (a
    transposed, the contraction over the tokens); the pass is the row's class."""
    cases = []
    models = TRAINING_MODELS[:1] if quick else TRAINING_MODELS
    for model, tokens, layers in models:
        for layer, n, k in layers[:QUICK_TRAINING_LAYERS] if quick else layers:
            name = f"{model} {layer}"
            cases += [Case(suite, name, tokens, n, k, shape_class="fwd"),
                      Case(suite, name, tokens, k, n, b_layout="row", shape_class="dgrad"),
                      Case(suite, name, n, k, tokens, a_layout="col", b_layout="row",
                           shape_class="wgrad")]
    return cases


# --- planner suites: named shape classes, and a seeded random sweep -----------------------------

# (M, N, K) shapes of the classes of shapes the planner finds hard, a few of each.
SHAPE_CLASSES = {
    # Sizes near 1000: rows 16-byte aligned, but not multiples of 16 elements.
    "near1000": ((1000, 1000, 1000), (1000, 1024, 1000), (1016, 1000, 1008), (1000, 4096, 1000)),
    # A grid of 128x128 output tiles just over one wave of an H100's 132 SMs.
    "overwave": ((1536, 1536, 1536), (1536, 1664, 1536), (1408, 1664, 2048)),
    "near3000": ((3000, 3000, 3000), (2992, 3008, 3000), (3072, 3000, 3000)),
    # A 7B model's attention and MLP projections at 32 tokens, and at one.
    "decode32": ((32, 4096, 4096), (32, 12288, 4096), (32, 4096, 11008)),
    "decode1": ((1, 4096, 4096), (1, 12288, 4096), (1, 4096, 11008)),
    "wideN": ((256, 22016, 4096), (256, 28672, 4096)),
    # K 64 times M and N: few output tiles, each with a long K loop.
    "deepK": ((256, 256, 16384), (128, 128, 8192), (512, 512, 32768)),
}

SWEEP_SEED = 0
SWEEP_COUNT = 400
QUICK_SWEEP_COUNT = 40
SWEEP_MAX_SIZE = 16384
SWEEP_MAX_FLOPS = 2**34  # larger draws are drawn again: one row should take seconds, not minutes
# The sweep's size classes, by what every size of a shape is a multiple of.
SIZE_CLASSES = ("mult64", "mult8", "arbitrary")
# Cumulative probabilities of rounding a drawn size to a multiple of 64, then to 8 * odd (a
# multiple of 8 but not of 16); the rest stay as drawn.
MULT64_SHARE, MULT8_SHARE = 0.5, 0.75
# Share of cases not in nn.Linear's layout: a transposed, b row-major, or a sliced operand.
OTHER_LAYOUT_SHARE = 0.25
# Row strides of sliced operands are a multiple of 8 elements (16 bytes at 2 bytes each) for
# half of them, and 1..7 elements off one for the rest.
ALIGNED_PAD_SHARE = 0.5
ALIGN_ELEMENTS = 8


def size_class(m: int, n: int, k: int) -> str:
    """The size class: "mult64" when M, N and K are multiples of 64, "mult8" when of 8, else
    "arbitrary"."""
    if all(s % 64 == 0 for s in (m, n, k)):
        return "mult64"
    return "mult8" if all(s % 8 == 0 for s in (m, n, k)) else "arbitrary"


def _sweep_size(rng: random.Random) -> int:
    size = round(math.exp(rng.uniform(0.0, math.log(SWEEP_MAX_SIZE))))
    draw = rng.random()
    if draw < MULT64_SHARE:
        return max(64, round(size / 64) * 64)
    if draw < MULT8_SHARE:
        return 16 * (min(size, SWEEP_MAX_SIZE - 1) // 16) + 8
    return size


def _sweep_pad(rng: random.Random, columns: int) -> int:
    """Extra buffer columns for an operand ``columns`` wide: the stride is 16-byte aligned or
    not, with ALIGNED_PAD_SHARE."""
    aligned = rng.random() < ALIGNED_PAD_SHARE
    pad = ALIGN_ELEMENTS * rng.randint(1, 8) + (-columns) % ALIGN_ELEMENTS
    return pad if aligned else pad + rng.randint(1, ALIGN_ELEMENTS - 1)


def _layout_tags(case: Case) -> list[str]:
    tags = ["a-col"] if case.a_layout == "col" else []
    tags += ["b-row"] if case.b_layout == "row" else []
    tags += [f"a-pad{case.a_pad}"] if case.a_pad else []
    return tags + ([f"b-pad{case.b_pad}"] if case.b_pad else [])


def _sweep_case(rng: random.Random) -> Case:
    while True:
        m, n, k = (_sweep_size(rng) for _ in range(3))
        if 2 * m * n * k <= SWEEP_MAX_FLOPS:
            break
    case = Case("sweep", "", m, n, k, shape_class=size_class(m, n, k))
    if rng.random() < OTHER_LAYOUT_SHARE:
        variant = rng.choice(("a-col", "b-row", "sliced"))
        if variant == "a-col":
            case = dataclasses.replace(case, a_layout="col")
        elif variant == "b-row":
            case = dataclasses.replace(case, b_layout="row")
        else:
            sliced = rng.choice(("a", "b", "ab"))
            # Both operands are [.., K] buffers in nn.Linear's layout, so the pads widen K.
            case = dataclasses.replace(case, a_pad=_sweep_pad(rng, k) if "a" in sliced else 0,
                                       b_pad=_sweep_pad(rng, k) if "b" in sliced else 0)
    return dataclasses.replace(case, name=" ".join([_shape_name(m, n, k), *_layout_tags(case)]))


def sweep_cases(seed: int = SWEEP_SEED, count: int = SWEEP_COUNT) -> list[Case]:
    """The sweep's ``count`` cases for ``seed``: the same on every machine and run, and the
    first cases of a longer sweep with the same seed.

    M, N and K are each log-uniform over 1..SWEEP_MAX_SIZE, then rounded to a multiple of 64
    (half of them), to 8 * odd (a quarter) or left as drawn; shapes over SWEEP_MAX_FLOPS are
    drawn again. A quarter of the cases get a transposed a, a row-major b, or operands sliced
    out of wider buffers (row strides aligned to 16 bytes or not)."""
    rng = random.Random(seed)
    return [_sweep_case(rng) for _ in range(count)]


# Products of few rows for the transposed rule (tuning.swap_plan): bench.plans' "fewrows" (16-bit)
# and "scaled-fewrows" (fp8) sets.
FEW_ROWS_M = (2, 32)
FEW_ROWS_N = (2048, 65536)
FEW_ROWS_K = (2048, 16384)
# bench.plans' "midrows" (16-bit) and "scaled-midrows" (fp8) sets: the same weights against a
# batch of 33-512 rows (prefill chunks, batched decoding), where too few tiles fill the SMs.
MID_ROWS_M = (33, 512)


def few_row_shapes(seed: int, count: int, fp8: bool,
                   n_range: tuple[int, int] = FEW_ROWS_N,
                   m_range: tuple[int, int] = FEW_ROWS_M) -> list[tuple[int, int, int]]:
    """``count`` seeded (M, N, K): M uniform over ``m_range`` (FEW_ROWS_M unless asked), N
    log-uniform over ``n_range`` (FEW_ROWS_N unless asked), K uniform over FEW_ROWS_K; N a
    multiple of 64 (40%), of 16 (40%) or as drawn, K a multiple of 128 (half), of 16 (30%),
    of 8 (10%) or as drawn. For fp8 (``fp8``) N and K stay multiples of 16
    (torch._scaled_mm, the peer, needs them)."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        m = rng.randint(*m_range)
        draw = rng.random()
        n = int(math.exp(rng.uniform(*map(math.log, n_range))))
        n = n // 64 * 64 if draw < 0.4 else n // 16 * 16 if draw < 0.8 or fp8 else n
        draw = rng.random()
        k = rng.randint(*FEW_ROWS_K)
        if draw < 0.5:
            k = k // 128 * 128
        elif draw < 0.8 or fp8:
            k = k // 16 * 16
        elif draw < 0.9:
            k = k // 8 * 8
        shapes.append((m, n, k))
    return shapes


def few_row_cases(seed: int, count: int, n_range: tuple[int, int] = FEW_ROWS_N,
                  m_range: tuple[int, int] = FEW_ROWS_M) -> list[Case]:
    """bench.plans' "fewrows" set (its "midrows" set with ``m_range`` MID_ROWS_M): 16-bit
    products of ``few_row_shapes``, nn.Linear's layout."""
    suite = "fewrows" if m_range == FEW_ROWS_M else "midrows"
    return [Case(suite, _shape_name(m, n, k), m, n, k)
            for m, n, k in few_row_shapes(seed, count, False, n_range, m_range)]


def few_row_scaled_cases(seed: int, count: int, n_range: tuple[int, int] = FEW_ROWS_N,
                         m_range: tuple[int, int] = FEW_ROWS_M) -> list[ScaledCase]:
    """bench.plans' "scaled-fewrows" set (with ``m_range`` MID_ROWS_M, "scaled-midrows"):
    fp8 products of ``few_row_shapes``, tensorwise and rowwise, each accumulation mode."""
    return [ScaledCase(_shape_name(m, n, k), m, n, k, recipe, fast)
            for m, n, k in few_row_shapes(seed, count, True, n_range, m_range)
            for recipe in ("tensorwise", "rowwise") for fast in (False, True)]


def sweep_count(quick: bool, count: int | None) -> int:
    """The number of sweep cases: ``count``, else the full or quick default."""
    if count is not None:
        return count
    return QUICK_SWEEP_COUNT if quick else SWEEP_COUNT


def plan_sweep_cases(name: str, seed: int, count: int,
                     few_rows_n: tuple[int, int] = FEW_ROWS_N) -> list[Case]:
    """The 16-bit cases the plan sweep (bench.plans) and the picks (bench.picks) take by name:
    "sweep", "fewrows" and "midrows" (``seed``, ``count``; the few-row sets' weights drawn
    over ``few_rows_n``), else the mm suite ``name``."""
    if name == "sweep":
        return sweep_cases(seed, count)
    if name == "fewrows":
        return few_row_cases(seed, count, few_rows_n)
    if name == "midrows":
        return few_row_cases(seed, count, few_rows_n, MID_ROWS_M)
    return suite_cases(name)


def suite_cases(suite: str, quick: bool = False, *, seed: int = SWEEP_SEED,
                count: int | None = None) -> list[Case]:
    """The mm (or latency) cases of one suite in run order; ``quick`` keeps a few of them.
    ``seed`` and ``count`` choose the sweep's shapes (count: SWEEP_COUNT, or QUICK_SWEEP_COUNT
    with ``quick``)."""
    if suite == "square":
        sizes = QUICK_SQUARE_SIZES if quick else SQUARE_SIZES
        return shape_cases(suite, [(s, s, s) for s in sizes])
    if suite == "llama":
        return _llama_cases(suite, QUICK_LLAMA_MS if quick else LLAMA_MS)
    if suite == "decode":
        return _llama_cases(suite, QUICK_DECODE_MS if quick else DECODE_MS)
    if suite == "layouts":
        s = LAYOUTS_SIZE
        return [Case(suite, "a-row b-row", s, s, s, a_layout="row", b_layout="row"),
                Case(suite, "a-col b-col", s, s, s, a_layout="col", b_layout="col")]
    if suite == "odd":
        return shape_cases(suite, _pick(ODD_SHAPES, QUICK_ODD, quick))
    if suite == "deepk":
        return shape_cases(suite, _pick(DEEP_K_SHAPES, QUICK_DEEP_K, quick))
    if suite == "shallowk":
        return shape_cases(suite, _pick(SHALLOW_K_SHAPES, QUICK_SHALLOW_K, quick))
    if suite == "latency":
        return [Case(suite, name, m, n, k) for name, m, n, k in LATENCY_SHAPES]
    if suite == "training":
        return _training_cases(suite, quick)
    if suite == "classes":
        return [Case(suite, _shape_name(m, n, k), m, n, k, shape_class=name)
                for name, shapes in SHAPE_CLASSES.items()
                for m, n, k in (shapes[:1] if quick else shapes)]
    if suite == "sweep":
        return sweep_cases(seed, sweep_count(quick, count))
    raise ValueError(f"{suite!r} is not an mm suite")


def build_cases(suites: Sequence[str], quick: bool = False) -> list[Case]:
    """The mm cases of ``suites`` (other suite names are ignored) in run order."""
    return [c for s in MM_SUITES if s in suites for c in suite_cases(s, quick)]


# --- grouped_mm suite ---------------------------------------------------------------------------

# Mixtral-8x7B experts: 8 of them, hidden 4096, FFN 14336.
MIXTRAL = dict(groups=8, k=4096, n=14336)
MIXTRAL_TOKENS = (2048, 8192, 32768)
QUICK_MIXTRAL_TOKENS = (8192,)
# DeepSeek-V3-like: 256 routed experts, hidden 7168, expert FFN 2048, 32768 token-slots.
DEEPSEEK = dict(groups=256, k=7168, n=2048, tokens=32768)
# Group sizes are multiples of this (padded routing, as MoE training stacks do), which every
# grouped GEMM kernel accepts, torch's included.
GROUP_ALIGN = 16
# Zipf exponent of the skewed routing: about 5% of the experts get no tokens, the busiest a
# fifth of them.
ZIPF_EXPONENT = 1.1

GROUPED_FORMS = {
    "fwd": "out[T, N] = a[T, K] @ b[g] per group of rows (2D x 3D)",
    "fwd+bwd": "forward, then the gradients of a and of the weights",
    "wgrad": "weight gradient: out[g] = x[rows of g].T @ dy[rows of g] (2D x 2D, groups along K)",
}


@dataclass(frozen=True)
class GroupedCase:
    """One grouped GEMM: ``tokens`` rows of width ``k`` routed to ``groups`` [k, n] weights."""

    name: str  # "mixtral", "deepseek"
    form: str  # a key of GROUPED_FORMS
    groups: int
    tokens: int
    n: int
    k: int
    routing: str = "balanced"  # or "skewed"
    suite: str = "grouped"

    @property
    def flops(self) -> int:
        """2*T*N*K for one product; the backward pass adds two products of the same size."""
        return 2 * self.tokens * self.n * self.k * (3 if self.form == "fwd+bwd" else 1)

    @property
    def memory_bound(self) -> bool:
        return False

    def group_sizes(self) -> list[int]:
        """Tokens per group, in group order (sums to ``tokens``)."""
        if self.routing == "balanced":
            return balanced_sizes(self.tokens, self.groups)
        return skewed_sizes(self.tokens, self.groups)

    def label(self) -> str:
        return f"grouped {self.name} {self.form} {self.routing} T={self.tokens}"

    def record(self) -> dict[str, object]:
        return {"form": self.form, "routing": self.routing, "G": self.groups,
                "T": self.tokens, "N": self.n, "K": self.k}


def balanced_sizes(tokens: int, groups: int) -> list[int]:
    """Every group gets tokens / groups rows."""
    if tokens % groups:
        raise ValueError(f"{tokens} tokens do not split evenly over {groups} groups")
    return [tokens // groups] * groups


def skewed_sizes(tokens: int, groups: int, exponent: float = ZIPF_EXPONENT,
                 align: int = GROUP_ALIGN, seed: int = 0) -> list[int]:
    """Zipf-like group sizes: the r-th busiest group gets a share proportional to r**-exponent,
    rounded down to a multiple of ``align`` (so the least busy get none); the rounding remainder
    goes, ``align`` rows at a time, to the busiest groups. Groups are then shuffled with a fixed
    seed, so the result is the same on every run."""
    if tokens % align:
        raise ValueError(f"{tokens} tokens are not a multiple of the alignment {align}")
    weights = [r ** -exponent for r in range(1, groups + 1)]
    total = sum(weights)
    sizes = [int(tokens * w / total) // align * align for w in weights]
    for i in range((tokens - sum(sizes)) // align):
        sizes[i % groups] += align
    random.Random(seed).shuffle(sizes)
    return sizes


def grouped_cases(quick: bool = False) -> list[GroupedCase]:
    """The grouped suite in run order."""
    mixtral_tokens = QUICK_MIXTRAL_TOKENS if quick else MIXTRAL_TOKENS
    cases = [GroupedCase("mixtral", "fwd", tokens=t, **MIXTRAL) for t in mixtral_tokens]
    cases += [GroupedCase("mixtral", "fwd+bwd", tokens=t, **MIXTRAL) for t in mixtral_tokens]
    routings = ("skewed",) if quick else ("balanced", "skewed")
    for form in ("fwd",) if quick else ("fwd", "fwd+bwd"):
        cases += [GroupedCase("deepseek", form, routing=r, **DEEPSEEK) for r in routings]
    cases += [GroupedCase("mixtral", "wgrad", tokens=t, **MIXTRAL) for t in mixtral_tokens]
    return cases


# --- moe_mlp suite ------------------------------------------------------------------------------

# Expert MLPs of Mixtral-8x7B and Qwen3-30B-A3B: experts, top-k, hidden H, expert FFN I.
MOE_MODELS = {
    "mixtral": dict(experts=8, top_k=2, hidden=4096, inter=14336),
    "qwen3": dict(experts=128, top_k=8, hidden=2048, inter=768),
}
MOE_TOKENS = (4096, 16384)
QUICK_MOE_TOKENS = (4096,)
MOE_FORMS = {
    "fwd": "out = the routed MLP of x (gather, gate/up, SwiGLU, down, weighted top-k sum)",
    "fwd+bwd": "forward, then the gradients of x, w13, w2 and the router weights",
}


@dataclass(frozen=True)
class MoECase:
    """One routed MoE MLP block: ``tokens`` tokens, each to ``top_k`` of ``experts`` SwiGLU
    experts of hidden size ``hidden`` and FFN size ``inter`` (softmax router on random
    logits)."""

    name: str  # a key of MOE_MODELS
    form: str  # a key of MOE_FORMS
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    suite: str = "moe"

    @property
    def flops(self) -> int:
        """Three products of 2 * (T * k) * H * I per slot forward (gate, up, down); the
        backward pass adds twice as many."""
        forward = 6 * self.tokens * self.top_k * self.hidden * self.inter
        return forward * (3 if self.form == "fwd+bwd" else 1)

    @property
    def memory_bound(self) -> bool:
        return False

    def label(self) -> str:
        return f"moe {self.name} {self.form} T={self.tokens}"

    def record(self) -> dict[str, object]:
        return {"form": self.form, "E": self.experts, "top_k": self.top_k, "H": self.hidden,
                "I": self.inter, "T": self.tokens}


def moe_cases(quick: bool = False) -> list[MoECase]:
    """The moe suite in run order."""
    tokens = QUICK_MOE_TOKENS if quick else MOE_TOKENS
    return [MoECase(name, form, tokens=t, **model)
            for name, model in MOE_MODELS.items() for form in MOE_FORMS for t in tokens]


# --- scaled_mm suite ----------------------------------------------------------------------------

SCALED_RECIPES = {
    "tensorwise": "one scale per tensor",
    "rowwise": "one scale per row of a and per column of b",
    "blockwise": "a: one scale per 1x128 block; b: one per 128x128 block of the [N, K] weight",
}
SCALED_SQUARE_SIZES = (4096, 8192)
SCALED_LLAMA_MS = (16, 128, 2048, 8192)
# A wide MLP projection (4096 tokens, intermediate 18944, hidden 3584).
SCALED_EXTRA_SHAPES = ((4096, 18944, 3584),)
# Accumulation modes timed per recipe (use_fast_accum, each side the same): blockwise scales
# apply at every K step, so it has no fast mode.
SCALED_ACCUMULATION = {"tensorwise": (False, True), "rowwise": (False, True),
                       "blockwise": (False,)}
# (suite-local name, M, N, K)
QUICK_SCALED_SHAPES = (("4096^3", 4096, 4096, 4096), ("qkv", 16, 6144, 4096),
                       ("gate_up", 2048, 28672, 4096))


@dataclass(frozen=True)
class ScaledCase:
    """One fp8 product with scales: a [M, K] e4m3 row-major, b = W.t() with W [N, K] e4m3."""

    name: str
    m: int
    n: int
    k: int
    recipe: str  # a key of SCALED_RECIPES
    fast: bool = False  # use_fast_accum on both sides
    suite: str = "scaled"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def memory_bound(self) -> bool:
        return False

    def label(self) -> str:
        where = f" M={self.m}" if self.name != _shape_name(self.m, self.n, self.k) else ""
        return f"scaled {self.name}{where} {self.recipe}{' fast' if self.fast else ''}"

    @property
    def accumulation(self) -> str:
        return "fast" if self.fast else "precise"

    def record(self) -> dict[str, object]:
        return {"M": self.m, "N": self.n, "K": self.k, "recipe": self.recipe,
                "accum": self.accumulation}


def scaled_cases(quick: bool = False,
                 llama_ms: Sequence[int] = SCALED_LLAMA_MS,
                 layers: Sequence[tuple[str, int, int]] = LLAMA_LAYERS) -> list[ScaledCase]:
    """The scaled suite in run order: every shape with each recipe and its accumulation modes
    (--quick: precise only); the projections ``layers`` ((name, N, K): Llama-3-8B's unless
    given) at each M of ``llama_ms``."""
    if quick:
        shapes = list(QUICK_SCALED_SHAPES)
    else:
        shapes = [(_shape_name(s, s, s), s, s, s) for s in SCALED_SQUARE_SIZES]
        shapes += [(_shape_name(m, n, k), m, n, k) for m, n, k in SCALED_EXTRA_SHAPES]
        shapes += [(name, m, n, k) for m in llama_ms for name, n, k in layers]
    return [ScaledCase(name, m, n, k, recipe, fast)
            for name, m, n, k in shapes for recipe in SCALED_RECIPES
            for fast in (SCALED_ACCUMULATION[recipe][:1] if quick
                         else SCALED_ACCUMULATION[recipe])]


# --- scaled_grouped_mm suite --------------------------------------------------------------------

# Expert GEMMs of Mixtral-8x7B and of a DeepSeek-V3-like MoE: experts G, top-k, hidden H, expert
# FFN I, and the token counts (routed rows = tokens * top-k). Mixtral's follow the MoE rows of
# the benchmark shape list; the DeepSeek-like rows route 1024 tokens (8192 rows, 32 per expert
# when balanced: few rows per expert, as at inference batch sizes).
SGROUPED_MODELS = {
    "mixtral": dict(groups=8, top_k=2, hidden=4096, inter=14336, tokens=(4096, 16384)),
    "deepseek": dict(groups=256, top_k=8, hidden=7168, inter=2048, tokens=(1024,)),
}
QUICK_SGROUPED = {"mixtral": ((4096,), ("balanced",)), "deepseek": ((1024,), ("skewed",))}
# The two products of a SwiGLU expert as (N, K) of hidden H and FFN I: gate and up fused, then
# down.
SGROUPED_PROJECTIONS = {"gate_up": lambda h, i: (2 * i, h), "down": lambda h, i: (h, i)}
ROUTINGS = ("balanced", "skewed")
ACCUM_MODES = (False, True)  # use_fast_accum


@dataclass(frozen=True)
class ScaledGroupedCase:
    """One rowwise-fp8 grouped GEMM, 2-D x 3-D: ``tokens`` routed rows of a [T, K] e4m3 with
    scale_a [T], split by offs over ``groups`` experts whose weights [G, N, K] e4m3 are passed
    transposed, with scale_b [G, N]; bf16 out [T, N]."""

    name: str  # a key of SGROUPED_MODELS
    proj: str  # a key of SGROUPED_PROJECTIONS
    groups: int
    tokens: int  # routed rows: tokens * top-k
    n: int
    k: int
    routing: str  # "balanced" or "skewed"
    fast_accum: bool  # use_fast_accum, the same for tgemm and torch
    suite: str = "sgrouped"

    @property
    def flops(self) -> int:
        return 2 * self.tokens * self.n * self.k

    @property
    def memory_bound(self) -> bool:
        return False

    @property
    def accum(self) -> str:
        """The accumulation mode as a short word: "fast" or "fp32"."""
        return "fast" if self.fast_accum else "fp32"

    def group_sizes(self) -> list[int]:
        """Rows per expert, in expert order (multiples of GROUP_ALIGN, summing to ``tokens``)."""
        if self.routing == "balanced":
            return balanced_sizes(self.tokens, self.groups)
        return skewed_sizes(self.tokens, self.groups)

    def label(self) -> str:
        return (f"sgrouped {self.name} {self.proj} {self.routing} T={self.tokens} "
                f"accum={self.accum}")

    def record(self) -> dict[str, object]:
        return {"proj": self.proj, "routing": self.routing, "G": self.groups, "T": self.tokens,
                "N": self.n, "K": self.k, "fast_accum": self.fast_accum}


def sgrouped_cases(quick: bool = False) -> list[ScaledGroupedCase]:
    """The sgrouped suite in run order: per model and token count, each projection with each
    routing, in both accumulation modes (adjacent rows)."""
    cases = []
    for name, model in SGROUPED_MODELS.items():
        tokens, routings = QUICK_SGROUPED[name] if quick else (model["tokens"], ROUTINGS)
        for t in tokens:
            for proj, shape in SGROUPED_PROJECTIONS.items():
                n, k = shape(model["hidden"], model["inter"])
                cases += [ScaledGroupedCase(name, proj, model["groups"], t * model["top_k"], n,
                                            k, routing, fast)
                          for routing in routings for fast in ACCUM_MODES]
    return cases


# --- counts for --list --------------------------------------------------------------------------

# Cold-start processes in run order, each with the mode it runs in and its arguments (see
# coldstart.py). Each mode starts from an empty Triton cache of its own, which its second run
# finds warm.
COLDSTART_RUNS = {"plain": "plain", "override, cold caches": "override",
                  "override, warm caches": "override",
                  "override aten, cold caches": "override-aten",
                  "override aten, warm caches": "override-aten",
                  "override, PyTorch while compiling, cold caches":
                      "override --while-compiling pytorch",
                  "override, PyTorch while compiling, 8 compile processes, cold caches":
                      "override --while-compiling pytorch --compile-processes 8",
                  "override aten, PyTorch while compiling, 8 compile processes, cold caches":
                      "override-aten --while-compiling pytorch --compile-processes 8"}


def suite_row_count(suite: str, quick: bool = False, count: int | None = None) -> int:
    """Rows one suite reports (per dtype for the mm and latency suites); ``count`` is the
    sweep's (see ``suite_cases``)."""
    if suite == "sweep":
        return sweep_count(quick, count)
    if per_dtype(suite):
        return len(suite_cases(suite, quick))
    if suite == "grouped":
        return len(grouped_cases(quick))
    if suite == "scaled":
        return len(scaled_cases(quick))
    if suite == "sgrouped":
        return len(sgrouped_cases(quick))
    if suite == "moe":
        return len(moe_cases(quick))
    if suite == "e2e":
        return 1
    if suite == "coldstart":
        return len(COLDSTART_RUNS)
    raise ValueError(f"unknown suite {suite!r}")


def per_dtype(suite: str) -> bool:
    """Whether a suite runs once per ``--dtypes`` entry (the others have fixed dtypes)."""
    return suite in MM_SUITES or suite in PLANNER_SUITES or suite == "latency"
