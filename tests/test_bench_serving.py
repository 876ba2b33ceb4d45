"""`bench serving`: three designs, one workload, one memory budget, one runner.

Wall-clock speedups depend on the machine, so the tests check what does not: the JSON shape, that
every design generates the same tokens, and that continuous batching on the paged pool needs far fewer
steps and holds more sequences at once than static batching under the same budget. The measured
speedup is printed by the benchmark (the command itself is tested in test_cli.py).
"""

from helpers import random_model, small_config

from moekv_ref.apps.bench_serving import DESIGNS, run_serving_benchmark
from moekv_ref.cache.budget import RowBudget


def test_designs_share_tokens_and_paged_batches_more():
    model = random_model(small_config("expert", "threshold"), seed=0)
    report = run_serving_benchmark(
        model,
        num_requests=10,
        num_blocks=160,
        block_size=4,
        prompt_len=(2, 20),
        output_len=(4, 24),
        max_num_seqs=16,
    )
    assert set(report["designs"]) == set(DESIGNS)
    for row in report["designs"].values():
        assert {"tokens_per_second", "max_concurrent_sequences", "preemptions", "recomputed_tokens"} <= set(
            row
        )
        assert row["refused"] == 0
    assert report["same_tokens_in_every_design"]
    static, reserved, paged = (report["designs"][d] for d in DESIGNS)
    assert static["preemptions"] == reserved["preemptions"] == 0
    assert (
        paged["max_concurrent_sequences"]
        > reserved["max_concurrent_sequences"]
        >= static["max_concurrent_sequences"]
    )
    assert static["steps"] >= 2 * paged["steps"]
    assert report["speedup_paged_vs_static"] > 0


def test_a_budget_makes_the_reservation_exact_and_small():
    """With at most 4 tokens per row, the reserved design's lifetime reservation is the capped worst case:
    it never preempts and holds more sequences at once than without the budget; the budgeted designs
    generate the same tokens as each other (not as the exact cache: the window evicts)."""
    model = random_model(small_config("expert", "threshold"), seed=0)
    report = run_serving_benchmark(
        model,
        num_requests=10,
        num_blocks=160,
        block_size=4,
        prompt_len=(2, 20),
        output_len=(4, 24),
        max_num_seqs=16,
        budget=RowBudget(4, "window"),
    )
    reserved, budgeted = (
        report["designs"]["continuous_reserved"],
        report["designs"]["continuous_reserved + budget"],
    )
    assert budgeted["preemptions"] == 0 and budgeted["refused"] == 0
    assert budgeted["max_concurrent_sequences"] > reserved["max_concurrent_sequences"]
    assert report["same_tokens_in_every_budgeted_design"]
    assert report["budget"] == {"max_tokens": 4, "policy": "window", "num_sinks": 3}  # one slot moves
    assert all(0 < row["mean_used_fraction"] <= 1 for row in report["designs"].values())


def test_the_budget_s_cost_in_quality_is_measured_beside_its_speed(monkeypatch):
    """budget_quality: held-out bits per byte under the budget against the exact cache, per window
    length; a budget no row can reach costs nothing (the recompute's float order aside), a binding
    one is measured as capacity.measure measures it."""
    import torch

    from moekv_ref.apps import bench_serving
    from moekv_ref.apps.capacity import heldout_windows, measure
    from moekv_ref.apps.train import load_corpus

    monkeypatch.setattr(bench_serving, "QUALITY_CONTEXTS", (24, 48))
    model = random_model(small_config("expert", "threshold", vocab_size=256), seed=0, dtype=torch.float32)
    tight = RowBudget(3, "window")
    quality = bench_serving.budget_quality(model, tight, num_windows=2)
    assert set(quality) == {"24", "48"}
    x, y = heldout_windows(load_corpus()[1], 2, 48)
    with torch.no_grad():
        expected = measure(model, x, y, tight)["bits_per_byte"]
    assert quality["48"]["bits_per_byte_budget"] == expected
    assert abs(quality["48"]["cost_bits_per_byte"]) > 1e-3
    loose = bench_serving.budget_quality(model, RowBudget(48, "window"), num_windows=2)
    assert all(abs(q["cost_bits_per_byte"]) < 1e-5 for q in loose.values())
