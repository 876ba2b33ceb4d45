"""The scheduler's arithmetic, decisions and policies, without a model.

Bounds: the worst case of one step and of a lifetime are upper bounds of what any routing can take
(checked against random routings), and exact on hand-made cases. The predictor starts at k_max and
follows what it observes. Bad configurations raise before anything exists.
"""

import pytest
import torch

import moekv_ref.engine.scheduler as scheduler_module
import moekv_ref.engine.scheduler_factory as scheduler_factory
from moekv_ref.cache.block_pool import OutOfBlocksError
from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.cache.prefix_caching_manager import PrefixCachingKVCacheManager
from moekv_ref.engine.admission import predicted_peak
from moekv_ref.engine.demand import (
    DemandPredictor,
    blocks_held_per_device,
    min_lifetime_blocks,
    reserved_blocks,
    worst_case_lifetime_blocks,
    worst_case_lifetime_blocks_per_device,
    worst_case_step_blocks,
    worst_case_step_blocks_per_device,
)
from moekv_ref.engine.memory import ModelShape
from moekv_ref.engine.optimistic_reservation import OptimisticReservation
from moekv_ref.engine.prefix_caching_scheduler import PrefixCachingScheduler
from moekv_ref.engine.request import Request, RequestStatus
from moekv_ref.engine.reservation import Retry, WorstCaseReservation
from moekv_ref.engine.row_evicting_scheduler import RowEvictingScheduler
from moekv_ref.engine.scheduler import Scheduler
from moekv_ref.engine.scheduler_config import SchedulerConfig
from moekv_ref.engine.scheduler_output import SchedulerOutput
from moekv_ref.engine.swap import SWAP_IN, SWAP_OUT
from moekv_ref.engine.swapping_scheduler import SwappingScheduler
from moekv_ref.engine.undo import Snapshot
from moekv_ref.engine.victims import RowEviction, Shortage, VictimPolicy
from moekv_ref.sampling import SamplingParams
from moekv_ref.sim.fast_scheduler import FastScheduler


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
        # the scheduler's per-device bounds: with D = 1 the one-pool ones; with every row on device 1
        # of 2 (a pool with home devices), the one-pool ones there and nothing on device 0
        for devices, D, expected in (
            (torch.zeros(1, L, E, dtype=torch.int64), 1, [[bound]]),
            (torch.ones(1, L, E, dtype=torch.int64), 2, [[0, bound]]),
        ):
            assert (
                worst_case_step_blocks_per_device(counts, torch.tensor([n]), k_max, P, devices, D).tolist()
                == expected
            )
            assert blocks_held_per_device(counts, P, devices, D).tolist()[0][-1] == before
            lifetime = worst_case_lifetime_blocks(total + n, L, E, k_max, P)
            assert worst_case_lifetime_blocks_per_device(
                torch.tensor([total + n]), k_max, P, devices, D
            ).tolist() == [[lifetime] if D == 1 else [0, lifetime]]
        for _ in range(n):  # each token to 1..k_max random experts per layer
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
    predictor.observe(torch.tensor([10, 15]), num_tokens=10)  # 1.0 and 1.5 experts per token
    assert predictor.k_avg.tolist() == [1.0, 1.5]
    # 64 tokens: layer 0 has 64 entries over min(8, 64) = 8 rows -> 64/16 + 8 * 15/16 = 11.5 -> 12;
    # layer 1 has 96 entries -> 6 + 7.5 = 13.5 -> 14
    assert predictor.predict(64) == 12 + 14


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("policy", "fifo"),
        ("admission", "lucky"),
        ("preemption_mode", "evict_one_expert"),
    ],
)
def test_bad_scheduler_config_names_the_value(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


# ----- decisions, with no model -------------------------------------------------------------------
# A KVCacheManager and a Scheduler alone, stepped by hand: `schedule()`, then the forward simulated by
# allocating each scheduled token in the manager under a hand-made routing, then `update_from_output`
# with a made-up sampled token. L=2 layers, E=4 experts, k_max=2, P=4 slots per block; the pool is
# unshuffled, so it hands out blocks 0, 1, 2, ... and reuses the last freed first.


SHAPE = ModelShape(k_max=2, k_min=1, max_num_positions=64)
NUM_LAYERS = 2  # the manager's L
NUM_EXPERTS = 4  # E
BLOCK_SIZE = 4  # P
EXPERTS_01 = torch.tensor([1, 1, 0, 0])  # a token routed to experts 0 and 1, in every layer
EXPERTS_23 = torch.tensor([0, 0, 1, 1])


@pytest.fixture(params=[Scheduler, FastScheduler], ids=["plain", "fast"])
def scheduler_class(request):
    """Every behaviour test runs on the engine's plain Scheduler and on the trace runner's
    FastScheduler (sim/fast_scheduler.py): the same decisions, step by step."""
    return request.param


def make_scheduler(scheduler_class, num_blocks, num_swap_blocks=0, **config):
    """scheduler_class with the variants the config asks for (a swap space: SwappingScheduler)."""
    manager = KVCacheManager(NUM_LAYERS, NUM_EXPERTS, BLOCK_SIZE, num_blocks)
    return scheduler_factory.make_scheduler(
        SchedulerConfig(**config), manager, SHAPE, num_swap_blocks, base=scheduler_class
    )


def add(scheduler, request_id, prompt_len, max_new_tokens):
    request = Request(
        request_id, [7] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    )
    scheduler.check_fits_alone(prompt_len, max_new_tokens)
    scheduler.add_request(request)
    return request


def run_forward(scheduler, out, experts=EXPERTS_01):
    """What the model's forward would do to the manager: every scheduled token goes to `experts`
    (E,) in every layer; then every request that samples gets token 1."""
    manager = scheduler.manager
    for item in out.scheduled:
        seq_id = item.request.request_id
        if seq_id not in manager.sequences:
            manager.add_sequence(seq_id)
        rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0]  # (L*E,)
        manager.allocate_slots(rows, (experts * item.num_tokens).repeat(NUM_LAYERS))
    sampled = {item.request.request_id: 1 for item in out.scheduled if item.samples}
    return scheduler.update_from_output(out, sampled)


