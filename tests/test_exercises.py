"""The exercise checks of notebooks 01-11: the solution passes, the placeholder asks for an answer, and
each usual wrong answer gets the explanation that names its mistake (not just "wrong")."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from moekv_ref import get_config
from moekv_ref.analysis import decode_flops
from moekv_ref.course import (
    exercise_01,
    exercise_02,
    exercise_03,
    exercise_04,
    exercise_05,
    exercise_06,
    exercise_07,
    exercise_08,
    exercise_09,
    exercise_10,
    exercise_11,
)
from moekv_ref.course.exercise_01 import EXERCISE_01_CONTEXT_LENGTH, solution_flop_ratio
from moekv_ref.course.exercise_02 import solution_expert_cache_bytes
from moekv_ref.course.exercise_03 import EXERCISE_03_BLOCK_SIZES, exercise_03_workload, solution_block_size
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


check_flop_ratio = _unwrapped(exercise_01.check_flop_ratio)
check_expert_cache_bytes = _unwrapped(exercise_02.check_expert_cache_bytes)
check_block_size = _unwrapped(exercise_03.check_block_size_answer)
check_hit_tokens = _unwrapped(exercise_06.check_hit_tokens)
check_perplexity_ratio = _unwrapped(exercise_09.check_perplexity_ratio)
check_prompt_reservation = _unwrapped(exercise_11.check_prompt_reservation)


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
    assert "t + 1" in check_flop_ratio(t + 1, CONFIG) and check_flop_ratio(t + 1, CONFIG).startswith(
        "Not yet"
    )
    assert "inverse" in check_flop_ratio(1 / right, CONFIG)
    assert "far too large" in check_flop_ratio((t + 1) ** 2, CONFIG)
    assert "too low, by more than 10%" in check_flop_ratio(right / 2, CONFIG)
    assert "too low, within 10%" in check_flop_ratio(0.93 * right, CONFIG)
    assert "too high, within 10%" in check_flop_ratio(1.09 * right, CONFIG)


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
    check = lambda answer: check_expert_cache_bytes(answer, selected, CONFIG)  # noqa: E731
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
    assert "expert 4's cache" in check_expert_cache_bytes(
        int(selected[2][:, 4].sum()) * 512, selected, CONFIG
    )


# --- 03 -------------------------------------------------------------------------------------------


def test_block_size_solution_is_the_largest_reaching_the_target():
    trace = exercise_03_workload()

    def utilization(P):
        return replay(
            trace, CountingPagedDesign(trace.num_sequences, trace.num_layers, trace.num_experts, P)
        ).effective_utilization

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


# --- 04 -------------------------------------------------------------------------------------------

check_max_num_seqs = _unwrapped(exercise_04.check_max_num_seqs)


def test_max_num_seqs_right_answer_runs_the_engine_and_passes():
    """Measured on the exercise's workload: 3 sequences at once never preempt, 4 do (the runs are
    the real engine, optimistic admission, 200 blocks)."""
    assert exercise_04._exercise_04_run(3)["preempted"] == 0
    assert exercise_04._exercise_04_run(4)["preempted"] > 0
    assert check_max_num_seqs(3).startswith("Right")
    message = check_max_num_seqs(4)
    assert message.startswith("Not yet") and "preempted" in message and "fewer sequences" in message


def test_max_num_seqs_messages_for_each_mistake(monkeypatch):
    """The check's reasoning on made-up runs, so that every branch is covered without serving."""
    runs = {
        m: {
            "steps": 600 // m,
            "preempted": 0 if m <= 2 else m,
            "recomputed_tokens": 0 if m <= 2 else 40 * m,
            "max_concurrent_sequences": m,
        }
        for m in exercise_04.EXERCISE_04_MAX_NUM_SEQS
    }
    monkeypatch.setattr(exercise_04, "_exercise_04_run", runs.__getitem__)
    assert check_max_num_seqs(None).startswith("No answer yet")
    assert "not one of the choices" in check_max_num_seqs(5)
    assert "neither does the next choice up" in check_max_num_seqs(
        1
    ) and "300 steps instead of 600" in check_max_num_seqs(1)
    assert check_max_num_seqs(2).startswith("Right")
    assert exercise_04.solution_max_num_seqs() == 2
    assert "preempted 6 time(s)" in check_max_num_seqs(6)


