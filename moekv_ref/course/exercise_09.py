"""Notebook 09's exercise: what routing attention costs at equal KV bytes, as a perplexity ratio."""

from __future__ import annotations

from .checks import MISSING, RIGHT, WRONG, close, wrapped


def solution_perplexity_ratio(family: dict) -> float:
    """expert_topk's per-byte perplexity over dense_kv_matched's (the dense model holding the same KV
    bytes per token): 2 to the power of the gap in bits per byte, from the family's JSON."""
    variants = family["variants"]
    gap = variants["expert_topk"]["bits_per_byte_mean"] - variants["dense_kv_matched"]["bits_per_byte_mean"]
    return 2.0**gap


@wrapped
def check_perplexity_ratio(answer, family: dict) -> str:
    """Is `answer` expert_topk's per-byte perplexity over dense_kv_matched's, within 1%?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with a number. Hint: bits per byte are a log2; a gap of g bits "
            f"per byte multiplies the per-byte perplexity by 2 ** g."
        )
    if not isinstance(answer, (int, float)) or isinstance(answer, bool) or not answer > 0:
        return f"{WRONG}: {answer!r} is not a positive number: a ratio of two perplexities is one."
    variants = family["variants"]
    right = solution_perplexity_ratio(family)
    gap = variants["expert_topk"]["bits_per_byte_mean"] - variants["dense_kv_matched"]["bits_per_byte_mean"]
    if close(answer, right, 0.01):
        return (
            f"{RIGHT}: {variants['expert_topk']['bits_per_byte_mean']:.3f} - "
            f"{variants['dense_kv_matched']['bits_per_byte_mean']:.3f} = {gap:.3f} bits per byte, and "
            f"2 ** {gap:.3f} = {right:.3f}: at equal KV bytes per token, routing attention makes each "
            f"byte about {100 * (right - 1):.0f}% harder to predict in these models."
        )
    if close(answer, gap, 0.02):
        return f"{WRONG}: that is the gap in bits per byte; the perplexity ratio is 2 to that power."
    if close(answer, 1 / right, 0.01):
        return f"{WRONG}: that is the ratio the other way round: expert_topk's over dense_kv_matched's."
    against_dense = 2.0 ** (
        variants["expert_topk"]["bits_per_byte_mean"] - variants["dense"]["bits_per_byte_mean"]
    )
    if close(answer, against_dense, 0.01):
        return (
            f"{WRONG}: that compares with `dense`, which holds half the KV bytes of expert_topk; the "
            f"question is at equal KV bytes: `dense_kv_matched`."
        )
    return f"{WRONG}: {answer} is {'above' if answer > right else 'below'} the ratio by more than 1%."
