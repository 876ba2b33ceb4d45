"""A cache-only simulator: routing traces replayed through memory designs, without the model.

traces.py     what the router decided, token by token: synthetic, or recorded (analysis.py)
designs.py    paged designs; contiguous_designs.py the designs paging must beat (reserved, first fit)
replay.py     lock-step replay of a trace through a design; capacity under a budget
runner.py     serving over a trace: the engine's own Scheduler, with the trace playing the model
clairvoyant.py  the reservation that reads the trace's future: the bound the others are measured by
steady_state.py  steady-state measurement: the window, attainment, goodput by bisection, capacity
optimum.py    the exact best victim choices on small traces; density.py expert buffer density
workloads.py  published request lengths, arrivals, latency under SLOs; a skewed workload
cluster.py    the cluster bench cluster simulates: its model, block size, placement, pools
"""

from .contiguous_designs import AddressSpace, FirstFitDesign, ReservedDesign
from .designs import CountingPagedDesign, ManagerPagedDesign, SharedTailDesign
from .replay import ReplayStats, max_concurrent_sequences, replay
from .traces import RoutingTrace, synthetic_trace

__all__ = [
    "AddressSpace",
    "CountingPagedDesign",
    "FirstFitDesign",
    "ReservedDesign",
    "ManagerPagedDesign",
    "ReplayStats",
    "RoutingTrace",
    "SharedTailDesign",
    "max_concurrent_sequences",
    "replay",
    "synthetic_trace",
]
