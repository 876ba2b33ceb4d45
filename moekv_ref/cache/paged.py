"""The paged per-expert KV cache: one pool of K/V blocks for every (sequence, layer, expert).

Memory layout (the Triton kernels read exactly this):

    key_cache, value_cache   (N, P, Hkv, Dh)   one pool for all layers and experts, model dtype
    block_tables             (num_rows, W)     int32, from the KVCacheManager
    context_lens             (num_rows,)       int32
    slot_mapping             (n,)              int64, slot = block_id * P + offset, indexes
                                               key_cache.view(-1, Hkv, Dh)

The pool tensors are allocated once; `layer_view`-style per-layer buffers do not exist because a
block may serve any layer and expert. Attention is pure PyTorch: gather the row's K/V through its
block table, then the same `attend_by_position` every cache uses, so "paged = contiguous" tests the
gathering and not a second copy of the math.

Causality inside a row: the model hands this cache the tokens routed to one expert in position order,
and each row holds its tokens in the order they arrived, so a key's index in the row orders it like
its position; the query at row index i sees keys 0..i. We check that positions increase, so a caller
that breaks this gets an error rather than a silently wrong mask.

Dimension legend: N blocks, P block size, H heads, Hkv key/value heads, Dh head width,
n new tokens of this call, m cached tokens of one row.
"""

from __future__ import annotations

import math

import torch

from ..attention import attend_by_position
from ..config import ModelConfig
from .kv_cache_manager import KVCacheManager, check_block_size
from .shared_tail_manager import SharedTailKVCacheManager

BACKENDS = ("torch", "triton")


