"""Notebook 03's exercise: a block size for a workload."""

from __future__ import annotations

from functools import lru_cache

from ..sim.designs import CountingPagedDesign
from ..sim.replay import replay
from ..sim.traces import RoutingTrace, synthetic_trace
from .checks import MISSING, RIGHT, WRONG, wrapped

EXERCISE_03_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
TARGET_EFFECTIVE_UTILIZATION = 0.96


def exercise_03_workload() -> RoutingTrace:
    """The first 8 sequences of bench memory's W3 (E = 8, top-2, 16 layers, prompt and output lengths
    log-normal of mean 256 each, Zipf(1) expert popularity), built here so that the exercise does not
    change if the benchmark's workloads do."""
    return synthetic_trace(
        8,
        num_layers=16,
        num_experts=8,
        top_k=2,
        mean_prompt=256,
        mean_output=256,
        zipf_s=1.0,
        seed=3,
        name="W3",
    )


@lru_cache(maxsize=None)
def _exercise_03_utilization(block_size: int) -> float:
    trace = exercise_03_workload()
    design = CountingPagedDesign(trace.num_sequences, trace.num_layers, trace.num_experts, block_size)
    return replay(trace, design).effective_utilization


def solution_block_size() -> int:
    """The largest block size in EXERCISE_03_BLOCK_SIZES at which plain pages keep effective
    utilization >= 0.96 on the exercise's workload."""
    return max(
        P for P in EXERCISE_03_BLOCK_SIZES if _exercise_03_utilization(P) >= TARGET_EFFECTIVE_UTILIZATION
    )


@wrapped
def check_block_size_answer(answer) -> str:
    """Is `answer` the largest block size reaching effective utilization >= 0.96 on the workload?"""
    if answer is None:
        return (
            f"{MISSING}: replace None with a block size from {EXERCISE_03_BLOCK_SIZES}. Hint: a row "
            f"wastes on average about half a block; estimate the tokens per row first."
        )
    if answer not in EXERCISE_03_BLOCK_SIZES:
        return f"{WRONG}: {answer!r} is not one of the block sizes offered, {EXERCISE_03_BLOCK_SIZES}."
    trace = exercise_03_workload()
    tokens_per_row = float(trace.lengths.double().mean()) * trace.experts.shape[2] / trace.num_experts
    mine = _exercise_03_utilization(answer)
    right = solution_block_size()
    if answer == right:
        larger = EXERCISE_03_BLOCK_SIZES[EXERCISE_03_BLOCK_SIZES.index(right) + 1]
        return (
            f"{RIGHT}: P = {right} keeps effective utilization at {mine:.3f}; P = {larger} drops to "
            f"{_exercise_03_utilization(larger):.3f}. Rows end holding about {tokens_per_row:.0f} "
            f"tokens and waste about half a block each, and larger blocks would mean fewer, longer "
            f"reads per decode token, so the largest block that meets the target is the one to take."
        )
    if mine < TARGET_EFFECTIVE_UTILIZATION:
        return (
            f"{WRONG}: at P = {answer} effective utilization is {mine:.3f} < "
            f"{TARGET_EFFECTIVE_UTILIZATION}. Each row wastes about P/2 slots of its last block, "
            f"and rows here end near {tokens_per_row:.0f} tokens (fewer early in the run), so that "
            f"waste is too large a share: try smaller blocks."
        )
    return (
        f"{WRONG}: P = {answer} reaches {mine:.3f}, but a larger block size also stays >= "
        f"{TARGET_EFFECTIVE_UTILIZATION}; larger blocks mean fewer block-table entries and fewer, "
        f"longer reads per decode token, so take the largest that meets the target."
    )
