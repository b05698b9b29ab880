"""How a tgemm op is registered with torch.library."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._library.custom_ops import CustomOpDef

from .. import device as _device


def define_triton_op(name: str, impl: Callable[..., torch.Tensor],
                     fake: Callable[..., torch.Tensor]) -> CustomOpDef:
    """Register ``impl`` (checks, allocation, ``wrap_triton`` launches) as the op ``name``.

    With compiled Triton this is a ``torch.library.triton_op``: its body is make_fx-traceable, so
    it serves as its own fake implementation and torch.compile sees the kernels inside it.
    Under Triton's CPU interpreter the kernels are plain Python that ``wrap_triton`` cannot trace,
    so the op is an opaque ``custom_op`` whose fake is ``fake`` (the same checks and allocation,
    no launch).
    """
    if _device.interpreter_enabled():
        op = torch.library.custom_op(name, impl, mutates_args=())
        op.register_fake(fake)
        return op
    return torch.library.triton_op(name, impl, mutates_args=())
