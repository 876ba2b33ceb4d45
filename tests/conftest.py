import os
from pathlib import Path

import torch

# Triton kernels run on a CPU only in the interpreter; set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest.ini runs the suite on every core (pytest-xdist, one test module or notebook per worker):
# each worker's torch takes its share of the cores instead of all of them, so that workers do not
# oversubscribe the machine.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini) runs the suite on every core, but a run naming test files only runs
    here, in this process: starting workers would take longer than the tests (`python -m pytest
    tests/spec/test_routing.py`: 2 s instead of 12). None: pytest-xdist's own count, one per core."""
    if config.args and all(Path(arg.split("::")[0]).is_file() for arg in config.args):
        return 0
    return None


# The longest module first, so that a worker starts it at once instead of it running alone at the end.
FIRST = ("tests/test_browser.py",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # a stable sort: otherwise in order


def pytest_terminal_summary(terminalreporter):
    """The browser test's table per notebook (tests/test_browser.py), at the end of the run."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", []):
            if name == "browser_table" and report.when == "call":
                terminalreporter.write_sep("-", "notebooks in JupyterLab (runs/browser/)")
                terminalreporter.write_line(value)
