"""Steady-state measurement (sim/steady_state.py) and the decode-heavy workload (sim/workloads.py)."""

import math
from dataclasses import replace

import pytest
import torch

from moekv_ref.apps.bench_cluster import ACTIVE_PARAMS, cluster_workload
from moekv_ref.config import get_config
from moekv_ref.costs import CostModel, cluster_cost_model
from moekv_ref.sim.cluster import BLOCK_SIZE, MODEL, cluster_placement
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.steady_state import (
    TTFT_SLO,
    ample_blocks_per_device,
    capacity,
    capacity_rate,
    goodput_by_bisection,
    interpolated_goodput,
    latency_arrays,
    saturated_step_seconds,
    scaled_tpot_slo,
    steady_window,
    trace_lengths,
    window_attainment,
    working_set,
    working_set_blocks,
)
from moekv_ref.sim.traces import topic_trace
from moekv_ref.sim.workloads import (
    DECODE_HEAVY_OUTPUT_SIGMA,
    arrival_times,
    cut_to_fit,
    decode_heavy_lengths,
    latency_summary,
)

# a step costs 1 s whatever it computes: completion times are step counts
ONE_SECOND_STEPS = CostModel("steps", 1.0, 0.0, 0.0, float("inf"), 0.0, 0.0, 1)
DEVICES = 8


def small_cluster(num_requests: int = 60, max_num_seqs: int = 8, seed: int = 0):
    """bench cluster's model on 8 H200s over a few requests of the published lengths; a batch of
    max_num_seqs, so that 60 requests saturate it. blocks_per_device=1: the functions give their own."""
    trace = cluster_workload(num_requests, "azure_conversation_2023", seed)
    setup = RunnerSetup(
        blocks_per_device=1,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        admission="predicted",
    )
    cost = cluster_cost_model(get_config(MODEL), ACTIVE_PARAMS, DEVICES, BLOCK_SIZE)
    return trace, cluster_placement(DEVICES), setup, cost


@pytest.fixture(scope="module")
def cluster():
    return small_cluster()


@pytest.fixture(scope="module")
def cluster_capacity(cluster):
    return capacity(*cluster)


# ----- steady_window -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_the_window_leaves_out_the_first_and_last_arrivals_by_arrival_order(seed):
    generator = torch.Generator().manual_seed(seed)
    S = int(torch.randint(20, 200, (1,), generator=generator))
    arrival = torch.rand(S, generator=generator, dtype=torch.float64) * 100  # in no particular order
    never = torch.rand(S, generator=generator) < 0.1
    arrival[never] = float("nan")  # turns that never came
    warmup, cooldown = (float(x) for x in torch.rand(2, generator=generator) * 0.45)
    window = steady_window(arrival, warmup, cooldown)
    n = int((~never).sum())
    assert window.dtype == torch.bool and window.shape == (S,)
    assert not window[never].any()
    assert int(window.sum()) == n - math.floor(warmup * n) - math.floor(cooldown * n)
    ranks = torch.argsort(torch.argsort(arrival[~never]))  # 0 = earliest
    kept = window[~never]
    assert bool((ranks[kept] >= math.floor(warmup * n)).all())
    assert bool((ranks[kept] < n - math.floor(cooldown * n)).all())


def test_the_window_keeps_everything_without_warmup_or_cooldown_and_ties_go_by_index():
    arrival = torch.zeros(10, dtype=torch.float64)  # all at once
    assert bool(steady_window(arrival, 0.0, 0.0).all())
    assert steady_window(arrival, 0.2, 0.3).tolist() == [False] * 2 + [True] * 5 + [False] * 3


@pytest.mark.parametrize(
    "warmup, cooldown, message",
    [
        (1.0, 0.0, "warmup=1.0 is not allowed"),
        (-0.1, 0.0, "warmup=-0.1 is not allowed"),
        (0.1, 1.5, "cooldown=1.5 is not allowed"),
        (0.6, 0.4, r"warmup \+ cooldown=1 is not allowed"),
        (0.1, "0.1", "cooldown='0.1' is a str"),
    ],
)
def test_bad_window_fractions_are_named(warmup, cooldown, message):
    with pytest.raises(ValueError, match=message):
        steady_window(torch.zeros(5, dtype=torch.float64), warmup, cooldown)


