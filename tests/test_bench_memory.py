"""The simulator, the baselines and `bench memory`.

Scenario tests pin exact numbers on hand-made traces (why each number is what it is, in a comment);
equivalence tests show the count-level paged design equals the real KVCacheManager step by step, and
a recorded trace equals what the model's cache really held.
"""

import json

import pytest
import torch
from helpers import random_model, small_config

from moekv_ref.analysis import record_model_trace
from moekv_ref.apps.bench_memory import build_report, compare_designs, format_table
from moekv_ref.apps.bench_memory import main as bench_main
from moekv_ref.generate import generate
from moekv_ref.plots.memory import block_owners
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim import (
    CountingPagedDesign,
    ManagerPagedDesign,
    RoutingTrace,
    SharedTailDesign,
    max_concurrent_sequences,
    replay,
    synthetic_trace,
)
from moekv_ref.sim.contiguous_designs import AddressSpace, FirstFitDesign, ReservedDesign


def hand_trace(kv_bytes_per_slot=1) -> RoutingTrace:
    """One layer, E=2. Sequence 0: 3 tokens (prompt 2), all to expert 0. Sequence 1: 2 tokens
    (prompt 1), token 0 to experts 0 and 1, token 1 to expert 1."""
    experts = torch.tensor([[[0, -1]], [[0, -1]], [[0, -1]], [[0, 1]], [[1, -1]]], dtype=torch.int16)
    return RoutingTrace(
        experts,
        torch.tensor([0, 3, 5]),
        torch.tensor([2, 1]),
        num_experts=2,
        kv_bytes_per_slot=kv_bytes_per_slot,
        name="hand",
    )


def test_replay_scenario_exact_numbers():
    trace = hand_trace()
    # step 0 (prefill): rows (0,e0)=2, (1,e0)=1, (1,e1)=1 -> live 4
    # step 1: seq 0 token 2 -> (0,e0)=3; seq 1 token 1 -> (1,e1)=2 -> live 6, then both finish
    stats = replay(trace, CountingPagedDesign(2, 1, 2, block_size=2))
    # P=2 blocks: step 0 holds 3 blocks (6 slots), step 1 holds 2 + 1 + 1 = 4 blocks (8 slots)
    assert (stats.num_steps, stats.slot_appends) == (2, 6)
    assert stats.live_bytes_time_sum == 4 + 6 and stats.allocated_bytes_time_sum == 6 + 8
    shared = replay(trace, SharedTailDesign(2, 1, 2, block_size=2))
    # step 0: body blocks: (0,e0) one; tails: seq 1 has 2 tail tokens -> 1 tail block: 2 blocks
    # step 1: (0,e0)=3 -> 1 body + tail 1 (seq 0: 1 tail block); (1,e1)=2 -> 1 body; seq 1's tail
    #         is (1,e0)'s one token -> 1 tail block: 1 + 1 + 1 + 1 = 4 blocks
    assert shared.allocated_bytes_time_sum == 2 * 2 + 4 * 2
    reserved = replay(trace, ReservedDesign(2, 1, 2))
    # every row reserves the sequence's length: 2 rows x 3 + 2 rows x 2 = 10 slots, both steps
    assert reserved.allocated_bytes_time_sum == 20


def test_address_space_first_fit_and_coalescing():
    space = AddressSpace()
    a, b, c = space.allocate(4), space.allocate(2), space.allocate(4)
    assert (a, b, c, space.top) == (0, 4, 6, 10)
    space.free(a, 4)  # hole [0, 4)
    assert space.allocate(2) == 0  # first fit takes the low hole: hole [2, 4) remains
    assert space.allocate(3) == 10  # does not fit the 2-slot hole: goes on top
    space.free(b, 2)  # [2, 4) + [4, 6) coalesce into [2, 6)
    assert space.hole_starts.tolist() == [2] and space.hole_sizes.tolist() == [4]
    space.free(10, 3)  # the top buffer: the heap shrinks back to 10
    assert space.top == 10


