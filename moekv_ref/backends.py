"""Which compute backends this machine can run: "torch" everywhere, "triton" where the triton
package is installed (3.7.1, pinned in requirements-deps.txt, has wheels for Linux only). Whatever
selects "triton" calls `require_backend` first: the user reads what to do, not a
ModuleNotFoundError from deep inside a forward pass.
"""

from __future__ import annotations

import importlib.util

from .validation import check_choice

BACKENDS = ("torch", "triton")  # what a model computes with


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine (its package is not installed)."""


def triton_available() -> bool:
    """True when the triton package can be imported here (without importing it: importing triton
    before TRITON_INTERPRET is set would fix the interpreter choice too early)."""
    return importlib.util.find_spec("triton") is not None


def require_backend(backend: str) -> None:
    """ValueError for a name not in BACKENDS; BackendUnavailableError for one this machine cannot run."""
    check_choice("backend", backend, BACKENDS)
    if backend == "triton" and not triton_available():
        raise BackendUnavailableError(
            "the 'triton' backend needs the triton package, which has wheels for "
            "Linux x86_64/aarch64 only; on this machine use --backend torch"
        )
