"""Notebook 06's exercise: how much of a prompt a prefix hit reuses."""

from __future__ import annotations

from functools import lru_cache

from ..checkpoint import load_default_model
from ..engine import LLMEngine, SchedulerConfig
from ..engine.workload import few_shot_workload
from ..validation import is_integer
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_06_PROMPT_LEN = 128
EXERCISE_06_SHARED = 100  # the first 100 tokens of both prompts are the same
EXERCISE_06_BLOCK_SIZE = 16


@lru_cache(maxsize=1)
def solution_hit_tokens() -> int:
    """The prompt tokens the second of two requests starts from, out of the first's cached blocks,
    on the real engine: two few-shot prompts sharing their first EXERCISE_06_SHARED tokens, the
    second added once the first has finished."""
    model = load_default_model("topk")
    workload = few_shot_workload(
        2,
        prompt_len=EXERCISE_06_PROMPT_LEN,
        shared_share=EXERCISE_06_SHARED / EXERCISE_06_PROMPT_LEN,
        output_len=4,
    )
    engine = LLMEngine(
        model,
        2000,
        EXERCISE_06_BLOCK_SIZE,
        SchedulerConfig(max_num_seqs=2),
        enable_prefix_caching=True,
        record_history=True,
    )
    for request in workload:
        engine.add_request(request.prompt, request.sampling_params)
        while engine.has_unfinished_requests():
            engine.step()
    hit = engine.requests[1].prefix_hit
    return 0 if hit is None else hit.num_tokens


@wrapped
def check_hit_tokens(answer) -> str:
    """Is `answer` the number of prompt tokens the second request reuses from the cache?"""
    P = EXERCISE_06_BLOCK_SIZE
    S = EXERCISE_06_SHARED
    if answer is None:
        return (
            f"{MISSING}: replace None with a number of tokens. Hint: a block is found by the key of "
            f"every token up to its end, in chunks of P = {P}."
        )
    if not is_integer(answer) or not 0 <= answer <= EXERCISE_06_PROMPT_LEN:
        return f"{WRONG}: {answer!r} is not a number of tokens from 0 to {EXERCISE_06_PROMPT_LEN}."
    right = solution_hit_tokens()
    if answer == right:
        return (
            f"{RIGHT}: the hit reuses {right} tokens: the {right // P} chunks of {P} made only of shared "
            f"tokens. The chunk holding tokens {right}-{right + P - 1} mixes the last {S - right} shared "
            f"tokens with the request's own, so its key differs and those {S - right} are computed again."
        )
    if answer > S:
        return (
            f"{WRONG}: the prompts share only their first {S} tokens; a token past them differs, and so "
            f"does the key of every chunk that holds one."
        )
    if answer == S:
        return (
            f"{WRONG}: a hit reuses whole chunks of P = {P} tokens (whole blocks of each row): a chunk "
            f"is found by a key over every token up to its end, and the chunk that holds the last "
            f"shared tokens holds some of the request's own too."
        )
    if answer % P:
        return f"{WRONG}: a hit is a whole number of chunks of P = {P} tokens."
    return (
        f"{WRONG}: too few: every chunk of {P} tokens made only of shared tokens is found, however "
        f"many precede it."
    )
