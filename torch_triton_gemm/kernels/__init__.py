"""Triton kernels only: ``@triton.jit`` functions, no torch code."""
