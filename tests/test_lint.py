"""The code is laid out by ruff's formatter and passes ruff's linter, with the settings in
pyproject.toml (line length 110; pyflakes, pycodestyle and import order). Fix a failure with

    ruff format moekv_ref moekv_kernels tests conftest.py
    ruff check --fix moekv_ref moekv_kernels tests conftest.py

or let .pre-commit-config.yaml run both before each commit."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["moekv_ref", "moekv_kernels", "tests", "conftest.py"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ruff"] if shutil.which("ruff") is None else ["ruff"]
    return subprocess.run([*command, *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_finds_nothing():
    done = _ruff("check", "--output-format", "concise")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_would_change_nothing():
    done = _ruff("format", "--check")
    assert done.returncode == 0, "not formatted by ruff format:\n" + done.stdout + done.stderr
