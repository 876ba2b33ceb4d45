"""moekv_ref.notebook.setup: the one call every notebook's first cell makes (threads, seed)."""

import json
import os
from pathlib import Path

import pytest
import torch

from moekv_ref.notebook import setup

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def restore_torch_state():
    threads, rng, omp = torch.get_num_threads(), torch.get_rng_state(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def test_setup_sets_one_thread_for_torch_and_child_processes_and_seeds(restore_torch_state):
    torch.set_num_threads(2)
    setup()
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    first = torch.rand(3)
    setup()
    assert torch.equal(torch.rand(3), first)  # seeded again: the same draw


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_setup_refuses_a_bad_thread_count_before_changing_anything(restore_torch_state, bad):
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="num_threads"):
        setup(num_threads=bad)
    assert torch.get_num_threads() == 2


def test_notebooks_call_setup_in_their_first_code_cell_and_set_no_threads_themselves():
    """Every notebook leaves thread and seed settings to setup()."""
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        first = "".join(cells[0]["source"])
        assert "setup()" in first and "moekv_ref.notebook import setup" in first, path.name
        every = "".join("".join(c["source"]) for c in cells)
        assert "set_num_threads" not in every, path.name


def test_setup_switches_on_inline_figures_in_a_kernel_only(restore_torch_state, monkeypatch):
    """In a Jupyter kernel setup() runs %matplotlib inline (so that display(fig) of a figure made
    without pyplot shows a picture); outside one (get_ipython() None, or a terminal shell) it does not."""
    import IPython

    class Shell:
        def __init__(self, kernel):
            if kernel:
                self.kernel = object()
            self.magics = []

        def run_line_magic(self, name, line):
            self.magics.append((name, line))

    for in_kernel, expected in ((True, [("matplotlib", "inline")]), (False, [])):
        shell = Shell(in_kernel)
        monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
        setup()
        assert shell.magics == expected
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    setup()  # a plain script: nothing to switch on, no error
