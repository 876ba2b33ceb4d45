import os

import torch

# Triton kernels run on a CPU only in the interpreter; set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter):
    """The browser test's table per notebook (tests/test_browser.py), at the end of the run."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", []):
            if name == "browser_table" and report.when == "call":
                terminalreporter.write_sep("-", "notebooks in JupyterLab (runs/browser/)")
                terminalreporter.write_line(value)
