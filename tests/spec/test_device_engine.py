"""The engine over per-device pools: every victim policy serves every request with exactly the tokens
of generating it alone, with no block left on any device; a request is preempted because one device
is short while the others have room; per-device refusal; the victim policies' choices on a stub
memory view (exact requests and rows); free_rows; random evict / resume / finish programs on the per-device
manager and its swap space keep ownership and reference counts exact against a plain-dict model.

Small random float64 models (helpers), so that a tie in argmax cannot flip between batchings, plus
one case on the embedded model."""

from types import SimpleNamespace

import pytest
import torch
from helpers import alone_tokens, random_model, random_workload, small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from moekv_ref.cache import (
    BlockPool,
    KVCacheManager,
    OutOfBlocksError,
    PrefixCachingKVCacheManager,
    RowPlacement,
    SharedTailKVCacheManager,
)
from moekv_ref.engine import LLMEngine, ModelShape, SchedulerConfig
from moekv_ref.engine.row_evicting_scheduler import RowEvictingScheduler
from moekv_ref.engine.scheduler import Scheduler
from moekv_ref.engine.scheduler_factory import make_scheduler
from moekv_ref.engine.swap import SwapSpace
from moekv_ref.engine.victims import ExpertLRU, PressureAware, RowEviction, SequenceLRU, Shortage
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams

BLOCK_SIZE = 4
# 8 experts on 4 devices, skewed: device 0 holds three experts, device 3 one
PLACEMENT = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
BLOCKS = [36, 40, 40, 40]


def device_engine(model, blocks_per_device, device_of_expert, block_size, config=None, **options):
    """The engine over per-device pools."""
    return LLMEngine(
        model,
        block_size=block_size,
        scheduler_config=config,
        blocks_per_device=blocks_per_device,
        device_of_expert=device_of_expert,
        **options,
    )


@pytest.fixture(scope="module")
def model():
    return random_model(
        small_config("expert", "threshold", num_attention_experts=8, num_attention_experts_per_tok=2), seed=0
    )


@pytest.fixture(scope="module")
def workload():
    return random_workload(12, (2, 7), (10, 25), seed=0, prompt_seed=1)


@pytest.fixture(scope="module")
def alone(model, workload):
    return alone_tokens(model, *workload)


@pytest.mark.parametrize(
    "victim,mode",
    [
        ("newest_first", "recompute"),
        ("sequence_lru", "swap"),
        ("pressure_aware", "recompute"),
        ("pressure_aware", "swap"),
        ("expert_lru", "recompute"),
    ],
)
def test_every_policy_serves_every_request_as_if_alone(model, workload, alone, victim, mode):
    config = SchedulerConfig(victim=victim, admission="optimistic", preemption_mode=mode)
    engine = device_engine(model, BLOCKS, PLACEMENT, BLOCK_SIZE, config, shuffle_seed=1, record_history=True)
    outputs = engine.generate(*workload)
    assert [o.token_ids for o in outputs] == alone
    engine.memory.assert_no_leak()  # every device, and the swap space
    stats = engine.eviction_stats()
    assert stats["num_preemptions"] > 0  # the pools are short enough to evict
    used = torch.stack(engine.device_timeline)  # (steps, D) never above a device's pool
    assert (used <= torch.tensor(BLOCKS)).all()
    assert stats["peak_used_blocks_per_device"] == used.max(0).values.tolist()  # the running peak
    if victim == "expert_lru":  # rows dropped: the sequences are recomputed
        assert stats["num_row_evictions"] > 0 and stats["num_recomputed_tokens"] > 0
        assert stats["num_evicted_rows"] == stats["num_row_evictions"]  # one row at a time
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0


def test_embedded_model_with_pressure_aware_and_expert_lru_equals_alone():
    from moekv_ref.checkpoint import load_default_model
    from moekv_ref.prompts import encode

    model = load_default_model(dtype=torch.float64)
    prompts = [encode(t) for t in ("The cache", "Experts", "A block", "Memory")]
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, seed=i) for i in range(4)]
    alone = [generate(model, [p], [q], cache="contiguous").tokens[0] for p, q in zip(prompts, params)]
    E = model.config.num_attention_experts
    placement = torch.arange(E) % 4  # round robin, D = 4
    for victim in ("pressure_aware", "expert_lru"):
        engine = device_engine(
            model, [44] * 4, placement, 4, SchedulerConfig(victim=victim, admission="optimistic")
        )
        assert [o.token_ids for o in engine.generate(prompts, params)] == alone
        engine.memory.assert_no_leak()
        assert engine.stats().num_preemptions > 0


