"""The block pool: physical KV blocks, their reference counts and the free block queues.

A block is P token slots of K and V for one attention expert's head group. Every (sequence, layer,
expert) row takes blocks from this one pool, so any free block serves any row (no external
fragmentation). The pool only hands out and takes back ids; kv_cache_manager.py owns block tables.

With D devices (`blocks_per_device=[N0, N1, ...]`), device d's ids are one contiguous range,
[0, N0), [N0, N0 + N1), ...: block tables, slots, the paged cache's tensors and the Triton kernels
stay as they are, and only which free block a row gets changes (`allocate(n, device=d)`; d can be
full while others are empty). On hardware each range is its own device's memory; here, a slice.

Free blocks are, per device, plain (a LIFO stack) or cached (holding a full block of a known
prefix, prefix_cache.py: an LRU queue). `allocate` evicts d's cached-free blocks, LRU first and
told to the eviction listener (`listen_for_evictions`), only when d's stack is empty; `reuse` takes
a cached block back (a prefix hit). Why
not vLLM's doubly linked free list: most blocks are never cached, so they enter and leave at one
end, and a tensor stack hands out n blocks with one slice (the simulator allocates thousands per
step); only cached blocks need LRU order and removal from the middle (an OrderedDict). LIFO reuses
the most recently freed blocks, likeliest in a hardware cache.

Invariants (`assert_consistent`): each block is plain free, cached free or in use (ref_cnt >= 1),
on its own device's queue; a call that raises changes nothing; ids and counts must be integers (a
float, even 1.0, or a bool is never rounded or read as 0 / 1); no tensor of the pool is an inference
tensor. The engine's forward runs in inference mode and allocates there (engine/model_runner.py),
and an inference tensor cannot be changed in place outside it: so the pool's tensors are made
outside inference mode, whatever the caller's, and a call changes them in place, never replacing
one with a new tensor (which, made inside the forward, would be an inference tensor).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from ..state import Stateful
from ..validation import (
    MAX_BLOCKS,
    check_blocks_per_device,
    check_fits_memory,
    check_ids,
    check_int,
    check_seed,
    known_keywords,
    preview,
    shown,
)
from .rows import stable_order

# bytes the pool's own tensors take per block: a free-stack entry (8), a ref count (4), a cached flag (1)
BYTES_PER_BLOCK = 13


def check_pool_size(num_blocks, blocks_per_device, meaning: str = "the pool's blocks") -> list[int]:
    """The pool's blocks per device: [num_blocks] (one device), or blocks_per_device (num_blocks, if
    given too, their sum), each a count of MAX_BLOCKS at most in all, whose bookkeeping fits the
    machine; ValueError naming the bad value before anything is allocated. `meaning`: what a
    message says num_blocks is."""
    if blocks_per_device is None:
        sizes = [check_int("num_blocks", num_blocks, 1, MAX_BLOCKS, meaning)]
    else:
        sizes = check_blocks_per_device(blocks_per_device)
        if num_blocks is not None and num_blocks != sum(sizes):
            raise ValueError(f"num_blocks={shown(num_blocks)} must equal sum(blocks_per_device)={sum(sizes)}")
    check_pool_fits(sum(sizes))
    return sizes


def check_pool_fits(num_blocks: int) -> None:
    """ValueError when the pool's own tensors for num_blocks blocks would not fit the machine."""
    check_fits_memory(
        f"the bookkeeping of a pool of {num_blocks:,} blocks",
        BYTES_PER_BLOCK * num_blocks,
        "cpu",
        "ask for fewer blocks",
    )


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Not a bug: a scheduler checks
    `can_allocate` first and preempts a sequence when memory is short, or (optimistic reservation)
    undoes the step and retries it with `shortfall` more blocks freed: (D,) blocks missing per
    device, where the manager knows them (None otherwise)."""

    def __init__(self, message: str, shortfall=None):
        super().__init__(message)
        self.shortfall = shortfall


class BlockPool(Stateful):
    """Block ids of D devices (num_blocks: one), a free block queue per device and a reference
    count per block. shuffle_seed: each device's queue starts in a random order (device d's seed
    is shuffle_seed + d): tests use it to show nothing depends on a row's blocks being adjacent."""

    STATE = (
        "_free_stack",
        "_num_free",
        "ref_cnt",
        "is_cached",
        "_cached_free",
        "_any_cached",
        "num_evicted_cached_blocks",
    )

    @known_keywords
    @torch.inference_mode(False)  # kept across steps: never inference tensors (module docstring)
    def __init__(
        self,
        num_blocks: int | None = None,
        shuffle_seed: int | None = None,
        blocks_per_device=None,
        checked: bool = False,
    ):
        """checked=True: the caller (a manager) checked the arguments with check_pool_size and
        check_seed; blocks_per_device is then a list of ints, or None for [num_blocks]."""
        if not checked:
            blocks_per_device = check_pool_size(num_blocks, blocks_per_device)
            shuffle_seed = check_seed("shuffle_seed", shuffle_seed, len(blocks_per_device), allow_none=True)
        elif blocks_per_device is None:
            blocks_per_device = [num_blocks]
        num_devices = len(blocks_per_device)
        self.num_blocks = sum(blocks_per_device)
        self._device_sizes = blocks_per_device  # (D,)
        first_blocks = [sum(blocks_per_device[:d]) for d in range(num_devices)]
        self._first_blocks = torch.tensor(first_blocks, dtype=torch.int64)  # (D,) device d's first id
        # devices of one size (the usual case): a block's device is a division, not a search
        self._equal_size = blocks_per_device[0] if len(set(blocks_per_device)) == 1 else None
        # (D,) plain free blocks per device: a tensor, since the simulator asks for all D each step
        self._num_free = torch.tensor(blocks_per_device, dtype=torch.int64)
        self._make_block_state(shuffle_seed)
        self._cached_free: list[OrderedDict[int, None]] = [OrderedDict() for _ in blocks_per_device]
        self._any_cached = False  # a block was ever marked: `free` must sort released ones
        self._on_evict: Callable[[list[int]], None] | None = None  # told which cached blocks left
        self.num_evicted_cached_blocks = 0

    def _make_block_state(self, shuffle_seed: int | None) -> None:
        """The state kept per block: each device's free stack, a reference count and a cached flag.
        Device d's plain free ids are _free_stack[first : first + _num_free[d]], first =
        _first_blocks[d], popped from the end; stored reversed, so that an unshuffled device hands
        out its ids in increasing order."""
        self._free_stack = torch.empty(self.num_blocks, dtype=torch.int64)  # (N,)
        for d, (first, size) in enumerate(zip(self._first_blocks.tolist(), self._device_sizes)):
            order = (
                torch.arange(size)
                if shuffle_seed is None
                else torch.randperm(size, generator=torch.Generator().manual_seed(shuffle_seed + d))
            )
            self._free_stack[first : first + size] = order.flip(0) + first
        self.ref_cnt = torch.zeros(self.num_blocks, dtype=torch.int32)  # (N,) owners of each block
        # prefix caching only: which blocks hold a known prefix (each device's LRU queue: _cached_free)
        self.is_cached = torch.zeros(self.num_blocks, dtype=torch.bool)  # (N,)

    def listen_for_evictions(self, callback: Callable[[list[int]], None]) -> None:
        """callback(block_ids) is told which cached-free blocks an allocation evicted (the prefix
        cache forgets their keys)."""
        self._on_evict = callback

    # ----- queries -------------------------------------------------------------------------------
    num_devices = property(lambda self: len(self._device_sizes))
    blocks_per_device = property(lambda self: torch.tensor(self._device_sizes, dtype=torch.int64))
    num_cached_free_blocks = property(lambda self: sum(map(len, self._cached_free)))

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out, over all devices: plain free and cached free."""
        return int(self._num_free.sum()) + self.num_cached_free_blocks

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        if not self._any_cached:
            return self._num_free.clone()
        return self._num_free + torch.tensor([len(cached) for cached in self._cached_free], dtype=torch.int64)

    def cached_free_block_ids(self, device: int | None = None) -> list[int]:
        """The cached free blocks of `device` (None: all), in eviction order."""
        queues = self._cached_free if device is None else [self._cached_free[self._checked_device(device)]]
        return [block for queue in queues for block in queue]

    @property
    def num_used_blocks(self) -> int:
        """Blocks with an owner (cached-free blocks are free: `allocate` may evict them)."""
        return self.num_blocks - self.num_free_blocks

    def device_of_blocks(self, block_ids) -> torch.Tensor:
        return self._device_of(self._checked_ids(block_ids))

    def free_block_ids(self) -> torch.Tensor:
        """The free blocks, device by device, in the order handed out: stack, then cached ones."""
        queues = []
        for first, n, cached in zip(self._first_blocks.tolist(), self._num_free.tolist(), self._cached_free):
            queues += [
                self._free_stack[first : first + n].flip(0),
                torch.tensor(list(cached), dtype=torch.int64),
            ]
        return torch.cat(queues)

    # ----- allocate / free -----------------------------------------------------------------------
    def allocate(self, num_blocks: int, device: int | None = None) -> torch.Tensor:
        """Take `num_blocks` blocks of `device` (left out on a one-device pool only), each with
        ref_cnt 1, in the order handed out; OutOfBlocksError, changing nothing, when short."""
        device = self._checked_device(device)
        num_blocks = check_int("num_blocks", num_blocks, 0)
        cached_here = self._cached_free[device]
        on_stack = int(self._num_free[device])
        free_here = on_stack + len(cached_here)
        if num_blocks > free_here:
            if self.num_devices == 1:
                raise OutOfBlocksError(
                    f"need {num_blocks} blocks but only {self.num_free_blocks} of {self.num_blocks} are free"
                )
            raise OutOfBlocksError(
                f"device {device} is short: need {num_blocks} blocks, "
                f"{free_here} of {self._device_sizes[device]} are free"
            )
        top = int(self._first_blocks[device]) + on_stack
        from_stack = min(num_blocks, on_stack)
        block_ids = self._free_stack[top - from_stack : top].flip(0).clone()
        self._num_free[device] -= from_stack
        if num_blocks > from_stack:  # evict this device's cached-free blocks, LRU first
            evicted = [cached_here.popitem(last=False)[0] for _ in range(num_blocks - from_stack)]
            self.is_cached[evicted] = False
            self.num_evicted_cached_blocks += len(evicted)
            if self._on_evict is not None:
                self._on_evict(evicted)
            block_ids = torch.cat([block_ids, torch.tensor(evicted, dtype=torch.int64)])
        self.ref_cnt[block_ids] = 1
        return block_ids

    def allocate_per_device(self, num_blocks: torch.Tensor) -> torch.Tensor:
        """num_blocks (D,): `allocate(num_blocks[d], device=d)` for every device at once, the ids
        device after device; OutOfBlocksError, changing nothing, when one is short. One gather from
        the stacks where no device reaches into its cached-free blocks (the simulator's thousands of
        blocks a step over 64 devices)."""
        num_blocks = self._checked_counts(num_blocks)
        self._check_free(num_blocks)
        if self._any_cached and not bool((num_blocks <= self._num_free).all()):
            parts = [self.allocate(n, device=d) for d, n in enumerate(num_blocks.tolist()) if n]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        device = torch.repeat_interleave(torch.arange(self.num_devices), num_blocks)  # (n,)
        rank = torch.arange(device.numel()) - (torch.cumsum(num_blocks, 0) - num_blocks)[device]
        top = self._first_blocks + self._num_free  # (D,)
        block_ids = self._free_stack[top[device] - 1 - rank]  # popped from the end, as allocate does
        self._num_free -= num_blocks
        self.ref_cnt[block_ids] = 1
        return block_ids

    def mark_cached(self, block_ids) -> None:
        """Blocks in use that now hold a full block of a known prefix: freed, they wait in their
        device's cached-free queue instead of its stack."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("mark_cached of a free block: only blocks in use are registered")
        self.is_cached[block_ids] = True
        self._any_cached = True

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

    def incref(self, block_ids: torch.Tensor) -> None:
        """Add an owner to blocks already in use (sharing, e.g. a forked sequence)."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("incref of a free block: only blocks in use can gain an owner")
        self.ref_cnt.index_add_(0, block_ids, torch.ones_like(block_ids, dtype=torch.int32))

    def free(self, block_ids: torch.Tensor, distinct: bool = False) -> None:
        """Drop one owner per occurrence of each block; blocks left with none go back to their
        device's free queue. ValueError, pool unchanged, for a double free. distinct=True: the
        caller's ids are distinct (a sequence's blocks), which skips finding the repeated ones
        (three sorts of a few thousand ids, most of a finished request's cost in the simulator)."""
        block_ids = self._checked_ids(block_ids)
        if block_ids.numel() == 0:
            return
        # work over the distinct blocks given, not the whole pool: freeing a sequence touches a few
        # thousand blocks of a pool that may hold millions
        if distinct:
            unique_ids = block_ids
            drops = torch.ones_like(block_ids)
        else:
            unique_ids, inverse, drops = torch.unique(block_ids, return_inverse=True, return_counts=True)
        owners = self.ref_cnt[unique_ids]  # (u,)
        over = (drops > owners).nonzero().squeeze(1)
        if over.numel():
            i = int(over[0])
            raise ValueError(
                f"block {int(unique_ids[i])} is freed {int(drops[i])} time(s) but has "
                f"ref_cnt {int(owners[i])}: a double free (pool unchanged)"
            )
        remaining = owners - drops.to(torch.int32)
        self.ref_cnt[unique_ids] = remaining
        # push the released blocks in the order given (first occurrence): the block freed last is
        # the first handed out again
        released = (remaining == 0).nonzero().squeeze(1)  # (r,)
        if distinct:
            released = unique_ids[released]
        else:
            first = torch.full((unique_ids.numel(),), block_ids.numel(), dtype=torch.int64)
            first = first.scatter_reduce(0, inverse, torch.arange(block_ids.numel()), reduce="amin")
            released = unique_ids[released[first[released].argsort()]]
        if self._any_cached:
            cached = self.is_cached[released]
            for block, device in zip(released[cached].tolist(), self._device_of(released[cached]).tolist()):
                self._cached_free[device][block] = None  # most recently used: the end of its LRU queue
            released = released[~cached]
        # each device's onto its own stack, in order: one scatter, not a pass per device
        device = self._device_of(released)  # (r,)
        if not bool((device[1:] >= device[:-1]).all()):  # not yet grouped by device (as a sequence's are)
            order = stable_order(device)
            released = released[order]
            device = device[order]
        per_device = torch.bincount(device, minlength=self.num_devices)  # (D,)
        top = self._first_blocks + self._num_free  # (D,)
        rank = torch.arange(released.numel()) - (torch.cumsum(per_device, 0) - per_device)[device]
        self._free_stack[top[device] + rank] = released
        self._num_free += per_device

    def _device_of(self, block_ids: torch.Tensor) -> torch.Tensor:
        if self._equal_size is not None:
            return block_ids // self._equal_size
        return torch.searchsorted(self._first_blocks, block_ids, right=True) - 1

    def _checked_device(self, device) -> int:
        """device as an int in [0, D), or ValueError (TypeError when left out on several devices)."""
        if device is None:
            if self.num_devices > 1:
                raise TypeError(
                    f"allocate on a pool of {self.num_devices} devices needs a device: "
                    "allocate(num_blocks, device=d)"
                )
            return 0
        return check_int("device", device, 0, self.num_devices - 1, "a device of this pool")

    def _checked_counts(self, num_blocks) -> torch.Tensor:
        """num_blocks as (D,) int64 counts >= 0, one per device, or ValueError."""
        num_blocks = check_ids(num_blocks, "num_blocks")
        if num_blocks.shape != (self.num_devices,) or bool((num_blocks < 0).any()):
            raise ValueError(
                f"num_blocks={preview(num_blocks)} must be ({self.num_devices},) counts >= 0, one per device"
            )
        return num_blocks

    def _check_free(self, num_blocks: torch.Tensor) -> None:
        """OutOfBlocksError naming the first device with fewer free blocks than num_blocks (D,)."""
        free = self.num_free_blocks_per_device  # (D,)
        if not bool((num_blocks <= free).all()):
            d = int((num_blocks > free).nonzero()[0])
            raise OutOfBlocksError(
                f"device {d} is short: need {int(num_blocks[d])} blocks, {int(free[d])} of "
                f"{self._device_sizes[d]} are free"
            )

    def _checked_ids(self, block_ids) -> torch.Tensor:
        """block_ids as 1-D int64 ids of this pool, or ValueError."""
        block_ids = check_ids(block_ids, "block_ids").reshape(-1)
        if block_ids.numel() and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(
                f"block ids must be in [0, {self.num_blocks}), got "
                f"[{int(block_ids.min())}, {int(block_ids.max())}]"
            )
        return block_ids

    def _assert_no_inference_tensors(self) -> None:
        """No tensor of the pool's state is an inference tensor (module docstring)."""
        inference = [
            name
            for name in self.STATE
            if isinstance(getattr(self, name), torch.Tensor) and getattr(self, name).is_inference()
        ]
        assert not inference, (
            f"{inference} are inference tensors: changed in place outside inference mode, they raise"
        )

    def assert_consistent(self) -> None:
        """The invariants of the module docstring; AssertionError names the broken one."""
        self._assert_no_inference_tensors()
        stacks = [
            self._free_stack[first : first + n]
            for first, n in zip(self._first_blocks.tolist(), self._num_free.tolist())
        ]
        queues = [torch.tensor(list(queue), dtype=torch.int64) for queue in self._cached_free]
        for d, (stack, queue) in enumerate(zip(stacks, queues)):
            assert (self._device_of(stack) == d).all(), (
                f"device {d}'s free stack holds a block of another device"
            )
            assert (self._device_of(queue) == d).all(), (
                f"device {d}'s cached-free queue holds a block of another device"
            )
        stack, cached = torch.cat(stacks), torch.cat(queues)
        free = torch.cat([stack, cached])
        assert int(torch.bincount(free, minlength=self.num_blocks).max()) <= 1, (
            "a block is in the free queues twice"
        )
        assert (self.ref_cnt[free] == 0).all(), "a block in a free queue has owners"
        assert not self.is_cached[stack].any(), "a cached block is in the plain free stack"
        assert self.is_cached[cached].all(), "a block in the cached-free queue is not cached"
        assert (self.ref_cnt >= 0).all(), "negative ref_cnt"
        num_used = int((self.ref_cnt > 0).sum())
        assert num_used + free.numel() == self.num_blocks, (
            f"leak: {num_used} used + {free.numel()} free != {self.num_blocks} blocks"
        )
