"""The trace runner's scheduler: the engine's Scheduler (engine/scheduler.py) with four speed-ups
that make its decisions in fewer tensor operations.

The engine runs the plain Scheduler, so the worst case it reserves is the formula notebook 04
teaches (engine/demand.py's bounds over every row). The simulator replays steps of 256 sequences x
24 layers x 64 experts, where that formula over every row of every running request is most of a
step; this class reads the same numbers from smaller tables:

    decode need      a decode step's worst case (every request one token into rows it holds) from
                     the counting manager's per-slot tables `open_rows` / `open_per_device` (where
                     the trace runner builds a CountingKVCacheManager: sim/counting.py) instead of every
                     row (demand.decode_step_blocks_per_device): bound A is the open rows of each
                     (layer, device), bound B the experts a token can take there, min(k_max, E_d)
    fresh needs      the worst case of a request with nothing computed, held or swapped depends on its
                     token count alone where rows live on their experts' devices: remembered per count
                     (the head of a line that does not fit is asked again every step)
    one pool         with D = 1, demand.py's bounds in a third of the tensor calls
    all at once      when every running request's planned tokens fit together (most decode steps), one
                     check schedules them all, instead of one check per request

The reservation policy (engine/reservation.py) is handed the worst case as the scheduler's
`worst_case_step_blocks`, which this class overrides: the first three apply under either policy
(worst_case reserves it; optimistic reads it to decide whether a step may run short, and for a
prefill chunk where it cannot spread the expected blocks over the experts' devices).

Each is tested against the plain Scheduler, decision by decision over whole runs and on random
states, and broken on purpose to show the tests would see it (tests/spec/test_sim_fast_paths.py).
"""

from __future__ import annotations

import torch

from ..cache.rows import ceil_div, worst_case_lifetime_blocks
from ..engine.demand import decode_step_blocks_per_device, step_need
from ..engine.request import Request
from ..engine.scheduler import Scheduler
from ..engine.scheduler_output import SchedulerOutput
from .counting import CountingKVCacheManager


