"""Prefix caching over per-expert rows (cache/prefix_cache.py): exact block ids of a hit, a
copy-on-write and an LRU eviction; random programs keep reference counts and ownership exact; the
engine gives the same tokens with and without the cache, under both routings."""

import pytest
import torch
from helpers import alone_tokens, random_model, random_prompts, small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from moekv_ref.cache.block_pool import OutOfBlocksError
from moekv_ref.cache.caching_block_pool import CachingBlockPool
from moekv_ref.cache.prefix_cache import chain_keys
from moekv_ref.cache.prefix_caching_manager import PrefixCachingKVCacheManager
from moekv_ref.checkpoint import load_default_model
from moekv_ref.engine import LLMEngine, SchedulerConfig
from moekv_ref.engine.undo import Snapshot
from moekv_ref.engine.workload import few_shot_workload, run_workload
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams


def append_tokens(manager, seq_id, start, routing):
    """Append tokens at positions start, start + 1, ... of one sequence, token t going to the experts
    routing[t][layer] (a list per layer), as the paged cache's append_kv does: one allocation per
    layer, rows in ascending order (its general case; decode keeps pair order), then the tokens'
    positions recorded. Returns the slots per layer."""
    if not manager.holds(seq_id):
        manager.add_sequence(seq_id)
    for layer in range(manager.num_layers):
        pairs = [(e, start + t) for t, experts in enumerate(routing) for e in experts[layer]]
        experts = torch.tensor([e for e, _ in pairs], dtype=torch.int64)
        positions = torch.tensor([p for _, p in pairs], dtype=torch.int64)
        pair_rows = manager.rows(torch.full_like(experts, seq_id), layer, experts)
        order = torch.argsort(pair_rows, stable=True)
        rows, num_new = torch.unique_consecutive(pair_rows[order], return_counts=True)
        allocation = manager.allocate_slots(rows, num_new)
        slots = torch.empty_like(order)
        slots[order] = allocation.slot_mapping
        first = torch.cumsum(num_new, 0) - num_new
        manager.note_positions(rows, positions[order][first + num_new - 1])
        manager.prefix_cache.record_positions(slots, positions)


