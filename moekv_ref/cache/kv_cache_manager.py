"""The KV cache manager: a block table and a token count per (sequence, layer, expert) row.

Rows are numbered as rows.py says. Everything is a tensor over rows, so that one call serves a whole
step, for the model's attention (a few rows) and the cache-only simulator (tens of thousands) alike:

    row_tokens      (num_rows,)             int64  tokens stored in the row
    block_tables    (num_rows, max_blocks)  int32  block ids of the row, in token order
    last_position   (num_rows,)             int64  position of the row's newest token (-1: none),
                                                   against which the cache checks token order
    last_appended   (num_rows,)             int64  the `clock` of the row's last append (-1: none),
                                                   what an expert-level LRU reads (`row_last_used`)

and three tables over sequence slots that follow from row_tokens, kept up to date where it
changes (`set_row_tokens`, its one writer, which empties a freed sequence's slot at once), so that
a scheduler reads a decode step's worst case without touching every row of every running sequence
(engine/demand.py, `decode_need`):

    open_rows       (num_slots, L, D)       int32  rows of each (layer, device) whose last block is
                                                   full or which are empty: the next token there
                                                   opens a block
    open_per_device (num_slots, D)          int64  open_rows summed over the layers
    count_blocks    (num_slots, D)          int64  ceil(n / P) summed over the rows on each device

Token j of a row lives at offset j % P of block block_tables[row, j // P], slot block_id * P +
offset of the flat pool; entries past a row's ceil(n / P) blocks are padding (`num_blocks`, out of
range on purpose), never read.

    row with n = 11 tokens, P = 4:      block_table = [ 7, 2, 9, pad, pad ]
        block 7: t0 t1 t2 t3    block 2: t4 t5 t6 t7    block 9: t8 t9 t10 --   <- the tail

Invariants (`assert_consistent`, driven by property tests): a row of n tokens owns exactly
ceil(n / P) blocks, of its own device; no block is owned twice; a call that raises changes nothing.

Each row takes blocks of one device's range, so memory is short per device. Which device is the
manager's `placement` (rows.py's RowPlacement), which answers for every row: by expert, each expert
of each layer on one of D devices (`device_of_expert`, (L, E)); or, with `home_devices`, by sequence,
every row of sequence s on s % D (a pool sharded by sequence, as expert parallelism's
kv_with_sequence and replicated_attention placements keep theirs). Parts, vLLM's style, each own
their state and are called where they differ: SharedTails and PrefixCache (which do not combine), and
RowBudget (budget.py: at most B tokens a row, a policy at a full row), which combines with neither.

The manager is the only writer of these tables. Whoever else changes a row asks it:

    allocate_slots, allocate_within_budget   appends (the model's attention, the simulator)
    note_positions, extend_rows_in_place     the newest tokens' positions; an append that takes no
                                             block (paged.py's decode plan)
    place_blocks                             table entries a part took or shares (shared tails)
    start_from_blocks                        a sequence that starts from shared and copied blocks
                                             (a prefix hit: prefix_cache.py)
    restore_sequence                         a sequence back from the swap space (engine/swap.py)
    free, free_rows, start_step              a sequence or single rows let go; the step's clock
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..state import Stateful
from ..validation import (
    MAX_INT32,
    MAX_INT64,
    a_type,
    check_block_size,
    check_device_table,
    check_fits_memory,
    check_flag,
    check_ids,
    check_int,
    check_seed,
    known_keywords,
    shown,
)
from .block_pool import BlockPool, OutOfBlocksError, check_pool_size
from .rows import RowIndex, RowPlacement, ceil_div, ragged_arange, stable_order

Moves = list[tuple[torch.Tensor, torch.Tensor]]  # (source slots, destination slots), in order
_NO_BLOCKS = torch.zeros(0, dtype=torch.int64)  # what most decode appends take (never written to)


@dataclass
class SlotAllocation:
    """What `allocate_slots` hands back (one result, as vLLM's KVCacheBlocks: docs/design.md)."""

    # (n,) each new token's slot in key_cache.view(-1, Hkv, Dh), row after row, in token order
    slot_mapping: torch.Tensor | None  # None with with_slots=False
    # shared tails only: K/V copies to apply, in order, *before* the new tokens are written
    moves: Moves = field(default_factory=list)


class ManagerPart(Stateful):
    """What a KVCacheManager is built with besides its pool (SharedTails, PrefixCache, RowBudget): it
    keeps the state of one manager, which hands it to the part once (`attach`)."""

    role = ""  # the manager's parameter that takes it: "tails", "prefix_cache" or "budget"
    manager = None  # the manager it belongs to, once attached

    def attach(self, manager: "KVCacheManager") -> None:
        raise NotImplementedError

    def bytes_needed(self, num_rows: int, num_blocks: int, block_size: int, num_layers: int) -> int:
        """Bytes of the tensors `attach` makes for a manager of these sizes (checked before)."""
        raise NotImplementedError


PART_KINDS = {
    "tails": "a SharedTails (cache/shared_tail_manager.py)",
    "prefix_cache": "a PrefixCache (cache/prefix_cache.py)",
    "budget": "a RowBudget (cache/budget.py)",
}


def check_part_kind(role: str, part) -> None:
    """A part given as `role` (a manager's or a cache's parameter) is of its kind, or None."""
    if part is not None and not (isinstance(part, ManagerPart) and part.role == role):
        raise ValueError(f"{role}={shown(part)} is {a_type(part)}; allowed: {PART_KINDS[role]}, or None")


def check_parts(tails, prefix_cache, budget, num_layers: int, num_experts: int) -> None:
    """Each part of its kind or None, not yet given to another manager, in a combination that works,
    and a budget the model can have; ValueError naming the parameter otherwise."""
    for role, part in (("tails", tails), ("prefix_cache", prefix_cache), ("budget", budget)):
        check_part_kind(role, part)
        if part is not None and part.manager is not None:
            raise ValueError(
                f"{role}={shown(part)} already belongs to another KVCacheManager: a part keeps one "
                f"manager's state; build a new {type(part).__name__} for this one"
            )
    check_parts_combine(tails is not None, prefix_cache is not None, budget is not None)
    if budget is not None:
        budget.check_model(num_layers, num_experts)


def check_parts_combine(tails: bool, prefix_cache: bool, budget: bool) -> None:
    """The combinations of parts that do not work, refused with their reason."""
    if tails and prefix_cache:
        raise ValueError(
            "shared tails and prefix caching do not combine: a prefix hit copies "
            "the block straddling its end, but a shared-tail row keeps its last "
            "tokens in its sequence's tail blocks, not in a block of its own; use "
            "one or the other (each works with one device or several)"
        )
    if budget and (tails or prefix_cache):
        raise ValueError(
            "a row budget combines with neither shared tails nor prefix caching: a full "
            "budgeted row replaces tokens in place, so its blocks hold what its policy "
            "kept, not a prefix another request could reuse, and its last tokens are "
            "not a tail to share; build the cache with the budget alone"
        )


def check_devices(home_devices, blocks_per_device, device_of_expert) -> bool:
    """Per-device pools take blocks_per_device with device_of_expert (each expert's rows on its
    device) or with home_devices=True (every row of sequence s on device s % D); one pool, neither."""
    check_flag("home_devices", home_devices)
    if home_devices and device_of_expert is not None:
        raise ValueError(
            "home_devices=True takes no device_of_expert: every row of sequence s lives on "
            "device s % D, whatever its expert"
        )
    if home_devices and blocks_per_device is None:
        raise ValueError(
            "home_devices=True needs blocks_per_device: every row of sequence s lives on device "
            "s % D of the pools it gives"
        )
    if not home_devices and (blocks_per_device is None) != (device_of_expert is None):
        raise ValueError(
            "per-device pools need both blocks_per_device and device_of_expert "
            "(or home_devices=True instead of device_of_expert)"
        )
    return home_devices


def check_bookkeeping_fits(
    num_layers: int,
    num_experts: int,
    block_size: int,
    num_blocks: int,
    num_devices: int,
    num_seqs: int,
    width: int,
    parts,
) -> None:
    """ValueError, before anything is allocated, when the manager's tables for num_seqs sequences of
    rows `width` blocks wide, and its parts', take more than the machine's memory."""
    num_rows = num_seqs * num_layers * num_experts
    # per row a count, a device, a position and a clock (8 bytes each) and `width` int32 table
    # entries; per sequence slot open_rows (L * D int32) and count_blocks (D int64)
    needed = num_rows * (4 * 8 + 4 * width) + num_seqs * num_devices * (4 * num_layers + 8)
    needed += sum(part.bytes_needed(num_rows, num_blocks, block_size, num_layers) for part in parts)
    check_fits_memory(
        f"the tables of {num_rows:,} rows (num_layers={num_layers} x num_experts={num_experts} x "
        f"{num_seqs} sequences) over {num_blocks:,} blocks of {block_size}",
        needed,
        "cpu",
        "ask for fewer layers, experts, sequences or blocks",
    )


def checked_placement(device_of_expert, num_layers: int, num_experts: int, num_devices: int) -> torch.Tensor:
    """device_of_expert as (L, E) int64: given (E,) for every layer or (L, E), devices in [0, D), or
    ValueError naming the first bad value (validation.check_device_table, the rule of every table of
    devices)."""
    return check_device_table(device_of_expert, num_devices, num_layers, num_experts, every_layer=True)


@dataclass(frozen=True)
class ManagerOptions:
    """A manager's sizes and placement, checked and resolved by check_manager_options: what
    KVCacheManager(..., checked=True) takes as given (and PagedKVCache, which builds one)."""

    block_size: int
    shuffle_seed: int | None
    blocks_per_device: list[int]  # (D,) [num_blocks] for one pool
    device_of_expert: torch.Tensor | None  # (L, E) int64; None: one pool, or home devices
    home_devices: bool

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_per_device)


