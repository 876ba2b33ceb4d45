"""The block pool: physical KV blocks, their reference counts and the free block queue.

A block is P token slots of K and V for one attention expert's head group. Every (sequence, layer,
expert) row of the cache takes its blocks from this one pool, so the irregular demand of many experts
becomes whole blocks from one free list: a free block can serve any row, and there is no external
fragmentation.

This module knows nothing about rows, sequences or tensors of K/V: it hands out block ids and takes
them back. The KV cache manager (kv_cache_manager.py) owns the block tables.

Free blocks come in two kinds:

    plain free     ref_cnt 0, nothing worth keeping: a LIFO stack (`_free_stack`)
    cached free    ref_cnt 0, but still holding a full block of a known prefix (prefix caching,
                   prefix_cache.py): an LRU queue (`_cached_free`), least recently freed first

`allocate` takes plain free blocks first and evicts cached-free blocks, least recently used first,
only when the stack is empty; each evicted block is handed to `on_evict` so the prefix index forgets
it. `reuse` takes a cached block back (a prefix-cache hit): from the cached-free queue if no one owns
it, else one more owner. Without prefix caching no block is ever marked cached, the LRU queue stays
empty, and the pool is exactly a stack.

Invariants, after every public call:
  * every block id in [0, num_blocks) is exactly one of: plain free (ref_cnt 0, once in the stack),
    cached free (ref_cnt 0, cached, once in the LRU queue) or in use (ref_cnt >= 1, in neither):
    num_free_blocks (both kinds) + num_used_blocks == num_blocks;
  * a call that raises leaves the pool exactly as it was;
  * ids and counts are integers as given: a float (even 1.0) or a bool is refused (`checked_ids`,
    `checked_count`), never rounded to a block or read as block 0 / 1.

Why the plain free queue is a tensor stack and not vLLM's doubly linked list: vLLM keeps every free
block, cached or not, in one queue from which a hit removes blocks in the middle. Most blocks here are
never cached (a partial tail, or no prefix caching at all), so they enter and leave at one end, and a
stack held in a tensor lets `allocate(n)` take n blocks with one slice -- the simulator allocates
thousands of blocks per step. Only cached blocks need the LRU order and removal from the middle, and
an OrderedDict gives both. Plain freed blocks are reused last-in first-out: the most recently freed
blocks are the ones most likely still in a hardware cache.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

MAX_SEED = 2**63 - 1            # torch.Generator.manual_seed takes up to 2**64 - 1; the engine's bound
IDS_ALLOWED = "integer ids (an integer tensor or array, a list of ints, or one int)"


def a_type(value) -> str:
    """"an int", "a float", "a str": the type of a refused value, for an error message."""
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def preview(values) -> str:
    """The first few values of a tensor or array as a user would write them (1.7, not
    1.7000000476837158; 3.0, not 3)."""
    flat = values.reshape(-1)
    shown = [repr(float(f"{v:.6g}")) if isinstance(v, float) else repr(v) for v in flat[:4].tolist()]
    return "[" + ", ".join(shown) + (", ...]" if len(flat) > 4 else "]")


def _flat(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


def checked_ids(ids, name: str = "block_ids") -> torch.Tensor:
    """`ids` (a tensor, a numpy array, a list or one int) as an int64 tensor of the same shape.

    Raises ValueError, naming the dtype, for values that are not integers: a float id (even 1.0) is
    never rounded to a block, a bool never read as block 0 or 1, text never read as digits. Empty
    input of any dtype is allowed (there is nothing to round)."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name}={ids!r} is text ({type(ids).__name__}); allowed: {IDS_ALLOWED}")
    if isinstance(ids, (list, tuple)):
        for i, v in enumerate(_flat(ids)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, torch.Tensor)):
                raise ValueError(f"{name}[{i}]={v!r} is {a_type(v)}; allowed: {IDS_ALLOWED}")
    try:
        tensor = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} of type {type(ids).__name__} are not integer ids ({error}); "
                         f"allowed: {IDS_ALLOWED}") from None
    dtype = tensor.dtype
    if tensor.numel() and (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{name}={preview(tensor)} has dtype {dtype}; allowed: {IDS_ALLOWED}, never "
                         "rounded or read as 0/1")
    return tensor.to(torch.int64)


