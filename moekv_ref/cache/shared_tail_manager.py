"""Paged rows whose partly filled tails share blocks: waste < P slots per sequence, not per row.

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

from .kv_cache_manager import KVCacheManager, ManagerPart, Moves, SlotAllocation


class SharedTails(ManagerPart):
    """A KVCacheManager's part (`tails=SharedTails()`, one per manager): it owns the tail state,
    and the manager hands it the calls that differ."""

    role = "tails"

    def bytes_needed(self, num_rows: int, num_blocks: int, block_size: int, num_layers: int) -> int:
        return 8 * block_size * (num_rows + 2 * num_blocks)  # tail_slots, slot_row, slot_position

    STATE = ("tail_slots", "slot_row", "slot_position", "tail_blocks", "free_tail_slots")

    def attach(self, manager: KVCacheManager) -> None:
        self.manager = manager
        P, num_slots = manager.block_size, manager.num_blocks * manager.block_size
        num_rows = manager.row_tokens.numel()
        self.tail_slots = torch.full((num_rows, P), -1, dtype=torch.int64)  # (R, P) -1 = none
        # who uses each slot of a tail block: the row and the position in its tail (-1: nobody)
        self.slot_row = torch.full((num_slots,), -1, dtype=torch.int64)  # (N*P,)
        self.slot_position = torch.full((num_slots,), -1, dtype=torch.int64)
        # tail group g = seq_index * D + device (module docstring); g = seq_index with one device
        self.tail_blocks: dict[int, list[int]] = {}  # group -> its tail block ids
        self.free_tail_slots: dict[int, list[int]] = {}  # group -> free slots (a stack)

    def blocks(self) -> torch.Tensor:
        """Every tail block, of all sequences (owned outside the block tables)."""
        return torch.tensor([b for blocks in self.tail_blocks.values() for b in blocks], dtype=torch.int64)

    def groups_of_sequence(self, index: int) -> range:
        D = self.manager.num_devices
        return range(index * D, (index + 1) * D)

    def group_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        m = self.manager
        return (rows // m.rows_per_seq) * m.num_devices + m.row_device[rows]

    def blocks_of_sequence(self, index: int) -> list[int]:
        return [b for g in self.groups_of_sequence(index) for b in self.tail_blocks[g]]

    def add_sequence(self, index: int) -> None:
        for g in self.groups_of_sequence(index):
            self.tail_blocks[g], self.free_tail_slots[g] = [], []

    def num_blocks_needed_per_device(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> torch.Tensor:
        """(D,) the rows' new full blocks and each tail group's new tail blocks, per device."""
        m, P, D = self.manager, self.manager.block_size, self.manager.num_devices
        old = m.row_tokens[rows]
        new = old + num_new_tokens
        need = torch.zeros(D, dtype=torch.int64).index_add_(0, m.row_device[rows], new // P - old // P)
        group_of_row = self.group_of_rows(rows)
        for group in group_of_row.unique().tolist():
            mine, held = group_of_row == group, len(self.tail_blocks[group])
            tail_tokens = held * P - len(self.free_tail_slots[group])
            tail_tokens += int((new[mine] % P - old[mine] % P).sum())
            need[group % D] += max(0, -(-tail_tokens // P) - held)
        return need

    # ----- allocate / slots / free ----------------------------------------------------------------
    def allocate_slots(
        self, rows: torch.Tensor, num_new_tokens: torch.Tensor, with_slots: bool
    ) -> SlotAllocation:
        """KVCacheManager.allocate_slots with shared tails, rows checked."""
        m, P, D = self.manager, self.manager.block_size, self.manager.num_devices
        m.raise_short(self.num_blocks_needed_per_device(rows, num_new_tokens), rows.numel(), num_new_tokens)
        old = m.row_tokens[rows]
        new = old + num_new_tokens
        groups = self.group_of_rows(rows)
        each_row = list(zip(rows.tolist(), groups.tolist(), old.tolist(), new.tolist()))
        promotion_src, promotion_dst = [], []
        # 1. promotions: rows whose tail fills up get fresh full blocks; their old tail moves there
        for row, group, n_old, n_new in each_row:
            first, last = n_old // P, n_new // P
            if last == first:
                continue
            block_ids = m.pool.allocate(last - first, device=group % D)
            m.place_blocks(torch.full((last - first,), row), torch.arange(first, last), block_ids)
            tail = self.tail_slots[row, : n_old % P].clone()
            if tail.numel():
                promotion_src.append(tail)
                promotion_dst.append(block_ids[0] * P + torch.arange(tail.numel()))
                self.slot_row[tail] = self.slot_position[tail] = -1
                self.free_tail_slots[group].extend(tail.tolist()[::-1])
                self.tail_slots[row] = -1
        # 2. new tail tokens take free tail slots of their group (new tail blocks when none)
        for row, group, n_old, n_new in each_row:
            kept = n_old % P if n_new // P == n_old // P else 0
            for position in range(kept, n_new % P):
                slot = self._take_tail_slot(group)
                self.tail_slots[row, position] = slot
                self.slot_row[slot], self.slot_position[slot] = row, position
        m.set_row_tokens(rows, new)
        moves: Moves = [(torch.cat(promotion_src), torch.cat(promotion_dst))] if promotion_src else []
        # 3. compaction: give back tail blocks while a whole block's worth of tail slots is free
        for group in groups.unique().tolist():
            moves += self._compact(group)
        return SlotAllocation(m.slots(rows, old, num_new_tokens) if with_slots else None, moves)

    def _take_tail_slot(self, group: int) -> int:
        P, free = self.manager.block_size, self.free_tail_slots[group]
        if not free:
            block = int(self.manager.pool.allocate(1, device=group % self.manager.num_devices)[0])
            self.tail_blocks[group].append(block)
            free.extend(range(block * P + P - 1, block * P - 1, -1))
        return free.pop()

    def _compact(self, group: int) -> Moves:
        P = self.manager.block_size
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
            self.manager.pool.free(torch.tensor([victim]))
        return moves

    def slot_of(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        m, P = self.manager, self.manager.block_size
        full = (m.row_tokens[row] // P) * P  # tokens in blocks
        in_table = token < full
        column = torch.where(in_table, token // P, 0)
        body = m.block_tables[row, column].to(torch.int64) * P + token % P
        tail = self.tail_slots[row, torch.where(in_table, 0, token - full)]
        return torch.where(in_table, body, tail)

    def free(self, index: int, rows: torch.Tensor) -> None:
        """Forget the freed sequence's tails (the manager returned its tail blocks)."""
        P = self.manager.block_size
        self.tail_slots[rows] = -1
        for block in self.blocks_of_sequence(index):
            slots = slice(block * P, (block + 1) * P)
            self.slot_row[slots] = self.slot_position[slots] = -1
        self.add_sequence(index)

    def grow_rows(self, num_rows: int) -> None:
        extra = torch.full((num_rows - len(self.tail_slots), self.manager.block_size), -1)
        self.tail_slots = torch.cat([self.tail_slots, extra])

    def assert_consistent(self) -> None:
        m, P = self.manager, self.manager.block_size
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


def manager_with_shared_tails(*args, **kwargs) -> KVCacheManager:
    return KVCacheManager(*args, tails=SharedTails(), **kwargs)
