"""The swap space's bookkeeping (integers only, no K/V): swap-out frees a sequence's device blocks
and names, row by row, the host blocks they go to; swap-in gives the same row counts back on new
device blocks, in the same row-by-row order; a swap that does not fit raises and changes nothing."""

import pytest
import torch

from moekv_ref.cache.block_pool import OutOfBlocksError
from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.engine.swap import SWAP_IN, SWAP_OUT, SwapSpace

L, E, P = 2, 3, 4


def sequence_with(manager, seq_id, counts):
    """Add a sequence whose (L*E,) rows hold `counts` tokens."""
    index = manager.add_sequence(seq_id)
    rows = manager.index.sequence_rows(torch.tensor([index]))[0]
    manager.allocate_slots(rows, torch.tensor(counts))


@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_swap_out_and_in_keep_the_row_counts_and_list_blocks_row_by_row(shuffle_seed):
    manager = KVCacheManager(L, E, P, num_blocks=20, shuffle_seed=shuffle_seed)
    swap = SwapSpace(manager, num_blocks=10)
    counts = [5, 0, 1, 4, 9, 0]  # 2 + 0 + 1 + 1 + 3 + 0 = 7 blocks
    sequence_with(manager, 0, counts)
    sequence_with(manager, 1, [1] * 6)  # another sequence, so that ids are not trivial
    device_blocks = manager.blocks_of_sequence(0)
    assert swap.can_swap_out(0)
    copy = swap.swap_out(0)
    assert copy.direction == SWAP_OUT
    assert copy.source.tolist() == device_blocks.tolist() and copy.destination.tolist() == list(range(7))
    assert 0 not in manager.sequences and manager.num_free_blocks == 20 - 6
    assert swap.swapped[0].host_block_ids.numel() == 7
    assert swap.token_counts(0).reshape(-1).tolist() == counts
    expected_new = manager.pool.free_block_ids()[:7].tolist()  # next out of the free queue, in order
    copy = swap.swap_in(0)
    assert copy.direction == SWAP_IN and copy.source.tolist() == list(range(7))
    assert copy.destination.tolist() == manager.blocks_of_sequence(0).tolist() == expected_new
    assert manager.token_counts([0])[0].reshape(-1).tolist() == counts
    assert swap.pool.num_used_blocks == 0 and not swap.swapped
    manager.assert_consistent()


def test_a_swap_that_does_not_fit_raises_and_changes_nothing():
    manager = KVCacheManager(L, E, P, num_blocks=12)
    swap = SwapSpace(manager, num_blocks=3)
    sequence_with(manager, 0, [8, 8, 0, 0, 0, 0])  # 4 blocks: more than the swap space
    assert not swap.can_swap_out(0)
    with pytest.raises(OutOfBlocksError):
        swap.swap_out(0)
    assert manager.blocks_of_sequence(0).numel() == 4 and swap.pool.num_free_blocks == 3
    sequence_with(manager, 1, [4, 0, 0, 0, 0, 0])
    swap.swap_out(1)  # 1 block out
    sequence_with(manager, 2, [32, 0, 0, 0, 0, 0])  # 8 blocks: the device pool is full again
    with pytest.raises(RuntimeError, match="needs 1 blocks on device 0, 0 free there"):
        swap.swap_in(1)
    assert 1 in swap.swapped and 1 not in manager.sequences
    manager.assert_consistent()


def test_a_swap_in_short_on_one_device_raises_and_changes_nothing():
    """Two devices: enough free blocks in all, but not on the device the sequence's rows live on.
    swap_in raises RuntimeError (as its docstring says) before adding the sequence or taking a block."""
    manager = KVCacheManager(L, E, P, blocks_per_device=[6, 6], device_of_expert=[0, 1, 1])
    swap = SwapSpace(manager, num_blocks=8)
    sequence_with(manager, 0, [8, 0, 0, 4, 0, 0])  # 3 blocks, all on device 0 (expert 0)
    swap.swap_out(0)
    sequence_with(manager, 1, [16, 0, 0, 4, 0, 0])  # 5 blocks on device 0: 1 free there, 6 on device 1
    free = manager.num_free_blocks_per_device.tolist()
    with pytest.raises(RuntimeError, match="needs 3 blocks on device 0, 1 free there"):
        swap.swap_in(0)
    assert 0 in swap.swapped and 0 not in manager.sequences
    assert manager.num_free_blocks_per_device.tolist() == free
    manager.assert_consistent()


def test_swap_space_size_must_be_a_positive_integer():
    manager = KVCacheManager(L, E, P, num_blocks=12)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="swap space num_blocks"):
            SwapSpace(manager, bad)
