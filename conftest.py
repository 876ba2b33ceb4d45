"""Test-session settings shared by tests/ and the notebooks nbval runs (their kernels inherit the
environment).

- `import moekv_ref` and `import moekv_kernels` work because `pip install -r requirements.txt` installs this
  repository as a package (editable): nothing here touches PYTHONPATH, so the notebooks are tested as
  a reader's `jupyter lab` runs them.
- One intra-op thread: the models here are tiny, and on a shared 2-core machine OpenMP threads that
  spin-wait for a busy core made a 256-token forward 40x slower (0.15 s -> 6 s measured). Results do
  not depend on the thread count beyond float rounding, which every tolerance here covers.
- Where triton is not installed (it has wheels for Linux only), every test module and notebook that
  imports `moekv_kernels` or `triton` is skipped, with the reason in pytest's summary (`-rs`).
"""

import fnmatch
import os
import re
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from moekv_ref.backends import triton_available  # noqa: E402

torch.set_num_threads(1)

# `import moekv_kernels`, `from moekv_kernels.x import y`, `import triton` at the start of a line (a notebook's
# JSON source lines start with a quote)
_NEEDS_TRITON = re.compile(r'^[\s"]*(import|from)\s+(moekv_kernels|triton)\b', re.MULTILINE)


def _skip_reason(path: Path) -> str:
    return (
        f"{path.name} runs the Triton kernels, and triton is not installed "
        "(it has wheels for Linux x86_64/aarch64 only)"
    )


def needs_triton(path: Path) -> bool:
    """True when the test module or notebook at `path` imports the kernels or triton."""
    try:
        return bool(_NEEDS_TRITON.search(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError):
        return False


class _SkippedModule(pytest.Module):
    """A test module that is not imported, because importing it would fail without triton."""

    def collect(self):
        pytest.skip(_skip_reason(self.path))


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    if not triton_available() and needs_triton(module_path):
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    """Notebooks (nbval's items) skipped, cell by cell: those that import the kernels, without triton;
    and those the browser test runs in this session (it is collected only where Chromium and
    playwright are), because it compares their outputs with the stored ones as nbval does."""
    browser_runs = any(item.path.name == "test_browser.py" for item in items)
    chosen = os.environ.get("BROWSER_TEST_NOTEBOOKS", "*.ipynb")  # the browser test's choice
    no_triton = not triton_available()  # a search of sys.path: once
    for item in items:
        if item.path.suffix != ".ipynb":
            continue
        if no_triton and needs_triton(item.path):
            item.add_marker(pytest.mark.skip(reason=_skip_reason(item.path)))
        elif browser_runs and fnmatch.fnmatch(item.path.name, chosen):
            item.add_marker(
                pytest.mark.skip(
                    reason="tests/test_browser.py runs this notebook in JupyterLab "
                    "in this session and compares its outputs as nbval does"
                )
            )
