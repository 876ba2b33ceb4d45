"""The paged cache equals the contiguous cache and full recompute.

Equivalence: the same prompts and sampling through `generate` with cache="paged" (block sizes 1, 4,
16, 64, free queue shuffled so that a row's blocks are scattered over the pool) and cache="contiguous"
give the same tokens and token counts, and logits within the foundation's tolerances of each other and
of full recompute. Scenarios: exact block ids and slots; bad input raises before anything changes.
"""

import pytest
import torch
from helpers import max_logit_error, random_model, random_prompts, small_config

from moekv_ref.cache import (
    KVCacheManager,
    OutOfBlocksError,
    PagedKVCache,
    PlannedPagedKVCache,
    PrefixCachingPagedKVCache,
    SharedTailKVCacheManager,
    SharedTailPagedKVCache,
    make_paged_cache,
)
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingParams

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def _run(model, cache, **options):
    prompts = random_prompts([3, 11, 1], model.config.vocab_size, seed=5)
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i) for i, n in enumerate([6, 4, 9])]
    return generate(model, prompts, params, cache=cache, record_logits=True, **options)


def assert_same_run(model, paged, reference, dtype) -> None:
    """A paged run equals the contiguous one: the same tokens and per-expert counts, logits within the
    dtype's tolerance of it and of full recompute."""
    assert paged.tokens == reference.tokens
    assert torch.equal(paged.cache_counts, reference.cache_counts)
    for a, b in zip(paged.logits, reference.logits):
        assert (a - b).abs().max().item() <= TOLERANCE[dtype]
    assert max_logit_error(model, paged) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "mode,routing", [("expert", "topk"), ("expert", "threshold"), ("dense", "topk"), ("dense", "threshold")]
)
@pytest.mark.parametrize("attention", ["reference", "batched"])
def test_paged_equals_contiguous_and_recompute(mode, routing, dtype, attention):
    model = random_model(small_config(mode, routing), seed=1, dtype=dtype)
    reference = _run(model, "contiguous")
    for block_size in (1, 4, 16, 64):
        paged = _run(model, "paged", block_size=block_size, shuffle_seed=block_size, attention=attention)
        assert_same_run(model, paged, reference, dtype)