def ids(requests):
    return [r.request_id for r in requests]


def test_optimistic_admission_admits_while_the_step_worst_case_fits(scheduler_class):
    scheduler = make_scheduler(scheduler_class, 20, admission="optimistic")
    for i in range(3):
        add(scheduler, i, prompt_len=3, max_new_tokens=4)
    out = scheduler.schedule(0)
    # a 3-token prompt may open min(bound A = 4 rows x 1, bound B = 4 + (6 - 4) // 4) = 4 blocks per
    # layer: 8 reserved each; 8 + 8 <= 20, but a third 8 would make 24 > 20
    assert [(s.request.request_id, s.num_tokens, s.reserved_blocks) for s in out.scheduled] == [
        (0, 3, 8),
        (1, 3, 8),
    ]
    assert ids(out.admitted) == [0, 1] and ids(scheduler.waiting) == [2] and not out.block_copies
    run_forward(scheduler, out)
    # each sequence: rows (layer, expert 0/1) got a block each, in row order
    assert scheduler.manager.blocks_of_sequence(0).tolist() == [0, 1, 2, 3]
    assert scheduler.manager.blocks_of_sequence(1).tolist() == [4, 5, 6, 7]
    out = scheduler.schedule(1)
    # decode: the two empty rows per layer may each open a block -> 4 reserved each; 8 of 12 free;
    # the third request's 8 would need 16 > 12
    assert [(s.request.request_id, s.reserved_blocks) for s in out.scheduled] == [(0, 4), (1, 4)]
    assert not out.admitted


