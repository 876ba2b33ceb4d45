"""Sizes with a stated upper bound, options refused where they would do nothing, and row budgets whose
messages and allocations follow what a row can hold: each refused at once, before anything runs, with
one message naming the option (or argument) and what is allowed."""

import re

import pytest
import torch
from helpers import random_model, random_prompts, small_config

from moekv_ref.apps import bench_cluster, bench_serving, bench_simulator
from moekv_ref.apps.cli import main
from moekv_ref.cache import BudgetedKVCacheManager, BudgetedPagedKVCache
from moekv_ref.cache.budget import RowBudget
from moekv_ref.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from moekv_ref.config import get_config
from moekv_ref.engine import LLMEngine, SchedulerConfig
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams
from moekv_ref.validation import MAX_COMPACT_TRACE_REQUESTS, MAX_SERVING_REQUESTS, MAX_TRACE_REQUESTS


@pytest.fixture
def nothing_runs(monkeypatch):
    """The benchmarks' work replaced by a failure: a refused option must stop before any of it."""

    def ran(*args, **kwargs):
        raise AssertionError("the benchmark ran although an option should have been refused")

    for module, name in (
        (bench_serving, "load_checkpoint"),
        (bench_serving, "run_serving_benchmark"),
        (bench_cluster, "cluster_workload"),
        (bench_cluster, "measure_sessions"),
        (bench_simulator, "measure_speed"),
        (bench_simulator, "measure_scale"),
    ):
        monkeypatch.setattr(module, name, ran)