def test_a_window_needs_float_seconds():
    with pytest.raises(ValueError, match="arrival has shape"):
        steady_window(torch.zeros(5, dtype=torch.int64))


# ----- window_attainment -------------------------------------------------------------------------------------
def hand_requests():
    """Six requests: arrival, first token, finish, output tokens. Request 0: TTFT 1 s (too slow);
    1: good; 2: TPOT 0.5 s (too slow); 3: refused (never served); 4 and 5: good."""
    arrival = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    first = torch.tensor([1.0, 1.1, 2.1, math.nan, 4.1, 5.1], dtype=torch.float64)
    finish = torch.tensor([2.0, 2.1, 7.1, math.nan, 4.2, 6.1], dtype=torch.float64)
    num_output = torch.tensor([11, 11, 11, 0, 1, 11])
    return arrival, first, finish, num_output


def test_attainment_over_a_window_counts_refused_requests_as_measured_and_not_good():
    arrays = hand_requests()
    everything = torch.ones(6, dtype=torch.bool)
    result = window_attainment(*arrays, 0.25, 0.2, everything)
    assert (result["measured"], result["served"], result["good"]) == (6, 5, 3)
    assert result["attainment"] == pytest.approx(3 / 6)
    # the window: requests 1 to 4; outside it, request 0's slowness does not count
    window = torch.tensor([False, True, True, True, True, False])
    result = window_attainment(*arrays, 0.25, 0.2, window)
    assert (result["measured"], result["served"], result["good"]) == (4, 3, 2)
    assert result["attainment"] == pytest.approx(2 / 4)
    assert result["ttft_p50_s"] == pytest.approx(0.1)  # over the served 1, 2, 4
    assert result["tpot_p99_s"] == pytest.approx(torch.quantile(torch.tensor([0.1, 0.5, 0.0]), 0.99).item())
    assert result["window_seconds"] == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(3))
def test_refusing_requests_never_raises_attainment(cluster, seed):
    trace, placement, setup, cost = cluster
    setup = replace(setup, blocks_per_device=ample_blocks_per_device(trace, placement, setup))
    arrival = arrival_times(trace.num_sequences, 2000.0, seed=seed)
    stats = TraceRunner(trace, placement, setup, "sequence_lru", cost, arrivals=arrival).run(100_000)
    arrival, first, finish, num_output = latency_arrays([stats])
    window = steady_window(arrival)
    ttft_slo = float(torch.quantile((first - arrival)[window], 0.5))  # half the window meets it
    before = window_attainment(arrival, first, finish, num_output, ttft_slo, 1.0, window)
    assert 0 < before["good"] < before["measured"]
    generator = torch.Generator().manual_seed(seed)
    refused = window & (torch.rand(trace.num_sequences, generator=generator) < 0.5)
    for kind in (first, finish):
        kind[refused] = float("nan")
    num_output[refused] = 0
    after = window_attainment(arrival, first, finish, num_output, ttft_slo, 1.0, window)
    assert after["measured"] == before["measured"] and after["served"] < before["served"]
    assert after["attainment"] < before["attainment"]  # good ones were among the refused


@pytest.mark.parametrize("seed", range(3))
def test_window_attainment_over_every_request_agrees_with_latency_summary(seed):
    generator = torch.Generator().manual_seed(seed)
    S = 50
    arrival = torch.rand(S, generator=generator, dtype=torch.float64) * 10
    first = arrival + torch.rand(S, generator=generator, dtype=torch.float64) * 0.5
    num_output = torch.randint(1, 30, (S,), generator=generator)
    finish = first + (num_output - 1) * torch.rand(S, generator=generator, dtype=torch.float64) * 0.2
    never = torch.rand(S, generator=generator) < 0.2
    first[never] = float("nan")
    finish[never] = float("nan")
    num_output[never] = 0
    summary = latency_summary(arrival, first, finish, num_output, 0.25, 0.1)
    ours = window_attainment(arrival, first, finish, num_output, 0.25, 0.1, torch.ones(S, dtype=torch.bool))
    assert ours["attainment"] == summary["slo_attainment"]
    assert ours["served"] == summary["served"]
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert ours[key] == summary[key]


