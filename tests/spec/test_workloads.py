"""Workloads for the trace runner: published lengths, arrivals in time, latency and goodput."""

import math

import pytest
import torch

from moekv_ref.apps.cli import main as cli_main
from moekv_ref.costs import CostModel
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.traces import conversation_lengths, conversation_turns, synthetic_trace
from moekv_ref.sim.workloads import (
    arrival_times,
    latency_summary,
    length_workloads,
    round_robin,
    sample_lengths,
    sample_sessions,
    session_workloads,
)

# a step costs 1 s plus 1 s per token it computes: times are step counts one can follow by hand
STEPS = CostModel("steps", 1.0, 1.0, 0.0, float("inf"), 0.0, 0.0, 1)


@pytest.mark.parametrize("name", ["azure_code_2023", "azure_conversation_2023", "sharegpt"])
def test_sampled_lengths_have_the_published_medians(name):
    stats = length_workloads()[name]
    prompts, outputs = sample_lengths(name, 20000, seed=1)
    for drawn, part in ((prompts, "prompt"), (outputs, "output")):
        quantiles = stats[part]
        published = dict(quantiles)[0.5] if isinstance(quantiles, list) else quantiles["median"]
        assert abs(float(drawn.double().median()) / published - 1) < 0.05, (part, published)
    assert "source" in stats and (prompts >= 1).all() and (outputs >= 1).all()


def test_lengths_are_cut_to_the_context():
    prompts, outputs = sample_lengths("azure_code_2023", 5000, seed=0, max_tokens=4096)
    assert int((prompts + outputs).max()) <= 4096 and (prompts >= 1).all() and (outputs >= 1).all()


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 3.0)])
def test_arrivals_have_the_rate_and_burstiness_asked_for(process, cv):
    times = arrival_times(40000, 8.0, process, cv=cv, seed=2)
    gaps = torch.diff(times)
    assert (gaps >= 0).all()
    assert abs(float(times[-1]) / 40000 - 1 / 8.0) < 0.01 / 8.0 * 10  # mean gap 1 / rate, within 10%
    assert abs(float(gaps.std() / gaps.mean()) - cv) < 0.1 * cv


def test_bad_workload_inputs_are_named():
    with pytest.raises(ValueError, match="workload='nope'"):
        sample_lengths("nope", 10)
    with pytest.raises(ValueError, match="rate=0"):
        arrival_times(10, 0)
    with pytest.raises(ValueError, match="process='uniform'"):
        arrival_times(10, 1.0, "uniform")


def test_latency_of_a_hand_run():
    """Two requests: arrival 0 and 1, first tokens at 2 and 4, finishes at 5 and 4 with 4 and 1
    tokens: TTFT 2 and 3, TPOT 1 and 0; the SLOs (TTFT 2.5, TPOT 2) keep the first only."""
    summary = latency_summary(
        torch.tensor([0.0, 1.0]),
        torch.tensor([2.0, 4.0]),
        torch.tensor([5.0, 4.0]),
        torch.tensor([4, 1]),
        ttft_slo=2.5,
        tpot_slo=2.0,
    )
    assert summary["slo_attainment"] == 0.5
    assert "good_requests_per_s" not in summary  # retired: refusals shorten the span it divides by
    assert summary["ttft_p50_s"] == pytest.approx(2.5) and summary["tpot_p50_s"] == pytest.approx(0.5)


def test_the_runner_waits_for_arrivals_and_times_first_tokens():
    """One-token prompts and 3 stored output tokens (4 generated: the last is never stored),
    arriving at 0 and at 100 s: the second waits for its arrival (the clock jumps over the idle
    time); each step costs 1 s + 1 s a token."""
    trace = synthetic_trace(2, 2, 4, 2, mean_prompt=1, mean_output=3, sigma=0.0, seed=0)
    setup = RunnerSetup(blocks_per_device=200, block_size=4, max_num_seqs=4)
    stats = TraceRunner(
        trace, [0, 0, 0, 0], setup, "sequence_lru", STEPS, arrivals=torch.tensor([0.0, 100.0])
    ).run()
    assert stats.first_token_seconds.tolist() == [2.0, 102.0]  # a 1-token prefill step: 2 s
    assert stats.finish_seconds.tolist() == [8.0, 108.0]  # three decode steps of 2 s
    assert stats.num_output_tokens.tolist() == [4, 4]
    with pytest.raises(ValueError, match="arrivals must be"):
        TraceRunner(trace, [0, 0, 0, 0], setup, "sequence_lru", STEPS, arrivals=torch.tensor([0.0]))


