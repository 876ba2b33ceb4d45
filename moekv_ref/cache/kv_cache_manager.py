"""The KV cache manager: a block table and a token count per (sequence, layer, expert) row.

Rows are numbered as rows.py says. Everything is a tensor over rows, so that one call serves a whole
step, for the model's attention (a few rows) and the cache-only simulator (tens of thousands) alike:

    row_tokens      (R,)     int64  tokens stored in the row
    block_tables    (R, W)   int32  block ids of the row, in token order
    last_position   (R,)     int64  position of the row's newest token (-1: none), against which
                                    the cache checks token order
    last_appended   (R,)     int64  the `clock` of the row's last append (-1: none), what an
                                    expert-level LRU reads (`row_last_used`)

Token j of a row lives at offset j % P of block block_tables[row, j // P], slot block_id * P + offset
of the flat pool; entries past a row's ceil(n / P) blocks are padding (`num_blocks`), never read.

    row with n = 11 tokens, P = 4:      block_table = [ 7, 2, 9, pad, pad ]
        block 7: t0 t1 t2 t3    block 2: t4 t5 t6 t7    block 9: t8 t9 t10 --   <- the tail

A row grows into a new block when its tokens pass a multiple of P: appending k tokens to a row of n
takes ceil((n + k) / P) - ceil(n / P) blocks (`blocks_needed_per_device`, `allocate_slots`).
Invariants (`assert_consistent`, driven by property tests): a row of n tokens owns exactly ceil(n / P)
blocks, of its own device; no block is owned twice; a call that raises changes nothing.

Each row takes blocks of one device's range, so memory is short per device. Which device is the
`placement` (rows.py's RowPlacement): by expert (`device_of_expert`, (L, E)), or by sequence
(`home_devices`: every row of sequence s on s % D, as expert parallelism's kv_with_sequence and
replicated_attention placements keep theirs). options.py checks the options. Subclasses, each in
its own file, add prefix caching (prefix_caching_manager.py), shared-tail
rows (shared_tail_manager.py), a cap of B tokens per row (budgeted_manager.py) and the simulator's
counting (sim/counting.py).

The manager is the only writer of these tables. Whoever else changes a row asks it: allocate_slots
and grow_rows (appends, with slots or without), note_positions and extend_rows_in_place (the newest
positions; an append that takes no block), place_blocks (entries a subclass took or shares),
restore_sequence (back from the swap space), free, free_rows and start_step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..state import Stateful
from ..validation import MAX_INT64, check_ids, check_int
from .block_pool import BlockPool, OutOfBlocksError
from .invariants import check_block_tables, check_row_counts
from .options import (
    ManagerOptions,
    check_appends,
    check_distinct_rows,
    check_manager_options,
    check_rows_held,
)
from .rows import RowIndex, RowPlacement, ceil_div, ragged_arange, stable_order

Moves = list[tuple[torch.Tensor, torch.Tensor]]  # (source slots, destination slots), in order


@dataclass
class SlotAllocation:
    """What `allocate_slots` hands back (one result, as vLLM's KVCacheBlocks: docs/design.md)."""

    # (n,) each new token's slot in key_cache.view(-1, Hkv, Dh), row after row, in token order
    slot_mapping: torch.Tensor
    # K/V copies to apply, in order, *before* the new tokens are written (a shared-tail row moves its
    # tail into its new block); none for plain pages
    moves: Moves = field(default_factory=list)


class KVCacheManager(Stateful):
    """Block tables and token counts for every (sequence, layer, expert) row over one BlockPool.
    options: the keywords of options.py (placement, per-device pools, a shuffle seed, first sizes),
    or options= a ManagerOptions they were validated into."""

    STATE = (
        "row_tokens",
        "row_device",
        "block_tables",
        "last_position",
        "clock",
        "last_appended",
        "_seq_index",
        "_free_seq_indices",
        "slot_held",
    )
    PARTS = ("pool",)

    def __init__(
        self, num_layers: int, num_experts: int, block_size: int, num_blocks: int | None = None, **options
    ):
        num_layers, num_experts, options = check_manager_options(
            num_layers,
            num_experts,
            block_size,
            num_blocks,
            options,
            type(self).__name__,
            self._bytes_beside_tables,
        )
        self.options = options
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.block_size = options.block_size
        self.pool = self._make_pool(options)
        device_of_expert = options.device_of_expert
        if options.home_devices:
            self.placement = RowPlacement.by_sequence(num_layers, num_experts, self.pool.num_devices)
        else:
            if device_of_expert is None:
                device_of_expert = torch.zeros(num_layers, num_experts, dtype=torch.int64)
            self.placement = RowPlacement.by_expert(device_of_expert, self.pool.num_devices)
        self.index = RowIndex(num_layers, num_experts)
        self.rows_per_seq = self.index.rows_per_seq
        self.pad = self.pool.num_blocks  # padding in block tables: never a real block
        num_seqs = options.initial_num_seqs
        num_rows = num_seqs * self.rows_per_seq
        self.row_tokens = torch.zeros(num_rows, dtype=torch.int64)  # (R,)
        self.row_device = torch.zeros(num_rows, dtype=torch.int64)  # (R,) set by add_sequence
        width = self._initial_table_width(options.initial_blocks_per_row)
        self.block_tables = torch.full((num_rows, width), self.pad, dtype=torch.int32)  # (R, W)
        self.last_position = torch.full((num_rows,), -1, dtype=torch.int64)  # (R,)
        self.clock = 0  # stamped on the rows each append grows
        self.last_appended = torch.full((num_rows,), -1, dtype=torch.int64)  # (R,)
        self.slot_held = torch.zeros(num_seqs, dtype=torch.bool)  # (S,) a sequence holds it
        self._seq_index: dict[int, int] = {}  # sequence id -> its slot of rows
        self._free_seq_indices = list(range(num_seqs - 1, -1, -1))

    # ----- what a manager built on this one changes (each a subclass: module docstring) -----------
    def _bytes_beside_tables(self, num_layers: int, num_rows: int, options: ManagerOptions) -> int:
        """Bytes a subclass keeps beside the tables for num_rows rows with these options (weighed
        against the machine's memory before anything is allocated)."""
        return 0

    def _make_pool(self, options: ManagerOptions) -> BlockPool:
        """The pool this manager's rows take blocks from."""
        return BlockPool(options=options)

    def _initial_table_width(self, initial_blocks_per_row: int) -> int:
        """Columns each row's block table starts with (the tables widen as rows grow)."""
        return initial_blocks_per_row

    # whether a scheduler may evict single rows (`free_rows`), and whether a swap space may copy
    # this manager's sequences out (it reads their blocks by id, blocks_of_sequence, and gives them
    # back in fresh blocks, restore_sequence)
    can_evict_rows = True
    can_swap = True
    # the most tokens a row of each layer keeps (None: no cap but the pool's)
    layer_limits: list[int] | None = None

    # ----- the pool and its devices (the pool's answers; (D,) ones per device) -------------------
    num_blocks = property(lambda self: self.pool.num_blocks)
    num_free_blocks = property(lambda self: self.pool.num_free_blocks)
    num_devices = property(lambda self: self.pool.num_devices)
    blocks_per_device = property(lambda self: self.pool.blocks_per_device)
    num_free_blocks_per_device = property(lambda self: self.pool.num_free_blocks_per_device)

    def device_of_rows(self, rows) -> torch.Tensor:
        """(m,) the device of each row id (of a held sequence)."""
        return self.row_device[check_ids(rows, "rows")]

    def blocks_held_per_device(self, seq_ids) -> torch.Tensor:
        """(m, D) blocks each sequence owns on each device; zeros if not held."""
        held = torch.zeros(len(seq_ids), self.num_devices, dtype=torch.int64)
        for i, s in enumerate(seq_ids):
            if self.holds(s):
                rows = self.index.sequence_rows(torch.tensor([self.seq_index(s)]))[0]  # (L*E,)
                held[i].index_add_(0, self.row_device[rows], self.num_used_columns(rows))
        return held

    def blocks_needed_per_device(self, rows, num_new_tokens) -> torch.Tensor:
        """(D,) blocks appending num_new_tokens[i] tokens to rows[i] takes."""
        rows = check_ids(rows, "rows")
        num_new_tokens = check_ids(num_new_tokens, "num_new_tokens")
        old = self.row_tokens[rows]
        new_blocks = ceil_div(old + num_new_tokens, self.block_size) - ceil_div(old, self.block_size)
        return torch.zeros(self.num_devices, dtype=torch.int64).index_add_(
            0, self.device_of_rows(rows), new_blocks
        )

    sequences = property(lambda self: list(self._seq_index))

    def holds(self, seq_id: int) -> bool:
        return int(seq_id) in self._seq_index

    def add_sequence(self, seq_id: int) -> int:
        """Give a new sequence a slot of L * E empty rows; returns its seq_index."""
        seq_id = check_int("seq_id", seq_id, 0, MAX_INT64, "a sequence id")  # 1.7 is not sequence 1
        if seq_id in self._seq_index:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        if not self._free_seq_indices:
            self._grow_rows()
        index = self._free_seq_indices.pop()
        self._seq_index[seq_id] = index
        self.slot_held[index] = True
        rows = self.index.sequence_rows(torch.tensor([index]))[0]  # (L*E,)
        self.row_device[rows] = self.placement.of_sequences([seq_id])[0].reshape(-1)
        return index

    def seq_index(self, seq_id: int) -> int:
        if int(seq_id) not in self._seq_index:
            raise KeyError(
                f"sequence {seq_id} is not in the cache (unknown, or already freed); "
                f"known: {sorted(self._seq_index)[:10]}"
            )
        return self._seq_index[int(seq_id)]

    def seq_slots(self, seq_ids: list[int]) -> list[int | None]:
        """Each sequence's slot of rows (None: not held)."""
        return [self._seq_index.get(s) for s in seq_ids]

    def rows(self, seq_ids, layer: int, experts) -> torch.Tensor:
        """Row ids of (seq_ids[i], layer, experts[i]); experts may be one int for all."""
        layer = check_int("layer", layer, 0, self.num_layers - 1, "a layer of this manager")
        seq_ids = check_ids(seq_ids, "seq_ids").reshape(-1)
        experts = check_ids(experts, "experts").expand_as(seq_ids)
        lowest, highest = torch.aminmax(experts) if experts.numel() else (0, 0)
        if not 0 <= int(lowest) <= int(highest) < self.num_experts:
            raise ValueError(
                f"experts {sorted(set(experts.tolist()))[:8]} are not allowed; allowed: integers in "
                f"[0, {self.num_experts - 1}] (the experts of this manager)"
            )
        try:  # one dict lookup per id: cheaper than sorting out the few distinct ones first
            slots = torch.tensor([self._seq_index[s] for s in seq_ids.tolist()], dtype=torch.int64)
        except KeyError as missing:
            self.seq_index(missing.args[0])  # raises its KeyError
        return self.index.row(slots, layer, experts)

    def used_columns(self, rows=slice(None)) -> torch.Tensor:
        """(m, W) the table entries that list a block: the first num_used_columns of each row."""
        return torch.arange(self.block_tables.shape[1]) < self.num_used_columns(rows)[:, None]

    def num_used_columns(self, rows=slice(None)) -> torch.Tensor:
        """(m,) the table entries of each row that list a block: ceil(n / P)."""
        return ceil_div(self.row_tokens[rows], self.block_size)

    def set_row_tokens(self, rows: torch.Tensor | slice, counts: torch.Tensor | None) -> None:
        """Rows (distinct int64 ids of held sequences) now hold `counts` tokens: the one place
        row_tokens changes. The caller has taken or returned the blocks. rows may be the slice of
        one sequence's L * E rows and counts None (`free`): they hold nothing."""
        if isinstance(rows, slice):
            self.row_tokens[rows] = 0
        else:
            self.row_tokens.index_copy_(0, rows, counts)

    def _clear_rows(self, rows) -> None:
        """Empty the rows: int64 ids, or a slice (a sequence's rows, written without an index)."""
        used = self.num_used_columns(rows)
        width = int(used.max()) if used.numel() else 0  # the entries past it are padding already
        if isinstance(rows, slice):
            self.set_row_tokens(rows, None)
        else:
            rows = torch.as_tensor(rows).reshape(-1)
            self.set_row_tokens(rows, torch.zeros(rows.numel(), dtype=torch.int64))
        self.block_tables[rows, :width] = self.pad
        self.last_position[rows] = -1
        self.last_appended[rows] = -1

    # ----- the other writers' operations: what paged.py, the swap space, the scheduler and the
    # subclasses change here, each through one of these -----------------------------------------
    def start_step(self, step: int) -> None:
        """The rows the coming appends grow remember `step` (last_appended, which row-evicting
        victim policies read)."""
        self.clock = step

    def note_positions(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """The position of the last token each of the rows now holds (paged attention masks and
        rotates by it)."""
        self.last_position[rows] = positions

    def extend_rows_in_place(self, rows: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor) -> None:
        """Distinct rows whose new tokens fit the blocks they hold now hold `counts` tokens, the last
        at `positions`: an append that takes no block (paged.py's decode plan)."""
        self.set_row_tokens(rows, counts)
        self.last_appended[rows] = self.clock
        self.last_position[rows] = positions

    def place_blocks(self, rows: torch.Tensor, columns: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Table entries block_ids[i] at column columns[i] of row rows[i], the tables widened first
        where a column lies past them: blocks a part took or shares (prefix hits' shared blocks
        and copies, a shared-tail row's promoted blocks). The caller counts the rows' tokens."""
        if columns.numel() and int(columns.max()) >= self.block_tables.shape[1]:
            self._grow_tables(int(columns.max()) + 1)
        self.block_tables[rows, columns] = block_ids.to(torch.int32)

    def restore_sequence(
        self, seq_id: int, token_counts: torch.Tensor, last_appended: torch.Tensor
    ) -> torch.Tensor:
        """A sequence back from the swap space: its rows hold token_counts (L*E,) tokens again in
        fresh blocks, with the clocks last_appended (L*E,) they had (coming back is not a use).
        Returns the new blocks in blocks_of_sequence's order; OutOfBlocksError, changing nothing,
        when a device is short."""
        index = self.add_sequence(seq_id)
        rows = self.index.sequence_rows(torch.tensor([index]))[0]  # (L*E,)
        try:
            self.grow_rows(rows, token_counts)
        except OutOfBlocksError:
            self.free(seq_id)
            raise
        self.last_appended[rows] = last_appended
        return self.blocks_of_sequence(seq_id)

    # ----- the scheduler's questions --------------------------------------------------------------
    def can_allocate(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> bool:
        """Whether the append fits every device's pool."""
        needed = self.blocks_needed_per_device(rows, num_new_tokens)  # (D,)
        return bool((needed <= self.num_free_blocks_per_device).all())

    def blocks_of_sequence(self, seq_id: int) -> torch.Tensor:
        """Every block the sequence owns, row by row in token order: what a swap to a CPU pool
        copies, and what `free` returns."""
        rows = self.index.sequence_rows(torch.tensor([self.seq_index(seq_id)]))[0]  # (L*E,) its rows
        # each row's used entries only (a row of the simulator's lists a few of its table's columns)
        owner, column = ragged_arange(self.num_used_columns(rows))  # (b,) each
        width = self.block_tables.shape[1]
        return self.block_tables.view(-1)[rows[owner] * width + column].to(torch.int64)

    def num_blocks_of_sequence(self, seq_id: int) -> int:
        return int(self.blocks_held_per_device([seq_id]).sum())

    def token_counts(self, seq_ids) -> torch.Tensor:
        """(num_seqs, L, E) tokens held per row; zeros for a sequence the cache does not hold."""
        seq_ids = [int(s) for s in seq_ids]  # one gather (the scheduler asks for the whole batch)
        slots = [self._seq_index.get(s, 0) for s in seq_ids]  # slot 0 stands in, zeroed
        counts = self.row_tokens.view(-1, self.num_layers, self.num_experts)[
            slots
        ]  # a slot's rows: L * E in a row
        if missing := [i for i, s in enumerate(seq_ids) if s not in self._seq_index]:
            counts[missing] = 0
        return counts  # (m, L, E), a copy

    def row_last_used(self, seq_id: int) -> torch.Tensor:
        """(L, E) the clock of each row's last append (-1: never, or a sequence not held)."""
        if int(seq_id) not in self._seq_index:
            return torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int64)
        rows = self.index.sequence_rows(torch.tensor([self._seq_index[int(seq_id)]]))[0]  # (L*E,)
        return self.last_appended[rows].view(self.num_layers, self.num_experts).clone()

    # ----- allocate / slots / free ----------------------------------------------------------------
    def allocate_slots(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> SlotAllocation:
        """Make room for num_new_tokens[i] more tokens in the distinct rows[i], rows of sequences the
        cache holds, and count them as stored; returns each new token's slot. Raises ValueError for
        bad rows or counts, and OutOfBlocksError when the pool is short (a scheduler asks
        `can_allocate` first), changing nothing."""
        rows, num_new_tokens = check_appends(self, rows, num_new_tokens)
        old = self.row_tokens[rows]  # (m,)
        moves = self._grow(rows, num_new_tokens)
        return SlotAllocation(self.slots(rows, old, num_new_tokens), moves)

    def grow_rows(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> None:
        """allocate_slots without working out the slots: what a caller that writes no K/V (the
        cache-only simulator, a sequence back from the swap space) needs."""
        rows, num_new_tokens = check_appends(self, rows, num_new_tokens)
        self._grow(rows, num_new_tokens)

    def _grow(self, rows: torch.Tensor, num_new_tokens: torch.Tensor) -> Moves:
        """allocate_slots' work over validated rows: each row's new blocks, taken from its device, at
        the columns after its last; the rows' counts and clocks. Returns the K/V copies to apply
        first (none here)."""
        P = self.block_size
        old = self.row_tokens.index_select(0, rows)  # (m,)
        new = old + num_new_tokens
        held = ceil_div(old, P)  # (m,) blocks each holds: its first new block's column
        needed = ceil_div(new, P) - held  # (m,) a decode step takes none P - 1 times in P
        growing = needed.nonzero().squeeze(1)  # (c,)
        if growing.numel():
            owners = rows[growing]
            block_ids = self._take_blocks(self.row_device[owners], needed[growing])  # may raise
            if block_ids.numel():
                # the k-th new block of row i: column ceil(old[i] / P) + k
                owner, k = ragged_arange(needed[growing])  # (total,) each
                self.place_blocks(owners[owner], k + held[growing][owner], block_ids)
        self.set_row_tokens(rows, new)
        self.last_appended.index_fill_(0, rows[num_new_tokens > 0], self.clock)
        return []

    def _take_blocks(self, device: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
        """needed[i] fresh blocks from device device[i], row after row; OutOfBlocksError (the pool's,
        with the blocks missing on each device), changing nothing, when a device is short."""
        per_device = torch.zeros(self.num_devices, dtype=torch.int64).index_add_(0, device, needed)  # (D,)
        order = stable_order(torch.repeat_interleave(device, needed))  # the new blocks, device after device
        block_ids = torch.empty(order.numel(), dtype=torch.int64)
        block_ids[order] = self.pool.allocate_per_device(per_device)  # each device's in row order
        return block_ids

    def row_slots(self, row: int) -> torch.Tensor:
        return self.rows_slots(torch.tensor([int(row)]))

    def rows_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Slots of every token of each row, row after row, in token order."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        counts = self.row_tokens[rows]
        return self.slots(rows, torch.zeros_like(counts), counts)

    def padded_slots(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots (m, Lmax) of each row's tokens, padded, and valid (m, Lmax). Padding holds slot 0,
        a real slot: mask it, never read it as data."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        lens = self.row_tokens[rows]  # (m,)
        token = torch.arange(int(lens.max()) if rows.numel() else 0)  # (Lmax,)
        valid = token[None, :] < lens[:, None]  # (m, Lmax)
        token = torch.minimum(token[None, :], (lens - 1).clamp(min=0)[:, None])  # (m, Lmax) in range
        slots = self.slot_of(rows[:, None].expand_as(token), token)
        return torch.where(valid, slots, 0), valid

    def slots(self, rows, starts, counts) -> torch.Tensor:
        """Slots of tokens starts[i] .. starts[i] + counts[i] - 1 of each row, row after row."""
        owner, k = ragged_arange(counts)  # (t,) each
        return self.slot_of(rows[owner], k + starts[owner])

    def slot_of(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The slot of token `token` of row `row`, elementwise."""
        P = self.block_size
        return (token % P).add_(self.block_tables[row, token // P], alpha=P)  # offset + P * block

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence to the pool and forget it; KeyError, changing
        nothing, for a sequence the cache does not hold."""
        index = self.seq_index(seq_id)  # KeyError before any change
        self._return_sequence_blocks(seq_id, index)
        self._clear_rows(slice(index * self.rows_per_seq, (index + 1) * self.rows_per_seq))  # its L * E rows
        del self._seq_index[int(seq_id)]
        self.slot_held[index] = False
        self._free_seq_indices.append(index)

    def _return_sequence_blocks(self, seq_id: int, index: int) -> None:
        """Every block of the sequence (held in slot `index`) back to the pool, its rows not yet
        emptied (`free`)."""
        self.pool.free(self.blocks_of_sequence(seq_id), distinct=True)  # a sequence owns a block once

    def free_rows(self, rows) -> int:
        """Empty some rows of held sequences (an eviction of single rows: the sequences stay, but
        cannot attend over them until rebuilt); returns how many blocks went back to the pool."""
        rows = check_ids(rows, "rows").reshape(-1)
        check_rows_held(self, rows, "free_rows")
        check_distinct_rows(self, rows, "free_rows")
        num_freed = self._return_row_blocks(rows)
        self._clear_rows(rows)
        return num_freed

    def _return_row_blocks(self, rows: torch.Tensor) -> int:
        """The blocks of the rows (distinct, validated) back to the pool, the rows not yet emptied
        (`free_rows`); returns how many."""
        blocks = self.block_tables[rows][self.used_columns(rows)].to(torch.int64)
        self.pool.free(blocks)
        return blocks.numel()

    @torch.inference_mode(False)  # tables kept across steps: never inference tensors
    def _grow_rows(self) -> None:
        """Double the sequence slots (bookkeeping only; the pool never grows). A subclass doubles
        its own tables after calling this."""
        num_seqs = self.slot_held.numel()
        extra = num_seqs * self.rows_per_seq
        fills = {
            "row_tokens": 0,
            "row_device": 0,
            "last_position": -1,
            "last_appended": -1,
            "block_tables": self.pad,
        }
        for name, fill in fills.items():
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.full((extra, *old.shape[1:]), fill, dtype=old.dtype)]))
        self.slot_held = torch.cat([self.slot_held, torch.zeros_like(self.slot_held)])
        self._free_seq_indices = list(range(2 * num_seqs - 1, num_seqs - 1, -1)) + self._free_seq_indices

    @torch.inference_mode(False)
    def _grow_tables(self, min_width: int) -> None:
        width = self.block_tables.shape[1]
        while width < min_width:
            width *= 2
        extra = torch.full(
            (len(self.block_tables), width - self.block_tables.shape[1]), self.pad, dtype=torch.int32
        )
        self.block_tables = torch.cat([self.block_tables, extra], dim=1)

    def assert_consistent(self) -> None:
        """The invariants of the module docstring (invariants.py); AssertionError names the broken one."""
        self.pool.assert_consistent()
        check_row_counts(self)
        check_block_tables(self)
