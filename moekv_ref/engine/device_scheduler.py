"""The scheduler over per-device pools: a step fits only if it fits every device.

The attention experts of each layer live on D devices (placement.py) and each device has its own
pool (the devices of cache/block_pool.py). Scheduler's loop is kept, with its reservation made per
device: each running request's next tokens reserve, on every device, the worst case they could open
there (demand.py), and when some device is short the victim policy is told *which*
(victims.Shortage). So a request can be refused or preempted because one device is full while the
others are empty.

Victims may be whole requests (preempted by recompute or swap, as before) or rows (victims.RowEviction,
what expert_lru returns): the rows are freed on the short device and the request *stalls*: it goes
back to the head of the waiting line, all of its context to be recomputed (counted in
num_recomputed_tokens), while its other rows stay in the pools, dead weight, as a cache of
independent expert buffers would leave them. Dead rows are freed before anything else when their
device is short (`_free_dead_rows`: they will be recomputed anyway), when nothing runs and the head
of the line does not fit, and when the stalled request resumes (it starts from an empty cache).

Only continuous batching on the paged pool (continuous_paged) runs here: the reserving baselines
never preempt, so which device is short does not matter to them.

Statistics (Scheduler's counters, which the one-pool loop fills only in part): num_evictions (victims
chosen), num_row_evictions, num_evicted_rows, freed_on_short_device (blocks freed on the short device
by all evictions), num_dead_rows_freed. The engine is LLMEngine, given blocks_per_device.
"""

from __future__ import annotations

import torch

from ..cache.kv_cache_manager import KVCacheManager
from .batching import AdmissionStep, ContinuousBatching
from .demand import worst_case_lifetime_blocks_per_device, worst_case_step_blocks_per_device
from .memory import MemoryView, ModelShape
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .victims import RowEviction, Shortage


class DeviceAdmissionStep(AdmissionStep):
    """AdmissionStep whose reservation is a (D,) vector: the head joins only if its next step (and
    its swap-in) fits every device next to what the step reserved there."""

    def __init__(self, scheduler: "DeviceScheduler", out: SchedulerOutput, token_budget: int,
                 reserved_per_device: torch.Tensor):
        super().__init__(scheduler, out, token_budget, int(reserved_per_device.sum()))
        self.reserved_per_device = reserved_per_device.clone()

    def step_fits(self, request: Request) -> bool:
        scheduler = self._scheduler
        num_tokens = min(request.num_pending_tokens, self.token_budget)
        need = scheduler.step_blocks_per_device(request, num_tokens) \
            + self.memory.swapped_blocks_per_device(request.request_id)
        free = self.memory.num_free_blocks_per_device
        if request.request_id in scheduler.stalled:           # its dead rows go when it starts
            free = free + self.memory.blocks_held_per_device(request.request_id)
        return bool((self.reserved_per_device + need <= free).all())

    def start_next(self) -> Request:
        scheduler = self._scheduler
        request = scheduler.start_head(self._out)
        num_tokens = min(request.num_pending_tokens, self.token_budget)
        if num_tokens > 0:
            need = scheduler.step_blocks_per_device(request, num_tokens)
            scheduler.schedule_tokens(self._out, request, num_tokens, int(need.sum()))
            self.reserved_per_device += need
            self.reserved += int(need.sum())
            self.token_budget -= num_tokens
        return request