def test_blocks_are_scattered_and_slots_follow_tables():
    """With a shuffled free queue a row's blocks are not adjacent; each token's slot is
    block_table[row, j // P] * P + j % P."""
    manager = KVCacheManager(num_layers=1, num_experts=2, block_size=4, num_blocks=32, shuffle_seed=0)
    manager.add_sequence(7)
    rows = manager.rows([7], 0, 1)
    first = manager.allocate_slots(rows, torch.tensor([7]))
    last = manager.allocate_slots(rows, torch.tensor([3]))
    table = manager.block_tables[rows[0], :3].to(torch.int64)
    assert (table.diff().abs() != 1).any()
    expected = torch.cat([table[j // 4 : j // 4 + 1] * 4 + j % 4 for j in range(10)])
    assert torch.equal(manager.row_slots(int(rows[0])), expected)
    assert torch.equal(first.slot_mapping, expected[:7]) and torch.equal(last.slot_mapping, expected[7:])
    assert first.moves == [] and last.moves == []  # plain pages never move


def test_exact_block_ids_unshuffled():
    """Blocks are handed out 0, 1, 2, ... and the last freed is the first reused (LIFO)."""
    manager = KVCacheManager(num_layers=1, num_experts=2, block_size=2, num_blocks=8)
    manager.add_sequence(0)
    manager.add_sequence(1)
    a, b = manager.rows([0], 0, 0), manager.rows([1], 0, 1)
    manager.allocate_slots(a, torch.tensor([3]))  # blocks 0, 1
    manager.allocate_slots(b, torch.tensor([1]))  # block 2
    manager.allocate_slots(a, torch.tensor([1]))  # fills block 1: no new block
    manager.allocate_slots(a, torch.tensor([1]))  # block 3
    assert manager.blocks_of_sequence(0).tolist() == [0, 1, 3]
    assert manager.blocks_of_sequence(1).tolist() == [2]
    manager.free(0)
    manager.allocate_slots(b, torch.tensor([5]))  # 6 tokens -> 3 blocks: 2 new ones
    assert manager.blocks_of_sequence(1).tolist() == [2, 3, 1]
    manager.assert_consistent()


def test_bad_input_leaves_everything_unchanged():
    config = small_config("expert", "topk")
    L, K = config.num_hidden_layers, config.num_attention_experts_per_tok
    for bad in (0, -4, 3, 12):
        with pytest.raises(ValueError, match="block_size"):
            PagedKVCache(config, num_blocks=64, block_size=bad)
    with pytest.raises(ValueError, match=f"at least {L * K}"):
        PagedKVCache(config, num_blocks=L * K - 1, block_size=4)

    manager = KVCacheManager(num_layers=2, num_experts=3, block_size=4, num_blocks=6)
    manager.add_sequence(0)
    manager.allocate_slots(manager.rows([0], 0, 0), torch.tensor([9]))  # 3 blocks
    before = (
        manager.pool.free_block_ids(),
        manager.pool.ref_cnt.clone(),
        manager.block_tables.clone(),
        manager.row_tokens.clone(),
    )

    def unchanged():
        after = (
            manager.pool.free_block_ids(),
            manager.pool.ref_cnt,
            manager.block_tables,
            manager.row_tokens,
        )
        return all(torch.equal(x, y) for x, y in zip(before, after))

    with pytest.raises(KeyError, match="sequence 5"):
        manager.free(5)
    assert unchanged()
    rows = manager.rows([0], 1, 2)
    assert manager.blocks_needed_per_device(rows, torch.tensor([16])).tolist() == [4]
    assert not manager.can_allocate(rows, torch.tensor([16]))
    with pytest.raises(OutOfBlocksError, match="need 4 blocks but only 3 of 6 are free"):
        manager.allocate_slots(rows, torch.tensor([16]))
    assert unchanged()
    with pytest.raises(ValueError, match="distinct"):
        manager.allocate_slots(torch.cat([rows, rows]), torch.tensor([1, 1]))
    assert unchanged()
    with pytest.raises(ValueError, match="double free"):
        manager.pool.free(torch.tensor([5]))  # block 5 is free
    assert unchanged()
    manager.free(0)
    with pytest.raises(KeyError, match="already freed"):
        manager.free(0)
    assert manager.num_free_blocks == 6
    manager.assert_consistent()


def test_append_kv_rejects_out_of_order_positions_without_storing():
    config = small_config("dense", "topk")
    cache = PagedKVCache(config, num_blocks=16, block_size=4)
    Hkv, Dh = config.num_key_value_heads, config.head_dim
    k = torch.randn(2, Hkv, Dh)
    expert = torch.tensor([0, 0])
    cache.append_kv(0, torch.tensor([3, 3]), expert, torch.tensor([0, 1]), k, k)
    with pytest.raises(ValueError, match="do not increase"):
        cache.append_kv(0, torch.tensor([3]), expert[:1], torch.tensor([1]), k[:1], k[:1])
    assert cache.token_counts([3])[0, 0, 0] == 2
    with pytest.raises(ValueError, match="do not increase"):
        cache.append_kv(0, torch.tensor([4, 4]), expert, torch.tensor([2, 2]), k, k)
    assert 4 not in cache.manager.sequences
    cache.free(3)
    assert cache.manager.num_free_blocks == 16
    with pytest.raises(KeyError, match="sequence 3 is not in the cache"):
        cache.free(3)
    assert cache.manager.num_free_blocks == 16


def test_append_kv_groups_pairs_into_rows_exactly():
    """One call, every expert of a layer: pairs of two sequences and three experts, interleaved as
    the model sends them (sorted by expert). P = 2, blocks handed out 0, 1, 2, ... in row order."""
    config = small_config("expert", "topk")  # L = 2, E = 5, Hkv = 2, Dh = 8
    seq_ids = torch.tensor([9, 9, 9, 9, 5, 9])
    experts = torch.tensor([0, 0, 0, 3, 3, 4])
    positions = torch.tensor([0, 1, 2, 1, 0, 2])
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    cache = PagedKVCache(config, num_blocks=32, block_size=2, dtype=torch.float64)
    appended = cache.append_kv(1, seq_ids, experts, positions, k, -k)
    # new sequences get slots in id order: 5 -> slot 0, 9 -> slot 1; L * E = 10 rows per sequence,
    # row = slot * 10 + layer * 5 + expert
    assert appended.rows.tolist() == [8, 15, 18, 19]  # (5,1,3) (9,1,0) (9,1,3) (9,1,4)
    assert appended.num_new.tolist() == [1, 3, 1, 1] and appended.context_lens.tolist() == [1, 3, 1, 1]
    assert appended.pair_row.tolist() == [1, 1, 1, 2, 0, 3]
    assert appended.pair_index.tolist() == [0, 1, 2, 0, 0, 0]
    # blocks in row order: row 8 block 0, row 15 blocks 1-2, row 18 block 3, row 19 block 4
    assert cache.manager.row_slots(15).tolist() == [2, 3, 4]
    assert torch.equal(cache.key_cache.view(-1, 2, 8)[[2, 3, 4, 6, 0, 8]], k)
    assert torch.equal(cache.value_cache.view(-1, 2, 8)[6], -k[3])
    # a second call continues the rows: expert 0 of sequence 9 gets its 4th token at index 3
    again = cache.append_kv(1, torch.tensor([9]), torch.tensor([0]), torch.tensor([3]), k[:1], k[:1])
    assert (
        again.rows.tolist() == [15]
        and again.pair_index.tolist() == [3]
        and again.context_lens.tolist() == [4]
    )


@pytest.mark.parametrize("attention", ["reference", "batched", "triton"])
def test_padding_and_free_slots_are_never_read_as_data(attention):
    """Fill every slot of the pool with NaN, then append: only the rows' own slots get real values.
    Batched paths pad short rows to the longest one; a padded position must never bring NaN (or inf)
    into another row's output. Checked against the contiguous cache on the same inputs."""
    if attention == "triton":
        pytest.importorskip("triton")
    from moekv_ref.cache import ContiguousKVCache

    config = small_config("expert", "threshold")
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cache = PagedKVCache(config, num_blocks=64, block_size=4, attention=attention, shuffle_seed=3)
    cache.key_cache.fill_(float("nan"))
    cache.value_cache.fill_(float("nan"))
    reference = ContiguousKVCache(config.num_hidden_layers, config.num_attention_experts)
    generator = torch.Generator().manual_seed(0)
    lengths = {0: 9, 1: 2, 2: 5}  # ragged prompts, one per expert
    seq_ids = torch.tensor([s for s, n in lengths.items() for _ in range(n)])
    positions = torch.tensor([p for n in lengths.values() for p in range(n)])
    experts = seq_ids.clone()  # sequence s -> expert s
    for step in range(3):  # a prefill, then two decode steps
        k, v = torch.randn(2, seq_ids.numel(), Hkv, Dh, generator=generator)
        q = torch.randn(seq_ids.numel(), H, Dh, generator=generator)
        out = cache.attend(cache.append_kv(0, seq_ids, experts, positions, k, v), q)
        expected = reference.attend(reference.append_kv(0, seq_ids, experts, positions, k, v), q)
        assert torch.isfinite(out).all(), f"step {step}: padding or a free slot leaked into the output"
        assert (out - expected).abs().max() <= 1e-5
        seq_ids = torch.tensor(list(lengths))
        experts = seq_ids.clone()
        positions = torch.tensor([n + step for n in lengths.values()])


@pytest.mark.parametrize("routing", ["topk", "threshold"])
def test_paged_equals_recompute_on_the_embedded_model(routing):
    from moekv_ref.checkpoint import load_default_model

    model = load_default_model(routing)
    prompts = [list(b"def fibonacci(n):\n    "), list(b"import os"), list(b"x")]
    result = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=12, temperature=0.0),
        cache="paged",
        record_logits=True,
        block_size=16,
        shuffle_seed=0,
    )
    assert max_logit_error(model, result) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "mode,routing", [("expert", "topk"), ("expert", "threshold"), ("dense", "threshold")]
)
@pytest.mark.parametrize("attention", ["reference", "batched"])
def test_shared_tails_equal_contiguous_and_recompute(mode, routing, dtype, attention):
    """Shared tails move K/V (promotion, compaction): the model must not notice."""
    model = random_model(small_config(mode, routing), seed=1, dtype=dtype)
    reference = _run(model, "contiguous")
    for block_size in (1, 2, 4, 16, 64):
        paged = _run(
            model,
            "paged",
            block_size=block_size,
            shuffle_seed=block_size,
            shared_tails=True,
            attention=attention,
        )
        assert paged.tokens == reference.tokens
        for a, b in zip(paged.logits, reference.logits):
            assert (a - b).abs().max().item() <= TOLERANCE[dtype]
        assert max_logit_error(model, paged) <= TOLERANCE[dtype]


