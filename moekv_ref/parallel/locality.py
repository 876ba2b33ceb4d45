"""Placing experts on ranks (placement.py: contiguous, round_robin, coactivation), compared on a
model's attention routing over a text: ranks a token touches per layer; hidden-state bytes per token
per layer sent to other ranks, once per rank (dispatch.py) and once per expert; and under
kv_with_expert the K/V tokens each rank stores, with their imbalance max / mean (1.0 is even).

Co-activation placement is fitted on the first half of the text and measured on the second, on
decisions it did not see. Tokens get home ranks round-robin by 256-token windows, as sequences do.
"""

from __future__ import annotations

import torch

from ..analysis import heldout_text
from ..placement import PLACEMENTS, coactivation_counts, devices_touched, place_experts
from ..prompts import encode
from .dispatch import DispatchPlan
from .kv_placements import KV_PLACEMENTS

WINDOW = 256


@torch.no_grad()
def attention_routing_of_text(model, text: str | None = None, max_tokens: int = 8192) -> list[torch.Tensor]:
    """Per layer, the attention experts each token of the text selected, over windows of WINDOW
    tokens: L tensors (N, E) bool."""
    tokens = encode(heldout_text() if text is None else text)[:max_tokens]
    window = min(WINDOW, model.config.max_position_embeddings)
    per_window = [
        model(torch.tensor([tokens[start : start + window]])).attention_routing
        for start in range(0, len(tokens), window)
    ]  # windows x L
    return [torch.cat([routing.selected[0] for routing in layer]) for layer in zip(*per_window)]


def compare_placements(
    selected_per_layer: list[torch.Tensor],
    world_sizes=(2, 4),
    hidden_size: int = 128,
    bytes_per_value: int = 4,
) -> list[dict]:
    """One row per (world size, strategy): the measures of the module docstring on the held-out half."""
    num_tokens, num_experts = selected_per_layer[0].shape
    half = num_tokens // 2
    evaluated = num_tokens - half
    per_token_layer = evaluated * len(selected_per_layer)
    k_max = max(int(s.sum(1).max()) for s in selected_per_layer)
    rows = []
    for world_size in world_sizes:
        home = (torch.arange(evaluated) // WINDOW) % world_size  # (N',)
        for strategy in PLACEMENTS:
            touched, per_rank_pairs, per_expert_pairs = [], 0, 0
            load = torch.zeros(world_size, dtype=torch.int64)
            for selected in selected_per_layer:
                fit, test = selected[:half], selected[half:]  # (N/2, E)
                counts = coactivation_counts(fit) if strategy == "coactivation" else None
                rank_of_expert = place_experts(num_experts, world_size, strategy, counts)  # (E,)
                touched.append(devices_touched(test, rank_of_expert, world_size).double().mean())
                plan = DispatchPlan.build(test, test.double(), rank_of_expert, world_size, k_max)
                per_rank_pairs += plan.pairs_to_peers(home[plan.token])
                per_expert_pairs += plan.expert_pairs_to_peers(home[plan.token])
                load.index_add_(0, rank_of_expert, test.sum(0).to(torch.int64))
            rows.append(
                {
                    "world_size": world_size,
                    "strategy": strategy,
                    "ranks_touched_per_token_layer": float(torch.stack(touched).mean()),
                    "dispatch_bytes_per_token_layer_once_per_rank": per_rank_pairs
                    * hidden_size
                    * bytes_per_value
                    / per_token_layer,
                    "dispatch_bytes_per_token_layer_once_per_expert": per_expert_pairs
                    * hidden_size
                    * bytes_per_value
                    / per_token_layer,
                    "kv_tokens_per_rank": load.tolist(),
                    "kv_imbalance_max_over_mean": float(load.max() / load.double().mean()),
                    "tokens_evaluated": evaluated,
                }
            )
    return rows


def format_placement_table(rows: list[dict]) -> str:
    lines = [
        f"{'ranks':>5} {'strategy':<13} {'ranks touched':>13} {'bytes/rank':>10} {'bytes/expert':>12} "
        f"{'K/V imbalance':>13}  K/V tokens per rank"
    ]
    for row in rows:
        lines.append(
            f"{row['world_size']:>5} {row['strategy']:<13} {row['ranks_touched_per_token_layer']:>13.3f} "
            f"{row['dispatch_bytes_per_token_layer_once_per_rank']:>10.1f} "
            f"{row['dispatch_bytes_per_token_layer_once_per_expert']:>12.1f} "
            f"{row['kv_imbalance_max_over_mean']:>13.3f}  {row['kv_tokens_per_rank']}"
        )
    return "\n".join(lines)


def kv_location_map(
    selected_per_layer: list[torch.Tensor], attention_ranks: torch.Tensor, kv_placement: str, home_rank: int
) -> torch.Tensor:
    """(L * E, T) int64: the rank holding the K/V token t of one sequence wrote into expert e of
    layer l (row l * E + e), or -1 where t was not routed to e. selected_per_layer: L of (T, E)."""
    if kv_placement not in KV_PLACEMENTS:
        raise ValueError(f"kv_placement={kv_placement!r} is not one of {KV_PLACEMENTS}")
    where = home_rank
    if kv_placement == "kv_with_expert":
        where = torch.as_tensor(attention_ranks, dtype=torch.int64)[:, None, :]  # (L, 1, E)
    located = torch.where(torch.stack(selected_per_layer), where, -1)  # (L, T, E)
    return located.transpose(1, 2).flatten(0, 1)  # (L*E, T)
