"""Suite-wide setup. Triton kernels run in the interpreter on CPU-only machines: the variable
must be set before any kernel module imports triton."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("ZEROSERVE_TEST_GPU") else "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP spin-waiting
# made the same forward passes ~20x slower; cluster tests also run several processes at once.
import torch  # noqa: E402

torch.set_num_threads(1)