def test_shared_tail_promotion_and_compaction_exact_moves():
    """P = 4, one layer, three experts, one sequence; tail blocks 0 and 1 are handed out in order."""
    manager = SharedTailKVCacheManager(num_layers=1, num_experts=3, block_size=4, num_blocks=16)
    manager.add_sequence(0)
    rows = torch.cat([manager.rows([0], 0, e) for e in range(3)])
    # 3 + 3 + 1 tail tokens: no full block yet, 7 tail slots in tail blocks 0 and 1 (slots 0..6)
    first = manager.allocate_slots(rows, torch.tensor([3, 3, 1]))
    assert first.moves == [] and first.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert manager.tail_blocks[0] == [0, 1] and manager.tail_slots[rows[2], 0] == 6
    # expert 0's fourth token fills its block: a fresh block (2) takes its 3 tail tokens (slots 0..2
    # -> 8..10); 4 tail tokens remain and 4 slots are free, so the emptiest tail block (0, holding
    # expert 1's token at slot 3) is compacted into block 1 (slot 3 -> 7) and given back.
    allocation = manager.allocate_slots(rows[:1], torch.tensor([1]))
    assert [(s.tolist(), d.tolist()) for s, d in allocation.moves] == [([0, 1, 2], [8, 9, 10]), ([3], [7])]
    assert allocation.slot_mapping.tolist() == [11]  # written straight to block 2
    assert manager.tail_blocks[0] == [1] and manager.pool.num_free_blocks == 16 - 2
    assert manager.row_slots(int(rows[0])).tolist() == [8, 9, 10, 11]
    assert manager.row_slots(int(rows[1])).tolist() == [7, 4, 5]  # its first tail token moved
    manager.assert_consistent()
    manager.free(0)
    assert manager.pool.num_free_blocks == 16
    manager.assert_consistent()


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_shared_tail_design_equals_the_real_manager(block_size):
    """The simulator's count-level SharedTailDesign allocates what SharedTailKVCacheManager does."""
    from moekv_ref.sim import ManagerPagedDesign, SharedTailDesign, replay, synthetic_trace

    trace = synthetic_trace(5, num_layers=2, num_experts=8, top_k=3, mean_prompt=12, mean_output=20, seed=6)
    real = ManagerPagedDesign(
        5,
        2,
        8,
        block_size,
        num_blocks=trace.num_slot_appends + 1,
        shuffle_seed=1,
        manager_class=SharedTailKVCacheManager,
    )
    counted = SharedTailDesign(5, 2, 8, block_size)
    assert replay(trace, real).allocated_bytes_time_sum == replay(trace, counted).allocated_bytes_time_sum
    real.manager.assert_consistent()
    assert real.manager.num_free_blocks == real.manager.num_blocks


