"""Cached decoding = full recompute, at every position.

The cached path (`forward_cached`: per-expert gather of routed tokens, K/V appended to a cache) and
the recompute path (`forward`: all experts dense, masked by routing, scaled_dot_product_attention)
are independent implementations; their logits must agree at every prefill and decode position.
"""

import pytest
import torch
from helpers import max_logit_error, random_model, random_prompts, small_config

from moekv_ref.checkpoint import load_default_model
from moekv_ref.generate import generate
from moekv_ref.model import ExpertAttention
from moekv_ref.sampling import SamplingError, SamplingParams

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("routing", ["topk", "threshold"])
@pytest.mark.parametrize("mode", ["expert", "dense"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cached_equals_recompute_random_configs(mode, routing, dtype, seed):
    model = random_model(small_config(mode, routing), seed=seed, dtype=dtype)
    prompts = random_prompts([1, 5, 17, 30][seed:], model.config.vocab_size, seed=100 + seed)
    params = [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=i) for i, n in enumerate([9, 4, 12, 7][seed:])
    ]
    result = generate(model, prompts, params, cache="contiguous", record_logits=True)
    assert max_logit_error(model, result) <= TOLERANCE[dtype]
    # the recompute path itself, step by step, samples the same tokens
    assert generate(model, prompts, params, cache="none").tokens == result.tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("routing", ["topk", "threshold"])
def test_cached_equals_recompute_tiny(routing, dtype):
    model = load_default_model(routing, dtype)
    prompts = [list(b"def fibonacci(n):\n    "), list(b"import os"), list(b"x")]
    result = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=12, temperature=0.0),
        cache="contiguous",
        record_logits=True,
    )
    assert max_logit_error(model, result) <= TOLERANCE[dtype]


def test_none_cache_logits_match_too():
    model = random_model(small_config("expert", "threshold"), seed=3)
    prompts = random_prompts([6, 2], model.config.vocab_size, seed=7)
    result = generate(
        model, prompts, SamplingParams(max_new_tokens=5, temperature=0.0), cache="none", record_logits=True
    )
    assert max_logit_error(model, result) <= 1e-10


def test_bfloat16_cached_paths_stay_as_close_to_float32_as_recompute():
    """In bfloat16 the cached paths compute scores and softmax in float32, as full recompute (PyTorch's
    fused attention) and the kernels do: against the float32 model, their logits are no further off
    than recompute's, and greedy decoding gives recompute's tokens."""
    exact = load_default_model()  # float32
    half = load_default_model().to(torch.bfloat16)
    prompts = [
        list(b"import os\nimport sys\ndef main(argv):\n    for x in range(10):\n        print(x)\n"),
        list(b"class Foo:\n    def __init__(self):\n        self.x = 1\n"),
        list(b"if __name__ == "),
    ]
    # 12 new tokens (24 before: recompute in bfloat16 takes most of the time, a full forward per
    # token): every prompt's largest error, in each of the three paths, comes in its first 12 tokens
    # (measured: 0.50, 2.17 and 0.35, the same with 24), so the errors compared below are those of
    # 24 tokens; the cached paths run their prefill and 11 decode steps.
    params = SamplingParams(max_new_tokens=12, temperature=0)
    errors, tokens = {}, {}
    for cache in ("none", "contiguous", "paged"):
        result = generate(half, prompts, params, cache=cache, record_logits=True)
        tokens[cache] = result.tokens
        errors[cache] = max(
            (exact(torch.tensor([p + g[:-1]])).logits[0] - logits.float()).abs().max().item()
            for p, g, logits in zip(result.prompts, result.tokens, result.logits)
        )
    for cache in ("contiguous", "paged"):
        assert errors[cache] <= 1.1 * errors["none"], errors
        assert tokens[cache] == tokens["none"]


# ----- ExpertAttention.qkv_weight: W_q, W_k, W_v side by side without a copy, never stale ---------------


