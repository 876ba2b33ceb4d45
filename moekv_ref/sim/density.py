"""Density: the fraction of a batch's sequences each (layer, expert) buffer holds (those with a
token routed there in their first `context` tokens); 1 in a dense transformer. Under uniform top-k
routing of c tokens it is 1 - (1 - k / E)^c, lower for cold experts under skew. Low density is why
per-buffer LRU loses its meaning (a buffer's least recently used rows belong to sequences running
now) and why taking one sequence off frees little in any one buffer.
"""

from __future__ import annotations

import torch

from ..cache.rows import ceil_div
from .traces import RoutingTrace, synthetic_trace


def density_per_expert(trace: RoutingTrace, context: int) -> torch.Tensor:
    """(L, E) fraction of the sequences (of at least `context` tokens) each buffer holds."""
    seqs = (trace.lengths >= context).nonzero().squeeze(1).tolist()
    if not seqs:
        raise ValueError(f"no sequence of the trace has {context} tokens")
    counts = torch.stack([trace.row_counts(s)[context] for s in seqs])  # (S', L, E)
    return (counts > 0).to(torch.float64).mean(0)


def mean_blocks_at_context(trace: RoutingTrace, contexts, block_size: int) -> torch.Tensor:
    """(len(contexts),) float64: blocks a sequence holds after c tokens, averaged over the trace's
    sequences of at least c tokens (every row's partly filled tail block counted)."""
    contexts = torch.as_tensor(list(contexts), dtype=torch.int64)
    total, num = torch.zeros(2, contexts.numel(), dtype=torch.float64)  # (C,) each
    for s in range(trace.num_sequences):
        blocks = ceil_div(trace.row_counts(s)[1:], block_size).sum((1, 2))  # (n,) after t+1 tokens
        reached = contexts <= blocks.shape[0]
        total[reached] += blocks[contexts[reached] - 1].to(torch.float64)
        num[reached] += 1
    return total / num.clamp(min=1)


def density_sweep(
    experts=(8, 16, 64),
    top_ks=(1, 2, 8),
    skews=(0.0, 1.0, 2.0),
    context: int = 64,
    num_sequences: int = 32,
    num_layers: int = 2,
    seed: int = 0,
) -> list[dict]:
    """Mean and coldest-expert density over synthetic traces for each (E, k, Zipf skew) with k <= E."""
    out = []
    for E in experts:
        for k in top_ks:
            if k > E:
                continue
            for s in skews:
                trace = synthetic_trace(
                    num_sequences,
                    num_layers,
                    E,
                    k,
                    mean_prompt=context,
                    mean_output=1,
                    sigma=0.0,
                    zipf_s=s,
                    seed=seed,
                )
                density = density_per_expert(trace, context)
                out.append(
                    {
                        "num_experts": E,
                        "top_k": k,
                        "zipf_s": s,
                        "context": context,
                        "mean": float(density.mean()),
                        "min": float(density.min()),
                        "uniform_expectation": 1 - (1 - k / E) ** context,
                    }
                )
    return out
