"""The scheduler's configuration: its limits and policies (SchedulerConfig), the swap space's one
rule (check_swap_space), and the check of a scheduler's arguments (check_scheduler_arguments)."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.kv_cache_manager import KVCacheManager
from ..cache.options import check_pool_fits
from ..validation import MAX_BLOCKS, MAX_INT32, check_choice, check_int, known_keywords
from .admission import ADMISSIONS, AdmissionPolicy
from .baseline_batching import ContinuousReserved, StaticBatching
from .batching import BatchingPolicy, ContinuousBatching
from .calibrated_reservation import CalibratedReservation
from .memory import ModelShape
from .optimistic_reservation import OptimisticReservation
from .per_device_admission import PerDevicePredictedAdmission
from .reservation import ReservationPolicy, WorstCaseReservation
from .victims import VICTIM_POLICIES, VictimPolicy

POLICIES = ("static", "continuous_reserved", "continuous_paged")
PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_POLICIES = {**ADMISSIONS, PerDevicePredictedAdmission.name: PerDevicePredictedAdmission}
RESERVATION_POLICIES = {
    "worst_case": WorstCaseReservation,
    "optimistic": OptimisticReservation,
    "calibrated": CalibratedReservation,
}
RESERVATIONS = tuple(RESERVATION_POLICIES)


@known_keywords
@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and policies, each given by name or as a policy object; admission
    (default "predicted") applies to continuous_paged only."""

    max_num_seqs: int = 16  # sequences running at once
    max_num_batched_tokens: int = 256  # tokens in one forward (prefill chunks + decode tokens)
    policy: str | BatchingPolicy = "continuous_paged"
    admission: str | AdmissionPolicy | None = None
    preemption_mode: str = "recompute"
    victim: str | VictimPolicy = "newest_first"
    # what a step sets aside before the routers decide (reservation.py): worst_case, what its tokens
    # could take at most, or a policy that may run short (optimistic, calibrated), continuous_paged only
    reservation: str | ReservationPolicy = "worst_case"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1, MAX_INT32))
        for name, allowed, kind in (
            ("policy", POLICIES, BatchingPolicy),
            ("admission", tuple(ADMISSION_POLICIES), AdmissionPolicy),
            ("preemption_mode", PREEMPTION_MODES, None),
            ("reservation", RESERVATIONS, ReservationPolicy),
            ("victim", tuple(VICTIM_POLICIES), VictimPolicy),
        ):
            value = getattr(self, name)
            if (value is None and name == "admission") or (kind and isinstance(value, kind)):
                continue
            check_choice(name, value, allowed, f", or a policy object ({kind.__name__})" if kind else "")
        reservation = self.make_reservation_policy()
        if reservation.repairs and self.preemption_mode != "recompute":
            raise ValueError(
                f"reservation={reservation.name!r} drops a chunk from a step that ran short by "
                f"recompute, not preemption_mode={self.preemption_mode!r}: a swap-out would have "
                "to copy blocks the forward has already started to fill"
            )
        if (reservation.retries or reservation.repairs) and self.policy != "continuous_paged":
            raise ValueError(
                f"reservation={self.reservation!r} applies to policy='continuous_paged' only, not "
                f"policy={self.policy!r} (whose admission reserves whole lifetimes)"
            )
        if self.admission is not None and self.policy != "continuous_paged":
            raise ValueError(
                f"admission={self.admission!r} applies to policy='continuous_paged' only, "
                f"not policy={self.policy!r} (which has its own admission rule)"
            )

    def make_batching_policy(self) -> BatchingPolicy:
        """A fresh policy object for a name; a policy object is used as given."""
        if isinstance(self.policy, BatchingPolicy):
            return self.policy
        if self.policy != "continuous_paged":
            return StaticBatching() if self.policy == "static" else ContinuousReserved()
        admission = self.admission or "predicted"
        return ContinuousBatching(
            ADMISSION_POLICIES[admission]() if isinstance(admission, str) else admission
        )

    def make_victim_policy(self) -> VictimPolicy:
        return self.victim if isinstance(self.victim, VictimPolicy) else VICTIM_POLICIES[self.victim]()

    def make_reservation_policy(self) -> ReservationPolicy:
        if isinstance(self.reservation, ReservationPolicy):
            return self.reservation
        return RESERVATION_POLICIES[self.reservation]()


def check_scheduler_arguments(scheduler_class, config, manager, shape, num_swap_blocks) -> int:
    """A scheduler's arguments' types; its swap space's blocks (check_swap_space) where its manager
    can swap, which it returns; and the rules where the config meets the manager, and the class: a
    Scheduler refuses what only a variant serves (scheduler_factory.make_scheduler builds it)."""
    for name, value, kind in (
        ("config", config, SchedulerConfig),
        ("shape", shape, ModelShape),
        ("manager", manager, KVCacheManager),
    ):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    num_swap_blocks = check_swap_space(num_swap_blocks, config.preemption_mode)
    if num_swap_blocks and not manager.can_swap:
        raise ValueError(
            f"num_swap_blocks={num_swap_blocks}: a swap copies a sequence's blocks by id, which "
            f"this manager ({type(manager).__name__}) does not list; allowed: num_swap_blocks=0, "
            "or a KVCacheManager, which lists them"
        )
    # by name: continuous_reserved is a ContinuousBatching too, with an admission of its own
    if manager.num_devices > 1 and config.make_batching_policy().name != ContinuousBatching.name:
        raise ValueError(f"per-device pools run policy='continuous_paged' only, not {config.policy!r}")
    victim = config.make_victim_policy()
    if victim.evicts_rows and not manager.can_evict_rows:
        raise ValueError(
            f"victim={victim.name!r} drops single rows, which this cache cannot: "
            f"{type(manager).__name__} shares blocks between rows; use a victim that preempts "
            "whole sequences (newest_first, sequence_lru, pressure_aware)"
        )
    for what, needed, served in (
        (f"victim={victim.name!r} drops single rows", victim.evicts_rows, scheduler_class.takes_rows),
        ("preemption_mode='swap' swaps", num_swap_blocks > 0, scheduler_class.swaps),
    ):
        if needed and not served:
            raise ValueError(
                f"{what}, which a {scheduler_class.__name__} does not: build the scheduler with "
                "make_scheduler (scheduler_factory.py)"
            )
    return num_swap_blocks


def check_swap_space(num_swap_blocks, preemption_mode: str) -> int:
    """The swap space's blocks: an integer in [0, MAX_BLOCKS], more than 0 exactly when preempting by
    swap (the engine and the scheduler's one rule)."""
    num_swap_blocks = check_int("num_swap_blocks", num_swap_blocks, 0, MAX_BLOCKS, "0: no swap space")
    if num_swap_blocks and preemption_mode != "swap":
        raise ValueError(
            f"num_swap_blocks={num_swap_blocks} applies to preemption_mode='swap', not {preemption_mode!r}"
        )
    if preemption_mode == "swap" and not num_swap_blocks:
        raise ValueError("preemption_mode='swap' needs a swap space: give the engine num_swap_blocks > 0")
    check_pool_fits(num_swap_blocks)
    return num_swap_blocks
