"""The serving benchmark's two baselines as batching policies: the same scheduler loop, runner and
pool as continuous paged batching, only a different rule for who may run.
"""

from __future__ import annotations

from .admission import AdmissionPolicy
from .batching import AdmissionStep, BatchingPolicy, ContinuousBatching
from .demand import reserved_blocks
from .memory import MemoryView
from .request import Request


def _reservation(num_cached_tokens: int, memory: MemoryView) -> int:
    """Every row's worst case: all the tokens, or its budget's B."""
    cap = (
        num_cached_tokens if memory.max_row_tokens is None else min(num_cached_tokens, memory.max_row_tokens)
    )
    return reserved_blocks(cap, memory.num_layers, memory.num_experts, memory.block_size)


class ReserveEveryRow(AdmissionPolicy):
    """Admit while every request's lifetime reservation (room for all its tokens in every row)
    fits the pool together: what a per-expert contiguous cache must do, not knowing the routing."""

    name = "reserved"

    def allows(self, request, running, memory, predictor) -> bool:
        total = sum(_reservation(r.max_cached_tokens, memory) for r in list(running) + [request])
        return total <= memory.num_blocks


class ContinuousReserved(ContinuousBatching):
    """Continuous batching, each request reserving every (layer, expert) row's worst case for its
    whole life: the pool never runs short (no preemption) and few requests run at once."""

    name = "continuous_reserved"

    def __init__(self):
        super().__init__(ReserveEveryRow())

    def max_blocks_alone(self, num_cached_tokens: int, memory: MemoryView) -> int:
        return _reservation(num_cached_tokens, memory)

    __repr__ = BatchingPolicy.__repr__  # "ContinuousReserved()": its admission is fixed


class StaticBatching(BatchingPolicy):
    """Static batching: a new batch only when the last one is done, the longest prefix of the queue
    whose members, each reserving every row's worst case for the padded length (longest prompt +
    longest output), fit the pool. Every member decodes (and throws away) tokens until the batch's
    longest output is done, as a padded batch does; the padding is kept here, per request."""

    STATE = ("_padding",)

    name = "static"

    def __init__(self):
        self._padding: dict[int, int] = {}  # request id -> tokens decoded past its output

    def max_blocks_alone(self, num_cached_tokens: int, memory: MemoryView) -> int:
        return _reservation(num_cached_tokens, memory)

    def num_new_tokens(self, request: Request) -> int:
        return request.max_new_tokens + self._padding.get(request.request_id, 0)

    def admit(self, step: AdmissionStep) -> None:
        if step.running or step.head is None:
            return
        memory = step.memory
        batch: list[Request] = []
        for request in step.peek(step.max_num_seqs):
            candidate = batch + [request]
            padded = (
                max(len(r.prompt_token_ids) for r in candidate) + max(r.max_new_tokens for r in candidate) - 1
            )
            if len(candidate) * _reservation(padded, memory) > memory.num_blocks:
                break
            batch.append(request)
        batch = batch or [step.head]  # fits alone: checked at add_request
        longest_output = max(r.max_new_tokens for r in batch)
        for request in batch:
            # padding: decode until the batch's longest output ends, within the model's positions
            room = memory.shape.max_num_positions - 1 - request.max_cached_tokens
            self._padding[request.request_id] = min(longest_output - request.max_new_tokens, room)
            step.start_next()

    def release(self, request: Request) -> None:
        self._padding.pop(request.request_id, None)