def check_manager_options(
    num_layers: int,
    num_experts: int,
    block_size,
    num_blocks,
    shuffle_seed,
    blocks_per_device,
    device_of_expert,
    home_devices,
    tails,
    prefix_cache,
    budget,
    initial_num_seqs: int = 4,
    initial_blocks_per_row: int = 4,
    pool_meaning: str = "the pool's blocks",
) -> ManagerOptions:
    """Every option a manager takes beyond its layers and experts, checked in one place for both
    public ways to build one (KVCacheManager and PagedKVCache's check_cache_options), each value
    once, before anything is allocated. num_blocks: an int, None (blocks_per_device gives the pool),
    or a function of the checked block size (a pool sized for a workload, once the block size and
    the parts are checked). pool_meaning: what a block count means, for the pool size's message."""
    block_size = check_block_size(block_size)
    home_devices = check_devices(home_devices, blocks_per_device, device_of_expert)
    check_parts(tails, prefix_cache, budget, num_layers, num_experts)
    if callable(num_blocks):
        num_blocks = num_blocks(block_size)
    blocks_per_device = check_pool_size(num_blocks, blocks_per_device, pool_meaning)
    shuffle_seed = check_seed("shuffle_seed", shuffle_seed, len(blocks_per_device), allow_none=True)
    if device_of_expert is not None:
        device_of_expert = checked_placement(
            device_of_expert, num_layers, num_experts, len(blocks_per_device)
        )
    check_bookkeeping_fits(
        num_layers,
        num_experts,
        block_size,
        sum(blocks_per_device),
        len(blocks_per_device),
        initial_num_seqs,
        initial_blocks_per_row,
        [part for part in (tails, prefix_cache, budget) if part is not None],
    )
    return ManagerOptions(block_size, shuffle_seed, blocks_per_device, device_of_expert, home_devices)


