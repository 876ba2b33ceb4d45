"""The trace runner (sim/runner.py) makes the engine's decisions: on the routing the engine's own
model produces, the runner -- the Scheduler with the trace playing the model -- and LLMEngine with
the model admit, resume and preempt the same requests at the same steps, hold the same blocks on
every device after every step, and count the same evictions and recomputed tokens.

The trace is recorded from the model (analysis.record_model_trace, greedy, as the engine generates
here). Top-k routing, so that a recomputed token goes to the same experts again; a small random
float64 model (helpers), so that no near-tie flips between batchings; four devices with tight pools,
so that preemptions happen (asserted: a run without any would compare little)."""

import pytest
import torch
from helpers import random_model, random_workload, small_config

from moekv_ref.analysis import record_model_trace
from moekv_ref.costs import CostModel
from moekv_ref.engine import LLMEngine, SchedulerConfig
from moekv_ref.engine.calibrated_reservation import CalibratedReservation
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim.runner import RunnerSetup, TraceRunner, simulate

PLACEMENT = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])  # 8 experts on 4 devices, device 0 the busiest
BLOCK_SIZE, BLOCKS_PER_DEVICE, SWAP_BLOCKS = 4, 36, 64
SESSION_BLOCKS = 52  # second turns hold their first turn's tokens too; tight enough to preempt
ROOMY_BLOCKS = 400  # no preemption, no cached block evicted
FLAT = CostModel("flat", 0.0, 1.0, 0.0, float("inf"), 1.0, 0.0, 1)
DECISIONS = ("admitted", "resumed", "preempted")


def engine_on_pools(model, blocks=BLOCKS_PER_DEVICE, swap_blocks=0, prefix_caching=False, **scheduler):
    """The engine on the runner's pools: 4 devices of `blocks`, PLACEMENT, the tests' batch limits and
    the scheduler settings given (victim, admission, reservation, preemption_mode)."""
    return LLMEngine(
        model,
        block_size=BLOCK_SIZE,
        blocks_per_device=[blocks] * 4,
        device_of_expert=PLACEMENT,
        num_swap_blocks=swap_blocks or None,
        enable_prefix_caching=prefix_caching,
        record_history=True,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, **scheduler),
    )


@pytest.fixture(scope="module")
def model():
    return random_model(
        small_config("expert", "topk", num_attention_experts=8, num_attention_experts_per_tok=2), seed=0
    )


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = random_workload(12, (2, 7), (10, 25), seed=0, prompt_seed=1)
    output_lens = [p.max_new_tokens for p in params]
    return prompts, output_lens, record_model_trace(model, prompts, output_lens)


@pytest.mark.parametrize(
    "victim,mode,admission",
    [
        ("newest_first", "recompute", "optimistic"),
        ("pressure_aware", "swap", "optimistic"),
        ("expert_lru", "recompute", "optimistic"),
        ("pressure_aware", "recompute", "predicted"),
    ],
)
def test_the_runner_makes_the_engines_decisions_step_by_step(model, workload, victim, mode, admission):
    prompts, output_lens, trace = workload
    swap_blocks = SWAP_BLOCKS if mode == "swap" else 0
    setup = RunnerSetup(
        BLOCKS_PER_DEVICE,
        BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_host_blocks=swap_blocks,
        admission=admission,
    )
    stats = simulate(trace, PLACEMENT, setup, victim, FLAT)

    engine = engine_on_pools(
        model, swap_blocks=swap_blocks, victim=victim, admission=admission, preemption_mode=mode
    )
    outputs = engine.generate(
        prompts, [SamplingParams(max_new_tokens=n, temperature=0.0) for n in output_lens]
    )
    assert [len(o.token_ids) for o in outputs] == output_lens
    events = [(e.step, e.request_id, e.kind) for e in engine.events if e.kind in DECISIONS]

    assert stats.events == events  # admissions, preemptions (victims)
    assert stats.num_steps == engine.step_count
    assert stats.used_blocks.tolist() == torch.stack(engine.device_timeline).tolist()  # (steps, D)
    assert stats.num_running.tolist() == [record.num_running for record in engine.timeline]
    counts = engine.eviction_stats()
    assert (stats.num_evictions, stats.recomputed_tokens, stats.freed_on_short_device) == (
        counts["num_evictions"],
        counts["num_recomputed_tokens"],
        counts["freed_on_short_device"],
    )
    assert stats.num_finished == len(prompts) and stats.finished_tokens == sum(output_lens)
    if admission == "optimistic":
        assert any(kind == "preempted" for _, _, kind in events)
    if mode == "swap":
        assert stats.swapped_bytes > 0
    if victim == "expert_lru":
        assert any(record.mode == "rows" for record in stats.evictions)


