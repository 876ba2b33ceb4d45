"""Routing traces where each sequence has a topic, and each topic its own favourite experts.

`synthetic_trace` draws every token's experts from one popularity per layer, so all sequences look
alike to the cache: each holds about the same share of every expert. Learned routers are not like
that: experts specialise (the embedded model's routers prefer kinds of characters; `routing-stats`),
so a sequence about one thing leans on some experts, and a sequence about another on others. Which
sequence to evict then matters: under per-device pools one sequence may hold much of the short
device, another almost nothing there.

Each layer's expert weights for a token of topic t mix a global popularity and the topic's own:

    log w[l, e] = -global_s * log(1 + global_rank[l, e]) - topic_s * log(1 + topic_rank[t, l, e])

and a token takes k distinct experts by Gumbel top-k on those weights (as `synthetic_trace`). Topics
are drawn per sequence with Zipf(topic_popularity_s) popularity, so the most popular topic's experts
(and, under a co-activation placement, the device they share) fill first.

Dimension legend: S sequences, L layers, E experts, K experts per token, T topics.
"""

from __future__ import annotations

import torch

from .traces import RoutingTrace, _lognormal_lengths


def topic_trace(num_sequences: int, num_layers: int, num_experts: int, top_k: int, num_topics: int = 4,
                topic_s: float = 1.5, global_s: float = 0.5, topic_popularity_s: float = 1.0,
                mean_prompt: float = 256, mean_output: float = 256, sigma: float = 0.5,
                kv_bytes_per_slot: int = 512, seed: int = 0, name: str = "topics") -> tuple[RoutingTrace, torch.Tensor]:
    """A RoutingTrace and the topic of each sequence, (S,) int64 (module docstring)."""
    for name_, value in (("num_sequences", num_sequences), ("num_layers", num_layers),
                         ("num_experts", num_experts), ("top_k", top_k), ("num_topics", num_topics)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name_}={value!r} must be a positive integer")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} is greater than num_experts={num_experts}")
    for name_, value in (("topic_s", topic_s), ("global_s", global_s), ("topic_popularity_s", topic_popularity_s)):
        if value < 0:
            raise ValueError(f"{name_}={value} must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    prompts = _lognormal_lengths(num_sequences, mean_prompt, sigma, generator)
    outputs = _lognormal_lengths(num_sequences, mean_output, sigma, generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (prompts + outputs).cumsum(0)])

    def ranks(n):                                                              # (n, L, E)
        return torch.stack([torch.stack([torch.randperm(num_experts, generator=generator)
                                         for _ in range(num_layers)]) for _ in range(n)])

    global_weight = -global_s * torch.log1p(ranks(1)[0].to(torch.float32))       # (L, E)
    topic_weight = -topic_s * torch.log1p(ranks(num_topics).to(torch.float32))   # (T, L, E)
    popularity = torch.arange(1, num_topics + 1, dtype=torch.float64) ** -topic_popularity_s
    topic = torch.multinomial(popularity, num_sequences, replacement=True, generator=generator)   # (S,)
    num_tokens = int(offsets[-1])
    token_topic = torch.repeat_interleave(topic, prompts + outputs)               # (N,)
    log_weight = global_weight + topic_weight                                     # (T, L, E)
    experts = torch.empty(num_tokens, num_layers, top_k, dtype=torch.int16)
    chunk = 8192                                    # bounds the (chunk, L, E) noise tensor
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        uniform = torch.rand(n, num_layers, num_experts, generator=generator).clamp_(1e-12, 1.0)
        gumbel = -torch.log(-torch.log(uniform))                                  # (n, L, E)
        scores = log_weight[token_topic[start:start + n]] + gumbel                # (n, L, E)
        experts[start:start + n] = scores.topk(top_k, dim=-1).indices.to(torch.int16)
    return RoutingTrace(experts, offsets, prompts, num_experts, kv_bytes_per_slot, name), topic
