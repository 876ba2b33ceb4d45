"""The model runner: turns the scheduler's decision into one `forward_cached` over a flat ragged batch.

    scheduled   r0: 5 prompt tokens    r1: 1 decode token    r2: 3 tokens of a prefill chunk
    tokens      t t t t t              t                     t t t              (N,) = (9,)
    seq_ids     0 0 0 0 0              1                     2 2 2
    positions   0 1 2 3 4              17                    32 33 34

Each request's slice continues what the cache holds for it, so the cache appends and attends in one
call per (layer, expert). The runner returns the logits of each request's last scheduled token (the
engine samples from them only when that token is the request's newest) and how many experts the
routers chose per layer, which feeds the demand predictor.

Every serving design of the benchmark runs through this one runner, so the comparison measures
scheduling and memory, not two implementations of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import MoEKVTransformer


@dataclass
class RunnerOutput:
    last_logits: torch.Tensor          # (m, V) logits at each scheduled request's last token
    entries_per_layer: torch.Tensor    # (L,) sum over the step's tokens of experts chosen
    num_tokens: int                    # N


class ModelRunner:
    def __init__(self, model: MoEKVTransformer, cache):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def execute(self, scheduled) -> RunnerOutput:
        """scheduled: list of ScheduledRequest (request, num_tokens), in batch order."""
        tokens, seq_ids, positions, lengths = [], [], [], []
        for item in scheduled:
            request, n = item.request, item.num_tokens
            start = request.num_computed_tokens
            tokens += request.all_token_ids[start: start + n]
            seq_ids += [request.request_id] * n
            positions += range(start, start + n)
            lengths.append(n)
        device = self.device
        output = self.model.forward_cached(torch.tensor(tokens, device=device),
                                           torch.tensor(seq_ids, device=device),
                                           torch.tensor(positions, device=device), self.cache)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1                       # (m,)
        entries = torch.stack([r.selected.sum() for r in output.attention_routing])     # (L,)
        return RunnerOutput(output.logits[last].cpu(), entries.cpu(), len(tokens))