def test_attend_of_a_call_with_no_pairs_is_empty():
    """A rank of expert parallelism may get no (token, expert) pair of a layer: attend returns (0, H, Dh)."""
    config = small_config()
    cache = PagedKVCache(config, num_blocks=64, block_size=4)
    Hkv, H, Dh = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    empty = torch.zeros(0, dtype=torch.int64)
    appended = cache.append_kv(0, empty, empty, empty, torch.zeros(0, Hkv, Dh), torch.zeros(0, Hkv, Dh))
    assert cache.attend(appended, torch.zeros(0, H, Dh)).shape == (0, H, Dh)


def test_prefix_caching_and_shared_tails_combine_with_several_devices_not_with_each_other():
    """The paged cache takes prefix caching, and shared tails, over per-device pools, by expert or by
    home; shared tails with prefix caching do not combine and are refused with the reason, where the
    class is chosen (make_paged_cache); shared tails refuse the Triton path when built."""
    from moekv_ref.cache.prefix_caching_manager import PrefixCachingKVCacheManager

    config = small_config("expert", "topk")  # L = 2, E = 5, k = 3
    placement = torch.tensor([0, 0, 1, 1, 1])
    by_expert = PrefixCachingPagedKVCache(
        config, 40, 4, blocks_per_device=[20, 20], device_of_expert=placement
    )
    by_home = PrefixCachingPagedKVCache(config, 40, 4, blocks_per_device=[20, 20], home_devices=True)
    assert isinstance(by_expert.manager, PrefixCachingKVCacheManager) and by_expert.manager.num_devices == 2
    assert by_home.manager.placement.follows_sequence and isinstance(
        by_home.manager, PrefixCachingKVCacheManager
    )
    assert torch.equal(by_home.manager.placement.of_sequences([0, 1])[:, 0, 0], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no device_of_expert"):
        PagedKVCache(config, 40, 4, blocks_per_device=[20, 20], device_of_expert=placement, home_devices=True)
    with pytest.raises(ValueError, match=r"blocks_per_device\[1\]=5 is too small .* homed there"):
        PagedKVCache(config, 25, 4, blocks_per_device=[20, 5], home_devices=True)
    tails = SharedTailPagedKVCache(config, 40, 4, blocks_per_device=[20, 20], device_of_expert=placement)
    assert isinstance(tails.manager, SharedTailKVCacheManager) and tails.manager.num_devices == 2
    assert not isinstance(
        PagedKVCache(config, 40, 4).manager, (SharedTailKVCacheManager, PrefixCachingKVCacheManager)
    )
    model = random_model(config, seed=0)
    with pytest.raises(ValueError, match="shared tails and prefix caching do not combine"):
        make_paged_cache(
            model,
            4,
            40,
            blocks_per_device=[20, 20],
            home_devices=True,
            shared_tails=True,
            enable_prefix_caching=True,
        )
    with pytest.raises(ValueError, match="shared_tails=True cannot use attention='triton'"):
        SharedTailPagedKVCache(config, 40, 4, attention="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("placement", ["expert", "home"])
def test_shared_tails_on_several_devices_equal_contiguous_and_recompute(dtype, placement):
    """Shared tails over two devices (each sequence's rows on a device share that device's tail
    blocks): the same tokens as the contiguous cache, logits within the dtype's tolerance of it and of
    full recompute."""
    model = random_model(small_config("expert", "threshold"), seed=1, dtype=dtype)
    reference = _run(model, "contiguous")
    devices = (
        dict(device_of_expert=torch.tensor([0, 1, 1, 0, 1]))
        if placement == "expert"
        else dict(home_devices=True)
    )
    for block_size in (2, 4, 16):
        paged = _run(
            model,
            "paged",
            block_size=block_size,
            shuffle_seed=block_size,
            shared_tails=True,
            blocks_per_device=[200, 200],
            **devices,
        )
        assert_same_run(model, paged, reference, dtype)


def test_shared_tails_on_two_devices_keep_each_devices_tails_apart_exact_ids():
    """One layer, experts 0 and 1 on devices 0 (blocks 0-3) and 1 (blocks 4-7), P = 2. One token in
    each row: on one device the two tails would share one tail block; here each device's row gets a
    tail block of its own device. The second token of expert 0 promotes its tail into a full block of
    device 0 (a move of slot 0 to slot 2), and device 0's emptied tail block goes back."""
    manager = SharedTailKVCacheManager(1, 2, 2, blocks_per_device=[4, 4], device_of_expert=[0, 1])
    manager.add_sequence(0)
    rows = manager.rows([0, 0], 0, [0, 1])
    first = manager.allocate_slots(rows, torch.tensor([1, 1]))
    assert first.slot_mapping.tolist() == [0, 8] and first.moves == []
    assert manager.tail_blocks == {0: [0], 1: [4]}  # group = seq slot * D + device
    assert manager.blocks_needed_per_device(rows[:1], torch.tensor([1])).tolist() == [1, 0]
    second = manager.allocate_slots(rows[:1], torch.tensor([1]))
    assert second.slot_mapping.tolist() == [3] and [(s.tolist(), d.tolist()) for s, d in second.moves] == [
        ([0], [2])
    ]
    assert manager.tail_blocks == {0: [], 1: [4]} and manager.block_tables[rows[0], 0] == 1
    assert manager.num_free_blocks_per_device.tolist() == [3, 3]
    assert manager.blocks_of_sequence(0).tolist() == [1, 4]
    manager.assert_consistent()
    with pytest.raises(OutOfBlocksError, match="device 1 is short"):
        manager.allocate_slots(rows[1:], torch.tensor([9]))  # 4 full blocks + a tail on device 1
    manager.assert_consistent()
    manager.free(0)
    assert manager.num_free_blocks_per_device.tolist() == [4, 4]
    manager.assert_consistent()


def _dense_decode_run(model, monkeypatch, planned=None):
    """generate through the paged cache (a PlannedPagedKVCache: one attention expert) with
    PlannedPagedKVCache._append_planned replaced by `planned` (None: counted only); returns the result
    and the layers of the appends the plan served."""
    served, original = [], PlannedPagedKVCache._append_planned

    def counting(self, plan, layer, *args):
        appended = (planned or original)(self, plan, layer, *args)
        if appended is not None:
            served.append(layer)
        return appended

    monkeypatch.setattr(PlannedPagedKVCache, "_append_planned", counting)
    prompts = random_prompts([5, 9, 3], model.config.vocab_size, seed=6)
    result = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=12, temperature=0.0),
        cache="paged",
        record_logits=True,
        block_size=4,
        shuffle_seed=1,
    )
    return result, served