def test_a_step_where_every_running_request_fits_asks_the_pool_once_on_the_fast_path(
    scheduler_class, monkeypatch
):
    """The usual decode step: the running requests' worst cases fit the pool all together. The plain
    scheduler checks the pool once a request, as the module docstring's loop says; the fast one once
    for all of them; both schedule each with its own worst case (step_blocks, asked here
    afterwards). When they do not all fit, it goes request by request and preempts:
    test_the_newest_request_is_preempted_when_the_step_does_not_fit."""
    scheduler = make_scheduler(scheduler_class, 40, admission="optimistic")
    requests = [add(scheduler, i, prompt_len=3, max_new_tokens=4) for i in range(3)]
    run_forward(scheduler, scheduler.schedule(0))
    assert not scheduler.waiting and len(scheduler.running) == 3
    checks = []
    original = Scheduler.fits
    monkeypatch.setattr(
        Scheduler, "fits", lambda self, demand: checks.append(list(demand)) or original(self, demand)
    )
    out = scheduler.schedule(1)
    expected = [(r.request_id, 1, int(scheduler.step_blocks(r, 1).sum())) for r in requests]
    assert [(s.request.request_id, s.num_tokens, s.reserved_blocks) for s in out.scheduled] == expected
    assert sum(checks[-1]) == out.reserved_blocks == sum(e[2] for e in expected) > 0
    assert len(checks) == (1 if scheduler_class is FastScheduler else len(requests))


@pytest.mark.parametrize("seed", range(3))
def test_the_one_pool_need_is_the_per_device_bounds_with_one_device(seed, monkeypatch):
    """With one pool the fast scheduler takes its need (a step's worst case, capped by the lifetime's
    minus what is held) in fewer tensor calls than demand.py's per-device form: the same numbers,
    on random rows, decode and prefill steps, with the lifetime cap binding on some; and the
    per-device form is not what ran (it raises here)."""
    generator = torch.Generator().manual_seed(seed)
    scheduler = make_scheduler(FastScheduler, 40)
    L = NUM_LAYERS
    E = NUM_EXPERTS
    K = SHAPE.k_max
    P = BLOCK_SIZE
    m = 12
    counts = torch.randint(0, 3 * P + 2, (m, L, E), generator=generator)
    num_tokens = torch.randint(1, 2 * P + 3, (m,), generator=generator).tolist()
    # totals from a row's largest count (each token reaches a row at most once) to well above it
    extra = torch.randint(0, 4 * P, (m,), generator=generator) * (torch.arange(m) % 2)  # 0 on even rows
    totals = (counts.amax((1, 2)) + torch.tensor(num_tokens) + extra).tolist()
    devices = torch.zeros(m, L, E, dtype=torch.int64)
    held = blocks_held_per_device(counts, P, devices, 1)
    step = worst_case_step_blocks_per_device(counts, torch.tensor(num_tokens), K, P, devices, 1)
    lifetime = worst_case_lifetime_blocks_per_device(torch.tensor(totals), K, P, devices, 1)
    expected = torch.clamp(torch.minimum(step, lifetime - held), min=0)
    for name in (
        "blocks_held_per_device",
        "worst_case_step_blocks_per_device",
        "worst_case_lifetime_blocks_per_device",
    ):
        monkeypatch.setattr(scheduler_module, name, lambda *args: pytest.fail("the per-device form ran"))
    need = scheduler.worst_case_need(counts, num_tokens, totals, devices)  # the one-pool path
    assert need.dtype == torch.int64 and need.tolist() == expected.tolist()
    assert (expected < step).any() and (expected > 0).any()  # the cap binds on some, not on all


def test_predicted_admission_refuses_what_the_predicted_peak_cannot_hold(scheduler_class):
    # Before any routing is observed the predictor assumes k_max = 2 experts per token. Request 0
    # (running, holding nothing yet) is predicted to end at 6 tokens x 2 experts = 12 entries per
    # layer: 12/4 + 4 rows x 3/4 = 6 blocks, 12 in all; request 1 the same. Both peak in the same
    # last step: 24 > 20, so the prediction refuses request 1, which the optimistic rule admits.
    predicted = make_scheduler(scheduler_class, 20, admission="predicted")
    optimistic = make_scheduler(scheduler_class, 20, admission="optimistic")
    for scheduler in (predicted, optimistic):
        first, second = add(scheduler, 0, 3, 4), add(scheduler, 1, 3, 4)
    out = predicted.schedule(0)
    assert ids(out.admitted) == [0]
    assert predicted_peak([first, second], predicted.memory, predicted.predictor) == 24
    assert ids(optimistic.schedule(0).admitted) == [0, 1]


