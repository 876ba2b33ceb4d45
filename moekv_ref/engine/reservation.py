"""Reservation policies: how many blocks a step sets aside for its tokens before the routers decide.

    step_needs(requests, num_tokens, worst_case, memory, predictor) -> (m, D) blocks per device
    chunk_tokens(request, token_budget) -> int the tokens a request may run this step
    may_run_short(running, may_join, worst_case, memory, token_budget) -> bool
    retries                                    whether a step that ran short is scheduled again
    retry(out, error, previous) -> Retry       how (asked only of a policy that retries)
    repairs                                    whether a step that ran short drops chunks instead
    start_step() / note_fault(shortfall)       a step begins / a layer ran short by (D,) blocks
    release(request)                           a request left (what a policy kept of it goes)

`worst_case(requests, num_tokens)` is the scheduler's worst case of those tokens (m, D): what a step
could take at most, whatever the routers decide (demand.py's bounds over every row).

    worst_case   WorstCaseReservation (here, the default): a step reserves its tokens' worst case,
                 so no forward ever runs short
    optimistic   optimistic_reservation.py: decode tokens reserve nothing and a prefill chunk what
                 the predictor expects; a step that runs short is undone and scheduled again
    calibrated   calibrated_reservation.py: decode tokens reserve their worst case, a prefill chunk
                 a quantile of its blocks per device; a layer that runs short drops the chunk
                 scheduled last and the forward goes on for the others (Scheduler.repair)
    clairvoyant  sim/clairvoyant.py, trace replay only: exactly the blocks the trace will take
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..state import Stateful
from .demand import DemandPredictor
from .memory import MemoryView
from .request import Request

# the scheduler's worst case of the next num_tokens[i] tokens of requests[i]: (m, D)
WorstCase = Callable[[list[Request], list[int]], torch.Tensor]


@dataclass(frozen=True)
class Retry:
    """How to schedule a step again after a try ran short (`ReservationPolicy.retry`): free
    `shortfall` (D,) blocks beyond those free now, by the victim policy, and admit at most
    `max_admissions` requests."""

    shortfall: torch.Tensor
    max_admissions: int


class ReservationPolicy(Stateful):
    # a policy that remembers something across steps lists it in STATE (moekv_ref/state.py)

    name = "reservation"
    retries = False  # whether a step may run short, to be undone and scheduled again
    repairs = False  # whether a step may run short, to drop its last chunks and go on (Scheduler.repair)

    def step_needs(
        self,
        requests: list[Request],
        num_tokens: list[int],
        worst_case: WorstCase,
        memory: MemoryView,
        predictor: DemandPredictor,
    ) -> torch.Tensor:
        """(m, D) the blocks the step reserves for the next num_tokens[i] tokens of requests[i]."""
        raise NotImplementedError

    def chunk_tokens(self, request: Request, token_budget: int) -> int:
        """The tokens `request` may run this step within the step's remaining `token_budget`: all
        its pending ones that fit (a policy may cap prefill chunks)."""
        return min(request.num_pending_tokens, token_budget)

    def start_step(self) -> None:
        """A step's scheduling begins (a policy that adapts across steps updates here)."""

    def note_fault(self, shortfall: torch.Tensor) -> None:
        """A layer of the step found devices short by shortfall (D,) blocks (a policy that repairs
        is told, once per chunk dropped)."""

    def release(self, request: Request) -> None:
        """`request` has left the scheduler for good (Scheduler.finish): a policy that keeps
        something per request forgets it here, so that what it keeps stays bounded by the requests
        in flight."""

    def may_run_short(
        self,
        running: Sequence[Request],
        may_join: bool,
        worst_case: WorstCase,
        memory: MemoryView,
        token_budget: int,
    ) -> bool:
        """Whether the next step could find a device full (may_join: a waiting request may join
        it). False: no try of it needs undoing (the trace runner then takes no snapshot)."""
        return False

    def retry(self, out, error, previous: Retry | None) -> Retry:
        """How to schedule the step again after the try that decided `out` (a SchedulerOutput) ran
        short with `error` (an OutOfBlocksError); `previous`: the retry that try was given."""
        raise ValueError(f"reservation={self.name!r} never runs short: a step under it is not retried")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WorstCaseReservation(ReservationPolicy):
    """A step reserves, on every device, the most blocks its tokens could open whatever the routers
    decide (the default): no forward ever runs short, at the price of memory held back for
    routings that rarely happen."""

    name = "worst_case"

    def step_needs(self, requests, num_tokens, worst_case, memory, predictor) -> torch.Tensor:
        return worst_case(requests, num_tokens)
