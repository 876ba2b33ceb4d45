"""SwappingScheduler: the Scheduler (scheduler.py) under preemption_mode='swap'; it adds a swap
space (swap.py) that a preempted request's blocks are copied out to, and back from when it resumes.

A victim holding blocks is swapped out when the swap space has room for them (a SWAP_OUT block copy
the runner performs before the forward), else recomputed as in the Scheduler. A swapped request
holds host blocks only: its worst case grows from the rows it saved, and to start again it takes as
many device blocks as it holds host blocks, on the same devices (a SWAP_IN copy).
"""

from __future__ import annotations

import torch

from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .swap import SwapSpace


class SwappingScheduler(Scheduler):
    """Scheduler, preempting by swap where the swap space has room (module docstring). Only a
    swap-PREEMPTED request holds swap blocks, and it holds no pool blocks."""

    STATE = (*Scheduler.STATE, "num_swapped_out_blocks")
    swaps = True

    def __init__(self, config, manager, shape, num_swap_blocks: int = 0):
        super().__init__(config, manager, shape, num_swap_blocks)
        self.num_swapped_out_blocks = 0

    def make_swap_space(self, num_swap_blocks: int) -> SwapSpace:
        """The swap space of num_swap_blocks host blocks (more than 0: check_swap_space)."""
        return SwapSpace(self.manager, num_swap_blocks)

    def row_counts(self, requests: list[Request]) -> torch.Tensor:
        """Scheduler.row_counts; a swapped request's are the rows it saved."""
        if not any(r.swapped for r in requests):
            return super().row_counts(requests)
        held = iter(super().row_counts([r for r in requests if not r.swapped]))
        return torch.stack(
            [self.memory.swapped_token_counts(r.request_id) if r.swapped else next(held) for r in requests]
        )

    def head_fits(self, request: Request, reserved: torch.Tensor, token_budget: int) -> bool:
        """Scheduler.head_fits, with the blocks a swapped request takes to come back."""
        swapped = self.memory.swapped_blocks_per_device(request.request_id)  # (D,)
        return super().head_fits(request, reserved + swapped, token_budget)

    def start_head(self, out: SchedulerOutput) -> Request:
        """Scheduler.start_head; a swapped request is swapped back in first."""
        request = self.waiting[0]
        if request.swapped:
            out.block_copies.append(self.swap_space.swap_in(request.request_id))
            out.swapped_in.append(request)
            request.leave_swap_space()
        return super().start_head(out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Swapped out where it holds blocks and the swap space has room; else Scheduler._preempt."""
        seq_id = request.request_id
        if not (self.memory.holds(seq_id) and self.swap_space.can_swap_out(seq_id)):
            return super()._preempt(request, out)
        self.running.remove(request)
        copy = self.swap_space.swap_out(seq_id)
        out.block_copies.append(copy)
        out.swapped_out.append(request)
        self.num_swapped_out_blocks += copy.source.numel()
        self._requeue_preempted(request, out, swapped=True)

    def finish(self, request: Request, step: int, reason: str = "length", error: str | None = None) -> None:
        """Scheduler.finish; a swapped request's host blocks go back too."""
        if request.swapped:
            self.swap_space.discard(request.request_id)
        super().finish(request, step, reason, error)

    def recover_from_failed_copies(self, out: SchedulerOutput) -> None:
        """Scheduler.recover_from_failed_copies; the requests swapped out or in by the failed copies
        drop what they moved and recompute."""
        super().recover_from_failed_copies(out)
        for request in out.swapped_out:
            if request.swapped:
                self.swap_space.discard(request.request_id)
                request.leave_swap_space()
                self._forget_computed(request)
        for request in out.swapped_in:
            if request.status is RequestStatus.RUNNING and self.memory.holds(request.request_id):
                self.manager.free(request.request_id)
                self._forget_computed(request)
