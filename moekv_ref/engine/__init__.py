"""Serving: continuous batching over the paged per-expert KV cache (DESIGN.md §3).

    request.py       Request, its states (waiting, running, preempted, finished) and its output
    demand.py        blocks a request needs: worst case of a step, of a lifetime, and a prediction
    memory.py        KVMemory: the scheduler's only window onto the pool (and the swap space)
    swap.py          SwapSpace: a CPU pool that holds the blocks of sequences preempted by swap
    scheduler.py     Scheduler: admission, per-step worst-case reservation, preemption
    model_runner.py  ModelRunner: one forward_cached over the scheduled flat ragged batch
    engine.py        LLMEngine: add_request / step / generate, timeline and statistics;
                     generate_with_engine (what `generate --cache paged` runs)
    workload.py      workloads with arrivals, and running one through an engine
    figures.py       request timelines, pool use, prediction vs actual: data and plots
"""

from .engine import EngineStats, LLMEngine, RequestEvent, StepRecord, generate_with_engine
from .request import Request, RequestOutput, RequestStatus
from .scheduler import POLICIES, PREEMPTION_MODES, Scheduler, SchedulerConfig

__all__ = ["EngineStats", "LLMEngine", "POLICIES", "PREEMPTION_MODES", "Request", "RequestEvent",
           "RequestOutput", "RequestStatus", "Scheduler", "SchedulerConfig", "StepRecord", "generate_with_engine"]
