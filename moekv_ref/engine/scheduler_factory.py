"""The one place that chooses which scheduler class serves a manager (the engine, the trace runner
and parallel serving all build theirs here).

    a manager that caches prefixes   PrefixCachingScheduler (prefix_caching_scheduler.py)
    any other                        the Scheduler (scheduler.py)

`base` is the plain class the variant adds to: the engine's Scheduler, or the trace runner's
FastScheduler (sim/fast_scheduler.py), which decides the same, faster.
"""

from __future__ import annotations

from functools import cache

from .memory import ModelShape
from .prefix_caching_scheduler import PrefixCachingScheduler
from .scheduler import Scheduler
from .scheduler_config import SchedulerConfig


def make_scheduler(
    config: SchedulerConfig,
    manager,
    shape: ModelShape,
    num_swap_blocks: int = 0,
    base: type[Scheduler] = Scheduler,
) -> Scheduler:
    """The scheduler for `manager`: `base`, with prefix caching where the manager caches prefixes."""
    if getattr(manager, "prefix_cache", None) is None:
        return base(config, manager, shape, num_swap_blocks)
    return prefix_caching(base)(config, manager, shape, num_swap_blocks)


@cache
def prefix_caching(base: type[Scheduler]) -> type[Scheduler]:
    """PrefixCachingScheduler over `base` (a Scheduler subclass): its methods first, then base's."""
    if base is Scheduler:
        return PrefixCachingScheduler
    doc = f"{base.__name__}, starting requests from cached prefixes (PrefixCachingScheduler)."
    return type(f"PrefixCaching{base.__name__}", (PrefixCachingScheduler, base), {"__doc__": doc})
