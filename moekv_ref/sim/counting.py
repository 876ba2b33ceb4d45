"""The trace runner's counting manager: a KVCacheManager (cache/kv_cache_manager.py) over a BlockPool
(cache/block_pool.py) that counts each row's blocks and lists none.

The simulator writes no K/V, and where no prefix cache or swap space is on, no scheduling decision
reads a block id: the scheduler asks for counts (free blocks per device, each slot's open_rows and
count_blocks below, each row's tokens). The plain manager still writes every new block's id into its
block tables (rows of up to 512 entries at 64 experts, scattered over hundreds of megabytes) and
every block's reference count, only to read them back when a sequence finishes. These two classes
keep the counts alone:

    CountingBlockPool        BlockPool with no free stacks, reference counts or cached flags: each
                             device's number of free blocks, lent by number (allocate_per_device)
                             and given back by number (free_per_device)
    CountingKVCacheManager   KVCacheManager over a CountingBlockPool, its block tables without
                             columns: a row's blocks are ceil(n / P), as the plain manager counts
                             them; a finished sequence gives back count_blocks, one count per
                             device, instead of a list of about 9,000 ids

Every count, and so every decision, is the plain manager's. The trace runner builds it unless a
prefix cache, a swap space or RunnerSetup.list_block_ids asks for ids: a step then takes 55-60% of
the time at 64 experts, 1.7-1.8x at the fine shape (24 layers, 64 experts top-8 on 64 devices) in
two side-by-side runs of 1,000 requests. What needs an id (slots, a sequence's block list, the block
owners, placing or restoring blocks, a swap space) is refused by name, changing nothing.
tests/spec/test_sim_fast_paths.py runs the runner with both managers on random traces and compares
every step, and miscounts a block on purpose to show the comparison sees it.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from ..cache.block_pool import BlockPool
from ..cache.invariants import check_no_inference_tensors, check_row_counts
from ..cache.kv_cache_manager import KVCacheManager, SlotAllocation
from ..cache.options import check_counts_per_device
from ..cache.rows import ceil_div

NO_IDS = torch.zeros(0, dtype=torch.int64)  # what a counting manager's _take_blocks hands back
LISTS_IDS = "a KVCacheManager (cache/kv_cache_manager.py), which lists them"


class CountingBlockPool(BlockPool):
    """BlockPool keeping only each device's number of free blocks (module docstring): it lends
    blocks by number and names none; every call that names a block by id is refused."""

    def _make_block_state(self, shuffle_seed: int | None) -> None:
        """No state per block: empty tensors, so that the attributes BlockPool's STATE names (saved
        and restored with a step) exist as in any pool."""
        self._free_stack = torch.empty(0, dtype=torch.int64)
        self.ref_cnt = torch.zeros(0, dtype=torch.int32)

    def allocate_per_device(self, num_blocks: torch.Tensor) -> None:
        """num_blocks (D,) blocks of each device counted as lent; OutOfBlocksError, changing
        nothing, when one is short."""
        num_blocks = check_counts_per_device(num_blocks, self.num_devices)
        self.check_free(num_blocks)
        self._num_free -= num_blocks

    def free_per_device(self, num_blocks: torch.Tensor) -> None:
        """num_blocks (D,) blocks back on each device. ValueError, pool unchanged, when more come
        back to a device than it has lent."""
        num_blocks = check_counts_per_device(num_blocks, self.num_devices)
        lent = self.blocks_per_device - self._num_free  # (D,)
        if not bool((num_blocks <= lent).all()):
            d = int((num_blocks > lent).nonzero()[0])
            raise ValueError(
                f"free_per_device: device {d} gets {int(num_blocks[d])} blocks back but has lent "
                f"{int(lent[d])}: a double free (pool unchanged)"
            )
        self._num_free += num_blocks

    def _refuse_ids(self, call: str) -> NoReturn:
        raise ValueError(
            f"{call}: this pool ({type(self).__name__}) counts its blocks without ids; allowed: "
            "allocate_per_device and free_per_device, or a BlockPool, which lists them"
        )

    def allocate(self, num_blocks: int, device: int | None = None):
        self._refuse_ids("allocate")

    def free_block_ids(self):
        self._refuse_ids("free_block_ids")

    def _checked_ids(self, block_ids):
        """Every call given block ids (free, incref, reuse, mark_cached, uncache,
        device_of_blocks) is refused here, before it changes anything."""
        self._refuse_ids("a call with block ids")

    def assert_consistent(self) -> None:
        """No inference tensor, and each device's free count within [0, its blocks]."""
        check_no_inference_tensors(self)
        assert bool(((self._num_free >= 0) & (self._num_free <= self.blocks_per_device)).all()), (
            f"free blocks per device {self._num_free.tolist()} outside [0, {self._device_sizes}]"
        )


