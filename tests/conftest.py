import os

import torch

# Triton kernels run on a CPU only in the interpreter; set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
