"""The model on the Triton backend generates what it generates on the torch backend.

`PagedKVCache(backend="triton")` runs decode steps (one new token per row) on kernels.store_kv and
kernels.paged_attention; prefill stays on the torch gather. On a CPU that is Triton's interpreter,
so the cases are a few tokens of a small model.
"""

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from moekv_ref.cache import PagedKVCache  # noqa: E402
from moekv_ref.generate import generate  # noqa: E402
from moekv_ref.sampling import SamplingParams  # noqa: E402

from helpers import random_model, random_prompts, small_config  # noqa: E402


def test_generate_triton_backend_gives_the_same_tokens(monkeypatch):
    launches = []
    original = kernels.paged_attention

    def counting_paged_attention(*args, **kwargs):
        launches.append(args[0].shape[0])                               # rows in this launch
        return original(*args, **kwargs)

    gemm_launches = []
    original_gemm = kernels.expert_gemm

    def counting_expert_gemm(*args, **kwargs):
        gemm_launches.append(args[0].shape[0])                          # (token, expert) pairs
        return original_gemm(*args, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention", counting_paged_attention)
    monkeypatch.setattr(kernels, "expert_gemm", counting_expert_gemm)
    # threshold routing: tokens use 1 to 3 experts, so rows of one sequence have ragged lengths
    model = random_model(small_config(routing="threshold"), seed=3, dtype=torch.float32)
    prompts = random_prompts([5, 1, 9], model.config.vocab_size, seed=4)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    # block_size 4: decode tiles of 16 tokens span several blocks of a row
    results = {}
    for backend in ("torch", "triton"):
        model.set_backend(backend)       # the experts' projections: torch matmuls or the grouped GEMM
        results[backend] = generate(model, prompts, params, cache="paged", record_logits=True,
                                    block_size=4, num_blocks=256, shuffle_seed=0, backend=backend)
    assert results["triton"].tokens == results["torch"].tokens
    assert torch.equal(results["triton"].cache_counts, results["torch"].cache_counts)
    for torch_logits, triton_logits in zip(results["torch"].logits, results["triton"].logits):
        assert (torch_logits - triton_logits).abs().max() < 1e-4
    # 2 decode steps x 2 layers, one launch per (layer, expert) that received tokens
    assert len(launches) >= 2 * model.config.num_hidden_layers
    # 3 forwards (prefill, 2 decode steps) x 2 layers x (4 attention + 3 FFN projections)
    assert len(gemm_launches) == 3 * model.config.num_hidden_layers * 7


def test_triton_backend_needs_a_kernel_dtype():
    model = random_model(small_config(), seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='triton' runs float32, float16 or bfloat16 weights"):
        model.set_backend("triton")
    with pytest.raises(ValueError, match="backend='tpu' is not one of"):
        model.set_backend("tpu")


def test_unknown_backend_is_refused():
    model = random_model(small_config(), seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        PagedKVCache.for_model(model, backend="cuda")


def test_cli_triton_backend_gives_the_torch_tokens(capsys):
    """`generate --backend triton --cache paged --json` (through the serving engine) = `--backend torch`."""
    import json

    from moekv_ref.__main__ import main

    tokens = {}
    for backend in ("torch", "triton"):
        assert main(["generate", "--prompt", "def ", "--max-new-tokens", "6", "--greedy", "--json",
                     "--cache", "paged", "--backend", backend]) == 0
        output = json.loads(capsys.readouterr().out)
        assert output["backend"] == backend
        tokens[backend] = output["tokens"]
    assert len(tokens["torch"]) == 6 and tokens["triton"] == tokens["torch"]


def test_cli_triton_backend_needs_the_paged_cache(capsys):
    from moekv_ref.__main__ import main

    assert main(["generate", "--prompt", "x", "--backend", "triton", "--cache", "contiguous"]) == 2
    assert "--backend triton runs on the paged cache: add --cache paged" in capsys.readouterr().err
