"""The block pool: physical KV blocks, their reference counts and the free block queue.

A block is P token slots of K and V for one attention expert's head group. Every (sequence, layer,
expert) row of the cache takes its blocks from this one pool, so the irregular demand of many experts
becomes whole blocks from one free list: a free block can serve any row, and there is no external
fragmentation.

This module knows nothing about rows, sequences or tensors of K/V: it hands out block ids and takes
them back. The KV cache manager (kv_cache_manager.py) owns the block tables.

Invariants, after every public call:
  * every block id in [0, num_blocks) is either free (ref_cnt == 0, exactly once in the free queue)
    or in use (ref_cnt >= 1, not in the free queue): num_free_blocks + num_used_blocks == num_blocks;
  * a call that raises leaves the pool exactly as it was.

Why the free queue is a tensor stack and not vLLM's doubly linked list: vLLM must remove blocks from
the middle of its queue when a cached prefix is hit again (prefix caching). We do not cache prefixes,
so blocks only enter and leave at one end, and a stack held in a tensor lets `allocate(n)` take n
blocks with one slice -- the simulator allocates thousands of blocks per step. Freed blocks are
reused last-in first-out: the most recently freed blocks are the ones most likely still in a cache.
"""

from __future__ import annotations

import torch


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Not a bug: a scheduler checks
    `can_allocate` first and preempts a sequence when memory is short."""


class BlockPool:
    """`num_blocks` block ids, a free block queue and a reference count per block.

    shuffle_seed: when given, the free queue starts in a random order, so the blocks of one row are
    scattered over the pool (tests use it to show that nothing depends on blocks being adjacent).
    """

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} is not allowed: it must be a positive integer")
        self.num_blocks = num_blocks
        if shuffle_seed is None:
            order = torch.arange(num_blocks, dtype=torch.int64)
        else:
            generator = torch.Generator().manual_seed(shuffle_seed)
            order = torch.randperm(num_blocks, generator=generator)
        # The free queue: _free_stack[:_num_free] are the free block ids; allocation pops from the end.
        # Stored reversed so that an unshuffled pool hands out 0, 1, 2, ... in that order.
        self._free_stack = order.flip(0).clone()                       # (N,) int64
        self._num_free = num_blocks
        self.ref_cnt = torch.zeros(num_blocks, dtype=torch.int32)      # (N,) owners of each block

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def free_block_ids(self) -> torch.Tensor:
        """The free block queue, next to be handed out first. (num_free,) int64, a copy."""
        return self._free_stack[: self._num_free].flip(0).clone()

    # ----- allocate / free -----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> torch.Tensor:
        """Take `num_blocks` blocks from the free queue, each with ref_cnt 1. Returns (num_blocks,)
        int64 block ids, in the order they were handed out."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self._num_free:
            raise OutOfBlocksError(
                f"need {num_blocks} blocks but only {self._num_free} of {self.num_blocks} are free"
            )
        top = self._num_free
        block_ids = self._free_stack[top - num_blocks: top].flip(0).clone()
        self._num_free = top - num_blocks
        self.ref_cnt[block_ids] = 1
        return block_ids

    def incref(self, block_ids: torch.Tensor) -> None:
        """Add an owner to blocks already in use (sharing, e.g. a forked sequence)."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("incref of a free block: only blocks in use can gain an owner")
        self.ref_cnt.index_add_(0, block_ids, torch.ones_like(block_ids, dtype=torch.int32))

    def free(self, block_ids: torch.Tensor) -> None:
        """Drop one owner of each block; blocks left with no owner go back to the free queue.

        A block may appear several times (once per owner being dropped). Raises ValueError, with the
        pool unchanged, if that would drop more owners than a block has (a double free)."""
        block_ids = self._checked_ids(block_ids)
        if block_ids.numel() == 0:
            return
        # work over the distinct blocks given, not over the whole pool: freeing a sequence touches
        # a few thousand blocks of a pool that may hold millions
        unique_ids, inverse, drops = torch.unique(block_ids, return_inverse=True, return_counts=True)
        owners = self.ref_cnt[unique_ids]                                             # (u,)
        over = (drops > owners).nonzero().squeeze(1)
        if over.numel():
            i = int(over[0])
            raise ValueError(
                f"block {int(unique_ids[i])} is freed {int(drops[i])} time(s) but has ref_cnt "
                f"{int(owners[i])}: a double free (pool unchanged)"
            )
        remaining = owners - drops.to(torch.int32)
        self.ref_cnt[unique_ids] = remaining
        # Push the released blocks in the order given (first occurrence), so that the block freed
        # last is the first handed out again.
        first = torch.full((unique_ids.numel(),), block_ids.numel(), dtype=torch.int64)
        first = first.scatter_reduce(0, inverse, torch.arange(block_ids.numel()), reduce="amin")
        released = (remaining == 0).nonzero().squeeze(1)                              # (r,)
        released = unique_ids[released[first[released].argsort()]]
        top = self._num_free
        self._free_stack[top: top + released.numel()] = released
        self._num_free = top + released.numel()

    def _checked_ids(self, block_ids) -> torch.Tensor:
        block_ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
        if block_ids.numel() and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(
                f"block ids must be in [0, {self.num_blocks}), got "
                f"[{int(block_ids.min())}, {int(block_ids.max())}]"
            )
        return block_ids

    # ----- checking --------------------------------------------------------------------------------
    def assert_consistent(self) -> None:
        """Check the invariants in the module docstring; raise AssertionError naming the broken one."""
        free = self._free_stack[: self._num_free]
        assert free.unique().numel() == free.numel(), "a block is in the free queue twice"
        assert (self.ref_cnt[free] == 0).all(), "a block in the free queue has owners"
        assert (self.ref_cnt >= 0).all(), "negative ref_cnt"
        num_used = int((self.ref_cnt > 0).sum())
        assert num_used + self._num_free == self.num_blocks, (
            f"leak: {num_used} used + {self._num_free} free != {self.num_blocks} blocks"
        )
