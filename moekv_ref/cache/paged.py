"""The paged per-expert KV cache: one pool of K/V blocks for every (sequence, layer, expert) row.

`append_kv` (bookkeeping and store) and `attend` (the math only) are the contract of cache/__init__.py
(docs/design.md tells why). This is the plain path; each variant is a subclass in its own file, and
factory.py picks the class for a model (cache/__init__.py lists them).

Memory layout (the Triton kernels read exactly this): key_cache and value_cache (N, P, Hkv, Dh), one
pool for all layers and experts in the model dtype; block_tables (num_rows, W) int32 and context_lens
(num_rows,) int32 from the KVCacheManager; slot = block_id * P + offset into key_cache.view(-1, Hkv, Dh).

A sequence's tokens reach a row in position order (the model keeps token order within each
expert), so the query at row index i sees keys 0..i; `append_kv` checks that positions increase
from the row's last cached one, so a caller that breaks this gets an error, not a wrong mask.

Attention paths (all equal to rounding; tests): "reference" calls `attend_by_position` row by row,
as every cache does (slow and clear); "batched" pads rows to the longest and runs one fused
scaled_dot_product_attention, decode and prefill rows apart so that a decode row is never padded to
a prompt's length; "triton" runs decode rows on moekv_kernels.paged_attention and stores K/V with
moekv_kernels.store_kv. Padding gathers a real block (or slot 0) whose K/V are zeroed before any product,
so whatever it holds (a GPU's uninitialised memory can hold NaN) cannot reach another row's output.

Dimensions: N blocks, P block size, H heads, Hkv key/value heads, Dh head width, n (token, expert)
pairs of the call, m distinct rows of the call, Lmax longest row, Qmax most new tokens of one row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import attend_by_position, score_dtype
from ..config import ModelConfig
from .block_pool import OutOfBlocksError
from .cache_options import (
    CACHE_SETTINGS,
    CacheOptions,
    check_cache_options,
    check_given_options,
    new_manager,
    settings_for_model,
    triton_kernels,
)
from .kv_cache_manager import KVCacheManager


@dataclass
class AppendedRows:
    """What `append_kv` hands to `attend` (all int64)."""

    rows: torch.Tensor  # (m,) the call's distinct rows: ascending, or in pair order when
    #      every pair is its own row (a decode step)
    num_new: torch.Tensor  # (m,) pairs of this call in each row
    context_lens: torch.Tensor  # (m,) tokens each row holds after the append
    pair_row: torch.Tensor  # (n,) each pair's row, as an index into `rows`
    pair_index: torch.Tensor  # (n,) index of the pair's token in its row: it sees 0..pair_index
    slots: torch.Tensor | None = None  # (n,) each pair's slot, where its K/V were written


class PagedKVCache:
    """append_kv / attend over a paged block pool shared by every (sequence, layer, expert).

    PagedKVCache(config, num_blocks, block_size, **settings): settings are cache_options.py's
    CACHE_SETTINGS (dtype, device, attention, shuffle_seed, and per-device pools: blocks_per_device
    with device_of_expert or home_devices), made into a CacheOptions there; or `options=` one made
    by this class's check_options. A variant builds its own manager (`make_manager`) and makes its
    own options (`check_options`)."""

    SETTINGS = CACHE_SETTINGS  # the keywords beside config, num_blocks and block_size

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int | None = None,
        block_size: int = 16,
        options: CacheOptions | None = None,
        **settings,
    ):
        if options is None:
            options = self.check_options(config, num_blocks, block_size, **settings)
        else:
            check_given_options(options, type(self).__name__, num_blocks, settings)
        self.config = config
        self.options = options
        self.attention = options.attention
        self.manager = self.make_manager(config, options)
        shape = (options.num_blocks, options.block_size, config.num_key_value_heads, config.head_dim)
        self.key_cache = torch.zeros(shape, dtype=options.dtype, device=options.device)  # (N, P, Hkv, Dh)
        self.value_cache = torch.zeros(shape, dtype=options.dtype, device=options.device)
        self._kernels = triton_kernels(self.attention)  # moekv_kernels for "triton", else None

    block_size = property(lambda self: self.manager.block_size)

    @classmethod
    def check_options(
        cls, config, num_blocks=None, block_size=16, max_num_seqs=None, **settings
    ) -> CacheOptions:
        """The CacheOptions a cache of this class takes (cache_options.check_cache_options); a
        variant adds its own settings (a row cap) and refusals (shared-tail rows: no "triton")."""
        return check_cache_options(config, num_blocks, block_size, max_num_seqs, settings, cls.__name__)

    def make_manager(self, config: ModelConfig, options: CacheOptions) -> KVCacheManager:
        """The manager of this cache's rows (a variant builds its own kind)."""
        return new_manager(config, options)

    @classmethod
    def for_model(
        cls, model, block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 8, **settings
    ):
        """A cache in the model's dtype and device; attention=None (or left out) follows the model's
        backend. Without num_blocks, the pool holds max_num_seqs sequences of
        max_position_embeddings tokens at their worst (rows.worst_case_lifetime_blocks). The plain
        class is exact whatever the model's attention_capacity: every routed token stays in its row
        (make_paged_cache gives such a model the capped class)."""
        settings = settings_for_model(model, f"{cls.__name__}.for_model", settings, cls.SETTINGS)
        options = cls.check_options(model.config, num_blocks, block_size, max_num_seqs, **settings)
        return cls(model.config, options=options)

    # ----- verb 1: bookkeeping and store ----------------------------------------------------------
    def _check_pairs(self, seq_ids, experts, positions, k, v):
        """append_kv's arguments of shape: ValueError unless k, v are (n, Hkv, Dh) and seq_ids,
        experts, positions n integers each, which it returns as (n,) int64 CPU tensors."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        n = k.shape[0]
        if k.shape != (n, Hkv, Dh) or v.shape != k.shape:
            raise ValueError(f"k and v must be (n, {Hkv}, {Dh}); got {tuple(k.shape)}, {tuple(v.shape)}")
        seq_ids, experts, positions = (
            torch.as_tensor(t, dtype=torch.int64).cpu().reshape(-1) for t in (seq_ids, experts, positions)
        )
        if not seq_ids.shape == experts.shape == positions.shape == (n,):
            raise ValueError(
                f"seq_ids, experts and positions must be (n,) = ({n},); got "
                f"{tuple(seq_ids.shape)}, {tuple(experts.shape)}, {tuple(positions.shape)}"
            )
        return seq_ids, experts, positions

    def append_kv(self, layer: int, seq_ids, experts, positions, k, v, scores=None) -> AppendedRows:
        """Raises ValueError (bad shapes or order) or OutOfBlocksError (pool short) before anything
        is stored or allocated. scores (n,): each pair's router probability, which the model hands
        every cache and this one does not read."""
        seq_ids, experts, positions = self._check_pairs(seq_ids, experts, positions, k, v)
        manager, n = self.manager, k.shape[0]
        new_seqs = sorted(set(seq_ids.tolist()).difference(manager.sequences))  # ascending
        for s in new_seqs:
            manager.add_sequence(s)
        try:
            pair_rows = manager.rows(seq_ids, layer, experts)  # (n,)
            # decode: each pair the one new token of its own row, in pair order (a set tells it faster than a sort)
            if len(set(pair_rows.tolist())) == n:
                rows, pair_row, num_new = pair_rows, torch.arange(n), torch.ones(n, dtype=torch.int64)
                order, first = None, None
                self._check_positions(rows, positions, rows, None)
            else:  # the call's rows ascending, each pair's row among them, each row's number of pairs
                rows, pair_row, num_new = torch.unique(pair_rows, return_inverse=True, return_counts=True)
                order = torch.argsort(pair_rows, stable=True)  # (n,) grouped by row
                first = torch.cumsum(num_new, 0) - num_new  # (m,) into order
                self._check_positions(pair_rows[order], positions[order], rows, first)
            allocation = manager.allocate_slots(rows, num_new)
        except Exception as error:
            for s in new_seqs:  # as it was
                manager.free(s)
            if isinstance(error, OutOfBlocksError):  # which layer ran short
                raise OutOfBlocksError(str(error), error.shortfall, layer) from error
            raise
        self.copy_slots(allocation.moves)
        slots, last = allocation.slot_mapping, positions  # row after row: pair order in a decode
        if order is not None:  # (n,) per pair; each row's last position
            slots = torch.empty(n, dtype=torch.int64).index_copy_(0, order, allocation.slot_mapping)
            last = positions[order][first + num_new - 1]
        manager.note_positions(rows, last)
        self._store(k, v, slots)
        context_lens = manager.row_tokens[rows]  # (m,)
        if order is None:  # pair i is row i
            return AppendedRows(rows, num_new, context_lens, pair_row, context_lens - 1, slots)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n) - first[pair_row[order]]  # (n,) in the call
        pair_index = context_lens[pair_row] - num_new[pair_row] + rank
        return AppendedRows(rows, num_new, context_lens, pair_row, pair_index, slots)

    def _check_positions(self, sorted_rows, sorted_positions, rows, first) -> None:
        """Positions must increase within each row, from its last cached one. first (m,): each row's
        first pair in the sorted order; None when every pair is its own row."""
        last = self.manager.last_position[rows]  # (m,) -1: empty
        if first is None:
            bad, bad_first = None, sorted_positions <= last
        else:
            later = sorted_rows[1:] == sorted_rows[:-1]  # same row as before
            bad = later & (sorted_positions[1:] <= sorted_positions[:-1])
            bad_first = sorted_positions[first] <= last
        if bad_first.any() or (bad is not None and bad.any()):
            i = int(bad_first.nonzero()[0]) if bad_first.any() else None
            row = int(rows[i]) if i is not None else int(sorted_rows[1:][bad][0])
            mine = sorted_positions[sorted_rows == row].tolist()
            cached = int(self.manager.last_position[row])
            raise ValueError(
                f"row {row}: positions {mine[:8]} do not increase from the cached ones (last "
                f"{None if cached < 0 else cached}): a sequence's tokens must arrive in order"
            )

    def copy_slots(self, moves) -> None:
        """Copy K/V between slots, in order, as an allocation asks before its new tokens are written
        (SlotAllocation.moves: none for plain pages)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        for source, destination in moves:
            for cache in (self.key_cache, self.value_cache):
                flat = cache.view(-1, Hkv, Dh)
                flat[destination.to(cache.device)] = flat[source.to(cache.device)]

    def _store(self, k, v, slots) -> None:
        k, v = k.to(self.key_cache.dtype), v.to(self.value_cache.dtype)
        slots = slots.to(self.key_cache.device)
        if self.attention == "triton":
            self._kernels.store_kv(k.contiguous(), v.contiguous(), self.key_cache, self.value_cache, slots)
        else:
            Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
            self.key_cache.view(-1, Hkv, Dh).index_copy_(0, slots, k)
            self.value_cache.view(-1, Hkv, Dh).index_copy_(0, slots, v)

    # ----- verb 2: the math -----------------------------------------------------------------------
    def attend(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
        """Each pair's query q (n, H, Dh) over the keys its row holds up to and including its own
        token. Returns (n, H, Dh)."""
        if q.shape[0] != appended.pair_row.numel():
            raise ValueError(f"q has {q.shape[0]} queries for {appended.pair_row.numel()} appended pairs")
        if self.attention == "reference":
            return self._attend_row_by_row(appended, q)
        if self.attention == "batched" and 0 < appended.rows.numel() == q.shape[0]:
            return self._attend_decode(appended, q)  # decode only: every row one pair, one group
        out = torch.empty_like(q)
        decode = appended.num_new == 1  # (m,)
        groups = [decode, ~decode]  # each padded alone
        if self.attention == "triton" and decode.any():
            self._attend_with_kernels(appended, decode, q, out)  # decode rows: done
            groups = [~decode]
        for group in groups:
            if group.any():
                self._attend_padded(appended, group, q, out)
        return out

    def _attend_row_by_row(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        out = torch.empty_like(q)
        for i, row in enumerate(appended.rows.tolist()):
            pairs = (appended.pair_row == i).nonzero().squeeze(1)  # this row's queries
            slots = self.manager.row_slots(row).to(self.key_cache.device)  # (Lr,)
            keys = self.key_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)  # (Lr, Hkv, Dh)
            values = self.value_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)
            key_index = torch.arange(slots.numel(), device=q.device)
            query_index = appended.pair_index[pairs].to(q.device)
            out[pairs] = attend_by_position(q[pairs], keys, values, query_index, key_index)
        return out

    def _attend_decode(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
        """Decode: one pair per row, rows in pair order; q[i] is row i's newest token and sees all of row i."""
        Hkv = self.key_cache.shape[2]
        compute = score_dtype(q.dtype)  # float32 at least
        keys, values, key_valid = self._gather_rows(appended.rows, appended.context_lens, compute)
        result = F.scaled_dot_product_attention(  # (n, H, 1, Dh)
            q.to(compute)[:, :, None],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=key_valid[:, None, None, :],
            enable_gqa=Hkv != q.shape[1],
        )  # keys (n, Lmax, Hkv, Dh)
        return result.reshape(q.shape).to(q.dtype)  # (n, H, Dh)

    def _attend_padded(
        self, appended: AppendedRows, group: torch.Tensor, q: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The rows where group is True, at once, into out: keys padded to the longest row, queries
        to the most new tokens of a row, one fused grouped-query attention."""
        Hkv, Dh, device = self.key_cache.shape[2], self.key_cache.shape[3], q.device
        members = group.nonzero().squeeze(1)  # (g,) into rows
        rows, lens = appended.rows[members], appended.context_lens[members]  # (g,)
        num_new = appended.num_new[members]
        max_new, g = int(num_new.max()), rows.numel()
        compute = score_dtype(q.dtype)  # float32 at least
        keys, values, key_valid = self._gather_rows(rows, lens, compute)  # (g, Lmax, Hkv, Dh), (g, Lmax)
        max_len = keys.shape[1]
        # the group's pairs in a padded (g, Qmax) table of queries
        if g == appended.rows.numel():  # every row of the call
            pairs, pair_slot = None, appended.pair_row  # (n,)
            column = appended.pair_index - (lens - num_new)[pair_slot]
            pair_q, pair_index = q, appended.pair_index
        else:
            pairs, pair_slot = self._pairs_of(appended, members)  # (p,) each
            column = appended.pair_index[pairs] - (lens - num_new)[pair_slot]  # (p,) 0..Qmax-1
            pair_q, pair_index = q[pairs], appended.pair_index[pairs]
        queries = q.new_zeros(g, max_new, q.shape[1], Dh, dtype=compute)  # (g, Qmax, H, Dh)
        queries[pair_slot, column] = pair_q.to(compute)
        if max_new == 1:  # decode: each row's one query is its newest token and sees the whole row
            visible = key_valid[:, None, :]  # (g, 1, Lmax)
        else:
            query_index = torch.full((g, max_new), max_len - 1, dtype=torch.int64)  # padding sees all
            query_index[pair_slot, column] = pair_index
            visible = key_valid[:, None, :] & (
                torch.arange(max_len)[None, None, :] <= query_index[:, :, None]
            ).to(device)  # (g, Qmax, Lmax)
        result = F.scaled_dot_product_attention(  # (g, H, Qmax, Dh)
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=visible[:, None],
            enable_gqa=Hkv != q.shape[1],
        )
        result = result.transpose(1, 2)[pair_slot, column].to(out.dtype)  # (p, H, Dh)
        if pairs is None:
            out.copy_(result)
        else:
            out[pairs] = result

    def _gather_rows(self, rows: torch.Tensor, lens: torch.Tensor, dtype: torch.dtype):
        """keys, values (g, Lmax, Hkv, Dh) in dtype, zeros past a row's end, and valid (g, Lmax).
        index_select and index_fill_ are, on a CPU, 4x and 5x faster than advanced indexing and
        masked_fill (16 rows of 64 tokens)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        pool, index, valid, padding = self.gather_index(rows, lens)
        g, max_len = valid.shape
        gathered = []
        for cache in pool:  # keys, then values
            tokens = cache.index_select(0, index).to(dtype).view(g * max_len, Hkv * Dh)  # a fresh copy
            gathered.append(tokens.index_fill_(0, padding, 0.0).view(g, max_len, Hkv, Dh))
        return gathered[0], gathered[1], valid.to(self.key_cache.device)

    def gather_index(self, rows: torch.Tensor, lens: torch.Tensor):
        """What _gather_rows reads: the pool tensors (keys, values), the index into their first
        dimension, valid (g, Lmax) and the index of the padding in the gathered (g * Lmax) tokens.
        Plain pages gather whole blocks, table padding clamped to a real block."""
        width, valid, padding = self.block_padding(lens)
        blocks = self.manager.block_tables.index_select(0, rows)[:, :width].clamp(
            max=self.key_cache.shape[0] - 1
        )
        index = blocks.view(-1).to(self.key_cache.device)  # (g * width,) int32 ids
        return (self.key_cache, self.value_cache), index, valid, padding

    def block_padding(self, lens: torch.Tensor):
        """Blocks of the longest row, valid (g, width * P) and the padding's index, of plain pages."""
        width = -(-int(lens.max()) // self.block_size)
        valid = torch.arange(width * self.block_size) < lens[:, None]
        return width, valid, (~valid).view(-1).nonzero().squeeze(1).to(self.key_cache.device)

    def _attend_with_kernels(
        self, appended: AppendedRows, decode: torch.Tensor, q: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Decode rows (one new token each) in one launch of moekv_kernels.paged_attention."""
        device = self.key_cache.device
        members = decode.nonzero().squeeze(1)  # (d,) into rows
        pairs, pair_slot = self._pairs_of(appended, members)  # (d,) one per row
        rows = appended.rows[members]
        block_tables = self.manager.block_tables[rows].to(device)  # (d, W) int32
        context_lens = self.manager.row_tokens[rows].to(device, torch.int32)  # (d,) int32
        queries = q.new_empty(members.numel(), q.shape[1], q.shape[2])
        queries[pair_slot] = q[pairs]
        result = self._kernels.paged_attention(
            queries.contiguous(), self.key_cache, self.value_cache, block_tables, context_lens
        )
        out[pairs] = result[pair_slot].to(q.dtype)

    @staticmethod
    def _pairs_of(appended: AppendedRows, members: torch.Tensor):
        """The pairs whose rows are `members` (into appended.rows), and each one's index there."""
        slot_of_row = torch.full((appended.rows.numel(),), -1, dtype=torch.int64)
        slot_of_row[members] = torch.arange(members.numel())
        pairs = (slot_of_row[appended.pair_row] >= 0).nonzero().squeeze(1)
        return pairs, slot_of_row[appended.pair_row[pairs]]

    # ----- sequences --------------------------------------------------------------------------------
    def token_counts(self, seq_ids) -> torch.Tensor:
        return self.manager.token_counts(seq_ids)

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def kv_bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()
