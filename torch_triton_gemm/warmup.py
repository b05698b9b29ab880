"""The command line of ``torch_triton_gemm.warmup`` (see warming.py):

    python -m torch_triton_gemm.warmup --shapes 8192x1024x1024,8192x2752x1024 --dtype bf16

``--help`` lists the options. The package's ``warmup`` is the function, not this module.
"""

import sys

from torch_triton_gemm.warming import main

if __name__ == "__main__":
    sys.exit(main())
