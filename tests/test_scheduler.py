"""The scheduler's arithmetic and policies (issue 4), without a model where possible.

Bounds: the worst case of one step and of a lifetime are upper bounds of what any routing can take
(checked against random routings), and exact on hand-made cases. The predictor starts at k_max and
follows what it observes. Bad configurations raise before anything exists.
"""

import pytest
import torch

from moekv_ref.engine.demand import (DemandPredictor, min_lifetime_blocks, reserved_blocks,
                                     worst_case_lifetime_blocks, worst_case_step_blocks)
from moekv_ref.engine.scheduler import SchedulerConfig


def blocks(counts, P):
    return int(((counts + P - 1) // P).sum())


def test_decode_worst_case_counts_only_rows_at_a_block_boundary():
    # P=4, E=4, k_max=2. Layer 0: rows hold 4, 8, 3, 0 tokens -> three rows are at a boundary (4, 8
    # and the empty one), so one token can open min(k_max, 3) = 2 blocks. Layer 1: rows 1, 2, 3, 5
    # all have room in their last block -> a decode token opens none.
    counts = torch.tensor([[[4, 8, 3, 0], [1, 2, 3, 5]]])
    assert worst_case_step_blocks(counts, torch.tensor([1]), k_max=2, block_size=4).tolist() == [2]


def test_prefill_worst_case_is_exact_on_an_empty_sequence():
    # 10 tokens, k_max=2, E=4, P=4: at most 20 entries, at most 10 per expert. Bound A (every expert
    # gets all 10) = 4 * 3 = 12; bound B = 4 rows + (20 - 4) // 4 = 8. Routing 5 tokens to each
    # expert reaches 8 (ceil(5/4) = 2 blocks each), so 8 is exact.
    counts = torch.zeros(1, 1, 4, dtype=torch.int64)
    assert worst_case_step_blocks(counts, torch.tensor([10]), k_max=2, block_size=4).tolist() == [8]


@pytest.mark.parametrize("seed", range(5))
def test_step_and_lifetime_bounds_hold_for_random_routings(seed):
    generator = torch.Generator().manual_seed(seed)
    L, E, k_max, P = 3, 6, 3, 4
    counts = torch.zeros(1, L, E, dtype=torch.int64)
    total = 0
    for _ in range(12):
        n = int(torch.randint(1, 6, (), generator=generator))
        bound = int(worst_case_step_blocks(counts, torch.tensor([n]), k_max, P)[0])
        before = blocks(counts, P)
        for _ in range(n):                      # each token to 1..k_max random experts per layer
            for layer in range(L):
                k = int(torch.randint(1, k_max + 1, (), generator=generator))
                experts = torch.randperm(E, generator=generator)[:k]
                counts[0, layer, experts] += 1
        total += n
        assert blocks(counts, P) - before <= bound
        assert min_lifetime_blocks(total, L, 1, P) <= blocks(counts, P)
        assert blocks(counts, P) <= worst_case_lifetime_blocks(total, L, E, k_max, P)
        assert worst_case_lifetime_blocks(total, L, E, k_max, P) <= reserved_blocks(total, L, E, P)


def test_predictor_starts_at_k_max_and_follows_observations():
    predictor = DemandPredictor(num_layers=2, num_experts=8, k_max=2, block_size=16)
    assert predictor.k_avg.tolist() == [2.0, 2.0]
    predictor.observe(torch.tensor([10, 15]), num_tokens=10)     # 1.0 and 1.5 experts per token
    assert predictor.k_avg.tolist() == [1.0, 1.5]
    # 64 tokens: layer 0 has 64 entries over min(8, 64) = 8 rows -> 64/16 + 8 * 15/16 = 11.5 -> 12;
    # layer 1 has 96 entries -> 6 + 7.5 = 13.5 -> 14
    assert predictor.predict(64) == 12 + 14


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_batched_tokens", -1),
                                         ("policy", "fifo"), ("admission", "lucky"),
                                         ("preemption_mode", "evict_one_expert")])
def test_bad_scheduler_config_names_the_value(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})
