"""Small random models and prompts shared by the tests."""

from __future__ import annotations

import torch

from moekv_ref.config import ModelConfig
from moekv_ref.generate import generate
from moekv_ref.model import MoEKVTransformer
from moekv_ref.sampling import SamplingParams


def small_config(attention_mode="expert", routing="topk", **overrides) -> ModelConfig:
    values = dict(
        name="small",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=96,
        num_local_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        attention_routing=routing,
        routing_threshold=0.6,
    )
    if attention_mode == "dense":
        values.update(attention_mode="dense", num_attention_experts=1, num_attention_experts_per_tok=1)
    else:
        values.update(attention_mode="expert", num_attention_experts=5, num_attention_experts_per_tok=3)
    values.update(overrides)
    return ModelConfig(**values)


def random_model(
    config: ModelConfig, seed: int, dtype=torch.float64, backend: str = "torch"
) -> MoEKVTransformer:
    torch.manual_seed(seed)
    model = MoEKVTransformer(config, backend)
    with torch.no_grad():  # make the routers decisive and varied, as a trained model's are
        for block in model.blocks:
            block.attention.router.weight.mul_(4.0)
    return model.to(dtype).eval()


def random_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def max_logit_error(model, result) -> float:
    """Largest |cached logits - full-recompute logits| over every position of every sequence."""
    worst = 0.0
    for prompt, generated, logits in zip(result.prompts, result.tokens, result.logits):
        sequence = torch.tensor([prompt + generated[:-1]])
        full = model(sequence).logits[0]  # (T, V)
        assert full.shape == logits.shape
        worst = max(worst, (full - logits).abs().max().item())
    return worst


def random_workload(
    num_requests: int,
    prompt_lengths: tuple[int, int],
    output_lengths: tuple[int, int],
    seed: int,
    prompt_seed: int,
    temperature: float = 1.0,
    vocab_size: int = 64,
):
    """Prompts and sampling params of a serving test: lengths drawn in [low, high), every other request
    greedy, the others sampled with their own seed. Returns (prompts, params)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(*prompt_lengths, (num_requests,), generator=generator).tolist()
    outputs = torch.randint(*output_lengths, (num_requests,), generator=generator).tolist()
    prompts = random_prompts(lengths, vocab_size, seed=prompt_seed)
    params = [
        SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else temperature, top_p=0.9, seed=i)
        for i, n in enumerate(outputs)
    ]
    return prompts, params


def alone_tokens(model, prompts, params) -> list[list[int]]:
    """What each request generates when it is served alone (the reference every batching must equal)."""
    return [generate(model, [p], [q], cache="contiguous").tokens[0] for p, q in zip(prompts, params)]


def prefill_then_decode(model, cache, sequences: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) of a cache driven as generate drives it: a prefill chunk of `prefill` tokens of
    every sequence (B, T) in one forward, then one decode step per position; the manager's invariants
    checked at the end."""
    B, T = sequences.shape
    seq_ids = torch.arange(B)
    first = model.forward_cached(
        sequences[:, :prefill].reshape(-1),
        seq_ids.repeat_interleave(prefill),
        torch.arange(prefill).repeat(B),
        cache,
    ).logits.view(B, prefill, -1)
    rest = [
        model.forward_cached(sequences[:, t], seq_ids, torch.full((B,), t), cache).logits
        for t in range(prefill, T)
    ]
    cache.manager.assert_consistent()
    return torch.cat([first, torch.stack(rest, 1)], 1)
