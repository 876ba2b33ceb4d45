"""SharedTailKVCacheManager: a KVCacheManager (kv_cache_manager.py) whose rows' partly filled
tails share blocks: waste < P slots per sequence, not per row.

With plain pages every row wastes the unused end of its last block, and fine-grained experts make
rows short (E = 64, top-8, 16 layers: ~32 tokens per row on average), so at a block size a GPU reads
well (P = 16) that is a large share of memory (the memory benchmark measures 0.87 utilization).
Here a row's full blocks stay private and its last n % P tokens live in the sequence's *tail
blocks*, shared slot by slot by all its rows:

    row (s, l, e), n = 37, P = 16:    block_table = [12, 40]               tokens 0..31
                                      tail_slots  = [161, 167, 170, 171, 175]   tokens 32..36
    sequence s's tail blocks [10, 11]: slots 160..191, each used by some row of s, or free

When a row's tail fills a block, a fresh block joins its table and the P - 1 tail tokens are copied
into it (`moves`, promotion); when a sequence's free tail slots add up to P, the tail block with
fewest used slots has them moved elsewhere (`moves`) and returns to the pool (compaction). With D
devices, tail group g = seq_index * D + d holds the sequence's tail blocks on device d, for its rows
there. Invariants (`assert_consistent`): a row lists n // P blocks in its table and n % P tail
slots; group g holds ceil(T_g / P) blocks of device g % D for its T_g tail tokens; every tail slot
is used once or free, and a block is a row's or a group's, never both.

The price, measured by bench memory: the moves, a slot index per tail token, and a decode that
gathers up to P - 1 scattered tail slots per row. The simulator's SharedTailDesign replays the same
accounting from counts (a test checks they agree).
"""

from __future__ import annotations

import torch

from ..validation import check_ids
from .invariants import check_block_tables, check_row_counts
from .kv_cache_manager import KVCacheManager, Moves