def test_first_fit_growth_leaves_holes():
    design = FirstFitDesign(num_sequences=2, num_layers=1, num_experts=1)
    design.append(torch.tensor([0, 1]), torch.tensor([1, 1]))  # buffers of 1 at 0 and 1
    design.append(torch.tensor([0]), torch.tensor([1]))  # row 0 -> 2 slots at 2; hole [0,1)
    memory = design.memory_map()
    assert memory["start"].tolist() == [2, 1] and memory["size"].tolist() == [2, 1]
    assert memory["hole_start"].tolist() == [0] and design.allocated_slots() == 4
    design.release([0, 1])
    assert design.allocated_slots() == 0 and design.space.num_holes == 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_manager_design_equals_counting_design(block_size):
    """The formula (a row of n tokens owns ceil(n/P) blocks) is what the real manager allocates."""
    trace = synthetic_trace(6, num_layers=3, num_experts=8, top_k=2, mean_prompt=20, mean_output=15, seed=1)
    L, E = trace.num_layers, trace.num_experts
    manager = ManagerPagedDesign(6, L, E, block_size, num_blocks=trace.num_slot_appends + 1, shuffle_seed=3)
    counting = CountingPagedDesign(6, L, E, block_size)
    a, b = replay(trace, manager, count_reads=True), replay(trace, counting, count_reads=True)
    assert (a.allocated_bytes_time_sum, a.metadata_bytes_time_sum, a.decode_reads) == (
        b.allocated_bytes_time_sum,
        b.metadata_bytes_time_sum,
        b.decode_reads,
    )
    manager.manager.assert_consistent()
    assert manager.manager.num_free_blocks == manager.manager.num_blocks  # everything came back


def test_synthetic_trace_topk_identity_and_skew():
    trace = synthetic_trace(4, num_layers=2, num_experts=16, top_k=4, zipf_s=1.0, seed=0)
    assert trace.num_slot_appends == 4 * 2 * int(trace.lengths.sum())  # exactly k per token per layer
    first_layer = trace.experts[:, 0].reshape(-1).to(torch.int64)
    popularity = torch.bincount(first_layer, minlength=16).sort(descending=True).values
    assert popularity[0] > 3 * popularity[-1]  # Zipf: a hot expert exists
    with pytest.raises(ValueError, match="top_k=5 is greater than num_experts=4"):
        synthetic_trace(1, 1, 4, 5)


@pytest.mark.parametrize("routing", ["topk", "threshold"])
def test_recorded_trace_matches_what_the_cache_held(routing):
    model = random_model(small_config("expert", routing), seed=4, dtype=torch.float32)
    prompts, outputs = [[1, 2, 3], [7, 8, 9, 10, 11]], [5, 3]
    trace = record_model_trace(model, prompts, outputs)
    result = generate(
        model,
        prompts,
        [SamplingParams(max_new_tokens=n, temperature=0.0) for n in outputs],
        cache="contiguous",
    )
    design = CountingPagedDesign(2, trace.num_layers, trace.num_experts, block_size=1)
    design.append(*trace.prefill_appends(torch.arange(2)))
    for step in range(max(outputs) - 1):
        running = torch.tensor([s for s in range(2) if len(prompts[s]) + step < trace.lengths[s]])
        rows = trace.decode_appends(running, trace.prompt_lens[running] + step)[0]
        design.append(rows, torch.ones_like(rows))
    assert torch.equal(design.tokens.view(2, trace.num_layers, trace.num_experts), result.cache_counts)


