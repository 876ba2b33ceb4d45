"""Calibrated reservation (engine/calibrated_reservation.py) and the clairvoyant bound
(sim/clairvoyant.py): what each reserves, measured against what the trace's routing then takes.

The trace runner's TraceFuture knows the blocks each request holds after each of its tokens, so
the blocks a chunk really opens on each device are held[c + n] - held[c]: the yardstick for both.
The simulator = engine equivalence under calibrated reservation, repairs included, is in
test_sim_vs_engine.py."""

import pytest
import torch
from helpers import random_model, small_config

from moekv_ref.cache.block_pool import OutOfBlocksError
from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.cache.paged import PagedKVCache
from moekv_ref.costs import CostModel
from moekv_ref.engine import LLMEngine
from moekv_ref.engine.calibrated_reservation import CalibratedReservation
from moekv_ref.engine.memory import ModelShape
from moekv_ref.engine.request import Request, RequestStatus
from moekv_ref.engine.scheduler import Scheduler
from moekv_ref.engine.scheduler_config import SchedulerConfig
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.workloads import skewed_workload

FREE = CostModel("free", 0.0, 0.0, 0.0, float("inf"), 0.0, 0.0, 1)


def skewed_runner(reservation, blocks_per_device: int, seed: int, max_chunk: int = 64) -> TraceRunner:
    """96 requests of a topic trace (8 layers, 16 experts top-2, skew 1.5) on 4 devices, placed by
    co-activation, so that the popular topic's device fills first."""
    trace, _, placement = skewed_workload(96, mean_prompt=160, mean_output=32, seed=seed)
    setup = RunnerSetup(
        blocks_per_device,
        block_size=16,
        max_num_seqs=32,
        max_num_batched_tokens=max_chunk * 4,
        admission="optimistic",
        reservation=reservation,
    )
    return TraceRunner(trace, placement, setup, "newest_first", FREE)


def record_chunks(runner: TraceRunner, policy: CalibratedReservation) -> list:
    """(reserved (D,), taken (D,)) of every chunk the policy's quantile was asked for."""
    records = []
    quantile = policy.quantile_blocks

    def recording(requests, num_tokens, memory, predictor):
        reserved = quantile(requests, num_tokens, memory, predictor)
        for request, n, row in zip(requests, num_tokens, reserved):
            held = runner.future.held(request.request_id)
            done = request.num_computed_tokens
            records.append((row, held[done + n] - held[done]))
        return reserved

    policy.quantile_blocks = recording
    return records


@pytest.mark.parametrize("q,most", [(0.9, 0.13), (0.99, 0.025)])
def test_a_chunk_takes_more_than_its_quantile_about_as_often_as_q_allows(q, most):
    """Over three seeds' runs (thousands of (chunk, device) pairs), a chunk's blocks on a device
    exceed what calibrated(q) reserved there in at most `most` of the pairs (1 - q plus a margin
    for a prior learned on the fly), and the reservation stays near what is taken: at most 1.5x in
    all (worst-case reservation sets aside several times more)."""
    exceeded, pairs, reserved_sum, taken_sum = 0, 0, 0.0, 0.0
    for seed in range(3):
        policy = CalibratedReservation(q=q, max_chunk_tokens=64)
        runner = skewed_runner(policy, blocks_per_device=4000, seed=seed)
        records = record_chunks(runner, policy)
        runner.run()
        reserved = torch.stack([r for r, _ in records]).double()  # (chunks, D)
        taken = torch.stack([t for _, t in records]).double()
        exceeded += int((taken > reserved).sum())
        pairs += taken.numel()
        reserved_sum += float(reserved.sum())
        taken_sum += float(taken.sum())
    assert pairs > 2000
    assert exceeded / pairs <= most
    assert exceeded > 0  # the quantile is a quantile, not the worst case
    assert 1.0 < reserved_sum / taken_sum <= 1.5


def test_the_clairvoyant_bound_reserves_exactly_what_every_step_takes():
    """Under reservation='clairvoyant' every step's appends take, device by device summed, exactly
    the blocks the step reserved for them: no step runs short, and no block set aside goes unused."""
    runner = skewed_runner("clairvoyant", blocks_per_device=900, seed=0)
    append = runner.append
    steps = []

    def checking(out):
        free = runner.manager.num_free_blocks_per_device.clone()
        result = append(out)
        taken = int((free - runner.manager.num_free_blocks_per_device).sum())
        steps.append((out.reserved_blocks, taken))
        return result

    runner.append = checking
    stats = runner.run()
    assert stats.num_finished == 96 and stats.num_evictions > 0  # memory bound: victims acted
    assert all(reserved == taken for reserved, taken in steps)
    assert stats.num_repairs == stats.num_retries == 0


