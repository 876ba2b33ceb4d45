"""Test-session settings shared by tests/ and the notebooks nbval runs (their kernels inherit the
environment).

- `import moekv_ref` and `import kernels` work because `pip install -r requirements.txt` installs this
  repository as a package (editable): nothing here touches PYTHONPATH, so the notebooks are tested as
  a reader's `jupyter lab notebooks/` runs them.
- One intra-op thread: the models here are tiny, and on a shared 2-core machine OpenMP threads that
  spin-wait for a busy core made a 256-token forward 40x slower (0.15 s -> 6 s measured). Results do
  not depend on the thread count beyond float rounding, which every tolerance here covers.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
