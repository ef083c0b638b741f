"""Suite-wide setup. Triton kernels run in the interpreter on CPU-only machines: the variable
must be set before any kernel module imports triton."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("ZEROSERVE_TEST_GPU") else "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
