"""The serving engine over per-device pools: LLMEngine with a paged cache whose rows take blocks
from their expert's device (cache/kv_cache_manager.py) and the DeviceScheduler.

    engine = DeviceLLMEngine(model, blocks_per_device=[40, 40, 40, 40], device_of_expert=placement,
                             scheduler_config=SchedulerConfig(victim="pressure_aware"))

The model, its cache calls, the runner and the swap copies are LLMEngine's; what changes is that
memory runs short per device. `eviction_stats()` adds the per-device counts to stats(), with the
peak of blocks in use on each device (after a forward, before finishing): a running maximum, so a
long-running engine keeps no per-step history. With record_history=True (LLMEngine's flag: the
per-step `timeline`, the `events`, finished requests) `device_timeline` also records, per step, the
(D,) blocks in use on each device, for figures and tests.
"""

from __future__ import annotations

import torch

from ..cache.block_pool import checked_blocks_per_device
from ..cache.paged import PagedKVCache
from ..model import MoEKVTransformer
from .device_scheduler import DeviceScheduler
from .engine import LLMEngine
from .memory import ModelShape
from .model_runner import ModelRunner
from .request import RequestOutput
from .scheduler import SchedulerConfig


class _RecordingRunner(ModelRunner):
    """ModelRunner that notes the blocks in use on each device right after the forward (the step's
    peak: finished requests free theirs after it)."""

    def __init__(self, model, cache, num_swap_blocks, memory):
        super().__init__(model, cache, num_swap_blocks)
        self._memory = memory
        self.used_after_forward = memory.num_used_blocks_per_device

    def forward(self, scheduled):
        result = super().forward(scheduled)
        self.used_after_forward = self._memory.num_used_blocks_per_device
        return result


class DeviceLLMEngine(LLMEngine):
    """blocks_per_device: D integers >= 1 (a list, tuple, 1-D integer tensor or array; never rounded:
    cache.block_pool.checked_blocks_per_device); device_of_expert: (E,) or (L, E) integer
    devices 0..D-1 (e.g. placement.place_experts / place_layers; cache.kv_cache_manager.
    checked_placement). record_history: also keep `device_timeline` (module docstring). Other
    arguments as LLMEngine's (num_blocks is the sum)."""

    def __init__(self, model: MoEKVTransformer, blocks_per_device, device_of_expert, block_size: int = 16,
                 scheduler_config: SchedulerConfig | None = None, num_swap_blocks: int | None = None,
                 shuffle_seed: int | None = None, attention: str | None = None, record_history: bool = False):
        self.blocks_per_device = checked_blocks_per_device(blocks_per_device)
        self.device_of_expert = device_of_expert         # checked by the cache; replaced by its (L, E) below
        self.device_timeline: list[torch.Tensor] = []    # (D,) blocks in use after each step, with record_history
        self._peak_used_per_device: torch.Tensor | None = None   # (D,) running maximum, once a step ran
        super().__init__(model, sum(self.blocks_per_device), block_size, scheduler_config, num_swap_blocks,
                         shuffle_seed, attention, record_history=record_history)
        self.device_of_expert = self.cache.manager.device_of_expert                      # (L, E) int64
        self.runner = _RecordingRunner(model, self.cache, self.runner.host_key_cache.shape[0], self.memory)

    def _make_cache(self, num_blocks, block_size, shuffle_seed, attention) -> PagedKVCache:
        return PagedKVCache.for_model(self.model, block_size, num_blocks, shuffle_seed=shuffle_seed,
                                      attention=attention, blocks_per_device=self.blocks_per_device,
                                      device_of_expert=self.device_of_expert)

    def _make_scheduler(self, scheduler_config, block_size, num_swap_blocks) -> DeviceScheduler:
        return DeviceScheduler(scheduler_config, self.cache.manager, ModelShape.from_config(self.config, block_size),
                               num_swap_blocks)

    def step(self) -> list[RequestOutput]:
        finished = super().step()
        used = self.runner.used_after_forward                                            # (D,)
        peak = self._peak_used_per_device
        self._peak_used_per_device = used.clone() if peak is None else torch.maximum(peak, used)
        if self.record_history:
            self.device_timeline.append(used)
        return finished

    @property
    def peak_used_blocks_per_device(self) -> list[int]:
        """Most blocks in use on each device after any step so far ([] before the first step)."""
        return [] if self._peak_used_per_device is None else self._peak_used_per_device.tolist()

    def eviction_stats(self) -> dict:
        """stats() plus the eviction counts of the per-device scheduler."""
        s = self.scheduler
        return {**self.stats().to_dict(), "num_evictions": s.num_evictions, "num_row_evictions": s.num_row_evictions,
                "num_evicted_rows": s.num_evicted_rows, "num_dead_rows_freed": s.num_dead_rows_freed,
                "freed_on_short_device": s.freed_on_short_device,
                "freed_on_short_device_per_eviction": s.freed_on_short_device / max(1, s.num_evictions),
                "peak_used_blocks_per_device": self.peak_used_blocks_per_device}