# --- 05 -------------------------------------------------------------------------------------------

check_victim_rule = _unwrapped(exercise_05.check_victim_rule)


def test_victim_rule_solution_makes_the_most_room_at_every_decision_and_passes():
    stats, decisions, error = exercise_05._run_victim_rule(exercise_05.solution_victim_rule)
    assert error is None and decisions and stats.num_finished == 20
    assert any(entries[-1][0] != chosen for _, entries, chosen in decisions)  # not always the newest
    for _, entries, chosen in decisions:
        room = {seq_id: held + step for seq_id, _, held, step, _ in entries}
        assert room[chosen] == max(room.values())
    assert check_victim_rule(exercise_05.solution_victim_rule).startswith("Right")


def test_victim_rule_wrong_rules_are_named():
    assert check_victim_rule(None).startswith("No answer yet")
    assert "not a function" in check_victim_rule(3)
    newest = check_victim_rule(lambda candidates, memory, need: candidates[-1])
    assert newest.startswith("Not yet") and "sequence_lru" in newest
    least = check_victim_rule(
        lambda candidates, memory, need: min(
            enumerate(candidates), key=lambda item: exercise_05.room_on_short_device(*item, memory, need)
        )[1]
    )
    assert "least" in least
    assert "ZeroDivisionError" in check_victim_rule(lambda candidates, memory, need: 1 / 0)
    assert "return one of the candidates" in check_victim_rule(lambda candidates, memory, need: -5)


# --- 07 -------------------------------------------------------------------------------------------

check_expert_placement = _unwrapped(exercise_07.check_expert_placement)


def _paired_routing():
    """Every token picks one of the pairs (0, 4), (1, 5), (2, 6), (3, 7), each pair as often: the
    best balanced placement on 2 ranks keeps each pair together (1 rank per token, K/V even);
    round-robin splits no pair either, contiguous splits them all."""
    selected = torch.zeros(400, 8, dtype=torch.bool)
    for token in range(400):
        pair = token % 4
        selected[token, [pair, pair + 4]] = True
    return selected


def test_expert_placement_solution_is_the_best_balanced_placement_and_passes():
    selected = _paired_routing()
    best = exercise_07.solution_expert_placement(selected)
    assert exercise_07.placement_measures(selected, best, 2) == (1.0, 1.0)
    assert check_expert_placement(best, selected).startswith("Right")
    assert check_expert_placement([0, 1, 0, 1, 0, 1, 0, 1], selected).startswith(
        "Right"
    )  # pairs together too


def test_expert_placement_wrong_answers_are_explained():
    selected = _paired_routing()
    assert check_expert_placement(None, selected).startswith("No answer yet")
    assert "each an integer from 0 to 1" in check_expert_placement([0, 1, 2, 0, 1, 0, 1, 0], selected)
    assert "each must hold 4" in check_expert_placement([0, 0, 0, 0, 0, 1, 1, 1], selected)
    split = check_expert_placement([0, 0, 0, 0, 1, 1, 1, 1], selected)  # every pair across ranks
    assert split.startswith("Not yet") and "2.000 ranks" in split and "0+4" in split
    skewed = selected.clone()
    skewed[:200, 0] = True  # expert 0 now takes many more tokens than the others
    assert "imbalance" in check_expert_placement([0, 0, 1, 1, 0, 0, 1, 1], skewed)


# --- 08 -------------------------------------------------------------------------------------------

check_tokens_per_split = _unwrapped(exercise_08.check_tokens_per_split)


def test_tokens_per_split_solution_is_the_largest_split_filling_the_gpu():
    # 8 resident blocks x 132 SMs = 1056 programs; 16 programs per split -> 66 splits -> 496 tokens
    right = exercise_08.solution_tokens_per_split(blocks_per_sm=8)
    assert right == 496
    assert exercise_08.split_k_programs(right) >= 1056 > exercise_08.split_k_programs(right + 16)
    assert check_tokens_per_split(right, 8).startswith("Right")


