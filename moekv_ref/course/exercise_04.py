"""Notebook 04's exercise: how many sequences to run at once under optimistic admission."""

from __future__ import annotations

from functools import lru_cache

from ..checkpoint import load_default_model
from ..demo_workload import demo_workload, serve_workload
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_04_MAX_NUM_SEQS = (1, 2, 3, 4, 6, 8, 16)
EXERCISE_04_NUM_REQUESTS = 12
EXERCISE_04_NUM_BLOCKS = 200


def exercise_04_workload():
    """Twelve requests of the demo workload (notebook 04's widget runs the same ones), without the
    oversized request: arrivals 0.5 per step, prompts of 16-160 bytes, outputs of 16-128 tokens."""
    return demo_workload(EXERCISE_04_NUM_REQUESTS, arrival_rate=0.5, seed=0, with_oversized=False)


@lru_cache(maxsize=None)
def _exercise_04_run(max_num_seqs: int) -> dict:
    """One serving run: optimistic admission, preemption by recompute, a pool of 200 blocks of 16."""
    engine, result = serve_workload(
        load_default_model("threshold"),
        exercise_04_workload(),
        EXERCISE_04_NUM_BLOCKS,
        admission="optimistic",
        preemption_mode="recompute",
        max_num_seqs=max_num_seqs,
    )
    stats = engine.stats()
    return {
        "steps": stats.num_steps,
        "preempted": stats.num_preemptions,
        "recomputed_tokens": stats.num_recomputed_tokens,
        "max_concurrent_sequences": stats.max_concurrent_sequences,
    }


def solution_max_num_seqs() -> int:
    """The largest max_num_seqs in EXERCISE_04_MAX_NUM_SEQS such that it, and every smaller choice,
    serves the exercise's workload without one preemption (runs the engine: tens of seconds)."""
    best = None
    for max_num_seqs in EXERCISE_04_MAX_NUM_SEQS:
        if _exercise_04_run(max_num_seqs)["preempted"]:
            break
        best = max_num_seqs
    return best


@wrapped
def check_max_num_seqs(answer) -> str:
    """Is `answer` the largest max_num_seqs at which optimistic admission never preempts? Runs the
    engine at the answer and at the next larger choice."""
    if answer is None:
        return (
            f"{MISSING}: replace None with a max_num_seqs from {EXERCISE_04_MAX_NUM_SEQS}. Hint: "
            f"optimistic admission lets a request in whenever its next step fits; what stops the "
            f"pool from running short later is how many sequences grow in it at once."
        )
    if answer not in EXERCISE_04_MAX_NUM_SEQS:
        return f"{WRONG}: {answer!r} is not one of the choices offered, {EXERCISE_04_MAX_NUM_SEQS}."
    mine = _exercise_04_run(answer)
    if mine["preempted"]:
        return (
            f"{WRONG}: at max_num_seqs = {answer} the engine preempted {mine['preempted']} time(s) and "
            f"recomputed {mine['recomputed_tokens']} tokens: with up to {mine['max_concurrent_sequences']} "
            f"sequences admitted on their next step alone, their decode growth outran the "
            f"{EXERCISE_04_NUM_BLOCKS}-block pool. Allow fewer sequences at once."
        )
    index = EXERCISE_04_MAX_NUM_SEQS.index(answer)
    if index + 1 == len(EXERCISE_04_MAX_NUM_SEQS):
        return (
            f"{RIGHT}: even {answer} sequences at once never preempt ({mine['steps']} steps); the pool "
            f"holds everything this workload runs at once."
        )
    larger = EXERCISE_04_MAX_NUM_SEQS[index + 1]
    next_run = _exercise_04_run(larger)
    if next_run["preempted"]:
        return (
            f"{RIGHT}: max_num_seqs = {answer} serves the {EXERCISE_04_NUM_REQUESTS} requests in "
            f"{mine['steps']} steps without "
            f"a preemption; {larger} lets in one sequence too many, which the pool cannot keep as it "
            f"grows: {next_run['preempted']} preemption(s), {next_run['recomputed_tokens']} tokens "
            f"recomputed. A cap on running sequences is a crude prediction of demand: the right cap "
            f"depends on the requests' lengths and the pool, so it must be found again for every "
            f"workload; predicted admission adapts by itself."
        )
    return (
        f"{WRONG}: max_num_seqs = {answer} never preempts, but neither does the next choice up, which "
        f"finishes in {next_run['steps']} steps instead of {mine['steps']}: more sequences per step is "
        f"faster as long as the pool holds them. Take a larger value."
    )
