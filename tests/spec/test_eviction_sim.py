"""The trace runner (the engine's Scheduler over a routing trace) and the victim policies: exact
victims on hand-made traces (why in each comment), every policy runs a skewed workload to the end
with no leaked block on any device and every request finished or refused, the memory-time bound is
never beaten, offline policies refuse to run without the future, the cost model's fit and
crossover, and density. tests/spec/test_sim_vs_engine.py checks the runner against the engine itself."""

import pytest
import torch

from moekv_ref.apps.bench_eviction import compare_policies, format_comparison
from moekv_ref.costs import CostModel, crossover_context, fit_cost_model
from moekv_ref.engine import SchedulerConfig
from moekv_ref.engine.victims import VICTIM_POLICIES, Belady, Oracle
from moekv_ref.sim.density import density_per_expert, mean_blocks_at_context
from moekv_ref.sim.runner import RunnerSetup, memory_time_bound, simulate
from moekv_ref.sim.traces import RoutingTrace
from moekv_ref.sim.workloads import skewed_workload, workload_cost_model

FLAT = CostModel("flat", 0.0, 1.0, 0.0, float("inf"), 1.0, 0.0, 1)  # recompute 1 s/token, swap 2 s/block


def hand_trace(experts_of_seq, lengths, prompt=1):
    """One layer, two experts, top-1; sequence s sends every token to experts_of_seq[s]."""
    parts = [torch.full((n, 1, 1), e, dtype=torch.int16) for e, n in zip(experts_of_seq, lengths)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    return RoutingTrace(torch.cat(parts), offsets, torch.full((len(lengths),), prompt), 2, 1)


# A (seq 0) and C (seq 1) use expert 0 on device 0; B (seq 2) expert 1 on device 1. Each device has 3
# blocks of 1 token. All three are admitted at step 0 (1 block each). At step 1 each request reserves
# the worst case of its token: 1 block on *each* device (the router could send it to either expert).
# A, the oldest, is scheduled first and takes device 0's last free block; then C is short there, and
# the victim is chosen among the requests not yet scheduled, C and B.
TRACE = hand_trace([0, 0, 1], [3, 3, 3])
PLACEMENT = torch.tensor([0, 1])
SETUP = RunnerSetup(blocks_per_device=3, block_size=1, max_num_seqs=4)


def first_evictions(policy, trace=TRACE, setup=SETUP):
    stats = simulate(trace, PLACEMENT, setup, policy, FLAT)
    return [(r.step, r.request_id, r.mode, r.freed) for r in stats.evictions[:2]], stats


def test_sequence_lru_evicts_the_newest_even_when_it_frees_nothing_on_the_short_device():
    records, stats = first_evictions("sequence_lru")
    # B is newest and holds nothing on device 0 (frees [0, 1]); then C, the newest left, frees [1, 0]
    assert records == [(1, 2, "recompute", [0, 1]), (1, 1, "recompute", [1, 0])]
    assert stats.num_finished == 3 and stats.used_blocks.shape == (stats.num_steps, 2)


def test_pressure_aware_evicts_a_sequence_holding_the_short_device():
    records, stats = first_evictions("pressure_aware")
    # C makes room on device 0 (1 held + its step's 1), B none: one eviction makes C's step fit
    assert records[0] == (1, 1, "recompute", [1, 0])
    assert stats.evictions[0].short_device == 0


def test_expert_lru_drops_the_least_recently_used_row_and_stalls_its_sequence():
    records, stats = first_evictions("expert_lru")
    # the only row on device 0 among the candidates is C's (appended at step 0): it goes, C stalls
    assert records[0] == (1, 1, "rows", [1, 0])
    assert stats.recomputed_tokens >= 1  # C must run its context again
    assert stats.num_finished == 3


def test_oracle_admits_only_what_fits_to_completion_and_never_evicts():
    records, stats = first_evictions("oracle")
    # with A running, C's reservations would pass device 0's 3 blocks: held back (and B behind it, FIFO)
    assert records == [] and stats.recomputed_tokens == 0 and stats.num_finished == 3
    assert [e for e in stats.events if e[0] == 0] == [(0, 0, "admitted")]


def test_belady_evicts_the_sequence_that_would_hold_the_short_device_longest():
    # A, C, D on expert 0 (device 0, 4 blocks), B on expert 1. At step 1 A takes device 0's last free
    # block; C and D are short of room there, for the same recompute. pressure_aware takes C (its own
    # step's block counts as room too); belady reads the future: C ends after 2 tokens (2 block-steps
    # to come on device 0), D after 4 (2 + 3 + 4 = 9): D goes
    trace = hand_trace([0, 0, 0, 1], [3, 2, 4, 3])
    setup = RunnerSetup(blocks_per_device=4, block_size=1, max_num_seqs=4)
    aware, _ = first_evictions("pressure_aware", trace, setup)
    belady, stats = first_evictions("belady", trace, setup)
    assert aware[0] == (1, 1, "recompute", [1, 0])
    assert belady[0] == (1, 2, "recompute", [1, 0]) and stats.num_finished == 4


def test_with_host_blocks_victims_are_swapped():
    setup = RunnerSetup(blocks_per_device=3, block_size=1, max_num_seqs=4, num_host_blocks=8)
    records, stats = first_evictions("pressure_aware", setup=setup)
    assert records[0] == (1, 1, "swap", [1, 0]) and stats.swapped_bytes > 0 and stats.recomputed_tokens == 0


def test_every_policy_finishes_a_skewed_workload_without_leaks_and_under_the_bound():
    trace, _, placement = skewed_workload(
        num_sequences=10, num_layers=2, mean_prompt=8, mean_output=48, seed=1
    )
    setup = RunnerSetup(blocks_per_device=80, block_size=4, max_num_seqs=8, num_host_blocks=30)
    comparison = compare_policies(trace, placement, setup, workload_cost_model(trace, 4))
    bound = memory_time_bound(trace, placement, setup)
    for name, stats in comparison["stats"].items():  # the runner asserts no leak on every device
        assert stats.num_finished + stats.num_refused == trace.num_sequences, name
        assert stats.finished_tokens == bound["finished_tokens"], name
        assert stats.tokens_per_step <= bound["tokens_per_step"] + 1e-9, name
    assert comparison["stats"]["oracle"].num_evictions == 0
    assert all(s.num_evictions > 0 for name, s in comparison["stats"].items() if name != "oracle")
    assert "pressure_aware" in format_comparison(comparison)


def test_unknown_and_offline_policies_are_named():
    with pytest.raises(ValueError, match="policy='lfu' is not one of"):
        simulate(TRACE, PLACEMENT, SETUP, "lfu", FLAT)
    assert set(VICTIM_POLICIES) == {
        "newest_first",
        "sequence_lru",
        "expert_lru",
        "pressure_aware",
        "oracle",
        "belady",
    }
    for policy in (Oracle, Belady):
        with pytest.raises(ValueError, match=rf"victim='{policy.name}' reads the future .* give it future="):
            policy()
    with pytest.raises(ValueError, match="victim='belady' reads the future"):
        SchedulerConfig(victim="belady").make_victim_policy()


def test_fit_recovers_constants_and_crossover():
    contexts = torch.tensor([16, 64, 256, 1024])
    recompute = 1e-3 + 2e-6 * contexts + 1e-9 * contexts * (contexts + 1) / 2
    blocks = contexts // 4 + 10
    swap = 2 * (5e-4 + blocks * 1e-6)
    cost = fit_cost_model(contexts, recompute, blocks, swap, 64)
    assert cost.seconds_per_token == pytest.approx(2e-6, rel=1e-6)
    assert cost.seconds_per_token_pair == pytest.approx(1e-9, rel=1e-6)
    assert cost.seconds_per_block == pytest.approx(1e-6, rel=1e-6)
    assert cost.seconds_per_swap == pytest.approx(5e-4, rel=1e-6)
    # c = 1024: swap 2 (5e-4 + 266e-6) = 1.53e-3 < recompute 2.57e-3; c = 256: 1.15e-3 > 5.45e-4
    assert crossover_context(cost, contexts, blocks) == 1024


def test_density_and_blocks_on_a_hand_trace():
    trace = hand_trace([0, 0, 1], [4, 4, 4])
    assert density_per_expert(trace, 2).tolist() == [[2 / 3, 1 / 3]]
    # 3 tokens in one row: ceil(3 / 2) = 2 blocks, for every sequence
    assert mean_blocks_at_context(trace, [1, 3], 2).tolist() == [1.0, 2.0]
