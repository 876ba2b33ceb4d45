"""Notebook 11's exercise: what worst-case reservation sets aside for a prompt on a cluster."""

from __future__ import annotations

from functools import lru_cache

from ..cache.rows import ceil_div
from ..config import get_config
from ..sim.cluster import BLOCK_SIZE, MODEL, cluster_placement, pool_blocks
from ..sim.runner import RunnerSetup, TraceRunner
from ..sim.traces import topic_trace
from ..validation import is_integer
from .checks import MISSING, RIGHT, WRONG, close, wrapped

EXERCISE_11_PROMPT_TOKENS = 1000  # about the mean prompt of bench cluster's Azure lengths
EXERCISE_11_DEVICES = 8  # bench cluster's GPUs: one expert of every layer each
EXERCISE_11_GIB_PER_DEVICE = 0.5  # the smaller of bench cluster's pools


@lru_cache(maxsize=None)
def exercise_11_reservation(reservation: str) -> tuple[int, ...]:
    """The blocks the scheduler sets aside on each GPU, (D,) as a tuple, for the prefill of a fresh
    request of EXERCISE_11_PROMPT_TOKENS prompt tokens, under `reservation` ("worst_case" or
    "optimistic"), on bench cluster's model and placement: the real Scheduler's step_blocks_many,
    in a trace runner built as bench cluster builds it (predicted admission, its pool), never run."""
    config = get_config(MODEL)
    trace, _ = topic_trace(
        1,
        config.num_hidden_layers,
        config.num_attention_experts,
        config.num_attention_experts_per_tok,
        kv_bytes_per_slot=config.kv_bytes_per_entry(),
        lengths=([EXERCISE_11_PROMPT_TOKENS], [1]),
    )
    setup = RunnerSetup(
        blocks_per_device=pool_blocks(EXERCISE_11_GIB_PER_DEVICE),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=8192,
        admission="predicted",
        reservation=reservation,
    )
    runner = TraceRunner(trace, cluster_placement(EXERCISE_11_DEVICES), setup, "sequence_lru", None)
    request = runner.scheduler.waiting[0]
    return tuple(runner.scheduler.step_blocks_many([request], [EXERCISE_11_PROMPT_TOKENS])[0].tolist())


def solution_prompt_reservation() -> int:
    """Blocks worst-case reservation sets aside on one GPU for the prompt (the same on every GPU:
    each holds one expert of every layer): every prompt token may choose that GPU's expert in
    every layer, so each of the L rows there may take ceil(T / P) blocks."""
    return exercise_11_reservation("worst_case")[0]


@wrapped
def check_prompt_reservation(answer) -> str:
    """Is `answer` the number of blocks worst-case reservation sets aside on one GPU for the prompt?
    Compares with the real scheduler's reservation; names the usual mistakes."""
    config = get_config(MODEL)
    T = EXERCISE_11_PROMPT_TOKENS
    P = BLOCK_SIZE
    L = config.num_hidden_layers
    E = config.num_attention_experts
    k = config.num_attention_experts_per_tok
    D = EXERCISE_11_DEVICES
    if answer is None:
        return (
            f"{MISSING}: replace None with a number of blocks on one GPU. Hint: the worst case is the "
            f"routing that puts the most of the prompt's {T} tokens on that GPU; it holds one expert "
            f"of each layer, and a block holds {P} tokens of one row."
        )
    if not is_integer(answer) or answer < 1:
        return f"{WRONG}: {answer!r} is not a positive whole number of blocks."
    worst = exercise_11_reservation("worst_case")
    if len(set(worst)) != 1:  # every GPU holds one expert of every layer: the same on each
        raise RuntimeError(f"the GPUs' worst cases differ: {worst}")
    right = worst[0]
    optimistic = exercise_11_reservation("optimistic")[0]
    pool = pool_blocks(EXERCISE_11_GIB_PER_DEVICE)
    row = ceil_div(T, P)
    if answer == right:
        return (
            f"{RIGHT}: {right} blocks on every GPU: any token may choose the GPU's expert in every one "
            f"of the {L} layers, so each of its {L} rows there may reach {T} tokens, {row} blocks of "
            f"{P}. That is {100 * right / pool:.0f}% of a pool of {pool} blocks ({EXERCISE_11_GIB_PER_DEVICE:g} "
            f"GiB per GPU), and {right / optimistic:.1f}x the {optimistic} blocks optimistic reservation "
            f"sets aside (the blocks the predictor expects, 1/{D} of them on each GPU: top-{k} of {E} "
            f"experts sends a token to a given expert {k} times in {E}). Only {pool // right} such "
            f"prompts' worst cases fit in a pool at once, whatever their routing turns out to be: "
            f"this is why admission waits under worst-case reservation while the pools stay under "
            f"half full."
        )
    if answer in (row, row - 1):
        return (
            f"{WRONG}: {answer} blocks is one row, one layer's expert on this GPU. The GPU holds an "
            f"expert of each of the {L} layers, and the prompt's tokens may choose every one of them."
        )
    if answer == k * right:
        return (
            f"{WRONG}: a token goes to k = {k} experts of a layer, but this GPU holds only one expert of "
            f"each layer: a token adds at most one entry per layer here, so k does not multiply the "
            f"GPU's worst case."
        )
    if answer == D * right or answer == D * k * right:
        return (
            f"{WRONG}: that counts every GPU; each GPU has its own pool, and the question asks for "
            f"the blocks set aside on one of them."
        )
    if answer in (L * T, k * L * T):
        return f"{WRONG}: that is a number of slots (tokens); a block holds {P} of them."
    if answer == L * T // P or answer == L * T / P:
        return (
            f"{WRONG}: almost: a row takes whole blocks, so its last block, only partly filled, is "
            f"taken whole too. Round up per row, not over the whole GPU."
        )
    if close(answer, optimistic, 0.1):  # L * k * T / (E * P) = 375, with tails 384 or the predictor's
        return (
            f"{WRONG}: that is about the blocks the prompt is *expected* to take on one GPU (what "
            f"optimistic reservation sets aside). Worst-case reservation cannot know the routing "
            f"before the forward runs: it assumes every token chooses this GPU's expert in every layer."
        )
    direction = "too few" if answer < right else "too many"
    return (
        f"{WRONG}: {answer} is {direction}. Count, layer by layer, the most blocks the prompt's tokens "
        f"can open in the one row this GPU holds for that layer, then add the layers."
    )
