"""A cache-only simulator: routing traces replayed through memory designs, without the model.

    traces.py    what the router decided, token by token: recorded from the embedded model or synthetic
    designs.py   paged designs (the real KVCacheManager, and count-level models for sweeps)
    replay.py    lock-step replay of a trace through a design; utilization and capacity under a budget

The baselines (`reserved`, `first_fit`) live in moekv_ref/cache/baselines.py.
"""

from .designs import CountingPagedDesign, ManagerPagedDesign, SharedTailDesign
from .replay import ReplayStats, max_concurrent_sequences, replay
from .traces import RoutingTrace, record_model_trace, synthetic_trace

__all__ = ["CountingPagedDesign", "ManagerPagedDesign", "ReplayStats", "RoutingTrace",
           "SharedTailDesign", "max_concurrent_sequences", "record_model_trace", "replay",
           "synthetic_trace"]