def preemption_scenario(scheduler_class, mode):
    """Two requests (3-token prompts, 4 new tokens) in a pool of 16 blocks. Steps 0-2 fill it:
    prefill routes to experts 0/1 (blocks 0-3 and 4-7), the first decode token to experts 2/3
    (blocks 8-11 and 12-15), the second to experts 0/1 again (rows 0 and 1 reach 4 tokens: full)."""
    scheduler = make_scheduler(
        scheduler_class,
        16,
        num_swap_blocks=8 if mode == "swap" else 0,
        admission="optimistic",
        preemption_mode=mode,
    )
    add(scheduler, 0, 3, 4)
    add(scheduler, 1, 3, 4)
    for step, experts in enumerate([EXPERTS_01, EXPERTS_23, EXPERTS_01]):
        out = scheduler.schedule(step)
        assert ids(s.request for s in out.scheduled) == [0, 1] and not out.preempted
        run_forward(scheduler, out, experts)
    assert scheduler.manager.num_free_blocks == 0
    assert scheduler.manager.blocks_of_sequence(1).tolist() == [4, 5, 12, 13, 6, 7, 14, 15]
    return scheduler


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_newest_request_is_preempted_when_the_step_does_not_fit(scheduler_class, mode):
    scheduler = preemption_scenario(scheduler_class, mode)
    out = scheduler.schedule(3)
    # request 0's full rows 0 and 1 may each open a block in both layers: 4 blocks, none free. The
    # newest running request, 1, is preempted; its 8 blocks return and request 0 runs alone.
    assert ids(out.preempted) == [1] and not out.admitted and not out.resumed
    assert [(s.request.request_id, s.reserved_blocks) for s in out.scheduled] == [(0, 4)]
    request = out.preempted[0]
    assert request.status is RequestStatus.PREEMPTED and ids(scheduler.waiting) == [1]
    assert 1 not in scheduler.manager.sequences and scheduler.manager.num_free_blocks == 8
    if mode == "recompute":
        assert out.freed == [1] and not out.block_copies
        assert request.num_computed_tokens == 0 and request.num_recomputed_tokens == 5
    else:
        # its device blocks, row by row, go to host blocks 0..7 of the (unshuffled) swap space
        assert [(c.direction, c.source.tolist(), c.destination.tolist()) for c in out.block_copies] == [
            (SWAP_OUT, [4, 5, 12, 13, 6, 7, 14, 15], list(range(8)))
        ]
        assert out.freed == [] and request.num_computed_tokens == 5 and request.swapped
        assert scheduler.memory.num_swapped_blocks == 8
    # request 0 decodes its last token into 2 new blocks per layer, taken from the freed ones, last
    # freed first (15, 14, 7, 6); it finishes and frees all 12 of its blocks
    assert ids(run_forward(scheduler, out)) == [0]
    out = scheduler.schedule(4)
    assert ids(out.resumed) == [1] and not out.admitted
    if mode == "recompute":
        # all 6 tokens (3 prompt + 3 sampled) as one prefill: up to 6 blocks per layer (4 rows +
        # (12 entries - 4) // 4)
        assert [(s.num_tokens, s.reserved_blocks) for s in out.scheduled] == [(6, 12)]
        assert not out.block_copies
    else:
        # swap-in: its saved counts (4, 4, 1, 1 per layer: 8 blocks) are allocated again, row by
        # row, from the free queue, whose top is request 0's blocks in reverse of their freeing
        # order (0, 15, 1, 14, 8, 9, 2, 7, 3, 6, 10, 11); the host blocks return to the swap space
        assert [(c.direction, c.source.tolist(), c.destination.tolist()) for c in out.block_copies] == [
            (SWAP_IN, list(range(8)), [11, 10, 6, 3, 7, 2, 9, 8])
        ]
        assert scheduler.manager.blocks_of_sequence(1).tolist() == [11, 10, 6, 3, 7, 2, 9, 8]
        assert scheduler.memory.num_swapped_blocks == 0
        assert [(s.num_tokens, s.reserved_blocks) for s in out.scheduled] == [(1, 4)]
    assert ids(run_forward(scheduler, out)) == [1]
    scheduler.memory.assert_no_leak()
    assert not scheduler.has_unfinished