def checked_count(value, name: str, minimum: int = 0, maximum: int | None = None) -> int:
    """A count (of blocks, tokens; a seed) as an int: a Python or numpy integer, or a 0-d integer
    tensor, not a bool or a float (even 2.0), in [minimum, maximum]."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex):
        value = int(value)
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer {bound}")
    return int(value)


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
        if shuffle_seed is not None:
            shuffle_seed = checked_count(shuffle_seed, "shuffle_seed", 0, MAX_SEED)
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
        # prefix caching only: blocks holding a full block of a known prefix, and the cached blocks
        # no one owns, least recently freed first (evicted in that order when the stack runs out)
        self.is_cached = torch.zeros(num_blocks, dtype=torch.bool)      # (N,)
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._any_cached = False                  # a block was ever marked: `free` must sort released ones
        self.on_evict: Callable[[list[int]], None] | None = None       # told which cached blocks left
        self.num_evicted_cached_blocks = 0

    # ----- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: plain free and cached free."""
        return self._num_free + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with an owner (cached-free blocks are free: `allocate` may evict them)."""
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> torch.Tensor:
        """The free block queue, next to be handed out first: the plain free stack, then the cached
        free blocks, least recently used first. (num_free,) int64, a copy."""
        cached = torch.tensor(list(self._cached_free), dtype=torch.int64)
        return torch.cat([self._free_stack[: self._num_free].flip(0), cached])

    # ----- allocate / free -----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> torch.Tensor:
        """Take `num_blocks` blocks from the free queue, each with ref_cnt 1. Returns (num_blocks,)
        int64 block ids, in the order they were handed out."""
        num_blocks = checked_count(num_blocks, "num_blocks", 0)
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} blocks but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        top = self._num_free
        from_stack = min(num_blocks, top)
        block_ids = self._free_stack[top - from_stack: top].flip(0).clone()
        self._num_free = top - from_stack
        if num_blocks > from_stack:                 # evict cached-free blocks, least recently used first
            evicted = [self._cached_free.popitem(last=False)[0] for _ in range(num_blocks - from_stack)]
            self.is_cached[evicted] = False
            self.num_evicted_cached_blocks += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
            block_ids = torch.cat([block_ids, torch.tensor(evicted, dtype=torch.int64)])
        self.ref_cnt[block_ids] = 1
        return block_ids

    def mark_cached(self, block_ids) -> None:
        """Blocks in use that now hold a full block of a known prefix: when their last owner frees
        them they wait in the cached-free queue instead of the stack."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("mark_cached of a free block: only blocks in use are registered")
        self.is_cached[block_ids] = True
        self._any_cached = True

    def reuse(self, block_ids) -> None:
        """One more owner for each cached block (a prefix-cache hit): a cached-free one leaves the
        LRU queue. Raises ValueError, pool unchanged, for a block that is not cached or repeated."""
        block_ids = self._checked_ids(block_ids)
        if block_ids.unique().numel() != block_ids.numel():
            raise ValueError("reuse: block ids must be distinct")
        if not self.is_cached[block_ids].all():
            bad = int(block_ids[~self.is_cached[block_ids]][0])
            raise ValueError(f"reuse of block {bad}, which holds no cached prefix")
        for block in block_ids[self.ref_cnt[block_ids] == 0].tolist():
            del self._cached_free[block]
        self.ref_cnt[block_ids] += 1

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
        if self._any_cached:
            cached = self.is_cached[released]
            for block in released[cached].tolist():   # most recently used: the end of the LRU queue
                self._cached_free[block] = None
            released = released[~cached]
        top = self._num_free
        self._free_stack[top: top + released.numel()] = released
        self._num_free = top + released.numel()

    def _checked_ids(self, block_ids) -> torch.Tensor:
        block_ids = checked_ids(block_ids, "block_ids").reshape(-1)
        if block_ids.numel() and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(
                f"block ids must be in [0, {self.num_blocks}), got "
                f"[{int(block_ids.min())}, {int(block_ids.max())}]"
            )
        return block_ids

    # ----- checking --------------------------------------------------------------------------------
    def assert_consistent(self) -> None:
        """Check the invariants in the module docstring; raise AssertionError naming the broken one."""
        stack = self._free_stack[: self._num_free]
        cached = torch.tensor(list(self._cached_free), dtype=torch.int64)
        free = torch.cat([stack, cached])
        assert free.unique().numel() == free.numel(), "a block is in the free queues twice"
        assert (self.ref_cnt[free] == 0).all(), "a block in a free queue has owners"
        assert not self.is_cached[stack].any(), "a cached block is in the plain free stack"
        assert self.is_cached[cached].all(), "a block in the cached-free queue is not cached"
        assert (self.ref_cnt >= 0).all(), "negative ref_cnt"
        num_used = int((self.ref_cnt > 0).sum())
        assert num_used + free.numel() == self.num_blocks, (
            f"leak: {num_used} used + {free.numel()} free != {self.num_blocks} blocks"
        )