def test_decode_tokens_reserve_their_worst_case_and_chunks_their_cap():
    """A decode token's need is the scheduler's worst case (so no decode runs short), and no item of
    any step runs more than max_chunk_tokens tokens."""
    policy = CalibratedReservation(q=0.9, max_chunk_tokens=24)
    runner = skewed_runner(policy, blocks_per_device=300, seed=1, max_chunk=64)
    scheduler = runner.scheduler
    step_needs = policy.step_needs
    checked = []

    def checking(requests, num_tokens, worst_case, memory, predictor):
        needs = step_needs(requests, num_tokens, worst_case, memory, predictor)
        for i, (request, n) in enumerate(zip(requests, num_tokens)):
            if n == 1 and request.num_computed_tokens > 0:
                assert needs[i].tolist() == worst_case([request], [1])[0].tolist()
                checked.append(i)
        return needs

    policy.step_needs = checking
    sizes = []
    schedule = scheduler.schedule

    def recording(step, retry=None):
        out = schedule(step, retry)
        sizes.extend(item.num_tokens for item in out.scheduled)
        return out

    scheduler.schedule = recording
    runner.run()
    assert checked and max(sizes) == 24


def test_the_headroom_rises_by_a_fault_and_decays_each_step():
    policy = CalibratedReservation(headroom_decay=0.5)
    policy.note_fault(torch.tensor([0, 8]))
    policy.note_fault(torch.tensor([2, 0]))
    assert policy.headroom.tolist() == [2.0, 8.0]
    policy.start_step()
    policy.start_step()
    assert policy.headroom.tolist() == [0.5, 2.0]


def test_before_enough_requests_are_measured_a_chunk_reserves_its_worst_case():
    """The prior is learned from the requests served: until min_observed are measured, a chunk
    reserves the worst case, and the first chunks therefore never run short."""
    policy = CalibratedReservation(q=0.5, min_observed=10**6)  # never enough
    runner = skewed_runner(policy, blocks_per_device=300, seed=2)
    asked = []
    quantile = policy.quantile_blocks
    policy.quantile_blocks = lambda *args: asked.append(1) or quantile(*args)
    stats = runner.run()
    assert not asked and stats.num_repairs == 0


def calibrated_engine(num_hidden_layers: int) -> LLMEngine:
    """A random top-2 expert model's engine under calibrated reservation, 200 blocks of 4."""
    model = random_model(small_config("expert", "topk", num_hidden_layers=num_hidden_layers), seed=0)
    return LLMEngine(
        model,
        block_size=4,
        num_blocks=200,
        scheduler_config=SchedulerConfig(admission="optimistic", reservation=CalibratedReservation()),
    )


def test_what_the_policy_keeps_per_request_goes_when_the_request_does():
    """The ids of measured requests are kept only while they are in flight (Scheduler.finish tells
    the policy), so a server that runs for days keeps no more than its live requests; their shares
    stay in the prior. In the trace runner and in the engine alike."""
    policy = CalibratedReservation(min_observed=4)
    runner = skewed_runner(policy, blocks_per_device=300, seed=2)
    stats = runner.run()
    assert stats.num_finished + stats.num_refused == 96 and policy.num_observed >= stats.num_finished > 0
    assert policy.observed == set()
    engine = calibrated_engine(num_hidden_layers=2)
    outputs = engine.generate([[3] * 6, [5] * 9, [7] * 4], SamplingParams(max_new_tokens=3))
    calibrated = engine.scheduler.reservation
    assert len(outputs) == 3 and calibrated.num_observed == 3 and calibrated.observed == set()


@pytest.mark.parametrize(
    "keywords,named",
    [
        ({"q": 1.0}, "q=1.0"),
        ({"q": 0}, "q=0"),
        ({"max_chunk_tokens": 0}, "max_chunk_tokens=0"),
        ({"headroom_decay": 1.0}, "headroom_decay=1.0"),
        ({"min_observed": 0}, "min_observed=0"),
    ],
)
def test_bad_settings_are_refused_by_name(keywords, named):
    with pytest.raises(ValueError, match=named):
        CalibratedReservation(**keywords)


def test_what_cannot_combine_is_refused():
    with pytest.raises(ValueError, match="preemption_mode='swap'"):
        SchedulerConfig(reservation="calibrated", preemption_mode="swap")
    with pytest.raises(ValueError, match="continuous_paged"):
        SchedulerConfig(reservation="calibrated", policy="static")
    trace, _, placement = skewed_workload(8, seed=0)
    with pytest.raises(ValueError, match="clairvoyant"):
        TraceRunner(
            trace,
            placement,
            RunnerSetup(300, prefix_caching=True, reservation="clairvoyant"),
            "newest_first",
            FREE,
        )


# ----- the repair, on the scheduler alone -------------------------------------------------------------
def scheduler_with_three_prompts(reservation):
    """A Scheduler on one pool of 2 layers x 4 experts, three prompts of 6, 5 and 4 tokens
    admitted in one step (optimistic admission: all fit)."""
    manager = KVCacheManager(2, 4, 4, 200)
    config = SchedulerConfig(max_num_seqs=8, admission="optimistic", reservation=reservation)
    scheduler = Scheduler(config, manager, ModelShape(2, 2, 64))
    for request_id, prompt_len in enumerate((6, 5, 4)):
        scheduler.add_request(Request(request_id, [7] * prompt_len, SamplingParams(max_new_tokens=3)))
    return scheduler