def test_a_dense_decode_step_plans_its_bookkeeping_once_and_the_plan_reaches_the_logits(monkeypatch):
    """With one attention expert a decode append's lengths, columns, offsets and gather padding are
    worked out at the first layer and reused at the others (DecodePlan). Prompts of 5, 9 and 3
    tokens, blocks of 4: of the 11 decode steps, those before tokens 1, 3, 5, 7 and 9 give some row
    a block and are not planned; the other 6 serve layers 1 and 2 from the plan. The logits equal
    full recompute (float64); shifting the planned slots by one, and only those, shows in them."""
    model = random_model(small_config("dense", num_hidden_layers=3), seed=5)
    result, served = _dense_decode_run(model, monkeypatch)
    assert served == [1, 2] * 6
    assert max_logit_error(model, result) <= TOLERANCE[torch.float64]
    original = PlannedPagedKVCache._append_planned

    def shifted(self, plan, *args):  # each new token one slot on in its block
        if plan is None:
            return None
        plan.offset = (plan.offset + 1) % self.block_size
        try:
            return original(self, plan, *args)
        finally:
            plan.offset = (plan.offset - 1) % self.block_size

    broken, _ = _dense_decode_run(model, monkeypatch, shifted)
    assert max(float((a - b).abs().max()) for a, b in zip(broken.logits, result.logits)) > 1e-3