class OldestFirst(VictimPolicy):
    """For the test: preempt the oldest candidate."""

    name = "oldest_first"

    def choose_victim(self, candidates, memory, need):
        # what the step is short of: 4 blocks on the one device, all of them its own step's
        assert need == Shortage(device=0, num_blocks=4, request_need=4) and memory.num_free_blocks == 0
        return candidates[0]


def test_a_victim_policy_object_chooses_who_is_preempted(scheduler_class):
    scheduler = make_scheduler(scheduler_class, 16, admission="optimistic", victim=OldestFirst())
    add(scheduler, 0, 3, 4)
    add(scheduler, 1, 3, 4)
    for step, experts in enumerate([EXPERTS_01, EXPERTS_23, EXPERTS_01]):
        run_forward(scheduler, scheduler.schedule(step), experts)
    out = scheduler.schedule(3)
    # request 0 is preempted (it was the candidate chosen, and the one being scheduled); request 1
    # then fits in the 8 blocks it freed
    assert ids(out.preempted) == [0]
    assert [(s.request.request_id, s.reserved_blocks) for s in out.scheduled] == [(1, 4)]


def test_a_victim_outside_the_candidates_is_an_error(scheduler_class):
    class Wrong(VictimPolicy):
        def choose_victim(self, candidates, memory, need):
            return Request(99, [1], SamplingParams())

    scheduler = make_scheduler(scheduler_class, 16, admission="optimistic", victim=Wrong())
    add(scheduler, 0, 3, 4)
    add(scheduler, 1, 3, 4)
    for step, experts in enumerate([EXPERTS_01, EXPERTS_23, EXPERTS_01]):
        run_forward(scheduler, scheduler.schedule(step), experts)
    with pytest.raises(RuntimeError, match="chose request 99, not one of the candidates"):
        scheduler.schedule(3)


class DropFirstRow(VictimPolicy):
    """Drops row (layer 0, expert 0) of the newest candidate (a victim policy that evicts rows)."""

    evicts_rows = True

    def choose_victim(self, candidates, memory, need):
        return RowEviction(candidates[-1], ((0, 0),))


def test_a_row_eviction_stalls_its_request_which_restarts_from_empty_rows(scheduler_class):
    """make_scheduler builds a RowEvictingScheduler for a victim policy that drops rows. The
    request stalls at the head of the line, its other rows dead weight in the pool, and its worst
    case restarts from empty rows (it is recomputed whole), the same as a request holding nothing;
    when it starts again its dead rows go first."""
    scheduler = make_scheduler(scheduler_class, 40, admission="optimistic", victim=DropFirstRow())
    assert isinstance(scheduler, RowEvictingScheduler) and isinstance(scheduler, scheduler_class)
    request = add(scheduler, 0, prompt_len=6, max_new_tokens=4)
    run_forward(scheduler, scheduler.schedule(0))  # 6 tokens into experts 0 and 1 of both layers
    out = SchedulerOutput(1)
    choice = scheduler.victims.choose_victim([request], scheduler.memory, 1)
    assert scheduler.take_off(choice, [request], out) == (request, "rows")
    assert scheduler.stalled == {0: request} and list(scheduler.waiting) == [request]
    held = scheduler.memory.token_counts([0])[0]  # (L, E): the three rows left
    assert held.tolist() == [[0, 6, 0, 0], [6, 6, 0, 0]] and request.num_computed_tokens == 0
    pending = request.num_pending_tokens  # its prompt and its sampled token, all to recompute
    fresh = Request(1, [7] * pending, SamplingParams(max_new_tokens=4, temperature=0))
    stalled_need = scheduler.worst_case_step_blocks([request], [pending])
    assert torch.equal(stalled_need, scheduler.worst_case_step_blocks([fresh], [pending]))
    out = scheduler.schedule(1)
    assert ids(out.resumed) == [0] and not scheduler.stalled  # its dead rows went as it started
    assert scheduler.memory.token_counts([0]).sum() == 0  # nothing computed yet this step
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [(0, pending)] == [(0, 7)]


