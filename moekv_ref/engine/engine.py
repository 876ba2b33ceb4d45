"""The serving engine: `add_request`, `step`, `generate`.

    add_request ─> Scheduler.schedule ─> ModelRunner.execute ─> sample ─> Scheduler.update_from_output
                   (admit, reserve,       (swap copies, then     (each request's  (tokens counted, finish:
                    preempt: integers,     one forward_cached     own seeded       blocks freed)
                    one SchedulerOutput)   over the flat batch)   generator)

One `step` is one forward of the model over every scheduled token. Everything a request needs to be
served is checked in `add_request` before any state changes: a bad prompt, bad sampling parameters, or
a request that might not fit the pool even alone is refused there with a ValueError, and the requests
already in the engine are untouched.

The engine records, per step, the pool's use and the scheduler's decisions (`timeline`, `events`),
which the demo, the notebook and the serving benchmark turn into figures and tables.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.paged import PagedKVCache
from ..model import MoEKVTransformer
from ..results import GenerationResult
from ..sampling import SamplingParams, sample_next
from .demand import worst_case_lifetime_blocks
from .memory import ModelShape
from .model_runner import ModelRunner
from .request import Request, RequestOutput, RequestStatus
from .scheduler import Scheduler, SchedulerConfig


@dataclass
class StepRecord:
    """The state after one step (or one idle tick while waiting for arrivals)."""
    step: int
    num_running: int            # sequences holding the pool during the step
    num_waiting: int            # never run yet
    num_preempted: int          # waiting to resume
    num_scheduled_tokens: int
    used_blocks: int            # pool blocks owned by sequences after the forward, before finishing
    scheduled_used_blocks: int  # blocks in use when the step was scheduled: + reserved <= pool
    reserved_blocks: int        # worst case the step reserved before running
    swapped_blocks: int         # blocks in the CPU swap space
    seconds: float              # wall time of the step (not reproducible; never printed rounded)


@dataclass
class RequestEvent:
    step: int
    request_id: int
    kind: str                   # "arrived", "admitted", "preempted", "resumed", "finished"


@dataclass
class EngineStats:
    num_steps: int
    num_admitted: int
    num_preemptions: int
    num_resumed: int
    num_finished: int
    num_recomputed_tokens: int
    num_swapped_out_blocks: int
    num_generated_tokens: int
    max_concurrent_sequences: int
    peak_used_blocks: int
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class LLMEngine:
    """Continuous batching over a paged per-expert KV cache of `num_blocks` blocks of `block_size`.

    num_swap_blocks: size of the CPU swap space (default: as large as the pool when preempting by
    swap, none otherwise).
    attention: the paged cache's attention path (see PagedKVCache); None follows the model's
    backend: "triton" for a model built on the Triton backend, else "batched".
    """

    def __init__(self, model: MoEKVTransformer, num_blocks: int, block_size: int = 16,
                 scheduler_config: SchedulerConfig | None = None, num_swap_blocks: int | None = None,
                 shuffle_seed: int | None = None, attention: str | None = None):
        scheduler_config = scheduler_config or SchedulerConfig()
        if num_swap_blocks is None:
            num_swap_blocks = num_blocks if scheduler_config.preemption_mode == "swap" else 0
        self.model = model
        self.config = model.config
        self.cache = PagedKVCache.for_model(model, block_size, num_blocks, shuffle_seed=shuffle_seed,
                                            attention=attention)
        self.scheduler = Scheduler(scheduler_config, self.cache.manager,
                                   ModelShape.from_config(self.config, block_size), num_swap_blocks)
        self.memory = self.scheduler.memory          # read-only: the pool and the swap space
        self.predictor = self.scheduler.predictor
        self.runner = ModelRunner(model, self.cache, num_swap_blocks)
        self.requests: dict[int, Request] = {}
        self.step_count = 0
        self.timeline: list[StepRecord] = []
        self.events: list[RequestEvent] = []
        self._next_request_id = 0
        self._seconds = 0.0

    # ----- requests in ------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], sampling_params: SamplingParams | dict | None = None) -> int:
        """Queue a request; returns its id. Raises ValueError, changing nothing, for an empty prompt,
        token ids outside the vocabulary, invalid sampling parameters, a generation past the model's
        positions, or a request that might not fit the pool even alone."""
        params = self._checked_params(sampling_params)
        prompt = self._checked_prompt(prompt, params.max_new_tokens)
        self.scheduler.check_fits_alone(len(prompt), params.max_new_tokens)
        request = Request(self._next_request_id, prompt, params, arrival_step=self.step_count)
        self._next_request_id += 1
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        self.events.append(RequestEvent(self.step_count, request.request_id, "arrived"))
        return request.request_id

    @staticmethod
    def _checked_params(sampling_params) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        if isinstance(sampling_params, dict):
            return SamplingParams(**sampling_params)                   # validates
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or a dict, got "
                             f"{type(sampling_params).__name__}")
        # validate again: a frozen dataclass can still be forced into a bad state
        return SamplingParams(**dataclasses.asdict(sampling_params))

    def _checked_prompt(self, prompt, max_new_tokens: int) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]!r} is not an integer in [0, {vocab})")
        limit = self.config.max_position_embeddings
        if len(prompt) + max_new_tokens - 1 > limit:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} would pass "
                             f"max_position_embeddings={limit}; ask for at most "
                             f"{limit - len(prompt) + 1} new tokens")
        return prompt

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ----- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample. Returns the requests that finished in this step."""
        start = time.perf_counter()
        step = self.step_count
        decision = self.scheduler.schedule(step)
        self.events += [RequestEvent(step, r.request_id, kind) for kind, r in decision.events]
        finished: list[RequestOutput] = []
        num_running, used_blocks = len(self.scheduler.running), self.memory.num_used_blocks
        scheduled_used = used_blocks
        result = self.runner.execute(decision)                 # swap copies first, then the forward
        if decision.scheduled:
            used_blocks = self.memory.num_used_blocks           # the peak of the step: before finishing
            sampled = {}
            for item, logits in zip(decision.scheduled, result.last_logits):
                if item.samples:
                    request = item.request
                    sampled[request.request_id] = sample_next(logits, request.sampling_params, request.generator)
            for request in self.scheduler.update_from_output(decision, sampled, result.entries_per_layer):
                self.events.append(RequestEvent(step, request.request_id, "finished"))
                finished.append(RequestOutput.from_request(request))
        elif self.scheduler.has_unfinished:
            raise RuntimeError(f"step {step}: nothing could be scheduled with {len(self.scheduler.waiting)} "
                               f"waiting and {len(self.scheduler.running)} running requests")
        seconds = time.perf_counter() - start
        self._seconds += seconds
        self._record(step, decision.num_scheduled_tokens, decision.reserved_blocks, seconds,
                     num_running, used_blocks, scheduled_used)
        self.step_count += 1
        return finished

    def idle_step(self) -> None:
        """Let a step of time pass with nothing to run (requests have not arrived yet)."""
        self._record(self.step_count, 0, 0, 0.0)
        self.step_count += 1

    def _record(self, step, num_tokens, reserved, seconds, num_running=None, used_blocks=None,
                scheduled_used=None) -> None:
        waiting = self.scheduler.waiting
        num_preempted = sum(r.status is RequestStatus.PREEMPTED for r in waiting)
        num_running = len(self.scheduler.running) if num_running is None else num_running
        used_blocks = self.memory.num_used_blocks if used_blocks is None else used_blocks
        scheduled_used = used_blocks if scheduled_used is None else scheduled_used
        self.timeline.append(StepRecord(step, num_running, len(waiting) - num_preempted, num_preempted,
                                        num_tokens, used_blocks, scheduled_used, reserved,
                                        self.memory.num_swapped_blocks, seconds))

    # ----- whole workloads ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list | None = None,
                 on_step: Callable[["LLMEngine"], None] | None = None) -> list[RequestOutput]:
        """Serve every prompt to the end; outputs in the order of `prompts`. Every prompt and its
        parameters are checked before the first is queued, so a bad one leaves the engine unchanged."""
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
        checked = []
        for prompt, params in zip(prompts, per_prompt):
            params = self._checked_params(params)
            checked.append((self._checked_prompt(prompt, params.max_new_tokens), params))
            self.scheduler.check_fits_alone(len(checked[-1][0]), params.max_new_tokens)
        ids = [self.add_request(prompt, params) for prompt, params in checked]
        while self.has_unfinished_requests():
            self.step()
            if on_step is not None:
                on_step(self)
        return [RequestOutput.from_request(self.requests[i]) for i in ids]

    def stats(self) -> EngineStats:
        kinds = [e.kind for e in self.events]
        return EngineStats(
            num_steps=self.step_count,
            num_admitted=kinds.count("admitted"),
            num_preemptions=self.scheduler.num_preemptions,
            num_resumed=kinds.count("resumed"),
            num_finished=kinds.count("finished"),
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            num_swapped_out_blocks=self.scheduler.num_swapped_out_blocks,
            num_generated_tokens=sum(len(r.generated_token_ids) for r in self.requests.values()),
            max_concurrent_sequences=max((s.num_running for s in self.timeline), default=0),
            peak_used_blocks=max((s.used_blocks for s in self.timeline), default=0),
            seconds=self._seconds,
        )