def test_sampled_sessions_have_the_published_means():
    """Turns per session and each turn's new prompt and output tokens, over 20,000 sessions,
    within 3% of the means the data file states (and names the source of)."""
    stats = session_workloads()["lmsys_chat_1m"]
    session, prompts, outputs = sample_sessions("lmsys_chat_1m", 20000, seed=3)
    turns = torch.bincount(session)
    assert abs(float(turns.double().mean()) / stats["turns_mean"] - 1) < 0.03
    assert abs(float(prompts.double().mean()) / stats["prompt_mean"] - 1) < 0.03
    assert abs(float(outputs.double().mean()) / stats["output_mean"] - 1) < 0.03
    assert bool((turns >= 1).all()) and "source" in stats
    assert bool((torch.diff(session) >= 0).all())  # a session's turns consecutive


def test_sessions_are_cut_to_the_context_turn_by_turn():
    session, prompts, outputs = sample_sessions("lmsys_chat_1m", 3000, seed=0, max_tokens=512)
    whole = torch.zeros(int(session.max()) + 1, dtype=torch.int64).index_add_(0, session, prompts + outputs)
    assert int(whole.max()) <= 512
    assert torch.equal(torch.unique(session), torch.arange(3000))  # every session keeps its first turn
    with pytest.raises(ValueError, match="workload='chat'"):
        sample_sessions("chat", 10)


TIGHT_BLOCKS = 10  # some turns fit alone, the longer ones do not


def _turns():
    session = torch.tensor([0, 0, 0, 1, 2, 2])
    prompts = torch.tensor([5, 3, 2, 7, 4, 6])
    outputs = torch.tensor([4, 2, 3, 2, 5, 1])
    lengths = conversation_lengths(session, prompts, outputs)
    conversations = synthetic_trace(
        3, 2, 4, 2, lengths=(lengths - 1, torch.ones_like(lengths)), distinct_routings=16, seed=1
    )
    return conversations, session, prompts, outputs


def test_a_turn_is_its_conversation_so_far_with_the_same_routing_and_tokens():
    """Turn j's prompt is every earlier turn's prompt and output tokens plus its own new prompt; it
    stores all but its last sampled token; it begins with the turn before it, token for token, and
    two sessions share no token."""
    conversations, session, prompts, outputs = _turns()
    turns, follows = conversation_turns(conversations, session, prompts, outputs)
    assert follows.tolist() == [-1, 0, 1, -1, -1, 4]
    assert turns.prompt_lens.tolist() == [5, 5 + 4 + 3, 5 + 4 + 3 + 2 + 2, 7, 4, 4 + 5 + 6]
    assert turns.lengths.tolist() == (turns.prompt_lens + outputs - 1).tolist()
    for t, before in enumerate(follows.tolist()):
        mine = slice(int(turns.offsets[t]), int(turns.offsets[t + 1]))
        start = int(conversations.offsets[session[t]])
        whole = slice(start, start + int(turns.lengths[t]))
        assert torch.equal(turns.experts_of(mine), conversations.experts_of(whole))
        if before >= 0:
            n = int(turns.lengths[before])
            assert turns.tokens_of(t, 0, n) == turns.tokens_of(before, 0, n)
    first = [set(turns.tokens_of(t, 0, int(turns.lengths[t]))) for t in (0, 3, 4)]
    assert not (first[0] & first[1]) and not (first[0] & first[2]) and not (first[1] & first[2])


def test_conversation_turns_refuse_turns_out_of_order_or_too_long():
    conversations, session, prompts, outputs = _turns()
    with pytest.raises(ValueError, match="consecutive"):
        conversation_turns(conversations, session[[0, 3, 1, 2, 4, 5]], prompts, outputs)
    with pytest.raises(ValueError, match="shorter than its turns"):
        conversation_turns(conversations, session, prompts + 1, outputs)