@pytest.mark.parametrize("victim", ["sequence_lru", "pressure_aware"])
def test_under_optimistic_reservation_the_runner_retries_as_the_engine_does(model, workload, victim):
    """Decode tokens reserve nothing; a layer that finds its device full undoes the step, which is
    scheduled again with the missing blocks freed first. The runner (failing at the first short
    layer, as the forward does) and the engine retry the same steps, take the same victims and hold
    the same blocks; the engine's tokens are those of worst-case reservation."""
    prompts, output_lens, trace = workload
    setup = RunnerSetup(
        BLOCKS_PER_DEVICE,
        BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        admission="optimistic",
        reservation="optimistic",
    )
    stats = simulate(trace, PLACEMENT, setup, victim, FLAT)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in output_lens]
    engines = {}
    for reservation in ("optimistic", "worst_case"):
        engines[reservation] = engine_on_pools(
            model, victim=victim, admission="optimistic", reservation=reservation
        )
    outputs = {name: engine.generate(prompts, params) for name, engine in engines.items()}
    engine = engines["optimistic"]
    assert [o.token_ids for o in outputs["optimistic"]] == [o.token_ids for o in outputs["worst_case"]]
    events = [(e.step, e.request_id, e.kind) for e in engine.events if e.kind in DECISIONS]
    assert stats.events == events
    assert stats.used_blocks.tolist() == torch.stack(engine.device_timeline).tolist()
    engine_stats = engine.stats()
    assert (stats.num_retries, stats.thrown_away_tokens) == (
        engine_stats.num_retries,
        engine_stats.num_thrown_away_tokens,
    )
    assert stats.num_retries > 0  # the retry path ran
    assert stats.num_steps < engines["worst_case"].step_count  # fewer steps than worst-case reservation


@pytest.mark.parametrize("victim", ["newest_first", "pressure_aware"])
def test_under_calibrated_reservation_the_runner_repairs_as_the_engine_does(model, workload, victim):
    """Decode tokens reserve their worst case, chunks (of at most 4 tokens) a quantile low enough
    that layers run short; each time, the chunk scheduled last leaves the step and the forward goes
    on for the others. The runner (checking layer by layer before it appends) and the engine (whose
    forward raises at the short layer and runs again without the chunk) drop the same chunks, take
    the same victims, hold the same blocks after every step and throw away the same token-layers;
    the engine's tokens are those of worst-case reservation."""
    prompts, output_lens, trace = workload

    def calibrated():  # a fresh policy for each run: it learns from the requests it serves
        return CalibratedReservation(q=0.05, max_chunk_tokens=4, min_observed=2)

    setup = RunnerSetup(
        BLOCKS_PER_DEVICE,
        BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        admission="optimistic",
        reservation=calibrated(),
    )
    stats = simulate(trace, PLACEMENT, setup, victim, FLAT)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in output_lens]
    engines = {}
    for name, reservation in (("calibrated", calibrated()), ("worst_case", "worst_case")):
        engines[name] = engine_on_pools(model, victim=victim, admission="optimistic", reservation=reservation)
    outputs = {name: engine.generate(prompts, params) for name, engine in engines.items()}
    engine = engines["calibrated"]
    assert [o.token_ids for o in outputs["calibrated"]] == [o.token_ids for o in outputs["worst_case"]]
    events = [(e.step, e.request_id, e.kind) for e in engine.events if e.kind in DECISIONS]
    assert stats.events == events
    assert stats.num_steps == engine.step_count
    assert stats.used_blocks.tolist() == torch.stack(engine.device_timeline).tolist()
    engine_stats = engine.stats()
    assert (stats.num_repairs, stats.thrown_away_token_layers) == (
        engine_stats.num_repairs,
        engine_stats.num_thrown_away_token_layers,
    )
    assert stats.num_repairs > 0 and stats.num_retries == 0  # the repair path ran, no step was undone
    assert stats.recomputed_tokens == engine_stats.num_recomputed_tokens