def generate_with_engine(model: MoEKVTransformer, prompts: list[list[int]], params, block_size: int = 16,
                         num_blocks: int | None = None, on_token: Callable[[int, int], None] | None = None,
                         scheduler_config: SchedulerConfig | None = None, shuffle_seed: int | None = None):
    """`generate.generate(..., cache="paged")` through the serving engine: the same GenerationResult
    (tokens, and the (B, L, E) tokens each row held when its request finished), produced by
    continuous batching over the paged pool. Without num_blocks the pool holds every prompt's
    worst case at once, so nothing is preempted; give fewer to watch preemption keep the tokens."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if num_blocks is None:
        c = model.config
        num_blocks = sum(worst_case_lifetime_blocks(len(p) + q.max_new_tokens - 1, c.num_hidden_layers,
                                                    c.num_attention_experts, c.num_attention_experts_per_tok,
                                                    block_size) for p, q in zip(prompts, per_prompt))
        num_blocks = max(num_blocks, c.num_hidden_layers * c.num_attention_experts_per_tok)
    engine = LLMEngine(model, num_blocks, block_size, scheduler_config, shuffle_seed=shuffle_seed)
    streamed = [0] * len(prompts)

    def stream(engine):
        for i, request in enumerate(engine.requests.values()):
            for token in request.output_token_ids[streamed[i]:]:
                on_token(i, token)
            streamed[i] = len(request.output_token_ids)

    outputs = engine.generate(prompts, per_prompt, on_step=stream if on_token is not None else None)
    counts = torch.stack([engine.requests[o.request_id].final_token_counts for o in outputs])   # (B, L, E)
    engine.memory.assert_no_leak()
    return GenerationResult([list(p) for p in prompts], [o.token_ids for o in outputs], counts, None,
                            {"cache": "paged", "engine": True, "block_size": block_size, "num_blocks": num_blocks})
