"""The one place that chooses which scheduler class serves a manager and a configuration (the
engine, the trace runner and parallel serving all build theirs here).

    a manager that caches prefixes         PrefixCachingScheduler (prefix_caching_scheduler.py)
    a victim policy that drops single rows RowEvictingScheduler (row_evicting_scheduler.py)
    preemption_mode='swap'                 SwappingScheduler (swapping_scheduler.py)
    none of these                          the plain class

The plain class is the engine's Scheduler (scheduler.py), or the trace runner's FastScheduler
(sim/fast_scheduler.py), which decides the same, faster; the variants that apply are put before it
(their methods call on through super()). Prefix caching and row eviction do not combine: a cached
block is shared between rows, which RowEvictingScheduler refuses when it is built.
"""

from __future__ import annotations

from functools import cache

from ..cache.prefix_caching_manager import PrefixCachingKVCacheManager
from .memory import ModelShape
from .prefix_caching_scheduler import PrefixCachingScheduler
from .row_evicting_scheduler import RowEvictingScheduler
from .scheduler import Scheduler
from .scheduler_config import SchedulerConfig
from .swapping_scheduler import SwappingScheduler


def make_scheduler(
    config: SchedulerConfig,
    manager,
    shape: ModelShape,
    num_swap_blocks: int = 0,
    base: type[Scheduler] = Scheduler,
) -> Scheduler:
    """The scheduler for `manager` and `config`: `base`, with the variants they need."""
    variants = []
    if isinstance(manager, PrefixCachingKVCacheManager):
        variants.append(PrefixCachingScheduler)
    if isinstance(config, SchedulerConfig) and config.make_victim_policy().evicts_rows:
        variants.append(RowEvictingScheduler)
    if isinstance(config, SchedulerConfig) and config.preemption_mode == "swap":
        variants.append(SwappingScheduler)
    return scheduler_class(tuple(variants), base)(config, manager, shape, num_swap_blocks)


@cache
def scheduler_class(variants: tuple[type[Scheduler], ...], base: type[Scheduler]) -> type[Scheduler]:
    """`base` with `variants` (Scheduler subclasses) before it; a variant over the Scheduler alone
    is its own class. The class's STATE lists every one of theirs."""
    if not variants:
        return base
    if len(variants) == 1 and base is Scheduler:
        return variants[0]
    name = "".join(v.__name__.removesuffix("Scheduler") for v in variants) + base.__name__
    state = dict.fromkeys(attribute for cls in (*variants, base) for attribute in cls.STATE)
    doc = f"{base.__name__} with {', '.join(v.__name__ for v in variants)}."
    return type(name, (*variants, base), {"__doc__": doc, "STATE": tuple(state)})
