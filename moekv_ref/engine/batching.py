"""Batching policies: which waiting requests join the running batch at a step, how many blocks one
request may need alone, and how many tokens a request decodes.

    continuous_paged     ContinuousBatching (here)
    continuous_reserved  baseline_batching.py: the same, each request reserving every row's worst case
    static               baseline_batching.py: fixed batches, each padded to its longest output
"""

from __future__ import annotations

from itertools import islice

from ..state import Stateful
from .admission import AdmissionPolicy, PredictedAdmission
from .demand import DemandPredictor, worst_case_lifetime_blocks
from .memory import MemoryView
from .request import Request


class AdmissionStep:
    """One step's admission, as a batching policy sees it (in a step that preempted nothing): the
    waiting line, the running requests, a read-only MemoryView, the predictor, the step's budget and
    reservation; `start_next` is the policy's only move. The Scheduler is not imported here: it uses
    the policies, never the other way round."""

    def __init__(
        self,
        scheduler: "Scheduler",  # noqa: F821 (not imported: the scheduler imports this module)
        out: "SchedulerOutput",  # noqa: F821
        token_budget: int,
        reserved,
        max_admissions: int | None = None,
    ):
        self._scheduler = scheduler
        self._out = out
        self._max_admissions = max_admissions  # a retried step's limit (scheduler.Retry); None: none
        self.token_budget = token_budget  # tokens the step may still run
        self.reserved = reserved  # worst case already reserved by the step ((D,): per device)
        self.memory: MemoryView = scheduler.memory
        self.predictor: DemandPredictor = scheduler.predictor
        self.max_num_seqs: int = scheduler.config.max_num_seqs
        self.victims = scheduler.victims  # its `admits` may veto too

    @property
    def head(self) -> Request | None:
        """Preempted requests come first in the waiting line."""
        return self._scheduler.waiting[0] if self._scheduler.waiting else None

    def peek(self, num_requests: int) -> list[Request]:
        return list(islice(self._scheduler.waiting, num_requests))  # not the whole line

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._scheduler.running)

    @property
    def has_room(self) -> bool:
        joined = len(self._out.admitted) + len(self._out.resumed)
        return (
            len(self._scheduler.running) < self.max_num_seqs
            and self.token_budget > 0
            and (self._max_admissions is None or joined < self._max_admissions)
        )

    def step_fits(self, request: Request) -> bool:
        """Would the request's next tokens (and its swap-in) fit every device beside the step's
        reservation?"""
        self._scheduler.deciding_on(request)
        return self._scheduler.head_fits(request, self.reserved, self.token_budget)

    def start_next(self) -> Request:
        """Start the head of the line, scheduling and reserving its next tokens within budget."""
        request = self._scheduler.start_head(self._out)
        num_tokens = self._scheduler.reservation.chunk_tokens(request, self.token_budget)
        if num_tokens > 0:
            need = self._scheduler.step_blocks(request, num_tokens)
            self._scheduler.schedule_tokens(self._out, request, num_tokens, int(need.sum()))
            self.reserved = self.reserved + need
            self.token_budget -= num_tokens
        return request


class BatchingPolicy(Stateful):
    """One object serves one scheduler: it may keep per-request state, dropped in `release`."""

    # a policy that remembers something across steps lists it in STATE (moekv_ref/state.py)

    name = "batching"

    def max_blocks_alone(self, num_cached_tokens: int, memory: MemoryView) -> int:
        """The most blocks one request could need alone (above the pool: refused when added)."""
        raise NotImplementedError

    def num_new_tokens(self, request: Request) -> int:
        return request.max_new_tokens

    def admits_on_prediction(self) -> bool:
        """Whether admission decides on the predictor's estimate (each request's predicted_blocks is
        recorded either way)."""
        return False

    def admit(self, step: AdmissionStep) -> None:
        raise NotImplementedError

    def release(self, request: Request) -> None:
        """The request left the engine."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ContinuousBatching(BatchingPolicy):
    """Admit the head of the line while its next step fits and the admission policy (and the victim
    policy's `admits`) allows: more sequences share the pool than under any lifetime reservation,
    and the admission policy keeps that from turning into preemptions."""

    PARTS = ("admission",)

    name = "continuous_paged"

    def __init__(self, admission: AdmissionPolicy | None = None):
        self.admission = admission if admission is not None else PredictedAdmission()

    def admits_on_prediction(self) -> bool:
        return self.admission.uses_prediction

    def max_blocks_alone(self, num_cached_tokens: int, memory: MemoryView) -> int:
        return worst_case_lifetime_blocks(
            num_cached_tokens,
            memory.num_layers,
            memory.num_experts,
            memory.shape.k_max,
            memory.block_size,
            memory.max_row_tokens,
        )

    def admit(self, step: AdmissionStep) -> None:
        while step.head is not None and step.has_room:
            request = step.head
            if not step.step_fits(request):
                break
            if step.running and not (
                self.admission.allows(request, step.running, step.memory, step.predictor)
                and step.victims.admits(request, step.running, step.memory)
            ):
                break  # FIFO: no request overtakes the head of the line
            step.start_next()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.admission!r})"