class SharedTailKVCacheManager(KVCacheManager):
    """KVCacheManager whose rows keep their last n % P tokens in their sequence's tail blocks
    (module docstring). Takes the plain manager's arguments. It frees no single rows (a row's tail
    lives outside its table), so no victim that evicts rows works with it."""

    STATE = (
        *KVCacheManager.STATE,
        "tail_slots",
        "slot_row",
        "slot_position",
        "tail_blocks",
        "free_tail_slots",
    )
    can_evict_rows = False

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        P = self.block_size
        num_slots = self.num_blocks * P
        self.tail_slots = torch.full((self.row_tokens.numel(), P), -1, dtype=torch.int64)  # (R, P) -1 = none
        # who uses each slot of a tail block: the row and the position in its tail (-1: nobody)
        self.slot_row = torch.full((num_slots,), -1, dtype=torch.int64)  # (N*P,)
        self.slot_position = torch.full((num_slots,), -1, dtype=torch.int64)
        # tail group g = seq_index * D + device (module docstring); g = seq_index with one device
        self.tail_blocks: dict[int, list[int]] = {}  # group -> its tail block ids
        self.free_tail_slots: dict[int, list[int]] = {}  # group -> free slots (a stack)

    def _bytes_beside_tables(self, num_layers: int, num_rows: int, options) -> int:
        # tail_slots (R, P), slot_row and slot_position (N * P,) each
        return 8 * options.block_size * (num_rows + 2 * options.num_blocks)

    def tail_blocks_all(self) -> torch.Tensor:
        """Every tail block, of all sequences (owned outside the block tables)."""
        return torch.tensor([b for blocks in self.tail_blocks.values() for b in blocks], dtype=torch.int64)

    def groups_of_sequence(self, index: int) -> range:
        D = self.num_devices
        return range(index * D, (index + 1) * D)

    def group_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows // self.rows_per_seq) * self.num_devices + self.row_device[rows]

    def tail_blocks_of_slot(self, index: int) -> list[int]:
        return [b for g in self.groups_of_sequence(index) for b in self.tail_blocks[g]]

    # ----- what differs from plain pages ----------------------------------------------------------
    def add_sequence(self, seq_id: int) -> int:
        index = super().add_sequence(seq_id)
        for g in self.groups_of_sequence(index):
            self.tail_blocks[g] = []
            self.free_tail_slots[g] = []
        return index

    def num_used_columns(self, rows=slice(None)) -> torch.Tensor:
        """A row's table lists its full blocks only: n // P."""
        return self.row_tokens[rows] // self.block_size

    def blocks_of_sequence(self, seq_id: int) -> torch.Tensor:
        """KVCacheManager.blocks_of_sequence, then the sequence's tail blocks."""
        tails = torch.tensor(self.tail_blocks_of_slot(self.seq_index(seq_id)), dtype=torch.int64)
        return torch.cat([super().blocks_of_sequence(seq_id), tails])

    def blocks_held_per_device(self, seq_ids) -> torch.Tensor:
        """(m, D) blocks each sequence owns on each device, tail blocks too; zeros if not held."""
        held = torch.zeros(len(seq_ids), self.num_devices, dtype=torch.int64)
        for i, s in enumerate(seq_ids):
            if self.holds(s):
                held[i] = torch.bincount(
                    self.pool.device_of_blocks(self.blocks_of_sequence(s)), minlength=self.num_devices
                )
        return held

    def blocks_needed_per_device(self, rows, num_new_tokens) -> torch.Tensor:
        """(D,) the rows' new full blocks and each tail group's new tail blocks, per device."""
        rows = check_ids(rows, "rows")
        num_new_tokens = check_ids(num_new_tokens, "num_new_tokens")
        P = self.block_size
        old = self.row_tokens[rows]
        new = old + num_new_tokens
        need = torch.zeros(self.num_devices, dtype=torch.int64).index_add_(
            0, self.row_device[rows], new // P - old // P
        )
        group_of_row = self.group_of_rows(rows)
        for group in group_of_row.unique().tolist():
            mine = group_of_row == group
            held = len(self.tail_blocks[group])
            tail_tokens = held * P - len(self.free_tail_slots[group])
            tail_tokens += int((new[mine] % P - old[mine] % P).sum())
            need[group % self.num_devices] += max(0, -(-tail_tokens // P) - held)
        return need

    def _grow(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> Moves:
        """KVCacheManager._grow with shared tails: promotions, new tail slots, compaction; returns
        the K/V copies they need, in order."""
        P = self.block_size
        D = self.num_devices
        needed = self.blocks_needed_per_device(rows, num_new_tokens)
        self.pool.check_free(needed)
        old = self.row_tokens[rows]
        new = old + num_new_tokens
        groups = self.group_of_rows(rows)
        each_row = list(zip(rows.tolist(), groups.tolist(), old.tolist(), new.tolist()))
        promotion_src = []
        promotion_dst = []
        # 1. promotions: rows whose tail fills up get fresh full blocks; their old tail moves there
        for row, group, n_old, n_new in each_row:
            first = n_old // P
            last = n_new // P
            if last == first:
                continue
            block_ids = self.pool.allocate(last - first, device=group % D)
            self.place_blocks(torch.full((last - first,), row), torch.arange(first, last), block_ids)
            tail = self.tail_slots[row, : n_old % P].clone()
            if tail.numel():
                promotion_src.append(tail)
                promotion_dst.append(block_ids[0] * P + torch.arange(tail.numel()))
                self.slot_row[tail] = -1
                self.slot_position[tail] = -1
                self.free_tail_slots[group].extend(tail.tolist()[::-1])
                self.tail_slots[row] = -1
        # 2. new tail tokens take free tail slots of their group (new tail blocks when none)
        for row, group, n_old, n_new in each_row:
            kept = n_old % P if n_new // P == n_old // P else 0
            for position in range(kept, n_new % P):
                slot = self._take_tail_slot(group)
                self.tail_slots[row, position] = slot
                self.slot_row[slot] = row
                self.slot_position[slot] = position
        self.set_row_tokens(rows, new)
        self.last_appended.index_fill_(0, rows[num_new_tokens > 0], self.clock)
        moves: Moves = [(torch.cat(promotion_src), torch.cat(promotion_dst))] if promotion_src else []
        # 3. compaction: give back tail blocks while a whole block's worth of tail slots is free
        for group in groups.unique().tolist():
            moves += self._compact(group)
        return moves

    def _take_tail_slot(self, group: int) -> int:
        P = self.block_size
        free = self.free_tail_slots[group]
        if not free:
            block = int(self.pool.allocate(1, device=group % self.num_devices)[0])
            self.tail_blocks[group].append(block)
            free.extend(range(block * P + P - 1, block * P - 1, -1))
        return free.pop()

    def _compact(self, group: int) -> Moves:
        P = self.block_size
        moves: Moves = []
        while len(self.free_tail_slots[group]) >= P:
            blocks = self.tail_blocks[group]
            used = [int((self.slot_row[b * P : (b + 1) * P] >= 0).sum()) for b in blocks]
            victim = blocks[min(range(len(blocks)), key=lambda i: (used[i], -i))]  # emptiest, newest
            victim_slots = torch.arange(victim * P, (victim + 1) * P)
            sources = victim_slots[self.slot_row[victim_slots] >= 0]
            free = [s for s in self.free_tail_slots[group] if s // P != victim]
            destinations = torch.tensor(free[len(free) - sources.numel() :][::-1], dtype=torch.int64)
            self.free_tail_slots[group] = free[: len(free) - sources.numel()]
            if sources.numel():
                row, position = self.slot_row[sources], self.slot_position[sources]
                self.tail_slots[row, position] = destinations
                self.slot_row[destinations], self.slot_position[destinations] = row, position
                self.slot_row[sources] = self.slot_position[sources] = -1
                moves.append((sources, destinations))
            blocks.remove(victim)
            self.pool.free(torch.tensor([victim]))
        return moves

    def slot_of(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """A token in a full block: its table's slot; a tail token: its tail slot."""
        P = self.block_size
        full = (self.row_tokens[row] // P) * P  # tokens in blocks
        in_table = token < full
        column = torch.where(in_table, token // P, 0)
        body = self.block_tables[row, column].to(torch.int64) * P + token % P
        tail = self.tail_slots[row, torch.where(in_table, 0, token - full)]
        return torch.where(in_table, body, tail)

    def free(self, seq_id: int) -> None:
        """KVCacheManager.free (which returns the tail blocks too), then the tails forgotten."""
        index = self.seq_index(seq_id)
        P = self.block_size
        for block in self.tail_blocks_of_slot(index):
            slots = slice(block * P, (block + 1) * P)
            self.slot_row[slots] = -1
            self.slot_position[slots] = -1
        super().free(seq_id)
        self.tail_slots[index * self.rows_per_seq : (index + 1) * self.rows_per_seq] = -1
        for g in self.groups_of_sequence(index):
            self.tail_blocks[g] = []
            self.free_tail_slots[g] = []

    def free_rows(self, rows) -> int:
        # rows' tails live outside the block tables: they would have to be compacted too
        raise NotImplementedError("a manager with shared tails does not free single rows")

    @torch.inference_mode(False)
    def _grow_rows(self) -> None:
        super()._grow_rows()
        extra = torch.full((self.row_tokens.numel() - len(self.tail_slots), self.block_size), -1)
        self.tail_slots = torch.cat([self.tail_slots, extra])

    def assert_consistent(self) -> None:
        """KVCacheManager's invariants, the tail blocks owned too, and the tails' (module docstring)."""
        self.pool.assert_consistent()
        check_row_counts(self)
        check_block_tables(self, also_owned=self.tail_blocks_all())
        m = self
        P = self.block_size
        valid = torch.arange(P) < (m.row_tokens % P)[:, None]  # (R, P)
        assert (self.tail_slots[~valid] == -1).all(), "a tail slot past a row's tail is set"
        used = self.tail_slots[valid]
        assert used.unique().numel() == used.numel(), "a tail slot is used twice"
        row, position = valid.nonzero(as_tuple=True)
        assert torch.equal(self.slot_row[used], row) and torch.equal(self.slot_position[used], position), (
            "slot owner map disagrees with tail_slots"
        )
        assert int((self.slot_row >= 0).sum()) == used.numel(), "a slot has an owner but no row uses it"
        group_of_row = self.group_of_rows(row)
        for index, blocks in self.tail_blocks.items():
            assert all(int(d) == index % m.num_devices for d in m.pool.device_of_blocks(blocks).tolist()), (
                f"tail group {index} holds a block of another device than its own"
            )
            mine = used[group_of_row == index]
            free = torch.tensor(self.free_tail_slots[index], dtype=torch.int64)
            held = torch.tensor(blocks, dtype=torch.int64)
            assert torch.isin(mine // P, held).all() and torch.isin(free // P, held).all(), (
                "a tail slot lies outside its sequence's tail blocks"
            )
            assert mine.numel() + free.numel() == len(blocks) * P, "tail slots leaked"
            assert not torch.isin(free, mine).any(), "a free tail slot is in use"
            assert len(blocks) == -(-mine.numel() // P), (
                f"tail group {index} holds {len(blocks)} tail blocks for {mine.numel()} tail tokens"
            )