def test_continuous_reserved_admits_while_lifetime_reservations_fit(scheduler_class):
    # 6 cached tokens reserve ceil(6/4) = 2 blocks in each of the 8 rows: 16 per request. Two fit a
    # pool of 40; the third would make 48, although its step (8 blocks) fits the 24 left.
    scheduler = make_scheduler(scheduler_class, 40, policy="continuous_reserved")
    for i in range(3):
        add(scheduler, i, 3, 4)
    assert ids(scheduler.schedule(0).admitted) == [0, 1]


def test_static_batch_is_padded_by_the_policy_and_admits_only_when_done(scheduler_class):
    # padded length = longest prompt 5 + longest output 6 - 1 = 10 tokens: 8 rows x 3 blocks = 24
    # reserved each, two fit 48. Request 0 decodes 6 tokens (4 of padding), as its batch does.
    scheduler = make_scheduler(scheduler_class, 48, policy="static")
    short, long = add(scheduler, 0, 3, 2), add(scheduler, 1, 5, 6)
    assert not hasattr(short, "num_padding_tokens")
    finished_at = {}
    for step in range(20):
        if step == 1:
            add(scheduler, 2, 2, 2)
        out = scheduler.schedule(step)
        if step == 0:
            assert ids(out.admitted) == [0, 1]
        if 2 in ids(out.admitted):
            assert set(finished_at) == {0, 1}  # only once the whole first batch is done
            assert finished_at[0] == finished_at[1] == step - 1
        for request in run_forward(scheduler, out):
            finished_at[request.request_id] = step
        if not scheduler.has_unfinished:
            break
    assert len(short.output_token_ids) == 6 and short.generated_token_ids == [1, 1]
    assert len(long.generated_token_ids) == 6 and set(finished_at) == {0, 1, 2}
    scheduler.memory.assert_no_leak()


@pytest.mark.parametrize(
    "config,match",
    [
        ({"policy": "static", "admission": "optimistic"}, "applies to policy='continuous_paged' only"),
        ({"victim": "random"}, "victim='random' is not one of"),
        ({"policy": "static", "reservation": "optimistic"}, "applies to policy='continuous_paged' only"),
        (
            {"policy": "static", "reservation": OptimisticReservation()},
            "applies to policy='continuous_paged' only",
        ),
        ({"reservation": "lucky"}, "reservation='lucky' is not one of"),
        ({"policy": object()}, "policy=<object"),
    ],
)
def test_options_that_do_not_apply_or_do_not_exist_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**config)