def test_groups_of_runs_are_measured_together(cluster):
    trace, placement, setup, cost = cluster
    setup = replace(setup, blocks_per_device=ample_blocks_per_device(trace, placement, setup))
    runs = []
    for half in (list(range(0, 30)), list(range(30, 60))):
        arrival = arrival_times(30, 1000.0, seed=half[0])
        runs.append(
            TraceRunner(trace.subset(half), placement, setup, "sequence_lru", cost, arrivals=arrival).run()
        )
    arrays = latency_arrays(runs)
    assert all(a.shape == (60,) for a in arrays)
    result = window_attainment(*arrays, TTFT_SLO, 1.0, steady_window(arrays[0]))
    assert result["measured"] == 60 - 6 - 6 and result["served"] == result["measured"]


def test_bad_attainment_inputs_are_named():
    arrival, first, finish, num_output = hand_requests()
    everything = torch.ones(6, dtype=torch.bool)
    with pytest.raises(ValueError, match="window has shape"):
        window_attainment(arrival, first, finish, num_output, 0.25, 0.1, everything[:5])
    with pytest.raises(ValueError, match="finish has shape"):
        window_attainment(arrival, first, finish[:5], num_output, 0.25, 0.1, everything)
    with pytest.raises(ValueError, match="tpot_slo=0 is not allowed"):
        window_attainment(arrival, first, finish, num_output, 0.25, 0, everything)
    with pytest.raises(ValueError, match="num_output has shape"):
        window_attainment(arrival, first, finish, num_output.double(), 0.25, 0.1, everything)


# ----- goodput_by_bisection ----------------------------------------------------------------------------------
def step_at(threshold: float, calls: list | None = None):
    """Attainment 1 up to threshold requests per second, 0 above it."""

    def attainment(rate: float) -> float:
        if calls is not None:
            calls.append(rate)
        return 1.0 if rate <= threshold else 0.0

    return attainment


@pytest.mark.parametrize("seed", range(8))
def test_bisection_finds_the_highest_passing_rate_within_the_tolerance(seed):
    generator = torch.Generator().manual_seed(seed)
    threshold = float(10 + 90 * torch.rand(1, generator=generator))
    result = goodput_by_bisection(step_at(threshold), 5.0, 100.0, rel_tol=0.01, max_evals=20)
    lo, hi = result["bracket"]
    assert result["status"] == "converged" and result["doublings"] == 0
    assert lo <= threshold < hi and hi - lo <= 0.01 * lo
    assert result["goodput"] == lo <= threshold  # a rate that passed, never the last one evaluated
    passing = [rate for rate, attainment in result["evaluations"] if attainment >= 0.9]
    assert result["goodput"] == max(passing)


def test_the_goodput_is_the_highest_passing_rate_even_when_the_last_evaluated_failed():
    result = goodput_by_bisection(step_at(30.0), 10.0, 100.0, rel_tol=0.02)
    last_rate, last_attainment = result["evaluations"][-1]
    assert last_attainment == 0.0 and last_rate > 30.0  # bisection ended on a failing rate
    assert result["goodput"] <= 30.0


def test_bisection_on_a_smooth_attainment_meets_its_target():
    def attainment(rate: float) -> float:  # falls smoothly; 0.9 at rate0 * 9 ** -0.25
        return 1.0 / (1.0 + (rate / 40.0) ** 4)

    result = goodput_by_bisection(attainment, 1.0, 200.0, target=0.9, rel_tol=0.001, max_evals=30)
    assert result["goodput"] == pytest.approx(40.0 * 9**-0.25, rel=0.001)
    assert attainment(result["goodput"]) >= 0.9


@pytest.mark.parametrize("seed", range(3))
def test_the_crossing_within_the_last_bracket_finds_a_straight_attainment_exactly(seed):
    generator = torch.Generator().manual_seed(seed)
    crossing = float(20 + 60 * torch.rand(1, generator=generator))
    slope = float(0.002 + 0.02 * torch.rand(1, generator=generator))

    def attainment(rate: float) -> float:  # a straight line through 0.9 at the crossing, clipped
        return min(1.0, max(0.0, 0.9 - slope * (rate - crossing)))

    result = goodput_by_bisection(attainment, 10.0, 100.0, target=0.9, rel_tol=0.05, max_evals=12)
    lo, hi = result["bracket"]
    assert result["goodput"] == lo < crossing < hi  # the bisection's answer is a whole bracket low
    assert interpolated_goodput(result["evaluations"], 0.9) == pytest.approx(crossing, rel=1e-9)