def test_max_concurrent_sequences_under_a_budget():
    trace = synthetic_trace(12, num_layers=4, num_experts=16, top_k=2, mean_prompt=30, mean_output=30, seed=5)
    L, E = trace.num_layers, trace.num_experts
    budget = trace.subset(list(range(4))).num_slot_appends * trace.kv_bytes_per_slot
    paged = max_concurrent_sequences(trace, lambda n: SharedTailDesign(n, L, E, 16), budget)
    reserved = max_concurrent_sequences(trace, lambda n: ReservedDesign(n, L, E), budget)
    assert paged >= 3 and reserved <= 1 and paged >= 3 * max(reserved, 1)


def small_report():
    traces = {
        name: synthetic_trace(
            8, num_layers=4, num_experts=E, top_k=K, mean_prompt=64, mean_output=64, seed=i, name=name
        )
        for i, (name, E, K) in enumerate([("W1", 8, 2), ("W2", 64, 8), ("W3", 8, 2)])
    }
    return build_report(traces, block_size=16, w1_source="test", speed_repeats=1, sweep_sequences=4)


def test_bench_report_shape_and_the_designs_it_compares(tmp_path):
    report = small_report()
    for workload in ("W1", "W2", "W3"):
        for design in ("paged", "paged_shared_tail", "reserved", "first_fit"):
            entry = report["workloads"][workload][design]
            assert set(entry) >= {"utilization", "effective_utilization", "max_concurrent_sequences"}
            assert 0 < entry["effective_utilization"] <= entry["utilization"] <= 1
        results = report["workloads"][workload]
        # shared tails waste < P slots per sequence, not per row: >= 0.96 even on short rows
        assert results["paged_shared_tail"]["effective_utilization"] >= 0.96
        assert (
            results["paged"]["utilization"]
            > results["first_fit"]["utilization"]
            > results["reserved"]["utilization"]
        )
    assert report["simulator"]["slot_appends_per_second"] > 0
    sweep = {(r["block_size"], r["design"]): r for r in report["block_size_sweep"]["rows"]}
    # plain pages: tail waste grows with the block size; P = 1 wastes nothing but pays metadata
    assert sweep[(1, "paged")]["utilization"] == 1.0
    assert sweep[(256, "paged")]["utilization"] < sweep[(16, "paged")]["utilization"]
    assert sweep[(1, "paged")]["metadata_fraction"] > sweep[(16, "paged")]["metadata_fraction"]
    assert "W2" in format_table(report)
    json.dumps(report)  # serializable as it is


def test_bench_cli_rejects_bad_block_size(capsys):
    with pytest.raises(SystemExit) as exit_info:  # parser.error, before anything runs
        bench_main(["--block-size", "12"])
    assert exit_info.value.code == 2 and "--block-size=12 is not allowed" in capsys.readouterr().err


def test_compare_designs_orders_the_designs():
    results = compare_designs(num_experts=16, block_size=16, zipf_s=1.0, num_sequences=4, num_layers=2)
    assert results["paged_shared_tail"]["utilization"] > results["paged"]["utilization"]
    assert results["paged"]["utilization"] > results["reserved"]["utilization"]


def test_block_owners_and_drawings_mid_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moekv_ref.plots.memory import draw_first_fit_map, draw_pool

    trace = synthetic_trace(4, num_layers=2, num_experts=4, top_k=2, mean_prompt=10, mean_output=10, seed=2)
    paged = ManagerPagedDesign(4, 2, 4, block_size=4, num_blocks=200, shuffle_seed=0)
    first_fit = FirstFitDesign(4, 2, 4)
    stats = replay(trace, paged, max_steps=5)
    replay(trace, first_fit, max_steps=5)
    assert stats.num_steps == 5
    owner_row, used = block_owners(paged.manager)
    held = owner_row >= 0
    assert int(held.sum()) == paged.manager.pool.num_used_blocks
    assert int(used.sum()) == int(paged.manager.row_tokens.sum())  # every token in one slot
    assert (used[held] >= 1).all() and (used <= 4).all()
    fig, (a, b) = plt.subplots(1, 2)
    draw_first_fit_map(a, first_fit, "seq")
    draw_pool(b, paged, "expert")
    plt.close(fig)
