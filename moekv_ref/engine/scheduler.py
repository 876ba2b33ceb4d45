"""The scheduler: at every step, which requests run, which are admitted, which are preempted.

One step, in order (vLLM v1's loop, with MoE-aware memory checks):

 1. Running requests, oldest first, get their pending tokens (a prefill chunk, or one decode token)
    within the token budget, reserving what the reservation policy sets aside for them (by default
    the *worst case* of blocks those tokens can open: demand.py).
    While that does not fit, the victim policy picks a running request not yet scheduled this step
    (the newest, by default), preempted by recompute or by swap (possibly the request itself).
 2. If nothing was preempted: the batching policy admits waiting requests, preempted ones first
    (they keep their place in line), within the step's budgets, reservation and admission rule.
 3. `update_from_output`: tokens counted as computed, sampled tokens appended, requests at their
    last token finished and their blocks freed.

Only the next step's worst case is reserved, because a forward runs every layer and cannot stop
half-way when a layer's experts are full; the whole life's is k_max / k_avg times more than
threshold routing needs (what `continuous_reserved` pays). Admission adds a prediction
(admission.py): the step guarantee alone admits requests certain to be preempted later.

Whole sequences are preempted, never single experts' rows: a row at layer l is rebuilt only by
re-running the whole sequence (K/V at layer l depend on every earlier layer), so freeing 1/E of a
layer's share costs a whole recompute. A victims.RowEviction shows why: its request *stalls* at the
head of the line, to be recomputed whole, while its other rows stay in the pool as dead weight,
freed first when their device is short, when nothing runs, and when it resumes (only where the
block manager `can_evict_rows`: plain pages, no shared tails, no prefix caching).

The pool has D devices (one pool: D = 1) and a step must fit every device: the reservation is a (D,)
vector and the victim policy is told which device is short (victims.Shortage). Only
continuous_paged runs several devices. With prefix caching a request holding nothing may start from
a cached prefix (`prefix_hit`), reserving its remaining tokens' worst case plus the free blocks the
hit takes.

The scheduler sees integers only (the block manager and memory.ModelShape), never K/V; its decisions
leave `schedule()` in one SchedulerOutput, whose block copies the runner performs, in order, before
the forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.block_pool import check_pool_fits
from ..cache.kv_cache_manager import KVCacheManager
from ..state import Stateful
from ..validation import MAX_BLOCKS, MAX_INT32, check_choice, check_int, known_keywords
from .admission import ADMISSIONS, AdmissionPolicy
from .baseline_batching import ContinuousReserved, StaticBatching
from .batching import AdmissionStep, BatchingPolicy, ContinuousBatching
from .demand import (
    DemandPredictor,
    blocks_held_per_device,
    min_lifetime_blocks,
    step_need,
    worst_case_lifetime_blocks_per_device,
    worst_case_step_blocks_per_device,
)
from .memory import MemoryView, ModelShape
from .optimistic_reservation import OptimisticReservation
from .request import Request, RequestStatus
from .reservation import ReservationPolicy, Retry, WorstCaseReservation
from .swap import COPY, BlockCopy, SwapSpace
from .victims import VICTIM_POLICIES, RowEviction, Shortage, VictimPolicy

POLICIES = ("static", "continuous_reserved", "continuous_paged")
PREEMPTION_MODES = ("recompute", "swap")
RESERVATION_POLICIES = {"worst_case": WorstCaseReservation, "optimistic": OptimisticReservation}
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
    # could take at most, or a policy that may run short (optimistic), continuous_paged only
    reservation: str | ReservationPolicy = "worst_case"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1, MAX_INT32))
        for name, allowed, kind in (
            ("policy", POLICIES, BatchingPolicy),
            ("admission", tuple(ADMISSIONS), AdmissionPolicy),
            ("preemption_mode", PREEMPTION_MODES, None),
            ("reservation", RESERVATIONS, ReservationPolicy),
            ("victim", tuple(VICTIM_POLICIES), VictimPolicy),
        ):
            value = getattr(self, name)
            if (value is None and name == "admission") or (kind and isinstance(value, kind)):
                continue
            check_choice(name, value, allowed, f", or a policy object ({kind.__name__})" if kind else "")
        if self.make_reservation_policy().retries and self.policy != "continuous_paged":
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
        return ContinuousBatching(ADMISSIONS[admission]() if isinstance(admission, str) else admission)

    def make_victim_policy(self) -> VictimPolicy:
        return self.victim if isinstance(self.victim, VictimPolicy) else VICTIM_POLICIES[self.victim]()

    def make_reservation_policy(self) -> ReservationPolicy:
        if isinstance(self.reservation, ReservationPolicy):
            return self.reservation
        return RESERVATION_POLICIES[self.reservation]()


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


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens this step runs for it
    reserved_blocks: int  # worst case those tokens can take from the pool (summed over devices)
    samples: bool = True  # the tokens end its pending ones: the step samples its next token


@dataclass(frozen=True)
class EvictionRecord:
    """One victim taken off at `step` while `short_device` was short (mode "recompute", "swap" or
    "rows"), and the blocks that freed on each device."""

    step: int
    request_id: int
    mode: str
    short_device: int
    freed: list[int]  # (D,)


@dataclass
class SchedulerOutput:
    """What one `schedule` decided: the runner performs `block_copies`, in order, then runs
    `scheduled`; the engine records the rest."""

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)  # swap-outs and swap-ins, in order
    admitted: list[Request] = field(default_factory=list)  # first time running
    resumed: list[Request] = field(default_factory=list)  # running again after a preemption
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)  # preempted by swap (a SWAP_OUT copy each)
    swapped_in: list[Request] = field(default_factory=list)  # resumed from swap (a SWAP_IN copy each)
    prefix_copied: list[Request] = field(default_factory=list)  # started from a hit with COPY block copies
    freed: list[int] = field(default_factory=list)  # sequences whose blocks went back
    events: list[tuple[str, Request]] = field(default_factory=list)  # admitted/resumed/preempted, in order
    evictions: list[EvictionRecord] = field(default_factory=list)  # every victim chosen, in order

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def reserved_blocks(self) -> int:
        return sum(s.reserved_blocks for s in self.scheduled)


class Scheduler(Stateful):
    """Between steps every request is in exactly one of `waiting` (WAITING or PREEMPTED) and
    `running` (RUNNING), or is FINISHED and in neither; only a swap-PREEMPTED request holds swap
    blocks, and it holds no pool blocks."""

    STATE = (
        "waiting",
        "running",
        "stalled",
        "current",
        "num_preemptions",
        "num_recomputed_tokens",
        "num_swapped_out_blocks",
        "num_evictions",
        "freed_on_short_device",
        "num_row_evictions",
        "num_evicted_rows",
        "num_dead_rows_freed",
    )
    # the manager holds the prefix cache, shared tails and budget; the memory view holds nothing
    PARTS = ("manager", "swap_space", "predictor", "batching", "victims", "reservation")

    def __init__(
        self,
        config: SchedulerConfig,
        manager: KVCacheManager,
        shape: ModelShape,
        num_swap_blocks: int = 0,
        checked: bool = False,
    ):
        """checked=True: the caller (the engine) checked num_swap_blocks with check_swap_space; the
        rules comparing the config with the manager are checked here, where the two meet."""
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if not isinstance(shape, ModelShape):
            raise ValueError(f"shape must be a ModelShape, got {type(shape).__name__}")
        if not isinstance(manager, KVCacheManager):
            raise ValueError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        if not checked:
            num_swap_blocks = check_swap_space(num_swap_blocks, config.preemption_mode)
        if num_swap_blocks and not manager.can_swap:
            raise ValueError(
                f"num_swap_blocks={num_swap_blocks}: a swap copies a sequence's blocks by id, which "
                f"this manager ({type(manager).__name__}) does not list; allowed: num_swap_blocks=0, "
                "or a KVCacheManager, which lists them"
            )
        self.config = config
        self.manager = manager
        self.swap_space = SwapSpace(manager, num_swap_blocks, checked=True) if num_swap_blocks else None
        self.prefix_cache = manager.prefix_cache  # None: no prefix caching
        self.memory = MemoryView(manager, shape, self.swap_space)
        self.num_devices = self.memory.num_devices
        self.shape = shape
        memory = self.memory
        self.predictor = DemandPredictor(
            memory.num_layers, memory.num_experts, shape.k_max, memory.block_size, memory.max_row_tokens
        )
        self.batching = config.make_batching_policy()
        # by name: continuous_reserved is a ContinuousBatching too, with an admission of its own
        paged = self.batching.name == ContinuousBatching.name
        if self.prefix_cache is not None and not paged:
            raise ValueError(
                f"prefix caching works with policy='continuous_paged' only, not {config.policy!r}: "
                "a hit takes blocks at admission, which only that policy's step check counts"
            )
        if self.num_devices > 1 and not paged:
            raise ValueError(f"per-device pools run policy='continuous_paged' only, not {config.policy!r}")
        self.victims = config.make_victim_policy()
        if self.victims.evicts_rows and not manager.can_evict_rows:
            raise ValueError(
                f"victim={self.victims.name!r} drops single rows, which this cache cannot: shared "
                "tails and prefix caching share blocks between rows; use a victim that preempts "
                "whole sequences (newest_first, sequence_lru, pressure_aware)"
            )
        self.reservation = config.make_reservation_policy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stalled: dict[int, Request] = {}  # request id -> request whose rows were evicted, in order
        self.current: Request | None = None  # the request schedule() was deciding on
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_evictions = 0
        self.freed_on_short_device = 0
        self.num_row_evictions = 0
        self.num_evicted_rows = 0
        self.num_dead_rows_freed = 0

    def save(self) -> tuple:
        """Stateful.save, with every unfinished request's state (engine/undo.py)."""
        requests = {id(r): r for r in (*self.waiting, *self.running, *self.stalled.values())}
        return super().save(), [(r, r.save()) for r in requests.values()]

    def restore(self, saved: tuple) -> None:
        own, requests = saved
        super().restore(own)
        for request, state in requests:
            request.restore(state)

    # ----- requests in ------------------------------------------------------------------------------
    def max_blocks_alone(self, num_cached_tokens: int) -> int:
        return self.batching.max_blocks_alone(num_cached_tokens, self.memory)

    def check_fits_alone(self, prompt_len: int, max_new_tokens: int, request_id: int = 0) -> None:
        """ValueError if a request of this shape might not fit the pool even alone: preemption frees
        only *other* sequences' memory, so once admitted it could never finish. request_id: whose
        rows' devices to check (with home devices they depend on it)."""
        shape = self.shape
        memory = self.memory
        num_blocks = memory.num_blocks
        num_tokens = prompt_len + max_new_tokens - 1
        worst = self.max_blocks_alone(num_tokens)
        if worst <= num_blocks:
            self._check_fits_each_device(prompt_len, max_new_tokens, request_id)
            return
        budget = self.manager.budget  # a row budget lowers the fewest blocks as it lowers the most
        limits = None if budget is None else budget.layer_limits.tolist()
        least = min_lifetime_blocks(num_tokens, memory.num_layers, shape.k_min, memory.block_size, limits)
        verdict = "can never fit" if least > num_blocks else "may not fit even alone"
        prompt_worst = self.max_blocks_alone(prompt_len)
        if prompt_worst > num_blocks:
            fix = (
                f"the prompt alone may need {prompt_worst}: give the pool at least {worst} blocks "
                "or shorten the prompt"
            )
        else:
            longest = max(
                t for t in range(prompt_len, num_tokens + 1) if self.max_blocks_alone(t) <= num_blocks
            )
            fix = (
                f"lower max_new_tokens to at most {longest - prompt_len + 1}, or give the pool at least "
                f"{worst} blocks"
            )
        raise ValueError(
            f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} {verdict} in the "
            f"pool of {num_blocks} blocks: it needs at least {least} and up to {worst} blocks "
            f"({memory.num_layers} layers, up to {shape.k_max} experts per token, "
            f"block size {memory.block_size}); {fix}"
        )

    def _check_fits_each_device(self, prompt_len: int, max_new_tokens: int, request_id: int) -> None:
        shape, memory = self.shape, self.memory
        worst = worst_case_lifetime_blocks_per_device(
            torch.tensor([prompt_len + max_new_tokens - 1]),
            shape.k_max,
            memory.block_size,
            memory.placement.of_sequences([request_id]),
            self.num_devices,
            memory.max_row_tokens,
        )[0]  # (D,)
        over = (worst > memory.blocks_per_device).nonzero().squeeze(1)
        if over.numel():
            d = int(over[0])
            raise ValueError(
                f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} may not "
                f"fit device {d} even alone: its rows there may need up to {int(worst[d])} blocks, "
                f"the device has {int(memory.blocks_per_device[d])}; lower max_new_tokens or give "
                f"device {d} at least {int(worst[d])} blocks"
            )

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- one step ---------------------------------------------------------------------------------
    def schedule(self, step: int, retry: Retry | None = None) -> SchedulerOutput:
        """One step's decisions; an exception gets a note naming the request being decided on (the
        engine undoes the partial decisions: undo.py). retry: how to try again a step whose earlier
        try ran short (given only where the policy `retries`)."""
        self.current = None
        if retry is not None and not self.reservation.retries:
            raise ValueError(
                f"a retry is given only to schedule a step again under a reservation that retries, "
                f"not reservation={self.reservation.name!r}"
            )
        try:
            return self._schedule(step, retry)
        except BaseException as error:
            if self.current is not None:  # every exception has add_note (Python 3.11+)
                error.add_note(
                    f"while scheduling request {self.current.request_id} ({self.current.status.value}) at step {step}"
                )
            raise

    def _schedule(self, step: int, retry: Retry | None) -> SchedulerOutput:
        out = SchedulerOutput(step)
        self.manager.start_step(step)  # the rows this step appends remember it
        token_budget = self.config.max_num_batched_tokens
        # a retry short of blocks reserves every block free now plus the shortfall: victims go until
        # that many are free
        shortfall = None if retry is None or not bool(retry.shortfall.any()) else retry.shortfall
        base = (
            torch.zeros(self.num_devices, dtype=torch.int64)
            if shortfall is None
            else self.memory.num_free_blocks_per_device + shortfall
        )  # (D,)
        # every running request's need, in one call; a request the budget cuts short is asked again
        planned = [min(r.num_pending_tokens, token_budget) for r in self.running]
        needs = self.step_blocks_many(self.running, planned)  # (m, D)
        reserved, token_budget = self.schedule_running(out, planned, needs, base, token_budget, shortfall)
        max_admissions = None if retry is None else retry.max_admissions
        if (
            not out.preempted and max_admissions != 0
        ):  # a step that had to preempt admits none: it would thrash
            if not self.running:
                self._free_dead_rows(None)
            self.batching.admit(AdmissionStep(self, out, token_budget, reserved, max_admissions))
        return out

    def schedule_running(
        self,
        out: SchedulerOutput,
        planned: list[int],
        needs: torch.Tensor,
        reserved: torch.Tensor,
        token_budget: int,
        shortfall: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        """Step 1 of the module docstring: the running requests, oldest first, each given its planned
        tokens (needs[i], (D,), reserved for them) while they fit on top of `reserved`, victims
        preempted until they do. Returns the step's reservation and the token budget left."""
        planned_needs = dict(zip(map(id, self.running), zip(planned, needs)))
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.current = self.running[i]
            num_tokens = min(request.num_pending_tokens, token_budget)
            planned, need = planned_needs[id(request)]
            if planned != num_tokens:
                need = self.step_blocks(request, num_tokens)
            while not self.fits(reserved + need):
                device, shortage = self._shortage(reserved + need, need)
                if self._free_dead_rows(device):
                    continue  # dead rows went first: look again
                candidates = self.running[i:]  # not yet scheduled this step
                if shortfall is not None and i == 0 and len(candidates) == 1:
                    reserved = torch.zeros_like(reserved)  # the oldest alone fits (check_fits_alone)
                    continue
                free_before = self.memory.num_free_blocks_per_device  # (D,)
                choice = self.victims.choose_victim(tuple(candidates), self.memory, shortage)
                victim = choice.request if isinstance(choice, RowEviction) else choice
                if not any(victim is c for c in candidates):
                    raise RuntimeError(
                        f"victim policy {self.victims!r} chose request "
                        f"{getattr(victim, 'request_id', victim)!r}, not one of the candidates"
                    )
                if isinstance(choice, RowEviction):
                    self._evict_rows(choice, out)
                else:
                    self._preempt(victim, out)
                freed = self.memory.num_free_blocks_per_device - free_before  # (D,)
                self.num_evictions += 1
                self.freed_on_short_device += int(freed[device])
                mode = (
                    "rows" if isinstance(choice, RowEviction) else "swap" if victim.swapped else "recompute"
                )
                out.evictions.append(
                    EvictionRecord(out.step, victim.request_id, mode, device, freed.tolist())
                )
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it was the victim: running[i] is the next one
            self.schedule_tokens(out, request, num_tokens, int(need.sum()))
            reserved = reserved + need
            token_budget -= num_tokens
            i += 1
        return reserved, token_budget

    def deciding_on(self, request: Request) -> None:
        """The request the step is deciding on, named in the note of an exception raised meanwhile."""
        self.current = request

    def may_run_short(self) -> bool:
        """Whether the next step could find a device full, as the reservation policy says (the trace
        runner takes a snapshot only then)."""
        may_join = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        return self.reservation.may_run_short(
            self.running,
            may_join,
            self.worst_case_step_blocks,
            self.memory,
            self.config.max_num_batched_tokens,
        )

    # ----- the step's reservation: a (D,) vector, D = 1 for one pool ------------------------------
    def fits(self, demand: torch.Tensor) -> bool:
        return bool((demand <= self.memory.num_free_blocks_per_device).all())

    def _shortage(self, demand: torch.Tensor, need: torch.Tensor) -> tuple[int, Shortage]:
        """The device short by the most blocks, and a Shortage naming it for the victim policy."""
        missing = demand - self.memory.num_free_blocks_per_device  # (D,)
        device = int(missing.argmax())
        return device, Shortage(device, int(missing[device]), int(need[device]))

    def schedule_tokens(self, out: SchedulerOutput, request: Request, num_tokens: int, blocks: int) -> None:
        out.scheduled.append(
            ScheduledRequest(request, num_tokens, blocks, samples=num_tokens == request.num_pending_tokens)
        )

    def start_head(self, out: SchedulerOutput, hit=None) -> Request:
        """The head of the waiting line starts running: swapped back in, or a stalled one without
        its dead rows, or from the prefix `hit` (its full blocks shared, the ones straddling its end
        copied)."""
        request = self.current = self.waiting.popleft()
        if self.stalled.pop(request.request_id, None) is not None:
            self.manager.free(request.request_id)
        if request.swapped:
            out.block_copies.append(self.swap_space.swap_in(request.request_id))
            out.swapped_in.append(request)
            request.leave_swap_space()
        elif self.prefix_cache is not None and not self.memory.holds(request.request_id):
            copies = self.prefix_cache.start_sequence(request.request_id, request.num_tokens, hit)
            if hit is not None:
                request.start_from_prefix(hit)
                if copies[0].numel():
                    out.block_copies.append(BlockCopy(COPY, *copies))
                    out.prefix_copied.append(request)
        if request.status is RequestStatus.PREEMPTED:
            out.resumed.append(request)
            out.events.append(("resumed", request))
            request.resume()
        else:
            out.admitted.append(request)
            out.events.append(("admitted", request))
            num_cached = len(request.prompt_token_ids) + self.batching.num_new_tokens(request) - 1
            request.admit(self.predictor.predict(num_cached))
        self.running.append(request)
        return request

    def step_blocks(self, request: Request, num_tokens: int) -> torch.Tensor:
        """(D,) the worst case the next `num_tokens` tokens can take on each device, capped at the
        lifetime's minus what it holds (so a request alone always fits)."""
        return self.step_blocks_many([request], [num_tokens])[0]

    def step_blocks_many(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor:
        """`step_blocks` in one pass, (m, D) (per-request tensor calls cost more than a small model's
        decode forward): what the policy sets aside, from the worst case."""
        return self.reservation.step_needs(
            requests, num_tokens, self.worst_case_step_blocks, self.memory, self.predictor
        )

    def worst_case_step_blocks(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor:
        """(m, D) the most blocks each request's next num_tokens[i] tokens can take on each device,
        from every row's count: demand.py's bounds, as notebook 04 teaches them (`worst_case_need`).
        A swapped request grows from the rows it saved; a stalled one restarts empty."""
        memory = self.memory
        resident = [r.request_id for r in requests if not r.swapped]
        counts = memory.token_counts(resident)  # (h, L, E)
        if len(resident) < len(requests) or any(r.request_id in self.stalled for r in requests):
            held, rows = iter(counts), []
            for request in requests:
                row = memory.swapped_token_counts(request.request_id) if request.swapped else next(held)
                rows.append(torch.zeros_like(row) if request.request_id in self.stalled else row)
            counts = torch.stack(rows)  # (m, L, E)
        totals = [r.num_computed_tokens + n for r, n in zip(requests, num_tokens)]
        devices = memory.placement.of_sequences([r.request_id for r in requests])  # (m, L, E)
        return self.worst_case_need(counts, num_tokens, totals, devices)

    def worst_case_need(
        self, counts: torch.Tensor, num_tokens: list[int], totals: list[int], devices: torch.Tensor
    ) -> torch.Tensor:
        """counts, devices (m, L, E), rows growing by num_tokens[i] to totals[i] -> (m, D) needs:
        the step's worst case, capped by the lifetime's minus what is held (demand.step_need)."""
        D = self.num_devices
        K = self.shape.k_max
        P = self.memory.block_size
        C = self.memory.max_row_tokens
        held = blocks_held_per_device(counts, P, devices, D)  # (m, D)
        step = worst_case_step_blocks_per_device(
            counts, torch.tensor(num_tokens), K, P, devices, D, C
        )  # (m, D)
        lifetime = worst_case_lifetime_blocks_per_device(torch.tensor(totals), K, P, devices, D, C)  # (m, D)
        return step_need(step, lifetime, held)

    # ----- prefix caching ------------------------------------------------------------------------------
    def prefix_hit(self, request: Request):
        """The PrefixHit a request holding nothing (not swapped) would start from."""
        if self.prefix_cache is None or request.swapped or self.memory.holds(request.request_id):
            return None
        return self.prefix_cache.hit_for(request.all_token_ids, request.request_id)

    def hit_step_blocks(self, hit, num_tokens: int) -> torch.Tensor:
        """(D,) step_blocks for a request starting from `hit`, plus the free blocks it takes (the idle
        cached blocks it shares, its copies); at most what starting from nothing and computing the
        hit's tokens and these in one step would need, but never less than what applying the hit
        holds at once (its copies' sources stay pinned until the copies are taken). The cap holds
        for every routing: each row ends with as many blocks either way, and the blocks the hit
        lends it that other requests hold are ones it does not take from the free pool."""
        L = self.memory.num_layers
        E = self.memory.num_experts
        counts = hit.row_counts.view(1, L, E)  # (1, L, E)
        devices = hit.row_devices.view(1, L, E)
        total = hit.num_tokens + num_tokens
        with_hit = self.worst_case_need(counts, [num_tokens], [total], devices)[0] + hit.free_taken_per_device
        from_nothing = self.worst_case_need(torch.zeros_like(counts), [total], [total], devices)[0]
        return torch.maximum(torch.minimum(with_hit, from_nothing), hit.free_taken_per_device)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        seq_id = request.request_id
        holds = self.memory.holds(seq_id)
        swapped = self.config.preemption_mode == "swap" and holds and self.swap_space.can_swap_out(seq_id)
        if swapped:
            copy = self.swap_space.swap_out(seq_id)
            out.block_copies.append(copy)
            out.swapped_out.append(request)
            self.num_swapped_out_blocks += copy.source.numel()
        else:  # recompute (or the swap space is full): forget the K/V, re-run every token later
            if holds:
                self.manager.free(seq_id)
                out.freed.append(seq_id)
            self._forget_computed(request)
        self._requeue_preempted(request, out, swapped)

    def _requeue_preempted(self, request: Request, out: SchedulerOutput, swapped: bool = False) -> None:
        """Back to the head of the waiting line: a preempted request keeps its place."""
        request.preempt(swapped)
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.events.append(("preempted", request))

    def _forget_computed(self, request: Request) -> None:
        """Its K/V are gone: every token runs again."""
        self.num_recomputed_tokens += request.forget_computed()

    def _evict_rows(self, eviction: RowEviction, out: SchedulerOutput) -> None:
        """Drop the chosen rows; the request stalls (module docstring)."""
        request = eviction.request
        self.num_row_evictions += 1
        self.num_evicted_rows += self._free_rows(request.request_id, eviction.layer_experts)
        self.running.remove(request)
        self.stalled[request.request_id] = request
        self._forget_computed(request)
        self._requeue_preempted(request, out)

    def _free_dead_rows(self, device: int | None) -> bool:
        """Free the rows stalled requests hold on `device` (None: every device), oldest stall first;
        whether any was freed."""
        freed = False
        for request_id in self.stalled:
            dead = self.memory.token_counts([request_id])[0] > 0  # (L, E)
            if device is not None:
                dead &= self.memory.placement.of_sequences([request_id])[0] == device
            if dead.any():
                self.num_dead_rows_freed += self._free_rows(request_id, dead.nonzero().tolist())
                freed = True
        return freed

    def _free_rows(self, request_id: int, layer_experts) -> int:
        rows = torch.cat([self.manager.rows([request_id], layer, expert) for layer, expert in layer_experts])
        self.manager.free_rows(rows)
        return rows.numel()

    # ----- after the forward ----------------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: dict[int, int],
        entries_per_layer: torch.Tensor | None = None,
        failed: dict[int, str] | None = None,
    ) -> list[Request]:
        """Account for the step that ran `out`; returns the requests that finished, in order.
        entries_per_layer (L,): experts chosen over the step's tokens (for the predictor). failed:
        request id -> why its own sampling failed (it finishes with "error")."""
        failed = failed or {}
        if entries_per_layer is not None:
            self.predictor.observe(entries_per_layer, out.num_scheduled_tokens)
        finished = []
        for item in out.scheduled:
            request = item.request
            request.advance(item.num_tokens)
            if request.request_id in failed:
                self.finish(request, out.step, "error", failed[request.request_id])
                finished.append(request)
                continue
            if self.prefix_cache is not None and self.memory.holds(request.request_id):
                # its computed tokens' blocks become findable (prefix_cache.py)
                self.prefix_cache.cache_computed_blocks(
                    request.request_id, request.all_token_ids[: request.num_computed_tokens]
                )
            if not item.samples:
                continue  # a prefill chunk: more of it next step
            request.append_output(int(sampled_token_ids[request.request_id]))
            if len(request.output_token_ids) >= self.batching.num_new_tokens(request):
                self.finish(request, out.step)
                finished.append(request)
        return finished

    def finish(self, request: Request, step: int, reason: str = "length", error: str | None = None) -> None:
        """The request leaves, from any unfinished state; its device and swap blocks go back now."""
        seq_id = request.request_id
        actual_blocks = self.memory.num_blocks_held(seq_id)
        final_token_counts = self.memory.token_counts([seq_id])[0]
        if self.memory.holds(seq_id):
            self.manager.free(seq_id)
        if request.swapped:
            self.swap_space.discard(seq_id)
        self.batching.release(request)
        request.finish(step, reason, error, actual_blocks, final_token_counts)
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.stalled.pop(seq_id, None)  # a stalled request aborted while it waits

    def recover_from_failed_copies(self, out: SchedulerOutput) -> None:
        """The step's block copies raised part-way: every sequence they moved may have incomplete
        K/V, so it drops them and recomputes."""
        for request in out.swapped_out:
            if request.swapped:
                self.swap_space.discard(request.request_id)
                request.leave_swap_space()
                self._forget_computed(request)
        for request in out.swapped_in:
            if request.status is RequestStatus.RUNNING and self.memory.holds(request.request_id):
                self.manager.free(request.request_id)
                self._forget_computed(request)
        for request in out.prefix_copied:  # its copies of straddling blocks may be incomplete
            if request.status is RequestStatus.RUNNING and self.memory.holds(request.request_id):
                self.manager.free(request.request_id)
                request.forget_computed(recomputed=False)  # nothing of its own was computed
