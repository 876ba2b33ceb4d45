"""The paged per-expert KV cache: one pool of K/V blocks for every (sequence, layer, expert) row.

`append_kv` (bookkeeping and store) and `attend` (the math only) are the contract of
cache/__init__.py; docs/design.md tells why two verbs, and why blocks are taken here, per layer.

Memory layout (the Triton kernels read exactly this): key_cache and value_cache (N, P, Hkv, Dh),
one pool for all layers and experts in the model dtype; block_tables (num_rows, W) int32 and
context_lens (num_rows,) int32 from the KVCacheManager; slot_mapping (n,) int64, slot = block_id *
P + offset into key_cache.view(-1, Hkv, Dh).

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
from ..backends import require_backend
from ..config import ModelConfig
from ..validation import (
    MAX_BLOCKS,
    MAX_INT32,
    check_choice,
    check_fits_memory,
    check_flag,
    check_int,
    known_keywords,
    number,
)
from .kv_cache_manager import (
    PART_KINDS,
    KVCacheManager,
    ManagerOptions,
    ManagerPart,
    check_manager_options,
)
from .prefix_cache import PrefixCache
from .rows import worst_case_lifetime_blocks
from .shared_tail_manager import SharedTails

ATTENTION_PATHS = ("reference", "batched", "triton")


@dataclass
class AppendedRows:
    """What `append_kv` hands to `attend` (all int64)."""

    rows: torch.Tensor  # (m,) the call's distinct rows: ascending, or in pair order when
    #      every pair is its own row (a decode step)
    num_new: torch.Tensor  # (m,) pairs of this call in each row
    context_lens: torch.Tensor  # (m,) tokens each row holds after the append
    pair_row: torch.Tensor  # (n,) each pair's row, as an index into `rows`
    pair_index: torch.Tensor  # (n,) index of the pair's token in its row: it sees 0..pair_index


@dataclass
class DecodePlan:
    """A decode append's layer-independent work, for the next layer's append of the same pairs: with
    one attention expert every layer's row of a sequence holds as many tokens, so the next layer's
    rows (E further on) take the same columns, offsets, lengths and gather padding; only their block
    ids differ. Used where the pairs, their sequences' slots and the rows' counts are the planned."""

    layer: int  # the layer it last served
    key: tuple  # (seq_ids, experts, positions) of the pairs, as lists of ints
    slots: list  # each pair's sequence slot (manager.seq_slots)
    rows: torch.Tensor  # (n,) the rows at `layer`
    old: torch.Tensor  # (n,) tokens each row held before the append
    column: torch.Tensor  # (n,) block-table column and offset of each new token
    offset: torch.Tensor
    appended: AppendedRows  # what attend needs: the same at every layer but the rows
    padding: tuple  # the gather's (width, valid, padding index): PagedKVCache._padding

    def served(self, layer: int, rows: torch.Tensor) -> None:
        """The plan now stands at `layer`, whose rows are `rows`."""
        self.layer = layer
        self.rows = rows


def check_cache_options(
    config: ModelConfig,
    num_blocks,
    block_size,
    dtype,
    device,
    shuffle_seed,
    attention,
    shared_tails,
    blocks_per_device,
    device_of_expert,
    enable_prefix_caching,
    home_devices,
    max_num_seqs=None,
    part: ManagerPart | None = None,
    row_cap: int | None = None,
) -> ManagerOptions:
    """Every option of a paged cache (PagedKVCache's arguments), checked once, before anything is
    built or allocated: what the cache, its manager and its pool would otherwise check, and the
    bytes they would take. num_blocks=None with max_num_seqs (for_model, the engine): a pool for
    max_num_seqs sequences of max_position_embeddings tokens at their worst
    (rows.worst_case_lifetime_blocks, each row capped at row_cap tokens if given). part: a further
    ManagerPart a subclass builds its manager with (cache_parts), checked with the others."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: a floating-point torch dtype")
    check_choice("attention", attention, ATTENTION_PATHS)
    for name, flag in (
        ("enable_prefix_caching", enable_prefix_caching),
        ("shared_tails", shared_tails),
    ):
        check_flag(name, flag)
    if shared_tails and attention == "triton":
        raise ValueError(
            "shared_tails=True cannot use attention='triton': the Triton kernels read a "
            "row through its block table only, and shared tails live outside it"
        )
    L = config.num_hidden_layers
    E = config.num_attention_experts
    K = config.num_attention_experts_per_tok
    sized = ""  # how a pool not given in blocks was sized, for the messages below
    if num_blocks is None and blocks_per_device is None and max_num_seqs is not None:
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1, MAX_INT32, "sequences the pool holds")
        sized = (
            f"num_blocks=None sizes the pool for max_num_seqs={max_num_seqs} sequences of "
            f"max_position_embeddings={config.max_position_embeddings} tokens at their worst: "
        )

        def num_blocks(checked_block_size: int) -> int:
            """The pool for max_num_seqs sequences at their worst, once the block size and the
            parts are checked."""
            blocks = max_num_seqs * worst_case_lifetime_blocks(
                config.max_position_embeddings, L, E, K, checked_block_size, row_cap
            )
            if blocks > MAX_BLOCKS:
                raise ValueError(
                    f"{sized}{blocks:,} blocks of {checked_block_size}; allowed: at most "
                    f"{number(MAX_BLOCKS)} blocks (block tables are int32): give num_blocks, or a "
                    "smaller max_num_seqs"
                )
            return blocks

    minimum = L * K  # one token: a block in each of its k rows of every layer
    options = check_manager_options(
        L,
        E,
        block_size,
        num_blocks,
        shuffle_seed,
        blocks_per_device,
        device_of_expert,
        home_devices,
        **cache_parts(shared_tails, enable_prefix_caching, part),
        pool_meaning=f"the pool's blocks; one token of one sequence takes {minimum}",
    )
    block_size = options.block_size
    sizes = options.blocks_per_device
    placement = options.device_of_expert
    if sum(sizes) < minimum:
        raise ValueError(
            f"num_blocks={sum(sizes)} is too small for even one sequence: one "
            f"token needs {minimum} blocks (num_hidden_layers={L} x "
            f"num_attention_experts_per_tok={K}); allow at least {minimum}"
        )
    # each device must hold one token: a block in each of its experts a token can reach, every
    # layer (with home devices, all k of them)
    where = "a sequence homed there" if home_devices else "its experts"
    for d, n in enumerate(sizes):
        if placement is None:  # home devices (or one pool): all k of a token's rows may land on d
            least = minimum
        else:
            least = int(torch.clamp((placement == d).sum(1), max=K).sum())
        if n < least:
            raise ValueError(
                f"blocks_per_device[{d}]={n} is too small for even one token of "
                f"{where}: allow at least {least}"
            )
    kv_bytes = 2 * sum(sizes) * block_size * config.num_key_value_heads * config.head_dim * dtype.itemsize
    check_fits_memory(
        f"{sized}the K/V of {sum(sizes):,} blocks of {block_size} tokens "
        f"(num_key_value_heads={config.num_key_value_heads} x head_dim={config.head_dim}, {dtype})",
        kv_bytes,
        device,
        "give num_blocks, or a smaller max_num_seqs" if sized else "ask for fewer blocks",
    )
    return options


