"""The simulator's fast paths make exactly the decisions of the plain ones.

    the scheduler      FastScheduler (sim/fast_scheduler.py), the trace runner's: every decision
                       of the engine's plain Scheduler, over whole runs; its parts below
    decode need        FastScheduler._decode_need: a decode step's worst case read from the manager's
                       open_rows and count_blocks (two small tables per sequence slot), or from
                       open_per_device where k_max caps no device, instead of every row; plain: the
                       bounds of demand.py over the rows (Scheduler.worst_case_need)
    per-slot tables    CountingKVCacheManager.set_row_tokens keeps open_rows and count_blocks
                       following row_tokens, updating them over the rows that reach a block
                       boundary only (_crossing); plain: recounted from the rows
    freeing a sequence BlockPool.free(distinct=True): a sequence's blocks, distinct, skip the sorts
                       that find repeated ids; plain: free() of any order
    a fresh request    FastScheduler._fresh_needs: the worst case of a request with nothing computed,
                       held or swapped, read once per token count; plain: read each time
    one pool, all at   FastScheduler.worst_case_need with D = 1 and schedule_running:
    once               tests/spec/test_scheduler.py, which runs every behaviour test on both classes
    pool, per device   BlockPool.allocate_per_device: every device's blocks in one gather; plain:
                       allocate(n, device=d) device after device
    decode appends     TraceRunner.append: decode items' rows straight from the trace; plain:
                       RoutingTrace.appends (counting rows with bincount)
    ceil_div           a shift for powers of two; plain: the floor division
    emptying a slot    CountingKVCacheManager.free: a freed sequence's row counts and slot tables
                       zeroed at once (set_row_tokens on its slice of rows); plain: counted row by row
    a sequence's       KVCacheManager.blocks_of_sequence: each row's used table entries gathered
    blocks             (ragged_arange); plain: the table's first columns, masked
    stable_order       numpy's radix sort for keys below 2**16 (the devices of a step's new
                       blocks); plain: torch.argsort(stable=True)
    counted blocks     the runner's CountingKVCacheManager (sim/counting.py) where nothing reads an
                       id: blocks counted per row and device, no block tables, a CountingBlockPool
                       that lends by number; plain: every block listed by id in a KVCacheManager
                       (RunnerSetup.list_block_ids)
    blocks held        CountingKVCacheManager.blocks_held_per_device read from count_blocks; plain:
                       the devices of the sequence's listed blocks, counted
    fit alone          TraceRunner asks whether a request fits alone once per length; plain: once
                       per request

Each test runs both on fresh random inputs and compares; where the fast path could be silently
bypassed, a second part breaks it and checks that the comparison fails.
"""

import pytest
import torch

import moekv_ref.cache.rows as rows_module
import moekv_ref.sim.runner as runner_module
from moekv_ref.cache.block_pool import BlockPool, OutOfBlocksError
from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.cache.rows import ceil_div, ragged_arange, stable_order
from moekv_ref.costs import CostModel
from moekv_ref.engine.memory import ModelShape
from moekv_ref.engine.row_evicting_scheduler import RowEvictingScheduler
from moekv_ref.engine.scheduler import Scheduler
from moekv_ref.engine.scheduler_config import SchedulerConfig
from moekv_ref.sim.counting import CountingBlockPool, CountingKVCacheManager
from moekv_ref.sim.fast_scheduler import FastScheduler
from moekv_ref.sim.runner import RunnerSetup, TraceRunner
from moekv_ref.sim.traces import synthetic_trace, topic_trace

FREE = CostModel("free", 0.0, 0.0, 0.0, float("inf"), 0.0, 0.0, 1)


def random_runner(
    seed: int,
    policy: str = "sequence_lru",
    blocks: int = 80,
    num_devices: int = 2,
    reservation: str = "worst_case",
    list_block_ids: bool = False,
) -> TraceRunner:
    """A small run on two devices (4 experts each, top-2: k_max caps each device's open rows) or on
    four (2 experts each: it caps none) and a skewed trace, with blocks tight enough to evict (16
    to 25 evictions on these seeds, on two devices)."""
    trace, _ = topic_trace(40, 3, 8, 2, mean_prompt=8, mean_output=24, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    placement = torch.stack(
        [torch.randperm(8, generator=generator) % num_devices for _ in range(3)]
    )  # (L, E)
    setup = RunnerSetup(
        blocks_per_device=blocks,
        block_size=4,
        max_num_seqs=12,
        max_num_batched_tokens=64,
        reservation=reservation,
        list_block_ids=list_block_ids,
    )
    return TraceRunner(trace, placement, setup, policy, FREE)


def decisions(runner: TraceRunner):
    stats = runner.run()
    return stats.events, [(e.step, e.request_id, e.mode, e.freed) for e in stats.evictions], stats.used_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["sequence_lru", "pressure_aware", "expert_lru"])
