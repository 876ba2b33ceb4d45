"""Batching policies: which waiting requests join the running batch at a step, how many blocks one
request may need alone, and how many tokens a request decodes.

In a step that preempted nothing the scheduler hands admission to the batching policy through an
AdmissionStep: what the policy may see (the waiting line, the running requests, a read-only
MemoryView, the predictor, the step's budget and reservation) and the one thing it may do (start
the request at the head of the line).

    continuous_paged     ContinuousBatching (here): at every step, admit the head of the line while
                         its next step fits and the admission policy (admission.py) allows
    continuous_reserved  baselines.py: the same, each request reserving every row's worst case
    static               baselines.py: fixed batches, each padded to its longest output
"""

from __future__ import annotations

from .admission import AdmissionPolicy, PredictedAdmission
from .demand import DemandPredictor, worst_case_lifetime_blocks
from .memory import MemoryView, ModelShape
from .request import Request


class AdmissionStep:
    """One step's admission, as a batching policy sees it; `start_next` is the policy's only move.
    Built by the Scheduler with itself and the step's SchedulerOutput (not imported here: the
    scheduler uses the policies, never the other way round, so no import circle forms)."""

    def __init__(self, scheduler: "Scheduler", out: "SchedulerOutput", token_budget: int, reserved):
        self._scheduler = scheduler
        self._out = out
        self.token_budget = token_budget      # tokens the step may still run
        self.reserved = reserved              # worst case already reserved by the step ((D,): per device)
        self.memory: MemoryView = scheduler.memory
        self.predictor: DemandPredictor = scheduler.predictor
        self.shape: ModelShape = scheduler.memory.shape
        self.max_num_seqs: int = scheduler.config.max_num_seqs
        self.victims = scheduler.victims      # its `admits` may veto too (victims.py: only the oracle does)
        self._hits = {}                       # request id -> the prefix hit step_fits chose it starts from

    @property
    def head(self) -> Request | None:
        """The request at the head of the waiting line (preempted ones first), or None."""
        return self._scheduler.waiting[0] if self._scheduler.waiting else None

    def peek(self, num_requests: int) -> list[Request]:
        """The first `num_requests` of the waiting line, in order."""
        return list(self._scheduler.waiting)[:num_requests]

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._scheduler.running)

    @property
    def has_room(self) -> bool:
        """A sequence slot and some token budget are left."""
        return len(self._scheduler.running) < self.max_num_seqs and self.token_budget > 0

    def step_fits(self, request: Request) -> bool:
        """Would the request's next tokens (and its swap-in) fit the free pool (every device) beside
        what the step has reserved?"""
        scheduler = self._scheduler
        scheduler.current = request
        memory, request_id = scheduler.memory, request.request_id
        num_tokens = min(request.num_pending_tokens, self.token_budget)
        need = scheduler.step_blocks(request, num_tokens)
        hit = scheduler.prefix_hit(request)             # prefix caching: it starts from a cached prefix
        if hit is not None:
            hit_need = scheduler.hit_step_blocks(hit, min(request.num_tokens - hit.num_tokens, self.token_budget))
            if scheduler.fits(self.reserved + hit_need):
                self._hits[request.request_id] = hit
                return True
            # the hit holds more free blocks than it saves now (cached-free blocks it shares, copy
            # sources pinned while it is applied): start from nothing if that fits
            return scheduler.fits(self.reserved + need)
        if request_id in scheduler.stalled:            # its dead rows go when it starts
            need = need - memory.blocks_held_per_device(request_id)
        return scheduler.fits(self.reserved + memory.swapped_blocks_per_device(request_id) + need)

    def start_next(self) -> Request:
        """Start the head of the line and schedule its next tokens within the budget, reserving
        their worst case. Returns it."""
        request = self._scheduler.start_head(self._out, self._hits.pop(self.head.request_id, None))
        num_tokens = min(request.num_pending_tokens, self.token_budget)
        if num_tokens > 0:
            need = self._scheduler.step_blocks(request, num_tokens)
            self._scheduler.schedule_tokens(self._out, request, num_tokens, need)
            self.reserved = self.reserved + need
            self.token_budget -= num_tokens
        return request


class BatchingPolicy:
    """Who joins the running batch, and what one request may need alone (subclasses give
    `max_blocks_alone` and `admit`). One object serves one scheduler: it may keep per-request state,
    dropped in `release`."""
    name = "batching"

    def max_blocks_alone(self, num_cached_tokens: int, shape: ModelShape) -> int:
        """The most blocks one request of `num_cached_tokens` cached tokens could need, alone (a
        request above the pool is refused when added)."""
        raise NotImplementedError

    def num_new_tokens(self, request: Request) -> int:
        """Tokens the request decodes before it finishes."""
        return request.max_new_tokens

    def admit(self, step: AdmissionStep) -> None:
        """Start waiting requests (step.start_next) while this policy allows."""
        raise NotImplementedError

    def release(self, request: Request) -> None:
        """Forget anything kept about a request that left the engine."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ContinuousBatching(BatchingPolicy):
    """Continuous batching on the paged pool: the head of the line is admitted while its next step
    fits and the admission policy (and the victim policy's `admits`) allows. Reserving only the next
    step's worst case lets more sequences share the pool than any reservation; the admission policy
    keeps that from turning into preemptions."""
    name = "continuous_paged"

    def __init__(self, admission: AdmissionPolicy | None = None):
        self.admission = admission if admission is not None else PredictedAdmission()

    def max_blocks_alone(self, num_cached_tokens: int, shape: ModelShape) -> int:
        return worst_case_lifetime_blocks(num_cached_tokens, shape.num_layers, shape.num_experts,
                                          shape.k_max, shape.block_size)

    def admit(self, step: AdmissionStep) -> None:
        while step.head is not None and step.has_room:
            request = step.head
            if not step.step_fits(request):
                break
            if step.running and not (self.admission.allows(request, step.running, step.memory, step.predictor)
                                     and step.victims.admits(request, step.running, step.memory)):
                break                  # FIFO: no request overtakes the head of the line
            step.start_next()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.admission!r})"
