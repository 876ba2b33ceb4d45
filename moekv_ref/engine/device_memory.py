"""The scheduler's read-only view of per-device pools: MemoryView's questions, device by device.

    num_free_blocks_per_device   (D,) free blocks of each device
    blocks_held_per_device(s)    (D,) blocks sequence s holds on each device
    swapped_blocks_per_device(s) (D,) blocks a swapped sequence takes on each device to come back
    row_last_used(s)             (L, E) the step that last appended to each row of s (-1: never),
                                 what an expert-level LRU reads
    device_of_expert             (L, E)

The totals MemoryView answers (num_blocks, num_free_blocks, ...) stay sums over devices, so the
admission policies that reason about the whole pool keep working; the step's reservation is checked
per device by the scheduler (device_scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..cache.kv_cache_manager import KVCacheManager
from .memory import MemoryView, ModelShape
from .swap import SwapSpace

if TYPE_CHECKING:
    from .device_scheduler import DeviceScheduler


class DeviceMemoryView(MemoryView):
    def __init__(self, manager: KVCacheManager, shape: ModelShape, swap_space: SwapSpace | None,
                 scheduler: "DeviceScheduler"):
        super().__init__(manager, shape, swap_space)
        self._scheduler = scheduler

    @property
    def num_devices(self) -> int:
        return self._manager.num_devices

    @property
    def blocks_per_device(self) -> torch.Tensor:
        return self._manager.blocks_per_device

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        return self._manager.num_free_blocks_per_device

    @property
    def num_used_blocks_per_device(self) -> torch.Tensor:
        return self.blocks_per_device - self.num_free_blocks_per_device

    @property
    def device_of_expert(self) -> torch.Tensor:
        return self._manager.device_of_expert

    def blocks_held_per_device(self, seq_id: int) -> torch.Tensor:
        return self._manager.blocks_held_per_device([seq_id])[0]

    def swapped_blocks_per_device(self, seq_id: int) -> torch.Tensor:
        if not self.is_swapped(seq_id):
            return torch.zeros(self.num_devices, dtype=torch.int64)
        return self._manager.per_device(self.swapped_token_counts(seq_id))

    def row_last_used(self, seq_id: int) -> torch.Tensor:
        return self._scheduler.row_last_used(seq_id)

    def assert_no_leak(self) -> None:
        super().assert_no_leak()
        free = self.num_free_blocks_per_device
        assert torch.equal(free, self.blocks_per_device), f"blocks still in use per device: " \
            f"{(self.blocks_per_device - free).tolist()}"