@pytest.mark.parametrize("reservation", ["worst_case", "optimistic"])
@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_the_fast_scheduler_makes_the_plain_schedulers_decisions(
    seed, policy, reservation, num_devices, monkeypatch
):
    """The trace runner's FastScheduler against the engine's Scheduler on the same runs: the same
    events, victims, blocks in use per device at every step and retries."""
    blocks = 160 // num_devices
    fast_runner = random_runner(seed, policy, blocks, num_devices, reservation)
    # the runner builds FastScheduler (under expert_lru with RowEvictingScheduler before it)
    fast_class = type(fast_runner.scheduler)
    assert fast_class is FastScheduler or fast_class.__mro__[1:3] == (RowEvictingScheduler, FastScheduler)
    fast_stats = fast_runner.run()
    monkeypatch.setattr(runner_module, "FastScheduler", Scheduler)  # the runner builds the plain one
    plain_runner = random_runner(seed, policy, blocks, num_devices, reservation)
    plain_class = type(plain_runner.scheduler)
    assert plain_class is (RowEvictingScheduler if policy == "expert_lru" else Scheduler)
    plain_stats = plain_runner.run()
    assert fast_stats.evictions, "no eviction happened: the comparison would not test victims"
    assert fast_stats.events == plain_stats.events
    fast = [(e.step, e.request_id, e.mode, e.freed) for e in fast_stats.evictions]
    assert fast == [(e.step, e.request_id, e.mode, e.freed) for e in plain_stats.evictions]
    assert torch.equal(fast_stats.used_blocks, plain_stats.used_blocks)
    assert fast_stats.num_retries == plain_stats.num_retries


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["sequence_lru", "pressure_aware", "expert_lru"])
@pytest.mark.parametrize("num_devices", [2, 4])
def test_decode_need_makes_the_decisions_of_the_row_by_row_bound(seed, policy, num_devices, monkeypatch):
    fast = decisions(random_runner(seed, policy, blocks=160 // num_devices, num_devices=num_devices))
    assert fast[1], "no eviction happened: the comparison would not test victims"
    assert random_runner(seed, num_devices=num_devices).scheduler._caps_bind == (num_devices == 2)
    monkeypatch.setattr(FastScheduler, "_decode_need", lambda self, requests, num_tokens: None)
    plain = decisions(random_runner(seed, policy, blocks=160 // num_devices, num_devices=num_devices))
    assert fast[0] == plain[0]  # admitted / resumed / preempted, each step
    assert fast[1] == plain[1]  # victims, modes, blocks freed per device
    assert torch.equal(fast[2], plain[2])  # blocks in use per device after each step


@pytest.mark.parametrize("num_devices", [2, 4])
def test_a_broken_decode_need_changes_the_decisions(num_devices, monkeypatch):
    """The comparison above fails when the fast path is wrong by one block (so it is the one that
    runs), on both of its branches: it reserves one block more per device than the bound says."""
    blocks = 160 // num_devices
    plain = decisions(random_runner(0, blocks=blocks, num_devices=num_devices))
    real = FastScheduler._decode_need

    def one_more(self, requests, num_tokens):
        need = real(self, requests, num_tokens)
        return None if need is None else need + 1

    monkeypatch.setattr(FastScheduler, "_decode_need", one_more)
    broken = decisions(random_runner(0, blocks=blocks, num_devices=num_devices))
    assert broken[0] != plain[0] or broken[1] != plain[1] or not torch.equal(broken[2], plain[2])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_devices", [2, 4])
def test_decode_need_equals_the_bound_over_rows_on_random_states(seed, num_devices):
    """Random placements and row counts (a decode step of every held sequence): the (m, D) needs of
    the two paths are equal (the plain one with its lifetime cap, which a decode token never reaches).
    On 2 devices 4 experts a device, k_d = 3: the min of bounds A and B matters; on 4, 2 experts a
    device: k_max caps none, and the open rows summed over the layers answer."""
    generator = torch.Generator().manual_seed(seed)
    L, E, D, K, P = 3, 8, num_devices, 3, 4
    placement = torch.stack([torch.randperm(E, generator=generator) % D for _ in range(L)])
    trace = synthetic_trace(16, L, E, K, mean_prompt=12, mean_output=8, seed=seed)
    runner = TraceRunner(
        trace,
        placement,
        RunnerSetup(blocks_per_device=4000, block_size=P, max_num_seqs=16),
        "newest_first",
        FREE,
    )
    scheduler = runner.scheduler
    for _ in range(int(torch.randint(1, 12, (1,), generator=generator))):  # a few random steps
        out = scheduler.schedule(0)
        runner.append(out)
        scheduler.update_from_output(out, {item.request.request_id: 0 for item in out.scheduled})
    requests = list(scheduler.running)
    assert requests and all(r.num_pending_tokens == 1 for r in requests)
    fast = scheduler._decode_need(requests, [1] * len(requests))
    assert scheduler._caps_bind == (num_devices == 2)
    plain = Scheduler.worst_case_step_blocks(scheduler, requests, [1] * len(requests))  # over every row
    assert fast is not None and torch.equal(fast, plain)


def three_filled_sequences(
    num_layers: int, blocks: int, placement: list[int], most: int, seed: int, manager_class=KVCacheManager
):
    """A manager of 4 experts on two devices of `blocks` blocks (block size 4) holding sequences 0,
    1 and 2, each of their rows given 0 to most - 1 random tokens."""
    generator = torch.Generator().manual_seed(seed)
    manager = manager_class(num_layers, 4, 4, blocks_per_device=[blocks, blocks], device_of_expert=placement)
    for seq in range(3):
        manager.add_sequence(seq)
    rows = torch.arange(manager.rows_per_seq * 3)
    manager.grow_rows(rows, torch.randint(0, most, (rows.numel(),), generator=generator))
    return manager


def test_manager_tables_follow_row_tokens_and_a_missed_update_is_caught():
    manager = three_filled_sequences(
        2, 50, [0, 1, 0, 1], most=9, seed=0, manager_class=CountingKVCacheManager
    )
    manager.free(1)
    manager.assert_consistent()
    for table in (manager.open_rows, manager.open_per_device, manager.count_blocks):  # a missed update
        table[manager.seq_index(2)].view(-1)[0] += 1
        with pytest.raises(AssertionError, match="does not follow row_tokens"):
            manager.assert_consistent()
        table[manager.seq_index(2)].view(-1)[0] -= 1


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tables_updated_over_the_crossing_rows_equal_a_recount(block_size, monkeypatch):
    """Random appends (one token each and several), frees of sequences and of single rows: after
    each, open_rows and count_blocks equal their recount from row_tokens (assert_consistent), by
    each of the counting manager's appends (grow_rows, grow_trace_rows, grow_decode_rows). An update
    that misses one crossing row breaks the same run."""

    def run() -> None:
        generator = torch.Generator().manual_seed(block_size)
        manager = CountingKVCacheManager(
            3, 4, block_size, blocks_per_device=[400, 400], device_of_expert=[0, 1, 1, 0]
        )
        for seq in range(4):
            manager.add_sequence(seq)
        for step in range(40):
            slot = manager.seq_index(step % 4)
            rows = torch.arange(slot * manager.rows_per_seq, (slot + 1) * manager.rows_per_seq)
            rows = rows[torch.randperm(rows.numel(), generator=generator)[: 1 + step % rows.numel()]]
            if step % 3 == 0:
                manager.grow_decode_rows(rows)  # one token each
            elif step % 3 == 1:
                counts = torch.randint(0, 2 * block_size + 2, (rows.numel(),), generator=generator)
                manager.grow_trace_rows(rows, counts)
            else:
                counts = torch.randint(0, 2 * block_size + 2, (rows.numel(),), generator=generator)
                manager.grow_rows(rows, counts)
            if step % 11 == 10:
                manager.free_rows(rows[:2])
            if step % 13 == 12:
                manager.free(step % 4)
                manager.add_sequence(step % 4)
            manager.assert_consistent()

    run()
    count = CountingKVCacheManager._count  # the slot tables' update misses one crossing row
    monkeypatch.setattr(
        CountingKVCacheManager,
        "_count",
        lambda self, rows, old, new, device: count(self, rows[1:], old[1:], new[1:], device[1:]),
    )
    with pytest.raises(AssertionError):  # the tables, or the blocks of the row it missed
        run()


def test_freeing_distinct_blocks_equals_the_general_free_and_a_sequence_frees_that_way(monkeypatch):
    sizes = [6, 6, 6]
    generator = torch.Generator().manual_seed(2)
    fast = BlockPool(blocks_per_device=sizes, shuffle_seed=5)
    plain = BlockPool(blocks_per_device=sizes, shuffle_seed=5)
    for _ in range(20):
        counts = torch.randint(0, 3, (3,), generator=generator)
        taken = fast.allocate_per_device(counts)
        assert torch.equal(taken, plain.allocate_per_device(counts))
        if taken.numel():
            fast.incref(taken[:1])  # a shared block: freed once, it stays in use
            plain.incref(taken[:1])
            order = taken[torch.randperm(taken.numel(), generator=generator)]
            fast.free(order, distinct=True)
            plain.free(order)
        assert torch.equal(fast.free_block_ids(), plain.free_block_ids())  # the same stacks, in order
        assert torch.equal(fast.ref_cnt, plain.ref_cnt)
        if taken.numel():  # its last owner lets the shared block go
            fast.free(taken[:1], distinct=True)
            plain.free(taken[:1])
    fast.assert_consistent()
    calls = []
    manager = KVCacheManager(2, 2, 4, blocks_per_device=[20, 20], device_of_expert=[0, 1])
    manager.add_sequence(0)
    manager.allocate_slots(torch.arange(4), torch.tensor([5, 0, 9, 3]))
    pool_free = BlockPool.free

    def spy(self, ids, distinct=False):
        calls.append(distinct)
        return pool_free(self, ids, distinct)

    monkeypatch.setattr(BlockPool, "free", spy)
    manager.free(0)
    assert calls == [True]  # a sequence's blocks are distinct
    manager.assert_consistent()


def test_a_blocks_device_by_division_on_equal_devices_equals_the_search():
    ids = torch.arange(30)
    equal = BlockPool(blocks_per_device=[10, 10, 10])
    unequal = BlockPool(blocks_per_device=[10, 10, 9, 1])
    assert torch.equal(equal.device_of_blocks(ids), ids // 10)
    assert unequal.device_of_blocks(ids).tolist() == [0] * 10 + [1] * 10 + [2] * 9 + [3]


def test_allocate_per_device_equals_allocate_device_after_device():
    sizes = [7, 1, 12, 5]
    fast, plain = (
        BlockPool(blocks_per_device=sizes, shuffle_seed=3),
        BlockPool(blocks_per_device=sizes, shuffle_seed=3),
    )
    for counts in ([2, 0, 5, 1], [0, 0, 4, 4], [5, 0, 3, 0]):
        got = fast.allocate_per_device(torch.tensor(counts))
        expected = torch.cat([plain.allocate(n, device=d) for d, n in enumerate(counts) if n])
        assert torch.equal(got, expected)
        assert fast.num_free_blocks_per_device.tolist() == plain.num_free_blocks_per_device.tolist()
        fast.free(got[::2])
        plain.free(expected[::2])
    fast.assert_consistent()
    before = fast.num_free_blocks_per_device.tolist()
    with pytest.raises(OutOfBlocksError, match="device 0 is short"):
        fast.allocate_per_device(torch.tensor([100, 0, 0, 0]))
    assert fast.num_free_blocks_per_device.tolist() == before  # nothing taken


def test_decode_appends_are_the_counted_appends_of_one_token_each():
    trace = synthetic_trace(6, 3, 8, 2, mean_prompt=10, mean_output=10, seed=4)
    seqs, starts = torch.tensor([0, 3, 5]), torch.tensor([2, 0, 7])
    slots = torch.tensor([4, 1, 2])
    rows, per_layer = trace.decode_appends(seqs, starts, row_seqs=slots)
    counted, hits, counted_per_layer = trace.appends(seqs, starts, torch.ones_like(seqs), row_seqs=slots)
    assert torch.equal(rows.sort().values, counted) and (hits == 1).all()
    assert torch.equal(per_layer, counted_per_layer)


def test_ceil_div_by_shift_equals_the_floor_division():
    values = torch.randint(-1000, 1000, (5000,), generator=torch.Generator().manual_seed(1))
    for block_size in (1, 2, 16, 256):
        assert torch.equal(ceil_div(values, block_size), (values + block_size - 1) // block_size)
    assert torch.equal(ceil_div(values, 3), (values + 2) // 3)  # not a power of two


def test_ragged_arange_numbers_each_owners_entries():
    counts = torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(3))
    owner, index = ragged_arange(counts)
    expected = [(i, k) for i, n in enumerate(counts.tolist()) for k in range(n)]
    assert list(zip(owner.tolist(), index.tolist())) == expected
    assert ragged_arange(torch.zeros(0, dtype=torch.int64))[0].numel() == 0


def test_stable_order_is_the_stable_argsort_and_takes_numpys_radix_sort(monkeypatch):
    """Many ties (64 devices over 3,000 keys), so an unstable sort would differ; keys past 2**16 go
    to torch's sort, as do a few keys. A numpy argsort that reverses its answer breaks the many
    small keys only."""
    generator = torch.Generator().manual_seed(4)
    small = torch.randint(0, 64, (3000,), generator=generator)
    large = torch.randint(0, 2**20, (3000,), generator=generator) % 7 * 2**17
    for keys in (small, large, small[:1], small[:0]):
        assert torch.equal(stable_order(keys), torch.argsort(keys, stable=True))
    real = rows_module.np.argsort
    monkeypatch.setattr(rows_module.np, "argsort", lambda a, kind: real(a, kind=kind)[::-1].copy())
    assert not torch.equal(stable_order(small), torch.argsort(small, stable=True))
    assert torch.equal(stable_order(large), torch.argsort(large, stable=True))
    assert torch.equal(stable_order(small[:100]), torch.argsort(small[:100], stable=True))  # torch's


def test_a_sequences_blocks_gathered_row_by_row_equal_the_masked_table():
    manager = three_filled_sequences(3, 300, [0, 1, 1, 0], most=30, seed=5)
    for seq in range(3):
        start = manager.seq_index(seq) * manager.rows_per_seq
        own = torch.arange(manager.rows_per_seq) + start
        masked = manager.block_tables[own][manager.used_columns(own)].to(torch.int64)
        got = manager.blocks_of_sequence(seq)
        assert torch.equal(got, masked)
        assert got.numel() == manager.num_blocks_of_sequence(seq)


def test_a_freed_slot_restarts_empty_and_one_left_counting_is_caught(monkeypatch):
    """free empties the sequence's slot at once; the next sequence in that slot starts from zero
    counts (assert_consistent recounts them), and a free that left the slot's block count behind
    would be caught there."""

    def run():
        manager = CountingKVCacheManager(2, 4, 4, blocks_per_device=[80, 80], device_of_expert=[0, 1, 0, 1])
        manager.add_sequence(0)
        slot = manager.seq_index(0)
        manager.grow_rows(torch.arange(8), torch.arange(8))
        manager.free(0)
        rows = slice(slot * manager.rows_per_seq, (slot + 1) * manager.rows_per_seq)
        assert manager.row_tokens[rows].eq(0).all()
        assert manager.add_sequence(1) == slot  # the same slot, reused
        manager.grow_rows(torch.arange(8) + slot * manager.rows_per_seq, torch.ones(8, dtype=torch.int64))
        manager.assert_consistent()

    run()
    real = CountingKVCacheManager.set_row_tokens

    def leaves_blocks(self, rows, counts):
        real(self, rows, counts)
        if isinstance(rows, slice):
            self.count_blocks[rows.start // self.rows_per_seq] += 1

    monkeypatch.setattr(CountingKVCacheManager, "set_row_tokens", leaves_blocks)
    with pytest.raises(AssertionError, match="count_blocks does not follow"):
        run()


def test_the_runner_fails_at_the_first_short_layer_with_that_layers_shortfall():
    """As the engine's forward, layer after layer: 4 blocks a layer, 5 free -> layer 1 is short by
    3 (not the whole step's 7)."""
    trace = synthetic_trace(1, 3, 2, 2, mean_prompt=4, mean_output=4, seed=0)
    setup = RunnerSetup(blocks_per_device=5, block_size=1, max_num_seqs=1, reservation="optimistic")
    runner = TraceRunner(trace, [0, 0], setup, "sequence_lru", FREE)
    runner.manager.add_sequence(0)
    layer, shortfall = runner._first_short_layer(torch.arange(6), torch.full((6,), 2))
    assert (layer, shortfall.tolist()) == (1, [3])


def test_a_fresh_requests_need_read_once_per_token_count_makes_the_decisions_of_reading_it_each_time(
    monkeypatch,
):
    """FastScheduler._fresh_needs (worst-case reservation; an optimistic one reserves a chunk's predicted
    blocks instead): the same decisions as reading every fresh request's need again, and different
    ones when a remembered need is four blocks a device too large."""

    def runner():
        trace, _ = topic_trace(40, 3, 8, 2, mean_prompt=8, mean_output=24, seed=2)
        setup = RunnerSetup(blocks_per_device=40, block_size=4, max_num_seqs=12, max_num_batched_tokens=64)
        return TraceRunner(trace, torch.arange(8) % 2, setup, "sequence_lru", FREE)

    remembering = runner()
    fast = decisions(remembering)
    assert remembering.scheduler._fresh_needs, "no fresh request's need was remembered"
    monkeypatch.setattr(FastScheduler, "_is_fresh", lambda self, request: False)
    plain = decisions(runner())
    assert fast[0] == plain[0] and fast[1] == plain[1] and torch.equal(fast[2], plain[2])
    monkeypatch.undo()
    real = FastScheduler.worst_case_step_blocks

    def stale(self, requests, num_tokens):
        remembered = len(requests) == 1 and num_tokens[0] in self._fresh_needs and self._is_fresh(requests[0])
        need = real(self, requests, num_tokens)
        return need + 4 if remembered else need

    monkeypatch.setattr(FastScheduler, "worst_case_step_blocks", stale)
    broken = decisions(runner())
    assert broken[0] != plain[0] or broken[1] != plain[1] or not torch.equal(broken[2], plain[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", ["sequence_lru", "pressure_aware", "expert_lru"])
@pytest.mark.parametrize("reservation", ["worst_case", "optimistic"])
@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_counting_blocks_makes_the_decisions_of_listing_them(seed, policy, reservation, num_devices):
    """The same events, victims (expert_lru evicts single rows: free_rows), retries and blocks in
    use per device at every step; the counting manager's pool lends, at every step, exactly the
    blocks its rows count (assert_consistent)."""
    blocks = 160 // num_devices
    counting = random_runner(seed, policy, blocks, num_devices, reservation)
    listing = random_runner(seed, policy, blocks, num_devices, reservation, list_block_ids=True)
    assert type(counting.manager) is CountingKVCacheManager and type(listing.manager) is KVCacheManager
    fast_stats = counting.run(on_step=lambda num_finished: counting.manager.assert_consistent())
    plain_stats = listing.run()
    fast = (fast_stats.events, [(e.step, e.request_id, e.mode, e.freed) for e in fast_stats.evictions])
    plain = (plain_stats.events, [(e.step, e.request_id, e.mode, e.freed) for e in plain_stats.evictions])
    assert fast_stats.evictions, "no eviction happened: the comparison would not test victims"
    assert fast == plain
    assert torch.equal(fast_stats.used_blocks, plain_stats.used_blocks)
    assert fast_stats.num_retries == plain_stats.num_retries
    assert counting.manager.block_tables.shape[1] == 0  # nothing was listed
    assert counting.manager.pool.ref_cnt.numel() == 0


@pytest.mark.parametrize(
    "broken", ["free", "free_per_device", "allocate_per_device", "take_blocks", "return_row_blocks"]
)
def test_a_miscounted_block_changes_the_decisions_or_is_caught(broken, monkeypatch):
    """Counting one block too few when a sequence is freed, when blocks come back or when they are
    lent, one too many lent for an append, or one too few back from evicted rows (expert_lru, which
    evicts single rows): the run's decisions or its consistency check differ from listing the
    blocks."""
    policy = "expert_lru" if broken == "return_row_blocks" else "sequence_lru"
    plain = decisions(random_runner(0, policy, list_block_ids=True))
    pool_free = CountingBlockPool.free_per_device
    pool_allocate = CountingBlockPool.allocate_per_device
    manager_free = CountingKVCacheManager.free
    take_blocks = CountingKVCacheManager._take_blocks
    return_row_blocks = CountingKVCacheManager._return_row_blocks

    def one_fewer(counts: torch.Tensor) -> torch.Tensor:
        return counts - (torch.arange(counts.numel()) == int(counts.argmax())).to(counts.dtype)

    if broken == "free_per_device":
        monkeypatch.setattr(
            CountingBlockPool, "free_per_device", lambda self, n: pool_free(self, one_fewer(n))
        )
    elif broken == "allocate_per_device":
        monkeypatch.setattr(
            CountingBlockPool, "allocate_per_device", lambda self, n: pool_allocate(self, one_fewer(n))
        )
    elif broken == "take_blocks":  # the first row taking blocks takes one more

        def one_more(self, device, needed):
            return take_blocks(self, device, needed + (torch.arange(needed.numel()) == 0))

        monkeypatch.setattr(CountingKVCacheManager, "_take_blocks", one_more)
    elif broken == "return_row_blocks":  # evicted rows give one block fewer back than they held

        def one_kept(self, rows):
            per_device = torch.zeros(self.num_devices, dtype=torch.int64)
            per_device[int(self.row_device[rows[0]])] = 1
            self.pool.allocate_per_device(per_device)  # taken again right after the return
            return return_row_blocks(self, rows) - 1

        monkeypatch.setattr(CountingKVCacheManager, "_return_row_blocks", one_kept)
    else:  # a sequence's blocks are back, its slot is not cleared: a later sequence counts on

        def keep_counts(self, seq_id):
            index = self.seq_index(seq_id)
            kept = self.count_blocks[index].clone()
            manager_free(self, seq_id)
            self.count_blocks[index] = kept

        monkeypatch.setattr(CountingKVCacheManager, "free", keep_counts)
    runner = random_runner(0, policy)
    try:
        broken_run = decisions(runner)
    except (AssertionError, RuntimeError, ValueError):
        return  # refused or caught on the way
    assert (
        broken_run[0] != plain[0] or broken_run[1] != plain[1] or not torch.equal(broken_run[2], plain[2])
    ), f"a miscounted {broken} changed nothing"


def test_a_counting_manager_refuses_what_needs_a_block_id_and_changes_nothing():
    manager = CountingKVCacheManager(2, 2, 4, blocks_per_device=[20, 20], device_of_expert=[0, 1])
    manager.add_sequence(0)
    rows = torch.arange(4)
    manager.grow_rows(rows, torch.tensor([5, 0, 9, 3]))
    assert manager.num_free_blocks_per_device.tolist() == [20 - 2 - 3, 20 - 1]  # experts 0 / 1
    names = ("row_tokens", "last_appended", "open_rows", "count_blocks")
    before = [getattr(manager, name).clone() for name in names]
    with pytest.raises(ValueError, match="CountingKVCacheManager has no slots; allowed: grow_rows"):
        manager.allocate_slots(rows, torch.ones(4, dtype=torch.int64))
    for call in (
        lambda: manager.blocks_of_sequence(0),
        lambda: manager.rows_slots(rows),
        lambda: manager.place_blocks(rows[:1], torch.tensor([0]), torch.tensor([3])),
        lambda: manager.restore_sequence(
            1, torch.ones(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
        ),
    ):
        with pytest.raises(ValueError, match="counts blocks without listing them; allowed: a KVCacheManager"):
            call()
    assert manager.sequences == [0]
    assert all(torch.equal(getattr(manager, name), old) for name, old in zip(names, before))  # unchanged
    assert manager.num_free_blocks_per_device.tolist() == [15, 19]
    assert manager.blocks_held_per_device([0, 7]).tolist() == [[5, 1], [0, 0]]
    assert manager.free_rows(torch.tensor([2])) == 3  # row 2 (expert 0, layer 1): 9 tokens
    manager.free(0)
    assert manager.num_free_blocks_per_device.tolist() == [20, 20]
    manager.assert_consistent()
    for option in ("prefix_cache", "tails", "budget"):  # each is a manager class of its own
        with pytest.raises(ValueError, match=f"unknown keyword {option}=4 for CountingKVCacheManager"):
            CountingKVCacheManager(2, 2, 4, num_blocks=8, **{option: 4})


def test_a_counting_pool_lends_by_number_and_refuses_ids_and_double_frees():
    pool = CountingBlockPool(blocks_per_device=[5, 7])
    assert pool.allocate_per_device(torch.tensor([2, 7])) is None
    assert pool.num_free_blocks_per_device.tolist() == [3, 0]
    with pytest.raises(OutOfBlocksError, match="device 1 is short"):
        pool.allocate_per_device(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="device 0 gets 3 blocks back but has lent 2: a double free"):
        pool.free_per_device(torch.tensor([3, 0]))
    assert pool.num_free_blocks_per_device.tolist() == [3, 0]  # unchanged
    for call in (
        lambda: pool.allocate(1, device=0),
        lambda: pool.free(torch.tensor([0])),
        pool.free_block_ids,
    ):
        with pytest.raises(ValueError, match="counts its blocks without ids"):
            call()
    pool.free_per_device(torch.tensor([2, 7]))
    pool.assert_consistent()
    assert not hasattr(BlockPool, "free_per_device")  # the plain pool takes its blocks back by id


def test_the_runner_lists_block_ids_where_a_prefix_cache_or_swap_space_reads_them():
    trace = synthetic_trace(4, 2, 4, 2, mean_prompt=8, mean_output=8, seed=0)
    for setup, lists in (
        (RunnerSetup(blocks_per_device=64), False),
        (RunnerSetup(blocks_per_device=64, list_block_ids=True), True),
        (RunnerSetup(blocks_per_device=64, prefix_caching=True), True),
        (RunnerSetup(blocks_per_device=64, num_host_blocks=32), True),
    ):
        runner = TraceRunner(trace, torch.arange(4) % 2, setup, "sequence_lru", FREE)
        assert isinstance(runner.manager, CountingKVCacheManager) is not lists
    counting = CountingKVCacheManager(2, 4, 4, num_blocks=64)
    config = SchedulerConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="num_swap_blocks=32: a swap copies a sequence's blocks by id"):
        Scheduler(config, counting, ModelShape(2, 2, 64), 32)


def test_a_requests_fit_alone_checked_once_per_length_refuses_what_checking_each_refuses():
    """TraceRunner checks whether a request fits alone once per length (prompt + output - 1): the
    same requests are refused as when the scheduler checks each one. Prompts of 4 and 12 tokens,
    each with outputs that fit and outputs that do not, so that a check remembered by prompt length
    (or by anything but the whole length) refuses a different set."""
    prompts = torch.tensor([4, 12, 4, 12, 4, 12, 4])
    outputs = torch.tensor([2, 2, 40, 40, 2, 30, 60])
    trace = synthetic_trace(7, 2, 4, 2, seed=3, lengths=(prompts, outputs))
    setup = RunnerSetup(blocks_per_device=24, block_size=4, max_num_seqs=4)
    runner = TraceRunner(trace, torch.arange(4) % 2, setup, "sequence_lru", FREE)
    refused = 0
    for s in range(trace.num_sequences):
        length = int(trace.lengths[s])
        prompt = int(trace.prompt_lens[s])
        try:
            runner.scheduler.check_fits_alone(prompt, length - prompt + 1)
        except ValueError:
            refused += 1
    assert 0 < refused < trace.num_sequences  # some fit, some do not
    assert runner.num_refused == refused
    assert runner.run().num_finished == trace.num_sequences - refused


def test_blocks_held_per_device_read_from_count_blocks_equal_the_listed_blocks_devices():
    """CountingKVCacheManager.blocks_held_per_device reads count_blocks; plain: the devices of the
    sequence's listed blocks, counted. Random appends to three sequences on three devices."""
    generator = torch.Generator().manual_seed(7)
    placement = torch.randint(0, 3, (2, 6), generator=generator)  # (L, E)
    manager = KVCacheManager(2, 6, 4, blocks_per_device=[200, 200, 200], device_of_expert=placement)
    counting = CountingKVCacheManager(2, 6, 4, blocks_per_device=[200, 200, 200], device_of_expert=placement)
    for seq in (3, 5, 8):
        manager.add_sequence(seq)
        counting.add_sequence(seq)
    for _ in range(12):
        layer = int(torch.randint(0, 2, (1,), generator=generator))
        experts = torch.randint(0, 6, (3,), generator=generator)
        counts = torch.randint(0, 9, (3,), generator=generator)
        manager.grow_rows(manager.rows([3, 5, 8], layer, experts), counts)
        counting.grow_rows(counting.rows([3, 5, 8], layer, experts), counts)
    held = counting.blocks_held_per_device([3, 5, 8, 99])
    assert torch.equal(held, manager.blocks_held_per_device([3, 5, 8, 99]))
    for i, seq in enumerate((3, 5, 8)):
        devices = manager.pool.device_of_blocks(manager.blocks_of_sequence(seq))
        assert held[i].tolist() == torch.bincount(devices, minlength=3).tolist()
    assert held[3].tolist() == [0, 0, 0]  # not held
    assert bool((held[:3] > 0).all())  # every sequence holds blocks on every device
