"""What one step of the scheduler decided (SchedulerOutput), for the runner and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request
from .swap import BlockCopy


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
