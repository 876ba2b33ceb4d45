"""The exercises at the end of notebooks 01-03: each asks the reader for one small answer, and its
`check_*` function says whether it is right and, when it is not, *why* -- naming the usual mistake
the answer matches. The solutions are here too (`solution_*`), computed by the same package code the
notebooks teach, so a check can never disagree with the lesson.

    01  predict the recompute / cached FLOP ratio of one decode step at a context length
    02  compute one expert's cache size, in bytes, from the router's decisions
    03  choose the largest block size that keeps plain pages at effective utilization >= 0.96

Every check returns a message starting with "Right" or "Not yet" (or "No answer yet" for the
placeholder the notebooks are saved with), so a notebook cell just prints it.
"""

from __future__ import annotations

import textwrap
from functools import lru_cache

from .analysis import decode_flops
from .sim.designs import CountingPagedDesign
from .sim.replay import replay
from .sim.traces import RoutingTrace, synthetic_trace

RIGHT, WRONG, MISSING = "Right", "Not yet", "No answer yet"


def _wrapped(check):
    """Checks return one paragraph; wrap it at 100 columns so that it reads at notebook width."""
    def wrapped(*args, **kwargs):
        return textwrap.fill(check(*args, **kwargs), width=100)
    wrapped.__name__, wrapped.__doc__ = check.__name__, check.__doc__
    return wrapped