def test_make_scheduler_puts_the_variants_a_manager_and_config_need_before_the_plain_class():
    """scheduler_factory.make_scheduler is the one place that picks a scheduler's class: the plain
    one (Scheduler, or the trace runner's FastScheduler) alone, or with the variants before it, whose
    STATE lists every class's; a pair that cannot combine is refused with its reason."""
    plain = KVCacheManager(NUM_LAYERS, NUM_EXPERTS, BLOCK_SIZE, 40)
    cached = PrefixCachingKVCacheManager(NUM_LAYERS, NUM_EXPERTS, BLOCK_SIZE, 40)
    build = scheduler_factory.make_scheduler
    assert type(build(SchedulerConfig(), plain, SHAPE)) is Scheduler
    assert type(build(SchedulerConfig(), plain, SHAPE, base=FastScheduler)) is FastScheduler
    assert type(build(SchedulerConfig(), cached, SHAPE)) is PrefixCachingScheduler
    swap = SchedulerConfig(preemption_mode="swap", victim="expert_lru")
    both = type(build(swap, plain, SHAPE, 8, base=FastScheduler))
    assert both.__mro__[1:4] == (RowEvictingScheduler, SwappingScheduler, FastScheduler)
    assert {"stalled", "num_swapped_out_blocks", "_fresh_needs"} <= set(both.STATE)
    assert len(both.STATE) == len(set(both.STATE))
    fast_cached = type(build(SchedulerConfig(), cached, SHAPE, base=FastScheduler))
    assert fast_cached.__mro__[1:3] == (PrefixCachingScheduler, FastScheduler)
    assert {"_hit", "_fresh_needs"} <= set(fast_cached.STATE)
    with pytest.raises(ValueError, match="drops single rows, which this cache cannot"):
        build(SchedulerConfig(victim="expert_lru"), cached, SHAPE)  # cached blocks are shared
    with pytest.raises(ValueError, match="preemption_mode='swap' swaps, which a Scheduler does not"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), plain, SHAPE, 8)


# ----- reservation policies (reservation.py, optimistic_reservation.py) -----------------------------


def scheduled(out):
    return [(s.request.request_id, s.num_tokens, s.reserved_blocks) for s in out.scheduled]


@pytest.mark.parametrize("reservation", ["worst_case", WorstCaseReservation()])
def test_worst_case_reservation_reserves_every_steps_worst_case_and_never_retries(
    scheduler_class, reservation
):
    """The default, by name or as an object: a 3-token prompt reserves its worst case, 8 blocks
    (test_optimistic_admission_admits_while_the_step_worst_case_fits), a decode token 4 (the two
    empty rows of each layer may open a block); no step may run short, so none is retried."""
    scheduler = make_scheduler(scheduler_class, 20, admission="optimistic", reservation=reservation)
    assert isinstance(scheduler.reservation, WorstCaseReservation) and not scheduler.reservation.retries
    for i in range(3):
        add(scheduler, i, prompt_len=3, max_new_tokens=4)
    assert not scheduler.may_run_short()  # a request may join, yet the step's worst case is reserved
    out = scheduler.schedule(0)
    assert scheduled(out) == [(0, 3, 8), (1, 3, 8)] and ids(scheduler.waiting) == [2]
    run_forward(scheduler, out)
    out = scheduler.schedule(1)
    assert scheduled(out) == [(0, 1, 4), (1, 1, 4)] and not out.admitted  # 4 + 4 + 8 > 12 free
    with pytest.raises(ValueError, match="reservation='worst_case' never runs short"):
        scheduler.reservation.retry(out, OutOfBlocksError("short", torch.tensor([1])), None)
    with pytest.raises(ValueError, match="not reservation='worst_case'"):
        scheduler.schedule(2, Retry(torch.tensor([1]), 0))


def run_short_step(scheduler, step, experts):
    """Schedule and run a step, as LLMEngine.step does under a reservation that retries: a forward
    that runs short undoes the step, which is scheduled again as the policy's `retry` says.
    Returns the tries' outputs and the retries given; a step still short after 4 tries fails."""
    outs, retries, retry = [], [], None
    for _ in range(4):
        before = Snapshot(scheduler)
        out = scheduler.schedule(step, retry)
        outs.append(out)
        try:
            run_forward(scheduler, out, experts)
            return outs, retries
        except OutOfBlocksError as error:
            before.restore()
            retry = scheduler.reservation.retry(out, error, retry)
            retries.append(retry)
    raise AssertionError(f"step {step} still ran short after {len(outs)} tries: {retries}")


