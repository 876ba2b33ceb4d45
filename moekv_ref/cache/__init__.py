"""KV caches. Every cache answers one call from the model, per layer and expert:

    attend(layer, expert, seq_ids, positions, q, k, v) -> (n, H, Dh)

It stores the new tokens' k, v (n, Hkv, Dh) under (sequence, layer, expert), then returns, for each
query, attention over the keys that (sequence, layer, expert) holds at positions <= the query's.
Within a sequence the new tokens continue the positions the cache already holds.

Caches also answer `token_counts(seq_ids)` -> (num_seqs, L, E) and `free(seq_id)`.
"""

from .block_pool import BlockPool, OutOfBlocksError
from .contiguous import ContiguousKVCache
from .kv_cache_manager import KVCacheManager
from .paged import PagedKVCache
from .shared_tail_manager import SharedTailKVCacheManager

__all__ = ["BlockPool", "ContiguousKVCache", "KVCacheManager", "OutOfBlocksError", "PagedKVCache",
           "SharedTailKVCacheManager"]