def _close(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * abs(target)


# ---------------------------------------------------------------------------------------------------
# 01: how much work the cache saves


EXERCISE_01_CONTEXT_LENGTH = 384
FLOP_RATIO_TOLERANCE = 0.03     # relative: the ratio sits 5% under t + 1 at t = 384, so a looser band would pass t + 1


def solution_flop_ratio(config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> float:
    """Recompute FLOPs / cached FLOPs of one decode step after `context_length` tokens."""
    return decode_flops(config, context_length, cached=False) / decode_flops(config, context_length, cached=True)


@_wrapped
def check_flop_ratio(answer, config, context_length: int = EXERCISE_01_CONTEXT_LENGTH) -> str:
    """Is `answer` within 3% of the recompute / cached FLOP ratio at `context_length`?"""
    if answer is None:
        return (f"{MISSING}: replace None with your prediction of recompute / cached FLOPs at "
                f"t = {context_length}. Hint: recompute runs all t + 1 tokens through every layer; the "
                f"cached step runs one, and reads t * k / E cached keys per expert.")
    answer = float(answer)
    right = solution_flop_ratio(config, context_length)
    tokens = context_length + 1
    if _close(answer, right, FLOP_RATIO_TOLERANCE):
        return (f"{RIGHT}: the ratio is {right:.0f}x (you said {answer:.0f}). It is a little under "
                f"t + 1 = {tokens}: recompute does the per-token work (projections, FFN, output head) "
                f"for all {tokens} tokens, the cached step for one, and the attention the cached step "
                f"still pays over its t * k / E cached keys per expert keeps the ratio below t + 1.")
    if answer > 0 and _close(1 / answer, right, FLOP_RATIO_TOLERANCE):
        return (f"{WRONG}: {answer:.4f} is cached / recompute, the inverse. The ratio asked for is "
                f"recompute / cached, which is far above 1.")
    if _close(answer, tokens**2, 0.25) or answer > 4 * right:
        return (f"{WRONG}: {answer:.0f} is far too large (the ratio is {right:.0f}x). Only the attention "
                f"scores grow quadratically under recompute; at this model's size most of the work is "
                f"the per-token projections and FFN, which grow linearly, so the ratio is close to "
                f"t + 1 = {tokens}, not (t + 1)^2.")
    if _close(answer, tokens, 0.1):
        return (f"{WRONG}: {answer:.0f} = t + 1 is the ratio if the cached step cost nothing but its one "
                f"token. It also reads t * k / E cached keys per expert, so the true ratio is "
                f"{right:.0f}x, {100 * (1 - right / tokens):.0f}% below t + 1 (use decode_flops).")
    return (f"{WRONG}: {answer:.0f} is {100 * (answer / right - 1):+.0f}% from the ratio. Recompute pays "
            f"for all t + 1 = {tokens} tokens in every layer; the cached step for one token plus "
            f"attention over its cache; decode_flops(config, t, cached) counts both.")


# ---------------------------------------------------------------------------------------------------
# 02: one expert's cache, from the routing decisions


EXERCISE_02_PROMPT = "class Cache:\n    def __init__(self, size):"
EXERCISE_02_LAYER = 2
EXERCISE_02_EXPERT = 5
EXERCISE_02_BYTES_PER_VALUE = 4   # float32


def solution_expert_cache_bytes(selected, config, layer: int = EXERCISE_02_LAYER,
                                expert: int = EXERCISE_02_EXPERT,
                                bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE) -> int:
    """Bytes held by (layer, expert)'s cache after a prompt: the tokens routed to the expert, times
    K and V (2) x key/value heads x head dim x bytes per value. `selected`: one (T, E) bool tensor per
    layer, as `moekv_ref.analysis.route_prompt` returns."""
    tokens = int(selected[layer][:, expert].sum())
    return tokens * 2 * config.num_key_value_heads * config.head_dim * bytes_per_value


@_wrapped
def check_expert_cache_bytes(answer, selected, config, layer: int = EXERCISE_02_LAYER,
                             expert: int = EXERCISE_02_EXPERT,
                             bytes_per_value: int = EXERCISE_02_BYTES_PER_VALUE) -> str:
    """Is `answer` the number of bytes (layer, expert)'s cache holds? Names the usual mistakes."""
    if answer is None:
        return (f"{MISSING}: replace None with the bytes that expert {expert} of layer {layer} holds. "
                f"Hint: count the tokens routed to it (a column of selected[{layer}]), then multiply by "
                f"the bytes one token takes in one expert's cache.")
    answer = int(answer)
    num_tokens, num_experts = selected[layer].shape
    tokens = int(selected[layer][:, expert].sum())
    per_value = config.num_key_value_heads * config.head_dim                # one of K or V, one token
    per_token = 2 * per_value * bytes_per_value
    right = tokens * per_token
    if answer == right:
        return (f"{RIGHT}: {tokens} of the {num_tokens} tokens chose expert {expert} in layer {layer}, "
                f"and each takes 2 (K and V) x {config.num_key_value_heads} heads x {config.head_dim} "
                f"dims x {bytes_per_value} bytes = {per_token} bytes: {right} bytes.")
    if answer == tokens:
        return (f"{WRONG}: {answer} is the token count. Multiply by the bytes per token in one expert's "
                f"cache: 2 x {config.num_key_value_heads} x {config.head_dim} x {bytes_per_value}.")
    if answer == tokens * per_value * bytes_per_value:     # also what K and V in 2-byte values give
        return (f"{WRONG}: that is half of it: K only (the cache keeps K and V), or 2 bytes per value "
                f"(the model here runs in float32: {bytes_per_value} bytes per value).")
    if answer == num_tokens * per_token:
        return (f"{WRONG}: that counts all {num_tokens} tokens of the prompt. A token is stored only by "
                f"the experts its router chose: here {tokens} of them chose expert {expert}.")
    total_in_layer = int(selected[layer].sum())
    if answer == total_in_layer * per_token:
        return (f"{WRONG}: that is the whole layer's cache ({total_in_layer} entries over all "
                f"{num_experts} experts); the question is about expert {expert} alone.")
    average = total_in_layer / num_experts
    if abs(answer - average * per_token) < per_token:
        return (f"{WRONG}: that is the average expert ({average:.1f} tokens). Routing is skewed: expert "
                f"{expert} holds {tokens}; count its column of the routing matrix.")
    for other in range(len(selected)):
        if other != layer and answer == int(selected[other][:, expert].sum()) * per_token:
            return (f"{WRONG}: that is expert {expert} of layer {other}; every layer routes on its own, "
                    f"and the question is about layer {layer}.")
    for other in range(num_experts):
        if other != expert and answer == int(selected[layer][:, other].sum()) * per_token:
            return f"{WRONG}: that is expert {other}'s cache; experts are numbered from 0 (e0 is the first row)."
    return (f"{WRONG}: {answer} bytes is not it. Count the tokens in column {expert} of selected[{layer}] "
            f"and multiply by {per_token} bytes per token.")


# ---------------------------------------------------------------------------------------------------
# 03: a block size for a workload


EXERCISE_03_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
TARGET_EFFECTIVE_UTILIZATION = 0.96


def exercise_03_workload() -> RoutingTrace:
    """The first 8 sequences of bench memory's W3 (E = 8, top-2, 16 layers, prompt and output lengths
    log-normal of mean 256 each, Zipf(1) expert popularity), built here so that the exercise does not
    change if the benchmark's workloads do."""
    return synthetic_trace(8, num_layers=16, num_experts=8, top_k=2, mean_prompt=256, mean_output=256,
                           zipf_s=1.0, seed=3, name="W3")


@lru_cache(maxsize=None)
def _exercise_03_utilization(block_size: int) -> float:
    trace = exercise_03_workload()
    design = CountingPagedDesign(trace.num_sequences, trace.num_layers, trace.num_experts, block_size)
    return replay(trace, design).effective_utilization


def solution_block_size() -> int:
    """The largest block size in EXERCISE_03_BLOCK_SIZES at which plain pages keep effective
    utilization >= 0.96 on the exercise's workload."""
    return max(P for P in EXERCISE_03_BLOCK_SIZES if _exercise_03_utilization(P) >= TARGET_EFFECTIVE_UTILIZATION)


@_wrapped
def check_block_size(answer) -> str:
    """Is `answer` the largest block size reaching effective utilization >= 0.96 on the workload?"""
    if answer is None:
        return (f"{MISSING}: replace None with a block size from {EXERCISE_03_BLOCK_SIZES}. Hint: a row "
                f"wastes on average about half a block; estimate the tokens per row first.")
    if answer not in EXERCISE_03_BLOCK_SIZES:
        return f"{WRONG}: {answer!r} is not one of the block sizes offered, {EXERCISE_03_BLOCK_SIZES}."
    trace = exercise_03_workload()
    tokens_per_row = float(trace.lengths.double().mean()) * trace.experts.shape[2] / trace.num_experts
    mine = _exercise_03_utilization(answer)
    right = solution_block_size()
    if answer == right:
        larger = EXERCISE_03_BLOCK_SIZES[EXERCISE_03_BLOCK_SIZES.index(right) + 1]
        return (f"{RIGHT}: P = {right} keeps effective utilization at {mine:.3f}; P = {larger} drops to "
                f"{_exercise_03_utilization(larger):.3f}. Rows end holding about {tokens_per_row:.0f} "
                f"tokens and waste about half a block each, and larger blocks would mean fewer, longer "
                f"reads per decode token, so the largest block that meets the target is the one to take.")
    if mine < TARGET_EFFECTIVE_UTILIZATION:
        return (f"{WRONG}: at P = {answer} effective utilization is {mine:.3f} < "
                f"{TARGET_EFFECTIVE_UTILIZATION}. Each row wastes about P/2 slots of its last block, "
                f"and rows here end near {tokens_per_row:.0f} tokens (fewer early in the run), so that "
                f"waste is too large a share: try smaller blocks.")
    return (f"{WRONG}: P = {answer} reaches {mine:.3f}, but a larger block size also stays >= "
            f"{TARGET_EFFECTIVE_UTILIZATION}; larger blocks mean fewer block-table entries and fewer, "
            f"longer reads per decode token, so take the largest that meets the target.")
