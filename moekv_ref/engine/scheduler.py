"""The scheduler: at every step, which requests run, which are admitted, which are preempted.

One step, in order (vLLM v1's loop, with MoE-aware memory checks):

 1. Running requests, oldest first, get their pending tokens (a prefill chunk, or one decode token)
    within the step's token limit, reserving what the reservation policy sets aside for them (by
    default the *worst case* of blocks those tokens can open: demand.py). While that does not fit,
    the victim policy picks a running request not yet scheduled this step (the newest, by default),
    preempted whole by recompute (possibly the request itself; swapping_scheduler.py swaps).
 2. If nothing was preempted: the batching policy admits waiting requests, preempted ones first
    (they keep their place in line), within the step's limits, reservation and admission rule.
 3. `update_from_output`: tokens counted as computed, sampled tokens appended, requests at their
    last token finished and their blocks freed.

Under a reservation that may run short (reservation.py), a layer can find a device full during the
forward: the engine then either undoes the step and schedules it again (`retry`, optimistic) or
asks `repair` to take the chunk scheduled last out of the step (calibrated), and runs on.

Only the next step's worst case is reserved, because a forward runs every layer and cannot stop
half-way when a layer's experts are full; the whole life's is k_max / k_avg times more than
threshold routing needs (what `continuous_reserved` pays). Admission adds a prediction
(admission.py): the step guarantee alone admits requests certain to be preempted later.

The pool has D devices (one pool: D = 1) and a step must fit every device: the reservation is a (D,)
vector and the victim policy is told which device is short (victims.Shortage). The scheduler sees
integers only (the block manager and memory.ModelShape), never K/V; its decisions leave `schedule()`
in one SchedulerOutput, whose block copies the runner performs, in order, before the forward. The
class that serves a manager and a victim policy is chosen in scheduler_factory.py.
"""

from __future__ import annotations

from collections import deque
from types import MappingProxyType
from typing import Mapping

import torch

from ..cache.kv_cache_manager import KVCacheManager
from ..state import Stateful
from .batching import AdmissionStep
from .demand import (
    DemandPredictor,
    blocks_held_per_device,
    step_need,
    worst_case_lifetime_blocks_per_device,
    worst_case_step_blocks_per_device,
)
from .fits_alone import check_fits_alone
from .memory import MemoryView, ModelShape
from .request import Request, RequestStatus
from .reservation import Retry
from .scheduler_config import SchedulerConfig, check_scheduler_arguments
from .scheduler_output import EvictionRecord, ScheduledRequest, SchedulerOutput
from .victims import Shortage, check_victim


def is_decode(item: ScheduledRequest) -> bool:
    """One token of a request that has computed some: a decode (or its last prompt token's)."""
    return item.num_tokens == 1 and item.request.num_computed_tokens > 0


