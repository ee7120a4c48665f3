"""Loaded by pytest before every other conftest. Without a GPU the Triton kernels run through
Triton's interpreter on CPU tensors, and the switch must be set before triton is first imported
(importing mini_engine imports it), so it lives here rather than in tests/kernels/."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
