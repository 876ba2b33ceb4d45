"""The scheduler: at every step, which requests run, which are admitted, which are preempted.

One step, in order (vLLM v1's loop, with MoE-aware memory checks):

 1. Running requests, oldest first. Each gets its pending tokens (a prefill chunk, or one decode
    token) within the token budget, and the *worst case* of blocks those tokens can open
    (demand.worst_case_step_blocks: every token to k_max experts, each opening a block) is reserved
    against the free pool. When the reservation does not fit, the newest running request is
    preempted -- by recompute or by swap -- until it does (possibly the request itself).
 2. If nothing was preempted: waiting requests, preempted ones first (they keep their place in
    line), are admitted while the sequence budget, the token budget, the step's reservation and the
    admission policy allow.

Why the worst case of one step, and not of the request's whole life: the whole life is k_max / k_avg
times more than what threshold routing actually needs (what `continuous_reserved` pays); the next step
is all that must be guaranteed, because a forward runs every layer and cannot stop half-way when a
layer's router picks experts whose blocks are full. Why a prediction for admission: the step guarantee
alone would admit requests that will certainly be preempted later (wasted prefill); the prediction
(demand.DemandPredictor, and `predicted_peak` over the running requests' remaining steps) admits what
routing so far says will fit.

Why preempt whole sequences, never single experts' blocks: a sequence's next token may be routed to
any expert of any layer, and attends over everything that expert cached for the sequence. Freeing one
expert's blocks saves only that row (1/E of a layer's share, and usually a few partly filled blocks),
yet the sequence can no longer run until that row is rebuilt -- and a row can only be rebuilt by
running the whole sequence again (its K/V at layer l depend on every earlier layer). So a partial
eviction costs the same recompute as a whole one and frees a fraction of the memory.

Policies (`SchedulerConfig.policy`), all with the same loop, so the serving benchmark compares
memory accounting and batching, not implementations:
    static               a fixed batch, admitted only when the previous one has finished, padded to
                         its longest request, each reserving the worst case of every expert
    continuous_reserved  iteration-level batching, each request reserving the worst case of every
                         (layer, expert) row for its whole life: never preempts, admits few
    continuous_paged     iteration-level batching on the paged pool: admission on a prediction
                         (admission="predicted") or on the next step alone (admission="optimistic"),
                         worst case of one step reserved, preemption when short
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from .demand import (DemandPredictor, min_lifetime_blocks, reserved_blocks, worst_case_lifetime_blocks,
                     worst_case_step_blocks)
from .memory import KVMemory
from .request import Request, RequestStatus

POLICIES = ("static", "continuous_reserved", "continuous_paged")
ADMISSIONS = ("predicted", "optimistic")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16                 # sequences running at once
    max_num_batched_tokens: int = 256      # tokens in one forward (prefill chunks + decode tokens)
    policy: str = "continuous_paged"
    admission: str = "predicted"
    preemption_mode: str = "recompute"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name, allowed in (("policy", POLICIES), ("admission", ADMISSIONS),
                              ("preemption_mode", PREEMPTION_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int            # tokens this step runs for it
    reserved_blocks: int       # worst case those tokens can take from the pool


@dataclass
class SchedulerOutput:
    """What one call to `schedule` decided; the engine runs `scheduled` and records the rest."""
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)     # first time running
    resumed: list[Request] = field(default_factory=list)      # running again after a preemption
    preempted: list[Request] = field(default_factory=list)
    events: list[tuple[str, Request]] = field(default_factory=list)   # all of the above, in order

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def reserved_blocks(self) -> int:
        return sum(s.reserved_blocks for s in self.scheduled)


class Scheduler:
    """Queues of requests and the decisions above. Invariants between steps: every request is in
    exactly one of `waiting` (WAITING or PREEMPTED) and `running` (RUNNING), or is FINISHED and in
    neither; a RUNNING or recompute-PREEMPTED request holds no swap blocks; a swap-PREEMPTED request
    holds no pool blocks."""

    def __init__(self, config: SchedulerConfig, memory: KVMemory, predictor: DemandPredictor):
        if config.preemption_mode == "swap" and memory.swap_space is None:
            raise ValueError("preemption_mode='swap' needs a swap space: give the engine num_swap_blocks > 0")
        self.config = config
        self.memory = memory
        self.predictor = predictor
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swapped_out_blocks = 0

    # ----- requests in ------------------------------------------------------------------------------
    def max_blocks_alone(self, num_cached_tokens: int) -> int:
        """The most blocks this policy could need for one request running alone."""
        m = self.memory
        if self.config.policy == "continuous_paged":
            return worst_case_lifetime_blocks(num_cached_tokens, m.num_layers, m.num_experts, m.k_max,
                                              m.block_size)
        return reserved_blocks(num_cached_tokens, m.num_layers, m.num_experts, m.block_size)

    def check_fits_alone(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ValueError if a request of this shape might not fit the pool even with nothing else
        running. Such a request must be refused up front: preemption frees only *other* sequences'
        memory, so once admitted it could never finish."""
        m = self.memory
        num_tokens = prompt_len + max_new_tokens - 1
        worst = self.max_blocks_alone(num_tokens)
        if worst <= m.num_blocks:
            return
        least = min_lifetime_blocks(num_tokens, m.num_layers, m.k_min, m.block_size)
        verdict = "can never fit" if least > m.num_blocks else "may not fit even alone"
        prompt_worst = self.max_blocks_alone(prompt_len)
        if prompt_worst > m.num_blocks:
            fix = f"the prompt alone may need {prompt_worst}: give the pool at least {worst} blocks or shorten the prompt"
        else:
            longest = max(t for t in range(prompt_len, num_tokens + 1) if self.max_blocks_alone(t) <= m.num_blocks)
            fix = (f"lower max_new_tokens to at most {longest - prompt_len + 1}, or give the pool at least "
                   f"{worst} blocks")
        raise ValueError(
            f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} {verdict} in the "
            f"pool of {m.num_blocks} blocks: it needs at least {least} and up to {worst} blocks "
            f"({m.num_layers} layers, up to {m.k_max} experts per token, block size {m.block_size}); {fix}")

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- one step ---------------------------------------------------------------------------------
    def schedule(self, step: int) -> SchedulerOutput:
        out = SchedulerOutput(step)
        token_budget = self.config.max_num_batched_tokens
        reserved = 0
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_pending_tokens, token_budget)
            need = self._step_blocks(request, num_tokens)
            while reserved + need > self.memory.num_free_blocks:
                victim = self.running[-1]               # the newest: it has the least work to lose
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_tokens, need))
            reserved += need
            token_budget -= num_tokens
            i += 1
        if not out.preempted:          # do not admit in a step that had to preempt: it would thrash
            if self.config.policy == "static":
                self._admit_static_batch(out, token_budget, reserved)
            else:
                self._admit(out, token_budget, reserved)
        return out

    def _admit(self, out: SchedulerOutput, token_budget: int, reserved: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs and token_budget > 0:
            request = self.waiting[0]
            num_tokens = min(request.num_pending_tokens, token_budget)
            need = self._step_blocks(request, num_tokens)
            swap_in = self.memory.num_blocks_to_swap_in(request.request_id) if request.swapped else 0
            if reserved + swap_in + need > self.memory.num_free_blocks:
                break
            if self.running and not self._admission_allows(request):
                break                  # FIFO: no request overtakes the head of the line
            self.waiting.popleft()
            self._start(request, out)
            out.scheduled.append(ScheduledRequest(request, num_tokens, need))
            reserved += need
            token_budget -= num_tokens

    def _admit_static_batch(self, out: SchedulerOutput, token_budget: int, reserved: int) -> None:
        """Static batching: a new batch only when the last one is done. The batch is the longest
        prefix of the queue whose members, each reserving every expert's worst case for the padded
        length (longest prompt + longest output), fit the pool."""
        if self.running or not self.waiting:
            return
        m = self.memory
        batch: list[Request] = []
        for request in list(self.waiting)[: self.config.max_num_seqs]:
            candidate = batch + [request]
            padded = (max(len(r.prompt_token_ids) for r in candidate)
                      + max(r.sampling_params.max_new_tokens for r in candidate) - 1)
            if len(candidate) * reserved_blocks(padded, m.num_layers, m.num_experts, m.block_size) > m.num_blocks:
                break
            batch.append(request)
        batch = batch or [self.waiting[0]]            # fits alone: checked at add_request
        longest_output = max(r.sampling_params.max_new_tokens for r in batch)
        for request in batch:
            self.waiting.popleft()
            # padding: the request keeps decoding (tokens thrown away) until the batch's longest ends
            room = self.memory.cache.config.max_position_embeddings - 1 - request.max_cached_tokens
            request.num_padding_tokens = min(longest_output - request.sampling_params.max_new_tokens, room)
            self._start(request, out)
            num_tokens = min(request.num_pending_tokens, token_budget)
            if num_tokens > 0:
                need = self._step_blocks(request, num_tokens)
                out.scheduled.append(ScheduledRequest(request, num_tokens, need))
                token_budget -= num_tokens

    def _start(self, request: Request, out: SchedulerOutput) -> None:
        if request.swapped:
            self.memory.swap_in(request.request_id)
            request.swapped = False
        if request.status is RequestStatus.PREEMPTED:
            out.resumed.append(request)
            out.events.append(("resumed", request))
        else:
            out.admitted.append(request)
            out.events.append(("admitted", request))
            request.predicted_blocks = self.predictor.predict(request.max_cached_tokens)
            request.first_scheduled_step = out.step
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _admission_allows(self, request: Request) -> bool:
        """May `request` join the running ones? (An empty engine always admits the head of the line:
        it fits alone, checked at add_request.)"""
        m, policy = self.memory, self.config.policy
        if policy == "continuous_reserved":
            def reservation(r):
                return reserved_blocks(r.max_cached_tokens, m.num_layers, m.num_experts, m.block_size)
            return sum(map(reservation, self.running)) + reservation(request) <= m.num_blocks
        if self.config.admission == "optimistic":
            return True
        return self.predicted_peak(request) <= m.num_blocks

    def predicted_peak(self, request: Request | None = None) -> int:
        """The most blocks the pool is predicted to hold at any future step if `request` joins.

        Generation here always runs to max_new_tokens, so each request's remaining steps g are known;
        its blocks are predicted to grow from what it holds now, b, to its predicted final demand f
        (DemandPredictor, never less than b), then all return to the pool when it finishes:

            demand_r(s) = b_r + (f_r - b_r) * (s + 1) / g_r   for s < g_r,   0 afterwards

        The sum peaks just before some request finishes, so it is evaluated at s = g_r - 1. Summing
        final demands instead would assume everyone peaks at once and leave the pool half idle;
        short requests free their blocks before long ones reach theirs.
        """
        m = self.memory
        held, final, remaining = [], [], []
        for r in self.running + ([request] if request is not None else []):
            if r.status is RequestStatus.RUNNING:
                b = m.num_blocks_held(r.request_id)
            elif r.swapped:
                b = m.num_blocks_to_swap_in(r.request_id)
            else:  # its prefill (or recompute) arrives in one go
                b = self.predictor.predict(r.num_tokens)
            f = max(self.predictor.predict(r.max_cached_tokens), b)
            held.append(b)
            final.append(f)
            remaining.append(max(1, r.max_new_tokens - len(r.output_token_ids)))
        b, f, g = (torch.tensor(x, dtype=torch.float64) for x in (held, final, remaining))  # (k,) each
        s = g - 1                                                                  # (k,) peaks to test
        progress = torch.clamp((s[:, None] + 1) / g[None, :], max=1.0)             # (k steps, k requests)
        alive = s[:, None] < g[None, :]
        demand = torch.where(alive, b + (f - b) * progress, torch.zeros(()))       # (k, k)
        return int(math.ceil(float(demand.sum(1).max()) - 1e-9))

    def _step_blocks(self, request: Request, num_tokens: int) -> int:
        """Worst case of blocks the request's next `num_tokens` tokens can take from the pool. Never
        more than its lifetime worst case minus what it holds, so a request alone always fits."""
        m, seq_id = self.memory, request.request_id
        if request.swapped:
            counts = m.swapped_token_counts(seq_id)[None]                    # (1, L, E)
        else:
            counts = m.token_counts([seq_id])                                 # (1, L, E)
        held = int(((counts + m.block_size - 1) // m.block_size).sum())
        step = int(worst_case_step_blocks(counts, torch.tensor([num_tokens]), m.k_max, m.block_size)[0])
        lifetime = worst_case_lifetime_blocks(request.num_computed_tokens + num_tokens, m.num_layers,
                                              m.num_experts, m.k_max, m.block_size)
        return max(0, min(step, lifetime - held))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the pool; it goes back to the head of the waiting line."""
        self.running.remove(request)
        seq_id = request.request_id
        if self.config.preemption_mode == "swap" and self.memory.can_swap_out(seq_id):
            self.num_swapped_out_blocks += self.memory.swap_out(seq_id)
            request.swapped = True
        else:  # recompute (or the swap space is full): forget the K/V, re-run every token later
            self.memory.free(seq_id)
            request.num_recomputed_tokens += request.num_computed_tokens
            self.num_recomputed_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        out.events.append(("preempted", request))

    def finish(self, request: Request, step: int) -> None:
        request.actual_blocks = self.memory.num_blocks_held(request.request_id)
        request.final_token_counts = self.memory.token_counts([request.request_id])[0]
        self.memory.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finished_step = step
        self.running.remove(request)
