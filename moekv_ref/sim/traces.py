"""Routing traces: which attention experts each token of each sequence went to, at every layer.

A trace is all the cache needs to know about a run: a token routed to expert e at layer l appends one
slot to row (sequence, l, e). Storing expert ids (not a (T, L, E) mask) keeps a trace of real-model
shape small: 64 sequences x 512 tokens x 16 layers x top-8 is 4M int16.

    experts      (num_tokens, L, K) int16   the experts of each token, -1 where a token used fewer
                                            than K (threshold routing); sequences concatenated
    offsets      (S + 1,)           int64   sequence s is tokens offsets[s] : offsets[s + 1]
    prompt_lens  (S,)               int64   the first prompt_lens[s] tokens are prefilled at once

Two synthetic kinds: `synthetic_trace`, where every sequence draws its experts from the same
popularity, and `topic_trace`, where each sequence has a topic and each topic its own favourite
experts (see there why that matters to eviction).

Dimension legend: S sequences, L layers, E experts, K experts per token (k_max), T topics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.rows import RowIndex


@dataclass
class RoutingTrace:
    experts: torch.Tensor          # (num_tokens, L, K) int16, -1 = none
    offsets: torch.Tensor          # (S + 1,) int64
    prompt_lens: torch.Tensor      # (S,) int64
    num_experts: int               # E
    kv_bytes_per_slot: int         # bytes of K and V one token stores in one (layer, expert) row
    name: str = "trace"

    def __post_init__(self):
        if self.experts.dim() != 3:
            raise ValueError(f"experts must be (num_tokens, L, K), got shape {tuple(self.experts.shape)}")
        if int(self.offsets[-1]) != self.experts.shape[0]:
            raise ValueError("offsets[-1] must equal the number of tokens")
        if (self.prompt_lens < 1).any() or (self.prompt_lens > self.lengths).any():
            raise ValueError("every prompt needs 1 <= prompt_len <= sequence length")

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_slot_appends(self) -> int:
        """Slots the whole trace writes: one per (token, layer, selected expert)."""
        return int((self.experts >= 0).sum())

    def subset(self, seqs: list[int]) -> "RoutingTrace":
        """The trace of some sequences only, renumbered 0..len(seqs)-1."""
        parts = [self.experts[self.offsets[s]: self.offsets[s + 1]] for s in seqs]
        lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return RoutingTrace(torch.cat(parts), offsets, self.prompt_lens[seqs].clone(), self.num_experts,
                            self.kv_bytes_per_slot, self.name)

    def prefill_appends(self, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the prompts of `seqs` fill and how many slots each gains.

        Returns rows (a,) int64, distinct, numbered seq * (L * E) + layer * E + expert with seq the
        trace's sequence id, and num_new (a,) int64 >= 1."""
        index = RowIndex(self.num_layers, self.num_experts)
        count = self.prompt_lens[seqs]
        owner = torch.repeat_interleave(seqs, count)                                  # (t,)
        start = torch.cumsum(count, 0) - count
        local = torch.arange(int(count.sum())) - torch.repeat_interleave(start, count)
        token = self.offsets[owner] + local                                           # (t,)
        chosen = self.experts[token].to(torch.int64)                                  # (t, L, K)
        row = index.row(owner[:, None, None], torch.arange(self.num_layers)[None, :, None], chosen)
        counts = torch.bincount(row[chosen >= 0], minlength=self.num_sequences * index.rows_per_seq)
        rows = counts.nonzero().squeeze(1)
        return rows, counts[rows]

    def decode_appends(self, seqs: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """The rows that token token_index[i] of sequence seqs[i] appends one slot to: (a,) int64,
        distinct (a token's experts are distinct, and each sequence decodes one token)."""
        index = RowIndex(self.num_layers, self.num_experts)
        chosen = self.experts[self.offsets[seqs] + token_index].to(torch.int64)      # (m, L, K)
        rows = index.row(seqs[:, None, None], torch.arange(self.num_layers)[None, :, None], chosen)
        return rows[chosen >= 0]


def _lognormal_lengths(num: int, mean: float, sigma: float, generator) -> torch.Tensor:
    """Integer lengths >= 1 from a log-normal with the given mean: mu = ln(mean) - sigma^2 / 2."""
    mu = torch.log(torch.tensor(mean)) - sigma**2 / 2
    values = torch.exp(mu + sigma * torch.randn(num, generator=generator))
    return values.round().clamp(min=1).to(torch.int64)


def synthetic_trace(num_sequences: int, num_layers: int, num_experts: int, top_k: int,
                    mean_prompt: float = 256, mean_output: float = 256, sigma: float = 0.5,
                    zipf_s: float = 1.0, kv_bytes_per_slot: int = 512, seed: int = 0,
                    name: str = "synthetic") -> RoutingTrace:
    """Top-k routing with Zipf(s) expert popularity, log-normal prompt and output lengths.

    Each layer ranks its experts by a random permutation (the hot expert differs per layer) and gives
    the expert of rank r the weight 1 / r^s; a token takes k distinct experts, drawn with those weights
    (Gumbel top-k, equivalent to sampling without replacement). zipf_s = 0 is uniform routing."""
    for name_, value in (("num_sequences", num_sequences), ("num_layers", num_layers),
                         ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name_}={value!r} must be a positive integer")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} is greater than num_experts={num_experts}")
    if zipf_s < 0:
        raise ValueError(f"zipf_s={zipf_s} must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    prompts = _lognormal_lengths(num_sequences, mean_prompt, sigma, generator)
    outputs = _lognormal_lengths(num_sequences, mean_output, sigma, generator)
    lengths = prompts + outputs
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rank = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(num_layers)])
    log_weight = -zipf_s * torch.log1p(rank.to(torch.float32))                      # (L, E)
    num_tokens = int(offsets[-1])
    experts = torch.empty(num_tokens, num_layers, top_k, dtype=torch.int16)
    chunk = 8192                                    # bounds the (chunk, L, E) noise tensor
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        uniform = torch.rand(n, num_layers, num_experts, generator=generator).clamp_(1e-12, 1.0)
        gumbel = -torch.log(-torch.log(uniform))
        experts[start:start + n] = (log_weight + gumbel).topk(top_k, dim=-1).indices.to(torch.int16)
    return RoutingTrace(experts, offsets, prompts, num_experts, kv_bytes_per_slot, name)


def topic_trace(num_sequences: int, num_layers: int, num_experts: int, top_k: int, num_topics: int = 4,
                topic_s: float = 1.5, global_s: float = 0.5, topic_popularity_s: float = 1.0,
                mean_prompt: float = 256, mean_output: float = 256, sigma: float = 0.5,
                kv_bytes_per_slot: int = 512, seed: int = 0, name: str = "topics") -> tuple[RoutingTrace, torch.Tensor]:
    """A RoutingTrace and the topic of each sequence, (S,) int64.

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
    """
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
