"""Notebook 07's exercise: placing experts on ranks."""

from __future__ import annotations

from itertools import combinations

import torch

from ..placement import coactivation_counts, devices_touched, place_experts
from ..validation import is_integer
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_07_LAYER = 0
EXERCISE_07_WORLD_SIZE = 2
MAX_KV_IMBALANCE = 1.10  # max / mean K/V entries per rank under kv_with_expert
RANKS_TOUCHED_SLACK = 1.05  # within 5% of the fewest ranks touched that the balance bound allows


def placement_measures(selected, rank_of_expert, world_size: int) -> tuple[float, float]:
    """(ranks a token touches on average, K/V imbalance max / mean over ranks) of one layer's routing
    `selected` (N, E) bool under the placement `rank_of_expert` (E,)."""
    rank_of_expert = torch.as_tensor(rank_of_expert, dtype=torch.int64)
    touched = float(devices_touched(selected, rank_of_expert, world_size).double().mean())
    load = torch.zeros(world_size, dtype=torch.int64).index_add_(
        0, rank_of_expert, selected.sum(0).to(torch.int64)
    )
    return touched, float(load.max() / load.double().mean())


def _balanced_placements(num_experts: int, world_size: int):
    """Every way to put num_experts / world_size experts on each rank, up to renaming the ranks."""
    per_rank = num_experts // world_size

    def fill(rank_of_expert, rank):
        free = [e for e in range(num_experts) if rank_of_expert[e] < 0]
        if not free:
            yield tuple(rank_of_expert)
            return
        first = free[0]  # the lowest free expert opens the next rank: no renamed duplicates
        for others in combinations(free[1:], per_rank - 1):
            placed = list(rank_of_expert)
            for e in (first, *others):
                placed[e] = rank
            yield from fill(placed, rank + 1)

    yield from fill([-1] * num_experts, 0)


def solution_expert_placement(selected, world_size: int = EXERCISE_07_WORLD_SIZE) -> list[int]:
    """The balanced placement (E / D experts per rank) touching the fewest ranks per token among those
    whose K/V imbalance is at most MAX_KV_IMBALANCE: exhaustive search (35 placements for 8 experts
    on 2 ranks), where the package's co-activation placement is a greedy heuristic."""
    num_experts = selected.shape[1]
    scored = [
        (placement_measures(selected, p, world_size), p)
        for p in _balanced_placements(num_experts, world_size)
    ]
    allowed = [(m, p) for m, p in scored if m[1] <= MAX_KV_IMBALANCE]
    if not allowed:
        raise ValueError(
            f"no placement of {num_experts} experts on {world_size} ranks keeps this routing's K/V "
            f"imbalance <= {MAX_KV_IMBALANCE}: an expert's load alone exceeds what one rank may hold"
        )
    return list(min(allowed, key=lambda mp: mp[0])[1])


@wrapped
def check_expert_placement(answer, selected, world_size: int = EXERCISE_07_WORLD_SIZE) -> str:
    """Is `answer` (the rank of each expert) balanced in weights, in K/V (imbalance <= 1.10), and
    within 5% of the fewest ranks per token such a placement can touch?"""
    num_experts = selected.shape[1]
    per_rank = num_experts // world_size
    if answer is None:
        return (
            f"{MISSING}: replace None with a list of {num_experts} ranks, one per expert (0 to "
            f"{world_size - 1}), {per_rank} experts per rank. Hint: put experts that are chosen together "
            f"on one rank, and keep the most loaded experts apart."
        )
    answer = list(answer)
    if len(answer) != num_experts or any(not is_integer(r) or not 0 <= r < world_size for r in answer):
        return (
            f"{WRONG}: the answer must list {num_experts} ranks, each an integer from 0 to "
            f"{world_size - 1} (expert e goes to rank answer[e]); got {answer}."
        )
    per_rank_counts = torch.bincount(torch.tensor(answer), minlength=world_size).tolist()
    if any(count != per_rank for count in per_rank_counts):
        return (
            f"{WRONG}: ranks hold {per_rank_counts} experts; each must hold {per_rank}, so that every "
            f"rank stores the same weights and runs the same expert work per token."
        )
    touched, imbalance = placement_measures(selected, answer, world_size)
    round_robin = placement_measures(selected, torch.arange(num_experts) % world_size, world_size)
    greedy_map = place_experts(num_experts, world_size, "coactivation", coactivation_counts(selected))
    greedy = placement_measures(selected, greedy_map, world_size)
    load = selected.sum(0)
    if imbalance > MAX_KV_IMBALANCE:
        heaviest = load.argsort(descending=True)[:2].tolist()
        return (
            f"{WRONG}: the K/V imbalance is {imbalance:.3f} > {MAX_KV_IMBALANCE:.2f}: under kv_with_expert one "
            f"rank stores {imbalance:.2f}x the mean of the K/V and fills its pool first. Expert loads "
            f"differ (the heaviest, {heaviest[0]} and {heaviest[1]}, hold {int(load[heaviest[0]])} and "
            f"{int(load[heaviest[1]])} entries); spread the heavy ones. (The package's greedy co-activation "
            f"placement, {greedy_map.tolist()}, has this problem too: imbalance {greedy[1]:.3f}.)"
        )
    best = placement_measures(selected, solution_expert_placement(selected, world_size), world_size)
    if touched > RANKS_TOUCHED_SLACK * best[0]:
        pairs = coactivation_counts(selected).triu(1)
        top = [divmod(int(i), num_experts) for i in pairs.flatten().argsort(descending=True)[:3]]
        return (
            f"{WRONG}: balanced ({imbalance:.3f}), but a token touches {touched:.3f} ranks on average "
            f"(round-robin {round_robin[0]:.3f} on this layer's {selected.shape[0]} tokens; section 4's table "
            f"averages every layer over the second half of the text); a placement within the balance bound reaches "
            f"{best[0]:.3f}. Each rank a token touches receives one copy of its hidden state, so put "
            f"experts that are chosen together on one rank: the most frequent pairs are "
            f"{', '.join(f'{a}+{b}' for a, b in top)}."
        )
    return (
        f"{RIGHT}: a token touches {touched:.3f} ranks on average (round-robin {round_robin[0]:.3f} on "
        f"this layer's {selected.shape[0]} tokens, where section 4's table averages every layer over the second "
        f"half of the text; the best balanced placement {best[0]:.3f}) and the K/V imbalance is "
        f"{imbalance:.3f}. The package's "
        f"greedy co-activation placement touches {greedy[0]:.3f} but its imbalance is {greedy[1]:.3f}: "
        f"grouping experts that fire together also groups load, and a placement must watch both."
    )
