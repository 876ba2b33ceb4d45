"""Prefix caching over per-expert KV caches: a new request reuses the full blocks an earlier request
with the same first tokens left in its (layer, expert) rows. Notebook 06 tells the why at length.

Routing is causal, so equal prefixes hold equal entries in every row; but rows fill at different
rates and a request may skip tokens 0..s-1 only if *every* row's entries below s are there. So the
cache keeps *chunk records*: under the hash-chain key of each prefix of whole chunks of C = P
tokens, how many of the last chunk's tokens went to each of the L * E rows; a request's first i
records give, row by row, its entries below s = i * C.

    chunk keys   key_i = blake2b(key_{i-1} || tokens[i*C:(i+1)*C])      (16 bytes; key_-1 = b"")
    block keys   (device, layer * E + expert, j, key_m)  for the j-th block of a row, registered
                 under every complete chunk m it spans: a full block from its first entry's chunk
                 to its last entry's; a row's partly filled last block from its first entry's chunk
                 on (its entries below a complete chunk's end are final: later tokens come later)

Looking up s = i * C, row r with c_r = cum_counts[i-1, r] entries below s needs blocks
0 .. ceil(c_r / P) - 1: block j with (j + 1) * P <= c_r, found under the chunk of its last entry,
is *shared* (one more owner); the block j = c_r // P straddling s (c_r % P > 0), found under
key_{i-1}, is *copied* (copy-on-write) into a fresh block whose first c_r % P slots the request
keeps. A key matches only if the producer's first (m + 1) * C tokens equal the request's, so by
causality the entries needed are the request's own; keys hash the token bytes (never Python's
salted `hash`). Copying costs at most L * E blocks per request, where lowering s until no row
straddles would usually reach 0. A partial block is never shared (its producer keeps appending) but
may be a copy source: otherwise a rarely chosen expert with fewer than P entries would cap every
hit. s is the largest multiple of C whose blocks are all found (validity is monotone in s), at most
len(tokens) - 1: the last token always runs.

A block lies on its row's device, so the device is part of the block key (sequences of different
home devices never share a block); chunk records do not depend on devices. This relies on a
deterministic forward (true of the CPU forward, which the tests check; a GPU kernel would have to
be batch-invariant). Cached blocks outlive their sequences as cached-free blocks until reused or
evicted; chunk records are an LRU of bounded size (a missing record only shortens a hit).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..state import Stateful
from .block_pool import OutOfBlocksError
from .rows import ceil_div, ragged_arange

DIGEST_BYTES = 16


def chain_keys(token_ids, chunk_size: int, previous: bytes = b"") -> list[bytes]:
    """The chain keys of the complete chunks of `token_ids`; previous: the key before the first."""
    keys = []
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        digest = hashlib.blake2b(previous, digest_size=DIGEST_BYTES)
        digest.update(array("q", token_ids[start : start + chunk_size]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclass
class PrefixHit:
    """Where a request may start, and the blocks that get it there."""

    num_tokens: int = 0  # the request starts at this position
    row_counts: torch.Tensor | None = None  # (L*E,) entries of each row below num_tokens
    # (b,) blocks shared as they are, at block table row (layer * E + expert) and column:
    shared: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    shared_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    shared_columns: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # (c,) blocks straddling num_tokens, copied into rows cow_rows at column row_counts // P:
    cow_source: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    cow_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # free blocks applying it takes: cached-free ones reused, copy sources pinned until copied, copies
    num_free_taken: int = 0
    free_taken_per_device: torch.Tensor | None = None  # the same, (D,) per device
    row_devices: torch.Tensor | None = None  # (L*E,) devices of the rows it applies to (only those)


@dataclass
class PrefixCacheStats(Stateful):
    STATE = ("num_lookups", "num_lookup_tokens", "num_hit_tokens", "num_shared_blocks", "num_cow_blocks")

    num_lookups: int = 0
    num_lookup_tokens: int = 0  # tokens of the requests looked up (prompt, or all so far)
    num_hit_tokens: int = 0  # tokens skipped (sum of s)
    num_shared_blocks: int = 0  # full blocks reused as they are
    num_cow_blocks: int = 0  # straddling blocks copied


class PrefixCache(Stateful):
    """The prefix index of one PrefixCachingKVCacheManager (prefix_caching_manager.py), which builds it
    and owns its blocks: full blocks outlive their sequences and are found again by prefix. It asks
    the manager for every change to a block (`mark_cached`, `uncache`, `reuse`, `release`).
    block_positions (N, P), the position of the token at each slot, tells which chunks a block
    spans. Invariants (`assert_consistent`): a block listed by several rows is full in each, at the
    same (layer, expert) and column; keys and cached blocks match one to one; ref_cnt == the rows
    listing a block."""

    STATE = ("block_positions", "_block_of_key", "_keys_of_block", "_chunk_counts", "_seq_state")
    PARTS = ("stats",)

    def __init__(self, manager):
        self.manager = manager
        self.chunk_size = manager.block_size
        num_blocks = manager.num_blocks
        self.block_positions = torch.full((num_blocks, manager.block_size), -1, dtype=torch.int64)  # (N, P)
        self._block_of_key: dict[tuple[int, int, int, bytes], int] = {}  # (device, row, column, key)
        self._keys_of_block: dict[int, list[tuple[int, int, int, bytes]]] = {}
        self._chunk_counts: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> (L*E,) int64
        self.max_chunk_records = max(64, num_blocks)
        # per held sequence: [chain keys, chunks recorded, full blocks registered per row (L*E,)]
        self._seq_state: dict[int, list] = {}
        self.stats = PrefixCacheStats()

    def record_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.block_positions.view(-1)[slots] = positions

    def restore_positions(self, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Blocks back from the swap space hold the positions (b, P) they held before."""
        self.block_positions[block_ids] = positions

    # ----- registration (after a step computed tokens) ----------------------------------------------
    def cache_computed_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Make the prefix whose K/V the cache holds findable; returns the blocks newly cached."""
        m = self.manager
        P = C = m.block_size
        index = m.seq_index(seq_id)
        width = m.block_tables.shape[1]
        state = self._seq_state.setdefault(int(seq_id), [[], 0, torch.full((m.rows_per_seq, width), -1)])
        keys, num_recorded, registered_through = state
        num_complete = len(token_ids) // C
        if num_complete == num_recorded:  # entries added since lie in the incomplete chunk
            return 0
        if num_complete > len(keys):
            keys += chain_keys(token_ids[len(keys) * C : num_complete * C], C, keys[-1] if keys else b"")
        rows = m.index.sequence_rows(torch.tensor([index]))[0]  # (R,)
        counts = m.row_tokens[rows]  # (R,)
        if num_complete > num_recorded:
            self._record_chunks(rows, keys, num_recorded, num_complete)
            state[1] = num_complete
        if registered_through.shape[1] < width:  # tables grew
            registered_through = torch.cat(
                [registered_through, torch.full((m.rows_per_seq, width - registered_through.shape[1]), -1)], 1
            )
        column = torch.arange(width)  # (W,)
        used = column < ceil_div(counts, P)[:, None]  # (R, W)
        full = column < (counts // P)[:, None]  # (R, W)
        blocks = torch.where(used, m.block_tables[rows].to(torch.int64), 0)  # (R, W)
        first_chunk = self.block_positions[blocks, 0] // C  # (R, W)
        last_chunk = torch.where(full, self.block_positions[blocks, P - 1] // C, num_complete - 1)
        through = torch.clamp(last_chunk, max=num_complete - 1)  # (R, W)
        todo = used & (through > registered_through) & (through >= first_chunk)
        device = m.row_device[rows].tolist()  # (R,)
        newly_cached = []
        orphans = []  # idle blocks whose every key went to a block in use
        for r, j in todo.nonzero().tolist():
            block = int(blocks[r, j])
            for c in range(
                max(int(first_chunk[r, j]), int(registered_through[r, j]) + 1), int(through[r, j]) + 1
            ):
                key = (device[r], r, j, keys[c])
                older = self._block_of_key.get(key)
                if older is not None and older != block and int(m.pool.ref_cnt[older]) == 0:
                    # the same prefix, recomputed (its hit did not fit): the block in use takes the
                    # key, or the key would leave with the idle one once it is evicted
                    self._keys_of_block[older].remove(key)
                    if not self._keys_of_block[older]:
                        del self._keys_of_block[older]
                        orphans.append(older)
                    older = None
                if older is None:
                    self._block_of_key[key] = block
                    self._keys_of_block.setdefault(block, []).append(key)
                    newly_cached.append(block)
        state[2] = torch.where(todo, through, registered_through)
        newly_cached = sorted(set(newly_cached))
        if newly_cached:
            m.mark_cached(torch.tensor(newly_cached, dtype=torch.int64))
        if orphans:
            m.uncache(torch.tensor(orphans, dtype=torch.int64))
        return len(newly_cached)

    def _record_chunks(self, rows, keys, first: int, end: int) -> None:
        C = self.chunk_size
        slots, valid = self.manager.padded_slots(rows)  # (R, Lmax)
        chunk = self.block_positions.view(-1)[slots] // C  # (R, Lmax)
        keep = valid & (chunk >= first) & (chunk < end)
        row_of = torch.arange(rows.numel())[:, None].expand_as(chunk)  # (R, Lmax)
        per_chunk = torch.zeros(end - first, rows.numel(), dtype=torch.int64)  # (k, R)
        per_chunk.index_put_(
            (chunk[keep] - first, row_of[keep]),
            torch.ones(int(keep.sum()), dtype=torch.int64),
            accumulate=True,
        )
        for i in range(first, end):
            self._chunk_counts[keys[i]] = per_chunk[i - first].clone()
            self._chunk_counts.move_to_end(keys[i])
        while len(self._chunk_counts) > self.max_chunk_records:
            self._chunk_counts.popitem(last=False)

    def forget_blocks(self, blocks: list[int]) -> None:
        """Evicted cached-free blocks: their keys go with them."""
        for block in blocks:
            for key in self._keys_of_block.pop(block, []):
                del self._block_of_key[key]

    # ----- lookup ---------------------------------------------------------------------------------
    def row_devices(self, seq_id: int | None = None) -> torch.Tensor:
        """(L*E,) the device of each row of sequence seq_id, held or not."""
        m = self.manager
        if seq_id is None:
            if m.placement.follows_sequence:
                raise ValueError(
                    "a prefix lookup on a pool with home devices needs the sequence id "
                    "(find_cached_prefix(tokens, seq_id)): its rows' device is its home"
                )
            seq_id = 0  # rows follow their experts: every id gives the same
        return m.placement.of_sequences([seq_id])[0].reshape(-1)

    def find_cached_prefix(self, token_ids: list[int], seq_id: int | None = None) -> PrefixHit:
        """The longest usable cached prefix for sequence seq_id (PrefixHit() when none). Changes
        nothing but the LRU order of chunk records."""
        devices = self.row_devices(seq_id).tolist()  # (R,)
        C = self.chunk_size
        max_chunks = (len(token_ids) - 1) // C  # the last token always runs
        keys = chain_keys(token_ids[: max_chunks * C], C)
        counts = []
        for key in keys:
            record = self._chunk_counts.get(key)
            if record is None:
                break
            self._chunk_counts.move_to_end(key)
            counts.append(record)
        if not counts:
            return PrefixHit()
        cumulative = torch.stack(counts).cumsum(0)  # (I, R)
        # validity is monotone in i: bisect, trying the whole run of records (the common case) first
        low, high, best = 1, len(counts), None
        middle = high
        while low <= high:
            hit = self._hit_at(keys, cumulative, middle, devices)
            if hit is None:
                high = middle - 1
            else:
                best, low = hit, middle + 1
            middle = (low + high) // 2
        return best if best is not None else PrefixHit()

    def _hit_at(self, keys, cumulative, i: int, devices: list[int]) -> PrefixHit | None:
        """The hit for s = i * C, or None if some needed block is not cached on its row's device."""
        m, P = self.manager, self.manager.block_size
        s = i * self.chunk_size
        row_counts = cumulative[i - 1]  # (R,)
        num_full = row_counts // P  # (R,)
        # full blocks below s: (row, column) pairs and the chunk of each one's last entry
        shared_rows, shared_columns = ragged_arange(num_full)  # (f,) each
        last_entry = shared_columns * P + P - 1  # (f,)
        chunk = (cumulative[:i, shared_rows] <= last_entry[None, :]).sum(0)  # (f,)
        cow_rows = (row_counts % P > 0).nonzero().squeeze(1)  # (c,)
        # the (row, column, chunk key) each needed block is found under: shared ones, then copies
        wanted = [
            (r, j, keys[c]) for r, j, c in zip(shared_rows.tolist(), shared_columns.tolist(), chunk.tolist())
        ]
        wanted += [(r, j, keys[i - 1]) for r, j in zip(cow_rows.tolist(), num_full[cow_rows].tolist())]
        blocks = [self._block_of_key.get((devices[r], r, j, key)) for r, j, key in wanted]
        if None in blocks:
            return None
        shared_t = torch.tensor(blocks[: shared_rows.numel()], dtype=torch.int64)
        cow_t = torch.tensor(blocks[shared_rows.numel() :], dtype=torch.int64)
        # a block is shared only whole: its last slot written, below s (by causality it always is when
        # found under its last entry's chunk; checked all the same)
        last = self.block_positions[shared_t, P - 1]
        if ((last < 0) | (last >= s)).any():
            return None
        # free blocks the hit holds while it is applied: the cached-free blocks it reuses, shared or
        # copy sources (pinned so that the copies' allocation cannot evict them), and the copies
        found = torch.cat([shared_t, cow_t]).unique()
        taken = torch.cat([found[m.pool.ref_cnt[found] == 0], cow_t])  # reused idle blocks, copies
        per_device = torch.bincount(m.pool.device_of_blocks(taken), minlength=m.num_devices)  # (D,)
        return PrefixHit(
            s,
            row_counts.clone(),
            shared_t,
            shared_rows,
            shared_columns,
            cow_t,
            cow_rows,
            int(per_device.sum()),
            per_device,
            torch.tensor(devices, dtype=torch.int64),
        )

    def apply_prefix_hit(self, seq_id: int, hit: PrefixHit) -> tuple[torch.Tensor, torch.Tensor]:
        """Give a new sequence its rows from a hit; returns the copies' (source, destination)
        block ids, to copy before anything writes the destinations."""
        m = self.manager
        if hit.num_tokens == 0:
            raise ValueError("apply_prefix_hit of an empty hit: nothing to apply")
        if m.holds(seq_id):
            raise ValueError(f"sequence {seq_id} is already in the cache")
        found = torch.cat([hit.shared, hit.cow_source])
        if not m.pool.is_cached[found].all():
            raise ValueError("the hit lists blocks that are no longer cached: look up again")
        devices = self.row_devices(seq_id)  # (R,)
        if hit.row_devices is not None and not torch.equal(hit.row_devices, devices):
            raise ValueError(
                f"the hit was looked up for rows on other devices than sequence {seq_id}'s: "
                "look up with its id (find_cached_prefix(tokens, seq_id))"
            )
        rows_of = torch.cat([hit.shared_rows, hit.cow_rows])
        if not torch.equal(m.pool.device_of_blocks(found), devices[rows_of]):
            raise ValueError("the hit lists a block of another device than its row's: look up again")
        D = m.num_devices
        idle = found.unique()
        idle = idle[m.pool.ref_cnt[idle] == 0]
        available = m.num_free_blocks_per_device - torch.bincount(m.pool.device_of_blocks(idle), minlength=D)
        copies = torch.bincount(devices[hit.cow_rows], minlength=D)  # (D,)
        if (copies > available).any():
            d = int((copies > available).nonzero()[0])
            raise OutOfBlocksError(
                f"the hit's {int(copies[d])} copies on device {d} need blocks; "
                f"{int(available[d])} are free there beside the blocks it reuses"
            )
        m.reuse(hit.shared)
        m.reuse(hit.cow_source)  # pinned: the copies' allocation cannot evict them
        try:
            rows, destination = m.start_from_blocks(
                seq_id, hit.row_counts, hit.shared_rows, hit.shared_columns, hit.shared, hit.cow_rows
            )
        except OutOfBlocksError:
            m.release(hit.shared)  # its reuse undone: as before the call
            raise
        finally:
            m.release(hit.cow_source)
        self.block_positions[destination] = self.block_positions[hit.cow_source]
        held = (hit.row_counts > 0).nonzero().squeeze(1)  # (h,)
        last_slot = m.slot_of(rows[held], hit.row_counts[held] - 1)  # (h,)
        m.note_positions(rows[held], self.block_positions.view(-1)[last_slot])
        self.stats.num_hit_tokens += hit.num_tokens
        self.stats.num_shared_blocks += hit.shared.numel()
        self.stats.num_cow_blocks += hit.cow_source.numel()
        return hit.cow_source.clone(), destination

    # ----- what a scheduler asks -------------------------------------------------------------------
    def hit_for(self, token_ids: list[int], seq_id: int | None = None) -> PrefixHit | None:
        """What a new sequence with these tokens would start from, or None."""
        hit = self.find_cached_prefix(token_ids, seq_id)
        return hit if hit.num_tokens else None

    def start_sequence(self, seq_id: int, num_tokens: int, hit: PrefixHit | None):
        """A looked-up sequence starts from `hit` (returning its copies) or from nothing (None)."""
        self.stats.num_lookups += 1
        self.stats.num_lookup_tokens += int(num_tokens)
        return None if hit is None else self.apply_prefix_hit(seq_id, hit)

    def forget_sequence(self, seq_id: int) -> None:
        self._seq_state.pop(int(seq_id), None)  # its blocks stay findable until evicted

    num_cached_blocks = property(lambda self: len(self._keys_of_block))

    def assert_consistent(self) -> None:
        """The class docstring's invariants, after the manager checked ref_cnt."""
        m, P = self.manager, self.manager.block_size
        row, column = m.used_columns().nonzero(as_tuple=True)
        owned = m.block_tables[row, column].to(torch.int64)
        shared = torch.bincount(owned, minlength=m.num_blocks)[owned] > 1
        full = m.row_tokens[row] >= (column + 1) * P
        assert full[shared].all(), "a partly filled block is shared (copy-on-write broken)"
        where = (row % m.rows_per_seq) * m.block_tables.shape[1] + column  # (r_le, column)
        first = torch.full((m.num_blocks,), -1, dtype=torch.int64).scatter_(0, owned, where)
        assert (first[owned] == where).all(), "a block is listed at two different (layer, expert, column)"
        for key, block in self._block_of_key.items():
            assert key in self._keys_of_block.get(block, []), f"key of block {block} missing from its list"
        if self._block_of_key:
            key_device = torch.tensor([key[0] for key in self._block_of_key])
            blocks = torch.tensor(list(self._block_of_key.values()))
            assert torch.equal(m.pool.device_of_blocks(blocks), key_device), (
                "a block is keyed under another device"
            )
        assert sum(map(len, self._keys_of_block.values())) == len(self._block_of_key), "stale block keys"
        cached = torch.zeros(m.num_blocks, dtype=torch.bool)
        cached[list(self._keys_of_block)] = True
        assert torch.equal(cached, m.pool.is_cached), "pool's cached marks != blocks with keys"
