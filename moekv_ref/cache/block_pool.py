"""The block pool: physical KV blocks, their reference counts and a free block stack per device.

A block is P token slots of K and V for one attention expert's head group. Every (sequence, layer,
expert) row takes blocks from this one pool, so any free block serves any row (no external
fragmentation). The pool only hands out and takes back ids; kv_cache_manager.py owns block tables.

With D devices (`blocks_per_device=[N0, N1, ...]`), device d's ids are one contiguous range,
[0, N0), [N0, N0 + N1), ...: block tables, slots, the paged cache's tensors and the Triton kernels
stay as they are, and only which free block a row gets changes (`allocate(n, device=d)`; d can be
full while others are empty). On hardware each range is its own device's memory; here, a slice.

Each device's free blocks are a LIFO stack: blocks enter and leave at one end, so a tensor stack
hands out n blocks with one slice (the simulator allocates thousands per step), and the most
recently freed blocks, likeliest in a hardware cache, are reused first. (caching_block_pool.py adds
the blocks that keep a known prefix while free, in an LRU queue, for prefix caching.)

Invariants (`assert_consistent`): each block is free or in use (ref_cnt >= 1), on its own device's
stack when free; a call that raises changes nothing; ids and counts must be integers (a float, even
1.0, or a bool is never rounded or read as 0 / 1); no tensor of the pool is an inference tensor.
The engine's forward runs in inference mode and allocates there (engine/model_runner.py), and an
inference tensor cannot be changed in place outside it: so the pool's tensors are made outside
inference mode, whatever the caller's, and a call changes them in place, never replacing one with
a new tensor (which, made inside the forward, would be an inference tensor).
"""

from __future__ import annotations

import torch

from ..state import Stateful
from ..validation import check_ids, check_int, check_seed, known_keywords
from .invariants import check_pool
from .options import ManagerOptions, check_counts_per_device, check_pool_device, check_pool_size
from .rows import stable_order


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Not a bug: a scheduler checks
    `can_allocate` first and preempts a sequence when memory is short, or (optimistic reservation)
    undoes the step and retries it with `shortfall` more blocks freed: (D,) blocks missing per
    device, where the manager knows them (None otherwise); `layer`: the layer whose append ran
    short, where a paged cache's append_kv raised it (None otherwise)."""

    def __init__(self, message: str, shortfall=None, layer: int | None = None):
        super().__init__(message)
        self.shortfall = shortfall
        self.layer = layer


