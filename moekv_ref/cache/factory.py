"""make_paged_cache: the one place that chooses which paged cache class to build for a model.

    budget given, or the model's attention_capacity implies one   BudgetedPagedKVCache
    shared_tails=True                                              SharedTailPagedKVCache
    enable_prefix_caching=True                                     PrefixCachingPagedKVCache
    neither                                                        PagedKVCache

and, on a model with one attention expert, the plain and prefix-caching caches follow the dense
decode plan (PlannedPagedKVCache, decode_plan.py). The combinations that cannot work are refused
here, with their reason, before anything is built. generate and the engine build their caches here
(each rank of parallel serving builds a plain PagedKVCache); each class's own constructor and
for_model stay public.
"""

from __future__ import annotations

from ..validation import check_flag, known_keywords
from .budget import RowBudget, check_budget_kind, model_budget
from .budget_paged import BudgetedPagedKVCache
from .decode_plan import PlannedPagedKVCache
from .paged import PagedKVCache
from .prefix_caching_paged import PrefixCachingPagedKVCache
from .shared_tail_paged import SharedTailPagedKVCache


class PlannedPrefixCachingPagedKVCache(PrefixCachingPagedKVCache, PlannedPagedKVCache):
    """Prefix caching over the dense decode plan: PrefixCachingPagedKVCache records the positions of
    whatever PlannedPagedKVCache's append wrote (planned or not), through super()."""


def check_combination(shared_tails: bool, enable_prefix_caching: bool, budget: bool) -> None:
    """The combinations of variants that do not work, refused with their reason."""
    if budget and (shared_tails or enable_prefix_caching):
        raise ValueError(
            "a row budget combines with neither shared tails nor prefix caching: a full "
            "budgeted row replaces tokens in place, so its blocks hold what its policy "
            "kept, not a prefix another request could reuse, and its last tokens are "
            "not a tail to share; build the cache with the budget alone"
        )
    if shared_tails and enable_prefix_caching:
        raise ValueError(
            "shared tails and prefix caching do not combine: a prefix hit copies "
            "the block straddling its end, but a shared-tail row keeps its last "
            "tokens in its sequence's tail blocks, not in a block of its own; use "
            "one or the other (each works with one device or several)"
        )


def paged_cache_class(model, shared_tails=False, enable_prefix_caching=False, budget=None) -> type:
    """The class make_paged_cache builds for these choices (refused where they do not combine)."""
    check_flag("shared_tails", shared_tails)
    check_flag("enable_prefix_caching", enable_prefix_caching)
    check_budget_kind(budget)
    budgeted = budget is not None or model_budget(model.config) is not None
    check_combination(shared_tails, enable_prefix_caching, budgeted)
    if budgeted:
        return BudgetedPagedKVCache
    if shared_tails:
        return SharedTailPagedKVCache
    dense = model.config.num_attention_experts == 1
    if enable_prefix_caching:
        return PlannedPrefixCachingPagedKVCache if dense else PrefixCachingPagedKVCache
    return PlannedPagedKVCache if dense else PagedKVCache


@known_keywords
def make_paged_cache(
    model,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_num_seqs: int = 8,
    shuffle_seed: int | None = None,
    attention: str | None = None,
    shared_tails: bool = False,
    blocks_per_device=None,
    device_of_expert=None,
    enable_prefix_caching: bool = False,
    home_devices: bool = False,
    budget: RowBudget | None = None,
) -> PagedKVCache:
    """The paged cache for a model (its dtype and device): the class paged_cache_class picks, built
    by its for_model with the other options. budget=None on a model with attention_capacity: the
    capacity's own budget (budget.model_budget)."""
    cls = paged_cache_class(model, shared_tails, enable_prefix_caching, budget)
    options = dict(
        shuffle_seed=shuffle_seed,
        attention=attention,
        blocks_per_device=blocks_per_device,
        device_of_expert=device_of_expert,
        home_devices=home_devices,
    )
    if cls is BudgetedPagedKVCache:
        options["budget"] = budget
    return cls.for_model(model, block_size, num_blocks, max_num_seqs, **options)