def test_a_plan_is_not_used_where_the_next_layers_rows_hold_other_counts():
    """A caller that appended different tokens to each layer: the plan made at layer 0 does not fit
    layer 1's rows (6 tokens, not 5), so layer 1's append takes the general path, and its slots and
    attention are those of a cache that never planned."""
    config = small_config("dense")
    generator = torch.Generator().manual_seed(7)
    Hkv, H, Dh = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    kv = [torch.randn(8, Hkv, Dh, generator=generator, dtype=torch.float64) for _ in range(4)]
    q = torch.randn(1, H, Dh, generator=generator, dtype=torch.float64)
    outputs = []
    for plans in (True, False):
        cache = PlannedPagedKVCache(config, num_blocks=16, block_size=4, dtype=torch.float64)
        for layer, n in ((0, 5), (1, 6)):  # uneven layers, then one decode token
            cache.append_kv(layer, [0] * n, [0] * n, list(range(n)), kv[0][:n], kv[1][:n])
        one = [torch.tensor([0]), torch.tensor([0]), torch.tensor([6])]
        first = cache.append_kv(0, *one, kv[2][:1], kv[3][:1])
        assert cache.plan is not None and cache.plan.layer == 0  # layer 0's append planned
        if not plans:
            cache.plan = None
        second = cache.append_kv(1, *one, kv[2][1:2], kv[3][1:2])
        outputs.append(
            (
                first.context_lens.tolist(),
                second.context_lens.tolist(),
                cache.manager.row_slots(1).tolist(),
                cache.attend(second, q),
            )
        )
    assert outputs[0][1] == [7] and outputs[0][:3] == outputs[1][:3]
    assert torch.equal(outputs[0][3], outputs[1][3])


