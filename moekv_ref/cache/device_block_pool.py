"""D block pools behind one numbering of block ids: the blocks of each device are one range.

    device 0: ids [0, N0)     device 1: ids [N0, N0 + N1)     ...     device D-1: ... up to N

Why one numbering instead of D separate id spaces: a block table (kv_cache_manager.py), a slot
(block_id * P + offset), the K/V pool tensors of the paged cache and the Triton kernels all work on
one range of block ids. With the devices' blocks laid end to end, all of them stay as they are; only
*which* free block a row gets changes: a row of an expert placed on device d takes blocks from d's
range, and device d can be full while the others are empty. On real hardware each range would be a
separate allocation in its own device's memory; here, in one process, it is a slice of one tensor.

The pool answers what BlockPool answers (num_blocks, num_free_blocks, free, incref, ref_cnt,
assert_consistent) over all devices, plus per-device counts and `allocate_on(device, n)`. Plain
`allocate(n)` is refused: a caller must say which device. A call that raises changes no device.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .block_pool import MAX_SEED, BlockPool, OutOfBlocksError, a_type, checked_count, checked_ids, preview

BLOCKS_PER_DEVICE_ALLOWED = ("a list or tuple of D integers >= 1 (Python or numpy ints), or a 1-D integer "
                             "tensor or numpy array of them")


def checked_blocks_per_device(blocks_per_device, name: str = "blocks_per_device") -> list[int]:
    """blocks_per_device as a list of D Python ints, each >= 1 (a device with no block could hold no
    row of its experts), or ValueError naming the first bad entry. Nothing is coerced: a float (even
    100.0) or a bool is refused, not rounded, and a str is not read as a sequence of digits. Whether
    each device holds enough blocks for one token of its experts is the paged cache's check."""
    if isinstance(blocks_per_device, (torch.Tensor, np.ndarray)):
        dtype = blocks_per_device.dtype
        is_int = (not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)
                  if isinstance(blocks_per_device, torch.Tensor) else dtype.kind in "iu")
        if not is_int:
            raise ValueError(f"{name}={preview(blocks_per_device)} has dtype {dtype}; allowed: "
                             f"{BLOCKS_PER_DEVICE_ALLOWED}, never rounded")
        if blocks_per_device.ndim != 1:
            raise ValueError(f"{name} has shape {tuple(blocks_per_device.shape)}; allowed: {BLOCKS_PER_DEVICE_ALLOWED}")
        values = blocks_per_device.tolist()
    elif isinstance(blocks_per_device, (list, tuple)):
        values = list(blocks_per_device)
    else:
        raise ValueError(f"{name}={blocks_per_device!r} is {a_type(blocks_per_device)}; "
                         f"allowed: {BLOCKS_PER_DEVICE_ALLOWED}")
    if not values:
        raise ValueError(f"{name}={blocks_per_device!r} is empty; allowed: {BLOCKS_PER_DEVICE_ALLOWED} (D >= 1)")
    for d, n in enumerate(values):
        if not isinstance(n, numbers.Integral) or isinstance(n, (bool, np.bool_)):
            raise ValueError(f"{name}[{d}]={n!r} is {a_type(n)}; allowed: an integer >= 1 "
                             f"(the blocks of device {d}), never rounded")
        if n < 1:
            raise ValueError(f"{name}[{d}]={n!r} is not allowed; allowed: an integer >= 1 (the blocks of "
                             f"device {d})")
    return [int(n) for n in values]


