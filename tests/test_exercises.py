"""The exercise checks of notebooks 01-03: the solution passes, the placeholder asks for an answer, and
each usual wrong answer gets the explanation that names its mistake (not just "wrong")."""

import pytest
import torch

from moekv_ref import get_config
from moekv_ref.analysis import decode_flops
from moekv_ref import exercises
from moekv_ref.exercises import (
    EXERCISE_01_CONTEXT_LENGTH, EXERCISE_03_BLOCK_SIZES, exercise_03_workload, solution_block_size,
    solution_expert_cache_bytes, solution_flop_ratio,
)
from moekv_ref.sim.designs import CountingPagedDesign
from moekv_ref.sim.replay import replay

CONFIG = get_config("tiny")


def _unwrapped(check):
    """The check's message with its line breaks (wrapped at 100 columns for notebooks) undone."""
    def call(*args, **kwargs):
        message = check(*args, **kwargs)
        assert all(len(line) <= 100 for line in message.splitlines())
        return " ".join(message.split())
    return call


check_flop_ratio = _unwrapped(exercises.check_flop_ratio)
check_expert_cache_bytes = _unwrapped(exercises.check_expert_cache_bytes)
check_block_size = _unwrapped(exercises.check_block_size)


# --- 01 -------------------------------------------------------------------------------------------

def test_flop_ratio_solution_is_the_counted_ratio_and_passes():
    t = EXERCISE_01_CONTEXT_LENGTH
    right = solution_flop_ratio(CONFIG)
    assert right == decode_flops(CONFIG, t, cached=False) / decode_flops(CONFIG, t, cached=True)
    assert check_flop_ratio(right, CONFIG).startswith("Right")
    assert check_flop_ratio(round(right), CONFIG).startswith("Right")


def test_flop_ratio_wrong_answers_are_explained():
    t = EXERCISE_01_CONTEXT_LENGTH
    right = solution_flop_ratio(CONFIG)
    assert check_flop_ratio(None, CONFIG).startswith("No answer yet")
    assert "t + 1" in check_flop_ratio(t + 1, CONFIG) and check_flop_ratio(t + 1, CONFIG).startswith("Not yet")
    assert "inverse" in check_flop_ratio(1 / right, CONFIG)
    assert "far too large" in check_flop_ratio((t + 1) ** 2, CONFIG)
    assert "-50%" in check_flop_ratio(right / 2, CONFIG)


# --- 02 -------------------------------------------------------------------------------------------

def _selected(seed=0, num_tokens=30, num_layers=4, num_experts=8, top_k=2):
    """Random top-k routing decisions: one (T, E) bool tensor per layer."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        chosen = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices
        layers.append(torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True))
    return layers


def test_expert_cache_bytes_solution_counts_routed_tokens():
    selected = _selected()
    tokens = int(selected[2][:, 5].sum())
    # 2 (K, V) x 2 key/value heads x 32 dims x 4 bytes = 512 bytes per token per expert
    assert solution_expert_cache_bytes(selected, CONFIG) == tokens * 512
    assert check_expert_cache_bytes(tokens * 512, selected, CONFIG).startswith("Right")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expert_cache_bytes_names_each_mistake(seed):
    selected = _selected(seed)
    tokens = int(selected[2][:, 5].sum())
    num_tokens = selected[2].shape[0]
    check = lambda answer: check_expert_cache_bytes(answer, selected, CONFIG)   # noqa: E731
    assert check(None).startswith("No answer yet")
    assert "token count" in check(tokens)
    assert "K only" in check(tokens * 256) and "2 bytes per value" in check(tokens * 256)
    if tokens != num_tokens:
        assert f"all {num_tokens} tokens" in check(num_tokens * 512)
    assert "whole layer" in check(int(selected[2].sum()) * 512)
    message = check(123457)
    assert message.startswith("Not yet") and "column 5 of selected[2]" in message


def test_expert_cache_bytes_names_another_layer_or_expert():
    # hand-made routing where every layer and expert holds a different count, so each is identifiable
    selected = [torch.zeros(40, 8, dtype=torch.bool) for _ in range(4)]
    for layer in range(4):
        for expert in range(8):
            selected[layer][: 1 + layer + 4 * expert, expert] = True
    assert "layer 0" in check_expert_cache_bytes(int(selected[0][:, 5].sum()) * 512, selected, CONFIG)
    assert "expert 4's cache" in check_expert_cache_bytes(int(selected[2][:, 4].sum()) * 512, selected, CONFIG)


# --- 03 -------------------------------------------------------------------------------------------

def test_block_size_solution_is_the_largest_reaching_the_target():
    trace = exercise_03_workload()

    def utilization(P):
        return replay(trace, CountingPagedDesign(trace.num_sequences, trace.num_layers, trace.num_experts,
                                                 P)).effective_utilization

    right = solution_block_size()
    larger = EXERCISE_03_BLOCK_SIZES[EXERCISE_03_BLOCK_SIZES.index(right) + 1]
    assert utilization(right) >= 0.96 > utilization(larger)
    assert check_block_size(right).startswith("Right")


def test_block_size_wrong_answers_are_explained():
    right = solution_block_size()
    smaller = EXERCISE_03_BLOCK_SIZES[EXERCISE_03_BLOCK_SIZES.index(right) - 1]
    assert check_block_size(None).startswith("No answer yet")
    assert "not one of the block sizes" in check_block_size(12)
    assert "try smaller blocks" in check_block_size(64)
    assert "a larger block size also" in check_block_size(smaller)