def test_the_crossing_without_a_failing_or_a_passing_rate():
    assert interpolated_goodput([[10.0, 1.0], [40.0, 0.95]], 0.9) == 40.0  # nothing failed above
    assert interpolated_goodput([[10.0, 0.5], [40.0, 0.0]], 0.9) == 0.0  # nothing passed
    # a failing rate below the highest passing one is not a bracket end
    assert interpolated_goodput([[10.0, 0.8], [20.0, 1.0], [30.0, 0.0]], 0.9) == pytest.approx(21.0)


def test_a_rate_too_high_to_fail_doubles_and_says_so():
    calls = []
    result = goodput_by_bisection(step_at(350.0, calls), 10.0, 100.0, rel_tol=0.02)
    assert result["doublings"] == 2 and result["status"] == "converged"  # 100 -> 200 -> 400
    assert result["evaluations"][:4] == [[10.0, 1.0], [100.0, 1.0], [200.0, 1.0], [400.0, 0.0]]
    assert 350.0 * 0.98 <= result["goodput"] <= 350.0
    never_fails = goodput_by_bisection(step_at(1e9), 10.0, 100.0, max_doublings=3)
    assert never_fails["status"] == "meets_at_high" and never_fails["doublings"] == 3
    assert never_fails["goodput"] == 800.0 and never_fails["bracket"] == [800.0, None]


def test_a_rate_failing_at_low_gives_goodput_zero():
    result = goodput_by_bisection(step_at(1.0), 10.0, 100.0)
    assert result["goodput"] == 0.0 and result["status"] == "fails_at_low"
    assert result["evaluations"] == [[10.0, 0.0]] and result["bracket"] == [0.0, 10.0]


