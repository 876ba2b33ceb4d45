"""Routing: which experts each token goes to, and with what weight.

The token-choice rules are causal: a token's choice depends only on its own hidden state, so a
decode step can route a new token without looking at the future, and a cached prefix never needs
re-routing.

    topk           exactly k experts per token: every layer caches exactly k*T entries
    threshold      experts by falling probability until their mass reaches p, 1 <= count <= k_max: a
                   sequence's cache size depends on what the router decides (dynamic "top-p" routing,
                   Huang et al., "Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
                   arXiv 2403.07652)
    expert_choice  the experts choose: every token is a candidate of every expert, and an expert's
                   capacity C decides which it keeps (Mixture of Sparse Attention, arXiv 2505.00315)

A capacity (`apply_capacity`, over whole training windows) keeps at most C tokens per (sequence,
expert): under expert choice the C best-scored of the window, which looks ahead (a token's place
depends on later tokens' scores), so decoding keeps the best so far instead (cache/budget.py's
router_score); under token choice the first C routed there, Switch Transformer's capacity, which is
causal and is exactly what a cache with a `drop` budget of C keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """The router's decision for a set of tokens: three (..., E) tensors."""

    probs: torch.Tensor  # softmax of the router logits
    selected: torch.Tensor  # bool, True where the token goes to the expert
    gates: torch.Tensor  # each selected expert's weight (renormalised over them), else 0

    @property
    def experts_per_token(self) -> torch.Tensor:
        return self.selected.sum(-1)


def route(logits: torch.Tensor, rule: str, k: int, threshold: float = 0.5) -> Routing:
    """Routing of tokens (..., E) by rule; under expert_choice every expert is selected, with its
    probability as the gate (the capacity then chooses: module docstring)."""
    num_experts = logits.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be in [1, {num_experts}] (the number of experts)")
    probs = torch.softmax(logits, dim=-1)  # (..., E)
    # largest first; stable, so that among equal probabilities the lower-numbered expert wins
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (..., E) each
    selected = torch.zeros_like(probs, dtype=torch.bool)
    if rule == "topk":  # the first k in sorted order
        selected.scatter_(-1, order[..., :k], True)
    elif rule == "expert_choice":
        return Routing(probs=probs, selected=torch.ones_like(probs, dtype=torch.bool), gates=probs)
    elif rule == "threshold":
        # keep expert j (in sorted order) while the mass of the experts before it is below p
        rank = torch.arange(num_experts, device=logits.device)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = (mass_before < threshold) & (rank < k)
        keep_sorted[..., 0] = True  # at least one expert
        selected.scatter_(-1, order, keep_sorted)  # back to expert order
    else:
        raise ValueError(f"unknown routing rule {rule!r}; allowed: ('topk', 'threshold', 'expert_choice')")
    gates = probs * selected
    return Routing(probs=probs, selected=selected, gates=gates / gates.sum(-1, keepdim=True))


def apply_capacity(routing: Routing, rule: str, capacity: int) -> Routing:
    """Routing of whole windows (B, T, E) with at most `capacity` tokens per (sequence, expert): the
    best-scored under expert_choice, else the first routed there (module docstring). The gates of
    what is dropped become 0 and the others stay as they were (not renormalised), as the cache
    leaves them when a budget refuses a token."""
    selected = routing.selected
    if rule == "expert_choice":
        keep = min(capacity, selected.shape[1])
        best = routing.probs.topk(keep, dim=1).indices  # (B, C, E) along T
        kept = torch.zeros_like(selected).scatter_(1, best, True)
    else:
        kept = torch.cumsum(selected.long(), dim=1) <= capacity  # (B, T, E) first C
    selected = selected & kept
    return Routing(routing.probs, selected, routing.gates * selected)
