"""PrefixCachingScheduler: the Scheduler (scheduler.py) over a manager that caches prefixes; it adds
starting a request from a cached prefix.

A request holding nothing (not swapped, no rows) may start from the longest cached prefix of its
tokens (`prefix_hit`): its full blocks shared, the ones straddling its end copied (a COPY block copy
the runner performs before the forward). The head of the waiting line then reserves its remaining
tokens' worst case plus the free blocks the hit takes (`hit_step_blocks`); where that does not fit
it starts from nothing, as in the Scheduler. After each step the computed tokens' blocks become
findable (the manager's PrefixCache.cache_computed_blocks).

Only policy='continuous_paged' runs it: a hit takes blocks at admission, which only that policy's
step check counts.
"""

from __future__ import annotations

import torch

from .batching import ContinuousBatching
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .swap import COPY, BlockCopy


class PrefixCachingScheduler(Scheduler):
    """Scheduler, starting requests from cached prefixes (module docstring)."""

    STATE = (*Scheduler.STATE, "_hit")

    def __init__(self, config, manager, shape, num_swap_blocks: int = 0):
        super().__init__(config, manager, shape, num_swap_blocks)
        # by name: continuous_reserved is a ContinuousBatching too, with an admission of its own
        if self.batching.name != ContinuousBatching.name:
            raise ValueError(
                f"prefix caching works with policy='continuous_paged' only, not {config.policy!r}: "
                "a hit takes blocks at admission, which only that policy's step check counts"
            )
        self.prefix_cache = manager.prefix_cache
        self._hit = None  # (request id, PrefixHit) the head starts from, as head_fits chose

    def prefix_hit(self, request: Request):
        """The PrefixHit a request holding nothing (not swapped) would start from."""
        if request.swapped or self.memory.holds(request.request_id):
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

    def head_fits(self, request: Request, reserved: torch.Tensor, token_budget: int) -> bool:
        """Scheduler.head_fits, from the request's prefix hit where that fits."""
        self._hit = None
        hit = self.prefix_hit(request)
        if hit is not None:
            need = self.hit_step_blocks(hit, min(request.num_tokens - hit.num_tokens, token_budget))
            if self.fits((reserved + need).tolist()):
                self._hit = (request.request_id, hit)
                return True
            # the hit holds more free blocks than it saves now (cached-free blocks it shares, copy
            # sources pinned while it is applied): start from nothing if that fits
        return super().head_fits(request, reserved, token_budget)

    def start_head(self, out: SchedulerOutput) -> Request:
        """Scheduler.start_head; a request holding nothing starts its sequence in the prefix cache,
        from the hit head_fits chose (if any)."""
        request = self.waiting[0]
        chosen, self._hit = self._hit, None
        if not request.swapped and not self.memory.holds(request.request_id):
            hit = chosen[1] if chosen is not None and chosen[0] == request.request_id else None
            copies = self.prefix_cache.start_sequence(request.request_id, request.num_tokens, hit)
            if hit is not None:
                request.start_from_prefix(hit)
                if copies[0].numel():
                    out.block_copies.append(BlockCopy(COPY, *copies))
                    out.prefix_copied.append(request)
        return super().start_head(out)

    def tokens_computed(self, request: Request) -> None:
        """Its computed tokens' blocks become findable (prefix_cache.py)."""
        if self.memory.holds(request.request_id):
            self.prefix_cache.cache_computed_blocks(
                request.request_id, request.all_token_ids[: request.num_computed_tokens]
            )

    def recover_from_failed_copies(self, out: SchedulerOutput) -> None:
        """Scheduler.recover_from_failed_copies; a request started from a hit with copies drops
        them too (they may be incomplete)."""
        super().recover_from_failed_copies(out)
        for request in out.prefix_copied:
            if request.status is RequestStatus.RUNNING and self.memory.holds(request.request_id):
                self.manager.free(request.request_id)
                request.forget_computed(recomputed=False)  # nothing of its own was computed