def test_one_short_device_preempts_while_the_others_have_room(model, workload, alone):
    """Device 0 holds one expert and a small pool; the others are large: every preemption happens
    while the other devices are far from full."""
    placement = torch.tensor([0, 1, 1, 1, 2, 2, 3, 3])
    blocks = [20, 400, 400, 400]
    engine = device_engine(
        model,
        blocks,
        placement,
        BLOCK_SIZE,
        SchedulerConfig(victim="pressure_aware", admission="optimistic"),
        record_history=True,
    )
    assert [o.token_ids for o in engine.generate(*workload)] == alone
    engine.memory.assert_no_leak()
    used = torch.stack(engine.device_timeline)
    assert engine.stats().num_preemptions > 0
    assert used[:, 0].max() > 0.75 * blocks[0] and (used[:, 1:].max(0).values < 0.5 * 400).all()


def test_without_history_the_engine_keeps_no_per_step_record(model, workload, alone):
    """By default a long-running engine keeps only a running peak per device: nothing grows per step
    or per request served (the device timeline is opt-in, with record_history=True)."""
    config = SchedulerConfig(victim="pressure_aware", admission="optimistic")
    engine = device_engine(model, BLOCKS, PLACEMENT, BLOCK_SIZE, config)
    assert engine.eviction_stats()["peak_used_blocks_per_device"] == []  # no step yet
    assert [o.token_ids for o in engine.generate(*workload)] == alone
    assert engine.device_timeline == [] and engine.timeline == [] and not engine.requests
    assert not engine.scheduler.stalled and (engine.cache.manager.last_appended == -1).all()
    peak = engine.eviction_stats()["peak_used_blocks_per_device"]
    recorded = device_engine(model, BLOCKS, PLACEMENT, BLOCK_SIZE, config, record_history=True)
    recorded.generate(*workload)
    assert peak == torch.stack(recorded.device_timeline).max(0).values.tolist()
    assert all(0 < p <= b for p, b in zip(peak, BLOCKS))


def test_aborting_a_stalled_request_leaves_no_trace(model, workload):
    """expert_lru drops rows and the request stalls (waiting, its other rows dead weight); aborting
    it then takes it out of every table: waiting, stalled, the rows' last uses, its blocks."""
    config = SchedulerConfig(victim="expert_lru", admission="optimistic")
    engine = device_engine(model, BLOCKS, PLACEMENT, BLOCK_SIZE, config)
    ids = [engine.add_request(p, q) for p, q in zip(*workload)]
    scheduler = engine.scheduler
    while not scheduler.stalled:
        assert engine.has_unfinished_requests(), "the workload never stalled a request"
        engine.step()
    request_id = next(iter(scheduler.stalled))
    assert engine.abort_request(request_id).finish_reason == "aborted"
    assert request_id not in scheduler.stalled
    assert all(r.request_id != request_id for r in [*scheduler.waiting, *scheduler.running])
    assert (engine.memory.row_last_used(request_id) == -1).all()
    assert not engine.memory.holds(request_id) and request_id not in engine.requests
    while engine.has_unfinished_requests():  # the others are served, nothing leaks
        engine.step()
    assert not scheduler.stalled and len(ids) == engine.stats().num_finished + 1
    engine.memory.assert_no_leak()


def test_a_request_too_large_for_one_device_is_refused_naming_it(model):
    engine = device_engine(model, [12, 200, 200, 200], PLACEMENT, BLOCK_SIZE)
    with pytest.raises(ValueError, match="may not fit device 0 even alone"):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert not engine.requests and not engine.scheduler.waiting


def test_per_device_pool_sizes_are_checked(model):
    with pytest.raises(ValueError, match="num_blocks=.* must equal sum"):
        from moekv_ref.cache.paged import PagedKVCache

        PagedKVCache(model.config, 100, 4, blocks_per_device=[10, 10, 10, 10], device_of_expert=PLACEMENT)
    with pytest.raises(ValueError, match=r"blocks_per_device\[3\]=1 is too small"):
        device_engine(model, [40, 40, 40, 1], PLACEMENT, BLOCK_SIZE)


