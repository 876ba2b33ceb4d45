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