@pytest.mark.parametrize(
    "victim,mode,blocks",
    [
        ("pressure_aware", "recompute", SESSION_BLOCKS),
        ("sequence_lru", "recompute", SESSION_BLOCKS),
        ("pressure_aware", "swap", SESSION_BLOCKS),
        ("sequence_lru", "recompute", ROOMY_BLOCKS),
    ],
)
def test_multi_turn_sessions_with_prefix_caching_make_the_engines_decisions(
    model, workload, victim, mode, blocks
):
    """Each request's second turn (its prompt, every token it generated, a few new tokens) arrives
    when its first finishes and starts from what the first left in the prefix cache. The runner,
    over the model's trace of both turns (token ids and all), and the engine, fed the second turns
    as their first turns finish, make the same decisions, hold the same blocks after every step and
    skip the same prompt tokens. Tight pools preempt (and evict most cached blocks before the second
    turns come: their hits stay within the first prompts); a roomy one keeps them, so the hits reach
    into the tokens the first turns generated, which the runner must have "sampled" as the model did."""
    prompts, output_lens, _ = workload
    n = len(prompts)
    greedy = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in output_lens]
    first_outputs = generate(model, prompts, greedy, cache="contiguous").tokens
    generator = torch.Generator().manual_seed(5)
    second = [
        p
        + out
        + torch.randint(
            64, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator
        ).tolist()
        for p, out in zip(prompts, first_outputs)
    ]
    second_lens = torch.randint(5, 12, (n,), generator=generator).tolist()
    trace = record_model_trace(model, prompts + second, output_lens + second_lens)
    follows = torch.tensor([-1] * n + list(range(n)))
    swap_blocks = SWAP_BLOCKS if mode == "swap" else 0
    setup = RunnerSetup(
        blocks,
        BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_host_blocks=swap_blocks,
        prefix_caching=True,
    )
    think = torch.zeros(2 * n, dtype=torch.float64)  # at once: as the engine below gets them
    stats = TraceRunner(trace, PLACEMENT, setup, victim, FLAT, arrivals=think, follows=follows).run()

    engine = engine_on_pools(
        model,
        blocks,
        swap_blocks,
        prefix_caching=True,
        victim=victim,
        admission="optimistic",
        preemption_mode=mode,
    )
    sequence_of = {engine.add_request(p, q): i for i, p, q in zip(range(n), prompts, greedy)}
    while engine.has_unfinished_requests():
        done = sorted(sequence_of[o.request_id] for o in engine.step())
        for i in done:
            if i < n:  # its second turn arrives now, in trace order as the runner adds them
                params = SamplingParams(max_new_tokens=second_lens[i], temperature=0.0)
                sequence_of[engine.add_request(second[i], params)] = n + i
    events = [(e.step, sequence_of[e.request_id], e.kind) for e in engine.events if e.kind in DECISIONS]

    assert stats.events == events
    assert stats.num_steps == engine.step_count
    assert stats.used_blocks.tolist() == torch.stack(engine.device_timeline).tolist()
    assert stats.num_finished == 2 * n and stats.finished_tokens == sum(output_lens + second_lens)
    hits = engine.prefix_cache_stats()["num_hit_tokens"]
    assert stats.prefix_hit_tokens == hits > 0
    if blocks == SESSION_BLOCKS:
        assert any(kind == "preempted" for _, _, kind in events)
    else:
        assert hits > sum(len(p) for p in prompts)  # into the generated tokens