# ----- the policies' choices, on a stub memory view ----------------------------------------------------
def stub_memory(counts: dict, last_used: dict, device_of_expert, block_size=1, swap=False):
    """counts/last_used: request id -> (L, E) tensors."""
    D = int(device_of_expert.max()) + 1

    def held(seq_id):
        one_hot = torch.nn.functional.one_hot(device_of_expert, D)
        return torch.einsum("le,led->d", -(-counts[seq_id] // block_size), one_hot)

    return SimpleNamespace(
        token_counts=lambda ids: torch.stack([counts[i] for i in ids]),
        row_last_used=lambda i: last_used[i],
        placement=RowPlacement.by_expert(device_of_expert, D),
        blocks_held_per_device=held,
        has_swap_space=swap,
    )


def requests(*specs):
    return tuple(SimpleNamespace(request_id=i, num_computed_tokens=n) for i, n in specs)


def test_victim_choices_exact():
    # 1 layer, 4 experts: experts 0, 1 on device 0, experts 2, 3 on device 1
    device_of_expert = torch.tensor([[0, 0, 1, 1]])
    counts = {
        0: torch.tensor([[5, 0, 9, 9]]),
        1: torch.tensor([[1, 1, 0, 0]]),
        2: torch.tensor([[0, 0, 4, 0]]),
    }
    last = {
        0: torch.tensor([[3, -1, 9, 9]]),
        1: torch.tensor([[7, 2, -1, -1]]),
        2: torch.tensor([[-1, -1, 1, -1]]),
    }
    memory = stub_memory(counts, last, device_of_expert)
    cands = requests((0, 10), (1, 2), (2, 8))
    short0 = Shortage(device=0, num_blocks=3, request_need=1)
    # sequence_lru: the newest, whatever it holds where memory is short (request 2 holds nothing on device 0)
    assert SequenceLRU().choose_victim(cands, memory, short0) is cands[2]
    # pressure_aware, recompute: room per recomputed token on device 0: r0 (5+1)/10, r1 2/2, r2 0 -> r1
    assert PressureAware().choose_victim(cands, memory, short0) is cands[1]
    # expert_lru: the least recently appended row on device 0: request 1's expert 1 (step 2)
    assert ExpertLRU().choose_victim(cands, memory, short0) == RowEviction(cands[1], ((0, 1),))
    # device 1 short: expert_lru takes request 2's expert 2 (step 1); pressure_aware with a swap
    # space scores room per block swapped: r0 18/23, r2 4/4 -> r2
    short1 = Shortage(device=1, num_blocks=1)
    assert ExpertLRU().choose_victim(cands, memory, short1) == RowEviction(cands[2], ((0, 2),))
    assert (
        PressureAware().choose_victim(cands, stub_memory(counts, last, device_of_expert, swap=True), short1)
        is cands[2]
    )
    # nobody but the request being scheduled holds anything there: it waits itself
    only = requests((2, 8), (1, 2))
    assert PressureAware().choose_victim(only, memory, short1) is only[0]
    assert ExpertLRU().choose_victim(requests((1, 2)), memory, short1) is not None


def test_expert_lru_is_refused_where_rows_cannot_be_evicted():
    """Shared tails and prefix caching share blocks between rows: the scheduler refuses a victim
    policy that drops single rows when it is built, not at its first eviction."""
    shape = ModelShape(k_max=2, k_min=2, max_num_positions=64)
    for manager in (
        PrefixCachingKVCacheManager(2, 3, 4, 64),
        SharedTailKVCacheManager(2, 3, 4, 64),
    ):
        with pytest.raises(
            ValueError, match="victim='expert_lru' drops single rows, which this cache cannot"
        ):
            make_scheduler(SchedulerConfig(victim="expert_lru"), manager, shape)
    plain = make_scheduler(SchedulerConfig(victim="expert_lru"), KVCacheManager(2, 3, 4, 64), shape)
    assert isinstance(plain, RowEvictingScheduler)  # plain pages: fine
    # the plain Scheduler takes whole sequences only: it names where a row-evicting one is built
    with pytest.raises(ValueError, match="victim='expert_lru' drops single rows, which a Scheduler does not"):
        Scheduler(SchedulerConfig(victim="expert_lru"), KVCacheManager(2, 3, 4, 64), shape)


# ----- the per-device pool and manager ---------------------------------------------------------------
def test_device_block_pool_ranges_and_errors():
    pool = BlockPool(blocks_per_device=[3, 2])
    assert pool.allocate(2, device=1).tolist() == [3, 4]  # device 1's range is [3, 5)
    assert pool.num_free_blocks_per_device.tolist() == [3, 0]
    with pytest.raises(OutOfBlocksError, match="device 1 is short"):
        pool.allocate(1, device=1)
    with pytest.raises(TypeError, match="needs a device"):
        pool.allocate(1)
    pool.incref(torch.tensor([3]))
    before = pool.ref_cnt.clone()
    with pytest.raises(ValueError, match="double free"):  # block 0 is free: nothing changes
        pool.free(torch.tensor([3, 4, 0]))
    assert torch.equal(pool.ref_cnt, before)
    pool.free(torch.tensor([3, 3, 4]))
    assert pool.num_free_blocks == 5
    pool.assert_consistent()


def test_manager_rows_take_their_devices_blocks_exact_ids():
    manager = KVCacheManager(1, 4, 2, blocks_per_device=[3, 2], device_of_expert=torch.tensor([0, 0, 1, 1]))
    manager.add_sequence(5)
    rows = manager.rows([5, 5], 0, torch.tensor([1, 2]))
    allocation = manager.allocate_slots(rows, torch.tensor([3, 1]))
    # expert 1 (device 0) takes blocks 0, 1 (slots 0..2); expert 2 (device 1) block 3 (slot 6)
    assert allocation.slot_mapping.tolist() == [0, 1, 2, 6]
    assert manager.num_free_blocks_per_device.tolist() == [1, 1]
    with pytest.raises(OutOfBlocksError, match="device 1 is short"):
        manager.allocate_slots(rows, torch.tensor([0, 4]))  # needs 2 more on device 1, 1 free
    assert manager.num_free_blocks_per_device.tolist() == [1, 1]
    manager.assert_consistent()


def test_manager_free_rows_refuses_shared_tails_and_bad_rows():
    """free_rows, the hook row eviction uses: frees only those rows (the sequence stays)."""
    manager = KVCacheManager(2, 4, 2, 10)
    manager.add_sequence(1)
    manager.allocate_slots(torch.tensor([0, 5]), torch.tensor([3, 1]))
    assert manager.free_rows(torch.tensor([0])) == 2
    assert manager.num_free_blocks == 9 and manager.holds(1)
    manager.assert_consistent()
    with pytest.raises(ValueError, match="not all rows"):
        manager.free_rows(torch.tensor([2 * 4]))
    shared = SharedTailKVCacheManager(2, 4, 2, 10)
    shared.add_sequence(1)
    with pytest.raises(NotImplementedError):
        shared.free_rows(torch.tensor([0]))


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(st.integers(2, 10), min_size=2, max_size=2),
    block_size=st.sampled_from([1, 2]),
    program=st.lists(
        st.tuples(
            st.sampled_from(["append", "evict_rows", "swap_out", "swap_in", "finish"]),
            st.integers(0, 3),
            st.integers(0, 3),
            st.integers(1, 4),
        ),
        max_size=40,
    ),
)
def test_random_evict_resume_finish_programs_keep_ownership_exact(blocks, block_size, program):
    """Against a plain model (sequence -> {expert: tokens}, and swapped sequences' saved counts):
    per-device used blocks, every row's count, and the manager's invariants (each block owned once,
    ref_cnt == owners, on its row's device) after every operation; swap-in restores the counts."""
    device_of_expert = torch.tensor([0, 0, 1, 1])
    manager = KVCacheManager(1, 4, block_size, blocks_per_device=blocks, device_of_expert=device_of_expert)
    space = SwapSpace(manager, 40)
    held: dict[int, dict[int, int]] = {}
    swapped: dict[int, dict[int, int]] = {}

    def used_per_device(model):
        return [
            sum(
                -(-n // block_size)
                for rows in model.values()
                for e, n in rows.items()
                if int(device_of_expert[e]) == d
            )
            for d in range(2)
        ]

    for op, seq, expert, n in program:
        if op == "append" and seq not in swapped:
            trial = {**held, seq: {**held.get(seq, {}), expert: held.get(seq, {}).get(expert, 0) + n}}
            if seq not in held:
                manager.add_sequence(seq)
            row = manager.rows([seq], 0, expert)
            if all(u <= b for u, b in zip(used_per_device(trial), blocks)):
                manager.allocate_slots(row, torch.tensor([n]))
                held = trial
            else:
                with pytest.raises(OutOfBlocksError, match="is short"):
                    manager.allocate_slots(row, torch.tensor([n]))
                held.setdefault(seq, {})
        elif op == "evict_rows" and seq in held:
            manager.free_rows(manager.rows([seq], 0, expert))
            held[seq].pop(expert, None)
        elif op == "swap_out" and seq in held:
            space.swap_out(seq)
            swapped[seq] = held.pop(seq)
        elif op == "swap_in" and seq in swapped:
            need = used_per_device({seq: swapped[seq]})
            free = manager.num_free_blocks_per_device.tolist()
            if all(x <= f for x, f in zip(need, free)):
                space.swap_in(seq)
                held[seq] = swapped.pop(seq)
        elif op == "finish" and seq in held:
            manager.free(seq)
            del held[seq]
        manager.assert_consistent()
        assert (manager.blocks_per_device - manager.num_free_blocks_per_device).tolist() == used_per_device(
            held
        )
        for s, rows in held.items():
            expected = torch.zeros(1, 4, dtype=torch.int64)
            for e, count in rows.items():
                expected[0, e] = count
            assert torch.equal(manager.token_counts([s])[0], expected)
    for s in list(held):
        manager.free(s)
    for s in list(swapped):
        space.swap_in(s)
        manager.free(s)
    assert manager.num_free_blocks_per_device.tolist() == blocks
    manager.assert_consistent()


# ----- home devices: a row's device is its sequence's, not its expert's --------------------------------
def test_with_home_devices_policies_read_each_sequences_devices_not_device_zero():
    """A pool of 2 devices with home devices: every row of sequence s on device s % 2. Asked for a
    row on short device 1, expert_lru must take one of sequence 1's rows (home 1), not give up for
    want of rows there, as it would reading an all-zeros placement; and the reservation of a prefix
    hit for sequence 1 lies on device 1 only."""
    from moekv_ref.engine.memory import MemoryView, ModelShape

    manager = KVCacheManager(1, 2, 1, blocks_per_device=[6, 6], home_devices=True)
    for seq_id in (0, 1):
        manager.add_sequence(seq_id)
        manager.allocate_slots(manager.rows([seq_id, seq_id], 0, [0, 1]), torch.tensor([2, 1]))
    memory = MemoryView(manager, ModelShape(k_max=1, k_min=1, max_num_positions=64))
    assert memory.placement.of_sequences([0, 1])[:, 0].tolist() == [[0, 0], [1, 1]]
    cands = requests((0, 3), (1, 3))
    choice = ExpertLRU().choose_victim(cands, memory, Shortage(device=1, num_blocks=1))
    assert isinstance(choice, RowEviction) and choice.request is cands[1]
    assert ExpertLRU().choose_victim(cands, memory, Shortage(device=0, num_blocks=1)).request is cands[0]
    assert memory.placement.expert_devices is None  # there is no device per expert to answer with
    assert memory.placement.of_sequences([5])[0].unique().tolist() == [1]  # but one for every row

    cached = PrefixCachingKVCacheManager(1, 2, 2, blocks_per_device=[8, 8], home_devices=True)
    scheduler = make_scheduler(SchedulerConfig(), cached, ModelShape(k_max=1, k_min=1, max_num_positions=64))
    cached.add_sequence(3)  # home 1: the producer
    rows = cached.rows([3, 3], 0, [0, 1])
    allocation = cached.allocate_slots(rows, torch.tensor([2, 2]))
    cached.prefix_cache.record_positions(allocation.slot_mapping, torch.tensor([0, 2, 1, 3]))
    cached.prefix_cache.cache_computed_blocks(3, [7, 7, 7, 7])
    cached.free(3)
    hit = cached.prefix_cache.hit_for([7, 7, 7, 7, 8], seq_id=5)  # home 1 as well
    assert hit is not None and hit.num_tokens == 4
    need = scheduler.hit_step_blocks(hit, 1)
    assert need[0] == 0 and need[1] > 0, need
    assert cached.prefix_cache.hit_for([7, 7, 7, 7, 8], seq_id=4) is None  # home 0: nothing cached