def table(manager, seq_id, row):
    """Block ids of one row (layer * E + expert) of a sequence."""
    r = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0][row]
    n = -(-int(manager.row_tokens[r]) // manager.block_size)
    return manager.block_tables[r, :n].tolist()


def test_chain_keys_are_a_chain_of_the_whole_prefix():
    keys = chain_keys([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2 and len(keys[0]) == 16  # the incomplete chunk has no key
    assert chain_keys([1, 2, 3, 4], 2, b"") == keys
    assert chain_keys([3, 4], 2, keys[0]) == keys[1:]
    assert chain_keys([9, 2, 3, 4], 2)[1] != keys[1]  # an earlier token changes later keys


def test_hit_copy_on_write_and_lru_eviction_exact_blocks():
    # one layer, two experts, blocks of 2 slots (chunks of 2 tokens), 8 blocks handed out 0, 1, 2, ...
    manager = PrefixCachingKVCacheManager(1, 2, 2, 8)
    producer = [10, 11, 12, 13, 14, 15, 16, 17]
    route = [[[0]], [[0]], [[1]], [[0]], [[1]], [[1]], [[0]], [[1]]]  # token t -> expert, top-1
    append_tokens(manager, 0, 0, route)
    # expert 0 holds positions 0 1 | 3 6 in blocks 0, 1; expert 1 holds 2 4 | 5 7 in blocks 2, 3
    assert table(manager, 0, 0) == [0, 1] and table(manager, 0, 1) == [2, 3]
    assert manager.prefix_cache.cache_computed_blocks(0, producer) == 4
    manager.free(0)
    # all four blocks are cached-free, least recently used first in the order freed
    assert manager.pool.cached_free_block_ids() == [0, 1, 2, 3] and manager.pool.num_free_blocks == 8
    manager.assert_consistent()

    # a request with the same first 4 tokens (two chunks): entries below s = 4 are expert 0's positions
    # 0 1 3 (block 0 whole, the first slot of block 1) and expert 1's position 2 (first slot of block 2)
    hit = manager.prefix_cache.find_cached_prefix([10, 11, 12, 13, 99, 98, 97])
    assert hit.num_tokens == 4 and hit.row_counts.tolist() == [3, 1]
    assert hit.shared.tolist() == [0] and hit.cow_source.tolist() == [1, 2]
    # while it is applied: block 0 leaves the LRU, sources 1 and 2 are pinned, two fresh copies
    assert hit.num_free_taken == 5
    source, destination = manager.prefix_cache.apply_prefix_hit(1, hit)
    # the copies get the next blocks of the stack, 4 and 5; blocks 1 and 2 stay cached-free
    assert source.tolist() == [1, 2] and destination.tolist() == [4, 5]
    assert table(manager, 1, 0) == [0, 4] and table(manager, 1, 1) == [5]
    assert manager.last_position[
        manager.index.sequence_rows(torch.tensor([manager.seq_index(1)]))[0]
    ].tolist() == [3, 2]
    assert manager.pool.ref_cnt[0] == 1 and manager.pool.cached_free_block_ids() == [3, 1, 2]
    manager.assert_consistent()

    # the pool runs out of plain blocks: 6, 7 from the stack, then block 3 (least recently used)
    # is evicted and forgets its keys; blocks 1 and 2 stay findable
    assert manager.pool.allocate(3).tolist() == [6, 7, 3]
    assert 3 not in manager.prefix_cache._keys_of_block and 1 in manager.prefix_cache._keys_of_block
    assert manager.pool.num_evicted_cached_blocks == 1
    manager.pool.free(torch.tensor([6, 7, 3]))
    # a request sharing only the first chunk reuses block 0, now owned twice
    hit = manager.prefix_cache.find_cached_prefix([10, 11, 50, 51])
    assert hit.num_tokens == 2 and hit.shared.tolist() == [0] and hit.num_free_taken == 0
    manager.prefix_cache.apply_prefix_hit(2, hit)
    assert manager.pool.ref_cnt[0] == 2
    manager.assert_consistent()
    manager.free(1)
    manager.free(2)
    manager.assert_consistent()
    assert manager.pool.num_free_blocks == 8


def test_partial_tail_is_copied_never_shared():
    # the producer is still running: expert 0's second block (1) holds only position 3, a partial
    # tail it will append to. A request needing that entry gets a copy of block 1, not block 1.
    manager = PrefixCachingKVCacheManager(1, 2, 2, 8)
    append_tokens(manager, 0, 0, [[[0]], [[0]], [[1]], [[0]], [[1]], [[1]]])
    manager.prefix_cache.cache_computed_blocks(0, [10, 11, 12, 13, 14, 15])
    hit = manager.prefix_cache.find_cached_prefix([10, 11, 12, 13, 14, 99, 98])
    assert hit.num_tokens == 4 and hit.shared.tolist() == [0] and hit.cow_source.tolist() == [1, 2]
    source, destination = manager.prefix_cache.apply_prefix_hit(1, hit)
    assert destination.tolist() == [4, 5]  # blocks 0-3 are the producer's
    assert manager.pool.ref_cnt[[0, 1, 2]].tolist() == [2, 1, 1]
    # the producer appends position 6 to expert 0: it lands in its own block 1, after position 3
    append_tokens(manager, 0, 6, [[[0]]])
    assert table(manager, 0, 0) == [0, 1] and manager.prefix_cache.block_positions[1].tolist() == [3, 6]
    assert table(manager, 1, 0) == [0, 4] and manager.row_tokens[
        manager.index.sequence_rows(torch.tensor([manager.seq_index(1)]))[0]
    ].tolist() == [3, 1]
    manager.assert_consistent()
    # the last token always runs: a request equal to the producer's first 4 tokens gets s = 2 at most
    assert manager.prefix_cache.find_cached_prefix([10, 11, 12, 13]).num_tokens == 2


def test_reuse_and_mark_cached_refuse_bad_blocks():
    pool = CachingBlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.reuse(blocks)
    pool.mark_cached(blocks[:1])
    pool.free(blocks)
    with pytest.raises(ValueError, match="mark_cached of a free block"):
        pool.mark_cached(blocks[1:])
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 1
    pool.assert_consistent()
    with pytest.raises(OutOfBlocksError):
        pool.allocate(5)
    pool.assert_consistent()


# ----- random programs -------------------------------------------------------------------------------
L, E, P = 2, 3, 2
BASES = ([1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1, 3], [1, 2, 3, 0, 3, 3, 0, 1, 2, 0, 0, 1])  # share 4 tokens
# a request: the first n tokens of a base (prefixes repeat, so hits happen), then its own tokens
request = (
    st.tuples(st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(0, 3), max_size=4))
    .map(lambda x: BASES[x[0]][: x[1]] + x[2])
    .filter(bool)
)
run = st.tuples(st.just("run"), st.integers(0, 5), st.integers(1, 12))  # compute more tokens
program = st.lists(
    st.one_of(
        st.tuples(st.just("start"), request),  # a request, maybe a hit
        run,
        run,
        run,  # runs weigh three times: producers must fill blocks
        st.tuples(st.just("free"), st.integers(0, 5)),  # finish or preempt
        st.tuples(st.just("evict"), st.integers(1, 4)),  # the pool needs every plain block and k more
    ),
    min_size=1,
    max_size=40,
)


def routing_of(tokens, position):
    """A causal routing, deterministic in the prefix: layer l sends token t to 1 or 2 experts from a
    hash of tokens 0..t (threshold-like: the count varies)."""
    h = sum((i + 1) * (x + 1) * 7919 for i, x in enumerate(tokens[: position + 1]))
    return [
        sorted({(h + layer) % E, (h // 3 + 2 * layer) % E} if (h + layer) % 2 else {(h + layer) % E})
        for layer in range(L)
    ]


@settings(max_examples=60, deadline=None)
@given(program)
def test_random_programs_keep_ref_counts_exact_and_leak_nothing(ops):
    run_program(ops)


def test_seeded_programs_hit_copy_and_evict():
    """The same checks over seeded programs built to exercise every path: hypothesis's random programs
    may or may not reach a hit, a copy-on-write and an eviction; these must reach all three."""
    import random

    rng = random.Random(0)
    totals = torch.zeros(3, dtype=torch.int64)
    for _ in range(12):
        ops = []
        for _ in range(30):
            kind = rng.choice(["start", "run", "run", "run", "free", "evict"])
            if kind == "start":
                own = [rng.randrange(4) for _ in range(rng.randrange(3))]
                tokens = BASES[rng.randrange(2)][: rng.randrange(13)] + own
                ops.append(("start", tokens or [0]))
            elif kind == "run":
                ops.append(("run", rng.randrange(6), rng.randrange(1, 13)))
            else:
                ops.append((kind, rng.randrange(6) if kind == "free" else rng.randrange(1, 5)))
        totals += torch.tensor(run_program(ops))
    num_shared, num_copied, num_evicted = totals.tolist()
    assert num_shared > 0 and num_copied > 0 and num_evicted > 0, totals


def run_program(ops):
    """Run one program, checking after every operation; returns (shared, copied, evicted) blocks."""
    manager = PrefixCachingKVCacheManager(L, E, P, 24)
    live = {}  # seq id -> [tokens, computed]
    next_id = 0
    for op in ops:
        if op[0] == "start":
            tokens = op[1]
            hit = manager.prefix_cache.find_cached_prefix(tokens)
            computed = 0
            if hit.num_tokens:
                try:
                    manager.prefix_cache.apply_prefix_hit(next_id, hit)
                    computed = hit.num_tokens
                    # every row's count equals what running the prefix would give
                    expected = torch.zeros(L * E, dtype=torch.int64)
                    for t in range(computed):
                        for layer, experts in enumerate(routing_of(tokens, t)):
                            expected[[layer * E + e for e in experts]] += 1
                    assert torch.equal(hit.row_counts, expected)
                except OutOfBlocksError:
                    manager.assert_consistent()
                    continue
            else:
                manager.add_sequence(next_id)
            live[next_id] = [tokens, computed]
            next_id += 1
        elif op[0] == "run" and live:
            seq_id = sorted(live)[op[1] % len(live)]
            tokens, computed = live[seq_id]
            end = min(len(tokens), computed + op[2])
            if end == computed:
                continue
            snapshot = Snapshot(manager)
            try:
                append_tokens(
                    manager, seq_id, computed, [routing_of(tokens, t) for t in range(computed, end)]
                )
            except OutOfBlocksError:  # a layer ran short: undo the earlier layers, as the engine does
                snapshot.restore()
                manager.assert_consistent()
                continue
            live[seq_id][1] = end
            manager.prefix_cache.cache_computed_blocks(seq_id, tokens[:end])
        elif op[0] == "free" and live:
            seq_id = sorted(live)[op[1] % len(live)]
            manager.free(seq_id)
            del live[seq_id]
        elif op[0] == "evict":
            pool = manager.pool
            n = min(pool.num_free_blocks - pool.num_cached_free_blocks + op[1], pool.num_free_blocks)
            pool.free(pool.allocate(n))  # evicts min(k, cached-free) cached blocks
        manager.assert_consistent()
        # each live sequence's rows hold exactly its routed entries, at the right positions
        for seq_id, (tokens, computed) in live.items():
            rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0]
            for layer in range(L):
                for e in range(E):
                    want = [t for t in range(computed) if e in routing_of(tokens, t)[layer]]
                    slots = manager.row_slots(int(rows[layer * E + e]))
                    assert manager.prefix_cache.block_positions.view(-1)[slots].tolist() == want
    for seq_id in list(live):
        manager.free(seq_id)
    manager.assert_consistent()
    assert manager.pool.num_free_blocks == manager.num_blocks
    return (
        manager.prefix_cache.stats.num_shared_blocks,
        manager.prefix_cache.stats.num_cow_blocks,
        manager.pool.num_evicted_cached_blocks,
    )


# ----- the engine: the same tokens with and without the cache ---------------------------------------------


def serve(model, workload, enable_prefix_caching, num_blocks, block_size=4, **config):
    engine = LLMEngine(
        model,
        num_blocks,
        block_size,
        SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, **config}),
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(engine, workload, on_step=lambda e: e.cache.manager.assert_consistent())
    engine.memory.assert_no_leak()  # cached-free blocks count as free: nothing is held
    return [result.outputs[i].token_ids for i in range(len(workload))], engine


@pytest.mark.parametrize("routing", ["topk", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_embedded_model_gives_the_same_tokens_with_the_prefix_cache(routing, temperature):
    model = load_default_model(routing=routing)
    workload = few_shot_workload(
        6, prompt_len=80, shared_share=0.8, output_len=6, temperature=temperature, top_p=0.95
    )
    without, _ = serve(model, workload, False, 400)
    with_cache, engine = serve(model, workload, True, 400)
    assert with_cache == without
    stats = engine.prefix_cache_stats()
    # the test must exercise the cache: later requests skip most of the 64 shared tokens, with copies
    assert (
        stats["num_hit_tokens"] >= 5 * 48 and stats["num_shared_blocks"] > 0 and stats["num_cow_blocks"] > 0
    )


def test_embedded_model_under_pressure_preempts_evicts_and_keeps_the_tokens():
    """A pool too small for the batch: requests are preempted (recompute), cached-free blocks are
    evicted for new ones, and re-admitted requests hit their own cached prefix again."""
    model = load_default_model(routing="threshold")
    workload = few_shot_workload(
        6, prompt_len=80, shared_share=0.8, output_len=16, temperature=0.8, top_p=0.95
    )
    without, _ = serve(model, workload, False, 240, admission="optimistic")
    with_cache, engine = serve(model, workload, True, 240, admission="optimistic")
    assert with_cache == without
    stats = engine.prefix_cache_stats()
    assert engine.stats().num_preemptions > 0 and stats["num_evicted_cached_blocks"] > 0
    assert stats["num_lookups"] > len(workload)  # preempted requests looked up again


def shared_prefix_requests(num_requests=10):
    """Prompts sharing prefixes of varied lengths (20, 22, ... tokens of one random text), then 2-6
    tokens of their own; every other request greedy, the others sampled with their own seed."""
    shared = random_prompts([37], 64, seed=5)[0]
    own = random_prompts([2 + i % 5 for i in range(num_requests)], 64, seed=6)
    prompts = [shared[: 20 + 2 * i] + tail for i, tail in enumerate(own)]
    params = [
        SamplingParams(max_new_tokens=8 + i % 7, temperature=0.0 if i % 2 else 1.0, top_p=0.9, seed=i)
        for i in range(num_requests)
    ]
    return prompts, params


@pytest.mark.parametrize(
    "routing, mode", [("threshold", "recompute"), ("threshold", "swap"), ("topk", "recompute")]
)
def test_random_model_float64_with_shared_prefixes_equals_generating_alone(routing, mode):
    model = random_model(small_config("expert", routing), seed=0)
    prompts, params = shared_prefix_requests()
    alone = alone_tokens(model, prompts, params)
    engine = LLMEngine(
        model,
        120,
        4,
        SchedulerConfig(
            max_num_seqs=6, max_num_batched_tokens=48, preemption_mode=mode, admission="optimistic"
        ),
        enable_prefix_caching=True,
    )
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == alone
    engine.memory.assert_no_leak()
    assert engine.prefix_cache_stats()["num_hit_tokens"] > 0 and engine.stats().num_preemptions > 0


def test_prefix_caching_is_refused_where_it_does_not_apply():
    model = random_model(small_config("expert", "threshold"), seed=0)
    with pytest.raises(ValueError, match="continuous_paged"):
        LLMEngine(model, 64, 4, SchedulerConfig(policy="static"), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="True or False"):
        LLMEngine(model, 64, 4, enable_prefix_caching="yes")


class InjectedFault(RuntimeError):
    pass


def test_a_failed_copy_on_write_or_forward_after_a_hit_is_undone_and_the_tokens_stay():
    """The first step with a hit's copies fails in its copies, and a later step fails in its forward
    (after layer 1 appended) while a request that started from a hit runs: the first request
    recomputes from nothing, the failed step's appends are undone, and every request still gets the
    tokens of generating it alone."""
    model = random_model(small_config("expert", "threshold"), seed=0)
    prompts, params = shared_prefix_requests(6)
    alone = alone_tokens(model, prompts, params)
    engine = LLMEngine(
        model, 200, 4, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), enable_prefix_caching=True
    )
    copy_blocks, append_kv = engine.runner.copy_blocks, engine.cache.append_kv
    faults = []

    def flaky_copies(copies):
        if any(c.direction == "copy" for c in copies) and not faults:
            faults.append("copy")
            raise InjectedFault("copy failed")
        copy_blocks(copies)

    def flaky_append(layer, *args):
        appended = append_kv(layer, *args)
        if layer == 1 and faults == ["copy"] and engine.scheduler.running[-1].prefix_hit is not None:
            faults.append("forward")
            raise InjectedFault("forward failed")
        return appended

    engine.runner.copy_blocks, engine.cache.append_kv = flaky_copies, flaky_append
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = {}
    while engine.has_unfinished_requests():
        try:
            outputs.update((o.request_id, o) for o in engine.step())
        except InjectedFault:
            engine.cache.manager.assert_consistent()
    assert faults == ["copy", "forward"]
    assert [outputs[i].token_ids for i in ids] == alone
    engine.memory.assert_no_leak()


def test_few_shot_workload_shares_its_prefix_and_refuses_bad_shares():
    workload = few_shot_workload(4, prompt_len=64, shared_share=0.75, output_len=3)
    assert all(len(r.prompt) == 64 and r.prompt[:48] == workload[0].prompt[:48] for r in workload)
    assert len({tuple(r.prompt[48:]) for r in workload}) == 4  # each question its own
    with pytest.raises(ValueError, match="shared_share"):
        few_shot_workload(4, shared_share=1.5)
    with pytest.raises(ValueError, match="at most"):
        few_shot_workload(4, prompt_len=5000)


def test_bench_comparison_counts_hits_and_saved_work():
    from moekv_ref.apps.bench_eviction import compare_prefix_caching, format_prefix_caching

    model = random_model(small_config("expert", "topk"), seed=1)
    workload = few_shot_workload(5, prompt_len=48, shared_share=0.75, output_len=4, vocab_size=64)
    result = compare_prefix_caching(
        model, workload, num_blocks=300, block_size=4, max_num_batched_tokens=64, repeats=1
    )
    off, on = result["off"], result["on"]
    assert result["outputs_equal"] and off["prefix_cache"] is None
    # every token skipped is a token not computed; hit tokens are multiples of the block size
    assert result["prefill_tokens_saved"] == on["prefix_cache"]["num_hit_tokens"] > 0
    assert on["prefix_cache"]["num_hit_tokens"] % 4 == 0 and result["steps_saved"] >= 0
    assert "outputs equal: True" in format_prefix_caching({"topk": result})


def test_cached_free_blocks_count_as_free_not_used():
    """num_free_blocks + num_used_blocks == num_blocks holds with cached-free blocks in the pool."""
    pool = CachingBlockPool(8)
    blocks = pool.allocate(3)
    pool.mark_cached(blocks[:2])
    pool.free(blocks)  # two wait in the cached-free queue, one on the stack
    assert pool.num_cached_free_blocks == 2
    assert (pool.num_free_blocks, pool.num_used_blocks) == (8, 0)
    pool.reuse(blocks[:1])  # a hit: one cached block has an owner again
    assert (pool.num_free_blocks, pool.num_used_blocks) == (7, 1)
    pool.assert_consistent()


# ----- several devices: blocks placed by expert, or by the sequence's home ------------------------------
def check_rows_on_their_devices(engine):
    """Every block in every held row's table lies in that row's device's range, and with home devices
    no block is listed by two sequences of different homes."""
    manager = engine.cache.manager
    pool, P = manager.pool, manager.block_size
    listed_by = {}  # block -> the homes of the rows listing it
    for seq_id in manager.sequences:
        rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0]  # (L*E,)
        devices = manager.placement.of_sequences([seq_id])[0].reshape(-1)  # (L*E,)
        for row, device in zip(rows.tolist(), devices.tolist()):
            blocks = manager.block_tables[row, : -(-int(manager.row_tokens[row]) // P)].to(torch.int64)
            assert (pool.device_of_blocks(blocks) == device).all(), (seq_id, row, blocks.tolist(), device)
            for block in blocks.tolist():
                listed_by.setdefault(block, set()).add(device)
    if manager.placement.follows_sequence:
        assert all(len(homes) == 1 for homes in listed_by.values()), "two homes share a block"


def device_prefix_engine(model, placement, enable_prefix_caching, mode="recompute", **options):
    """The engine over 4 devices with blocks placed by expert (placement "expert"), or over 2 devices
    with every row of request s on device s % 2 (placement "home"); pools small enough to preempt."""
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=48, preemption_mode=mode, admission="optimistic"
    )
    if placement == "expert":
        E = model.config.num_attention_experts
        return LLMEngine(
            model,
            block_size=4,
            scheduler_config=config,
            blocks_per_device=[52, 26, 26, 26],
            device_of_expert=torch.arange(E) % 4,
            enable_prefix_caching=enable_prefix_caching,
            **options,
        )
    return LLMEngine(
        model,
        block_size=4,
        scheduler_config=config,
        blocks_per_device=[90, 90],
        home_devices=True,
        enable_prefix_caching=enable_prefix_caching,
        **options,
    )


@pytest.mark.parametrize(
    "placement, mode", [("expert", "recompute"), ("expert", "swap"), ("home", "recompute")]
)
def test_prefix_caching_on_several_devices_gives_the_tokens_of_no_cache_and_of_alone(placement, mode):
    """A random float64 model (exact tokens: no tie can flip between batchings), requests sharing
    prefixes: with the prefix cache on D devices the engine generates exactly what it generates without
    it and what each request generates alone, later requests start from cached prefixes, and at every
    step every row lists only blocks of its own device."""
    model = random_model(small_config("expert", "threshold"), seed=0)
    prompts, params = shared_prefix_requests()
    alone = alone_tokens(model, prompts, params)
    without = device_prefix_engine(model, placement, False, mode).generate(prompts, params)
    engine = device_prefix_engine(model, placement, True, mode, record_history=True)
    outputs = engine.generate(prompts, params, on_step=check_rows_on_their_devices)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in without] == alone
    engine.memory.assert_no_leak()
    stats = engine.prefix_cache_stats()
    assert stats["num_hit_tokens"] > 0 and stats["num_shared_blocks"] > 0 and stats["num_cow_blocks"] > 0
    started_from_hit = [r.request_id for r in engine.requests.values() if r.prefix_hit is not None]
    assert len(started_from_hit) >= len(prompts) // 2 and 0 not in started_from_hit, started_from_hit
    # the devices are short enough to preempt and to evict cached blocks for new ones
    assert engine.stats().num_preemptions > 0 and stats["num_evicted_cached_blocks"] > 0


def test_home_devices_two_homes_never_share_a_block_and_each_home_caches_its_own():
    """One layer, two experts, blocks of 2, devices of 8 blocks (ids 0-7 and 8-15); every row of
    sequence s on device s % 2. Sequence 0 (home 0) caches a prefix: sequence 2 (home 0) finds it,
    sequence 1 (home 1) does not, runs it itself and caches its own copy on device 1, which
    sequence 3 (home 1) then finds."""
    manager = PrefixCachingKVCacheManager(1, 2, 2, blocks_per_device=[8, 8], home_devices=True)
    prefix = manager.prefix_cache
    tokens = [10, 11, 12, 13, 14]
    route = [[[0]], [[0]], [[1]], [[1]]]  # 4 tokens: one full block per expert
    append_tokens(manager, 0, 0, route)
    assert prefix.cache_computed_blocks(0, tokens[:4]) == 2
    home0 = sorted(table(manager, 0, 0) + table(manager, 0, 1))
    assert all(b < 8 for b in home0)
    with pytest.raises(ValueError, match="needs the sequence id"):
        prefix.find_cached_prefix(tokens)
    assert prefix.find_cached_prefix(tokens, seq_id=1).num_tokens == 0  # other home: no hit
    hit = prefix.find_cached_prefix(tokens, seq_id=2)
    assert hit.num_tokens == 4 and sorted(hit.shared.tolist()) == home0
    assert hit.free_taken_per_device.tolist() == [0, 0]  # shared blocks in use, no copy
    with pytest.raises(ValueError, match="other devices"):
        prefix.apply_prefix_hit(1, hit)  # a home-0 hit for a home-1 sequence
    prefix.apply_prefix_hit(2, hit)
    append_tokens(manager, 1, 0, route)  # home 1 computes the prefix itself
    assert prefix.cache_computed_blocks(1, tokens[:4]) == 2
    home1 = sorted(table(manager, 1, 0) + table(manager, 1, 1))
    assert all(b >= 8 for b in home1)
    manager.free(0)
    manager.free(1)  # both copies stay cached
    hit = prefix.find_cached_prefix(tokens, seq_id=3)
    assert sorted(hit.shared.tolist()) == home1
    assert hit.free_taken_per_device.tolist() == [0, 2]  # two cached-free blocks of device 1
    prefix.apply_prefix_hit(3, hit)
    manager.assert_consistent()
    for seq_id in (2, 3):  # every row's blocks on its home
        for row in range(2):
            assert all(b // 8 == seq_id % 2 for b in table(manager, seq_id, row))
    assert not set(table(manager, 2, 0) + table(manager, 2, 1)) & set(
        table(manager, 3, 0) + table(manager, 3, 1)
    )


def test_a_short_device_evicts_its_own_cached_blocks_not_another_devices():
    """Experts 0 and 1 on devices 0 (ids 0-3) and 1 (ids 4-7). Device 0's cached blocks are freed
    first, so they are the least recently used of the pool: an allocation on device 1 that needs
    more than its plain free blocks must still evict device 1's cached blocks, and device 0's stay
    findable."""
    manager = PrefixCachingKVCacheManager(1, 2, 2, blocks_per_device=[4, 4], device_of_expert=[0, 1])
    prefix, pool = manager.prefix_cache, manager.pool
    append_tokens(manager, 0, 0, [[[0]], [[0]], [[0]], [[0]]])  # expert 0: blocks 0, 1
    prefix.cache_computed_blocks(0, [1, 2, 3, 4])
    append_tokens(manager, 1, 0, [[[1]], [[1]], [[1]], [[1]]])  # expert 1: blocks 4, 5
    prefix.cache_computed_blocks(1, [5, 6, 7, 8])
    assert (table(manager, 0, 0), table(manager, 1, 1)) == ([0, 1], [4, 5])
    manager.free(0)
    manager.free(1)
    assert pool.cached_free_block_ids(0) == [0, 1] and pool.cached_free_block_ids(1) == [4, 5]
    assert pool.num_free_blocks_per_device.tolist() == [4, 4]
    # device 1: two plain free blocks (6, 7), then its own cached block 4, least recently used there
    taken = pool.allocate(3, device=1)
    assert taken.tolist() == [6, 7, 4]
    assert pool.cached_free_block_ids(0) == [0, 1] and pool.cached_free_block_ids(1) == [5]
    assert pool.num_evicted_cached_blocks == 1
    pool.assert_consistent()
    assert prefix.find_cached_prefix([1, 2, 3, 4, 9]).shared.tolist() == [0, 1]  # device 0 kept all
    assert prefix.find_cached_prefix([5, 6, 7, 8, 9]).num_tokens == 0  # its first block is gone
    with pytest.raises(OutOfBlocksError, match="device 1 is short"):
        pool.allocate(2, device=1)  # one free there, although device 0 has four
    assert pool.cached_free_block_ids(0) == [0, 1]
    pool.free(taken)
    manager.assert_consistent()


def test_a_recomputed_prefix_takes_over_the_keys_of_its_idle_copy():
    """A prefix computed again from nothing (say its hit did not fit the pool) is registered: its
    blocks in use take the keys from the idle blocks that held them, which go back to the plain
    free stack. Else the keys would leave with the idle blocks once they are evicted, and the prefix,
    held all along, could not be found."""
    manager = PrefixCachingKVCacheManager(1, 1, 2, 8)
    prompt = [10, 11, 12, 13]
    route = [[[0]]] * 4
    append_tokens(manager, 0, 0, route)
    assert manager.prefix_cache.cache_computed_blocks(0, prompt) == 2
    first_blocks = table(manager, 0, 0)
    manager.free(0)  # idle, cached, findable
    append_tokens(manager, 1, 0, route)  # the same prompt from nothing: fresh blocks
    second_blocks = table(manager, 1, 0)
    assert not set(first_blocks) & set(second_blocks)
    assert manager.prefix_cache.cache_computed_blocks(1, prompt) == 2
    assert manager.pool.cached_free_block_ids() == []  # the idle copies are plain free blocks again
    manager.assert_consistent()
    append_tokens(manager, 2, 0, [[[0]]] * 8)  # takes every free block: the idle copies are gone
    hit = manager.prefix_cache.find_cached_prefix(prompt + [99])
    assert hit.num_tokens == 4 and sorted(hit.shared.tolist()) == sorted(second_blocks)


def test_a_tight_pool_still_starts_from_the_prefix_it_holds():
    """Four requests sharing a 224-token prefix, served one after another by the embedded model in
    pools from the smallest it accepts: each after the first starts from the cached prefix (its
    hit is at most what starting from nothing needs), with the tokens of a pool without caching."""
    model = load_default_model("threshold")
    generator = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    shared = torch.randint(0, V, (224,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, V, (8,), generator=generator).tolist() for _ in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    expected = generate(model, prompts, [params] * 4, cache="paged", block_size=16).tokens
    for num_blocks in (148, 156):
        engine = LLMEngine(model, num_blocks, 16, SchedulerConfig(max_num_seqs=4), enable_prefix_caching=True)
        tokens = []
        for prompt in prompts:
            engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                tokens += [output.token_ids for output in engine.step()]
        assert tokens == expected
        assert engine.cache.manager.prefix_cache.stats.num_hit_tokens == 3 * 224, num_blocks
        engine.memory.assert_no_leak()
