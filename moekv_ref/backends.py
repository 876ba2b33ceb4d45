"""Which compute backends this machine can run: "torch" everywhere, "triton" only where the triton
package is installed.

triton 3.7.1 (pinned in requirements-deps.txt) has wheels for Linux x86_64 and aarch64 only, so
macOS and Windows run everything but the Triton kernels on the CPU build of torch. Whatever selects
the "triton" backend calls `require_triton()` first: the user reads what to do, not a
ModuleNotFoundError from deep inside a forward pass.
"""

from __future__ import annotations

import importlib.util


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine (its package is not installed)."""


def triton_available() -> bool:
    """True when the triton package can be imported here (without importing it: importing triton
    before TRITON_INTERPRET is set would fix the interpreter choice too early)."""
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    """Raise BackendUnavailableError (a RuntimeError) with what to do instead when triton is missing."""
    if not triton_available():
        raise BackendUnavailableError("the 'triton' backend needs the triton package, which has "
                                      "wheels for Linux x86_64/aarch64 only; on this machine use "
                                      "--backend torch")


def require_backend(backend: str) -> None:
    """Check that `backend` can run here (require_triton for "triton")."""
    if backend == "triton":
        require_triton()