class KVCacheManager(Stateful):
    """Block tables and token counts for every (sequence, layer, expert) row over one BlockPool.
    device_of_expert: (E,) or (L, E), all zeros when left out; tails, prefix_cache, budget: its
    parts (ManagerPart), each given to this manager only."""

    STATE = (
        "row_tokens",
        "row_device",
        "block_tables",
        "last_position",
        "clock",
        "last_appended",
        "open_rows",
        "open_per_device",
        "count_blocks",
        "_seq_index",
        "_free_seq_indices",
        "slot_held",
    )
    PARTS = ("pool", "tails", "prefix_cache", "budget")

    @known_keywords
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        block_size: int,
        num_blocks: int | None = None,
        shuffle_seed: int | None = None,
        initial_num_seqs: int = 4,
        initial_blocks_per_row: int = 4,
        blocks_per_device=None,
        device_of_expert=None,
        home_devices: bool = False,
        tails=None,
        prefix_cache=None,
        budget=None,
        checked: bool = False,
    ):
        """checked=True: the caller (a paged cache) checked every argument with the functions this
        constructor calls otherwise; blocks_per_device is then a list of ints (None: [num_blocks])
        and device_of_expert an (L, E) int64 tensor (None: all zeros)."""
        if not checked:
            num_layers = check_int("num_layers", num_layers, 1, MAX_INT32)
            num_experts = check_int("num_experts", num_experts, 1, MAX_INT32)
            initial_num_seqs = check_int("initial_num_seqs", initial_num_seqs, 1, MAX_INT32)
            initial_blocks_per_row = check_int("initial_blocks_per_row", initial_blocks_per_row, 1, MAX_INT32)
            options = check_manager_options(
                num_layers,
                num_experts,
                block_size,
                num_blocks,
                shuffle_seed,
                blocks_per_device,
                device_of_expert,
                home_devices,
                tails,
                prefix_cache,
                budget,
                initial_num_seqs,
                initial_blocks_per_row,
            )
            block_size = options.block_size
            shuffle_seed = options.shuffle_seed
            blocks_per_device = options.blocks_per_device
            device_of_expert = options.device_of_expert
            home_devices = options.home_devices
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.block_size = block_size
        self.pool = self._make_pool(num_blocks, shuffle_seed, blocks_per_device)
        if home_devices:
            self.placement = RowPlacement.by_sequence(num_layers, num_experts, self.pool.num_devices)
        else:
            if device_of_expert is None:
                device_of_expert = torch.zeros(num_layers, num_experts, dtype=torch.int64)
            self.placement = RowPlacement.by_expert(device_of_expert, self.pool.num_devices)
        # a sequence's L * E rows, device after device (row order within each): `free` hands its
        # blocks to the pool grouped by device, so the pool has nothing to sort (by sequence, every
        # row of a sequence is on one device: row order)
        by_device = torch.zeros(num_layers * num_experts, dtype=torch.int64)
        if device_of_expert is not None:
            by_device = device_of_expert.reshape(-1)
        self._rows_by_device = torch.argsort(by_device, stable=True)
        self.index = RowIndex(num_layers, num_experts)
        self.rows_per_seq = self.index.rows_per_seq
        self.pad = self.pool.num_blocks  # padding in block tables: never a real block
        num_rows = initial_num_seqs * self.rows_per_seq
        self.row_tokens = torch.zeros(num_rows, dtype=torch.int64)  # (R,)
        self.row_device = torch.zeros(num_rows, dtype=torch.int64)  # (R,) set by add_sequence
        width = self._initial_table_width(initial_blocks_per_row)
        self.block_tables = torch.full((num_rows, width), self.pad, dtype=torch.int32)  # (R, W)
        self.last_position = torch.full((num_rows,), -1, dtype=torch.int64)  # (R,)
        self.clock = 0  # stamped on the rows each append grows
        self.last_appended = torch.full((num_rows,), -1, dtype=torch.int64)  # (R,)
        D = self.pool.num_devices
        self.open_rows = torch.zeros(initial_num_seqs, num_layers, D, dtype=torch.int32)  # (S, L, D)
        self.open_per_device = torch.zeros(initial_num_seqs, D, dtype=torch.int64)  # (S, D)
        self.count_blocks = torch.zeros(initial_num_seqs, D, dtype=torch.int64)  # (S, D)
        self.slot_held = torch.zeros(initial_num_seqs, dtype=torch.bool)  # (S,) a sequence holds it
        self._seq_index: dict[int, int] = {}  # sequence id -> its slot of rows
        self._free_seq_indices = list(range(initial_num_seqs - 1, -1, -1))
        self.tails = tails
        self.prefix_cache = prefix_cache
        self.budget = budget
        for part in (tails, prefix_cache, budget):
            if part is not None:
                part.attach(self)

    def _make_pool(self, num_blocks: int | None, shuffle_seed: int | None, blocks_per_device) -> BlockPool:
        """The pool this manager's rows take blocks from (arguments checked by the constructor)."""
        return BlockPool(num_blocks, shuffle_seed, blocks_per_device, checked=True)

    def _initial_table_width(self, initial_blocks_per_row: int) -> int:
        """Columns each row's block table starts with (the tables widen as rows grow)."""
        return initial_blocks_per_row

    @property
    def can_evict_rows(self) -> bool:
        """Whether a scheduler may evict single rows (`free_rows`): plain, unshared pages only."""
        return self.tails is None and self.prefix_cache is None

    # whether a swap space may copy this manager's sequences out: it reads their blocks by id
    # (blocks_of_sequence) and gives them back in fresh blocks (restore_sequence)
    can_swap = True

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
        """(m, D) blocks each sequence owns on each device (tail blocks too); zeros if not held."""
        if self.tails is None:  # each row's blocks are on its device: count_blocks
            held = torch.zeros(len(seq_ids), self.num_devices, dtype=torch.int64)
            for i, s in enumerate(seq_ids):
                if self.holds(s):
                    held[i] = self.count_blocks[self.seq_index(s)]
            return held
        return torch.stack(
            [
                torch.zeros(self.num_devices, dtype=torch.int64)
                if not self.holds(s)
                else torch.bincount(
                    self.pool.device_of_blocks(self.blocks_of_sequence(s)), minlength=self.num_devices
                )
                for s in seq_ids
            ]
        )

    def blocks_needed_per_device(self, rows, num_new_tokens) -> torch.Tensor:
        """(D,) blocks appending num_new_tokens[i] tokens to rows[i] takes (before compaction)."""
        rows = check_ids(rows, "rows")
        num_new_tokens = check_ids(num_new_tokens, "num_new_tokens")
        if self.tails is not None:
            return self.tails.num_blocks_needed_per_device(rows, num_new_tokens)
        old = self.row_tokens[rows]
        new = old + num_new_tokens
        if self.budget is not None:  # a row stops growing at its budget
            new = torch.minimum(new, self.budget.limit_of_rows(rows))
        new_blocks = ceil_div(new, self.block_size) - ceil_div(old, self.block_size)
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
        devices = self.placement.of_sequences([seq_id])[0]  # (L, E)
        self.row_device[rows] = devices.reshape(-1)
        self.open_rows[index] = torch.zeros(
            self.num_layers, self.num_devices, dtype=torch.int32
        ).scatter_add_(
            1, devices, torch.ones_like(devices, dtype=torch.int32)
        )  # every row is empty: all open
        self.open_per_device[index] = self.open_rows[index].sum(0)
        if self.tails is not None:
            self.tails.add_sequence(index)
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
        """(m,) the table entries of each row that list a block: ceil(n / P), or n // P with shared
        tails."""
        n = self.row_tokens[rows]
        return n // self.block_size if self.tails is not None else ceil_div(n, self.block_size)

    def set_row_tokens(self, rows: torch.Tensor | slice, counts: torch.Tensor | None) -> None:
        """Rows (distinct int64 ids of held sequences) now hold `counts` tokens: the one place
        row_tokens changes, with open_rows and count_blocks (module docstring) following it. The
        caller has taken or returned the blocks. rows may be the slice of one sequence's L * E rows
        and counts None (`free`): they hold nothing, and its slot's tables are zeroed at once, not
        counted row by row (add_sequence sets them again for the slot's next sequence)."""
        if isinstance(rows, slice):
            if counts is not None or (rows.stop - rows.start) != self.rows_per_seq:
                raise ValueError("a slice of rows is one sequence's rows, emptied: counts=None")
            index = rows.start // self.rows_per_seq
            self.row_tokens[rows] = 0
            self.open_rows[index] = 0
            self.open_per_device[index] = 0
            self.count_blocks[index] = 0
            return
        old = self.row_tokens[rows]  # (m,)
        crossing = self._crossing(old, counts)
        self._count_rows(rows, old, counts, crossing, self.row_device[rows[crossing]])

    def _crossing(self, old: torch.Tensor, new: torch.Tensor, one_each: bool = False) -> torch.Tensor:
        """(c,) the indices i where a row going from old[i] to new[i] tokens may change its block
        count or whether its next token opens a block: where the range between them reaches a
        multiple of P (a superset: a few rows that change neither are counted with 0). A decode
        step moves each row by one token, so about 2 rows in P; the rest only change row_tokens,
        and the slot tables are updated over these few (a step of the simulator moves tens of
        thousands of rows). one_each: new = old + 1, where that is old % P in {P - 1, 0}: new % P
        is 0 or 1."""
        if one_each:
            return (new & (self.block_size - 1)).le_(1).nonzero().squeeze(1)
        shift = self.block_size.bit_length() - 1  # P is a power of two
        low = torch.minimum(old, new)
        high = torch.maximum(old, new)
        return ((low - 1) >> shift).ne_(high >> shift).nonzero().squeeze(1)

    def _count_rows(self, rows: torch.Tensor, old: torch.Tensor, new: torch.Tensor, crossing, device) -> None:
        """set_row_tokens with old = row_tokens[rows] read, crossing = _crossing(old, new) and
        device = row_device[rows[crossing]] (allocate_slots has them already)."""
        P = self.block_size
        L = self.num_layers
        E = self.num_experts
        D = self.num_devices
        self.row_tokens.index_copy_(0, rows, new)
        rows = rows[crossing]
        old = old[crossing]
        new = new[crossing]
        where = (rows // E) * D + device  # (slot * L + layer) * D + device
        opened = ((new & (P - 1)) == 0).to(torch.int32) - ((old & (P - 1)) == 0).to(torch.int32)
        self.open_rows.view(-1).index_add_(0, where, opened)
        slot_device = (rows // (L * E)) * D + device
        self.open_per_device.view(-1).index_add_(0, slot_device, opened.to(torch.int64))
        grown = ceil_div(new, P) - ceil_div(old, P)  # (c,)
        self.count_blocks.view(-1).index_add_(0, slot_device, grown)

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
        if self.budget is not None:
            self.budget.clear_rows(rows)

    # ----- the other writers' operations: what paged.py, the prefix cache, shared tails, the swap
    # space and the scheduler change here, each through one of these -----------------------------
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
        and copies, shared tails' promoted blocks). The caller counts the rows' tokens."""
        if columns.numel() and int(columns.max()) >= self.block_tables.shape[1]:
            self._grow_tables(int(columns.max()) + 1)
        self.block_tables[rows, columns] = block_ids.to(torch.int32)

    def start_from_blocks(
        self,
        seq_id: int,
        row_counts: torch.Tensor,
        shared_rows: torch.Tensor,
        shared_columns: torch.Tensor,
        shared_blocks: torch.Tensor,
        copied_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A new sequence whose rows (indexed 0..L*E-1) hold row_counts tokens from the start: the
        blocks shared_blocks[i] listed at column shared_columns[i] of row shared_rows[i], and one
        fresh block (a copy's destination, on its row's device) at the last column of each
        copied_rows row. Returns the sequence's rows (L*E,) and the fresh blocks; OutOfBlocksError,
        changing nothing, when a device is short of them (a prefix hit: prefix_cache.py)."""
        one_each = torch.ones_like(copied_rows)
        index = self.add_sequence(seq_id)
        rows = self.index.sequence_rows(torch.tensor([index]))[0]  # (L*E,)
        try:
            copied = rows[copied_rows]
            fresh = self._take_blocks(copied, self.row_device[copied], one_each, one_each, one_each.numel())
        except OutOfBlocksError:
            self.free(seq_id)
            raise
        self.place_blocks(rows[shared_rows], shared_columns, shared_blocks)
        self.place_blocks(rows[copied_rows], row_counts[copied_rows] // self.block_size, fresh)
        self.set_row_tokens(rows, row_counts)
        return rows, fresh

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
            self.allocate_slots(rows, token_counts, rows_are_distinct=True, with_slots=False)
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

    def blocks_of_sequence(self, seq_id: int, by_device: bool = False) -> torch.Tensor:
        """Every block the sequence owns, row by row in token order, then its tail blocks: what a
        swap to a CPU pool copies, and what `free` returns. by_device=True: its rows device after
        device (the blocks grouped by device, as the pool pushes them when freed)."""
        index = self.seq_index(seq_id)
        order = self._rows_by_device if by_device else torch.arange(self.rows_per_seq)
        rows = order + index * self.rows_per_seq  # (L * E,) its rows
        tail_blocks = [] if self.tails is None else self.tails.blocks_of_sequence(index)
        # each row's used entries only (a row of the simulator's lists a few of its table's columns)
        owner, column = ragged_arange(self.num_used_columns(rows))  # (b,) each
        width = self.block_tables.shape[1]
        return torch.cat(
            [
                self.block_tables.view(-1)[rows[owner] * width + column].to(torch.int64),
                torch.tensor(tail_blocks, dtype=torch.int64),
            ]
        )

    def num_blocks_of_sequence(self, seq_id: int) -> int:
        """blocks_of_sequence(seq_id).numel(), from count_blocks where no tail blocks exist."""
        if self.tails is not None:
            return int(self.blocks_of_sequence(seq_id).numel())
        return int(self.count_blocks[self.seq_index(seq_id)].sum())

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

    def block_owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For drawing the pool: owner_row (N,) (-1: free) and used_slots (N,) of each block."""
        P = self.block_size
        row, column = self.used_columns().nonzero(as_tuple=True)
        blocks = self.block_tables[row, column].to(torch.int64)
        owner_row = torch.full((self.num_blocks,), -1, dtype=torch.int64)
        used_slots = torch.zeros(self.num_blocks, dtype=torch.int64)
        owner_row[blocks] = row
        used_slots[blocks] = (self.row_tokens[row] - column * P).clamp(max=P)
        return owner_row, used_slots

    # ----- allocate / slots / free ----------------------------------------------------------------
    def allocate_slots(
        self,
        rows: torch.Tensor,
        num_new_tokens: torch.Tensor,
        rows_are_distinct: bool = False,
        with_slots: bool = True,
        one_each: bool = False,
    ) -> SlotAllocation:
        """Make room for num_new_tokens[i] more tokens in the distinct rows[i], rows of sequences the
        cache holds, and count them as stored. Raises ValueError for bad rows or counts, and
        OutOfBlocksError when the pool is short (a scheduler asks `can_allocate` first), changing
        nothing. rows_are_distinct=True skips the distinctness check (a sort); with_slots=False skips
        the slots, which would cost the cache-only simulator (no K/V to write) as much as
        allocating; one_each=True skips every check: the caller's rows are distinct int64 rows of
        held sequences taking one token each (a decode append)."""
        P = self.block_size
        fewest = 1
        if not one_each:
            rows, num_new_tokens, fewest, most = self._check_allocation(
                rows, num_new_tokens, rows_are_distinct
            )
            one_each = fewest == most == 1
        if self.tails is not None:
            return self.tails.allocate_slots(rows, num_new_tokens, with_slots)
        if rows.numel() == 0:
            return SlotAllocation(torch.zeros(0, dtype=torch.int64))
        old = self.row_tokens.index_select(0, rows)  # (m,)
        new = old + num_new_tokens
        # only the rows whose range reaches a block boundary can take a block (with one token each,
        # 1 in P): the blocks and the slot tables are worked out over those
        crossing = self._crossing(old, new, one_each)  # (c,)
        growing = rows[crossing]
        device = self.row_device.index_select(0, growing)  # (c,)
        held = ceil_div(old[crossing], P)  # (c,) blocks each holds: its first new block's column
        needed = ceil_div(new[crossing], P) - held  # (c,)
        block_ids = self._take_blocks(growing, device, needed, num_new_tokens, rows.numel())  # may raise
        if block_ids.numel():  # a decode step takes none P - 1 of P times
            # the k-th new block of row i: column ceil(old[i] / P) + k
            owner, k = ragged_arange(needed)  # (total,) each
            owner_rows = growing[owner]
            block_column = k + held[owner]
            widest = int(block_column.max()) + 1
            if widest > self.block_tables.shape[1]:
                self._grow_tables(widest)
            width = self.block_tables.shape[1]
            self.block_tables.view(-1).index_copy_(
                0, owner_rows * width + block_column, block_ids.to(torch.int32)
            )
        self._count_rows(rows, old, new, crossing, device)
        appended_rows = rows if one_each or fewest > 0 else rows[num_new_tokens > 0]
        self.last_appended.index_fill_(0, appended_rows, self.clock)
        if not with_slots:
            return SlotAllocation(None)
        if one_each:  # the new token goes to column old // P, offset old % P: block * P + offset
            return SlotAllocation((old % P).add_(self.block_tables[rows, old // P], alpha=P))
        return SlotAllocation(self.slots(rows, old, num_new_tokens))

    def allocate_within_budget(
        self, rows: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One newcomer for each of the distinct rows (a manager with a budget): the budget's policy
        says where each goes (budget.py); a row below its budget appends it (which may take a block,
        OutOfBlocksError changing nothing), a full row gives it the victim's slot, or refuses it.
        Returns the accepted newcomers' slots (a,) and accepted (m,) bool."""
        index = self.budget.choose(rows, positions, scores)  # (m,) -1: refused
        accepted = index >= 0
        taken, slot_index = rows[accepted], index[accepted]  # (a,) each
        appending = slot_index == self.row_tokens[taken]  # (a,) below budget
        self.allocate_slots(
            taken[appending],
            torch.ones(int(appending.sum()), dtype=torch.int64),
            rows_are_distinct=True,
            with_slots=False,
        )
        self.budget.record(rows, index, positions, scores)
        self.last_position[taken] = positions[accepted]
        self.last_appended[taken] = self.clock
        return self.slot_of(taken, slot_index), accepted

    def _take_blocks(
        self,
        rows: torch.Tensor,
        device: torch.Tensor,
        needed: torch.Tensor,
        num_new_tokens: torch.Tensor,
        num_rows: int,
    ) -> torch.Tensor:
        """needed[i] fresh blocks for rows[i], from its device device[i] (row_device[rows], which
        the caller has), row after row; raises OutOfBlocksError, changing nothing, when short
        (naming the num_new_tokens appended to num_rows rows)."""
        if self.num_devices == 1:
            total = int(needed.sum())
            if total == 0:
                return _NO_BLOCKS
            if total > self.pool.num_free_blocks:
                self.raise_short(torch.tensor([total]), num_rows, num_new_tokens)
            block_ids = self.pool.allocate(total)
        else:
            needed = needed.to(torch.int64)
            per_device = self._sum_needed_per_device(device, needed, num_rows, num_new_tokens)  # (D,)
            block_device = torch.repeat_interleave(device, needed)  # (total,)
            block_ids = torch.empty(block_device.numel(), dtype=torch.int64)
            # device after device, each device's in row order
            block_ids[stable_order(block_device)] = self.pool.allocate_per_device(per_device)
        if self.prefix_cache is not None:  # their slots hold no position yet
            self.prefix_cache.clear_positions(block_ids)
        return block_ids

    def _sum_needed_per_device(
        self, device: torch.Tensor, needed: torch.Tensor, num_rows: int, num_new_tokens: torch.Tensor
    ) -> torch.Tensor:
        """(D,) the needed[i] (int64) blocks of rows on device[i], summed per device;
        OutOfBlocksError (raise_short), changing nothing, where a device has fewer free."""
        per_device = torch.zeros(self.num_devices, dtype=torch.int64)
        per_device.index_add_(0, device, needed)  # (D,)
        self.raise_short(per_device, num_rows, num_new_tokens)
        return per_device

    def raise_short(self, needed: torch.Tensor, num_rows: int, num_new_tokens) -> None:
        """OutOfBlocksError naming the pool (or first device) short of the needed (D,) blocks."""
        free = self.num_free_blocks_per_device  # (D,)
        if bool((needed <= free).all()):
            return
        short = (needed > free).nonzero().squeeze(1)
        tokens, d = int(num_new_tokens.sum()), int(short[0])
        shortfall = torch.clamp(needed - free, min=0)  # (D,)
        if self.num_devices == 1:
            raise OutOfBlocksError(
                f"appending {tokens} tokens to {num_rows} rows needs "
                f"{int(needed[0])} blocks; {int(free[0])} are free",
                shortfall,
            )
        raise OutOfBlocksError(
            f"device {d} is short: appending {tokens} tokens needs "
            f"{int(needed[d])} blocks there, {int(free[d])} of "
            f"{int(self.blocks_per_device[d])} are free",
            shortfall,
        )

    def _check_allocation(self, rows, num_new_tokens, rows_are_distinct: bool):
        rows = check_ids(rows, "rows")
        num_new_tokens = check_ids(num_new_tokens, "num_new_tokens")
        if rows.shape != num_new_tokens.shape or rows.dim() != 1:
            raise ValueError(
                f"rows and num_new_tokens must be 1-D of equal length, got "
                f"{tuple(rows.shape)} and {tuple(num_new_tokens.shape)}"
            )
        fewest, most = (int(t) for t in torch.aminmax(num_new_tokens)) if num_new_tokens.numel() else (0, 0)
        if fewest < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {fewest}")
        if not rows_are_distinct and rows.unique().numel() != rows.numel():
            raise ValueError("rows must be distinct within one allocate_slots call")
        self._check_rows_held(rows, "allocate_slots")
        return rows, num_new_tokens, fewest, most

    def _check_rows_held(self, rows: torch.Tensor, call: str) -> None:
        """ValueError unless every row id (int64, 1-D) is a row of a sequence the cache holds: a few
        tensor operations, whatever the number of rows."""
        if rows.numel() == 0:
            return
        bounds = torch.aminmax(rows)
        lowest = int(bounds.min)
        highest = int(bounds.max)
        in_range = lowest >= 0 and highest < self.row_tokens.numel()
        if in_range and bool(self.slot_held[rows // self.rows_per_seq].all()):
            return
        if in_range:
            bad = int(rows[~self.slot_held[rows // self.rows_per_seq]][0])
        else:
            bad = lowest if lowest < 0 else highest
        raise ValueError(
            f"{call}: rows {rows.tolist()[:8]} are not all rows of sequences the cache holds (row {bad} "
            "is not); allowed: rows of held sequences (add_sequence first, then rows(seq_ids, layer, experts))"
        )

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
        """The slot of token `token` of row `row`, elementwise (or SharedTails.slot_of's)."""
        if self.tails is not None:
            return self.tails.slot_of(row, token)
        P = self.block_size
        return (token % P).add_(self.block_tables[row, token // P], alpha=P)  # offset + P * block

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence to the pool and forget it; KeyError, changing
        nothing, for a sequence the cache does not hold."""
        index = self.seq_index(seq_id)  # KeyError before any change
        self._return_sequence_blocks(seq_id, index)
        rows = slice(index * self.rows_per_seq, (index + 1) * self.rows_per_seq)  # its L * E rows
        if self.tails is not None:
            self.tails.free(index, rows)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_sequence(seq_id)
        self._clear_rows(rows)
        del self._seq_index[int(seq_id)]
        self.slot_held[index] = False
        self._free_seq_indices.append(index)

    def _return_sequence_blocks(self, seq_id: int, index: int) -> None:
        """Every block of the sequence (held in slot `index`) back to the pool, its rows not yet
        emptied (`free`)."""
        blocks = self.blocks_of_sequence(seq_id, by_device=True)
        self.pool.free(blocks, distinct=True)  # a sequence owns a block once

    def free_rows(self, rows) -> int:
        """Empty some rows of held sequences (an eviction of single rows: the sequences stay, but
        cannot attend over them until rebuilt); returns how many blocks went back to the pool."""
        if self.tails is not None:
            # rows' tails live outside the block tables: they would have to be compacted too
            raise NotImplementedError("a manager with shared tails does not free single rows")
        rows = check_ids(rows, "rows").reshape(-1)
        if rows.unique().numel() != rows.numel():
            raise ValueError("rows must be distinct within one free_rows call")
        self._check_rows_held(rows, "free_rows")
        num_freed = self._return_row_blocks(rows)
        self._clear_rows(rows)
        return num_freed

    def _return_row_blocks(self, rows: torch.Tensor) -> int:
        """The blocks of the rows (distinct, checked) back to the pool, the rows not yet emptied
        (`free_rows`); returns how many."""
        blocks = self.block_tables[rows][self.used_columns(rows)].to(torch.int64)
        self.pool.free(blocks)
        return blocks.numel()

    @torch.inference_mode(False)  # tables kept across steps: never inference tensors
    def _grow_rows(self) -> None:
        """Double the sequence slots (bookkeeping only; the pool never grows)."""
        num_seqs = self.row_tokens.numel() // self.rows_per_seq
        extra = num_seqs * self.rows_per_seq
        for name, fill in (
            ("row_tokens", 0),
            ("row_device", 0),
            ("last_position", -1),
            ("last_appended", -1),
            ("block_tables", self.pad),
        ):
            old = getattr(self, name)
            new = torch.full((extra, *old.shape[1:]), fill, dtype=old.dtype)
            setattr(self, name, torch.cat([old, new]))
        for name in ("open_rows", "open_per_device", "count_blocks", "slot_held"):  # over slots
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.zeros_like(old)]))
        self._free_seq_indices = list(range(2 * num_seqs - 1, num_seqs - 1, -1)) + self._free_seq_indices
        for part in (self.tails, self.budget):
            if part is not None:
                part.grow_rows(self.row_tokens.numel())

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
        """The invariants of the module docstring; AssertionError names the broken one."""
        self.pool.assert_consistent()
        self._assert_counts_consistent()
        self._assert_blocks_consistent()

    def _assert_blocks_consistent(self) -> None:
        """The invariants over block ids: each row's used table entries list blocks of its device,
        the rest padding; a block owned once (shared through a prefix cache); ref_cnt its owners."""
        used = self.used_columns()  # (R, W)
        owned = self.block_tables[used].to(torch.int64)
        assert (owned < self.num_blocks).all(), "a row's used table entry is padding"
        # every used entry is a block, so tables with as many set entries as used ones have the
        # rest padding (one count over the tables, not a pass over the unused entries)
        assert int(torch.count_nonzero(self.block_tables != self.pad)) == owned.numel(), (
            "a table entry past a row's blocks is set"
        )
        assert torch.equal(self.pool.device_of_blocks(owned), self.device_of_rows(used.nonzero()[:, 0])), (
            "a row holds a block of another device than its own"
        )
        if self.tails is not None:
            owned = torch.cat([owned, self.tails.blocks()])
        distinct = owned.unique()
        assert self.prefix_cache is not None or distinct.numel() == owned.numel(), (
            "a block is owned by two rows (or twice)"
        )
        owners = torch.bincount(owned, minlength=self.num_blocks)
        assert torch.equal(owners.to(torch.int32), self.pool.ref_cnt), "ref_cnt != number of owners"
        assert distinct.numel() + self.pool.num_free_blocks == self.num_blocks, "free + owned != total"

    def _assert_counts_consistent(self) -> None:
        """The invariants over counts: slots held, row_tokens and the tables that follow it."""
        live = torch.zeros(self.row_tokens.numel() // self.rows_per_seq, dtype=torch.bool)
        live[list(self._seq_index.values())] = True
        assert torch.equal(self.slot_held, live), "slot_held does not follow the sequences held"
        idle_rows = (~live).repeat_interleave(self.rows_per_seq)
        assert (self.row_tokens[idle_rows] == 0).all(), "a free sequence slot holds tokens"
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
        for part in (self.tails, self.prefix_cache, self.budget):
            if part is not None:
                part.assert_consistent()
