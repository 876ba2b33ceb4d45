"""Prefix caching's paged cache: PrefixCachingPagedKVCache, a PagedKVCache whose manager caches prefixes.

What it adds to PagedKVCache: its manager is a PrefixCachingKVCacheManager, whose PrefixCache
(prefix_cache.py) finds a new request's full blocks again by their prefix (the scheduler asks it);
the cache's part is to tell it, after each append, which position every written slot holds
(PrefixCache.record_positions), so that a block is reused only for the chunks it spans. It reaches
the base through append_kv (super()), whose AppendedRows carry each pair's slot, and make_manager.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .cache_options import CacheOptions, new_manager
from .paged import AppendedRows, PagedKVCache
from .prefix_caching_manager import PrefixCachingKVCacheManager


class PrefixCachingPagedKVCache(PagedKVCache):
    """A PagedKVCache with prefix caching: its manager's `prefix_cache` records the position of every
    token it stores. Shared tails and a row budget do not combine with it (factory.py says why)."""

    def make_manager(self, config: ModelConfig, options: CacheOptions) -> PrefixCachingKVCacheManager:
        return new_manager(config, options, PrefixCachingKVCacheManager)

    def append_kv(self, layer: int, seq_ids, experts, positions, k, v, scores=None) -> AppendedRows:
        """PagedKVCache.append_kv, then each written slot's position recorded for prefix matching."""
        appended = super().append_kv(layer, seq_ids, experts, positions, k, v, scores)
        positions = torch.as_tensor(positions, dtype=torch.int64).cpu().reshape(-1)
        self.manager.prefix_cache.record_positions(appended.slots, positions)
        return appended
