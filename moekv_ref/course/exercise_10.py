"""Notebook 10's exercise: the smallest row budget at which drop refuses nothing."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..analysis import heldout_text
from ..cache import BudgetedPagedKVCache
from ..cache.budget import RowBudget
from ..checkpoint import load_default_model
from ..prompts import encode
from ..validation import is_integer
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_10_SPAN = (3602, 3756)  # 154 bytes of the held-out text: an attention layer's __init__


def exercise_10_text() -> str:
    """The snippet notebook 10 maps and its exercise asks about: a fixed slice of the held-out text
    (analysis.heldout_text, Python the embedded model never trained on)."""
    start, stop = EXERCISE_10_SPAN
    return heldout_text()[start:stop]


@lru_cache(maxsize=None)
def exercise_10_row_lengths() -> torch.Tensor:
    """(L, E) the tokens routed to each (layer, expert) row of the embedded model (top-2) over the
    snippet, without a budget: what each row would hold."""
    model = load_default_model()
    with torch.inference_mode():
        output = model(torch.tensor([encode(exercise_10_text())]))
    return torch.stack([routing.selected[0].sum(0) for routing in output.attention_routing])


@lru_cache(maxsize=None)
def _exercise_10_refused(max_tokens: int) -> int:
    """Pairs refused over every layer when the snippet is cached (one prefill) under a drop budget of
    max_tokens per row: the paged cache's own count."""
    model = load_default_model()
    tokens = torch.tensor(encode(exercise_10_text()))
    cache = BudgetedPagedKVCache.for_model(model, max_num_seqs=1, budget=RowBudget(max_tokens, "drop"))
    with torch.inference_mode():
        model.forward_cached(tokens, torch.zeros_like(tokens), torch.arange(len(tokens)), cache)
    return cache.manager.budget.num_refused


def solution_drop_budget() -> int:
    """The smallest B at which drop refuses no token of the snippet: the longest row over every
    layer and expert (drop refuses exactly a row's tokens beyond its first B)."""
    return int(exercise_10_row_lengths().max())


@wrapped
def check_drop_budget(answer) -> str:
    """Is `answer` the smallest row budget B at which drop refuses no token of the snippet? Caches
    the snippet under a drop budget of `answer` and counts what is refused; names the usual mistakes."""
    lengths = exercise_10_row_lengths()  # (L, E)
    num_layers, num_experts = lengths.shape
    num_tokens = len(exercise_10_text().encode())
    mean = float(lengths.double().mean())  # k T / E
    if answer is None:
        return (
            f"{MISSING}: replace None with the smallest B. Hint: drop refuses a token only when "
            f"its row already holds B tokens, so the answer is set by the rows that grow longest; "
            f"the mean row holds k T / E = {mean:.1f} tokens, and there are {num_layers} layers."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} must be a positive whole number of tokens per row."
    right = solution_drop_budget()
    layer, expert = divmod(int(lengths.argmax()), num_experts)
    refused = 0 if answer >= num_tokens else _exercise_10_refused(answer)  # no row exceeds T
    if answer == right and refused == 0:
        return (
            f"{RIGHT}: the longest row, expert {expert} of layer {layer}, is routed {right} of the "
            f"{num_tokens} tokens, so B = {right} refuses nothing and B = {right - 1} refuses "
            f"{_exercise_10_refused(right - 1)} pair(s). The mean row holds k T / E = {mean:.1f}: "
            f"routing is uneven, so a cap that never bites is {right / mean:.1f}x the mean row, and "
            f"is known only once the router has run. A budget set before the routing is known "
            f"bounds memory by binding on the busiest rows first."
        )
    if refused == 0 and answer >= num_tokens:
        return (
            f"{WRONG}: B = {answer} refuses nothing, whatever the routing: no row can be routed "
            f"more than the {num_tokens} tokens of the sequence. But the router spreads them over "
            f"{num_experts} experts, and a far smaller B refuses nothing here too."
        )
    if refused == 0:
        return (
            f"{WRONG}: B = {answer} refuses nothing, but so does a smaller B: no row here is routed "
            f"{answer} tokens. Find the length of the longest row."
        )
    if abs(answer - mean) < 1:
        return (
            f"{WRONG}: {answer} is the mean row, k T / E = {mean:.1f} tokens, and drop refuses "
            f"{refused} pair(s) there: routing is uneven, some rows are routed far more than the "
            f"mean, and drop refuses each of their tokens beyond the first B."
        )
    longest_per_layer = lengths.max(1).values.tolist()
    if answer in longest_per_layer:
        other = longest_per_layer.index(answer)
        return (
            f"{WRONG}: {answer} is the longest row of layer {other}, and drop refuses {refused} "
            f"pair(s) there: the budget holds in every layer, and layer {layer} has a longer row."
        )
    return (
        f"{WRONG}: at B = {answer} drop refuses {refused} pair(s): some row is routed more than "
        f"{answer} tokens. Count the tokens routed to each (layer, expert) row and take the longest."
    )
