import os

import torch

# Triton kernels run under the interpreter on CPU-only machines; set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
