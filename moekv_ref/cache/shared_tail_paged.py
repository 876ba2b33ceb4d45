"""Shared tails' paged cache: SharedTailPagedKVCache, a PagedKVCache whose rows' partly filled last
blocks share tail blocks (shared_tail_manager.py).

What it adds to PagedKVCache: its manager is a SharedTailKVCacheManager, so a row's last tokens live in its
sequence's tail blocks, outside the row's block table, and move (promotion, compaction) as rows
grow; the base copies those moves (SlotAllocation.moves, copy_slots) before it writes new tokens.
The batched path here gathers a row token by token, through the manager's slots (gather_index),
instead of whole blocks; the row-by-row path reads the manager's slots already. Not with
attention="triton": the Triton kernels read a row through its block table only.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .cache_options import CacheOptions, new_manager
from .paged import PagedKVCache
from .shared_tail_manager import SharedTailKVCacheManager


class SharedTailPagedKVCache(PagedKVCache):
    """A PagedKVCache over a SharedTailKVCacheManager. Prefix caching and a row budget do not
    combine with it (factory.py says why)."""

    @classmethod
    def check_options(
        cls, config, num_blocks=None, block_size=16, max_num_seqs=None, **settings
    ) -> CacheOptions:
        """The base's options; attention='triton' refused."""
        if settings.get("attention") == "triton":
            raise ValueError(
                "shared_tails=True cannot use attention='triton': the Triton kernels read a "
                "row through its block table only, and shared tails live outside it"
            )
        return super().check_options(config, num_blocks, block_size, max_num_seqs, **settings)

    def make_manager(self, config: ModelConfig, options: CacheOptions):
        return new_manager(config, options, SharedTailKVCacheManager)

    def gather_index(self, rows: torch.Tensor, lens: torch.Tensor):
        """The rows' tokens by slot (the manager's padded_slots): shared tails sit outside the tables."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        slots, valid = self.manager.padded_slots(rows)  # (g, Lmax) each
        device = self.key_cache.device
        pool = (self.key_cache.view(-1, Hkv, Dh), self.value_cache.view(-1, Hkv, Dh))
        padding = (~valid).view(-1).nonzero().squeeze(1).to(device)  # (g * Lmax - sum(lens),)
        return pool, slots.reshape(-1).to(device), valid, padding
