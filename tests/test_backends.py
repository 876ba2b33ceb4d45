"""Without triton (macOS and Windows, where it has no wheels) the "triton" backend refuses with an
error that says what to do, and the kernels' tests and notebook are skipped with the reason instead
of failing to import. Here triton is hidden by `sys.modules["triton"] = None`, which makes both
`import triton` and importlib.util.find_spec("triton") behave as if it were not installed."""

import subprocess
import sys
from pathlib import Path

import pytest

from moekv_ref.apps import cli
from moekv_ref.backends import BackendUnavailableError, require_backend, triton_available

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    assert not triton_available()


def test_require_triton_without_triton(no_triton):
    with pytest.raises(BackendUnavailableError, match="Linux x86_64/aarch64 only.*use --backend torch"):
        require_backend("triton")
    require_backend("torch")


def test_require_triton_with_triton():
    pytest.importorskip("triton")
    assert triton_available()
    require_backend("triton")


def test_cli_backend_triton_refuses_without_triton(no_triton, capsys):
    code = cli.main(
        ["generate", "--prompt", "def ", "--cache", "paged", "--backend", "triton", "--max-new-tokens", "2"]
    )
    assert code == 2
    assert "the 'triton' backend needs the triton package" in capsys.readouterr().err


def test_kernel_tests_and_notebook_skip_without_triton():
    """conftest.py skips, by reading their sources, the modules and notebooks that import the kernels."""
    script = (
        "import sys; sys.modules['triton'] = None; import pytest; "
        "sys.exit(pytest.main(['-o', 'addopts=', '-p', 'no:cacheprovider', '--nbval', '--nbval-current-env', "
        "'-rs', '-q', 'tests/spec/test_kernels.py', 'tests/spec/test_kernels_integration.py', "
        "'notebooks/08_kernels.ipynb']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "skipped" in summary
        and "passed" not in summary
        and "failed" not in summary
        and "error" not in summary
    ), summary
    assert "triton is not installed" in done.stdout
    for name in ("test_kernels.py", "test_kernels_integration.py", "08_kernels.ipynb"):
        assert name in done.stdout, done.stdout[-3000:]
