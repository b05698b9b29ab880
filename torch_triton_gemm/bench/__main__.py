"""``python -m torch_triton_gemm.bench``: see ``--help``."""

import sys

from .cli import main

sys.exit(main())