def refusal(capsys, argv) -> str:
    """The parser error of `python -m moekv_ref *argv` (exit status 2), as stderr's last line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ----- sizes with no upper bound ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["bench", "serving", "--num-requests", "1000000000"],
            f"--num-requests=1000000000 is not allowed; allowed: an integer in [1, {MAX_SERVING_REQUESTS}]",
        ),
        (
            ["bench", "cluster", "--requests", "1000000000"],
            f"--requests=1000000000 is not allowed; allowed: an integer in [1, {MAX_TRACE_REQUESTS}]",
        ),
        (
            ["bench", "cluster", "--sessions", "--requests", "1000000000"],
            f"--requests=1000000000 is not allowed; allowed: an integer in [1, {MAX_TRACE_REQUESTS}]",
        ),
        (
            ["bench", "simulator", "--scale", "--requests", "1000000000"],
            f"--requests=1000000000 is not allowed; allowed: an integer in [1, {MAX_COMPACT_TRACE_REQUESTS}]",
        ),
        (  # 1,000 requests for each of 1 + 128 groups: the bound is on every trace the sweep builds
            ["bench", "cluster", "--requests", "1000", "--devices", "8", "1024"],
            "--requests=1000 with --devices 8 1024 is not allowed: the sweep builds 129 groups' traces",
        ),
    ],
)
def test_a_size_past_its_bound_is_refused_before_anything_runs(capsys, nothing_runs, argv, message):
    assert message in refusal(capsys, argv)


def test_the_largest_sizes_within_the_bounds_pass_the_checks():
    for module, argv in (
        (bench_serving, ["--num-requests", str(MAX_SERVING_REQUESTS)]),
        (bench_cluster, ["--requests", str(MAX_TRACE_REQUESTS)]),
        (bench_simulator, ["--scale", "--requests", str(MAX_COMPACT_TRACE_REQUESTS)]),
        (bench_simulator, ["--requests", str(MAX_TRACE_REQUESTS)]),
        (bench_cluster, ["--requests", str(MAX_TRACE_REQUESTS // 129), "--devices", "8", "1024"]),
    ):
        module.check_args(module.build_parser(bench_cluster.argparse.ArgumentParser()).parse_args(argv))


# ----- options that would do nothing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--quick", "--requests", "5"],
            "--quick sets its own --requests (40): give either --quick or --requests",
        ),
        (
            ["--think-seconds", "3"],
            "--think-seconds applies to --sessions, not to the sweep (no --sessions)",
        ),
        (["--sessions", "--policies", "sequence_lru"], "--policies applies to the sweep, not to --sessions"),
        (
            ["--sessions", "--workload", "splitwise_code"],
            "--workload applies to the sweep, not to --sessions",
        ),
        (["--quick", "--rates", "100", "200"], "--quick runs the first of --rates only"),
        (["--quick", "--gib-per-device", "0.5", "1"], "--quick runs the first of --gib-per-device only"),
    ],
)
def test_bench_cluster_refuses_an_option_its_program_ignores(capsys, nothing_runs, argv, message):
    assert message in refusal(capsys, ["bench", "cluster", *argv])


def test_bench_serving_refuses_a_budget_policy_without_a_budget(capsys, nothing_runs):
    message = refusal(capsys, ["bench", "serving", "--budget-policy", "drop"])
    assert "--budget-policy drop applies to --budget, which is not given" in message


@pytest.mark.parametrize(
    "argv",
    [
        ["--sessions", "--think-seconds", "3"],
        ["--quick", "--gib-per-device", "0.5"],
        ["--sessions", "--quick", "--rates", "400"],
        ["--devices", "2", "--gib-per-device", "0.005859375"],  # the least: 48 blocks of 128 KiB
    ],
)
def test_bench_cluster_takes_those_options_where_they_are_read(argv):
    bench_cluster.check_args(bench_cluster.build_parser().parse_args(argv))


def test_bench_cluster_options_left_out_are_the_documented_defaults():
    args = bench_cluster.with_defaults(bench_cluster.build_parser().parse_args([]))
    assert (args.devices, args.workload, args.arrivals) == ([8], "azure_conversation_2023", ["poisson"])
    assert (args.think_seconds, args.seed, args.max_num_seqs) == (5.0, 0, 256)
    assert args.policies == list(bench_cluster.POLICIES)


@pytest.mark.parametrize(
    "devices, least_gib, blocks",
    [("8", "0.00292969", 24), ("2", "0.00585938", 48)],  # 24 layers x min(E / D, top-2) blocks of 128 KiB
)
def test_too_little_memory_per_gpu_is_refused_naming_the_option_and_the_least(
    capsys, nothing_runs, devices, least_gib, blocks
):
    message = refusal(capsys, ["bench", "cluster", "--devices", devices, "--gib-per-device", "1e-9"])
    assert f"--gib-per-device=1e-09 is not allowed; allowed: a finite number in [{least_gib}, " in message
    assert f"one token takes {blocks} blocks of 128 KiB on a GPU of --devices {devices}" in message
    assert "blocks_per_device" not in message


# ----- row budgets -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [10**6, 2**31 - 1])
def test_a_budget_above_the_model_s_positions_allocates_for_the_positions_and_is_the_exact_cache(max_tokens):
    """B above max_position_embeddings never binds: the cache's slot arrays have at most the model's
    positions per row (not B), and generate gives the exact cache's tokens and logits, bit for bit."""
    model = random_model(small_config("expert"), seed=2, dtype=torch.float32)
    positions = model.config.max_position_embeddings
    cache = BudgetedPagedKVCache.for_model(model, budget=RowBudget(max_tokens, "window"))
    assert cache.manager.budget.num_slots <= positions
    assert cache.manager.budget.slot_position.shape[1] <= positions
    assert cache.manager.budget.max_tokens == max_tokens  # kept as given, for what a report shows
    prompts = random_prompts([4, 9], model.config.vocab_size, seed=1)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=i) for i in range(2)]
    exact = generate(model, prompts, params, cache="paged", record_logits=True)
    budgeted = generate(
        model, prompts, params, cache="paged", record_logits=True, budget=RowBudget(max_tokens, "window")
    )
    assert budgeted.tokens == exact.tokens
    assert all(torch.equal(a, b) for a, b in zip(budgeted.logits, exact.logits))