def test_a_follow_up_turn_arrives_its_think_time_after_the_turn_before_finishes():
    """Two turns of one session and one other request, each step 1 s + 1 s a token: the second
    turn (3 s of think time) arrives 3 s after the first finished, and its TTFT counts from there;
    a refused turn's follow-up is refused with it."""
    conversations, session, prompts, outputs = _turns()
    turns, follows = conversation_turns(conversations, session, prompts, outputs)
    setup = RunnerSetup(blocks_per_device=400, block_size=4, max_num_seqs=4, prefix_caching=True)
    think = torch.tensor([0.0, 3.0, 3.0, 0.0, 50.0, 3.0], dtype=torch.float64)
    stats = TraceRunner(turns, [0, 0, 1, 1], setup, "sequence_lru", STEPS, think, follows).run()
    finish, arrival = stats.finish_seconds, stats.arrival_seconds
    for t, before in enumerate(follows.tolist()):
        if before >= 0:
            assert float(arrival[t]) == float(finish[before]) + float(think[t])
            assert float(stats.first_token_seconds[t]) > float(arrival[t])
    assert stats.num_finished == 6 and stats.prefix_hit_tokens > 0
    tight = RunnerSetup(blocks_per_device=TIGHT_BLOCKS, block_size=4, max_num_seqs=4)
    refused = TraceRunner(turns, [0, 0, 1, 1], tight, "sequence_lru", STEPS, think, follows)
    fits = []
    for t in range(6):
        try:
            refused.scheduler.check_fits_alone(
                int(turns.prompt_lens[t]), int(turns.lengths[t] - turns.prompt_lens[t]) + 1
            )
            fits.append(follows[t] < 0 or fits[follows[t]])
        except ValueError:
            fits.append(False)
    assert 0 < refused.num_refused == fits.count(False) < 6
    assert refused.run().num_finished == fits.count(True)
    with pytest.raises(ValueError, match="follows must be"):
        TraceRunner(
            turns, [0, 0, 1, 1], setup, "sequence_lru", STEPS, think, torch.tensor([-1, 1, 1, -1, -1, 4])
        )
    with pytest.raises(ValueError, match="reads a trace's future"):
        TraceRunner(turns, [0, 0, 1, 1], setup, "belady", STEPS, think, follows)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--devices", "3"], "--devices 3 must divide"),
        (["--devices", "12"], "or be a multiple of 8"),
        (["--sessions", "--devices", "16"], "--sessions serves one group"),
        (["--policies", "pressure_aware"], "must include sequence_lru"),
        (["--reservations", "lazy"], "--reservations 'lazy'"),
        (["--rates", "0"], "--rates"),
        (["--sessions", "--devices", "4", "8"], "--sessions serves one group"),
        (["--sessions", "--think-seconds", "-1"], "--think-seconds"),
    ],
)
def test_bench_cluster_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "cluster", *argv])
    assert message in capsys.readouterr().err


def test_round_robin_hands_requests_out_in_turn_of_arrival():
    arrival = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7])  # arrival order: 1, 3, 0, 4, 2
    groups = round_robin(arrival, 2)
    assert [g.tolist() for g in groups] == [[0, 1, 2], [3, 4]]
    assert [g.tolist() for g in round_robin(arrival, 1)] == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="num_groups"):
        round_robin(arrival, 0)


def test_groups_of_gpus_serve_the_requests_handed_to_each_and_the_numbers_are_over_all():
    """16 GPUs of the cluster model: 2 groups of 8, arrivals twice as fast, requests in turn; the
    run's numbers are those of running each group's requests on 8 GPUs by hand."""
    from moekv_ref.apps import bench_cluster as bench

    trace = bench.cluster_workload(24, "azure_conversation_2023", 0)
    run = bench.run_one(trace, 16, 0.25, 40.0, "poisson", "sequence_lru", "worst_case", 64, 0)
    assert run["groups"] == 2 and run["requests"] == 24
    arrival = arrival_times(24, 80.0, "poisson", seed=0)
    setup = RunnerSetup(
        blocks_per_device=bench.pool_blocks(0.25),
        block_size=bench.BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        admission="predicted",
    )
    cost = bench.cluster_cost_model(bench.get_config(bench.MODEL), bench.ACTIVE_PARAMS, 8, bench.BLOCK_SIZE)
    by_hand = []
    for seqs in (torch.arange(0, 24, 2), torch.arange(1, 24, 2)):
        runner = TraceRunner(
            trace.subset(seqs.tolist()),
            bench.cluster_placement(8),
            setup,
            "sequence_lru",
            cost,
            arrival[seqs],
        )
        by_hand.append(runner.run())
    assert run["steps"] == sum(stats.num_steps for stats in by_hand)
    assert run["modelled_seconds"] == max(stats.seconds for stats in by_hand)
    summary = latency_summary(
        torch.cat([stats.arrival_seconds for stats in by_hand]),
        torch.cat([stats.first_token_seconds for stats in by_hand]),
        torch.cat([stats.finish_seconds for stats in by_hand]),
        torch.cat([stats.num_output_tokens for stats in by_hand]),
        bench.TTFT_SLO,
        bench.TPOT_SLO,
    )
    assert {key: run[key] for key in summary} == summary


