"""The swap space's bookkeeping: where a sequence preempted by swap keeps its K/V until it resumes.

A second, smaller pool of host blocks of the device pool's shape, as integers only: the model runner
owns the host K/V and performs each `BlockCopy`. swap_out frees the device blocks at once (the copy
runs first: model_runner.py); swap_in allocates the saved row counts again, in the order
blocks_of_sequence lists them, so the sequence gets new device block ids: nothing outside the block
tables may remember a block id. (Why whole sequences: scheduler.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..cache.block_pool import BlockPool
from ..cache.budgeted_manager import BudgetedKVCacheManager
from ..cache.kv_cache_manager import KVCacheManager
from ..cache.prefix_caching_manager import PrefixCachingKVCacheManager
from ..state import Stateful
from ..validation import MAX_BLOCKS, check_int

SWAP_OUT = "swap_out"  # device blocks -> host blocks
SWAP_IN = "swap_in"  # host blocks -> device blocks
COPY = "copy"  # device blocks -> device blocks (copy-on-write of a prefix-cache hit)


class BlockCopy(NamedTuple):
    """One copy the model runner performs before the forward: block source[i] -> destination[i]."""

    direction: str  # SWAP_OUT, SWAP_IN or COPY
    source: torch.Tensor  # (b,) int64 block ids (device for SWAP_OUT and COPY, host for SWAP_IN)
    destination: torch.Tensor  # (b,) int64 block ids (host for SWAP_OUT, device for SWAP_IN and COPY)


@dataclass
class SwappedSequence:
    host_block_ids: torch.Tensor  # (b,) int64, in the order of blocks_of_sequence
    token_counts: torch.Tensor  # (L * E,) int64, layer-major
    last_appended: torch.Tensor | None = None  # (L * E,) each row's last append (the manager's clock)
    positions: torch.Tensor | None = None  # (b, P) each slot's token position (prefix caching only)
    blocks_per_device: torch.Tensor | None = (
        None  # (D,) of the b blocks, on each device (swap_in takes as many)
    )
    budget_state: tuple | None = None  # the rows' slot positions and scores (a row budget only)


class SwapSpace(Stateful):
    """Host block ids and saved row counts of the sequences preempted by swap (no tensors of K/V)."""

    STATE = ("swapped",)  # its SwappedSequence records are never changed in place
    PARTS = ("pool",)

    def __init__(self, manager: KVCacheManager, num_blocks: int):
        num_blocks = check_int("swap space num_blocks", num_blocks, 1, MAX_BLOCKS, "host blocks")
        self.manager = manager
        self.pool = BlockPool(num_blocks)
        self.swapped: dict[int, SwappedSequence] = {}

    def can_swap_out(self, seq_id: int) -> bool:
        return self.manager.blocks_of_sequence(seq_id).numel() <= self.pool.num_free_blocks

    def swap_out(self, seq_id: int) -> BlockCopy:
        """Host blocks for the sequence's device blocks, which are freed. Raises OutOfBlocksError,
        changing nothing, if the host pool is short (ask can_swap_out first)."""
        device_blocks = self.manager.blocks_of_sequence(seq_id)  # (b,)
        counts = self.manager.token_counts([seq_id])[0].reshape(-1)  # (L*E,)
        host_blocks = self.pool.allocate(device_blocks.numel())  # may raise
        # a prefix cache's slot positions travel too, and what a budget's policy reads
        prefix = self.manager.prefix_cache if isinstance(self.manager, PrefixCachingKVCacheManager) else None
        budget = self.manager.budget if isinstance(self.manager, BudgetedKVCacheManager) else None
        rows = self.manager.index.sequence_rows(torch.tensor([self.manager.seq_index(seq_id)]))[0]  # (L*E,)
        self.swapped[seq_id] = SwappedSequence(
            host_blocks,
            counts,
            self.manager.row_last_used(seq_id).reshape(-1),
            None if prefix is None else prefix.block_positions[device_blocks].clone(),
            self.manager.blocks_held_per_device([seq_id])[0],
            None if budget is None else budget.rows_state(rows),
        )
        self.manager.free(seq_id)
        return BlockCopy(SWAP_OUT, device_blocks, host_blocks)

    def token_counts(self, seq_id: int) -> torch.Tensor:  # (L, E)
        return self.swapped[seq_id].token_counts.view(self.manager.num_layers, self.manager.num_experts)

    def swap_in(self, seq_id: int) -> BlockCopy:
        """The sequence's rows back in the device pool (same counts, new block ids), its host blocks
        freed. Raises RuntimeError, changing nothing, if the device pool is short."""
        manager = self.manager
        saved = self.swapped[seq_id]
        free = manager.num_free_blocks_per_device  # (D,)
        short = (saved.blocks_per_device > free).nonzero().squeeze(1)  # each device, not the total
        if short.numel():
            d = int(short[0])
            raise RuntimeError(
                f"swap_in of sequence {seq_id} needs {int(saved.blocks_per_device[d])} blocks "
                f"on device {d}, {int(free[d])} free there: check first"
            )
        device_blocks = manager.restore_sequence(
            seq_id, saved.token_counts, saved.last_appended
        )  # (b,) new ids
        assert device_blocks.numel() == saved.host_block_ids.numel()
        rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0]  # (L*E,)
        if saved.positions is not None:
            manager.prefix_cache.restore_positions(device_blocks, saved.positions)
        if saved.budget_state is not None:  # same counts, same slot order: same state
            manager.budget.restore_rows(rows, saved.budget_state)
        self.pool.free(saved.host_block_ids)
        del self.swapped[seq_id]
        return BlockCopy(SWAP_IN, saved.host_block_ids, device_blocks)

    def discard(self, seq_id: int) -> None:
        """Forget a swapped sequence (aborted, or its copy out failed), freeing its host blocks."""
        self.pool.free(self.swapped.pop(seq_id).host_block_ids)
