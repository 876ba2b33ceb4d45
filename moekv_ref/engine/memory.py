"""What the scheduler and its policies know about memory: integers only.

ModelShape holds what the scheduler must know of the model beyond its cache: how many experts a
token is routed to, and how many positions it has. The cache's own facts (layers, experts, block
size, the most tokens a row of each layer keeps) are read from its manager, once, by the MemoryView, so there is no
second copy to disagree with it.

MemoryView is a read-only window onto the block manager and the swap space (per device as (D,)
vectors; one pool: D = 1); its totals stay sums over devices, for the admission policies that
reason about the whole pool. The policies get a MemoryView, which has no method that changes anything; the scheduler
changes memory only through the block manager and the swap space, never touching K/V tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.kv_cache_manager import KVCacheManager
from ..cache.rows import RowPlacement
from ..config import ModelConfig
from .swap import SwapSpace


@dataclass(frozen=True)
class ModelShape:
    k_max: int  # most experts a token is routed to per layer
    k_min: int  # fewest: k under top-k routing, 1 under threshold routing
    max_num_positions: int  # the model's max_position_embeddings

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelShape":
        k_max = config.num_attention_experts_per_tok
        k_min = k_max if config.attention_routing == "topk" else 1
        return cls(k_max, k_min, config.max_position_embeddings)


class MemoryView:
    def __init__(self, manager: KVCacheManager, shape: ModelShape, swap_space: SwapSpace | None = None):
        self._manager = manager
        self._swap_space = swap_space
        self.shape = shape
        # the cache's facts, read from its manager (fixed when it was built)
        self.num_layers = manager.num_layers  # L
        self.num_experts = manager.num_experts  # E
        self.block_size = manager.block_size  # P
        # the most tokens a row of each layer keeps (None: no cap), and their largest B
        self.layer_limits = manager.layer_limits
        self.max_row_tokens = None if self.layer_limits is None else max(self.layer_limits)

    # ----- the pool ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ----- sequences on the device ------------------------------------------------------------------
    def holds(self, seq_id: int) -> bool:
        return self._manager.holds(seq_id)

    def token_counts(self, seq_ids: list[int]) -> torch.Tensor:
        """(m, L, E) tokens held per row; zeros for a sequence the pool does not hold."""
        return self._manager.token_counts(seq_ids)

    def num_blocks_held(self, seq_id: int) -> int:
        return self._manager.num_blocks_of_sequence(seq_id) if self.holds(seq_id) else 0

    # ----- the swap space ---------------------------------------------------------------------------
    @property
    def has_swap_space(self) -> bool:
        return self._swap_space is not None

    @property
    def num_swap_blocks(self) -> int:
        return 0 if self._swap_space is None else self._swap_space.pool.num_blocks

    @property
    def num_swapped_blocks(self) -> int:
        return 0 if self._swap_space is None else self._swap_space.pool.num_used_blocks

    def is_swapped(self, seq_id: int) -> bool:
        return self._swap_space is not None and seq_id in self._swap_space.swapped

    def num_blocks_swapped(self, seq_id: int) -> int:
        """Host blocks the sequence holds (what it takes from the device pool to swap back in)."""
        return self._swap_space.swapped[seq_id].host_block_ids.numel() if self.is_swapped(seq_id) else 0

    def swapped_token_counts(self, seq_id: int) -> torch.Tensor:
        return self._swap_space.token_counts(seq_id)  # (L, E)

    # ----- devices (one pool: D = 1) ----------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self._manager.num_devices

    @property
    def blocks_per_device(self) -> torch.Tensor:
        return self._manager.blocks_per_device

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        return self._manager.num_free_blocks_per_device

    @property
    def num_used_blocks_per_device(self) -> torch.Tensor:
        return self.blocks_per_device - self.num_free_blocks_per_device

    @property
    def placement(self) -> RowPlacement:
        """Which device each row lives on: placement.of_sequences(ids) is (m, L, E), held or not."""
        return self._manager.placement

    def blocks_held_per_device(self, seq_id: int) -> torch.Tensor:
        """(D,) blocks the sequence holds per device, also any outside its rows (shared tails)."""
        return self._manager.blocks_held_per_device([seq_id])[0]

    def swapped_blocks_per_device(self, seq_id: int) -> torch.Tensor:
        """(D,) blocks a swapped sequence takes on each device to come back (zeros if not swapped)."""
        if not self.is_swapped(seq_id):
            return torch.zeros(self.num_devices, dtype=torch.int64)
        return self._swap_space.swapped[seq_id].blocks_per_device

    def row_last_used(self, seq_id: int) -> torch.Tensor | None:
        """(L, E) the step each row was last appended at (-1: never); None: rows never evicted."""
        return self._manager.row_last_used(seq_id) if self._manager.can_evict_rows else None

    # ----- checking ---------------------------------------------------------------------------------
    def assert_no_leak(self) -> None:
        """After every request finished: nothing held, every block free, the manager consistent."""
        manager = self._manager
        manager.assert_consistent()
        assert not manager.sequences, f"sequences still in the cache: {manager.sequences}"
        assert manager.num_free_blocks == manager.num_blocks, (
            f"leak: {manager.num_blocks - manager.num_free_blocks} blocks still in use"
        )
        if self._swap_space is not None:
            assert not (self._swap_space.swapped or self.num_swapped_blocks), "swap space still holds blocks"