def test_optimistic_reservation_reserves_a_prompts_expected_blocks_and_nothing_for_decode_tokens(
    scheduler_class,
):
    """A prompt reserves what the predictor expects of it (before any observation it assumes k_max
    experts a token: 8 blocks for 3 tokens, the worst case here), a decode token nothing: the decode
    step of requests 0 and 1 leaves room to admit request 2, which worst-case reservation refuses
    (test_worst_case_reservation_reserves_every_steps_worst_case_and_never_retries). One device
    holding every expert: the expected blocks go to it whole."""
    scheduler = make_scheduler(scheduler_class, 20, admission="optimistic", reservation="optimistic")
    assert isinstance(scheduler.reservation, OptimisticReservation) and scheduler.reservation.retries
    for i in range(3):
        add(scheduler, i, prompt_len=3, max_new_tokens=4)
    assert scheduler.predictor.predict(3) == 8
    out = scheduler.schedule(0)
    assert scheduled(out) == [(0, 3, 8), (1, 3, 8)]  # a third 8 would make 24 > 20
    run_forward(scheduler, out)
    out = scheduler.schedule(1)
    assert scheduled(out) == [(0, 1, 0), (1, 1, 0), (2, 3, 8)] and ids(out.admitted) == [2]


def test_an_optimistic_step_that_admitted_and_ran_short_is_retried_without_its_joiner(scheduler_class):
    """Requests 0 and 1 hold 8 of 16 blocks; the decode step reserves nothing and admits request 2
    (its prompt's expected 8 fit the 8 free). The routers send every token to the empty experts 2
    and 3: 4 blocks each, 12 > 8, so the step runs short. It had admitted one request beside
    others: retried admitting none (1 // 2), and the two decodes then fit."""
    scheduler = make_scheduler(scheduler_class, 16, admission="optimistic", reservation="optimistic")
    for i in range(3):
        add(scheduler, i, prompt_len=3, max_new_tokens=4)
    run_forward(scheduler, scheduler.schedule(0))
    assert scheduler.may_run_short()  # request 2 may join the next step
    outs, retries = run_short_step(scheduler, 1, EXPERTS_23)
    assert [scheduled(out) for out in outs] == [[(0, 1, 0), (1, 1, 0), (2, 3, 8)], [(0, 1, 0), (1, 1, 0)]]
    assert [(r.shortfall.tolist(), r.max_admissions) for r in retries] == [([0], 0)]
    assert ids(scheduler.waiting) == [2] and ids(scheduler.running) == [0, 1]
    assert int(scheduler.memory.num_free_blocks_per_device[0]) == 0


def test_an_optimistic_step_that_admitted_none_and_ran_short_frees_its_shortfall_first(scheduler_class):
    """Two requests (max_num_seqs=2) fill 16 blocks as their rows of experts 0-1, then 2-3, grow;
    their sixth tokens go back to experts 0 and 1, whose rows are full: each needs 4 blocks and none
    is free. The step admitted none: retried with the shortfall (4: the first request's append) freed
    first by the victim policy, which preempts the newest; the oldest then runs alone."""
    scheduler = make_scheduler(
        scheduler_class, 16, admission="optimistic", reservation="optimistic", max_num_seqs=2
    )
    for i in range(2):
        add(scheduler, i, prompt_len=3, max_new_tokens=4)
    for step, experts in enumerate([EXPERTS_01, EXPERTS_01, EXPERTS_23]):
        outs, retries = run_short_step(scheduler, step, experts)
        assert len(outs) == 1
    assert int(scheduler.memory.num_free_blocks_per_device[0]) == 0
    assert scheduler.may_run_short()  # the decodes' worst case (8) exceeds the free blocks (0)
    outs, retries = run_short_step(scheduler, 3, EXPERTS_01)
    assert [scheduled(out) for out in outs] == [[(0, 1, 0), (1, 1, 0)], [(0, 1, 0)]]
    assert [(r.shortfall.tolist(), r.max_admissions) for r in retries] == [([4], 0)]
    assert ids(outs[1].preempted) == [1] and ids(scheduler.waiting) == [1]