class BlockPool(Stateful):
    """Block ids of D devices (num_blocks: one), a free block stack per device and a reference
    count per block. shuffle_seed: each device's stack starts in a random order (device d's seed
    is shuffle_seed + d): tests use it to show nothing depends on a row's blocks being adjacent."""

    STATE = ("_free_stack", "_num_free", "ref_cnt")

    @known_keywords
    @torch.inference_mode(False)  # kept across steps: never inference tensors (module docstring)
    def __init__(
        self,
        num_blocks: int | None = None,
        shuffle_seed: int | None = None,
        blocks_per_device=None,
        options: ManagerOptions | None = None,
    ):
        """options: a manager's ManagerOptions (options.py), whose sizes and seed were validated there."""
        if options is None:
            blocks_per_device = check_pool_size(num_blocks, blocks_per_device)
            shuffle_seed = check_seed("shuffle_seed", shuffle_seed, len(blocks_per_device), allow_none=True)
        else:
            blocks_per_device = options.blocks_per_device
            shuffle_seed = options.shuffle_seed
        num_devices = len(blocks_per_device)
        self.num_blocks = sum(blocks_per_device)
        self._device_sizes = blocks_per_device  # (D,)
        first_blocks = [sum(blocks_per_device[:d]) for d in range(num_devices)]
        self._first_blocks = torch.tensor(first_blocks, dtype=torch.int64)  # (D,) device d's first id
        # devices of one size (the usual case): a block's device is a division, not a search
        self._equal_size = blocks_per_device[0] if len(set(blocks_per_device)) == 1 else None
        # (D,) free blocks per device: a tensor, since the simulator asks for all D each step
        self._num_free = torch.tensor(blocks_per_device, dtype=torch.int64)
        self._make_block_state(shuffle_seed)

    def _make_block_state(self, shuffle_seed: int | None) -> None:
        """The state kept per block: each device's free stack and a reference count. Device d's
        free ids are _free_stack[first : first + _num_free[d]], first = _first_blocks[d], popped
        from the end; stored reversed, so that an unshuffled device hands out its ids in
        increasing order."""
        self._free_stack = torch.empty(self.num_blocks, dtype=torch.int64)  # (N,)
        for d, (first, size) in enumerate(zip(self._first_blocks.tolist(), self._device_sizes)):
            order = (
                torch.arange(size)
                if shuffle_seed is None
                else torch.randperm(size, generator=torch.Generator().manual_seed(shuffle_seed + d))
            )
            self._free_stack[first : first + size] = order.flip(0) + first
        self.ref_cnt = torch.zeros(self.num_blocks, dtype=torch.int32)  # (N,) owners of each block

    # ----- queries -------------------------------------------------------------------------------
    num_devices = property(lambda self: len(self._device_sizes))
    blocks_per_device = property(lambda self: torch.tensor(self._device_sizes, dtype=torch.int64))

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out, over all devices."""
        return int(self.num_free_blocks_per_device.sum())

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        return self._num_free.clone()

    @property
    def num_used_blocks(self) -> int:
        """Blocks with an owner."""
        return self.num_blocks - self.num_free_blocks

    def device_of_blocks(self, block_ids) -> torch.Tensor:
        return self._device_of(self._checked_ids(block_ids))

    def free_block_ids(self) -> torch.Tensor:
        """The free blocks, device by device, in the order handed out."""
        stacks = self.free_stacks()
        return torch.cat([stack.flip(0) for stack in stacks]) if stacks else torch.zeros(0, dtype=torch.int64)

    def free_stacks(self) -> list[torch.Tensor]:
        """Each device's free stack, bottom first."""
        return [
            self._free_stack[first : first + n]
            for first, n in zip(self._first_blocks.tolist(), self._num_free.tolist())
        ]

    # ----- allocate / free -----------------------------------------------------------------------
    def allocate(self, num_blocks: int, device: int | None = None) -> torch.Tensor:
        """Take `num_blocks` blocks of `device` (left out on a one-device pool only), each with
        ref_cnt 1, in the order handed out; OutOfBlocksError, changing nothing, when short."""
        counts = torch.zeros(self.num_devices, dtype=torch.int64)
        counts[check_pool_device(device, self.num_devices)] = check_int("num_blocks", num_blocks, 0)
        return self.allocate_per_device(counts)

    def allocate_per_device(self, num_blocks: torch.Tensor) -> torch.Tensor:
        """num_blocks (D,): `allocate(num_blocks[d], device=d)` for every device at once, the ids
        device after device, in one gather from the stacks (the simulator's thousands of blocks a
        step over 64 devices); OutOfBlocksError, changing nothing, when one is short."""
        num_blocks = check_counts_per_device(num_blocks, self.num_devices)
        self.check_free(num_blocks)
        # device d's k-th block is its stack's top - k; the n blocks' positions, device after device:
        # each device's top, less the blocks handed out before it, repeated, less 0, 1, 2, ...
        total = int(num_blocks.sum())
        top = self._first_blocks + self._num_free - 1 + torch.cumsum(num_blocks, 0) - num_blocks  # (D,)
        position = torch.repeat_interleave(top, num_blocks, output_size=total) - torch.arange(total)  # (n,)
        block_ids = self._free_stack[position]  # popped from the end, as allocate does
        self._num_free -= num_blocks
        self.ref_cnt[block_ids] = 1
        return block_ids

    def incref(self, block_ids: torch.Tensor) -> None:
        """Add an owner to blocks already in use (sharing, e.g. a forked sequence)."""
        block_ids = self._checked_ids(block_ids)
        if (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("incref of a free block: only blocks in use can gain an owner")
        self.ref_cnt.index_add_(0, block_ids, torch.ones_like(block_ids, dtype=torch.int32))

    def free(self, block_ids: torch.Tensor, distinct: bool = False) -> None:
        """Drop one owner per occurrence of each block; blocks left with none go back to their
        device's free stack, in the order given (first occurrence), so that the block freed last is
        the first handed out again. ValueError, pool unchanged, for a double free. distinct=True:
        the caller's ids are distinct (a sequence's blocks), which skips finding the repeated ones
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
        released = (remaining == 0).nonzero().squeeze(1)  # (r,)
        if distinct:
            released = unique_ids[released]
        else:
            first = torch.full((unique_ids.numel(),), block_ids.numel(), dtype=torch.int64)
            first = first.scatter_reduce(0, inverse, torch.arange(block_ids.numel()), reduce="amin")
            released = unique_ids[released[first[released].argsort()]]
        self._push(released)

    def _push(self, released: torch.Tensor) -> None:
        """Blocks with no owner left, in order, each onto its device's stack: one scatter, not a
        pass per device."""
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

    def check_free(self, num_blocks: torch.Tensor) -> None:
        """OutOfBlocksError naming the first device with fewer free blocks than num_blocks (D,), and
        the blocks missing on each (`shortfall`)."""
        free = self.num_free_blocks_per_device  # (D,)
        if not bool((num_blocks <= free).all()):
            d = int((num_blocks > free).nonzero()[0])
            where = "" if self.num_devices == 1 else f"device {d} is short: "
            raise OutOfBlocksError(
                f"{where}need {int(num_blocks[d])} blocks but only {int(free[d])} of "
                f"{self._device_sizes[d]} are free",
                torch.clamp(num_blocks - free, min=0),
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

    def assert_consistent(self) -> None:
        """The invariants of the module docstring (invariants.py); AssertionError names the broken one."""
        check_pool(self)