def test_the_budgeted_recompute_allocates_for_the_tokens_not_for_b(monkeypatch):
    """model(tokens, budget=...) keeps slot arrays of min(B, T) per row: with B = 2**31 - 1 it runs
    (rather than asking for 2**31 slots a row) and gives the logits without a budget."""
    model = random_model(small_config("expert"), seed=4)
    tokens = torch.tensor(random_prompts([12], model.config.vocab_size, seed=3))
    assert torch.allclose(model(tokens, budget=RowBudget(2**31 - 1)).logits, model(tokens).logits, atol=1e-10)


def test_a_budget_whose_slots_cannot_fit_is_refused_naming_the_budget():
    """A manager without a model bounds a row by its pool only: a pool of 2**27 blocks of 16 lets a
    row hold 2**31 tokens, and B = 2**31 - 1 slots for each row would take terabytes: refused with a
    message that names max_tokens and says what is allowed."""
    with pytest.raises(ValueError) as error:
        BudgetedKVCacheManager(4, 8, 16, 2**27, budget=RowBudget(2**31 - 1))
    message = str(error.value)
    assert message.startswith("the slot arrays of RowBudget(max_tokens=2147483647, policy='window'")
    assert "allowed: at most this machine's" in message and "max_tokens at most" in message


def test_a_request_refused_or_served_agrees_with_the_message_s_bounds():
    """A row budget of 32 lowers a request's fewest blocks as it lowers its most: the request of
    100 + 81 tokens (tiny, top-2, blocks of 16) needs at least 4 x ceil(2 x 32 / 16) = 16 and at most
    64 blocks; a pool of 63 may not hold it (refused, with those numbers), and a pool of the message's
    upper bound serves it, holding no fewer blocks than its lower bound."""
    model = load_checkpoint(DEFAULT_CHECKPOINT, get_config("tiny").with_routing("topk"))
    prompt = list(range(1, 101))
    params = SamplingParams(max_new_tokens=81, temperature=0.0)
    small = LLMEngine(model, 63, 16, SchedulerConfig(), budget=RowBudget(32, "window"))
    with pytest.raises(ValueError) as error:
        small.add_request(prompt, params)
    message = str(error.value)
    assert "may not fit even alone in the pool of 63 blocks" in message
    least, most = (int(n) for n in re.search(r"at least (\d+) and up to (\d+) blocks", message).groups())
    assert (least, most) == (16, 64)
    engine = LLMEngine(model, most, 16, SchedulerConfig(), budget=RowBudget(32, "window"))
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert least <= engine.stats().peak_used_blocks <= most
    assert engine.stats().num_generated_tokens == 81


def test_sinks_at_or_above_the_budget_are_refused():
    with pytest.raises(ValueError, match=r"num_sinks=4 is not allowed; allowed: an integer in \[0, 3\]"):
        RowBudget(4, "window", num_sinks=4)
    with pytest.raises(ValueError, match=r"num_sinks=3 is not allowed; allowed: an integer in \[0, 2\]"):
        RowBudget([6, 3], "window", num_sinks=3)  # below every layer's B
    assert RowBudget(4, "window", num_sinks=3).num_sinks == 3
    assert RowBudget(2).num_sinks == 1  # left out: StreamingLLM's 4, lowered so that one slot moves
    assert RowBudget(64).num_sinks == 4
    assert RowBudget(2, "drop", num_sinks=4).num_sinks == 4  # read by window only


# ----- negative numbers after an option ------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--temperature", "-inf"],
            "--temperature=-inf is not allowed; allowed: a finite number in [0, inf)",
        ),
        (
            ["--temperature", "-1e3"],
            "--temperature=-1000.0 is not allowed; allowed: a finite number in [0, inf)",
        ),
        (["--temperature", "-nan"], "--temperature=nan is not allowed; allowed: a finite number in [0, inf)"),
        (["--top-p", "-inf"], "--top-p=-inf is not allowed; allowed: a finite number in (0, 1]"),
    ],
)
def test_a_negative_number_reaches_the_option_s_own_rule(capsys, argv, message):
    assert message in refusal(capsys, ["generate", "--prompt", "x", *argv])
