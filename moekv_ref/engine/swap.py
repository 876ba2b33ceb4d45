"""The CPU swap space: where a sequence preempted by swap keeps its K/V until it resumes.

A second, smaller pool of blocks of the same shape as the device pool, in host memory, with its own
BlockPool for the free list. Swapping out copies every block of the sequence (row by row, in token
order, as `KVCacheManager.blocks_of_sequence` lists them) and remembers each row's token count;
swapping in allocates the same counts again in the device pool -- `allocate_slots` hands out blocks in
the same row-by-row order -- and copies the data back. The sequence gets new block ids, not its old
ones: nothing outside the block tables may remember a block id.

Why whole sequences: a sequence's next token attends over every expert it has ever been routed to in
every layer, and the router may pick any of them. Swapping out only some experts' blocks would leave a
sequence that cannot run until they return, so the scheduler moves all of a sequence or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.block_pool import BlockPool
from ..cache.paged import PagedKVCache


@dataclass
class SwappedSequence:
    """What swap_out leaves behind: host block ids and the token count of each of the L * E rows."""
    host_block_ids: torch.Tensor      # (b,) int64, in the order of blocks_of_sequence
    token_counts: torch.Tensor        # (L * E,) int64, layer-major


class SwapSpace:
    def __init__(self, cache: PagedKVCache, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"swap space num_blocks={num_blocks!r} must be a positive integer")
        self.cache = cache
        self.pool = BlockPool(num_blocks)
        shape = (num_blocks,) + tuple(cache.key_cache.shape[1:])                     # (Ns, P, Hkv, Dh)
        self.key_cache = torch.zeros(shape, dtype=cache.key_cache.dtype, device="cpu")
        self.value_cache = torch.zeros(shape, dtype=cache.value_cache.dtype, device="cpu")
        self.swapped: dict[int, SwappedSequence] = {}

    def can_swap_out(self, seq_id: int) -> bool:
        return self.cache.manager.blocks_of_sequence(seq_id).numel() <= self.pool.num_free_blocks

    def swap_out(self, seq_id: int) -> int:
        """Copy the sequence's blocks to host memory and free them on the device. Returns the number
        of blocks moved."""
        manager = self.cache.manager
        device_blocks = manager.blocks_of_sequence(seq_id)                              # (b,)
        counts = manager.token_counts([seq_id])[0].reshape(-1)                         # (L*E,)
        host_blocks = self.pool.allocate(device_blocks.numel())                         # raises if full
        self.key_cache[host_blocks] = self.cache.key_cache[device_blocks].cpu()
        self.value_cache[host_blocks] = self.cache.value_cache[device_blocks].cpu()
        self.swapped[seq_id] = SwappedSequence(host_blocks, counts)
        self.cache.free(seq_id)
        return device_blocks.numel()

    def num_blocks_to_swap_in(self, seq_id: int) -> int:
        return self.swapped[seq_id].host_block_ids.numel()

    def token_counts(self, seq_id: int) -> torch.Tensor:
        """(L, E) tokens the swapped sequence's rows hold."""
        manager = self.cache.manager
        return self.swapped[seq_id].token_counts.view(manager.num_layers, manager.num_experts)

    def swap_in(self, seq_id: int) -> None:
        """Give the sequence its rows back in the device pool and copy its K/V into them."""
        manager = self.cache.manager
        saved = self.swapped[seq_id]
        if saved.host_block_ids.numel() > manager.num_free_blocks:
            raise RuntimeError(f"swap_in of sequence {seq_id} needs {saved.host_block_ids.numel()} "
                               f"blocks, {manager.num_free_blocks} free: check first")
        index = manager.add_sequence(seq_id)
        rows = manager.sequence_rows(torch.tensor([index]))[0]                          # (L*E,)
        manager.allocate_slots(rows, saved.token_counts)
        device_blocks = manager.blocks_of_sequence(seq_id)                              # (b,) new ids
        assert device_blocks.numel() == saved.host_block_ids.numel()
        device = self.cache.key_cache.device
        self.cache.key_cache[device_blocks] = self.key_cache[saved.host_block_ids].to(device)
        self.cache.value_cache[device_blocks] = self.value_cache[saved.host_block_ids].to(device)
        self.pool.free(saved.host_block_ids)
        del self.swapped[seq_id]

    def drop(self, seq_id: int) -> None:
        """Forget a swapped sequence (e.g. it was aborted)."""
        self.pool.free(self.swapped.pop(seq_id).host_block_ids)
