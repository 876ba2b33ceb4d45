"""What every notebook sets before its first cell runs: `from moekv_ref.notebook import setup; setup()`.

One call, so that the notebooks cannot drift apart:

* torch runs on one thread. The notebooks time small operations (a decode step of a 2 M-parameter
  model, a serving run) on machines that are often shared (a classroom server, a laptop with a
  browser open). With several threads each tiny matrix product is split across cores that wait for
  each other, and the timings swing with whatever else runs; with one thread they are steadier, and
  on a small model faster.
* Processes the notebook starts (notebook 07's ranks) inherit OMP_NUM_THREADS=1 for the same reason.
* torch's global random generator is seeded, so that anything drawn without an explicit generator is
  the same on every run (the notebooks' stored outputs are checked by nbval).
* In a Jupyter kernel, matplotlib's inline backend is switched on now. matplotlib picks its backend
  only when pyplot first draws, and until then `display(fig)` of a figure made without pyplot (the
  widget figures, `moekv_ref.plots.serving.plot_run`) shows the text "<Figure size ...>" instead of
  the picture.
"""

from __future__ import annotations

import os

import torch

from .validation import MAX_INT32, check_int, check_seed

NUM_THREADS = 1
SEED = 0


def setup(seed: int = SEED, num_threads: int = NUM_THREADS) -> None:
    """Set torch's threads (and its children's) and seed for a notebook. Prints nothing: a notebook's
    stored output must not depend on the machine or the torch version."""
    num_threads = check_int("num_threads", num_threads, 1, MAX_INT32)
    seed = check_seed("seed", seed)
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for processes started from the notebook
    torch.manual_seed(seed)
    _inline_figures()


def _inline_figures() -> None:
    """`%matplotlib inline` when running in a Jupyter kernel (not in a terminal IPython or a script)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "kernel"):
        shell.run_line_magic("matplotlib", "inline")
