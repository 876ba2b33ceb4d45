"""Per-device pools: rows take blocks from their expert's device; one device can be short while the
others are empty; failed calls change nothing anywhere; random programs of add / append / free /
free_rows keep every device's ownership and reference counts exact against a plain-dict model.
Also KVCacheManager.free_rows, the hook the per-device pools' row eviction uses."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekv_ref.cache import KVCacheManager, OutOfBlocksError, SharedTailKVCacheManager
from moekv_ref.cache.device_pools import DevicePools
from moekv_ref.placement import place_experts

L, E, D = 2, 4, 2


def pools(blocks=6, block_size=2, placement="contiguous", shuffle_seed=None):
    return DevicePools(L, E, block_size, blocks, place_experts(E, D, placement), shuffle_seed)


def snapshot(p):
    return [(m.pool.free_block_ids(), m.pool.ref_cnt.clone(), m.block_tables.clone(),
             m.num_computed_tokens.clone(), dict(m._seq_index)) for m in p.managers]


def same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for da, db in zip(a, b) for x, y in zip(da, db))


def test_rows_take_blocks_on_their_experts_device_exact_ids():
    p = pools(blocks=6, block_size=2)
    assert p.add_sequence(7) == 0
    # contiguous placement of 4 experts on 2 devices: experts 0,1 -> device 0, experts 2,3 -> device 1
    rows = torch.cat([p.rows([7], 0, 1), p.rows([7], 1, 2)])                   # rows 1 and 6
    assert rows.tolist() == [1, 6]
    allocation = p.allocate_slots(rows, torch.tensor([3, 1]))
    # row 1 (device 0) gets blocks 0, 1 of device 0: slots 0, 1, 2; row 6 (device 1) block 0: slot 0
    assert allocation.device.tolist() == [0, 0, 0, 1]
    assert allocation.slot_mapping.tolist() == [0, 1, 2, 0]
    assert p.num_free_blocks.tolist() == [4, 5]
    assert p.blocks_held([7]).tolist() == [[2, 1]]
    assert p.blocks_by_slot()[0].tolist() == [2, 1]
    assert p.token_counts([7])[0].tolist() == [[0, 3, 0, 0], [0, 0, 1, 0]]
    p.assert_consistent()
    assert p.free(7).tolist() == [2, 1]
    p.assert_no_leak()


def test_one_device_short_while_the_other_is_empty_and_nothing_changes():
    p = pools(blocks=2, block_size=1)
    p.add_sequence(0)
    before = snapshot(p)
    rows = p.rows([0, 0, 0], 0, torch.tensor([0, 1, 2]))
    # three tokens into expert 0 (device 0) need 3 blocks there; device 1 stays empty
    with pytest.raises(OutOfBlocksError, match="device 0 is short: the rows need 3 blocks"):
        p.allocate_slots(rows, torch.tensor([3, 0, 1]))
    assert same(before, snapshot(p))
    assert p.blocks_needed(rows, torch.tensor([3, 0, 1])).tolist() == [3, 1]
    assert not p.can_allocate(rows, torch.tensor([3, 0, 1]))
    assert p.can_allocate(rows, torch.tensor([2, 0, 2]))


def test_free_rows_frees_only_those_rows_and_the_sequence_stays():
    p = pools(blocks=8, block_size=2)
    p.add_sequence(3)
    rows = torch.arange(L * E)                                                  # every row of slot 0
    p.allocate_slots(rows, torch.tensor([3, 1, 2, 0, 4, 0, 1, 1]))
    freed = p.free_rows(torch.tensor([0, 4, 6]))       # rows 0, 4 on device 0 (2 + 2), row 6 on 1 (1)
    assert freed.tolist() == [4, 1]
    assert p.holds(3)
    assert p.token_counts([3])[0].reshape(-1).tolist() == [0, 1, 2, 0, 0, 0, 0, 1]
    p.assert_consistent()
    with pytest.raises(ValueError, match="distinct"):
        p.free_rows(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="not all rows of sequences"):
        p.free_rows(torch.tensor([L * E + 1]))                                  # slot 1: no sequence
    p.free(3)
    p.assert_no_leak()


def test_manager_free_rows_refuses_shared_tails_and_bad_rows():
    manager = KVCacheManager(L, E, 2, 10)
    manager.add_sequence(1)
    manager.allocate_slots(torch.tensor([0, 5]), torch.tensor([3, 1]))
    assert manager.free_rows(torch.tensor([0])) == 2
    assert manager.num_free_blocks == 9
    manager.assert_consistent()
    with pytest.raises(ValueError, match="not all rows"):
        manager.free_rows(torch.tensor([L * E]))
    shared = SharedTailKVCacheManager(L, E, 2, 10)
    shared.add_sequence(1)
    with pytest.raises(NotImplementedError):
        shared.free_rows(torch.tensor([0]))


def test_bad_placement_and_sizes_are_named():
    with pytest.raises(ValueError, match=r"device_of_expert must be \(E,\)"):
        DevicePools(L, E, 2, 4, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"names devices \[0, 1\]; allowed: 0..0"):
        DevicePools(L, E, 2, [4], place_experts(E, 2))


append = st.tuples(st.just("append"), st.integers(0, 2),
                   st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1), st.integers(0, 4)),
                            min_size=1, max_size=4))
operation = st.one_of(st.tuples(st.just("add"), st.integers(0, 2)), append, append,
                      st.tuples(st.just("free"), st.integers(0, 2)),
                      st.tuples(st.just("free_rows"), st.integers(0, 2),
                                st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)),
                                         min_size=1, max_size=3, unique=True)))


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), blocks=st.lists(st.integers(2, 12), min_size=D, max_size=D),
       placement=st.sampled_from(["contiguous", "round_robin"]), shuffle=st.booleans(),
       program=st.lists(operation, min_size=10, max_size=40))
def test_random_programs_keep_every_device_exact(block_size, blocks, placement, shuffle, program):
    p = pools(blocks, block_size, placement, 0 if shuffle else None)
    device_of_expert = place_experts(E, D, placement)
    model: dict[int, dict[tuple[int, int], int]] = {}          # seq -> (layer, expert) -> tokens

    def model_blocks(d):
        return sum(-(-n // block_size) for rows in model.values() for (l, e), n in rows.items()
                   if int(device_of_expert[e]) == d)

    for op in program:
        before = snapshot(p)
        if op[0] == "add":
            if op[1] in model:
                with pytest.raises(ValueError):
                    p.add_sequence(op[1])
            else:
                p.add_sequence(op[1])
                model[op[1]] = {}
        elif op[0] == "free":
            if op[1] in model:
                freed = p.free(op[1])
                expected = [sum(-(-n // block_size) for (l, e), n in model[op[1]].items()
                                if int(device_of_expert[e]) == d) for d in range(D)]
                assert freed.tolist() == expected
                del model[op[1]]
            else:
                with pytest.raises(KeyError):
                    p.free(op[1])
        elif op[0] == "free_rows":
            _, seq, pairs = op
            if seq not in model:
                continue
            rows = torch.cat([p.rows([seq], l, e) for l, e in pairs])
            p.free_rows(rows)
            for pair in pairs:
                model[seq].pop(pair, None)
        else:
            _, seq, appends = op
            if seq not in model:
                continue
            merged: dict[tuple[int, int], int] = {}
            for l, e, n in appends:
                merged[(l, e)] = merged.get((l, e), 0) + n
            rows = torch.cat([p.rows([seq], l, e) for l, e in merged])
            num_new = torch.tensor(list(merged.values()))
            after = {k: v for k, v in model[seq].items()}
            for key, n in merged.items():
                after[key] = after.get(key, 0) + n
            trial = {**model, seq: after}
            fits = all(sum(-(-n // block_size) for rows_ in trial.values() for (l, e), n in rows_.items()
                           if int(device_of_expert[e]) == d) <= blocks[d] for d in range(D))
            if fits:
                p.allocate_slots(rows, num_new)
                model[seq] = after
            else:
                with pytest.raises(OutOfBlocksError):
                    p.allocate_slots(rows, num_new)
                assert same(before, snapshot(p)), "a failed allocation changed a device"
        p.assert_consistent()
        for d in range(D):
            assert p.managers[d].pool.num_used_blocks == model_blocks(d)
        for seq, rows in model.items():
            counts = p.token_counts([seq])[0]
            for (l, e), n in rows.items():
                assert int(counts[l, e]) == n
            assert int(counts.sum()) == sum(rows.values())
    for seq in list(model):
        p.free(seq)
    p.assert_no_leak()
