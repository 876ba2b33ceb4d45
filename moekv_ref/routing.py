"""Token-choice routing: which experts each token goes to, and with what weight.

Both rules are causal: a token's choice depends only on its own hidden state, so a decode step can
route a new token without looking at the future, and a cached prefix never needs re-routing.

    topk       exactly k experts per token: every layer caches exactly k*T entries
    threshold  experts by falling probability until their mass reaches p, 1 <= count <= k_max: a
               sequence's cache size depends on what the router decides (dynamic "top-p" routing,
               Huang et al., "Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
               arXiv 2403.07652)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """The router's decision for a set of tokens: three (..., E) tensors."""

    probs: torch.Tensor          # softmax of the router logits
    selected: torch.Tensor       # bool, True where the token goes to the expert
    gates: torch.Tensor          # each selected expert's weight (renormalised over them), else 0

    @property
    def experts_per_token(self) -> torch.Tensor:
        return self.selected.sum(-1)


def route(logits: torch.Tensor, rule: str, k: int, threshold: float = 0.5) -> Routing:
    num_experts = logits.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be in [1, {num_experts}] (the number of experts)")
    probs = torch.softmax(logits, dim=-1)                        # (..., E)
    # largest first; stable, so that among equal probabilities the lower-numbered expert wins
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)   # (..., E) each
    selected = torch.zeros_like(probs, dtype=torch.bool)
    if rule == "topk":                                           # the first k in sorted order
        selected.scatter_(-1, order[..., :k], True)
    elif rule == "threshold":
        # keep expert j (in sorted order) while the mass of the experts before it is below p
        rank = torch.arange(num_experts, device=logits.device)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = (mass_before < threshold) & (rank < k)
        keep_sorted[..., 0] = True                               # at least one expert
        selected.scatter_(-1, order, keep_sorted)                # back to expert order
    else:
        raise ValueError(f"unknown routing rule {rule!r}; allowed: ('topk', 'threshold')")
    gates = probs * selected
    return Routing(probs=probs, selected=selected, gates=gates / gates.sum(-1, keepdim=True))
