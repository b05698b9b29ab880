"""``torch_triton_gemm.warmup``: compile the GEMM kernels a model or a list of shapes needs, in
parallel, before the first step; and its command line, ``python -m torch_triton_gemm.warmup``
(the module ``warmup.py`` runs ``main``).

Each product is planned and its launches worked out as a real call's (ops/compile_ahead.py:
the planner's ``plan_mm``, the launcher's ``prepare_launch``), forward and backward, and every
kernel variant they launch is compiled on the compile pool (ops/compile_pool.py) into Triton's
caches: in memory, so that this process's calls launch at once, and on disk
(``TRITON_CACHE_DIR``), so that later processes load instead of compiling. Under Triton's
interpreter (CPU) there is nothing to compile: the products are planned all the same.
"""

from __future__ import annotations

import argparse
import logging
import operator
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, as_completed
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from .kernels.tiles import ACTIVATIONS
from .ops import compile_ahead
from .ops.checks import OUT_DTYPES
from .ops.compile_ahead import GemmSpec, OperandSpec
from .ops.mm import INPUT_DTYPES

LOG = logging.getLogger("torch_triton_gemm")

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
          "float32": torch.float32, "fp8": torch.float8_e4m3fn,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


class WarmupResult(NamedTuple):
    """What ``warmup`` did: the products planned (forward and backward, distinct), the kernel
    variants they launch (distinct), those compiled by this call (0 where nothing compiles:
    CPU, the interpreter, or all compiled before), the seconds it took, and the variants whose
    compilation failed (their calls will raise the error when launched)."""
    products: int
    variants: int
    compiled: int
    seconds: float
    failures: tuple[str, ...] = ()


# --- what to compile ----------------------------------------------------------------------------

Shape = tuple[int, int, int] | Mapping[str, Any]


def shape_specs(shapes: Iterable[Shape], dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str | None = None, layout: str = "nt"
                ) -> list[GemmSpec]:
    """The products of a shape list: (M, N, K) tuples, or dicts with "M", "N", "K" and
    optionally "dtype", "layout" ("nt": x @ W.t() as nn.Linear, "nn", "tn", "tt"), "bias"
    (bool), "activation", "out_dtype" and "device", the keyword arguments' values otherwise."""
    device = _default_device(device)
    specs = []
    for shape in shapes:
        if isinstance(shape, Mapping):
            unknown = set(shape) - {"M", "N", "K", "dtype", "layout", "bias", "activation",
                                    "out_dtype", "device"}
            missing = {"M", "N", "K"} - set(shape)
            if unknown:
                raise ValueError(f"warmup: unknown shape keys {sorted(unknown)} in "
                                 f"{dict(shape)}")
            if missing:
                raise ValueError(f"warmup: shape {dict(shape)} has no "
                                 f"{', '.join(sorted(missing))}")
            activation = shape.get("activation", "none")
            if activation not in ACTIVATIONS:
                raise ValueError(f"warmup: unknown activation {activation!r}; choose one of "
                                 f"{ACTIVATIONS}")
            out_dtype = _dtype(shape.get("out_dtype"))
            if out_dtype is not None and out_dtype not in OUT_DTYPES:
                raise ValueError(f"warmup: out_dtype {out_dtype} is not one of {OUT_DTYPES}")
            specs.append(compile_ahead.linear_spec(
                *(_size(shape[name], name) for name in "MNK"),
                _input_dtype(shape.get("dtype", dtype)),
                _default_device(shape["device"]) if "device" in shape else device,
                shape.get("layout", layout), bool(shape.get("bias", False)), activation,
                out_dtype))
        else:
            try:
                M, N, K = shape
            except (TypeError, ValueError):
                raise ValueError(f"warmup: a shape is an (M, N, K) tuple or a dict with M, N "
                                 f"and K, got {shape!r} (for one product pass a list: "
                                 f"[(M, N, K)])") from None
            specs.append(compile_ahead.linear_spec(
                _size(M, "M"), _size(N, "N"), _size(K, "K"), _input_dtype(dtype), device,
                layout))
    return specs