def _greedy(model, prompts):
    return generate(
        model, prompts, SamplingParams(max_new_tokens=5, temperature=0.0), cache="paged", record_logits=True
    )


def _concatenated(attention):
    return torch.cat([attention.w_q, attention.w_k, attention.w_v], dim=2)


def test_the_cached_projection_reads_the_qkv_buffer_and_sees_every_in_place_write():
    """W_q, W_k, W_v are views of one buffer, which the cached forward's projection reads with no copy
    (the embedded model's too: its loader writes into the parameters). Each way of changing weights in
    place -- load_state_dict, an optimizer step, p.data.copy_ -- lands in that buffer: afterwards it
    is the three side by side, bit for bit, and cached decoding still equals full recompute (float32,
    1e-4). A stale buffer would project with the old weights and recompute with the new."""
    with torch.no_grad():  # as generate and the engine run (autograd needs the copy)
        assert all(
            block.attention.qkv_weight().data_ptr() == block.attention.w_q.data_ptr()
            for block in load_default_model().blocks
        )
    model = random_model(small_config(routing="threshold"), seed=5, dtype=torch.float32)
    attention = model.blocks[1].attention
    prompts = random_prompts([3, 11], model.config.vocab_size, seed=6)
    generator = torch.Generator().manual_seed(8)
    before = _greedy(model, prompts).logits

    def fresh(weight):  # new random values of a weight's shape, never zeros
        return torch.randn(weight.shape, generator=generator) * weight.detach().std()

    model.load_state_dict({**model.state_dict(), "blocks.1.attention.w_k": fresh(attention.w_k)})
    loss = model(torch.tensor([prompts[1]])).logits.square().mean()
    loss.backward()
    torch.optim.SGD([attention.w_q], lr=10.0).step()
    with torch.no_grad():
        attention.w_v.data.copy_(fresh(attention.w_v))
        buffer = attention.qkv_weight()
        assert buffer.data_ptr() == attention.w_q.data_ptr()  # still no copy
        assert torch.equal(buffer, _concatenated(attention))
    result = _greedy(model, prompts)
    assert max_logit_error(model, result) <= TOLERANCE[torch.float32]
    assert not torch.allclose(torch.cat(result.logits), torch.cat(before))  # the writes changed the model


def test_a_replaced_qkv_parameter_is_copied_never_read_stale():
    """A parameter given a new tensor (p.data = ..., .to(dtype), deepcopy) is no longer a view of the
    buffer: qkv_weight then copies the three, and cached decoding equals full recompute."""
    model = random_model(small_config(), seed=5, dtype=torch.float32)
    attention = model.blocks[0].attention
    attention.w_v.data = attention.w_v.data * 2  # new storage
    with torch.no_grad():
        assert attention.qkv_weight().data_ptr() != attention.w_q.data_ptr()
        assert torch.equal(attention.qkv_weight(), _concatenated(attention))
    prompts = random_prompts([4, 9], model.config.vocab_size, seed=6)
    assert max_logit_error(model, _greedy(model, prompts)) <= TOLERANCE[torch.float32]


def test_under_autograd_the_qkv_weight_reaches_the_parameters():
    """Also when only some of the three are trained (W_q frozen here)."""
    attention = random_model(small_config(), seed=5, dtype=torch.float32).blocks[0].attention
    attention.w_q.requires_grad_(False)
    attention.qkv_weight().sum().backward()
    assert all(torch.equal(w.grad, torch.ones_like(w)) for w in (attention.w_k, attention.w_v))


def test_the_qkv_weight_reaches_the_cached_logits(monkeypatch):
    """Broken (NaN), the projection's weight shows in the cached forward's logits: greedy sampling
    refuses NaN logits."""
    model = random_model(small_config(), seed=5, dtype=torch.float32)
    monkeypatch.setattr(
        ExpertAttention, "qkv_weight", lambda self: torch.full_like(_concatenated(self), float("nan"))
    )
    with pytest.raises(SamplingError):
        _greedy(model, random_prompts([4], model.config.vocab_size, seed=6))