def test_tokens_per_split_wrong_answers_are_explained():
    assert check_tokens_per_split(None, 8).startswith("No answer yet")
    assert "round it up to 512" in check_tokens_per_split(500, 8)
    assert "Use smaller splits" in check_tokens_per_split(512, 8)
    assert "largest split that still fills it" in check_tokens_per_split(256, 8)
    assert "positive whole number" in check_tokens_per_split(-16, 8)


# --- 10 -------------------------------------------------------------------------------------------

check_drop_budget = _unwrapped(exercise_10.check_drop_budget)


def test_drop_budget_solution_is_the_smallest_budget_refusing_nothing_and_passes():
    """The longest row of the embedded model over the snippet: drop refuses nothing there and something
    one token lower (the paged cache's count), and it is well above the mean row k T / E."""
    lengths = exercise_10.exercise_10_row_lengths()  # (L, E)
    right = exercise_10.solution_drop_budget()
    num_tokens = len(exercise_10.exercise_10_text().encode())
    assert lengths.shape == (CONFIG.num_hidden_layers, CONFIG.num_attention_experts)
    assert (lengths.sum(1) == CONFIG.num_attention_experts_per_tok * num_tokens).all()  # top-2
    assert right == int(lengths.max()) > 1.5 * float(lengths.double().mean())
    assert exercise_10._exercise_10_refused(right) == 0 < exercise_10._exercise_10_refused(right - 1)
    assert check_drop_budget(right).startswith("Right")


def test_drop_budget_wrong_answers_are_explained():
    lengths = exercise_10.exercise_10_row_lengths()
    right = exercise_10.solution_drop_budget()
    num_tokens = len(exercise_10.exercise_10_text().encode())
    mean = float(lengths.double().mean())
    assert check_drop_budget(None).startswith("No answer yet")
    for bad in (0, -3, 2.5, True, "70"):
        assert "positive whole number" in check_drop_budget(bad)
    assert "whatever the routing" in check_drop_budget(num_tokens)
    assert "whatever the routing" in check_drop_budget(10**9)  # not a cache of 10^9 slots
    larger = check_drop_budget(right + 1)
    assert larger.startswith("Not yet") and "so does a smaller B" in larger
    assert "is the mean row" in check_drop_budget(round(mean))
    shorter = [
        (layer, int(n)) for layer, n in enumerate(lengths.max(1).values) if n < right and abs(n - mean) >= 1
    ]
    assert shorter  # some layer's longest row is shorter than the answer
    layer, n = shorter[0]
    assert f"longest row of layer {layer}" in check_drop_budget(n)
    below = check_drop_budget(right - 1)
    assert below.startswith("Not yet") and "refuses 1 pair(s)" in below


# --- 11 -------------------------------------------------------------------------------------------


def test_prompt_reservation_solution_is_the_scheduler_s_and_passes():
    """Notebook 11: the scheduler sets aside, on every GPU of bench cluster's cluster, L rows of
    ceil(T / P) blocks for a fresh prompt of T tokens under worst-case reservation (each GPU holds one
    expert of every layer, so a token opens at most one row there per layer), and far less under
    optimistic reservation; the pool is bench cluster's (its JSON's blocks at 0.5 GiB)."""
    from moekv_ref.sim.cluster import BLOCK_SIZE, MODEL, cluster_placement, pool_blocks

    config = get_config(MODEL)
    T = exercise_11.EXERCISE_11_PROMPT_TOKENS
    right = exercise_11.solution_prompt_reservation()
    assert right == config.num_hidden_layers * math.ceil(T / BLOCK_SIZE) == 24 * 63
    worst = exercise_11.exercise_11_reservation("worst_case")
    assert worst == (right,) * exercise_11.EXERCISE_11_DEVICES  # the same on every GPU
    assert cluster_placement(exercise_11.EXERCISE_11_DEVICES).tolist() == list(range(8))  # one expert a GPU
    optimistic = exercise_11.exercise_11_reservation("optimistic")
    assert len(set(optimistic)) == 1 and 3 * optimistic[0] < right < 4 * optimistic[0]
    cluster = json.loads((Path(__file__).resolve().parents[1] / "figures" / "bench_cluster.json").read_text())
    gib = exercise_11.EXERCISE_11_GIB_PER_DEVICE
    assert {r["blocks_per_device"] for r in cluster["runs"] if r["gib_per_device"] == gib} == {
        pool_blocks(gib)
    }
    assert check_prompt_reservation(right).startswith("Right")