def _size(value: Any, what: str) -> int:
    """A product's size: a whole number, 0 or more (also written as 4096.0 or "4096", as
    computed or configuration files give them)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool):
        raise ValueError(f"warmup: {what} must be a whole number, got {value!r}")
    try:
        size = operator.index(value)
    except TypeError:
        raise ValueError(f"warmup: {what} must be a whole number, got {value!r}") from None
    if size < 0:
        raise ValueError(f"warmup: {what} must be 0 or more, got {size}")
    return size


def _input_dtype(value: torch.dtype | str) -> torch.dtype:
    dtype = _dtype(value)
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"warmup: tgemm::mm takes {INPUT_DTYPES} operands, not {dtype}")
    return dtype


def model_specs(model: torch.nn.Module, tokens: int | Iterable[int] | None = None,
                example_input: Any = None) -> list[GemmSpec]:
    """The products of a model's forward: with ``example_input``, those one forward (run
    under ``torch.no_grad`` on PyTorch's kernels) passes to ``F.linear``, ``torch.mm``,
    ``torch.addmm`` and 2-D ``torch.matmul`` / ``@``; else, for each ``nn.Linear`` and each of
    ``tokens`` (M: rows of the flattened input), x @ W.t() in the weight's dtype."""
    if example_input is not None:
        recorder = _Recorder()
        inputs = example_input if isinstance(example_input, tuple) else (example_input,)
        with torch.no_grad(), recorder:
            model(*inputs)
        return recorder.specs
    if tokens is None:
        raise ValueError("warmup: a model needs tokens= (rows of its inputs, batch x sequence) "
                         "or example_input= (one forward is run to record its products)")
    try:
        counts = [_size(tokens, "tokens")] if not isinstance(tokens, Iterable) else [
            _size(count, "tokens") for count in tokens]
    except ValueError:
        raise ValueError(f"warmup: tokens must be a whole number of rows or a list of them, "
                         f"0 or more, got {tokens!r}") from None
    specs = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            for M in counts:
                specs.append(compile_ahead.linear_spec(
                    M, module.out_features, module.in_features, weight.dtype, weight.device,
                    "nt", module.bias is not None))
    return specs