class FastScheduler(Scheduler):
    """Scheduler, deciding the same, faster on the simulator's shapes (module docstring)."""

    STATE = (*Scheduler.STATE, "_fresh_needs")

    def __init__(self, config, manager, shape, num_swap_blocks: int = 0):
        super().__init__(config, manager, shape, num_swap_blocks)
        # the experts of each (layer, device), where rows live on their experts' devices and no
        # budget caps them: what a decode token's worst case reads beside open_rows; None otherwise
        self._experts_on = (
            None if self.memory.max_row_tokens is not None else manager.placement.experts_per_device()
        )  # (L, D)
        # whether a token can open fewer blocks of some (layer, device) than it has rows there
        # (k_max below the experts there): only then does _decode_need read open_rows per layer
        self._caps_bind = self._experts_on is not None and bool((self._experts_on > shape.k_max).any())
        # the per-slot tables open_rows / open_per_device: the counting manager keeps them
        self._tables = manager if isinstance(manager, CountingKVCacheManager) else None
        self._fresh_needs: dict[int, torch.Tensor] = {}  # token count -> (1, D)

    # ----- all at once ------------------------------------------------------------------------------
    def schedule_running(
        self,
        out: SchedulerOutput,
        planned: list[int],
        needs: torch.Tensor,
        reserved: torch.Tensor,
        token_budget: int,
        shortfall: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        """Every running request's planned tokens, scheduled after one check, when together they fit
        the token budget and every device: the plain loop would find each request fits in turn and
        preempt none. Otherwise the plain loop. Measured on the trace runner (300 requests, 24
        layers, 64 experts top-8 on 64 devices, up to 256 running, one thread, CPU time of two runs
        each): 9.1-9.3 s with it, 10.5-12.2 s without."""
        if self.running and sum(planned) <= token_budget:
            total = reserved + needs.sum(0)  # (D,)
            if self.fits(total.tolist()):
                for request, num_tokens, blocks in zip(self.running, planned, needs.sum(1).tolist()):
                    self.schedule_tokens(out, request, num_tokens, blocks)
                return total, token_budget - sum(planned)
        return super().schedule_running(out, planned, needs, reserved, token_budget, shortfall)

    # ----- the worst case from smaller tables -----------------------------------------------------
    def worst_case_step_blocks(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor:
        """Scheduler.worst_case_step_blocks: decode tokens from the manager's tables where they apply
        (`_decode_need`), a fresh request from its count's remembered need, the rest over their rows."""
        decoding = [
            i for i, (r, n) in enumerate(zip(requests, num_tokens)) if n == 1 and r.num_computed_tokens > 0
        ]
        if len(decoding) < len(requests) and decoding:  # a step with prefills: two parts
            needs = torch.zeros(len(requests), self.num_devices, dtype=torch.int64)
            chosen = set(decoding)
            others = [i for i in range(len(requests)) if i not in chosen]
            for part in (decoding, others):
                needs[part] = self.worst_case_step_blocks(
                    [requests[i] for i in part], [num_tokens[i] for i in part]
                )
            return needs
        decode = self._decode_need(requests, num_tokens)
        if decode is not None:
            return decode
        if len(requests) == 1 and self._experts_on is not None and self._is_fresh(requests[0]):
            if num_tokens[0] not in self._fresh_needs:
                self._fresh_needs[num_tokens[0]] = super().worst_case_step_blocks(requests, num_tokens)
            return self._fresh_needs[num_tokens[0]].clone()
        return super().worst_case_step_blocks(requests, num_tokens)

    def _is_fresh(self, request: Request) -> bool:
        """Nothing computed, held or swapped: every row count is zero."""
        return (
            request.num_computed_tokens == 0
            and not request.swapped
            and not self.memory.holds(request.request_id)
        )

    def _decode_need(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor | None:
        """The worst case when every request decodes one token into the rows it holds: the same
        (m, D), read from the manager's open_rows (or, where k_max caps no device, their sum over the
        layers, open_per_device) instead of every row; None where it does not apply (a manager
        without those tables, a budget, home devices, a prefill, a swapped or stalled request)."""
        if (
            self._experts_on is None
            or self._tables is None
            or not requests
            or any(n != 1 for n in num_tokens)
            or any(r.swapped or r.request_id in self.stalled for r in requests)
        ):
            return None
        slots = self._tables.seq_slots([r.request_id for r in requests])
        if None in slots:  # one is not held
            return None
        if not self._caps_bind:  # min(open rows, k_d) is the open rows: their sum over the layers
            return self._tables.open_per_device[slots]  # (m, D)
        open_rows = self._tables.open_rows[slots]  # (m, L, D)
        # the lifetime cap of worst_case_need never binds here: one token's worst case (k_d open rows
        # of device d) is a routing the token can take, so held + step is a state some routing
        # reaches, within the lifetime worst case (tests/spec/test_sim_fast_paths.py compares the two)
        return decode_step_blocks_per_device(open_rows, self.shape.k_max, self._experts_on)  # (m, D)

    def worst_case_need(
        self, counts: torch.Tensor, num_tokens: list[int], totals: list[int], devices: torch.Tensor
    ) -> torch.Tensor:
        """Scheduler.worst_case_need; with one pool in a third of the tensor calls. Bound B does not
        depend on the rows and A <= E * ceil(n / P), so min(A, B) = min(A, rows.py's one-layer
        lifetime bound). Measured on 16 decoding requests of the embedded model's shape (4 layers, 8
        experts), one thread: 56 us a call against 148 us for the per-device form, 2.7x."""
        if self.num_devices > 1:
            return super().worst_case_need(counts, num_tokens, totals, devices)
        memory = self.memory
        L = memory.num_layers
        E = memory.num_experts
        K = self.shape.k_max
        P = memory.block_size
        C = memory.max_row_tokens
        new = torch.tensor(num_tokens, dtype=torch.int64).view(-1, 1, 1)  # (m, 1, 1)
        after = counts + new if C is None else torch.clamp(counts + new, max=C)  # a budget caps rows
        blocks = ceil_div(counts, P).sum(2)  # (m, L)
        grown = ceil_div(after, P).sum(2)  # (m, L)
        limits = torch.tensor(
            [
                [worst_case_lifetime_blocks(n, 1, E, K, P, C), worst_case_lifetime_blocks(t, L, E, K, P, C)]
                for n, t in zip(num_tokens, totals)
            ],
            dtype=torch.int64,
        ).view(-1, 2)  # (m, 2): one layer's bound on the step, the whole lifetime's
        step = torch.minimum(grown - blocks, limits[:, :1]).sum(1, keepdim=True)  # (m, 1)
        held = blocks.sum(1, keepdim=True)  # (m, 1)
        return step_need(step, limits[:, 1:], held)
