"""Per-device block pools: the attention experts of each layer live on D devices, and each device
has its own pool of blocks for the rows of its experts.

With experts spread over devices (placement.py), a row (sequence, layer, expert) can only take blocks
from the device its expert lives on. Memory is then short *per device*: one device may be full while
the others are empty, and freeing a sequence helps only by the blocks it held on the short device.

    device_of_expert  (L, E)  which device each expert of each layer lives on
    managers[d]               a KVCacheManager for device d: its pool, and block tables for the
                              rows of d's experts (rows of other devices' experts stay empty)

Why one plain KVCacheManager per device: it is what an expert-parallel rank holds for its own
experts, unchanged, and it already answers every question a scheduler or the simulator asks. This
class only keeps the D managers in step:

  * a sequence is held by all D managers or by none, under the same slot (seq_index), so a row id
    (rows.py: seq_index * (L * E) + layer * E + expert) means the same row on every device and
    the device of a row is device_of_expert[layer, expert];
  * manager d holds tokens only in rows of experts placed on d;
  * a call that raises changes nothing on any device (every device is checked before any allocates).

Dimension legend: D devices, L layers, E experts per layer, m rows of a call, n new tokens of a call.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .block_pool import OutOfBlocksError, checked_blocks_per_device, checked_ids
from .kv_cache_manager import KVCacheManager, checked_placement
from .rows import RowIndex, ceil_div


@dataclass
class DeviceSlotAllocation:
    """Where the new tokens of `DevicePools.allocate_slots` go.

    device        (n,) int64  the device of each new token (its row's expert's device)
    slot_mapping  (n,) int64  its slot in that device's pool, row after row in the order of the
                              rows given, each row's tokens in token order (as SlotAllocation)
    """
    device: torch.Tensor
    slot_mapping: torch.Tensor


class DevicePools:
    """D KVCacheManagers, one per device, each for the rows of the experts placed on it.

    blocks_per_device: one integer for every device, or D integers >= 1 (a list, tuple, 1-D integer
    tensor or array: checked_blocks_per_device, never rounded). device_of_expert: (L, E) (e.g.
    placement.place_layers) or (E,) for the same placement in every layer; devices are numbered
    0..D-1 with D = len(blocks_per_device) (or max device + 1 for one int)."""

    def __init__(self, num_layers: int, num_experts: int, block_size: int, blocks_per_device,
                 device_of_expert, shuffle_seed: int | None = None, initial_num_seqs: int = 4):
        if isinstance(blocks_per_device, numbers.Integral) and not isinstance(blocks_per_device, (bool, np.bool_)):
            placement = checked_placement(device_of_expert, num_layers, num_experts, None)
            blocks_per_device = [blocks_per_device] * (int(placement.max()) + 1)
        blocks_per_device = checked_blocks_per_device(blocks_per_device)
        placement = checked_placement(device_of_expert, num_layers, num_experts, len(blocks_per_device))
        self.device_of_expert = placement                                              # (L, E)
        self.index = RowIndex(num_layers, num_experts)
        self.block_size = block_size
        self.managers = [KVCacheManager(num_layers, num_experts, block_size, n, shuffle_seed,
                                        initial_num_seqs=initial_num_seqs) for n in blocks_per_device]

    # ----- shape and pools --------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.managers)

    @property
    def num_layers(self) -> int:
        return self.index.num_layers

    @property
    def num_experts(self) -> int:
        return self.index.num_experts

    @property
    def num_blocks(self) -> torch.Tensor:
        """(D,) blocks of each device's pool."""
        return torch.tensor([m.num_blocks for m in self.managers], dtype=torch.int64)

    @property
    def num_free_blocks(self) -> torch.Tensor:
        """(D,) free blocks of each device's pool."""
        return torch.tensor([m.num_free_blocks for m in self.managers], dtype=torch.int64)

    @property
    def num_used_blocks(self) -> torch.Tensor:
        return self.num_blocks - self.num_free_blocks

    def device_of_rows(self, rows) -> torch.Tensor:
        """(m,) the device of each row id."""
        rows = checked_ids(rows, "rows")
        return self.device_of_expert.reshape(-1)[rows % self.index.rows_per_seq]

    # ----- sequences --------------------------------------------------------------------------------
    @property
    def sequences(self) -> list[int]:
        return self.managers[0].sequences

    def holds(self, seq_id: int) -> bool:
        return int(seq_id) in self.managers[0]._seq_index

    def add_sequence(self, seq_id: int) -> int:
        """Give a new sequence the same slot on every device; returns its seq_index."""
        if self.holds(seq_id):
            raise ValueError(f"sequence {seq_id} is already in the pools")
        indices = {m.add_sequence(seq_id) for m in self.managers}
        assert len(indices) == 1, "device managers gave one sequence different slots"
        return indices.pop()

    def seq_index(self, seq_id: int) -> int:
        return self.managers[0].seq_index(seq_id)

    def rows(self, seq_ids, layer: int, experts) -> torch.Tensor:
        """Row ids of (seq_ids[i], layer, experts[i]), the same on every device: (m,) int64."""
        return self.managers[0].rows(seq_ids, layer, experts)

    def sequence_rows(self, seq_id: int) -> torch.Tensor:
        """All L * E rows of one held sequence: (L * E,) int64."""
        return self.index.sequence_rows(torch.tensor([self.seq_index(seq_id)]))[0]

    def token_counts(self, seq_ids) -> torch.Tensor:
        """(m, L, E) tokens per row, whichever device holds it."""
        return sum(m.token_counts(seq_ids) for m in self.managers)

    def blocks_held(self, seq_ids) -> torch.Tensor:
        """(m, D) blocks each sequence holds on each device (zeros for a sequence not held)."""
        counts = self.token_counts(seq_ids).reshape(len(list(seq_ids)), -1)           # (m, L*E)
        blocks = ceil_div(counts, self.block_size)                                    # (m, L*E)
        one_hot = torch.nn.functional.one_hot(self.device_of_expert.reshape(-1), self.num_devices)
        return blocks @ one_hot                                                       # (m, D)

    def blocks_by_slot(self) -> torch.Tensor:
        """(num_slots, D) blocks every sequence slot holds on each device, at once (the simulator asks
        this every step; slots of no sequence hold zeros). Row `seq_index(s)` is sequence s."""
        tokens = sum(m.num_computed_tokens for m in self.managers)                    # (R,) disjoint
        blocks = ceil_div(tokens, self.block_size).view(-1, self.index.rows_per_seq)  # (slots, L*E)
        one_hot = torch.nn.functional.one_hot(self.device_of_expert.reshape(-1), self.num_devices)
        return blocks @ one_hot                                                       # (slots, D)

    def free(self, seq_id: int) -> torch.Tensor:
        """Free the sequence on every device; returns (D,) blocks freed. KeyError, changing nothing,
        for a sequence not held."""
        held = self.blocks_held([seq_id])[0]
        self.seq_index(seq_id)                                                        # KeyError first
        for m in self.managers:
            m.free(seq_id)
        return held

    # ----- rows -------------------------------------------------------------------------------------
    def blocks_needed(self, rows, num_new_tokens) -> torch.Tensor:
        """(D,) blocks that appending num_new_tokens[i] tokens to rows[i] would take from each device."""
        rows = checked_ids(rows, "rows")
        num_new_tokens = checked_ids(num_new_tokens, "num_new_tokens")
        device = self.device_of_rows(rows)
        old = self.managers[0].num_computed_tokens.new_zeros(rows.shape)
        for d, m in enumerate(self.managers):
            mine = device == d
            old[mine] = m.num_computed_tokens[rows[mine]]
        new_blocks = ceil_div(old + num_new_tokens, self.block_size) - ceil_div(old, self.block_size)
        return torch.bincount(device, weights=new_blocks.to(torch.float64),
                              minlength=self.num_devices).to(torch.int64)

    def can_allocate(self, rows, num_new_tokens) -> bool:
        return bool((self.blocks_needed(rows, num_new_tokens) <= self.num_free_blocks).all())

    def allocate_slots(self, rows, num_new_tokens, rows_are_distinct: bool = False) -> DeviceSlotAllocation:
        """Make room for num_new_tokens[i] more tokens in rows[i], each on its expert's device.
        Raises OutOfBlocksError naming the short device, changing nothing on any device, when one
        device is short."""
        rows, num_new_tokens = KVCacheManager._check_allocation(rows, num_new_tokens, rows_are_distinct)
        need, free = self.blocks_needed(rows, num_new_tokens), self.num_free_blocks
        short = (need > free).nonzero().squeeze(1)
        if short.numel():
            d = int(short[0])
            raise OutOfBlocksError(f"device {d} is short: the rows need {int(need[d])} blocks there, "
                                   f"{int(free[d])} of {self.managers[d].num_blocks} are free")
        device = self.device_of_rows(rows)                                           # (m,)
        token_device = torch.repeat_interleave(device, num_new_tokens)               # (n,)
        slots = torch.empty(int(num_new_tokens.sum()), dtype=torch.int64)
        for d, m in enumerate(self.managers):
            mine = device == d
            if mine.any():
                allocation = m.allocate_slots(rows[mine], num_new_tokens[mine], rows_are_distinct=True)
                slots[token_device == d] = allocation.slot_mapping
        return DeviceSlotAllocation(token_device, slots)

    def free_rows(self, rows) -> torch.Tensor:
        """Empty some rows of held sequences (each on its device); returns (D,) blocks freed."""
        rows = checked_ids(rows, "rows").reshape(-1)
        if rows.unique().numel() != rows.numel():
            raise ValueError("rows must be distinct within one free_rows call")
        held = set(self.managers[0]._seq_index.values())
        if rows.numel() and not set((rows // self.index.rows_per_seq).tolist()) <= held:
            raise ValueError(f"rows {rows.tolist()[:8]} are not all rows of sequences the pools hold")
        device = self.device_of_rows(rows)
        return torch.tensor([m.free_rows(rows[device == d]) for d, m in enumerate(self.managers)],
                            dtype=torch.int64)

    # ----- checking ---------------------------------------------------------------------------------
    def assert_consistent(self) -> None:
        """Each device's invariants, plus the module docstring's: same sequences under the same
        slots everywhere; tokens only in rows of the device's own experts."""
        first = self.managers[0]._seq_index
        for d, m in enumerate(self.managers):
            m.assert_consistent()
            assert m._seq_index == first, f"device {d} holds other sequences or slots than device 0"
            num_seqs = m.num_computed_tokens.numel() // self.index.rows_per_seq
            elsewhere = (self.device_of_expert.reshape(-1) != d).repeat(num_seqs)     # (R,)
            assert (m.num_computed_tokens[elsewhere] == 0).all(), \
                f"device {d} holds tokens of an expert placed on another device"

    def assert_no_leak(self) -> None:
        self.assert_consistent()
        assert not self.sequences, f"sequences still held: {self.sequences}"
        leaked = self.num_used_blocks
        assert (leaked == 0).all(), f"blocks still in use per device: {leaked.tolist()}"