def test_a_repair_preempts_the_chunk_scheduled_last_and_keeps_the_others():
    policy = CalibratedReservation(headroom_decay=0.5)
    scheduler = scheduler_with_three_prompts(policy)
    out = scheduler.schedule(0)
    assert [item.request.request_id for item in out.scheduled] == [0, 1, 2]
    dropped = scheduler.repair(out, torch.tensor([3]))
    assert dropped.request_id == 2 and dropped.status is RequestStatus.PREEMPTED
    assert [item.request.request_id for item in out.scheduled] == [0, 1]  # the others go on
    assert scheduler.waiting[0] is dropped and dropped not in scheduler.running
    assert out.events[-1] == ("preempted", dropped)
    assert policy.headroom.tolist() == [3.0]  # the fault raised the headroom
    assert (scheduler.num_repairs, scheduler.num_repaired_tokens) == (1, 4)


def test_a_step_of_decode_tokens_alone_has_nothing_to_drop():
    """Decode tokens reserve their worst case, so only a chunk can run short: a repair asked of a
    step without one is a broken invariant, raised, with nothing changed."""
    scheduler = scheduler_with_three_prompts(CalibratedReservation())
    out = scheduler.schedule(0)
    out.scheduled = [item for item in out.scheduled if False]  # no chunk left
    with pytest.raises(RuntimeError, match="no chunk to drop"):
        scheduler.repair(out, torch.tensor([1]))
    assert scheduler.num_repairs == 0 and len(scheduler.running) == 3
    worst = scheduler_with_three_prompts("worst_case")
    out = worst.schedule(0)
    with pytest.raises(RuntimeError, match="no chunk to drop"):  # nor does a policy that never runs short
        worst.repair(out, torch.tensor([1]))


def test_the_runner_charges_a_step_for_its_busiest_device():
    """The cost model splits a step's token work evenly over the devices; the step waits for the one
    with the most entries: D x its share, 1 when even, D when one device takes everything."""
    trace, _, placement = skewed_workload(4, seed=0)
    runner = TraceRunner(trace, placement, RunnerSetup(900), "newest_first", FREE)
    manager = runner.manager
    manager.add_sequence(0)
    rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(0)]))[0]  # (L * E,)
    devices = manager.device_of_rows(rows)
    on_device = [int(rows[(devices == d).nonzero()[0]]) for d in range(4)]  # a row on each device
    even = torch.tensor(on_device)
    assert runner._hot_load(even, torch.ones(4, dtype=torch.int64)) == 1.0
    one = torch.tensor([on_device[0]] * 2)
    assert runner._hot_load(one, torch.tensor([3, 5])) == 4.0
    lopsided = torch.tensor(on_device[:2])
    assert runner._hot_load(lopsided, torch.tensor([3, 1])) == 4 * 3 / 4


def test_the_paged_cache_names_the_layer_whose_append_ran_short():
    """The engine counts a dropped chunk's thrown-away work up to the short layer, which the paged
    cache's append_kv names on the OutOfBlocksError it raises (nothing stored or allocated)."""
    config = small_config("expert", "topk", num_hidden_layers=3)
    cache = PagedKVCache(config, num_blocks=9, block_size=4)
    k = torch.zeros(28, config.num_key_value_heads, config.head_dim)
    positions = torch.arange(28)
    seqs = torch.zeros(28, dtype=torch.int64)
    cache.append_kv(0, seqs, torch.zeros(28, dtype=torch.int64), positions, k, k)  # 7 of 9 blocks
    with pytest.raises(OutOfBlocksError) as raised:  # 3 rows of 3, 3 and 2 tokens: 3 blocks
        cache.append_kv(1, seqs[:8], torch.arange(8) % 3, positions[:8], k[:8], k[:8])
    assert raised.value.layer == 1 and raised.value.shortfall.tolist() == [1]
    assert cache.manager.num_free_blocks == 2


def test_a_repair_in_the_engine_counts_the_layers_run_up_to_the_short_one():
    """LLMEngine's repair: the chunk scheduled last leaves the step and its tokens x (short layer +
    1) are counted thrown away (layer 1 of 3: two layers' work)."""
    engine = calibrated_engine(num_hidden_layers=3)
    for prompt_len in (6, 5):
        engine.add_request([3] * prompt_len, SamplingParams(max_new_tokens=2))
    decision = engine.scheduler.schedule(0)
    engine._repair(decision, OutOfBlocksError("short", torch.tensor([1]), layer=1))
    stats = engine.stats()
    assert (stats.num_repairs, stats.num_thrown_away_token_layers) == (1, 5 * 2)