def test_a_plan_is_not_used_for_a_sequence_freed_since_whose_slot_another_took():
    """Sequence 0's decode append at layer 0 plans layer 1; then the manager, as a scheduler would
    (free, then a swap-in's allocation), frees 0 and gives its slot of rows to sequence 1, with as
    many tokens. Layer 1's append of sequence 0 must not go to sequence 1's row: the plan checks the
    pairs' slots, and the append registers 0 anew."""
    config = small_config("dense")
    cache = PlannedPagedKVCache(config, num_blocks=16, block_size=4, dtype=torch.float64)
    kv = torch.randn(8, config.num_key_value_heads, config.head_dim, dtype=torch.float64)
    for layer in (0, 1):
        cache.append_kv(layer, [0] * 5, [0] * 5, list(range(5)), kv[:5], kv[:5])
    cache.append_kv(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), kv[:1], kv[:1])
    assert cache.plan is not None
    manager = cache.manager
    manager.free(0)
    assert manager.add_sequence(1) == 0  # 0's old slot
    rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(1)]))[0]  # layers 0 and 1
    manager.allocate_slots(rows, torch.tensor([5, 5]))
    cache.append_kv(1, torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), kv[:1], kv[:1])
    assert cache.token_counts([1, 0])[:, :, 0].tolist() == [[5, 5], [0, 1]]


def _decode_appends(cache, config, generator, steps=6):
    """Prompts of 5, 9 and 3 tokens, then `steps` decode steps, every layer, through `cache` (one
    attention expert); returns each call's (slots, attention output)."""
    Hkv, H, Dh, L = (
        config.num_key_value_heads,
        config.num_attention_heads,
        config.head_dim,
        config.num_hidden_layers,
    )
    lengths = [5, 9, 3]
    seq_ids = [s for s, n in enumerate(lengths) for _ in range(n)]
    positions = [p for n in lengths for p in range(n)]
    calls = []
    for step in range(steps + 1):
        n = len(seq_ids)
        for layer in range(L):
            k, v = torch.randn(2, n, Hkv, Dh, generator=generator, dtype=torch.float64)
            q = torch.randn(n, H, Dh, generator=generator, dtype=torch.float64)
            appended = cache.append_kv(layer, seq_ids, [0] * n, positions, k, v)
            calls.append((appended.slots.clone(), cache.attend(appended, q)))
        seq_ids = list(range(len(lengths)))
        positions = [n + step for n in lengths]
    return calls


def test_the_planned_cache_equals_the_plain_cache_bit_for_bit_and_the_plan_serves(monkeypatch):
    """PlannedPagedKVCache against PagedKVCache on the same appends (prefills, then decode steps of a
    dense model, three layers): the same slots, pools, block tables and attention outputs, bit for
    bit; and the plan served the later layers' decode appends (the other test breaks it and sees the
    logits change)."""
    config = small_config("dense", num_hidden_layers=3)
    plain = PagedKVCache(config, num_blocks=64, block_size=4, dtype=torch.float64, shuffle_seed=2)
    planned = PlannedPagedKVCache(config, num_blocks=64, block_size=4, dtype=torch.float64, shuffle_seed=2)
    served, original = [], PlannedPagedKVCache._append_planned

    def counting(self, plan, layer, *args):
        appended = original(self, plan, layer, *args)
        served.append(appended is not None)
        return appended

    monkeypatch.setattr(PlannedPagedKVCache, "_append_planned", counting)
    expected = _decode_appends(plain, config, torch.Generator().manual_seed(3))
    got = _decode_appends(planned, config, torch.Generator().manual_seed(3))
    for (slots, out), (planned_slots, planned_out) in zip(expected, got):
        assert torch.equal(slots, planned_slots) and torch.equal(out, planned_out)
    assert torch.equal(plain.key_cache, planned.key_cache) and torch.equal(
        plain.value_cache, planned.value_cache
    )
    assert torch.equal(plain.manager.block_tables, planned.manager.block_tables)
    assert sum(served) == 6  # the 3 decode steps of 6 that took no block: layers 1 and 2 planned