class PagedKVCache:
    """The `attend` contract of moekv_ref.cache over a paged block pool.

    num_blocks: blocks in the pool (each P slots of one expert's Hkv x Dh keys and values).
    shuffle_seed: scatter the free block queue, so that consecutive blocks of a row are far apart.
    backend: "torch" (the readable gather above, the default) or "triton": a decode call (one new
             token per row) then stores with kernels.store_kv and attends with kernels.paged_attention
             over all its rows in one launch; prefill calls keep the torch path. On a CPU the kernels
             run in Triton's interpreter. Tests: tests/test_kernels_integration.py.
    shared_tails: keep each row's partly filled tail in slots shared by the sequence's rows
             (SharedTailKVCacheManager) instead of a private last block; the K/V moves it asks for
             are applied here before new tokens are written. Torch backend only: the kernels read
             block tables of full rows.
    batch_decode: attend every decode row (one new token) of a call in one padded gather
             (`batched_decode_attention`) instead of one `paged_attention` per row. Same result to
             rounding; a serving step with many sequences makes L x k such calls, and per-call
             overhead is what continuous batching must amortise (the serving engine turns it on).
             Prefill rows still attend one by one: padding every decode row to a prefill chunk's
             length would cost more than the call saves.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 shuffle_seed: int | None = None, backend: str = "torch", shared_tails: bool = False,
                 batch_decode: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if shared_tails and backend != "torch":
            raise ValueError("shared_tails=True needs backend='torch': the Triton kernels read a row "
                             "through its block table only, and shared tails live outside it")
        self.backend = backend
        self.batch_decode = batch_decode
        L, E, K = config.num_hidden_layers, config.num_attention_experts, config.num_attention_experts_per_tok
        # One token of one sequence needs a block in each of its k rows of every layer (k_max under
        # threshold routing): a smaller pool cannot hold even one sequence.
        minimum = L * K
        if not isinstance(num_blocks, int) or num_blocks < minimum:
            raise ValueError(
                f"num_blocks={num_blocks!r} is too small for even one sequence: one token needs "
                f"{minimum} blocks (num_hidden_layers={L} x num_attention_experts_per_tok={K}); "
                f"allow at least {minimum}"
            )
        self.config = config
        manager_class = SharedTailKVCacheManager if shared_tails else KVCacheManager
        self.manager = manager_class(L, E, block_size, num_blocks, shuffle_seed)
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)     # (N, P, Hkv, Dh)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._last_position: dict[int, torch.Tensor] = {}   # row -> last cached position (checks)

    @classmethod
    def for_model(cls, model, block_size: int = 16, num_blocks: int | None = None,
                  max_num_seqs: int = 8, shuffle_seed: int | None = None,
                  backend: str = "torch", shared_tails: bool = False,
                  batch_decode: bool = False) -> "PagedKVCache":
        """A cache in the model's dtype and device. Without num_blocks, the pool holds the worst case
        of max_num_seqs sequences of max_position_embeddings tokens (every token in k_max experts)."""
        config = model.config
        if num_blocks is None:
            blocks_per_row = -(-config.max_position_embeddings // check_block_size(block_size))
            num_blocks = max_num_seqs * config.max_kv_entries_per_token * blocks_per_row
        parameter = next(model.parameters())
        return cls(config, num_blocks, block_size, parameter.dtype, parameter.device, shuffle_seed, backend,
                   shared_tails, batch_decode)

    # ----- the contract -----------------------------------------------------------------------------
    def attend(self, layer, expert, seq_ids, positions, q, k, v):
        """Store k, v (n, Hkv, Dh) under (sequence, layer, expert), then attend each query q (n, H, Dh)
        over its row's cached tokens at positions <= its own. Returns (n, H, Dh)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        if k.shape[1:] != (Hkv, Dh) or v.shape != k.shape or q.shape[0] != k.shape[0]:
            raise ValueError(f"k, v must be (n, {Hkv}, {Dh}) and q (n, H, {Dh}); got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        seqs = seq_ids.unique().tolist()                                      # sorted
        tokens = [(seq_ids == s).nonzero().squeeze(1) for s in seqs]        # indices into the n tokens
        new_seqs = [s for s in seqs if s not in self.manager.sequences]
        for s in new_seqs:
            self.manager.add_sequence(s)
        try:
            rows = self.manager.rows(seqs, layer, expert)                     # (m,)
            counts = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)   # (m,)
            for row, idx in zip(rows.tolist(), tokens):
                self._check_positions(row, positions[idx])
            moves = self.manager.allocate_slots(rows, counts)                 # may raise: nothing stored yet
        except Exception:
            for s in new_seqs:                                                 # leave the cache as it was
                self.manager.free(s)
            raise
        for source, destination in moves or []:                              # shared tails only
            for cache in (self.key_cache, self.value_cache):
                flat = cache.view(-1, Hkv, Dh)
                flat[destination] = flat[source]
        order = torch.cat(tokens)                                             # (n,) grouped by sequence
        slots = self.manager.slot_mapping(rows, counts)                       # (n,)
        if self.backend == "triton" and bool((counts == 1).all()):
            for row, idx in zip(rows.tolist(), tokens):
                self._last_position[row] = positions[idx[-1]]
            return self._decode_with_kernels(rows, order, slots, q, k, v)
        self.key_cache.view(-1, Hkv, Dh)[slots] = k[order].to(self.key_cache.dtype)
        self.value_cache.view(-1, Hkv, Dh)[slots] = v[order].to(self.value_cache.dtype)
        out = torch.empty_like(q)
        for row, idx in zip(rows.tolist(), tokens):
            self._last_position[row] = positions[idx[-1]]
        decode = (counts == 1) if self.batch_decode else torch.zeros_like(counts, dtype=torch.bool)
        if decode.any():
            decode_tokens = torch.stack([tokens[i][0] for i in decode.nonzero().squeeze(1).tolist()])
            out[decode_tokens] = self.batched_decode_attention(rows[decode], q[decode_tokens])
        for i in (~decode).nonzero().squeeze(1).tolist():
            out[tokens[i]] = self.paged_attention(int(rows[i]), q[tokens[i]])
        return out

    def paged_attention(self, row: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the row's newest q.shape[0] tokens' queries over the whole row.

        q: (n, H, Dh). Gathers the row's K/V through its block table, then masks causally by index
        in the row (equal to masking by position, see the module docstring). Returns (n, H, Dh)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        slots = self.manager.row_slots(row)                                   # (m,)
        keys = self.key_cache.view(-1, Hkv, Dh)[slots]                        # (m, Hkv, Dh)
        values = self.value_cache.view(-1, Hkv, Dh)[slots]
        m, n = slots.numel(), q.shape[0]
        key_index = torch.arange(m)                                           # (m,)
        query_index = torch.arange(m - n, m)                                  # (n,)
        return attend_by_position(q, keys.to(q.dtype), values.to(q.dtype), query_index, key_index)

    def batched_decode_attention(self, rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Each row's newest token's query over its whole row, all rows at once.

        rows: (d,), q: (d, H, Dh). The rows' slots are gathered into a padded (d, Lmax) table;
        padding is masked, never read as data. The pure-PyTorch twin of kernels.paged_attention.
        Returns (d, H, Dh)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        H = q.shape[1]
        lens = self.manager.num_computed_tokens[rows]                         # (d,) after the store
        d, max_len = rows.numel(), int(lens.max())
        owner = torch.repeat_interleave(torch.arange(d), lens)               # (t,) row of each slot
        index = torch.arange(owner.numel()) - (torch.cumsum(lens, 0) - lens)[owner]   # (t,) in its row
        slots = torch.zeros(d, max_len, dtype=torch.int64)                  # (d, Lmax)
        slots[owner, index] = self.manager.rows_slots(rows)
        valid = torch.arange(max_len)[None, :] < lens[:, None]              # (d, Lmax)
        keys = self.key_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)            # (d, Lmax, Hkv, Dh)
        values = self.value_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)
        keys = keys.repeat_interleave(H // Hkv, dim=2)                        # (d, Lmax, H, Dh)
        values = values.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("dhe,dlhe->dhl", q, keys) / math.sqrt(Dh)      # (d, H, Lmax)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        return torch.einsum("dhl,dlhe->dhe", torch.softmax(scores, dim=-1), values)  # (d, H, Dh)

    def _decode_with_kernels(self, rows, order, slots, q, k, v):
        """The decode step on the Triton kernels: token order[i] is row rows[i]'s one new token."""
        import kernels  # sets TRITON_INTERPRET=1 when no GPU is visible, before triton loads

        device = self.key_cache.device
        kernels.store_kv(k[order], v[order], self.key_cache, self.value_cache, slots.to(device))
        block_tables = self.manager.block_tables[rows].to(device)             # (m, W) int32
        context_lens = self.manager.context_lens(rows).to(device)             # (m,) int32
        out = torch.empty_like(q)
        out[order] = kernels.paged_attention(q[order], self.key_cache, self.value_cache,
                                             block_tables, context_lens)
        return out

    def _check_positions(self, row: int, positions: torch.Tensor) -> None:
        previous = self._last_position.get(row)
        if (positions[1:] <= positions[:-1]).any() or (previous is not None and positions[0] <= previous):
            raise ValueError(
                f"row {row}: positions {positions.tolist()[:8]} do not increase from the cached ones "
                f"(last {None if previous is None else int(previous)}): tokens must arrive in order"
            )

    def token_counts(self, seq_ids) -> torch.Tensor:
        return self.manager.token_counts(seq_ids)

    def free(self, seq_id: int) -> None:
        index = self.manager.seq_index(seq_id)                               # KeyError if unknown
        first = index * self.manager.rows_per_seq
        for row in range(first, first + self.manager.rows_per_seq):
            self._last_position.pop(row, None)
        self.manager.free(seq_id)

    # ----- for kernels and the scheduler ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def kv_bytes(self) -> int:
        """Bytes of the K and V pool tensors."""
        return 2 * self.key_cache.numel() * self.key_cache.element_size()
