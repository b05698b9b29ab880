"""torch_triton_gemm: PyTorch matrix multiplications on readable Triton kernels.

Importing the package registers the operators under ``torch.ops.tgemm``, and their sharding
rules for DTensor operands (``sharding.py``) where ``torch.distributed`` is available.
"""

from .ops.graph_descriptors import prepare_capture
from .ops.grouped_mm import grouped_mm
from .ops.grouped_mm_list import grouped_mm_list
from .ops.mm import mm
from .ops.moe_mlp import moe_mlp
from .ops.scaled_grouped_mm import scaled_grouped_mm
from .ops.scaled_mm import scaled_mm
from .override import override
from .quantize import dequantize, quantize
from .warming import warmup

__all__ = ["dequantize", "grouped_mm", "grouped_mm_list", "mm", "moe_mlp", "override",
           "prepare_capture", "quantize", "scaled_grouped_mm", "scaled_mm", "warmup"]
__version__ = "0.1.0"
