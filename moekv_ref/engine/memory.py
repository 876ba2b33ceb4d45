"""The scheduler's window onto the paged cache: the questions it asks and the moves it makes.

The scheduler decides *which* sequences run, wait, or leave; it never reads block tables or the free
queue. Everything it needs to know about memory goes through this class:

    num_blocks, num_free_blocks        the pool
    token_counts(seq_ids)              (m, L, E) tokens per (sequence, layer, expert) row
    num_blocks_held(seq_id)            blocks a sequence owns now (its actual demand)
    free(seq_id)                       give them back (finish, or preempt by recompute)
    can_swap_out / swap_out            move them to the CPU swap space (preempt by swap)
    num_blocks_to_swap_in / swap_in    bring them back (resume)

Blocks themselves are taken by the model's forward (PagedKVCache.attend allocates the slots of the
tokens the router sends to each expert), after the scheduler has checked that the worst case fits.
"""

from __future__ import annotations

import torch

from ..cache.paged import PagedKVCache
from .swap import SwapSpace


class KVMemory:
    def __init__(self, cache: PagedKVCache, num_swap_blocks: int = 0):
        self.cache = cache
        config = cache.config
        self.num_layers = config.num_hidden_layers
        self.num_experts = config.num_attention_experts
        self.k_max = config.num_attention_experts_per_tok
        # the fewest experts a token can go to: top-k always k, threshold routing at least one
        self.k_min = self.k_max if config.attention_routing == "topk" else 1
        self.block_size = cache.block_size
        self.swap_space = SwapSpace(cache, num_swap_blocks) if num_swap_blocks > 0 else None

    # ----- the pool ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.cache.manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.cache.manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ----- sequences --------------------------------------------------------------------------------
    def holds(self, seq_id: int) -> bool:
        return seq_id in self.cache.manager.sequences

    def token_counts(self, seq_ids: list[int]) -> torch.Tensor:
        """(m, L, E) tokens held per row; zeros for a sequence the pool does not hold."""
        return self.cache.manager.token_counts(seq_ids)

    def num_blocks_held(self, seq_id: int) -> int:
        if not self.holds(seq_id):
            return 0
        return int(self.cache.manager.blocks_of_sequence(seq_id).numel())

    def free(self, seq_id: int) -> int:
        """Return the sequence's blocks to the pool (nothing to do if it holds none). Returns how many."""
        num_blocks = self.num_blocks_held(seq_id)
        if self.holds(seq_id):
            self.cache.free(seq_id)
        return num_blocks

    # ----- swap ---------------------------------------------------------------------------------------
    def can_swap_out(self, seq_id: int) -> bool:
        return self.swap_space is not None and self.holds(seq_id) and self.swap_space.can_swap_out(seq_id)

    def swap_out(self, seq_id: int) -> int:
        return self.swap_space.swap_out(seq_id)

    def is_swapped(self, seq_id: int) -> bool:
        return self.swap_space is not None and seq_id in self.swap_space.swapped

    def num_blocks_to_swap_in(self, seq_id: int) -> int:
        return self.swap_space.num_blocks_to_swap_in(seq_id)

    def swapped_token_counts(self, seq_id: int) -> torch.Tensor:
        return self.swap_space.token_counts(seq_id)

    def swap_in(self, seq_id: int) -> None:
        self.swap_space.swap_in(seq_id)

    @property
    def num_swapped_blocks(self) -> int:
        if self.swap_space is None:
            return 0
        return self.swap_space.pool.num_used_blocks

    def assert_no_leak(self) -> None:
        """After every request finished: no sequence holds blocks, every block is free, the swap
        space is empty, and the manager's invariants hold."""
        manager = self.cache.manager
        manager.assert_consistent()
        assert not manager.sequences, f"sequences still in the cache: {manager.sequences}"
        assert manager.num_free_blocks == manager.num_blocks, (
            f"leak: {manager.num_blocks - manager.num_free_blocks} blocks still in use")
        if self.swap_space is not None:
            assert not self.swap_space.swapped and self.swap_space.pool.num_used_blocks == 0, \
                "swap space still holds blocks"