def test_prompt_reservation_wrong_answers_are_explained():
    right = exercise_11.solution_prompt_reservation()
    optimistic = exercise_11.exercise_11_reservation("optimistic")[0]
    T = exercise_11.EXERCISE_11_PROMPT_TOKENS
    assert check_prompt_reservation(None).startswith("No answer yet")
    for bad in (0, -3, 2.5, True, "1512"):
        assert "positive whole number" in check_prompt_reservation(bad)
    assert "one row" in check_prompt_reservation(right // 24)
    assert "k = 2" in check_prompt_reservation(2 * right)
    assert "counts every GPU" in check_prompt_reservation(8 * right)
    assert "slots (tokens)" in check_prompt_reservation(24 * T)
    assert "Round up per row" in check_prompt_reservation(24 * T // 16)
    for expected in (optimistic, 24 * 2 * T // (8 * 16)):
        assert "*expected*" in check_prompt_reservation(expected)
    assert "too few" in check_prompt_reservation(right - 100)
    assert "too many" in check_prompt_reservation(right + 100)


# --- every check: the right answer passes, plausible wrong ones are refused without the answer ------


def _shows(message: str, value) -> bool:
    """Does `message` show `value` as a number of its own (not a digit inside another number)?"""
    return re.search(rf"(?<![\w.]){re.escape(str(value))}(?![\w]|\.\d)", message) is not None


def _everywhere_rule(candidates, memory, need):
    """Blocks summed over every device: the short device alone is short."""
    return max(candidates, key=lambda r: int(memory.blocks_held_per_device(r.request_id).sum()))


def _held_only_rule(candidates, memory, need):
    """Blocks on the short device, forgetting the first candidate's own step."""
    return max(candidates, key=lambda r: int(memory.blocks_held_per_device(r.request_id)[need.device]))


def _refusals():
    """(check, right answer, what the right answer shows as, wrong answers) for every notebook."""
    ratio = solution_flop_ratio(CONFIG)
    t = EXERCISE_01_CONTEXT_LENGTH
    selected = _selected()
    bytes_right = solution_expert_cache_bytes(selected, CONFIG)
    tokens = int(selected[2][:, 5].sum())
    block = solution_block_size()
    blocks = EXERCISE_03_BLOCK_SIZES
    paired = _paired_routing()
    placement = exercise_07.solution_expert_placement(paired)
    split = exercise_08.solution_tokens_per_split(8)
    budget = exercise_10.solution_drop_budget()
    reservation = exercise_11.solution_prompt_reservation()
    hit = exercise_06.solution_hit_tokens()
    family = json.loads((Path(__file__).resolve().parents[1] / "figures" / "family.json").read_text())
    perplexity = exercise_09.solution_perplexity_ratio(family)
    gap = math.log2(perplexity)
    variants = family["variants"]
    against_dense = 2.0 ** (
        variants["expert_topk"]["bits_per_byte_mean"] - variants["dense"]["bits_per_byte_mean"]
    )
    shared = exercise_06.EXERCISE_06_SHARED
    P = exercise_06.EXERCISE_06_BLOCK_SIZE
    return {
        "01": (
            lambda a: check_flop_ratio(a, CONFIG),
            ratio,
            [f"{ratio:.0f}", f"{ratio:.1f}"],
            [t + 1, (t + 1) ** 2, 1 / ratio, 0.9 * ratio, 1.2 * ratio],
        ),
        "02": (
            lambda a: check_expert_cache_bytes(a, selected, CONFIG),
            bytes_right,
            [bytes_right],
            [tokens, tokens * 256, selected[2].shape[0] * 512, int(selected[2].sum()) * 512],
        ),
        "03": (
            check_block_size,
            block,
            [],  # seven choices: the messages name the block sizes the reader tried
            [blocks[blocks.index(block) - 1], blocks[blocks.index(block) + 1], 64],
        ),
        "06": (check_hit_tokens, hit, [hit], [shared, hit + P, 128, hit - P, shared - 1]),
        "09": (
            lambda a: check_perplexity_ratio(a, family),
            perplexity,
            [f"{perplexity:.2f}", f"{perplexity:.3f}"],
            [gap, 1 / perplexity, against_dense, 1.5 * ratio],
        ),
        "07": (
            lambda a: check_expert_placement(a, paired),
            placement,
            [placement, [1 - r for r in placement]],
            [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]],
        ),
        "08": (lambda a: check_tokens_per_split(a, 8), split, [split], [split + 16, split - 16, 256, 64]),
        "10": (check_drop_budget, budget, [budget], [budget + 1, budget + 20, 20, 2 * budget]),
        "11": (
            check_prompt_reservation,
            reservation,
            [reservation],
            [
                reservation // 24,
                2 * reservation,
                8 * reservation,
                exercise_11.exercise_11_reservation("optimistic")[0],
            ],
        ),
    }


@pytest.mark.parametrize("notebook", ["01", "02", "03", "06", "07", "08", "09", "10", "11"])
def test_check_accepts_the_answer_and_refuses_wrong_ones_without_giving_it(notebook):
    check, right, shown, wrong = _refusals()[notebook]
    assert check(right).startswith("Right")
    assert len(wrong) >= 2
    for answer in wrong:
        message = check(answer)
        assert message.startswith("Not yet"), (answer, message)
        for value in shown:
            assert not _shows(message, value), (answer, value, message)


def test_max_num_seqs_check_refuses_wrong_answers_without_giving_the_answer():
    """The real engine's runs (3 never preempts, 4 does: the test above), no stand-ins."""
    assert check_max_num_seqs(3).startswith("Right")
    for answer in (2, 1, 4, 16):
        message = check_max_num_seqs(answer)
        assert message.startswith("Not yet") and "max_num_seqs = 3" not in message, message
        assert "neither does 3" not in message and "try 3" not in message


def test_victim_rule_check_refuses_the_rules_that_count_the_wrong_blocks():
    """Blocks summed over every device, and blocks on the short device without the first candidate's
    step, make the run's decisions right too: the hand-built shortages tell them apart."""
    everywhere = check_victim_rule(_everywhere_rule)
    assert everywhere.startswith("Not yet") and "every device" in everywhere
    held_only = check_victim_rule(_held_only_rule)
    assert held_only.startswith("Not yet") and "need.request_need" in held_only
    newest = check_victim_rule(lambda candidates, memory, need: candidates[-1])
    assert newest.startswith("Not yet")
    assert check_victim_rule(lambda candidates, memory, need: candidates[0]).startswith("Not yet")
    assert check_victim_rule(exercise_05.solution_victim_rule).startswith("Right")


def test_victim_rule_shortages_separate_the_usual_mistakes():
    """On each hand-built shortage the right rule's choice differs from at least one usual mistake,
    and every mistake is caught by at least one shortage."""
    right = exercise_05._victim_rule_on_shortages(exercise_05.solution_victim_rule)
    for rule in (_everywhere_rule, _held_only_rule):
        wrong = exercise_05._victim_rule_on_shortages(rule)
        assert any(r[2] != w[2] for r, w in zip(right, wrong))


def test_hit_tokens_is_the_engine_s_and_each_wrong_answer_gets_its_reason():
    """Notebook 06: the second prompt reuses 96 of the 100 shared tokens (six whole chunks of 16), as
    the real engine's prefix hit says; the shared count itself, a chunk too many and a number that is
    not whole chunks each get their own reason."""
    assert exercise_06.solution_hit_tokens() == 96
    assert "whole chunks" in check_hit_tokens(100)
    assert "share only their first 100" in check_hit_tokens(112)
    assert "whole number of chunks" in check_hit_tokens(90)
    assert "too few" in check_hit_tokens(80)
    assert check_hit_tokens(None).startswith("No answer yet")
