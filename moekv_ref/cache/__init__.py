"""KV caches. Every cache answers two calls from the model, once per layer, with every (token,
expert) pair the layer's router chose:

    appended = cache.append_kv(layer, seq_ids, experts, positions, k, v)
    out      = cache.attend(appended, q)                                  # (n, H, Dh)

`append_kv` stores the pairs' k, v (n, Hkv, Dh) under their (sequence, layer, expert) rows (taking
memory as rows grow) and returns what attention needs; `attend` returns, for each pair's query, the
attention over the keys its row holds at positions <= the query's. Within a row, new tokens continue
the positions the cache already holds. Caches also answer `token_counts(seq_ids)` -> (num_seqs, L, E)
and `free(seq_id)`.

    rows.py                 how a (sequence, layer, expert) row is numbered, and on which device
                            it lives (RowPlacement); ceil_div
    options.py              ManagerOptions: a manager's and a pool's options, and their calls'
                            arguments, checked once
    block_pool.py           the free block stacks (per device) and reference counts
    kv_cache_manager.py     block tables and token counts per row (integers only; the plain path)
    invariants.py           the pool's and the manager's invariants, as the property tests check them
    caching_block_pool.py   CachingBlockPool: free blocks that keep a known prefix, in LRU queues
    prefix_cache.py         PrefixCache: the index from token prefixes to blocks
    prefix_caching_manager.py  PrefixCachingKVCacheManager: full blocks found again by prefix
    shared_tail_manager.py  SharedTailKVCacheManager: rows' partly filled tails share blocks
    budgeted_manager.py     BudgetedKVCacheManager: at most B tokens a row (a RowBudget)
    cache_options.py        CacheOptions: a paged cache's options, checked once
    paged.py                PagedKVCache: K/V pool tensors + a manager; the attention paths (the
                            plain path only; each variant below is a subclass in its own file)
    decode_plan.py          PlannedPagedKVCache: the dense decode plan, a speed-up
    prefix_caching_paged.py PrefixCachingPagedKVCache: records each stored token's position
    shared_tail_paged.py    SharedTailPagedKVCache: rows' tails in shared blocks
    budget.py               RowBudget: at most B tokens a row, a policy at a full row; the
                            budgeted recompute the model runs
    budget_paged.py         BudgetedPagedKVCache: a PagedKVCache whose rows keep a RowBudget
    factory.py              make_paged_cache: the one place that picks the class for a model
    contiguous.py           ContiguousKVCache: one growing buffer per row, the reference
"""

from .block_pool import BlockPool, OutOfBlocksError
from .budget_paged import BudgetedPagedKVCache
from .budgeted_manager import BudgetedKVCacheManager
from .cache_options import ATTENTION_PATHS, CacheOptions
from .caching_block_pool import CachingBlockPool
from .contiguous import ContiguousKVCache
from .decode_plan import PlannedPagedKVCache
from .factory import make_paged_cache
from .kv_cache_manager import KVCacheManager, SlotAllocation
from .paged import AppendedRows, PagedKVCache
from .prefix_cache import PrefixCache
from .prefix_caching_manager import PrefixCachingKVCacheManager
from .prefix_caching_paged import PrefixCachingPagedKVCache
from .rows import RowIndex, RowPlacement, ceil_div
from .shared_tail_manager import SharedTailKVCacheManager
from .shared_tail_paged import SharedTailPagedKVCache

__all__ = [
    "ATTENTION_PATHS",
    "AppendedRows",
    "BlockPool",
    "BudgetedPagedKVCache",
    "CacheOptions",
    "ContiguousKVCache",
    "KVCacheManager",
    "OutOfBlocksError",
    "PagedKVCache",
    "PlannedPagedKVCache",
    "PrefixCachingPagedKVCache",
    "SharedTailPagedKVCache",
    "PrefixCache",
    "RowIndex",
    "RowPlacement",
    "SharedTailKVCacheManager",
    "PrefixCachingKVCacheManager",
    "BudgetedKVCacheManager",
    "CachingBlockPool",
    "SlotAllocation",
    "ceil_div",
    "make_paged_cache",
]
