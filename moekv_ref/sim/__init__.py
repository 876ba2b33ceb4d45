"""A cache-only simulator: routing traces replayed through memory designs, without the model.

    traces.py     what the router decided, token by token: synthetic here (one expert popularity for
                  all, or per-sequence topics); recorded from a model by
                  moekv_ref.analysis.record_model_trace (the simulator never runs the model)
    designs.py    paged designs (the real KVCacheManager, and count-level models for sweeps)
    baselines.py  the designs paging must beat: per-expert worst-case reservation, first-fit buffers
    replay.py     lock-step replay of a trace through a design; utilization and capacity under a budget
    eviction.py   serving over a trace: the engine's own Scheduler, with the trace playing the model
                  (victim policies under per-device pools), costed by moekv_ref/costs.py
    density.py    for each expert buffer, the share of the running batch's sequences it holds
    optimum.py    the exact best victim choices on small traces: every choice tried, through the
                  same Scheduler
"""

from .baselines import AddressSpace, FirstFitDesign, ReservedDesign
from .designs import CountingPagedDesign, ManagerPagedDesign, SharedTailDesign
from .replay import ReplayStats, max_concurrent_sequences, replay
from .traces import RoutingTrace, synthetic_trace

__all__ = ["AddressSpace", "CountingPagedDesign", "FirstFitDesign", "ReservedDesign", "ManagerPagedDesign", "ReplayStats", "RoutingTrace",
           "SharedTailDesign", "max_concurrent_sequences", "replay",
           "synthetic_trace"]
