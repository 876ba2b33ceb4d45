"""Small helpers shared by the kernel files: interpreter detection and the error measure of the tests."""

from __future__ import annotations

import os

import torch


def is_interpreting() -> bool:
    """True when Triton runs kernels in its NumPy interpreter (TRITON_INTERPRET=1, the CPU path).

    The interpreter differs from a GPU in two ways the launchers care about: it has no bfloat16
    arithmetic (products and conversions of bf16 are wrong there), and it cannot autotune.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors in the interpreter; never on a mix."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not is_interpreting():
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
