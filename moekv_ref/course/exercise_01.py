"""Notebook 01's exercise: how much work the cache saves."""

from __future__ import annotations

from ..analysis import decode_flops
from .checks import MISSING, RIGHT, WRONG, close, wrapped

EXERCISE_01_CONTEXT_LENGTH = 384
FLOP_RATIO_TOLERANCE = (
    0.03  # relative: the ratio sits 5% under t + 1 at t = 384, so a looser band would pass t + 1
)


def solution_flop_ratio(config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> float:
    """Recompute FLOPs / cached FLOPs of one decode step after `context_length` tokens."""
    return decode_flops(config, context_length, cached=False) / decode_flops(
        config, context_length, cached=True
    )


@wrapped
def check_flop_ratio(answer, config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> str:
    """Is `answer` within 3% of the recompute / cached FLOP ratio at `context_length`?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with your prediction of recompute / cached FLOPs at "
            f"t = {context_length}. Hint: recompute runs all t + 1 tokens through every layer; the "
            f"cached step runs one, and reads t * k / E cached keys per expert."
        )
    answer = float(answer)
    right = solution_flop_ratio(config, context_length)
    tokens = context_length + 1
    if close(answer, right, FLOP_RATIO_TOLERANCE):
        return (
            f"{RIGHT}: the ratio is {right:.0f}x (you said {answer:.0f}). It is a little under "
            f"t + 1 = {tokens}: recompute does the per-token work (projections, FFN, output head) "
            f"for all {tokens} tokens, the cached step for one, and the attention the cached step "
            f"still pays over its t * k / E cached keys per expert keeps the ratio below t + 1."
        )
    if answer > 0 and close(1 / answer, right, FLOP_RATIO_TOLERANCE):
        return (
            f"{WRONG}: {answer:.4f} is cached / recompute, the inverse. The ratio asked for is "
            f"recompute / cached, which is far above 1."
        )
    if close(answer, tokens**2, 0.25) or answer > 4 * right:
        return (
            f"{WRONG}: {answer:.0f} is far too large. Only the attention "
            f"scores grow quadratically under recompute; at this model's size most of the work is "
            f"the per-token projections and FFN, which grow linearly, so the ratio is close to "
            f"t + 1 = {tokens}, not (t + 1)^2."
        )
    if close(answer, tokens, 0.02):
        return (
            f"{WRONG}: {answer:.0f} = t + 1 is the ratio if the cached step cost nothing but its one "
            f"token. It also scores its query against t * k / E cached keys per expert in every layer, "
            f"work that recompute's per-token count does not cover: estimate what that attention adds "
            f"to the cached step, as a share of its per-token work, and lower t + 1 by that share."
        )
    direction = "too low" if answer < right else "too high"
    distance = (
        "within 10%, but outside the 3% the check accepts"
        if close(answer, right, 0.1)
        else "by more than 10%"
    )
    return (
        f"{WRONG}: {answer:.0f} is {direction}, {distance}. Recompute pays for all t + 1 = {tokens} "
        f"tokens in every layer; the cached step for one token plus attention over its cache. Count "
        f"both per layer from the description in section 2."
    )