class DeviceScheduler(Scheduler):
    """Scheduler over a KVCacheManager with per-device pools (module docstring)."""

    def __init__(self, config: SchedulerConfig, manager: KVCacheManager, shape: ModelShape,
                 num_swap_blocks: int = 0):
        if not isinstance(manager, KVCacheManager):
            raise ValueError(f"DeviceScheduler needs a KVCacheManager, got {type(manager).__name__}")
        super().__init__(config, manager, shape, num_swap_blocks)
        if not isinstance(self.batching, ContinuousBatching):
            raise ValueError(f"per-device pools run policy='continuous_paged' only, not {config.policy!r}")
        self.memory = MemoryView(manager, shape, self.swap_space, evicts_rows=True)
        self.num_devices = manager.num_devices
        self.stalled: dict[int, Request] = {}              # request id -> request, in the order stalled

    # ----- what a request needs per device ----------------------------------------------------------
    def _held_counts(self, request: Request) -> torch.Tensor:
        """(L, E) the rows a request's next step grows from: none for a stalled one (it restarts)."""
        if request.request_id in self.stalled:
            return torch.zeros(self.shape.num_layers, self.shape.num_experts, dtype=torch.int64)
        return self.memory.token_counts([request.request_id])[0]

    def step_blocks_per_device(self, request: Request, num_tokens: int) -> torch.Tensor:
        """(D,) worst case of blocks the request's next `num_tokens` tokens can take on each device,
        never more than its lifetime worst case there minus what it holds there."""
        shape, manager = self.shape, self.manager
        counts = self._held_counts(request)                                          # (L, E)
        held = manager.per_device(counts)                                            # (D,)
        step = worst_case_step_blocks_per_device(counts[None], torch.tensor([num_tokens]), shape.k_max,
                                                 shape.block_size, manager.device_of_expert, self.num_devices)[0]
        computed = 0 if request.request_id in self.stalled else request.num_computed_tokens
        lifetime = worst_case_lifetime_blocks_per_device(computed + num_tokens, shape.k_max, shape.block_size,
                                                         manager.device_of_expert, self.num_devices)
        return torch.clamp(torch.minimum(step, lifetime - held), min=0)

    def step_blocks(self, request: Request, num_tokens: int) -> int:
        return int(self.step_blocks_per_device(request, num_tokens).sum())

    def step_blocks_many(self, requests: list[Request], num_tokens: list[int]) -> list:
        return [self.step_blocks(r, n) for r, n in zip(requests, num_tokens)]   # needs per device

    def check_fits_alone(self, prompt_len: int, max_new_tokens: int) -> None:
        """Scheduler's check over the whole pool, then device by device: a request whose rows on some
        device might outgrow that device's pool is refused, naming the device."""
        super().check_fits_alone(prompt_len, max_new_tokens)
        shape, manager = self.shape, self.manager
        worst = worst_case_lifetime_blocks_per_device(prompt_len + max_new_tokens - 1, shape.k_max,
                                                      shape.block_size, manager.device_of_expert, self.num_devices)
        over = (worst > manager.blocks_per_device).nonzero().squeeze(1)
        if over.numel():
            d = int(over[0])
            raise ValueError(f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} may not "
                             f"fit device {d} even alone: its rows there may need up to {int(worst[d])} blocks, "
                             f"the device has {int(manager.blocks_per_device[d])}; lower max_new_tokens or give "
                             f"device {d} at least {int(worst[d])} blocks")

    # ----- one step -----------------------------------------------------------------------------------
    def schedule(self, step: int) -> SchedulerOutput:
        out = SchedulerOutput(step)
        self.manager.clock = step                  # the rows this step appends to remember it
        token_budget = self.config.max_num_batched_tokens
        reserved = torch.zeros(self.num_devices, dtype=torch.int64)                  # (D,)
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_pending_tokens, token_budget)
            need = self.step_blocks_per_device(request, num_tokens)                  # (D,)
            while True:
                free = self.memory.num_free_blocks_per_device
                missing = reserved + need - free                                     # (D,)
                if (missing <= 0).all():
                    break
                device = int(missing.argmax())
                if self._free_dead_rows(device):
                    continue
                candidates = tuple(self.running[i:])                                 # not yet scheduled
                shortage = Shortage(device, int(missing[device]), int(need[device]))
                choice = self.victims.choose_victim(candidates, self.memory, shortage)
                victim = choice.request if isinstance(choice, RowEviction) else choice
                if not any(victim is c for c in candidates):
                    raise RuntimeError(f"victim policy {self.victims!r} chose request "
                                       f"{getattr(victim, 'request_id', victim)!r}, not one of the candidates")
                if isinstance(choice, RowEviction):
                    self._evict_rows(choice, out)
                else:
                    self._preempt(victim, out)
                self.num_evictions += 1
                self.freed_on_short_device += int(self.memory.num_free_blocks_per_device[device] - free[device])
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue                               # it was the victim: running[i] is the next one
            self.schedule_tokens(out, request, num_tokens, int(need.sum()))
            reserved += need
            token_budget -= num_tokens
            i += 1
        if not out.preempted:          # do not admit in a step that had to preempt: it would thrash
            if not self.running:
                self._free_dead_rows(None)
            self.batching.admit(DeviceAdmissionStep(self, out, token_budget, reserved))
        return out

    def _free_dead_rows(self, device: int | None) -> bool:
        """Free the rows stalled requests still hold on `device` (every device: None), oldest stall
        first. Returns whether any block was freed."""
        manager, freed = self.manager, False
        for request_id in self.stalled:
            counts = self.memory.token_counts([request_id])[0]                       # (L, E)
            dead = counts > 0
            if device is not None:
                dead &= manager.device_of_expert == device
            if dead.any():
                rows = torch.cat([manager.rows([request_id], layer, expert) for layer, expert in dead.nonzero().tolist()])
                manager.free_rows(rows)
                self.num_dead_rows_freed += rows.numel()
                freed = True
        return freed

    def _evict_rows(self, eviction: RowEviction, out: SchedulerOutput) -> None:
        """Drop the chosen rows; the request stalls (module docstring) and waits at the head of the line."""
        request, manager = eviction.request, self.manager
        rows = torch.cat([manager.rows([request.request_id], layer, expert) for layer, expert in eviction.layer_experts])
        manager.free_rows(rows)
        self.num_row_evictions += 1
        self.num_evicted_rows += rows.numel()
        self.running.remove(request)
        self.stalled[request.request_id] = request
        self._forget_computed(request)
        self._requeue_preempted(request, out)

    def start_head(self, out: SchedulerOutput) -> Request:
        """A stalled head first gives up its dead rows: it restarts from an empty cache."""
        head = self.waiting[0]
        if self.stalled.pop(head.request_id, None) is not None:
            self.manager.free(head.request_id)
        return super().start_head(out)

    def finish(self, request: Request, step: int, reason: str = "length", error: str | None = None) -> None:
        """Scheduler's finish (its blocks, dead rows included, go back), and the request leaves every
        table of this scheduler: a stalled request that is aborted while it waits is no longer stalled."""
        super().finish(request, step, reason, error)
        self.stalled.pop(request.request_id, None)