class _Recorder(TorchFunctionMode):
    """Records the 2-D products of a forward (inputs folded to 2-D as the override does),
    running every call on PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[GemmSpec] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        try:
            self._record(func, args, kwargs)
        except (TypeError, IndexError, ValueError, AttributeError):
            pass  # a form the recorder does not know: nothing recorded, the call still runs
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 1 and weight.dim() == 2:
                self._add(x.reshape(-1, x.shape[-1]), weight.t(), bias)
        elif func in (torch.mm, torch.Tensor.mm):
            self._add(args[0], args[1], None)
        elif func in (torch.addmm, torch.Tensor.addmm):
            self._add(args[1], args[2], args[0] if args[0].dim() == 1 else None)
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            x, y = args[0], args[1]
            if x.dim() >= 2 and y.dim() == 2:
                self._add(x.reshape(-1, x.shape[-1]), y, None)

    def _add(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
        if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype:
            return
        self.specs.append(GemmSpec(OperandSpec.of(a), OperandSpec.of(b),
                                   None if bias is None else OperandSpec.of(bias)))


def all_specs(forward: Iterable[GemmSpec], backward: bool = True) -> list[GemmSpec]:
    """``forward`` and, with ``backward``, the products of their backward (fp8 products have
    none), without repeats, in order."""
    seen: dict[Any, GemmSpec] = {}
    for spec in forward:
        found = [spec]
        if backward and spec.a.dtype.itemsize > 1:
            found += compile_ahead.backward_specs(spec)
        for product in found:
            seen.setdefault(_spec_key(product), product)
    return list(seen.values())


def _spec_key(spec: GemmSpec) -> tuple[Any, ...]:
    def operand(t: OperandSpec | None) -> Any:
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.aligned)

    return (operand(spec.a), operand(spec.b), operand(spec.bias), spec.activation,
            spec.out_dtype or compile_ahead.default_out_dtype(spec.a.dtype))


# --- compiling ----------------------------------------------------------------------------------

def warmup(model_or_shapes: torch.nn.Module | Iterable[Shape], *,
           tokens: int | Iterable[int] | None = None, example_input: Any = None,
           dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str | None = None,
           layout: str = "nt", backward: bool = True, progress: bool = True) -> WarmupResult:
    """Compile, in parallel, the Triton kernels that a model's or a shape list's GEMMs will run
    on tgemm::mm (through the planner and launcher of real calls), forward and backward, and
    wait for them.

    Args:
        model_or_shapes: an ``nn.Module`` (its ``nn.Linear`` layers with ``tokens``, or the
            products one forward on ``example_input`` records), or a list of (M, N, K) tuples
            or dicts (see ``shape_specs``): out = a @ b with a [M, K] and b [K, N].
        tokens: for a model, the rows M its linear layers see (batch x sequence), one or more.
        example_input: for a model, an input (a tuple for several) to run one forward on,
            under ``torch.no_grad`` with PyTorch's kernels, recording its products.
        dtype, device, layout: for shape tuples (dicts may set their own): operand dtype
            (also "bf16", "fp16", "fp32"), device (default: CUDA if available), layout ("nt":
            x @ W.t() as nn.Linear; "nn", "tn", "tt": "t" for a transposed operand).
        backward: also the products of the backward pass (grad_a = grad @ b.T, grad_b =
            a.T @ grad, in the layouts tgemm's autograd uses).
        progress: a progress bar (tqdm if installed, else a line on stderr).

    Returns:
        A ``WarmupResult``. Kernels are compiled into this process's Triton caches (calls then
        launch without compiling) and Triton's on-disk cache. Tuning on first use
        (TORCH_TRITON_GEMM_AUTOTUNE=1) chooses plans by timing real calls: ``warmup`` compiles
        the tuned table's or the heuristic's plans.

    Example:
        >>> import torch_triton_gemm as tg
        >>> tg.warmup(model, tokens=8 * 1024)               # every nn.Linear, M = 8192
        >>> tg.warmup([(4096, 4096, 4096), {"M": 16, "N": 4096, "K": 4096, "layout": "nn"}])
    """
    start = time.perf_counter()
    if isinstance(model_or_shapes, torch.nn.Module):
        forward = model_specs(model_or_shapes, tokens, example_input)
    else:
        forward = shape_specs(model_or_shapes, _dtype(dtype), device, layout)
    specs = all_specs(forward, backward)
    found: dict[Any, compile_ahead.Variant] = {}
    for spec in specs:
        for variant in compile_ahead.variants(spec):
            found.setdefault(variant.key(), variant)
    to_compile = [v for v in found.values() if v.device >= 0]
    pending = [v for v in to_compile if _not_built(v)]
    futures = compile_ahead.submit(pending)
    failures = _wait(futures, pending, progress)
    if failures:
        LOG.warning("torch_triton_gemm.warmup: %d kernel variants failed to compile; their "
                    "calls will raise when launched: %s", len(failures), "; ".join(failures))
    return WarmupResult(len(specs), len(found), len(pending) - len(failures),
                        time.perf_counter() - start, tuple(failures))


def _not_built(variant: compile_ahead.Variant) -> bool:
    """Whether the pool has not built ``variant`` yet (Triton's own cache may hold it: its
    compilation is then a lookup)."""
    future = compile_ahead.POOL.future(variant.key())
    return future is None or not future.done() or future.exception() is not None


def _wait(futures: Sequence[Future], found: Sequence[compile_ahead.Variant],
          progress: bool) -> list[str]:
    """Wait for ``futures`` (of ``found``), showing progress; the failures, described."""
    index = {id(f): i for i, f in enumerate(futures)}
    failures = []
    bar = _progress(len(futures)) if progress and futures else None
    for future in as_completed(futures):
        error = future.exception()
        if error is not None:
            variant = found[index[id(future)]]
            name = getattr(variant.kernel, "__name__", repr(variant.kernel))
            failures.append(f"{name} {dict(variant.meta)}: {type(error).__name__}: {error}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return failures


class _Line:
    """A progress line on stderr, where tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self._show()

    def _show(self) -> None:
        print(f"\rtorch_triton_gemm.warmup: compiled {self.done}/{self.total} kernels "
              f"({time.perf_counter() - self.start:.1f} s)", end="", file=sys.stderr, flush=True)

    def update(self, n: int) -> None:
        self.done += n
        self._show()

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _Line(total)
    return tqdm(total=total, desc="torch_triton_gemm.warmup", unit="kernel")


