"""CachingBlockPool: a BlockPool (block_pool.py) whose free blocks may keep a known prefix.

What it adds to the plain pool, for prefix caching (prefix_caching_manager.py): a block in use can
be marked as holding a full block of a known prefix (`mark_cached`). Freed, such a block does not go
back onto its device's stack but waits in the device's cached-free queue, in LRU order, so that a
later request with the same prefix can take it back (`reuse`, a prefix hit). `allocate` evicts a
device's cached-free blocks, LRU first, only when its stack is empty, and tells the eviction
listener which left (`listen_for_evictions`: the prefix cache forgets their keys); `uncache` moves
a cached-free block whose keys another block took over back onto the plain stack.

Why not vLLM's doubly linked free list: most blocks are never cached, so they enter and leave at
one end (the plain pool's stacks); only cached blocks need LRU order and removal from the middle
(an OrderedDict per device).

Invariants (`assert_consistent`, beside the plain pool's): each free block is on its device's stack
(not cached) or in its device's cached-free queue (cached), never both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from .block_pool import BlockPool
from .options import check_counts_per_device, check_pool_device


class CachingBlockPool(BlockPool):
    """BlockPool with a cached-free LRU queue per device (module docstring)."""

    STATE = (*BlockPool.STATE, "is_cached", "_cached_free", "num_evicted_cached_blocks")

    def _make_block_state(self, shuffle_seed: int | None) -> None:
        super()._make_block_state(shuffle_seed)
        self.is_cached = torch.zeros(self.num_blocks, dtype=torch.bool)  # (N,) holds a known prefix
        self._cached_free: list[OrderedDict[int, None]] = [OrderedDict() for _ in self._device_sizes]
        self._on_evict: Callable[[list[int]], None] | None = None  # told which cached blocks left
        self.num_evicted_cached_blocks = 0

    def listen_for_evictions(self, callback: Callable[[list[int]], None]) -> None:
        """callback(block_ids) is told which cached-free blocks an allocation evicted (the prefix
        cache forgets their keys)."""
        self._on_evict = callback

    num_cached_free_blocks = property(lambda self: sum(map(len, self._cached_free)))

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        """Plain free and cached free blocks of each device: both can be handed out."""
        cached = torch.tensor([len(queue) for queue in self._cached_free], dtype=torch.int64)
        return self._num_free + cached

    def cached_free_block_ids(self, device: int | None = None) -> list[int]:
        """The cached free blocks of `device` (None: all), in eviction order."""
        queues = (
            self._cached_free
            if device is None
            else [self._cached_free[check_pool_device(device, self.num_devices)]]
        )
        return [block for queue in queues for block in queue]

    def free_block_ids(self) -> torch.Tensor:
        """The free blocks, device by device, in the order handed out: stack, then cached ones."""
        queues = []
        for stack, cached in zip(self.free_stacks(), self._cached_free):
            queues += [stack.flip(0), torch.tensor(list(cached), dtype=torch.int64)]
        return torch.cat(queues)

    def allocate_per_device(self, num_blocks: torch.Tensor) -> torch.Tensor:
        """BlockPool.allocate_per_device, each device evicting its cached-free blocks, LRU first,
        once its stack is empty; the ids device after device, each device's stack ones first."""
        num_blocks = check_counts_per_device(num_blocks, self.num_devices)
        self.check_free(num_blocks)
        on_stack = torch.minimum(num_blocks, self._num_free)  # (D,)
        from_stack = super().allocate_per_device(on_stack)
        if bool((on_stack == num_blocks).all()):
            return from_stack
        parts = []
        for d, (stack, n) in enumerate(
            zip(from_stack.split(on_stack.tolist()), (num_blocks - on_stack).tolist())
        ):
            evicted = [self._cached_free[d].popitem(last=False)[0] for _ in range(n)]
            if evicted:
                self.is_cached[evicted] = False
                self.num_evicted_cached_blocks += len(evicted)
                if self._on_evict is not None:
                    self._on_evict(evicted)
                self.ref_cnt[evicted] = 1
            parts += [stack, torch.tensor(evicted, dtype=torch.int64)]
        return torch.cat(parts)

    def _push(self, released: torch.Tensor) -> None:
        """Released cached blocks join the end of their device's LRU queue; the rest their stack."""
        cached = self.is_cached[released]
        for block, device in zip(released[cached].tolist(), self._device_of(released[cached]).tolist()):
            self._cached_free[device][block] = None  # most recently used: the end of its LRU queue
        super()._push(released[~cached])

    def mark_cached(self, block_ids) -> None:
        """Blocks in use that now hold a full block of a known prefix: freed, they wait in their
        device's cached-free queue instead of its stack."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("mark_cached of a free block: only blocks in use are registered")
        self.is_cached[block_ids] = True

    def uncache(self, block_ids) -> None:
        """Cached-free blocks that no longer hold a known prefix (another block took over their
        keys): back onto their device's plain stack, as any free block."""
        block_ids = self._checked_ids(block_ids)
        if not bool((self.is_cached[block_ids] & (self.ref_cnt[block_ids] == 0)).all()):
            raise ValueError("uncache: only cached-free blocks (held by no sequence) can be uncached")
        for block, device in zip(block_ids.tolist(), self._device_of(block_ids).tolist()):
            del self._cached_free[device][block]
        self.is_cached[block_ids] = False
        self.ref_cnt[block_ids] += 1  # held for a moment, then freed onto the plain stack
        self.free(block_ids)

    def reuse(self, block_ids) -> None:
        """One more owner for each distinct cached block (a prefix hit); cached-free ones leave the
        LRU queue."""
        block_ids = self._checked_ids(block_ids)
        if block_ids.unique().numel() != block_ids.numel():
            raise ValueError("reuse: block ids must be distinct")
        if not self.is_cached[block_ids].all():
            bad = int(block_ids[~self.is_cached[block_ids]][0])
            raise ValueError(f"reuse of block {bad}, which holds no cached prefix")
        idle = block_ids[self.ref_cnt[block_ids] == 0]
        for block, device in zip(idle.tolist(), self._device_of(idle).tolist()):
            del self._cached_free[device][block]
        self.ref_cnt[block_ids] += 1

    def assert_consistent(self) -> None:
        """BlockPool's invariants over stacks and queues, and the cached flags that sort them."""
        super().assert_consistent()
        for d, queue in enumerate(self._cached_free):
            ids = torch.tensor(list(queue), dtype=torch.int64)
            assert (self._device_of(ids) == d).all(), (
                f"device {d}'s cached-free queue holds a block of another device"
            )
            assert self.is_cached[ids].all(), "a block in the cached-free queue is not cached"
        stacks = torch.cat(self.free_stacks())
        assert not self.is_cached[stacks].any(), "a cached block is in the plain free stack"
