"""Triton kernels beside their PyTorch references.

Each file reads like a Triton tutorial, top to bottom: what it computes, the @triton.jit kernel with
a comment per argument, a thin launcher with asserts, the plain-PyTorch reference it must equal, and
a check against the reference under `if __name__ == "__main__"` (`python -m moekv_kernels.paged_attention`).
The benchmark is a program over the kernels (`python -m moekv_kernels.bench`); no kernel imports it.

    paged_attention.py          decode attention over the paged per-expert cache: one query per
                                row (sequence, layer, expert), online softmax in float32, both
                                products on tl.dot (tensor cores) to keep registers low
    paged_attention_split_k.py  the same, split along tokens (flash-decoding) plus its reduction,
                                for few rows with long contexts
    store_kv.py                 new tokens' K/V into their slots (slot_mapping)
    expert_gemm.py              grouped GEMM: tokens sorted by expert times each expert's weight
    report.py                   what each kernel asks of a GPU, compiled for sm_90 / sm_80 without one:
                                registers, spills, shared memory, occupancy, tensor-core
                                instructions, and the bandwidth bound (python -m moekv_kernels.report)
    bench.py                    GPU benchmark: time against the references and the bandwidth bound,
                                bandwidth against a device copy, TFLOP/s against torch.matmul; JSON

The memory layout they share is the paged cache's (moekv_ref/cache/paged.py): one pool per K and V,
(num_blocks, P, Hkv, Dh), for all layers and experts; block_tables (rows, max_blocks_per_row) int32;
context_lens (rows,) int32 >= 0 (a row of length 0 gets zeros); slot = block_id * P + offset.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here when no GPU is
visible; if another library imported triton first, triton is imported again under the flag). Three
rules keep what passes there compiling on a GPU:
tiles of 16 or more for tl.dot, no autotune (it needs a GPU; bench.py sweeps tile sizes instead),
and no bfloat16 arithmetic in the interpreter (kernels convert tiles to float32; stores of new K/V
are pure copies, converted by torch beforehand). What the interpreter cannot show, a GPU's limits, is
checked by compiling for sm_90 and sm_80 with the ptxas Triton ships (report.py,
tests/test_kernels_static.py): no compile error, no spilled register.

The model uses them when its backend is "triton"; "torch" (the readable path) is the default.
"""

import os
import sys

import torch


def _choose_the_interpreter() -> None:
    """Without a GPU, run the kernels in Triton's interpreter, whatever was imported first.

    Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, and its language's
    own jit functions (tl.sum, tl.max, ...) are decorated when triton is first imported. A library
    imported earlier (transformers imports triton) leaves them built for a GPU, and an interpreted
    kernel that calls them fails. Then triton's Python modules are imported afresh, now under the
    interpreter (its compiled extension, triton._C, is kept: it does not depend on the flag)."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1" or "triton" not in sys.modules:
        return
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.sum, InterpretedFunction):
        return  # imported under the interpreter already
    for name in [n for n in sys.modules if n.split(".")[0] == "triton" and not n.startswith("triton._C")]:
        del sys.modules[name]


_choose_the_interpreter()

from .expert_gemm import expert_gemm, expert_gemm_reference  # noqa: E402
from .paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from .paged_attention_split_k import paged_attention_split_k  # noqa: E402
from .store_kv import store_kv, store_kv_reference  # noqa: E402

__all__ = [
    "expert_gemm",
    "expert_gemm_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_split_k",
    "store_kv",
    "store_kv_reference",
]
