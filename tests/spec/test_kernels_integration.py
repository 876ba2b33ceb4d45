"""A model built on the Triton backend generates what the same weights generate on the torch backend.

The backend is chosen once, when the model is built: the experts' projections run on the grouped GEMM
kernel, and a paged cache made for the model (`PagedKVCache.for_model`) stores new K/V with
moekv_kernels.store_kv and attends decode rows (one new token) with moekv_kernels.paged_attention, one launch per
layer; rows with several new tokens (prefill) take the batched torch path. On a CPU that is Triton's
interpreter, so the cases are a few tokens of a small model.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from helpers import prefill_then_decode, random_model, random_prompts, small_config  # noqa: E402

import moekv_kernels  # noqa: E402
from moekv_ref.cache import BudgetedPagedKVCache, PagedKVCache  # noqa: E402
from moekv_ref.cache.budget import RowBudget  # noqa: E402
from moekv_ref.generate import generate  # noqa: E402
from moekv_ref.sampling import SamplingParams  # noqa: E402


def test_generate_triton_backend_gives_the_same_tokens(monkeypatch):
    launches = []
    original = moekv_kernels.paged_attention

    def counting_paged_attention(*args, **kwargs):
        launches.append(args[0].shape[0])  # rows in this launch
        return original(*args, **kwargs)

    gemm_launches = []
    original_gemm = moekv_kernels.expert_gemm

    def counting_expert_gemm(*args, **kwargs):
        gemm_launches.append(args[0].shape[0])  # (token, expert) pairs
        return original_gemm(*args, **kwargs)

    monkeypatch.setattr(moekv_kernels, "paged_attention", counting_paged_attention)
    monkeypatch.setattr(moekv_kernels, "expert_gemm", counting_expert_gemm)
    # threshold routing: tokens use 1 to 3 experts, so rows of one sequence have ragged lengths
    models = {
        backend: random_model(small_config(routing="threshold"), seed=3, dtype=torch.float32, backend=backend)
        for backend in ("torch", "triton")
    }
    config = models["torch"].config
    prompts = random_prompts([5, 1, 9], config.vocab_size, seed=4)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    # block_size 4: decode tiles of 16 tokens span several blocks of a row
    results = {}
    for backend, model in models.items():
        results[backend] = generate(
            model,
            prompts,
            params,
            cache="paged",
            record_logits=True,
            block_size=4,
            num_blocks=256,
            shuffle_seed=0,
        )
    assert results["triton"].tokens == results["torch"].tokens
    assert torch.equal(results["triton"].cache_counts, results["torch"].cache_counts)
    for torch_logits, triton_logits in zip(results["torch"].logits, results["triton"].logits):
        assert (torch_logits - triton_logits).abs().max() < 1e-4
    # one launch per layer and forward (all its experts' one-new-token rows at once): the prefill has
    # such rows too (the 1-token prompt), so 3 forwards x 2 layers
    assert len(launches) == 3 * config.num_hidden_layers
    # 3 forwards (prefill, 2 decode steps) x 2 layers x (2 attention projections: Q, K and V fused,
    # then O; and 3 FFN projections)
    assert len(gemm_launches) == 3 * config.num_hidden_layers * 5


def test_triton_backend_needs_a_kernel_dtype():
    model = random_model(small_config(), seed=0, dtype=torch.float64, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' runs float32, float16 or bfloat16 weights"):
        generate(model, [[1, 2]], SamplingParams(max_new_tokens=2), cache="contiguous")
    with pytest.raises(ValueError, match="backend='tpu' is not one of"):
        random_model(small_config(), seed=0, backend="tpu")


def test_unknown_attention_path_is_refused():
    model = random_model(small_config(), seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="attention='cuda' is not one of"):
        PagedKVCache.for_model(model, attention="cuda")


def test_the_interpreter_does_not_depend_on_import_order():
    """A library that imports triton before kernels does (transformers does) must not leave the
    kernels built for a GPU on a machine without one: the triton backend still gives torch's tokens.
    A fresh process, since this one imported kernels already."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels are compiled, not interpreted")
    program = (
        "import os, sys\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import triton\n"  # first, as another library would
        "from moekv_ref.checkpoint import load_default_model\n"
        "from moekv_ref.generate import generate\n"
        "from moekv_ref.sampling import SamplingParams\n"
        "params = SamplingParams(max_new_tokens=3, temperature=0)\n"
        "tokens = [generate(load_default_model(backend=b), [list(b'def ')], params, cache='paged').tokens\n"
        "          for b in ('torch', 'triton')]\n"
        "print(tokens[0] == tokens[1], tokens[1])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("True"), done.stdout


def test_a_budgeted_cache_attends_full_rows_on_the_kernel(monkeypatch):
    """Under a window budget of 3 the decode rows a wave places (each full, its newcomer in a victim's
    slot) go to moekv_kernels.paged_attention like any decode row: the logits equal the batched torch
    path's (float32, 1e-4), and the kernel ran."""
    model = random_model(small_config("expert"), seed=3, dtype=torch.float32)
    sequences = torch.tensor(random_prompts([10, 10], model.config.vocab_size, seed=1))
    launches = []
    original = moekv_kernels.paged_attention

    def counting(*args, **kwargs):
        launches.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(moekv_kernels, "paged_attention", counting)
    with torch.inference_mode():
        logits = {
            attention: prefill_then_decode(
                model,
                BudgetedPagedKVCache.for_model(
                    model, block_size=2, attention=attention, budget=RowBudget(3, "window", num_sinks=1)
                ),
                sequences,
                prefill=4,
            )
            for attention in ("batched", "triton")
        }
    assert launches
    assert (logits["triton"] - logits["batched"]).abs().max() <= 1e-4
