"""RowEvictingScheduler: the Scheduler (scheduler.py) with a victim policy that drops single rows
(victims.RowEviction, e.g. expert_lru); it adds stalled requests and their dead rows.

Whole sequences are what the Scheduler preempts: a row at layer l is rebuilt only by re-running the
whole sequence (K/V at layer l depend on every earlier layer), so freeing 1/E of a layer's share
costs a whole recompute. A RowEviction shows why: its request *stalls* at the head of the line, to
be recomputed whole, while its other rows stay in the pool as dead weight, freed first when their
device is short, when nothing runs, and when it resumes. Its worst case restarts from empty rows.

Only a manager that `can_evict_rows` runs it (plain pages: no block shared between rows), as
scheduler_config.check_scheduler_arguments says.
"""

from __future__ import annotations

import torch

from .request import Request
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .victims import RowEviction, check_victim


class RowEvictingScheduler(Scheduler):
    """Scheduler, taking single rows off a victim and stalling it (module docstring)."""

    STATE = (*Scheduler.STATE, "stalled", "num_row_evictions", "num_evicted_rows", "num_dead_rows_freed")
    takes_rows = True

    def __init__(self, config, manager, shape, num_swap_blocks: int = 0):
        super().__init__(config, manager, shape, num_swap_blocks)
        self.stalled: dict[int, Request] = {}  # request id -> request whose rows were evicted, in order
        self.num_row_evictions = 0
        self.num_evicted_rows = 0
        self.num_dead_rows_freed = 0

    def take_off(self, choice, candidates: list[Request], out: SchedulerOutput) -> tuple[Request, str]:
        """Scheduler.take_off; a RowEviction drops the chosen rows and the request stalls."""
        if not isinstance(choice, RowEviction):
            return super().take_off(choice, candidates, out)
        request = choice.request
        check_victim(self.victims, request, candidates)
        self.num_row_evictions += 1
        self.num_evicted_rows += self._free_rows(request.request_id, choice.layer_experts)
        self.running.remove(request)
        self.stalled[request.request_id] = request
        self._forget_computed(request)
        self._requeue_preempted(request, out)
        return request, "rows"

    def free_idle_blocks(self, device: int | None) -> bool:
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

    def row_counts(self, requests: list[Request]) -> torch.Tensor:
        """Scheduler.row_counts; a stalled request restarts empty."""
        counts = super().row_counts(requests)
        stalled = [i for i, r in enumerate(requests) if r.request_id in self.stalled]
        if stalled:
            counts = counts.clone()
            counts[stalled] = 0
        return counts

    def head_fits(self, request: Request, reserved: torch.Tensor, token_budget: int) -> bool:
        """Scheduler.head_fits; a stalled request's dead rows go when it starts."""
        if request.request_id not in self.stalled:
            return super().head_fits(request, reserved, token_budget)
        need = self.step_blocks(request, self.reservation.chunk_tokens(request, token_budget))
        need = need - self.memory.blocks_held_per_device(request.request_id)
        return self.fits((reserved + need).tolist())

    def start_head(self, out: SchedulerOutput) -> Request:
        """Scheduler.start_head; a stalled one without its dead rows."""
        request_id = self.waiting[0].request_id
        if self.stalled.pop(request_id, None) is not None:
            self.manager.free(request_id)
        return super().start_head(out)

    def finish(self, request: Request, step: int, reason: str = "length", error: str | None = None) -> None:
        """Scheduler.finish; a stalled request aborted while it waits leaves the stalled ones too."""
        super().finish(request, step, reason, error)
        self.stalled.pop(request.request_id, None)