def cache_parts(shared_tails: bool, enable_prefix_caching: bool, part: ManagerPart | None) -> dict:
    """The parts a cache's manager is built with, by the manager's parameter (PART_KINDS, None where
    absent): fresh ones for its flags, and `part`, a subclass's own, under its role."""
    parts = dict.fromkeys(PART_KINDS)
    parts["tails"] = SharedTails() if shared_tails else None
    parts["prefix_cache"] = PrefixCache() if enable_prefix_caching else None
    if part is not None:
        parts[part.role] = part
    return parts


class PagedKVCache:
    """append_kv / attend over a paged block pool shared by every (sequence, layer, expert).

    shared_tails: a manager with SharedTails, not with "triton" (its kernels read a row through its
    block table only); enable_prefix_caching: with a PrefixCache. blocks_per_device (summing to
    num_blocks) with device_of_expert or home_devices: per-device pools (KVCacheManager).

    A subclass whose manager holds one more part says which in `manager_part`, and sizes a pool
    for_model builds through `_for_model`'s part and row_cap."""

    @known_keywords
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        shuffle_seed: int | None = None,
        attention: str = "batched",
        shared_tails: bool = False,
        blocks_per_device=None,
        device_of_expert=None,
        enable_prefix_caching: bool = False,
        home_devices: bool = False,
        checked: bool = False,
    ):
        """checked=True: the caller (for_model, the engine) checked the options with
        check_cache_options and passes what it returned."""
        if not checked:
            options = check_cache_options(
                config,
                num_blocks,
                block_size,
                dtype,
                device,
                shuffle_seed,
                attention,
                shared_tails,
                blocks_per_device,
                device_of_expert,
                enable_prefix_caching,
                home_devices,
                part=self.manager_part(config),
            )
            num_blocks = options.num_blocks
            block_size = options.block_size
            shuffle_seed = options.shuffle_seed
            blocks_per_device = options.blocks_per_device
            device_of_expert = options.device_of_expert
        self.config = config
        self.attention = attention
        self.manager = KVCacheManager(
            config.num_hidden_layers,
            config.num_attention_experts,
            block_size,
            num_blocks,
            shuffle_seed,
            blocks_per_device=blocks_per_device,
            device_of_expert=device_of_expert,
            home_devices=home_devices,
            checked=True,
            **cache_parts(shared_tails, enable_prefix_caching, self.manager_part(config)),
        )
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)  # (N, P, Hkv, Dh)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.plan: DecodePlan | None = None  # the last decode append's, for the next layer
        if attention == "triton":
            require_backend("triton")  # triton is installed only where it has wheels (Linux)
            import moekv_kernels  # sets TRITON_INTERPRET=1 when no GPU is visible, before triton loads

            self._kernels = moekv_kernels

    block_size = property(lambda self: self.manager.block_size)

    def manager_part(self, config: ModelConfig) -> ManagerPart | None:
        """A fresh further part for this cache's manager, beside its flags' (none here)."""
        return None

    @classmethod
    @known_keywords
    def for_model(
        cls,
        model,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 8,
        shuffle_seed: int | None = None,
        attention: str | None = None,
        shared_tails: bool = False,
        blocks_per_device=None,
        device_of_expert=None,
        enable_prefix_caching: bool = False,
        home_devices: bool = False,
    ) -> "PagedKVCache":
        """A cache in the model's dtype and device; attention=None follows the model's backend.
        Without num_blocks, the pool holds max_num_seqs sequences of max_position_embeddings tokens
        at their worst (rows.worst_case_lifetime_blocks). Exact whatever the model's
        attention_capacity: every routed token stays in its row."""
        return cls._for_model(
            model,
            block_size,
            num_blocks,
            max_num_seqs,
            shuffle_seed,
            attention,
            shared_tails,
            blocks_per_device,
            device_of_expert,
            enable_prefix_caching,
            home_devices,
        )

    @classmethod
    def _for_model(
        cls,
        model,
        block_size,
        num_blocks,
        max_num_seqs,
        shuffle_seed,
        attention,
        shared_tails,
        blocks_per_device,
        device_of_expert,
        enable_prefix_caching,
        home_devices,
        part: ManagerPart | None = None,
        row_cap: int | None = None,
        **own,
    ) -> "PagedKVCache":
        """for_model's work. A subclass's for_model adds the part its manager will hold (checked
        with the others), the most tokens one of its rows holds (row_cap, which sizes the pool) and
        its constructor's own keywords."""
        config = model.config
        if attention is None:
            attention = "triton" if model.backend == "triton" else "batched"
        parameter = next(model.parameters())
        options = check_cache_options(
            config,
            num_blocks,
            block_size,
            parameter.dtype,
            parameter.device,
            shuffle_seed,
            attention,
            shared_tails,
            blocks_per_device,
            device_of_expert,
            enable_prefix_caching,
            home_devices,
            max_num_seqs,
            part,
            row_cap,
        )
        return cls(
            config,
            options.num_blocks,
            options.block_size,
            parameter.dtype,
            parameter.device,
            options.shuffle_seed,
            attention,
            shared_tails,
            options.blocks_per_device,
            options.device_of_expert,
            enable_prefix_caching,
            home_devices,
            checked=True,
            **own,
        )

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
        manager, key = self.manager, (seq_ids.tolist(), experts.tolist(), positions.tolist())
        n = k.shape[0]
        appended = self._append_planned(self.plan, layer, key, positions, k, v)
        if appended is not None:
            return appended
        self.plan = None
        new_seqs = sorted(set(key[0]).difference(manager.sequences))  # ascending
        for s in new_seqs:
            manager.add_sequence(s)
        try:
            pair_rows = manager.rows(seq_ids, layer, experts)  # (n,)
            # decode: each pair the one new token of its own row, in pair order (a set tells it faster than a sort)
            one_per_row = len(set(pair_rows.tolist())) == n
            if one_per_row:
                rows, pair_row, num_new = pair_rows, torch.arange(n), torch.ones(n, dtype=torch.int64)
                self._check_positions(rows, positions, rows, None)
            else:  # the call's rows ascending, each pair's row among them, each row's number of pairs
                rows, pair_row, num_new = torch.unique(pair_rows, return_inverse=True, return_counts=True)
                order = torch.argsort(pair_rows, stable=True)  # (n,) grouped by row
                sorted_rows, sorted_positions = pair_rows[order], positions[order]  # (n,) each
                first = torch.cumsum(num_new, 0) - num_new  # (m,) into order
                self._check_positions(sorted_rows, sorted_positions, rows, first)
            allocation = manager.allocate_slots(rows, num_new, rows_are_distinct=True, one_each=one_per_row)
        except Exception:
            for s in new_seqs:  # as it was
                manager.free(s)
            raise
        self._apply_moves(allocation.moves)
        if one_per_row:
            manager.note_positions(rows, positions)
            slots = allocation.slot_mapping  # (n,) per pair
        else:
            manager.note_positions(rows, sorted_positions[first + num_new - 1])
            slots = torch.empty(n, dtype=torch.int64)
            slots[order] = allocation.slot_mapping  # (n,) per pair
        if manager.prefix_cache is not None:
            manager.prefix_cache.record_positions(slots, positions)  # which chunks each block spans
        self._store(k, v, slots)
        context_lens = manager.row_tokens[rows]  # (m,)
        if not one_per_row:
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n) - first[pair_row[order]]  # (n,) in the call
            pair_index = context_lens[pair_row] - num_new[pair_row] + rank
            return AppendedRows(rows, num_new, context_lens, pair_row, pair_index)
        appended = AppendedRows(rows, num_new, context_lens, pair_row, context_lens - 1)  # pair i is row i
        self.plan = self._plan_next_layer(layer, key, rows, appended)
        return appended

    def _plan_next_layer(self, layer, key, rows, appended: AppendedRows) -> DecodePlan | None:
        """The decode plan (DecodePlan) the next layer's append of the same pairs follows, or None:
        with one attention expert and plain pages, when no row took a block (so the next layer's
        take none either). Measured on a dense model of the embedded model's size (generate, 16
        sequences, 32-token prompts, 64 new tokens, one thread, CPU time of four runs each):
        0.26-0.29 s with it, 0.28-0.31 s without, about 7%. tests/spec/test_paged_cache.py breaks the
        planned slots and sees the logits change."""
        manager = self.manager
        if manager.num_experts != 1 or manager.tails is not None:
            return None
        column = appended.pair_index // self.block_size
        offset = appended.pair_index % self.block_size
        if bool((offset == 0).any()):
            return None
        return DecodePlan(
            layer,
            key,
            manager.seq_slots(key[0]),
            rows,
            appended.pair_index,
            column,
            offset,
            appended,
            self._padding(appended.context_lens),
        )

    def _append_planned(self, plan, layer, key, positions, k, v) -> AppendedRows | None:
        """append_kv of the plan's pairs at the next layer; None (nothing changed) where the plan does
        not apply: other pairs or layer, a sequence's slot changed, rows holding other counts."""
        manager = self.manager
        if (
            plan is None
            or type(layer) is not int
            or not layer == plan.layer + 1 < manager.num_layers
            or key != plan.key
            or manager.seq_slots(key[0]) != plan.slots
        ):
            return None
        rows = plan.rows + manager.num_experts  # the same (sequence, expert)
        if not torch.equal(manager.row_tokens[rows], plan.old):
            return None
        self._check_positions(rows, positions, rows, None)
        manager.extend_rows_in_place(rows, plan.appended.context_lens, positions)
        slots = plan.offset.add(manager.block_tables[rows, plan.column], alpha=self.block_size)
        if manager.prefix_cache is not None:
            manager.prefix_cache.record_positions(slots, positions)
        self._store(k, v, slots)
        plan.served(layer, rows)
        a = plan.appended  # (dataclasses.replace costs ten times this)
        return AppendedRows(rows, a.num_new, a.context_lens, a.pair_row, a.pair_index)

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

    def _apply_moves(self, moves) -> None:
        """Shared tails only: copy K/V between slots, in order, before new tokens are written."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        for source, destination in moves:
            for cache in (self.key_cache, self.value_cache):
                flat = cache.view(-1, Hkv, Dh)
                flat[destination.to(cache.device)] = flat[source.to(cache.device)]

    def _store(self, k, v, slots) -> None:
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        slots = slots.to(self.key_cache.device)
        if self.attention == "triton":
            self._kernels.store_kv(
                k.to(self.key_cache.dtype).contiguous(),
                v.to(self.value_cache.dtype).contiguous(),
                self.key_cache,
                self.value_cache,
                slots,
            )
            return
        self.key_cache.view(-1, Hkv, Dh).index_copy_(0, slots, k.to(self.key_cache.dtype))
        self.value_cache.view(-1, Hkv, Dh).index_copy_(0, slots, v.to(self.value_cache.dtype))

    # ----- verb 2: the math -----------------------------------------------------------------------
    def attend(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
        """Each pair's query q (n, H, Dh) over the keys its row holds up to and including its own
        token. Returns (n, H, Dh)."""
        if q.shape[0] != appended.pair_row.numel():
            raise ValueError(f"q has {q.shape[0]} queries for {appended.pair_row.numel()} appended pairs")
        return self._attend_rows(appended, q)

    def _attend_rows(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
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
        Plain pages gather whole blocks (table padding clamped to a real block), shared tails by
        slot. index_select and index_fill_ are, on a CPU, 4x and 5x faster than advanced indexing
        and a broadcast masked_fill (measured at 16 rows of 64 tokens)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        device = self.key_cache.device
        if self.manager.tails is not None:
            slots, valid = self.manager.padded_slots(rows)  # (g, Lmax) each
            index = slots.reshape(-1).to(device)  # (g * Lmax,) slots
            pool = (self.key_cache.view(-1, Hkv, Dh), self.value_cache.view(-1, Hkv, Dh))
            padding = (~valid).view(-1).nonzero().squeeze(1).to(device)  # (g * Lmax - sum(lens),)
        else:
            plan = self.plan
            width, valid, padding = (
                plan.padding
                if plan is not None and lens is plan.appended.context_lens
                else self._padding(lens)
            )
            blocks = self.manager.block_tables.index_select(0, rows)[:, :width].clamp(
                max=self.key_cache.shape[0] - 1
            )
            index = blocks.view(-1).to(device)  # (g * width,) int32 ids
            pool = (self.key_cache, self.value_cache)
        g, max_len = valid.shape
        gathered = []
        for cache in pool:  # keys, then values
            tokens = cache.index_select(0, index).to(dtype).view(g * max_len, Hkv * Dh)  # a fresh copy
            gathered.append(tokens.index_fill_(0, padding, 0.0).view(g, max_len, Hkv, Dh))
        return gathered[0], gathered[1], valid.to(device)

    def _padding(self, lens: torch.Tensor):
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
