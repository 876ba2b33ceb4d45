"""Test-session settings shared by tests/ and the notebooks nbval runs (their kernels inherit the
environment).

- The notebooks run in kernels whose working directory is notebooks/: put the repository root on
  PYTHONPATH so that `import moekv_ref` and `import kernels` work there as they do in tests/.
- One intra-op thread: the models here are tiny, and on a shared 2-core machine OpenMP threads that
  spin-wait for a busy core made a 256-token forward 40x slower (0.15 s -> 6 s measured). Results do
  not depend on the thread count beyond float rounding, which every tolerance here covers.
"""

import os
from pathlib import Path

ROOT = str(Path(__file__).parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