def _default_device(device: torch.device | str | None) -> torch.device:
    """The device to warm up for: by default CUDA where there is a GPU, else the CPU; a named
    one must be a device tgemm runs on that exists here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"warmup: {device!r} is not a device ({error})") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"warmup: {chosen} is not available: this process sees no CUDA "
                               "GPU")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise ValueError(f"warmup: {chosen} does not exist: this process sees "
                             f"{torch.cuda.device_count()} CUDA devices")
    elif chosen.type != "cpu":
        raise ValueError(f"warmup: tgemm runs on CUDA devices (and on the CPU under Triton's "
                         f"interpreter), not {chosen}")
    return chosen


def _dtype(value: torch.dtype | str | None) -> Any:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return DTYPES[value]
    except KeyError:
        raise ValueError(f"warmup: unknown dtype {value!r}; choose one of {sorted(DTYPES)}"
                         ) from None


# --- command line -------------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"4096x4096x4096,8192x1024x1024" -> [(M, N, K), ...]."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxNxK")
        shapes.append(tuple(int(p) for p in parts))
    return shapes  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_triton_gemm.warmup",
        description="Compile tgemm's Triton kernels for GEMM shapes ahead of time, in parallel, "
                    "into Triton's on-disk cache (TRITON_CACHE_DIR): later processes that run "
                    "these shapes load their kernels instead of compiling them.")
    parser.add_argument("--shapes", required=True, type=parse_shapes,
                        help="comma-separated MxNxK products, out[M, N] = a[M, K] @ b[K, N]; "
                             "for nn.Linear: M = tokens, N = out_features, K = in_features")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--layout", default="nt", choices=("nt", "nn", "tn", "tt"),
                        help="operand layouts, 't' for transposed: nt is x @ W.t() "
                             "(nn.Linear; default)")
    parser.add_argument("--bias", action="store_true", help="products with a bias")
    parser.add_argument("--no-backward", action="store_true",
                        help="forward products only (inference)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    shapes = [{"M": M, "N": N, "K": K, "bias": args.bias} for M, N, K in args.shapes]
    try:
        _default_device(args.device)
        result = warmup(shapes, dtype=args.dtype, device=args.device, layout=args.layout,
                        backward=not args.no_backward, progress=not args.quiet)
    except ValueError as error:
        parser.error(str(error))
    except RuntimeError as error:  # the device's checks only: others are not usage errors
        if not str(error).startswith("warmup:"):
            raise
        parser.error(str(error))
    device = _default_device(args.device)
    print(f"torch_triton_gemm.warmup: {result.products} products, {result.variants} kernel "
          f"variants, {result.compiled} compiled in {result.seconds:.1f} s on {device}"
          + ("" if compile_ahead.compiles(device) else " (nothing compiles there: planned only)"))
    for failure in result.failures:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if result.failures else 0