class Scheduler(Stateful):
    """Between steps every request is in exactly one of `waiting` (WAITING or PREEMPTED) and
    `running` (RUNNING), or is FINISHED and in neither."""

    COUNTERS = (
        "num_preemptions",
        "num_recomputed_tokens",
        "num_evictions",
        "freed_on_short_device",
        "num_repairs",
        "num_repaired_tokens",
    )
    STATE = ("waiting", "running", "current", *COUNTERS)
    # the manager holds its own parts; the memory view holds nothing
    PARTS = ("manager", "swap_space", "predictor", "batching", "victims", "reservation")
    # it takes whole sequences off, never single rows: no request stalls (row_evicting_scheduler.py)
    stalled: Mapping[int, Request] = MappingProxyType({})
    num_swapped_out_blocks = 0  # nor swaps them out (swapping_scheduler.py)
    num_row_evictions = 0
    num_evicted_rows = 0
    num_dead_rows_freed = 0
    takes_rows = False  # True: serves a victim policy that drops rows (check_scheduler_arguments)
    swaps = False  # True: serves preemption_mode='swap'

    def __init__(
        self, config: SchedulerConfig, manager: KVCacheManager, shape: ModelShape, num_swap_blocks: int = 0
    ):
        """ValueError, before anything is built, for arguments that do not meet
        (scheduler_config.check_scheduler_arguments)."""
        num_swap_blocks = check_scheduler_arguments(type(self), config, manager, shape, num_swap_blocks)
        self.config = config
        self.manager = manager
        self.swap_space = self.make_swap_space(num_swap_blocks)
        self.memory = memory = MemoryView(manager, shape, self.swap_space)
        self.num_devices = memory.num_devices
        self.shape = shape
        self.predictor = DemandPredictor(
            memory.num_layers, memory.num_experts, shape.k_max, memory.block_size, memory.max_row_tokens
        )
        self.batching = config.make_batching_policy()
        self.victims = config.make_victim_policy()
        self.reservation = config.make_reservation_policy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.current: Request | None = None  # the request schedule() was deciding on
        for name in self.COUNTERS:
            setattr(self, name, 0)

    def make_swap_space(self, num_swap_blocks: int) -> None:
        """None: a Scheduler preempts by recompute (a SwappingScheduler swaps)."""

    def save(self) -> tuple:
        """Stateful.save, with every unfinished request's state (engine/undo.py)."""
        requests = {id(r): r for r in (*self.waiting, *self.running)}
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
        """ValueError if a request of this shape might not fit the pool even alone (fits_alone.py).
        request_id: whose rows' devices to check (with home devices they depend on it)."""
        check_fits_alone(self.memory, self.max_blocks_alone, prompt_len, max_new_tokens, request_id)

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
        self.reservation.start_step()
        token_budget = self.config.max_num_batched_tokens
        # a retry short of blocks reserves every block free now plus the shortfall: victims go until
        # that many are free
        shortfall = None if retry is None or not bool(retry.shortfall.any()) else retry.shortfall
        base = (
            torch.zeros(self.num_devices, dtype=torch.int64)
            if shortfall is None
            else self.memory.num_free_blocks_per_device + shortfall
        )  # (D,)
        # every running request's need, in one call; one the token limit cuts short is asked again
        planned = [self.reservation.chunk_tokens(r, token_budget) for r in self.running]
        needs = self.step_blocks_many(self.running, planned)  # (m, D)
        reserved, token_budget = self.schedule_running(out, planned, needs, base, token_budget, shortfall)
        max_admissions = None if retry is None else retry.max_admissions
        # a step that had to preempt admits none: it would thrash
        if not out.preempted and max_admissions != 0:
            if not self.running:
                self.free_idle_blocks(None)
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
        preempted until they do. Returns the step's reservation and the tokens it may still run."""
        # integers per device, not tensors: a decode step asks this once per running request
        planned_needs = dict(zip(map(id, self.running), zip(planned, needs.tolist())))
        reserved = reserved.tolist()
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.current = self.running[i]
            num_tokens = self.reservation.chunk_tokens(request, token_budget)
            planned, need = planned_needs[id(request)]
            if planned != num_tokens:
                need = self.step_blocks(request, num_tokens).tolist()
            demand = [r + n for r, n in zip(reserved, need)]
            while not self.fits(demand):
                device, shortage = self._shortage(torch.tensor(demand), torch.tensor(need))
                freed_idle = self.free_idle_blocks(device)  # blocks no request needs go first
                candidates = self.running[i:]  # not yet scheduled this step
                if not freed_idle and shortfall is not None and i == 0 and len(candidates) == 1:
                    demand = list(need)  # the oldest alone fits (check_fits_alone)
                    continue
                victim = None if freed_idle else self._take_victim(candidates, device, shortage, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it was the victim: running[i] is the next one
            self.schedule_tokens(out, request, num_tokens, sum(need))
            reserved = demand
            token_budget -= num_tokens
            i += 1
        return torch.tensor(reserved, dtype=torch.int64), token_budget

    def _take_victim(self, candidates: list[Request], device: int, shortage: Shortage, out) -> Request:
        """The victim policy's choice among the candidates, taken off and recorded in
        `out.evictions`; returns the victim."""
        free_before = self.memory.num_free_blocks_per_device  # (D,)
        choice = self.victims.choose_victim(tuple(candidates), self.memory, shortage)
        victim, mode = self.take_off(choice, candidates, out)
        freed = self.memory.num_free_blocks_per_device - free_before  # (D,)
        self.num_evictions += 1
        self.freed_on_short_device += int(freed[device])
        out.evictions.append(EvictionRecord(out.step, victim.request_id, mode, device, freed.tolist()))
        return victim

    def take_off(self, choice, candidates: list[Request], out: SchedulerOutput) -> tuple[Request, str]:
        """Preempt the chosen request; (it, how: "swap" or "recompute")."""
        check_victim(self.victims, choice, candidates)
        self._preempt(choice, out)
        return choice, "swap" if choice.swapped else "recompute"

    def free_idle_blocks(self, device: int | None) -> bool:
        """Free blocks that no request needs on `device` (None: every device) before a victim is
        chosen; whether any was freed. A plain scheduler leaves none."""
        return False

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
    def fits(self, demand: list[int]) -> bool:
        """Whether demand[d] blocks fit device d's free blocks, on every device."""
        return all(d <= f for d, f in zip(demand, self.memory.num_free_blocks_per_device.tolist()))

    def _shortage(self, demand: torch.Tensor, need: torch.Tensor) -> tuple[int, Shortage]:
        """The device short by the most blocks, and a Shortage naming it for the victim policy."""
        missing = demand - self.memory.num_free_blocks_per_device  # (D,)
        device = int(missing.argmax())
        return device, Shortage(device, int(missing[device]), int(need[device]))

    def schedule_tokens(self, out: SchedulerOutput, request: Request, num_tokens: int, blocks: int) -> None:
        out.scheduled.append(
            ScheduledRequest(request, num_tokens, blocks, samples=num_tokens == request.num_pending_tokens)
        )

    def head_fits(self, request: Request, reserved: torch.Tensor, token_budget: int) -> bool:
        """Would the head of the waiting line's next tokens fit every device beside the step's
        `reserved`?"""
        need = self.step_blocks(request, self.reservation.chunk_tokens(request, token_budget))
        return self.fits((reserved + need).tolist())

    def start_head(self, out: SchedulerOutput) -> Request:
        """The head of the waiting line starts running."""
        request = self.current = self.waiting.popleft()
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
        from every row's count: demand.py's bounds, as notebook 04 teaches them (`worst_case_need`)."""
        totals = [r.num_computed_tokens + n for r, n in zip(requests, num_tokens)]
        devices = self.memory.placement.of_sequences([r.request_id for r in requests])  # (m, L, E)
        return self.worst_case_need(self.row_counts(requests), num_tokens, totals, devices)

    def row_counts(self, requests: list[Request]) -> torch.Tensor:
        """(m, L, E) tokens each request's rows hold."""
        return self.memory.token_counts([r.request_id for r in requests])

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

    # ----- victims ----------------------------------------------------------------------------------
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """By recompute: forget the K/V, re-run every token later."""
        self.running.remove(request)
        if self.memory.holds(request.request_id):
            self.manager.free(request.request_id)
            out.freed.append(request.request_id)
        self._forget_computed(request)
        self._requeue_preempted(request, out)

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

    # ----- a step that ran short -------------------------------------------------------------------
    def repair(self, out: SchedulerOutput, shortfall: torch.Tensor) -> Request:
        """Under a reservation that `repairs`: a layer of the step `out` found devices short by
        `shortfall` (D,) blocks. The chunk scheduled last (the newest to join the step) leaves it,
        preempted by recompute (its blocks freed, back to the head of the waiting line), and the
        forward goes on for the others: nothing of theirs depends on it (attention is per
        sequence, routing per token). Returns it. RuntimeError where the step has no chunk: a
        decode token reserves its worst case, so only a chunk's reservation can fall short."""
        index = self.chunk_to_drop(out)
        if not self.reservation.repairs or index is None:
            raise RuntimeError(
                f"step {out.step} ran short with no chunk to drop (reservation="
                f"{self.reservation.name!r}): only a chunk's reservation can fall short"
            )
        item = out.scheduled.pop(index)
        self.reservation.note_fault(shortfall)
        self.num_repairs += 1
        self.num_repaired_tokens += item.num_tokens
        self._preempt(item.request, out)
        return item.request

    def chunk_to_drop(self, out: SchedulerOutput) -> int | None:
        """The index in `out.scheduled` of the chunk `repair` drops: the last one (None: none)."""
        chunks = [i for i, item in enumerate(out.scheduled) if not is_decode(item)]
        return chunks[-1] if chunks else None

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
            self.tokens_computed(request)
            if not item.samples:
                continue  # a prefill chunk: more of it next step
            request.append_output(int(sampled_token_ids[request.request_id]))
            if len(request.output_token_ids) >= self.batching.num_new_tokens(request):
                self.finish(request, out.step)
                finished.append(request)
        return finished

    def tokens_computed(self, request: Request) -> None:
        """The step computed some of the request's tokens (counted already); nothing more to do here."""

    def finish(self, request: Request, step: int, reason: str = "length", error: str | None = None) -> None:
        """The request leaves, from any unfinished state; its blocks go back now."""
        seq_id = request.request_id
        actual_blocks = self.memory.num_blocks_held(seq_id)
        final_token_counts = self.memory.token_counts([seq_id])[0]
        if self.memory.holds(seq_id):
            self.manager.free(seq_id)
        self.batching.release(request)
        self.reservation.release(request)
        request.finish(step, reason, error, actual_blocks, final_token_counts)
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def recover_from_failed_copies(self, out: SchedulerOutput) -> None:
        """The step's block copies raised part-way: every sequence they moved may have incomplete
        K/V, so it drops them and recomputes. The Scheduler makes no copies; its variants do."""
