"""The paged cache with attention batched over rows: what the serving engine runs on.

`PagedKVCache.attend` gathers and attends one (sequence, expert) row at a time: clear, but a step
serving 16 sequences then makes ~16 x L x k small attention calls, and the per-call overhead grows
with the batch -- exactly what continuous batching is meant to amortise. This subclass stores K/V the
same way (same manager calls, same slots) and then attends every row of the call at once:

    rows        m rows of this (layer, expert), the i-th holding len_i tokens after the store
    key slots   (m, Lmax)        slot of key j of row i = block_tables[row_i, j // P] * P + j % P
    keys        (m, Lmax, H, Dh) gathered through the slots (padding masked, never read as data)
    queries     (m, Tmax, H, Dh) the row's newest n_i tokens, at key indices len_i - n_i .. len_i - 1
    mask        key j visible to query t  iff  j <= len_i - n_i + t  and  j < len_i

Inside a row, keys are in position order (see paged.py), so masking by index is masking by position.
Only decode rows (one new token each) are batched; a prefill chunk's row attends alone through
`PagedKVCache.paged_attention`, since padding every decode row to a chunk's length would waste more
than the call saves.
Equal to PagedKVCache to rounding; the tests compare tokens with generating each request alone.
"""

from __future__ import annotations

import math

import torch

from ..cache.paged import PagedKVCache


class BatchedPagedKVCache(PagedKVCache):
    def attend(self, layer, expert, seq_ids, positions, q, k, v):
        """Store k, v (n, Hkv, Dh) under (sequence, layer, expert), then attend every query q
        (n, H, Dh) over its row in one batched computation. Returns (n, H, Dh)."""
        Hkv, Dh = self.key_cache.shape[2], self.key_cache.shape[3]
        if k.shape[1:] != (Hkv, Dh) or v.shape != k.shape or q.shape[0] != k.shape[0]:
            raise ValueError(f"k, v must be (n, {Hkv}, {Dh}) and q (n, H, {Dh}); got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        seqs, owner_of_token = torch.unique(seq_ids, sorted=True, return_inverse=True)  # (m,), (n,)
        seqs = seqs.tolist()
        order = torch.argsort(owner_of_token, stable=True)                   # (n,) grouped by row
        counts = torch.bincount(owner_of_token, minlength=len(seqs))        # (m,) new tokens per row
        known = set(self.manager.sequences)
        new_seqs = [s for s in seqs if s not in known]
        for s in new_seqs:
            self.manager.add_sequence(s)
        try:
            rows = self.manager.rows(seqs, layer, expert)                     # (m,)
            ends = torch.cumsum(counts, 0)
            for i, row in enumerate(rows.tolist()):
                self._check_positions(row, positions[order[ends[i] - counts[i]: ends[i]]])
            self.manager.allocate_slots(rows, counts)                         # may raise: nothing stored yet
        except Exception:
            for s in new_seqs:                                                 # leave the cache as it was
                self.manager.free(s)
            raise
        slots = self.manager.slot_mapping(rows, counts)                       # (n,) in `order`
        self.key_cache.view(-1, Hkv, Dh)[slots] = k[order].to(self.key_cache.dtype)
        self.value_cache.view(-1, Hkv, Dh)[slots] = v[order].to(self.value_cache.dtype)
        last = positions[order[ends - 1]]                                     # (m,)
        for row, position in zip(rows.tolist(), last):
            self._last_position[row] = position
        # decode rows (one new token) attend together; a prefill chunk is large enough to go alone,
        # and padding every decode row to its length would multiply the work
        out = torch.empty_like(q)
        decode = counts == 1
        first = ends - counts                                                 # (m,) start in `order`
        if decode.any():
            tokens = order[first[decode]]                                     # (d,) their tokens
            out[tokens] = self.batched_attention(rows[decode], counts[decode], tokens, q)[tokens]
        for i in (~decode).nonzero().squeeze(1).tolist():
            tokens = order[first[i]: ends[i]]
            out[tokens] = self.paged_attention(int(rows[i]), q[tokens])
        return out

    def batched_attention(self, rows, counts, order, q):
        """Queries q (n, H, Dh), token order[j] being the j-th new token when grouped by row, over
        their rows' cached keys. Returns (n, H, Dh)."""
        P = self.block_size
        H, Dh = q.shape[1], q.shape[2]
        Hkv = self.key_cache.shape[2]
        m = rows.numel()
        lens = self.manager.num_computed_tokens[rows]                        # (m,) after the store
        max_len, max_new = int(lens.max()), int(counts.max())
        key_index = torch.arange(max_len)                                     # (Lmax,)
        valid = key_index[None, :] < lens[:, None]                            # (m, Lmax)
        tables = self.manager.block_tables[rows].to(torch.int64)              # (m, W)
        blocks = tables[:, key_index // P].clamp(max=self.manager.num_blocks - 1)  # (m, Lmax)
        slots = torch.where(valid, blocks * P + key_index % P, 0)            # (m, Lmax)
        keys = self.key_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)            # (m, Lmax, Hkv, Dh)
        values = self.value_cache.view(-1, Hkv, Dh)[slots].to(q.dtype)
        keys = keys.repeat_interleave(H // Hkv, dim=2)                        # (m, Lmax, H, Dh)
        values = values.repeat_interleave(H // Hkv, dim=2)
        # the t-th new token of row i sits at index first_new[i] + t of its row
        owner = torch.repeat_interleave(torch.arange(m), counts)             # (n,) row of each grouped token
        t = torch.arange(owner.numel()) - (torch.cumsum(counts, 0) - counts)[owner]  # (n,)
        queries = q.new_zeros(m, max_new, H, Dh)                              # (m, Tmax, H, Dh)
        queries[owner, t] = q[order]
        query_index = lens[:, None] - counts[:, None] + torch.arange(max_new)[None, :]  # (m, Tmax)
        query_index = torch.minimum(query_index, lens[:, None] - 1)           # padding queries: any valid row
        visible = (key_index[None, None, :] <= query_index[:, :, None]) & valid[:, None, :]  # (m, Tmax, Lmax)
        scores = torch.einsum("mthd,mjhd->mhtj", queries, keys) / math.sqrt(Dh)  # (m, H, Tmax, Lmax)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        attended = torch.einsum("mhtj,mjhd->mthd", torch.softmax(scores, dim=-1), values)  # (m, Tmax, H, Dh)
        out = torch.empty_like(q)
        out[order] = attended[owner, t]
        return out
