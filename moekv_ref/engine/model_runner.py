"""The model runner: performs the scheduler's block copies, then one `forward_cached` over the
scheduled requests as one flat ragged batch.

    scheduled   r0: 5 prompt tokens    r1: 1 decode token    r2: 3 tokens of a prefill chunk
    tokens      t t t t t              t                     t t t              (N,) = (9,)
    seq_ids     0 0 0 0 0              1                     2 2 2
    positions   0 1 2 3 4              17                    32 33 34

It owns the host (swap) K/V and copies blocks in the order decided, *before* the forward: a device
block freed by a swap-out may go to another sequence in the same step, and the copy must read it
first. Every serving design of the benchmark runs through this one runner, so the comparison
measures scheduling and memory only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.paged import PagedKVCache
from ..model import MoEKVTransformer
from .swap import COPY, SWAP_IN, SWAP_OUT, BlockCopy


@dataclass
class FlatBatch:
    token_ids: list[int]  # (N,)
    seq_ids: list[int]  # (N,) the request id of each token
    positions: list[int]  # (N,) each token's position in its sequence
    num_tokens: list[int]  # (m,) tokens of each request, in batch order


def flatten_batch(scheduled) -> FlatBatch:
    tokens, seq_ids, positions, lengths = [], [], [], []
    for item in scheduled:
        request, n = item.request, item.num_tokens
        start = request.num_computed_tokens
        tokens += request.all_token_ids[start : start + n]
        seq_ids += [request.request_id] * n
        positions += range(start, start + n)
        lengths.append(n)
    return FlatBatch(tokens, seq_ids, positions, lengths)


@dataclass
class RunnerOutput:
    last_logits: torch.Tensor  # (m, V) logits at each scheduled request's last token
    entries_per_layer: torch.Tensor  # (L,) sum over the step's tokens of experts chosen
    num_tokens: int  # N


class ModelRunner:
    """model + its paged cache (device K/V) + `num_swap_blocks` host blocks for swapped K/V."""

    def __init__(self, model: MoEKVTransformer, cache: PagedKVCache, num_swap_blocks: int = 0):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        shape = (num_swap_blocks,) + tuple(cache.key_cache.shape[1:])  # (Ns, P, Hkv, Dh)
        self.host_key_cache = torch.zeros(shape, dtype=cache.key_cache.dtype, device="cpu")
        self.host_value_cache = torch.zeros(shape, dtype=cache.value_cache.dtype, device="cpu")

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """In order: SWAP_OUT device -> host, SWAP_IN host -> device, COPY device -> device."""
        device = self.cache.key_cache.device
        pairs = ((self.cache.key_cache, self.host_key_cache), (self.cache.value_cache, self.host_value_cache))
        for copy in copies:
            source, destination = copy.source.to(torch.int64), copy.destination.to(torch.int64)
            if copy.direction not in (SWAP_OUT, SWAP_IN, COPY):
                raise ValueError(f"unknown block copy direction {copy.direction!r}")
            for pool, host in pairs:  # keys, then values
                if copy.direction == SWAP_OUT:
                    host[destination] = pool[source.to(device)].cpu()
                elif copy.direction == SWAP_IN:
                    pool[destination.to(device)] = host[source].to(device)
                else:
                    pool[destination.to(device)] = pool[source.to(device)]

    @torch.inference_mode()  # not only no_grad: 11% of a dense engine step (measured)
    def forward(self, scheduled) -> RunnerOutput:
        batch = flatten_batch(scheduled)
        tokens = torch.tensor([batch.token_ids, batch.seq_ids, batch.positions], device=self.device)  # (3, N)
        output = self.model.forward_cached(*tokens.unbind(), self.cache)
        entries = torch.stack([r.selected for r in output.attention_routing]).sum((1, 2))  # (L,)
        n = len(batch.token_ids)  # n = m: decode, one token a request, each its last one
        last = (
            None if n == len(scheduled) else torch.tensor(batch.num_tokens, device=self.device).cumsum(0) - 1
        )
        return RunnerOutput((output.logits if last is None else output.logits[last]).cpu(), entries.cpu(), n)
