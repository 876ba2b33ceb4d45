"""Serving: continuous batching over the paged per-expert KV cache, module by module.

request.py       Request, its states (waiting, running, preempted, finished) and its output
demand.py        blocks a request needs: worst case of a step, of a lifetime, and a prediction
memory.py        ModelShape (the model's routing facts) and MemoryView (read-only memory facts, the cache's shape)
swap.py          SwapSpace: host block ids of sequences preempted by swap; BlockCopy
admission.py     admission policies: predicted, optimistic
reservation.py   reservation policies: what a step sets aside before the routers decide; worst_case
optimistic_reservation.py  the optimistic reservation: expected blocks, a step that runs short retried
victims.py       victim policies: newest_first, sequence_lru, expert_lru, pressure_aware, and
                 oracle and belady for trace replay (sim/runner.py)
batching.py      BatchingPolicy; continuous batching on the paged pool (continuous_paged)
baseline_batching.py  the benchmark's baselines as batching policies: continuous_reserved, static
scheduler_config.py  SchedulerConfig: the scheduler's limits and policies; the swap space's rule
scheduler_output.py  SchedulerOutput: what one step decided
scheduler.py     Scheduler: the paged loop over integers (reserve per device, preempt whole
                 sequences by recompute, admit)
fits_alone.py    the refusal of a request that might not fit the pool even alone
prefix_caching_scheduler.py  PrefixCachingScheduler: the Scheduler, starting from cached prefixes
row_evicting_scheduler.py    RowEvictingScheduler: the Scheduler, dropping single rows (stalls)
swapping_scheduler.py        SwappingScheduler: the Scheduler, preempting by swap
scheduler_factory.py  make_scheduler: the one place that chooses the scheduler's class
model_runner.py  ModelRunner: the swap copies, then one forward_cached over the flat batch
undo.py          Snapshot: the scheduler's state, restored in place when a step raises
engine.py        LLMEngine (add_request / step / abort_request / generate), generate_with_engine
workload.py      workloads with arrivals, and running one through an engine
"""

from .admission import AdmissionPolicy, OptimisticAdmission, PredictedAdmission
from .baseline_batching import ContinuousReserved, StaticBatching
from .batching import BatchingPolicy, ContinuousBatching
from .engine import EngineStats, LLMEngine, RequestEvent, StepRecord, generate_with_engine
from .memory import MemoryView, ModelShape
from .optimistic_reservation import OptimisticReservation
from .prefix_caching_scheduler import PrefixCachingScheduler
from .request import Request, RequestOutput, RequestStatus
from .reservation import ReservationPolicy, WorstCaseReservation
from .row_evicting_scheduler import RowEvictingScheduler
from .scheduler import Scheduler
from .scheduler_config import POLICIES, PREEMPTION_MODES, SchedulerConfig
from .scheduler_factory import make_scheduler
from .scheduler_output import SchedulerOutput
from .swap import BlockCopy, SwapSpace
from .swapping_scheduler import SwappingScheduler
from .victims import NewestFirst, VictimPolicy

__all__ = [
    "AdmissionPolicy",
    "BatchingPolicy",
    "BlockCopy",
    "ContinuousBatching",
    "ContinuousReserved",
    "EngineStats",
    "LLMEngine",
    "MemoryView",
    "ModelShape",
    "NewestFirst",
    "OptimisticAdmission",
    "OptimisticReservation",
    "POLICIES",
    "PREEMPTION_MODES",
    "PredictedAdmission",
    "PrefixCachingScheduler",
    "Request",
    "RequestEvent",
    "RequestOutput",
    "RequestStatus",
    "ReservationPolicy",
    "RowEvictingScheduler",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StaticBatching",
    "StepRecord",
    "SwapSpace",
    "SwappingScheduler",
    "VictimPolicy",
    "WorstCaseReservation",
    "generate_with_engine",
    "make_scheduler",
]
