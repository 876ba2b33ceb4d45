"""The serving engine: `add_request`, `step`, `generate`.

    add_request ─> Scheduler.schedule ─> ModelRunner          ─> sample ─> Scheduler.update_from_output
                   (admit, reserve,       (swap copies, then     (each request's  (tokens counted, finish:
                    preempt: integers,     one forward_cached     own seeded       blocks freed)
                    one SchedulerOutput)   over the flat batch)   generator)

One `step` is one forward over every scheduled token. `add_request` checks everything before any
state changes, so a refused request (ValueError) leaves the others untouched.

With `record_history=True` the engine keeps, per step, the pool's use and the scheduler's decisions
(`timeline`, `events`, `device_timeline`) and the finished requests, for figures. Without it a
finished request is handed out and forgotten and `stats()` is kept in counters: memory stays flat
however many requests it serves.

Per-device pools (`blocks_per_device` with `device_of_expert`, or `home_devices=True`: every row of
request s on device s % D) give each device its own blocks (cache/kv_cache_manager.py); the
scheduler reserves each step device by device, and the model, runner and swap copies are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.block_pool import OutOfBlocksError
from ..cache.factory import make_paged_cache
from ..cache.prefix_caching_manager import PrefixCachingKVCacheManager
from ..model import MoEKVTransformer
from ..profiling import phase
from ..prompts import check_batch, check_prompt, check_sampling_params
from ..results import GenerationResult
from ..sampling import SamplingParams, sample_rows
from ..validation import check_block_size, check_callable, check_flag, check_int, known_keywords
from .demand import worst_case_lifetime_blocks
from .memory import ModelShape
from .model_runner import ModelRunner
from .request import Request, RequestOutput, RequestStatus
from .scheduler_config import SchedulerConfig, check_swap_space
from .scheduler_factory import make_scheduler
from .undo import Snapshot

_COUNTED_AS = {"length": "finished", "aborted": "aborted", "error": "failed"}  # by finish_reason


@dataclass
class StepRecord:
    """The state after one step (or one idle tick waiting for arrivals)."""

    step: int
    num_running: int  # sequences holding the pool during the step
    num_waiting: int  # never run yet
    num_preempted: int  # waiting to resume
    num_scheduled_tokens: int
    used_blocks: int  # pool blocks owned by sequences after the forward, before finishing
    scheduled_used_blocks: int  # blocks in use when the step was scheduled: + reserved <= pool
    reserved_blocks: int  # worst case the step reserved before running
    swapped_blocks: int  # blocks in the CPU swap space
    seconds: float  # wall time of the step (not reproducible; never printed rounded)


@dataclass
class RequestEvent:
    step: int
    request_id: int
    kind: str  # "arrived", "admitted", "preempted", "resumed", "finished", "aborted", "failed"


@dataclass
class EngineStats:
    num_steps: int
    num_admitted: int
    num_preemptions: int
    num_resumed: int
    num_finished: int  # served to the end (finish_reason "length")
    num_recomputed_tokens: int
    num_swapped_out_blocks: int
    num_generated_tokens: int
    max_concurrent_sequences: int
    peak_used_blocks: int
    seconds: float
    mean_concurrent_sequences: float = 0.0  # over every recorded step, idle ones included
    num_aborted: int = 0
    num_failed: int = 0  # finished with finish_reason "error"
    num_failed_steps: int = 0  # steps that raised (anywhere) and were undone
    num_retries: int = 0  # tries of a step undone for lack of blocks (optimistic reservation)
    num_thrown_away_tokens: int = 0  # tokens those tries had scheduled (their forwards thrown away)
    num_repairs: int = 0  # chunks dropped from a step a layer found short (calibrated reservation)
    num_thrown_away_token_layers: int = 0  # tokens x layers those chunks had run, the short one included

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def undo(before_forward: Snapshot, states: list) -> None:
    """The scheduler's state back to `before_forward`, and each sampling generator to its state
    (a token sampled before the fault is drawn again)."""
    before_forward.restore()
    for generator, state in states:
        generator.set_state(state)


class LLMEngine:
    """Continuous batching over a paged per-expert KV cache of `num_blocks` blocks of `block_size`.

    num_swap_blocks: the CPU swap space (default: the pool's size when preempting by swap).
    attention: PagedKVCache's attention path (None: "triton" on the Triton backend, else "batched").
    enable_prefix_caching: start a request from a cached prefix (cache/prefix_cache.py); a hit
    reuses only blocks of the device each row takes blocks from.
    blocks_per_device: D integers >= 1, never rounded (num_blocks their sum if left out);
    device_of_expert: (E,) or (L, E) devices (placement.place_experts). With home_devices
    device_of_expert is None: ask manager.placement.of_sequences(ids) (cache/rows.py).
    budget: a RowBudget (cache/budget.py), at most B tokens in each (sequence, layer, expert) row
    (a swapped-out sequence keeps its rows' policy state with its blocks).
    """

    @known_keywords
    @torch.inference_mode(False)  # what it builds outlives it (steps run outside inference mode)
    def __init__(
        self,
        model: MoEKVTransformer,
        num_blocks: int | None = None,
        block_size: int = 16,
        scheduler_config: SchedulerConfig | None = None,
        num_swap_blocks: int | None = None,
        shuffle_seed: int | None = None,
        attention: str | None = None,
        record_history: bool = False,
        enable_prefix_caching: bool = False,
        blocks_per_device=None,
        device_of_expert=None,
        home_devices: bool = False,
        budget=None,
    ):
        if not isinstance(model, MoEKVTransformer):
            raise ValueError(f"model must be a MoEKVTransformer, got {type(model).__name__}")
        if scheduler_config is not None and not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(
                f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}"
            )
        scheduler_config = scheduler_config or SchedulerConfig()
        swap = scheduler_config.preemption_mode == "swap"
        if num_swap_blocks is not None:
            num_swap_blocks = check_swap_space(num_swap_blocks, scheduler_config.preemption_mode)
        check_flag("record_history", record_history)
        self.model = model
        self.config = model.config
        # every option of the cache is checked there, once, before its pool is allocated
        self.cache = make_paged_cache(
            model,
            block_size,
            num_blocks,
            shuffle_seed=shuffle_seed,
            attention=attention,
            blocks_per_device=blocks_per_device,
            device_of_expert=device_of_expert,
            home_devices=home_devices,
            enable_prefix_caching=enable_prefix_caching,
            budget=budget,
        )
        if num_swap_blocks is None:  # as large as the pool, when preempting by swap
            num_swap_blocks = self.cache.manager.num_blocks if swap else 0
        self.blocks_per_device = self.cache.manager.blocks_per_device.tolist()  # D ints
        manager = self.cache.manager
        self.device_of_expert = manager.placement.expert_devices  # (L, E); None: by sequence
        self.scheduler = make_scheduler(
            scheduler_config, self.cache.manager, ModelShape.from_config(self.config), num_swap_blocks
        )
        self.memory = self.scheduler.memory  # read-only: the pool and the swap space
        self.predictor = self.scheduler.predictor
        self.runner = ModelRunner(model, self.cache, num_swap_blocks)
        self.record_history = record_history
        self.requests: dict[int, Request] = {}  # unfinished ones (and finished, with history)
        self.step_count = 0
        self.timeline: list[StepRecord] = []  # with record_history only
        self.events: list[RequestEvent] = []  # with record_history only
        self._next_request_id = 0
        self._seconds = 0.0
        self._generating: dict[int, RequestOutput] | None = None  # outputs, while generate() runs
        self._counts = dict.fromkeys(
            (
                "admitted",
                "resumed",
                "finished",
                "aborted",
                "failed",
                "generated_tokens",
                "failed_steps",
                "running_sum",
                "records",
                "max_running",
                "peak_used",
                "retries",
                "thrown_away_tokens",
                "repairs",
                "thrown_away_token_layers",
            ),
            0,
        )
        self.device_timeline: list[
            torch.Tensor
        ] = []  # (D,) blocks in use after each step, with record_history
        self._used_after_forward = self.memory.num_used_blocks_per_device  # (D,) at the last forward
        self._peak_used_per_device: torch.Tensor | None = None  # (D,) running maximum, once a step ran

    # ----- requests in ------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], sampling_params: SamplingParams | dict | None = None) -> int:
        """Queue a request and return its id; ValueError, changing nothing, for a bad prompt or
        sampling parameters, or a request that might not fit the pool even alone."""
        params = check_sampling_params(sampling_params)
        prompt = check_prompt(
            prompt,
            self.config.vocab_size,
            self.config.max_position_embeddings,
            params.max_new_tokens,
            "the prompt",
        )
        self.scheduler.check_fits_alone(len(prompt), params.max_new_tokens, self._next_request_id)
        return self._queue(prompt, params)

    def _queue(self, prompt: list[int], params: SamplingParams) -> int:
        request = Request(self._next_request_id, prompt, params, arrival_step=self.step_count)
        self._next_request_id += 1
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        self._event(self.step_count, request.request_id, "arrived")
        return request.request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ----- requests out -------------------------------------------------------------------------------
    @torch.inference_mode(False)  # what it changes outlives it: never inference tensors (step)
    def abort_request(self, request_id: int) -> RequestOutput | None:
        """Stop a request, from any state, freeing its blocks now; its output so far ("aborted"),
        or None if it had already finished."""
        if self._next_request_id:
            given = f"ids 0..{self._next_request_id - 1} were given out"
        else:
            given = "no request has been added yet"
        request_id = check_int(
            "request_id", request_id, 0, meaning=f"the id of a request of this engine; {given}"
        )
        if request_id >= self._next_request_id:
            raise ValueError(f"request_id={request_id} is not a request of this engine ({given})")
        request = self.requests.get(int(request_id))
        if request is None or request.is_finished:
            return None
        before = Snapshot(self.scheduler)
        marks = self._records([request])
        try:  # finished and handed out, or neither
            self.scheduler.finish(request, self.step_count, "aborted")
            return self._hand_out(request, self.step_count)
        except BaseException:
            self._restore_records(marks)
            before.restore()
            raise

    def _hand_out(self, request: Request, step: int) -> RequestOutput:
        kind = _COUNTED_AS[request.finish_reason]
        self._counts[kind] += 1
        self._event(step, request.request_id, kind)
        output = RequestOutput.from_request(request)
        if not self.record_history:
            del self.requests[request.request_id]
        if self._generating is not None:  # generate() collects what it asked for
            self._generating[request.request_id] = output
        return output

    def _event(self, step: int, request_id: int, kind: str) -> None:
        if kind in ("admitted", "resumed"):
            self._counts[kind] += 1
        if self.record_history:
            self.events.append(RequestEvent(step, request_id, kind))

    # ----- one step -----------------------------------------------------------------------------------
    @torch.inference_mode(False)  # the state it changes outlives it (only the forward runs in it)
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, account; returns the requests that finished (served
        to the end, or failed in their own sampling: "error", while the others go on).

        Whatever the caller's mode, the step's bookkeeping runs outside inference mode and only its
        forward inside (model_runner.py): an inference tensor kept in the engine's state (a table,
        a count, an undo's copy) could not be changed in place by a later step run outside it.

        A step happens whole or not at all (undo.py): if anything raises, every object is put back
        as it was before the step (once its block copies have started: as it was after them, its
        preemptions and admissions kept), and the exception propagates with a note naming the step;
        no block leaks. A fault in the block copies makes the sequences they moved recompute."""
        start = time.perf_counter()
        step = self.step_count
        used_before = self.memory.num_used_blocks
        retry = None  # a reservation that retries: how to try again a step that ran short
        while True:
            num_running, scheduled_used = len(self.scheduler.running), used_before
            before = Snapshot(self.scheduler)
            # what a fault undoes: while "scheduling", no block has moved and the step is undone whole;
            # while "copying", a copy may be half done and the sequences the copies move recompute;
            # while "running", the forward is undone and the step's scheduling kept
            stage = "scheduling"
            try:
                with phase("scheduler"):
                    decision = self.scheduler.schedule(step, retry)
                if not decision.scheduled and not decision.block_copies and self.scheduler.has_unfinished:
                    raise RuntimeError(
                        f"step {step}: nothing could be scheduled with {len(self.scheduler.waiting)} "
                        f"waiting and {len(self.scheduler.running)} running requests"
                    )
                running_scheduled = len(self.scheduler.running)
                used_scheduled = self.memory.num_used_blocks
                # scheduling that moved no request and freed no block leaves the state `before` holds
                moved = (
                    decision.events
                    or decision.evictions
                    or decision.block_copies
                    or used_scheduled != used_before
                )
                stage = "copying"
                self.runner.copy_blocks(decision.block_copies)
                stage = "running"
                commit = functools.partial(
                    self._commit, step, decision, start, running_scheduled, used_scheduled
                )
                if self.scheduler.reservation.repairs:
                    return self._run_repairing(step, decision, None if moved else before, start)
                # _run ends the step (commit) inside its protected region: no line of it runs after
                return self._run(decision, None if moved else before, commit)
            except BaseException as error:
                if stage == "scheduling":
                    before.restore()
                    self._fail_step(error, step, start, num_running, scheduled_used, "while scheduling")
                    raise
                if stage == "copying":
                    self.scheduler.recover_from_failed_copies(decision)
                    self._fail_running(error, decision, step, start, running_scheduled, used_scheduled)
                    raise
                short = isinstance(error, OutOfBlocksError) and error.shortfall is not None
                reservation = self.scheduler.reservation
                if not short or not reservation.retries:
                    self._fail_running(error, decision, step, start, running_scheduled, used_scheduled)
                    raise
                # a layer found its device full: the step starts over, scheduling included, with
                # fewer admissions or the missing blocks freed first (the forward so far is thrown away)
                before.restore()
                self._counts["retries"] += 1
                self._counts["thrown_away_tokens"] += decision.num_scheduled_tokens
                retry = reservation.retry(decision, error, retry)

    def _run_repairing(self, step, decision, before_forward: Snapshot | None, start):
        """_run, under a reservation that repairs: while a layer finds a device short (_run undoes
        the forward), the chunk scheduled last leaves the step (`_repair`) and the forward runs again
        without it."""
        while True:
            commit = functools.partial(
                self._commit,
                step,
                decision,
                start,
                len(self.scheduler.running),
                self.memory.num_used_blocks,
            )
            try:
                return self._run(decision, before_forward, commit)
            except OutOfBlocksError as error:
                if error.shortfall is None:
                    raise
                self._repair(decision, error)
                before_forward = None  # the state moved: _run takes a new snapshot

    def _repair(self, decision, error: OutOfBlocksError) -> None:
        """Scheduler.repair drops the chunk scheduled last from `decision`, whose forward found the
        devices short by error.shortfall at error.layer; counted in token-layers (layers 0 up to
        the short one). A GPU engine would mask the chunk's tokens from that layer on and finish
        the forward in one pass; this reference runs the forward again without it, which leaves
        the same state (nothing of the others depends on it: attention is per sequence, routing
        per token) at the cost of CPU time alone."""
        index = self.scheduler.chunk_to_drop(decision)
        num_tokens = 0 if index is None else decision.scheduled[index].num_tokens
        self.scheduler.repair(decision, error.shortfall)  # RuntimeError where there is no chunk
        layers = self.memory.num_layers if error.layer is None else error.layer + 1
        self._counts["repairs"] += 1
        self._counts["thrown_away_token_layers"] += num_tokens * layers

    def _commit(
        self, step, decision, start, num_running, scheduled_used, done, used_blocks, num_generated
    ) -> list[RequestOutput]:
        """The end of a step: its events, the hand-out of the requests it finished, its records. Part
        of the step: `_run` calls it inside its protected region, so that a fault at any line here
        (or Ctrl-C) undoes the forward too and the requests it finished are handed out by a later
        step; the records it changed are put back first. Returns the step's outputs."""
        marks = self._records(done)  # a fault here has changed nothing of the records yet
        try:
            for kind, request in decision.events:
                self._event(step, request.request_id, kind)
            self._counts["generated_tokens"] += num_generated
            finished = [self._hand_out(request, step) for request in done]
            self._end_step(
                step,
                decision.num_scheduled_tokens,
                decision.reserved_blocks,
                start,
                num_running,
                used_blocks,
                scheduled_used,
            )
            used, peak = self._used_after_forward, self._peak_used_per_device  # (D,) each
            self._peak_used_per_device = used.clone() if peak is None else torch.maximum(peak, used)
            if self.record_history:
                self.device_timeline.append(used)
            return finished  # the commit: no line of the step runs after it
        except BaseException:
            self._restore_records(marks)
            raise

    def _records(self, handing_out: list[Request]) -> tuple:
        """What the end of a step changes in the engine's own records, for `_restore_records`: the
        lists by length (they only grow), the counts copied, and the requests about to be handed
        out (the only entries of `requests` and of generate()'s outputs a hand-out changes), so
        that the cost follows the step, not the history."""
        return (
            dict(self._counts),
            list(handing_out),
            len(self.events),
            len(self.timeline),
            len(self.device_timeline),
            self.step_count,
            self._seconds,
            self._peak_used_per_device,
        )

    def _restore_records(self, marks: tuple) -> None:
        counts, handing_out, num_events, num_records, num_devices_records, step, seconds, peak = marks
        self._counts.clear()
        self._counts.update(counts)
        for request in handing_out:  # unfinished again: back in `requests`, out of generate()'s outputs
            self.requests[request.request_id] = request
            if self._generating is not None:
                self._generating.pop(request.request_id, None)
        del self.events[num_events:]
        del self.timeline[num_records:]
        del self.device_timeline[num_devices_records:]
        self.step_count = step
        self._seconds = seconds
        self._peak_used_per_device = peak

    def _fail_running(self, error, decision, step, start, num_running, scheduled_used) -> None:
        """The step failed past scheduling: its admissions and preemptions are kept (recorded)."""
        for kind, request in decision.events:
            self._event(step, request.request_id, kind)
        ids = [item.request.request_id for item in decision.scheduled]
        self._fail_step(error, step, start, num_running, scheduled_used, f"running requests {ids}")

    def _fail_step(self, error, step, start, num_running, scheduled_used, where: str) -> None:
        self._counts["failed_steps"] += 1
        error.add_note(f"engine step {step} failed {where}; the step was undone, stepping on is safe")
        self._end_step(step, 0, 0, start, num_running, self.memory.num_used_blocks, scheduled_used)

    def _run(self, decision, before_forward: Snapshot | None, commit: Callable[..., list]):
        """Forward, sampling, accounting, then commit(finished requests, blocks in use after the
        forward: the step's peak, tokens generated), whose outputs it returns; undone to the state
        after the block copies if any of it raises, commit included (to `before_forward` if given:
        the state is still the one it holds)."""
        if not decision.scheduled:  # copies only: no forward to undo
            return commit([], self.memory.num_used_blocks, 0)
        before_forward = before_forward or Snapshot(self.scheduler)
        rows = [i for i, item in enumerate(decision.scheduled) if item.samples]
        requests = [decision.scheduled[i].request for i in rows]
        states = [
            (r.generator, r.generator.get_state()) for r in requests if not r.sampling_params.greedy
        ]  # a greedy choice draws nothing from it
        try:
            result = self.runner.forward(decision.scheduled)
            # the step's peak on each device: finished requests free their blocks after it
            self._used_after_forward = self.memory.num_used_blocks_per_device
            errors = {}  # a request's own failure: it alone finishes
            logits = result.last_logits if len(rows) == len(decision.scheduled) else result.last_logits[rows]
            tokens = sample_rows(
                logits, [r.sampling_params for r in requests], [r.generator for r in requests], errors
            )
            sampled = {r.request_id: t for i, (r, t) in enumerate(zip(requests, tokens)) if i not in errors}
            failed = {
                requests[i].request_id: f"sampling failed: {type(e).__name__}: {e}" for i, e in errors.items()
            }
            used_blocks = self.memory.num_used_blocks
            num_generated = sum(
                len(r.output_token_ids) < r.max_new_tokens for r in requests if r.request_id in sampled
            )
            with phase("scheduler"):
                done = self.scheduler.update_from_output(decision, sampled, result.entries_per_layer, failed)
            return commit(done, used_blocks, num_generated)
        except BaseException:
            undo(before_forward, states)
            raise

    def idle_step(self) -> None:
        """A step of time with nothing to run (requests have not arrived yet)."""
        used = self.memory.num_used_blocks
        self._end_step(self.step_count, 0, 0, None, len(self.scheduler.running), used, used)

    def _end_step(self, step, num_tokens, reserved, start, num_running, used_blocks, scheduled_used) -> None:
        """Count the step (start: its perf_counter; None: idle, 0 s) and record it, with history."""
        seconds = 0.0 if start is None else time.perf_counter() - start
        self._seconds += seconds
        self.step_count += 1
        counts = self._counts
        counts["records"] += 1
        counts["running_sum"] += num_running
        counts["max_running"] = max(counts["max_running"], num_running)
        counts["peak_used"] = max(counts["peak_used"], used_blocks)
        if not self.record_history:
            return
        waiting = self.scheduler.waiting
        num_preempted = sum(r.status is RequestStatus.PREEMPTED for r in waiting)
        self.timeline.append(
            StepRecord(
                step,
                num_running,
                len(waiting) - num_preempted,
                num_preempted,
                num_tokens,
                used_blocks,
                scheduled_used,
                reserved,
                self.memory.num_swapped_blocks,
                seconds,
            )
        )

    # ----- whole workloads ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams | list | None = None,
        on_step: Callable[["LLMEngine"], None] | None = None,
    ) -> list[RequestOutput]:
        """Serve every prompt to the end, checking all before queueing any; outputs in prompt order.
        If interrupted (KeyboardInterrupt, a failed step), its unfinished requests are aborted."""
        checked = check_batch(prompts, sampling_params, self.config, "sampling_params")
        for i, (prompt, params) in enumerate(checked):
            self.scheduler.check_fits_alone(len(prompt), params.max_new_tokens, self._next_request_id + i)
        ids = [self._queue(prompt, params) for prompt, params in checked]
        outputs: dict[int, RequestOutput] = {}
        self._generating = outputs  # every request handed out while it runs, aborted ones too
        try:
            while self.has_unfinished_requests():
                self.step()
                if on_step is not None:
                    on_step(self)
        except BaseException:
            for request_id in ids:
                if request_id not in outputs:
                    self.abort_request(request_id)
            raise
        finally:
            self._generating = None
        return [outputs[i] for i in ids]

    def prefix_cache_stats(self) -> dict | None:
        if not isinstance(self.cache.manager, PrefixCachingKVCacheManager):
            return None
        prefix = self.cache.manager.prefix_cache
        return {
            **dataclasses.asdict(prefix.stats),
            "num_evicted_cached_blocks": self.cache.manager.pool.num_evicted_cached_blocks,
            "num_cached_blocks": prefix.num_cached_blocks,
        }

    @property
    def peak_used_blocks_per_device(self) -> list[int]:
        """Most blocks in use on each device after any step so far ([] before the first)."""
        return [] if self._peak_used_per_device is None else self._peak_used_per_device.tolist()

    def eviction_stats(self) -> dict:
        s = self.scheduler
        return {
            **self.stats().to_dict(),
            "num_evictions": s.num_evictions,
            "num_row_evictions": s.num_row_evictions,
            "num_evicted_rows": s.num_evicted_rows,
            "num_dead_rows_freed": s.num_dead_rows_freed,
            "freed_on_short_device": s.freed_on_short_device,
            "freed_on_short_device_per_eviction": s.freed_on_short_device / max(1, s.num_evictions),
            "peak_used_blocks_per_device": self.peak_used_blocks_per_device,
        }

    def stats(self) -> EngineStats:
        """Totals so far, in O(1): counters, not a scan of the history."""
        counts, s = self._counts, self.scheduler
        return EngineStats(
            num_steps=self.step_count,
            num_admitted=counts["admitted"],
            num_preemptions=s.num_preemptions,
            num_resumed=counts["resumed"],
            num_finished=counts["finished"],
            num_recomputed_tokens=s.num_recomputed_tokens,
            num_swapped_out_blocks=s.num_swapped_out_blocks,
            num_generated_tokens=counts["generated_tokens"],
            max_concurrent_sequences=counts["max_running"],
            peak_used_blocks=counts["peak_used"],
            seconds=self._seconds,
            mean_concurrent_sequences=counts["running_sum"] / max(1, counts["records"]),
            num_aborted=counts["aborted"],
            num_failed=counts["failed"],
            num_failed_steps=counts["failed_steps"],
            num_retries=counts["retries"],
            num_thrown_away_tokens=counts["thrown_away_tokens"],
            num_repairs=counts["repairs"],
            num_thrown_away_token_layers=counts["thrown_away_token_layers"],
        )


@known_keywords
def generate_with_engine(
    model: MoEKVTransformer,
    prompts: list[list[int]],
    params,
    block_size: int = 16,
    num_blocks: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    scheduler_config: SchedulerConfig | None = None,
    shuffle_seed: int | None = None,
):
    """`generate.generate(..., cache="paged")` through the serving engine (the same result);
    without num_blocks the pool holds every prompt's worst case at once."""
    if not isinstance(model, MoEKVTransformer):
        raise ValueError(f"model must be a MoEKVTransformer, got {type(model).__name__}")
    check_callable("on_token", on_token, "(prompt index, token)")
    c = model.config
    prompts, per_prompt = map(list, zip(*check_batch(prompts, params, c, "params")))
    if num_blocks is None:
        block_size = check_block_size(block_size)  # the pool sized here divides by it
        num_blocks = sum(
            worst_case_lifetime_blocks(
                len(p) + q.max_new_tokens - 1,
                c.num_hidden_layers,
                c.num_attention_experts,
                c.num_attention_experts_per_tok,
                block_size,
            )
            for p, q in zip(prompts, per_prompt)
        )
        num_blocks = max(num_blocks, c.num_hidden_layers * c.num_attention_experts_per_tok)
    engine = LLMEngine(
        model, num_blocks, block_size, scheduler_config, shuffle_seed=shuffle_seed, record_history=True
    )
    streamed = [0] * len(prompts)

    def stream(engine):
        for i, request in enumerate(engine.requests.values()):
            for token in request.output_token_ids[streamed[i] :]:
                on_token(i, token)
            streamed[i] = len(request.output_token_ids)

    outputs = engine.generate(prompts, per_prompt, on_step=stream if on_token is not None else None)
    counts = torch.stack([engine.requests[o.request_id].final_token_counts for o in outputs])  # (B, L, E)
    engine.memory.assert_no_leak()
    return GenerationResult(
        [list(p) for p in prompts],
        [o.token_ids for o in outputs],
        counts,
        None,
        {"cache": "paged", "engine": True, "block_size": engine.cache.block_size, "num_blocks": num_blocks},
    )