def test_make_paged_cache_picks_the_planned_class_for_one_attention_expert_only():
    """The factory is the one place that picks a cache's class: the dense decode plan for one
    attention expert (plain or with prefix caching, whose positions it still records), the plain
    class for several, shared tails never planned."""
    from moekv_ref.cache.factory import PlannedPrefixCachingPagedKVCache

    dense = random_model(small_config("dense"), seed=0)
    routed = random_model(small_config("expert"), seed=0)
    assert type(make_paged_cache(dense, 4, 64)) is PlannedPagedKVCache
    assert type(make_paged_cache(routed, 4, 64)) is PagedKVCache
    assert (
        type(make_paged_cache(dense, 4, 64, enable_prefix_caching=True)) is PlannedPrefixCachingPagedKVCache
    )
    assert type(make_paged_cache(routed, 4, 64, enable_prefix_caching=True)) is PrefixCachingPagedKVCache
    assert type(make_paged_cache(dense, 4, 64, shared_tails=True)) is SharedTailPagedKVCache
    # the planned prefix-caching cache records the positions of planned appends too
    caches = [
        PrefixCachingPagedKVCache(dense.config, 64, 4, dtype=torch.float64),
        PlannedPrefixCachingPagedKVCache(dense.config, 64, 4, dtype=torch.float64),
    ]
    for cache in caches:
        _decode_appends(cache, dense.config, torch.Generator().manual_seed(1), steps=5)
    assert caches[1].plan.layer == dense.config.num_hidden_layers - 1  # the last step's plan served
    positions = [cache.manager.prefix_cache.block_positions for cache in caches]
    assert torch.equal(positions[0], positions[1]) and int(positions[0].max()) >= 9


def test_a_cache_takes_its_options_checked_once_or_by_keyword_not_both():
    """PagedKVCache(config, num_blocks, block_size, **settings) checks the settings into a frozen
    CacheOptions; options= one made by the class's own check_options builds the same cache, and is
    refused with anything beside it, in another form, or made for another class."""
    import dataclasses

    from moekv_ref.cache import CacheOptions

    config = small_config("expert")
    options = PagedKVCache.check_options(config, 64, 4, dtype=torch.float64, shuffle_seed=3)
    assert isinstance(options, CacheOptions) and options.num_blocks == 64 and options.block_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.attention = "reference"
    built = PagedKVCache(config, options=options)
    by_keyword = PagedKVCache(config, 64, 4, dtype=torch.float64, shuffle_seed=3)
    assert built.options == by_keyword.options and built.key_cache.dtype == torch.float64
    assert built.manager.pool.free_block_ids().tolist() == by_keyword.manager.pool.free_block_ids().tolist()
    with pytest.raises(ValueError, match="options= with num_blocks=64 is not allowed"):
        PagedKVCache(config, 64, options=options)
    with pytest.raises(ValueError, match="options= with dtype is not allowed"):
        PagedKVCache(config, options=options, dtype=torch.float32)
    with pytest.raises(ValueError, match="options=.* is a dict; allowed: a CacheOptions"):
        PagedKVCache(config, options={"block_size": 4})
    with pytest.raises(
        ValueError, match="options made for PagedKVCache cannot build a SharedTailPagedKVCache"
    ):
        SharedTailPagedKVCache(config, options=options)
    with pytest.raises(
        ValueError, match="unknown keyword shared_tails=True for PagedKVCache; allowed: config"
    ):
        PagedKVCache(config, 64, 4, shared_tails=True)
