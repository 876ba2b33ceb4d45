"""PrefixCachingKVCacheManager: a KVCacheManager (kv_cache_manager.py) whose full blocks outlive
their sequences and are found again by prefix.

What it adds to the plain manager:
- its pool is a CachingBlockPool (caching_block_pool.py): freed blocks that hold a known prefix wait
  in an LRU queue instead of the free stack;
- it keeps a PrefixCache (prefix_cache.py), the index from token prefixes to blocks, told of every
  freed sequence and every evicted block;
- a new sequence may start from shared and copied blocks (`start_from_blocks`, a prefix hit);
- the block changes the index asks for (`mark_cached`, `uncache`, `reuse`, `release`), so that only
  the manager changes its pool.

A block may then be listed by several sequences' rows (ref_cnt counts them), so single rows are
never freed (`can_evict_rows` is False): a victim that evicts rows is refused by the scheduler.
"""

from __future__ import annotations

import torch

from .block_pool import OutOfBlocksError
from .caching_block_pool import CachingBlockPool
from .invariants import check_block_tables, check_row_counts
from .kv_cache_manager import KVCacheManager
from .options import ManagerOptions
from .prefix_cache import PrefixCache


class PrefixCachingKVCacheManager(KVCacheManager):
    """KVCacheManager with a prefix cache (module docstring); the plain manager's arguments."""

    PARTS = (*KVCacheManager.PARTS, "prefix_cache")
    can_evict_rows = False

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.prefix_cache = PrefixCache(self)
        self.pool.listen_for_evictions(self.prefix_cache.forget_blocks)

    def _bytes_beside_tables(self, num_layers: int, num_rows: int, options: ManagerOptions) -> int:
        return 8 * options.num_blocks * options.block_size  # the index's block_positions

    def _make_pool(self, options: ManagerOptions) -> CachingBlockPool:
        return CachingBlockPool(options=options)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self.prefix_cache.forget_sequence(seq_id)  # its blocks stay findable until evicted

    def start_from_blocks(
        self,
        seq_id: int,
        row_counts: torch.Tensor,
        shared_rows: torch.Tensor,
        shared_columns: torch.Tensor,
        shared_blocks: torch.Tensor,
        copied_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A new sequence whose rows (indexed 0..L*E-1) hold row_counts tokens from the start: the
        blocks shared_blocks[i] listed at column shared_columns[i] of row shared_rows[i], and one
        fresh block (a copy's destination, on its row's device) at the last column of each
        copied_rows row. Returns the sequence's rows (L*E,) and the fresh blocks; OutOfBlocksError,
        changing nothing, when a device is short of them."""
        one_each = torch.ones_like(copied_rows)
        index = self.add_sequence(seq_id)
        rows = self.index.sequence_rows(torch.tensor([index]))[0]  # (L*E,)
        try:
            copied = rows[copied_rows]
            fresh = self._take_blocks(self.row_device[copied], one_each)
        except OutOfBlocksError:
            self.free(seq_id)
            raise
        self.place_blocks(rows[shared_rows], shared_columns, shared_blocks)
        self.place_blocks(rows[copied_rows], row_counts[copied_rows] // self.block_size, fresh)
        self.set_row_tokens(rows, row_counts)
        return rows, fresh

    # ----- the block changes the prefix index asks for ----------------------------------------------
    def mark_cached(self, block_ids: torch.Tensor) -> None:
        self.pool.mark_cached(block_ids)

    def uncache(self, block_ids: torch.Tensor) -> None:
        self.pool.uncache(block_ids)

    def reuse(self, block_ids: torch.Tensor) -> None:
        self.pool.reuse(block_ids)

    def release(self, block_ids: torch.Tensor) -> None:
        self.pool.free(block_ids)

    def assert_consistent(self) -> None:
        """KVCacheManager's invariants, a block listed by several rows allowed (prefix hits share
        blocks; ref_cnt counts them), and the prefix index's."""
        self.pool.assert_consistent()
        check_row_counts(self)
        check_block_tables(self, shared=True)
        self.prefix_cache.assert_consistent()
