"""torch_triton_gemm: PyTorch matrix multiplications on readable Triton kernels.

Importing the package registers the operators under ``torch.ops.tgemm``.
"""

from .ops.mm import mm
from .override import override

__all__ = ["mm", "override"]
__version__ = "0.1.0"
