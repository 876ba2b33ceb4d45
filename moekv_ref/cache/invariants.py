"""The invariants of the pool and the manager, as the property tests check them (`assert_consistent`
of each class calls these; a subclass adds its own checks after them). Each failed check raises
AssertionError naming the invariant it broke.
"""

from __future__ import annotations

import torch


def check_no_inference_tensors(pool) -> None:
    """No tensor of the pool's state is an inference tensor (block_pool.py's docstring)."""
    inference = [
        name
        for name in pool.STATE
        if isinstance(getattr(pool, name), torch.Tensor) and getattr(pool, name).is_inference()
    ]
    assert not inference, (
        f"{inference} are inference tensors: changed in place outside inference mode, they raise"
    )


def check_pool(pool) -> None:
    """Each block is free (on its own device's stack, or another free queue) or in use (ref_cnt >= 1),
    never both, never twice; none is lost."""
    check_no_inference_tensors(pool)
    for d, stack in enumerate(pool.free_stacks()):
        assert (pool.device_of_blocks(stack) == d).all(), (
            f"device {d}'s free stack holds a block of another device"
        )
    free = pool.free_block_ids()
    assert int(torch.bincount(free, minlength=pool.num_blocks).max()) <= 1, (
        "a block is in the free queues twice"
    )
    assert (pool.ref_cnt[free] == 0).all(), "a block in a free queue has owners"
    assert (pool.ref_cnt >= 0).all(), "negative ref_cnt"
    num_used = int((pool.ref_cnt > 0).sum())
    assert num_used + free.numel() == pool.num_blocks, (
        f"leak: {num_used} used + {free.numel()} free != {pool.num_blocks} blocks"
    )


def check_row_counts(manager) -> None:
    """Sequence slots held as the sequences say, and no tokens in a free slot."""
    live = torch.zeros(manager.slot_held.numel(), dtype=torch.bool)
    live[manager.seq_slots(manager.sequences)] = True
    assert torch.equal(manager.slot_held, live), "slot_held does not follow the sequences held"
    idle_rows = (~live).repeat_interleave(manager.rows_per_seq)
    assert (manager.row_tokens[idle_rows] == 0).all(), "a free sequence slot holds tokens"


def check_block_tables(manager, also_owned: torch.Tensor | None = None, shared: bool = False) -> None:
    """Each row's used table entries list blocks of its device, the rest padding; ref_cnt counts each
    block's owners; owned and free blocks make the pool. also_owned: blocks a manager owns outside
    its tables (shared tails'); shared=True: a block may be listed by several rows (prefix hits)."""
    used = manager.used_columns()  # (R, W)
    owned = manager.block_tables[used].to(torch.int64)
    assert (owned < manager.num_blocks).all(), "a row's used table entry is padding"
    # every used entry is a block, so tables with as many set entries as used ones have the rest
    # padding (one count over the tables, not a pass over the unused entries)
    assert int(torch.count_nonzero(manager.block_tables != manager.pad)) == owned.numel(), (
        "a table entry past a row's blocks is set"
    )
    assert torch.equal(manager.pool.device_of_blocks(owned), manager.device_of_rows(used.nonzero()[:, 0])), (
        "a row holds a block of another device than its own"
    )
    if also_owned is not None:
        owned = torch.cat([owned, also_owned])
    distinct = owned.unique()
    assert shared or distinct.numel() == owned.numel(), "a block is owned by two rows (or twice)"
    owners = torch.bincount(owned, minlength=manager.num_blocks)
    assert torch.equal(owners.to(torch.int32), manager.pool.ref_cnt), "ref_cnt != number of owners"
    assert distinct.numel() + manager.pool.num_free_blocks == manager.num_blocks, "free + owned != total"
