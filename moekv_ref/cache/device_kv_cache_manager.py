"""The KV cache manager over per-device pools: one block table for every row, each row's blocks
taken from the pool of the device its expert lives on.

    device_of_expert  (L, E)  which device each expert of each layer lives on (placement.py)
    pool              DeviceBlockPool: device d's blocks are the ids [first_block[d], ... + N_d)

Everything else is KVCacheManager's: rows, block tables, slots, free, free_rows, swap. So the paged
cache (`PagedKVCache(..., blocks_per_device=..., device_of_expert=...)`), the attention paths and the
Triton kernels are unchanged: a slot is still block_id * P + offset into one pool tensor. What
changes is that memory is short *per device*: appending to a row of an expert on device d raises
OutOfBlocksError naming d when d is full, even while the other devices have room, and a scheduler
must check its reservation device by device (`num_free_blocks_per_device`, `blocks_needed_per_device`).

Compared with cache/device_pools.py (D whole managers kept in step, what expert-parallel ranks and
the simulator use), this keeps one manager and splits only the pool: the simplest form for one
process running the model, since the model's cache calls do not change.

Invariants, beyond KVCacheManager's (checked by `assert_consistent`):
  * every block in a row's table lies in the range of the device of the row's expert;
  * a call that raises changes no device.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .block_pool import OutOfBlocksError, a_type, checked_ids, preview
from .device_block_pool import DeviceBlockPool, checked_blocks_per_device
from .kv_cache_manager import KVCacheManager
from .rows import ceil_div


PLACEMENT_ALLOWED = "an integer tensor or numpy array, or (nested) lists of ints"


def checked_placement(device_of_expert, num_layers: int, num_experts: int, num_devices: int | None) -> torch.Tensor:
    """device_of_expert as (L, E) int64: given (E,) for every layer or (L, E), devices in [0, D)
    (num_devices=None: any device >= 0). ValueError, naming the first bad value, for anything else:
    a float device (even 1.0) or a bool is refused, not rounded, and a str is not read as digits."""
    devices = "0.." + str(num_devices - 1) if num_devices is not None else "integers >= 0"
    allowed = (f"devices {devices} as {PLACEMENT_ALLOWED}, of shape (E,) = ({num_experts},) or (L, E) = "
               f"({num_layers}, {num_experts})")
    if isinstance(device_of_expert, (list, tuple)):
        placement = _placement_from_lists(device_of_expert, allowed)
    elif isinstance(device_of_expert, (torch.Tensor, np.ndarray)):
        dtype = device_of_expert.dtype
        is_int = (not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)
                  if isinstance(device_of_expert, torch.Tensor) else dtype.kind in "iu")
        if not is_int:
            raise ValueError(f"{_first_value(device_of_expert)} has dtype {dtype}; allowed: {allowed}")
        placement = torch.as_tensor(device_of_expert).to(torch.int64)
    else:
        raise ValueError(f"device_of_expert={device_of_expert!r} is {a_type(device_of_expert)}; "
                         f"allowed: {allowed}")
    if placement.dim() == 1:
        placement = placement.expand(num_layers, -1)
    if placement.shape != (num_layers, num_experts):
        raise ValueError(f"device_of_expert must be (E,) = ({num_experts},) or (L, E) = ({num_layers}, "
                         f"{num_experts}); got {tuple(placement.shape)}")
    if placement.numel() and (int(placement.min()) < 0 or (num_devices is not None and
                                                            int(placement.max()) >= num_devices)):
        raise ValueError(f"device_of_expert names devices {sorted(set(placement.reshape(-1).tolist()))}; "
                         f"allowed: {devices}" + (" (one per entry of blocks_per_device)" if num_devices else ""))
    return placement.contiguous()


def _first_value(placement) -> str:
    """`device_of_expert[i]=v` for the first entry that is not a whole number (else the first entry)."""
    try:
        values = torch.as_tensor(placement)
    except TypeError:                                             # a numpy array of text or objects
        return "device_of_expert"
    if values.numel() == 0:
        return "device_of_expert=[]"
    flat = values.reshape(-1)
    broken = (flat != flat.round()).nonzero() if flat.is_floating_point() else flat[:0]
    i = int(broken[0]) if broken.numel() else 0
    index = ", ".join(str(int(k)) for k in np.unravel_index(i, tuple(values.shape)))
    return f"device_of_expert[{index}]={preview(flat[i:i + 1])[1:-1]}"


def _placement_from_lists(values, allowed: str) -> torch.Tensor:
    """(Nested) lists of ints as an int64 tensor; the first entry that is not an int is named."""
    def walk(value, index):
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, index + [i])
        elif not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
            where = "".join(f"[{i}]" for i in index)
            raise ValueError(f"device_of_expert{where}={value!r} is {a_type(value)}; allowed: {allowed}")
    walk(values, [])
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (TypeError, ValueError) as error:                   # ragged lists
        raise ValueError(f"device_of_expert is not a rectangular table ({error}); allowed: {allowed}") from None


class DeviceKVCacheManager(KVCacheManager):
    """KVCacheManager whose rows draw on the pool of their expert's device.

    blocks_per_device: D ints; device_of_expert: (E,) or (L, E) with devices 0..D-1."""

    def __init__(self, num_layers: int, num_experts: int, block_size: int, blocks_per_device,
                 device_of_expert, shuffle_seed: int | None = None, initial_num_seqs: int = 4,
                 initial_blocks_per_row: int = 4):
        blocks_per_device = checked_blocks_per_device(blocks_per_device)
        super().__init__(num_layers, num_experts, block_size, sum(blocks_per_device), None,
                         initial_num_seqs, initial_blocks_per_row)
        self.pool = DeviceBlockPool(blocks_per_device, shuffle_seed)
        self.device_of_expert = checked_placement(device_of_expert, num_layers, num_experts,
                                                  len(blocks_per_device))                  # (L, E)
        self._device_of_local_row = self.device_of_expert.reshape(-1)                        # (L*E,)

    # ----- devices ------------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.pool.num_devices

    @property
    def blocks_per_device(self) -> torch.Tensor:
        return self.pool.blocks_per_device

    @property
    def num_free_blocks_per_device(self) -> torch.Tensor:
        """(D,) free blocks of each device."""
        return self.pool.free_per_device

    def device_of_rows(self, rows) -> torch.Tensor:
        """(m,) the device of each row id."""
        return self._device_of_local_row[checked_ids(rows, "rows") % self.rows_per_seq]

    def per_device(self, token_counts: torch.Tensor) -> torch.Tensor:
        """Blocks of rows of these token counts on each device: (..., L, E) -> (..., D)."""
        one_hot = torch.nn.functional.one_hot(self.device_of_expert, self.num_devices)      # (L, E, D)
        blocks = ceil_div(token_counts, self.block_size)                                     # (..., L, E)
        return torch.einsum("...le,led->...d", blocks, one_hot)

    def blocks_held_per_device(self, seq_ids) -> torch.Tensor:
        """(m, D) blocks each sequence holds on each device (zeros for one not held)."""
        return self.per_device(self.token_counts(seq_ids))

    def blocks_needed_per_device(self, rows, num_new_tokens) -> torch.Tensor:
        """(D,) blocks that appending num_new_tokens[i] tokens to rows[i] would take on each device."""
        rows = checked_ids(rows, "rows")
        num_new_tokens = checked_ids(num_new_tokens, "num_new_tokens")
        old = self.num_computed_tokens[rows]
        new_blocks = ceil_div(old + num_new_tokens, self.block_size) - ceil_div(old, self.block_size)
        return torch.zeros(self.num_devices, dtype=torch.int64).index_add_(0, self.device_of_rows(rows), new_blocks)

    def can_allocate(self, rows, num_new_tokens) -> bool:
        return bool((self.blocks_needed_per_device(rows, num_new_tokens) <= self.num_free_blocks_per_device).all())

    # ----- the hook of allocate_slots -------------------------------------------------------------------
    def _take_blocks(self, rows, needed, num_new_tokens) -> torch.Tensor:
        device = self.device_of_rows(rows)                                                  # (m,)
        per_device = torch.zeros(self.num_devices, dtype=torch.int64).index_add_(0, device, needed)
        free = self.num_free_blocks_per_device
        short = (per_device > free).nonzero().squeeze(1)
        if short.numel():
            d = int(short[0])
            raise OutOfBlocksError(f"device {d} is short: appending {int(num_new_tokens.sum())} tokens "
                                   f"needs {int(per_device[d])} blocks there, {int(free[d])} of "
                                   f"{int(self.blocks_per_device[d])} are free")
        block_device = torch.repeat_interleave(device, needed)                              # (total,)
        block_ids = torch.empty(block_device.numel(), dtype=torch.int64)
        for d in per_device.nonzero().squeeze(1).tolist():
            block_ids[block_device == d] = self.pool.allocate_on(d, int(per_device[d]))
        return block_ids

    # ----- checking ---------------------------------------------------------------------------------
    def assert_consistent(self) -> None:
        super().assert_consistent()
        num_used = self._table_blocks(self.num_computed_tokens)                           # (R,)
        used = torch.arange(self.block_tables.shape[1]) < num_used[:, None]             # (R, W)
        row, _ = used.nonzero(as_tuple=True)
        blocks = self.block_tables[used].to(torch.int64)
        assert torch.equal(self.pool.device_of_blocks(blocks), self.device_of_rows(row)), \
            "a row holds a block of another device than its expert's"
