"""Compiling kernels for fixed GPU targets on a GPU-less host, for the tests that check what
Triton emits for Hopper (wgmma, TMA, warp specialization) without a GPU. Imported by scripts
that run without Triton's interpreter (``test_mm._run_without_interpreter``)."""

from __future__ import annotations

import inspect
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for(kernel: Any, pointers: dict[str, str], constants: dict[str, Any],
                aligned: list[str] = (), arch: int = 90, **options: Any) -> Any:
    """``kernel`` compiled for ``sm_<arch>``: arguments in ``constants`` are constexprs, those
    in ``pointers`` pointers of the given Triton type, the rest 32-bit integers; ``aligned``
    ones are marked 16-divisible, as a launch on aligned tensors specialises them. Gluon
    kernels compile from their own source type. ``options``: num_warps, num_stages."""
    # Constexprs left out take their defaults, as a launch that does not pass them would.
    constants = {**{p.name: p.default for p in kernel.params
                    if p.is_constexpr and p.default is not inspect.Parameter.empty},
                 **constants}
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                 for name in kernel.arg_names}
    index = kernel.arg_names.index
    source_type = ASTSource
    if type(kernel).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(
        fn=kernel, signature=signature,
        constexprs={(index(k),): v for k, v in constants.items()},
        attrs={(index(k),): [["tt.divisibility", 16]] for k in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