def test_bench_cluster_writes_its_json(tmp_path):
    path = tmp_path / "cluster.json"
    assert (
        cli_main(
            [
                "bench",
                "cluster",
                "--requests",
                "12",
                "--gib-per-device",
                "0.25",
                "--rates",
                "50",
                "--policies",
                "sequence_lru",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    import json

    result = json.loads(path.read_text())
    assert len(result["runs"]) == 3 and {r["reservation"] for r in result["runs"]} == {
        "worst_case",
        "optimistic",
        "calibrated",
    }
    assert all(r["served"] + r["refused"] == 12 for r in result["runs"])
    assert not math.isnan(result["runs"][0]["ttft_p50_s"])


def test_bench_cluster_sessions_serves_the_same_turns_with_the_prefix_cache_off_and_on(tmp_path, capsys):
    """--sessions: each (memory, rate) twice, the prefix cache off (no hit) and on (later turns find
    part of the turn before), every turn served or refused, and the pair's comparison written."""
    import json

    path = tmp_path / "sessions.json"
    argv = ["bench", "cluster", "--sessions", "--requests", "8", "--gib-per-device", "0.5"]
    assert cli_main([*argv, "--rates", "400", "--think-seconds", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    off, on = result["runs"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert off["prefix_hit_tokens"] == 0 < on["prefix_hit_tokens"] < on["prompt_tokens"]
    assert result["turns"] > result["sessions"] == 8  # some session has a second turn
    for run in (off, on):
        assert run["served"] + run["refused"] == result["turns"]
    pair = result["prefix_caching"][0]
    assert pair["hit_share"] == on["prefix_hit_tokens"] / on["prompt_tokens"]
    assert 0 < on["prefix_hit_tokens"] <= result["shareable_prompt_tokens"] < result["prompt_tokens"]
    assert "lmsys_chat_1m" in capsys.readouterr().out


def test_bench_simulator_times_both_shapes(tmp_path):
    """bench simulator runs the trace runner of a checkout in a fresh process on both shapes (here this
    checkout alone, 3 requests each) and writes what it measured."""
    import json

    path = tmp_path / "speed.json"
    assert cli_main(["bench", "simulator", "--requests", "3", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [(r["experts"], r["devices"]) for r in result["shapes"]] == [(8, 8), (64, 64)]
    assert all(r["this"]["steps"] > 0 and r["this"]["requests_per_second"] > 0 for r in result["shapes"])
    assert "against" not in result["shapes"][0]


def test_bench_simulator_scale_runs_the_fine_shape_over_a_compact_trace(tmp_path, capsys):
    """bench simulator --scale serves every request of a compact trace on the 64-device shape (here 12 requests, one
    thread) and writes each phase's seconds, the rate and the projection it printed."""
    import json

    path = tmp_path / "scale.json"
    argv = ["bench", "simulator", "--scale", "--requests", "12", "--threads", "1", "--json", str(path)]
    assert cli_main(argv) == 0
    result = json.loads(path.read_text())
    assert (result["experts"], result["top_k"], result["devices"]) == (64, 8, 64)
    assert result["finished"] + result["refused"] == 12 and result["finished"] > 0
    assert result["total_seconds"] >= result["run_seconds"] > 0
    assert result["projected_seconds_for_1e6"] == pytest.approx(result["total_seconds"] * 1e6 / 12)
    assert "(projected, not run)" in capsys.readouterr().out
