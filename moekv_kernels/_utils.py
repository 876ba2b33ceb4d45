"""Small helpers shared by the kernel files: interpreter detection, the error measure of the tests,
and the description of a launch that the launchers run and moekv_kernels/report.py compiles."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


def is_interpreting() -> bool:
    """True when Triton runs kernels in its NumPy interpreter (TRITON_INTERPRET=1, the CPU path).

    The interpreter differs from a GPU in two ways the launchers care about: it has no bfloat16
    arithmetic (products and conversions of bf16 are wrong there), and it cannot autotune.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_describing_only = False


@contextmanager
def describing_launches():
    """Within this block launchers' descriptions (Launch) may be built from small CPU tensors without
    the interpreter: moekv_kernels/report.py does so to compile them for a GPU, and never runs them."""
    global _describing_only
    _describing_only = True
    try:
        yield
    finally:
        _describing_only = False


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors in the interpreter; never on a mix."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not is_interpreting() and not _describing_only:
        raise RuntimeError(
            "Triton kernels need CUDA tensors; on a CPU set TRITON_INTERPRET=1 before importing triton"
        )


def max_relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| / max |reference|, in float64.

    Relative to the largest reference value rather than element by element: an output element
    near zero would otherwise turn a rounding error of the last bit into an arbitrarily large ratio.
    """
    out, reference = out.double(), reference.double()
    scale = reference.abs().max().clamp_min(1e-30)
    return float((out - reference).abs().max() / scale)


@dataclass
class Launch:
    """One kernel launch, described before it runs: the @triton.jit kernel, its grid, its arguments
    and its compile-time parameters (constexprs and num_warps / num_stages).

    The launchers build these and run them; moekv_kernels/report.py compiles the very same description for
    a named GPU (sm_80, sm_90) without running it, so what the report measures is what a launch runs.
    """

    kernel: Any
    grid: tuple
    args: tuple
    meta: dict = field(default_factory=dict)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)