class DeviceBlockPool:
    """blocks_per_device: D positive ints (checked_blocks_per_device). shuffle_seed: each device's
    free queue shuffled (seed + d)."""

    def __init__(self, blocks_per_device, shuffle_seed: int | None = None):
        blocks_per_device = checked_blocks_per_device(blocks_per_device)
        if shuffle_seed is not None:
            shuffle_seed = checked_count(shuffle_seed, "shuffle_seed", 0, MAX_SEED - len(blocks_per_device))
        self.pools = [BlockPool(n, None if shuffle_seed is None else shuffle_seed + d)
                      for d, n in enumerate(blocks_per_device)]
        sizes = torch.tensor(blocks_per_device, dtype=torch.int64)                    # (D,)
        self.first_block = torch.cumsum(sizes, 0) - sizes                              # (D,)
        self.num_blocks = int(sizes.sum())

    # ----- counts -------------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def blocks_per_device(self) -> torch.Tensor:
        """(D,) blocks of each device."""
        return torch.tensor([p.num_blocks for p in self.pools], dtype=torch.int64)

    @property
    def free_per_device(self) -> torch.Tensor:
        """(D,) free blocks of each device."""
        return torch.tensor([p.num_free_blocks for p in self.pools], dtype=torch.int64)

    @property
    def ref_cnt(self) -> torch.Tensor:
        """(N,) owners of each block, all devices end to end (a copy: change it through free/incref)."""
        return torch.cat([p.ref_cnt for p in self.pools])

    def device_of_blocks(self, block_ids) -> torch.Tensor:
        """(b,) the device whose range holds each block id."""
        block_ids = self._checked_ids(block_ids)
        return torch.searchsorted(self.first_block, block_ids, right=True) - 1

    # ----- allocate / free ----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> torch.Tensor:
        raise TypeError("DeviceBlockPool.allocate needs a device: use allocate_on(device, num_blocks)")

    def allocate_on(self, device: int, num_blocks: int) -> torch.Tensor:
        """`num_blocks` blocks of `device`, ref_cnt 1 each: (num_blocks,) int64 global ids. Raises
        OutOfBlocksError naming the device, changing nothing, when it is short."""
        if not isinstance(device, numbers.Integral) or isinstance(device, (bool, np.bool_)) \
                or not 0 <= device < self.num_devices:
            raise ValueError(f"device={device!r} is not allowed; allowed: an integer in 0..{self.num_devices - 1}")
        device = int(device)
        num_blocks = checked_count(num_blocks, "num_blocks", 0)
        pool = self.pools[device]
        if num_blocks > pool.num_free_blocks:
            raise OutOfBlocksError(f"device {device} is short: need {num_blocks} blocks, "
                                   f"{pool.num_free_blocks} of {pool.num_blocks} are free")
        return pool.allocate(num_blocks) + self.first_block[device]

    def free(self, block_ids) -> None:
        """Drop one owner of each block (as BlockPool.free), each on its device. A double free on any
        device raises ValueError before any device changes."""
        block_ids = self._checked_ids(block_ids)
        self._check_owners(block_ids, "free")
        device = self.device_of_blocks(block_ids)
        for d, pool in enumerate(self.pools):
            mine = block_ids[device == d]
            if mine.numel():
                pool.free(mine - self.first_block[d])

    def incref(self, block_ids) -> None:
        """Add an owner to blocks in use, each on its device (ValueError, nothing changed, for a free one)."""
        block_ids = self._checked_ids(block_ids)
        if block_ids.numel() and (self.ref_cnt[block_ids] <= 0).any():
            raise ValueError("incref of a free block: only blocks in use can gain an owner")
        device = self.device_of_blocks(block_ids)
        for d, pool in enumerate(self.pools):
            mine = block_ids[device == d]
            if mine.numel():
                pool.incref(mine - self.first_block[d])

    def _check_owners(self, block_ids: torch.Tensor, verb: str) -> None:
        if block_ids.numel() == 0:
            return
        unique_ids, drops = torch.unique(block_ids, return_counts=True)
        owners = self.ref_cnt[unique_ids]
        over = (drops > owners).nonzero().squeeze(1)
        if over.numel():
            i = int(over[0])
            raise ValueError(f"block {int(unique_ids[i])} is freed {int(drops[i])} time(s) but has ref_cnt "
                             f"{int(owners[i])}: a double free (no device changed)")

    def _checked_ids(self, block_ids) -> torch.Tensor:
        block_ids = checked_ids(block_ids, "block_ids").reshape(-1)
        if block_ids.numel() and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got "
                             f"[{int(block_ids.min())}, {int(block_ids.max())}]")
        return block_ids

    def assert_consistent(self) -> None:
        for d, pool in enumerate(self.pools):
            try:
                pool.assert_consistent()
            except AssertionError as error:
                raise AssertionError(f"device {d}: {error}") from None
