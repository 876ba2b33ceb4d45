"""Notebook 02's exercise: one expert's cache, from the routing decisions."""

from __future__ import annotations

from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_02_PROMPT = "class Cache:\n    def __init__(self, size):"
EXERCISE_02_LAYER = 2
EXERCISE_02_EXPERT = 5
EXERCISE_02_BYTES_PER_VALUE = 4  # float32


def solution_expert_cache_bytes(
    selected,
    config,
    layer: int = EXERCISE_02_LAYER,
    expert: int = EXERCISE_02_EXPERT,
    bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE,
) -> int:
    """Bytes held by (layer, expert)'s cache after a prompt: the tokens routed to the expert, times
    K and V (2) x key/value heads x head dim x bytes per value. `selected`: one (T, E) bool tensor per
    layer, as `moekv_ref.analysis.route_prompt` returns."""
    tokens = int(selected[layer][:, expert].sum())
    return tokens * 2 * config.num_key_value_heads * config.head_dim * bytes_per_value


@wrapped
def check_expert_cache_bytes(
    answer,
    selected,
    config,
    layer: int = EXERCISE_02_LAYER,
    expert: int = EXERCISE_02_EXPERT,
    bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE,
) -> str:
    """Is `answer` the number of bytes (layer, expert)'s cache holds? Names the usual mistakes."""
    if answer is None:
        return (
            f"{MISSING}: replace None with the bytes that expert {expert} of layer {layer} holds. "
            f"Hint: count the tokens routed to it (a column of selected[{layer}]), then multiply by "
            f"the bytes one token takes in one expert's cache."
        )
    answer = int(answer)
    num_tokens, num_experts = selected[layer].shape
    tokens = int(selected[layer][:, expert].sum())
    per_value = config.num_key_value_heads * config.head_dim  # one of K or V, one token
    per_token = 2 * per_value * bytes_per_value
    right = tokens * per_token
    if answer == right:
        return (
            f"{RIGHT}: {tokens} of the {num_tokens} tokens chose expert {expert} in layer {layer}, "
            f"and each takes 2 (K and V) x {config.num_key_value_heads} heads x {config.head_dim} "
            f"dims x {bytes_per_value} bytes = {per_token} bytes: {right} bytes."
        )
    if answer == tokens:
        return (
            f"{WRONG}: {answer} is the token count, not bytes. Multiply it by the bytes one token "
            f"takes in one expert's cache: section 2 says what a cached token stores, and a float32 "
            f"value takes {bytes_per_value} bytes."
        )
    if answer == tokens * per_value * bytes_per_value:  # also what K and V in 2-byte values give
        return (
            f"{WRONG}: your count leaves out part of each token's entry: did you count K only (the "
            f"cache keeps K and V), or 2 bytes per value (the model here runs in float32: "
            f"{bytes_per_value} bytes per value)?"
        )
    if answer == num_tokens * per_token:
        return (
            f"{WRONG}: that counts all {num_tokens} tokens of the prompt. A token is stored only by "
            f"the experts its router chose: count only the tokens that chose expert {expert}."
        )
    total_in_layer = int(selected[layer].sum())
    if answer == total_in_layer * per_token:
        return (
            f"{WRONG}: that is the whole layer's cache ({total_in_layer} entries over all "
            f"{num_experts} experts); the question is about expert {expert} alone."
        )
    average = total_in_layer / num_experts
    if abs(answer - average * per_token) < per_token:
        return (
            f"{WRONG}: that is the average expert ({average:.1f} tokens). Routing is skewed, so "
            f"expert {expert} holds a different number: count its column of the routing matrix."
        )
    for other in range(len(selected)):
        if other != layer and answer == int(selected[other][:, expert].sum()) * per_token:
            return (
                f"{WRONG}: that is expert {expert} of layer {other}; every layer routes on its own, "
                f"and the question is about layer {layer}."
            )
    for other in range(num_experts):
        if other != expert and answer == int(selected[layer][:, other].sum()) * per_token:
            return (
                f"{WRONG}: that is expert {other}'s cache; experts are numbered from 0 (e0 is the first row)."
            )
    return (
        f"{WRONG}: {answer} bytes is not it. Count the tokens in column {expert} of selected[{layer}] "
        f"and multiply by {per_token} bytes per token."
    )