def test_bisection_stops_at_max_evals_and_is_deterministic():
    calls = []
    result = goodput_by_bisection(step_at(33.3, calls), 10.0, 100.0, rel_tol=1e-9, max_evals=6)
    assert len(calls) == 6 == len(result["evaluations"]) and result["status"] == "max_evals"
    assert result == goodput_by_bisection(step_at(33.3), 10.0, 100.0, rel_tol=1e-9, max_evals=6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"low": 0.0}, "low=0.0 is not allowed"),
        ({"high": 5.0}, "high=5.0 is not allowed"),
        ({"target": 1.5}, "target=1.5 is not allowed"),
        ({"rel_tol": 0.0}, "rel_tol=0.0 is not allowed"),
        ({"max_evals": 1}, "max_evals=1 is not allowed"),
        ({"attainment_at": 3}, "attainment_at=3 is an int"),
        ({"attainment_at": lambda rate: math.nan}, r"attainment_at\(10\) returned nan"),
    ],
)
def test_bad_bisection_inputs_are_named(kwargs, message):
    arguments = {"attainment_at": step_at(50.0), "low": 10.0, "high": 100.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        goodput_by_bisection(**arguments)


# ----- capacity_rate -----------------------------------------------------------------------------------------
def test_capacity_of_waves_of_equal_requests_is_the_batch_over_their_steps():
    # 40 requests of 3 prompt and 4 output tokens (5 generated: a prefill step and 4 decode steps),
    # 4 at a time, each step 1 s: a wave of 4 finishes every 5 s, 0.8 requests per second
    lengths = (torch.full((40,), 3), torch.full((40,), 4))
    trace, _ = topic_trace(40, 2, 4, 2, lengths=lengths, seed=0)
    setup = RunnerSetup(blocks_per_device=1, block_size=4, max_num_seqs=4)
    result = capacity(trace, torch.tensor([0, 0, 1, 1]), setup, ONE_SECOND_STEPS)
    assert result["requests_per_s"] == pytest.approx(4 / 5)
    assert result["completions"] == [4, 36] and result["completion_seconds"] == [5.0, 45.0]
    assert result["mean_running_in_window"] == pytest.approx(4.0)


def test_capacity_memory_never_binds(cluster, cluster_capacity):
    """The capacity run's schedule is the one a far larger memory gives (nothing waits for blocks,
    nothing is preempted), and a smaller one would bind."""
    trace, placement, setup, cost = cluster
    # each GPU holds one expert of each of 24 layers; a request of the longest 4,096 tokens can fill
    # 256 blocks of 16 in each, and 8 requests run at once
    assert int(trace.lengths.max()) == 4096
    ample = setup.max_num_seqs * 24 * 4096 // BLOCK_SIZE
    assert cluster_capacity["blocks_per_device"] == ample == ample_blocks_per_device(trace, placement, setup)
    larger = TraceRunner(trace, placement, replace(setup, blocks_per_device=4 * ample), "sequence_lru", cost)
    stats = larger.run(100_000)
    times = torch.sort(stats.finish_seconds).values
    first, last = cluster_capacity["completions"]
    assert cluster_capacity["requests_per_s"] == pytest.approx(
        (last - first) / float(times[last - 1] - times[first - 1])
    )
    assert cluster_capacity["modelled_seconds"] == pytest.approx(stats.seconds)
    # one request's worst case per device: the scheduler admits fewer at once
    tight = replace(setup, blocks_per_device=ample // setup.max_num_seqs)
    assert TraceRunner(trace, placement, tight, "sequence_lru", cost).run(100_000).num_steps > stats.num_steps


def test_capacity_rate_is_the_capacity_runs_rate():
    lengths = (torch.full((40,), 3), torch.full((40,), 4))
    trace, _ = topic_trace(40, 2, 4, 2, lengths=lengths, seed=0)
    setup = RunnerSetup(blocks_per_device=1, block_size=4, max_num_seqs=4)
    assert capacity_rate(trace, torch.tensor([0, 0, 1, 1]), setup, ONE_SECOND_STEPS) == pytest.approx(0.8)


def test_capacity_is_measured_with_the_batch_full(cluster, cluster_capacity):
    trace, placement, setup, cost = cluster
    result = cluster_capacity
    assert result["mean_running_in_window"] > 0.9 * setup.max_num_seqs  # saturated
    # topic routing leans on some devices: the busiest does more than its even share
    assert 1 < result["hot_load_in_window"] <= DEVICES
    assert 0 < result["saturated_until"] <= 1
    # at half capacity the batch is not full
    low = working_set(trace, placement, setup, cost, 0.5 * result["requests_per_s"], seed=1)
    assert low["mean_running"] < setup.max_num_seqs


def test_capacity_needs_requests_between_its_completion_points():
    trace, _ = topic_trace(4, 2, 4, 2, lengths=(torch.full((4,), 3), torch.full((4,), 4)), seed=0)
    setup = RunnerSetup(blocks_per_device=1, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="no time between"):
        capacity(trace, torch.tensor([0, 0, 1, 1]), setup, ONE_SECOND_STEPS)


# ----- working_set_blocks ------------------------------------------------------------------------------------
def test_the_working_set_is_the_fullest_device_over_the_windows_steps(cluster, cluster_capacity):
    trace, placement, setup, cost = cluster
    rate = 0.7 * cluster_capacity["requests_per_s"]
    result = working_set(trace, placement, setup, cost, rate, seed=3)
    # the same run, read by hand: the steps from the window's first admission to its last
    ample = replace(setup, blocks_per_device=result["ample_blocks_per_device"])
    arrival = arrival_times(trace.num_sequences, rate, seed=3)
    stats = TraceRunner(trace, placement, ample, "sequence_lru", cost, arrivals=arrival).run(100_000)
    window = steady_window(arrival)
    admitted = [step for step, request, kind in stats.events if kind == "admitted" and window[request]]
    used = stats.used_blocks[min(admitted) : max(admitted) + 1].double()
    assert result["steps"] == used.shape[0] < stats.num_steps
    assert result["blocks"] == pytest.approx(float(used.max(1).values.mean()))
    # the fullest device each step: at least every device's mean, and above their average
    assert result["blocks"] >= max(result["blocks_per_device_mean"])
    assert result["blocks"] > sum(result["blocks_per_device_mean"]) / DEVICES
    assert working_set_blocks(trace, placement, setup, cost, rate, seed=3) == result["blocks"]


def test_the_working_set_grows_with_the_load_and_depends_on_the_seed(cluster, cluster_capacity):
    trace, placement, setup, cost = cluster
    full = cluster_capacity["requests_per_s"]
    low = working_set_blocks(trace, placement, setup, cost, 0.2 * full, seed=0)
    high = working_set_blocks(trace, placement, setup, cost, 0.9 * full, seed=0)
    assert 0 < low < high
    assert working_set_blocks(trace, placement, setup, cost, 0.9 * full, seed=1) != high


def test_bad_working_set_inputs_are_named(cluster):
    trace, placement, setup, cost = cluster
    with pytest.raises(ValueError, match="rate=0 is not allowed"):
        working_set_blocks(trace, placement, setup, cost, 0, seed=0)
    with pytest.raises(ValueError, match="seed=-1 is not allowed"):
        working_set_blocks(trace, placement, setup, cost, 10.0, seed=-1)
    with pytest.raises(ValueError, match="is not a CostModel"):
        working_set_blocks(trace, placement, setup, None, 10.0, seed=0)


# ----- scaled_tpot_slo ---------------------------------------------------------------------------------------
def test_the_saturated_step_and_the_slo_by_hand():
    cost = CostModel("hand", 1e-3, 1e-5, 1e-8, float("inf"), 0.0, 0.0, 1)
    # one request of 100 prompt tokens and 11 generated: 10 decode tokens over contexts 100..109,
    # and its prompt's prefill, per decode token
    per_token = (10 * 1e-5 + sum(range(100, 110)) * 1e-8 + 100 * 1e-5 + 100 * 101 / 2 * 1e-8) / 10
    prompts = torch.tensor([100])
    outputs = torch.tensor([11])
    assert saturated_step_seconds(cost, prompts, outputs, 32) == pytest.approx(1e-3 + 32 * per_token)
    idle = 1e-3 + per_token
    slo = scaled_tpot_slo(cost, prompts, outputs, 32, factor=0.5)
    assert slo == pytest.approx(idle + 0.5 * 31 * per_token)
    # the busiest device doing 1.5 times its share: the work, not the fixed cost, takes 1.5 times as long
    hot = saturated_step_seconds(cost, prompts, outputs, 32, hot_load=1.5)
    assert hot == pytest.approx(1e-3 + 1.5 * 32 * per_token)
    assert scaled_tpot_slo(cost, prompts, outputs, 32, 0.5, 1.5) == pytest.approx(
        1e-3 + 1.5 * (1 + 15.5) * per_token
    )


def test_the_saturated_step_pays_the_fixed_cost_of_its_tokens():
    """CostModel.step_fixed_seconds: 4 collectives of 1 ms and 1 us of link per token; a batch of 32
    decoding requests of 100 prompt and 11 output tokens carries 32 decode and 320 prompt tokens."""
    plain = CostModel("hand", 1e-3, 1e-5, 1e-8, float("inf"), 0.0, 0.0, 1)
    linked = replace(plain, seconds_per_collective=1e-3, collectives_per_step=4, link_seconds_per_token=1e-6)
    prompts = torch.tensor([100])
    outputs = torch.tensor([11])
    extra = saturated_step_seconds(linked, prompts, outputs, 32) - saturated_step_seconds(
        plain, prompts, outputs, 32
    )
    assert extra == pytest.approx(4e-3 + 352 * 1e-6)


def test_the_scaled_tpot_slo_binds_when_saturated_and_is_met_at_low_load(cluster, cluster_capacity):
    trace, placement, setup, cost = cluster
    # the cluster model without its collectives, link and expert reads: with them a step's fixed
    # cost (1.5 ms) drowns a batch of 8's work (10 us a request), idle and saturated steps differ by
    # 8%, and the SLO between them cannot tell a low load from a saturated one
    cost = replace(cost, collectives_per_step=0, link_seconds_per_token=0.0, expert_reads=())
    prompts, outputs = trace_lengths(trace)
    slo = scaled_tpot_slo(cost, prompts, outputs, setup.max_num_seqs)
    # saturated: everything waiting at t = 0, the batch full
    ample = replace(setup, blocks_per_device=cluster_capacity["blocks_per_device"])
    stats = TraceRunner(trace, placement, ample, "sequence_lru", cost).run(100_000)
    window = steady_window(stats.arrival_seconds)
    saturated = window_attainment(*latency_arrays([stats]), 1e9, slo, window)
    assert saturated["tpot_p50_s"] > slo and saturated["attainment"] < 0.5
    low = working_set(trace, placement, setup, cost, 0.3 * cluster_capacity["requests_per_s"], seed=0)
    assert low["tpot_p99_s"] < slo


def test_bad_slo_inputs_are_named():
    cost = ONE_SECOND_STEPS
    with pytest.raises(ValueError, match="outputs are all 1 token"):
        saturated_step_seconds(cost, torch.tensor([5]), torch.tensor([1]), 8)
    with pytest.raises(ValueError, match="batch_size=0 is not allowed"):
        saturated_step_seconds(cost, torch.tensor([5]), torch.tensor([4]), 0)
    with pytest.raises(ValueError, match="factor=0 is not allowed"):
        scaled_tpot_slo(cost, torch.tensor([5]), torch.tensor([4]), 8, factor=0)
    with pytest.raises(ValueError, match="factor=1 is not allowed"):
        scaled_tpot_slo(cost, torch.tensor([5]), torch.tensor([4]), 8, factor=1)
    with pytest.raises(ValueError, match="hot_load=0.5 is not allowed"):
        saturated_step_seconds(cost, torch.tensor([5]), torch.tensor([4]), 8, hot_load=0.5)
    with pytest.raises(ValueError, match="prompts holds 0"):
        saturated_step_seconds(cost, torch.tensor([0]), torch.tensor([4]), 8)


# ----- decode_heavy_lengths ----------------------------------------------------------------------------------
def test_decode_heavy_lengths_have_the_means_and_sigma_asked_for():
    prompts, outputs = decode_heavy_lengths(20000, seed=2)
    assert prompts.dtype == outputs.dtype == torch.int64
    assert float(prompts.double().mean()) == pytest.approx(200, rel=0.02)
    assert float(outputs.double().mean()) == pytest.approx(3000, rel=0.02)
    assert float(outputs.double().log().std()) == pytest.approx(DECODE_HEAVY_OUTPUT_SIGMA, rel=0.03)
    other = decode_heavy_lengths(20000, seed=2, mean_prompt=50, mean_output=500)
    assert float(other[1].double().mean()) == pytest.approx(500, rel=0.02)


def test_decode_heavy_lengths_are_cut_as_sample_lengths_cuts():
    prompts, outputs = decode_heavy_lengths(5000, seed=4)
    cut_prompts, cut_outputs = decode_heavy_lengths(5000, seed=4, max_tokens=4096)
    assert int((cut_prompts + cut_outputs).max()) <= 4096 and (cut_outputs >= 1).all()
    over = prompts + outputs > 4096
    assert 0 < int(over.sum()) < 5000  # some were cut, not all
    expected = cut_to_fit(prompts, outputs, 4096)
    assert torch.equal(cut_prompts, expected[0]) and torch.equal(cut_outputs, expected[1])
    assert torch.equal(cut_prompts[~over], prompts[~over]) and torch.equal(cut_outputs[~over], outputs[~over])
    # the prompt keeps its share of the context
    assert torch.equal(cut_prompts[over], (prompts * 4096 // (prompts + outputs))[over].clamp(min=1))
    again = decode_heavy_lengths(5000, seed=4, max_tokens=4096)
    assert torch.equal(again[0], cut_prompts) and torch.equal(again[1], cut_outputs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_requests": 0}, "num_requests=0 is not allowed"),
        ({"max_tokens": 1}, "max_tokens=1 is not allowed"),
        ({"mean_output": 0.5}, "mean_output=0.5 is not allowed"),
        ({"output_sigma": -1.0}, "output_sigma=-1.0 is not allowed"),
        ({"seed": -1}, "seed=-1 is not allowed"),
    ],
)
def test_bad_decode_heavy_inputs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode_heavy_lengths(**{"num_requests": 10, **kwargs})