class CountingKVCacheManager(KVCacheManager):
    """KVCacheManager counting each row's blocks without listing them (module docstring), with three
    tables over sequence slots that follow row_tokens, so that a scheduler reads a decode step's
    worst case without touching every row of every running sequence (sim/fast_scheduler.py):

        open_rows       (S, L, D)  int32  rows of each (layer, device) whose last block is full or
                                          which are empty: the next token there opens a block
        open_per_device (S, D)     int64  open_rows summed over the layers
        count_blocks    (S, D)     int64  ceil(n / P) summed over the rows on each device

    Takes the plain manager's arguments."""

    STATE = (*KVCacheManager.STATE, "open_rows", "open_per_device", "count_blocks")
    can_swap = False  # a swap copies a sequence's blocks by id

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        num_seqs = self.slot_held.numel()
        D = self.num_devices
        self.open_rows = torch.zeros(num_seqs, self.num_layers, D, dtype=torch.int32)  # (S, L, D)
        self.open_per_device = torch.zeros(num_seqs, D, dtype=torch.int64)  # (S, D)
        self.count_blocks = torch.zeros(num_seqs, D, dtype=torch.int64)  # (S, D)

    # ----- the seams of KVCacheManager ------------------------------------------------------------
    def _bytes_beside_tables(self, num_layers: int, num_rows: int, options) -> int:
        num_seqs = options.initial_num_seqs
        return num_seqs * len(options.blocks_per_device) * (4 * num_layers + 16)  # the slot tables

    def _make_pool(self, options) -> BlockPool:
        return CountingBlockPool(options=options)

    def _initial_table_width(self, initial_blocks_per_row: int) -> int:
        return 0  # no entries, ever

    def add_sequence(self, seq_id: int) -> int:
        """KVCacheManager.add_sequence; every row of the slot is empty: all open."""
        index = super().add_sequence(seq_id)
        devices = self.placement.of_sequences([int(seq_id)])[0]  # (L, E)
        self.open_rows[index] = torch.zeros(
            self.num_layers, self.num_devices, dtype=torch.int32
        ).scatter_add_(1, devices, torch.ones_like(devices, dtype=torch.int32))
        self.open_per_device[index] = self.open_rows[index].sum(0)
        return index

    def set_row_tokens(self, rows, counts) -> None:
        """KVCacheManager.set_row_tokens, the slot tables following over the rows that reach a
        multiple of P (`_crossing`); a freed sequence's slot zeroed at once."""
        if isinstance(rows, slice):
            super().set_row_tokens(rows, counts)
            index = rows.start // self.rows_per_seq
            self.open_rows[index] = 0
            self.open_per_device[index] = 0
            self.count_blocks[index] = 0
            return
        old = self.row_tokens[rows]  # (m,)
        crossing = self._crossing(old, counts)  # (c,)
        self.row_tokens.index_copy_(0, rows, counts)
        moved = rows[crossing]
        self._count(moved, old[crossing], counts[crossing], self.row_device[moved])

    def grow_trace_rows(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> None:
        """grow_rows for the trace runner's appends, without grow_rows' checks of the rows: the runner
        builds them from its trace, one per (held sequence, layer, expert) and so distinct (checking
        that took a third of a step at 64 experts: a mark over every row of the manager). The
        runner's comparisons with the plain manager (tests/spec/test_sim_fast_paths.py) hold it."""
        self._grow(rows, num_new_tokens)

    def grow_decode_rows(self, rows: torch.Tensor) -> None:
        """grow_trace_rows with one token for each row (a step where every request decodes): a row
        then crosses a block boundary where its new count is 0 or 1 modulo P, one test per row."""
        P = self.block_size
        new = self.row_tokens.index_select(0, rows).add_(1)  # (m,)
        crossing = (new & (P - 1)).le_(1).nonzero().squeeze(1)  # (c,)
        self._grow_crossing(rows, new, crossing, new[crossing] - 1)
        self.last_appended.index_fill_(0, rows, self.clock)

    def _grow(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> list:
        """KVCacheManager._grow worked out over the few rows whose range reaches a multiple of P
        (about 2 rows in P at a decode step), the only ones that can take a block or change a slot
        table; the rest only change row_tokens."""
        shift = self.block_size.bit_length() - 1  # P is a power of two
        old = self.row_tokens.index_select(0, rows)  # (m,)
        new = old + num_new_tokens
        crossing = ((old - 1) >> shift).ne_(new >> shift).nonzero().squeeze(1)  # (c,) _crossing, new >= old
        self._grow_crossing(rows, new, crossing, old[crossing])
        self.last_appended.index_fill_(0, rows[num_new_tokens > 0], self.clock)
        return []

    def _grow_crossing(self, rows, new, crossing, old_crossing) -> None:
        """The rows now hold `new`; the crossing ones (holding old_crossing before) take their blocks,
        and the slot tables follow them. OutOfBlocksError, changing nothing, when a device is short."""
        P = self.block_size
        moved = rows[crossing]
        device = self.row_device.index_select(0, moved)  # (c,)
        new_crossing = new[crossing]
        self._take_blocks(device, ceil_div(new_crossing, P) - ceil_div(old_crossing, P))
        self.row_tokens.index_copy_(0, rows, new)
        self._count(moved, old_crossing, new_crossing, device)

    def _count(self, rows, old, new, device) -> None:
        """The slot tables, rows (on `device`) going from old to new tokens."""
        P = self.block_size
        L = self.num_layers
        E = self.num_experts
        D = self.num_devices
        where = (rows // E) * D + device  # (slot * L + layer) * D + device
        opened = ((new & (P - 1)) == 0).to(torch.int32) - ((old & (P - 1)) == 0).to(torch.int32)
        self.open_rows.view(-1).index_add_(0, where, opened)
        slot_device = (rows // (L * E)) * D + device
        self.open_per_device.view(-1).index_add_(0, slot_device, opened.to(torch.int64))
        self.count_blocks.view(-1).index_add_(0, slot_device, ceil_div(new, P) - ceil_div(old, P))

    def _crossing(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """(c,) the indices i where a row going from old[i] to new[i] tokens may change its block
        count or whether its next token opens a block: where the range between them reaches a
        multiple of P (a superset: a few rows that change neither are counted with 0). A decode
        step moves each row by one token, so about 2 rows in P; the rest only change row_tokens
        (a step of the simulator moves tens of thousands of rows)."""
        shift = self.block_size.bit_length() - 1  # P is a power of two
        low = torch.minimum(old, new)
        high = torch.maximum(old, new)
        return ((low - 1) >> shift).ne_(high >> shift).nonzero().squeeze(1)

    @torch.inference_mode(False)
    def _grow_rows(self) -> None:
        super()._grow_rows()
        for name in ("open_rows", "open_per_device", "count_blocks"):  # over slots
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.zeros_like(old)]))

    def blocks_held_per_device(self, seq_ids) -> torch.Tensor:
        """(m, D) count_blocks of each sequence; zeros if not held."""
        held = torch.zeros(len(seq_ids), self.num_devices, dtype=torch.int64)
        for i, s in enumerate(seq_ids):
            if self.holds(s):
                held[i] = self.count_blocks[self.seq_index(s)]
        return held

    def num_blocks_of_sequence(self, seq_id: int) -> int:
        return int(self.count_blocks[self.seq_index(seq_id)].sum())

    def _take_blocks(self, device: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
        """The needed blocks counted as lent on their rows' devices, per device; no ids (an empty
        tensor, so no table entry is written). OutOfBlocksError, changing nothing, when short."""
        per_device = torch.zeros(self.num_devices, dtype=torch.int64).index_add_(0, device, needed)
        self.pool.allocate_per_device(per_device)
        return NO_IDS

    def _return_sequence_blocks(self, seq_id: int, index: int) -> None:
        """The sequence's blocks per device, as its slot counts them, back to the pool."""
        self.pool.free_per_device(self.count_blocks[index])

    def _return_row_blocks(self, rows: torch.Tensor) -> int:
        """Each row's ceil(n / P) blocks back on its device; returns how many."""
        per_row = self.num_used_columns(rows)  # (m,)
        per_device = torch.zeros(self.num_devices, dtype=torch.int64)
        per_device.index_add_(0, self.row_device[rows], per_row)
        self.pool.free_per_device(per_device)
        return int(per_row.sum())

    def assert_consistent(self) -> None:
        """KVCacheManager's invariants over counts, the slot tables', and the pool lending, per
        device, the blocks the held rows count (no ids to check)."""
        self.pool.assert_consistent()
        check_row_counts(self)
        slots = sorted(self._seq_index.values())
        if slots:
            rows = self.index.sequence_rows(torch.tensor(slots))  # (h, L*E)
            counts = self.row_tokens[rows].view(-1, self.num_layers, self.num_experts)  # (h, L, E)
            devices = self.row_device[rows].view(-1, self.num_layers, self.num_experts)  # (h, L, E)
            opened = ((counts % self.block_size) == 0).to(torch.int32)
            expected = torch.zeros(len(slots), self.num_layers, self.num_devices, dtype=torch.int32)
            assert torch.equal(self.open_rows[slots], expected.scatter_add_(2, devices, opened)), (
                "open_rows does not follow row_tokens"
            )
            assert torch.equal(self.open_per_device[slots], expected.sum(1).to(torch.int64)), (
                "open_per_device does not follow row_tokens"
            )
            blocks = torch.zeros(len(slots), self.num_layers, self.num_devices, dtype=torch.int64)
            blocks.scatter_add_(2, devices, ceil_div(counts, self.block_size))
            assert torch.equal(self.count_blocks[slots], blocks.sum(1)), (
                "count_blocks does not follow row_tokens"
            )
        counted = self.count_blocks[slots].sum(0)  # (D,) zeros when nothing is held
        lent = self.blocks_per_device - self.num_free_blocks_per_device
        assert torch.equal(counted, lent), (
            f"the pool lends {lent.tolist()} blocks per device, the held rows count {counted.tolist()}"
        )

    # ----- what needs a block id, refused ---------------------------------------------------------
    def allocate_slots(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> SlotAllocation:
        """There are no slots: grow_rows counts an append."""
        raise ValueError(
            f"allocate_slots: a {type(self).__name__} has no slots; allowed: grow_rows, or {LISTS_IDS}"
        )

    def _refuse_ids(self, call: str) -> NoReturn:
        raise ValueError(
            f"{call}: this manager ({type(self).__name__}) counts blocks without listing them; "
            f"allowed: {LISTS_IDS}, to read or place block ids"
        )

    def slot_of(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        self._refuse_ids("slots")

    def blocks_of_sequence(self, seq_id: int) -> torch.Tensor:
        self._refuse_ids("blocks_of_sequence")

    def place_blocks(self, rows: torch.Tensor, columns: torch.Tensor, block_ids: torch.Tensor) -> None:
        self._refuse_ids("place_blocks")

    def restore_sequence(self, seq_id: int, token_counts: torch.Tensor, last_appended: torch.Tensor):
        self._refuse_ids("restore_sequence")
