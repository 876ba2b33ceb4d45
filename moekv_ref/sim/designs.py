"""Paged memory designs for the simulator. Every design, baselines included, answers these calls:

    admit(seqs, final_lens)        sequences enter (final_lens: only the `reserved` oracle uses it)
    append(rows, num_new)          distinct rows (a,), numbered as rows.py says, gain num_new (a,)
                                   slots each (sparse: a decode step touches k of every E rows)
    release(seqs)                  sequences finish; their memory returns
    allocated_slots()              KV slots taken from memory now (used or not)
    metadata_bytes()               block tables, counts, ref counts as a compact (CSR) layout holds
                                   them, 4 bytes an integer (not the dense tables of KVCacheManager)
    reads(rows)                    contiguous runs a decode step must read from these rows
    live_slots_of(seqs)            slots these sequences hold

SharedTailDesign replays from token counts the accounting of cache/shared_tail_manager.py (whose
docstring draws the layout): a row's full blocks stay private, its last n % P tokens take slots in
tail blocks shared by the sequence's rows, so a sequence wastes < P slots instead of < P per row,
for a slot index per tail token, the copies of promotion and compaction (`copied_slots`) and up to
P - 1 scattered reads per row. Tail blocks are never shared across sequences, so freeing one frees
whole blocks. Tests check both count-level designs against the real managers step by step.
"""

from __future__ import annotations

import torch

from ..cache.kv_cache_manager import KVCacheManager
from ..cache.rows import RowIndex, ceil_div
from ..validation import check_block_size

BYTES_PER_INDEX = 4


class RowTokens:
    """Token counts per row (rows.py numbering, seq_index = trace sequence), for the designs that
    keep counts only (the paged ones here, contiguous_designs.py's)."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        self.index = RowIndex(num_layers, num_experts)
        self.rows_per_seq = self.index.rows_per_seq
        self.tokens = torch.zeros(num_sequences * self.rows_per_seq, dtype=torch.int64)  # (S*L*E,)

    def admit(self, seqs, final_lens) -> None:
        pass

    def _sequence_tokens(self, seqs) -> torch.Tensor:
        return self.tokens.view(-1, self.rows_per_seq)[seqs]  # (m, L*E)

    def live_slots_of(self, seqs) -> int:
        return int(self._sequence_tokens(seqs).sum())

    def reads(self, rows) -> int:
        return int((self.tokens[rows] > 0).sum())  # one contiguous run per row (the baselines)


class CountingPagedDesign(RowTokens):
    """Plain per-row pages from token counts alone (a row of n tokens owns ceil(n / P) blocks):
    ManagerPagedDesign's numbers, cheap enough to sweep block sizes."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int, block_size: int):
        self.name = f"paged(P={block_size})"
        self.block_size = check_block_size(block_size)
        super().__init__(num_sequences, num_layers, num_experts)
        self._num_blocks = 0  # private blocks of the rows, all together

    def _row_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        return ceil_div(tokens, self.block_size)  # private blocks; shared tails: full ones only

    def append(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        old = self.tokens[rows]  # (a,)
        new = old + num_new
        self._num_blocks += int((self._row_blocks(new) - self._row_blocks(old)).sum())
        self.tokens[rows] = new

    def release(self, seqs) -> None:
        self._num_blocks -= int(self._row_blocks(self._sequence_tokens(seqs)).sum())
        self.tokens.view(-1, self.rows_per_seq)[seqs] = 0

    def allocated_slots(self) -> int:
        return self._num_blocks * self.block_size

    def metadata_bytes(self) -> int:
        # a table entry and a ref_cnt per block, a token count per row in use
        return BYTES_PER_INDEX * (2 * self._num_blocks + int((self.tokens > 0).sum()))

    def reads(self, rows) -> int:
        return int(self._row_blocks(self.tokens[rows]).sum())


class ManagerPagedDesign:
    """Plain per-row pages through the real KVCacheManager, one `allocate_slots` a step (real block
    ids from the real free block queue). manager_class=SharedTailKVCacheManager drives the real
    shared-tail bookkeeping (a Python loop over rows: for tests, too slow for the benchmarks)."""

    def __init__(
        self,
        num_sequences: int,
        num_layers: int,
        num_experts: int,
        block_size: int,
        num_blocks: int,
        shuffle_seed: int | None = None,
        manager_class=KVCacheManager,
    ):
        self.name = f"paged-manager(P={block_size})"
        self.block_size = block_size
        self.rows_per_seq = RowIndex(num_layers, num_experts).rows_per_seq
        self.manager = manager_class(
            num_layers,
            num_experts,
            block_size,
            num_blocks,
            shuffle_seed=shuffle_seed,
            initial_num_seqs=max(1, num_sequences),
        )
        self._row_base = torch.zeros(num_sequences, dtype=torch.int64)  # trace seq -> first manager row

    def admit(self, seqs, final_lens) -> None:
        for seq in torch.as_tensor(seqs).tolist():
            self._row_base[seq] = self.manager.add_sequence(seq) * self.rows_per_seq

    def _manager_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._row_base[rows // self.rows_per_seq] + rows % self.rows_per_seq

    def append(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        self.manager.grow_rows(self._manager_rows(rows), num_new)

    def release(self, seqs) -> None:
        for seq in torch.as_tensor(seqs).reshape(-1).tolist():
            self.manager.free(seq)

    def live_slots_of(self, seqs) -> int:
        return int(self.manager.token_counts(torch.as_tensor(seqs).reshape(-1).tolist()).sum())

    def allocated_slots(self) -> int:
        return self.manager.pool.num_used_blocks * self.block_size

    def metadata_bytes(self) -> int:
        num_rows_in_use = int((self.manager.row_tokens > 0).sum())
        return BYTES_PER_INDEX * (2 * self.manager.pool.num_used_blocks + num_rows_in_use)

    def reads(self, rows) -> int:
        return int(ceil_div(self.manager.row_tokens[self._manager_rows(rows)], self.block_size).sum())


class SharedTailDesign(CountingPagedDesign):
    """Private full blocks plus per-sequence shared tail blocks (module docstring)."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int, block_size: int):
        super().__init__(num_sequences, num_layers, num_experts, block_size)
        self.name = f"paged-shared-tail(P={block_size})"
        self.tail_tokens = torch.zeros(num_sequences, dtype=torch.int64)  # (S,) now
        self.tail_blocks = torch.zeros(num_sequences, dtype=torch.int64)  # (S,) held
        self.copied_slots = 0  # promotions (P - 1 each) + compaction moves (< P each)

    def _row_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens // self.block_size

    def append(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        P = self.block_size
        old = self.tokens[rows]  # (a,)
        new = old + num_new
        promoted = int((new // P - old // P).sum())
        # a promotion copies the P - 1 tail tokens already written (the filling one goes straight
        # in; prefill could write whole blocks directly: counting its copies keeps an upper bound)
        self.copied_slots += promoted * (P - 1)
        self.tail_tokens.index_add_(0, rows // self.rows_per_seq, new % P - old % P)
        needed = ceil_div(self.tail_tokens, P)  # (S,)
        # compaction: each tail block given back moves at most P - 1 live slots into holes
        self.copied_slots += int((self.tail_blocks - needed).clamp(min=0).sum()) * (P - 1)
        self.tail_blocks = needed
        super().append(rows, num_new)

    def release(self, seqs) -> None:
        self.tail_tokens[seqs] = self.tail_blocks[seqs] = 0
        super().release(seqs)

    def allocated_slots(self) -> int:
        return (self._num_blocks + int(self.tail_blocks.sum())) * self.block_size

    def metadata_bytes(self) -> int:
        # body table entries and a ref_cnt per body block, a slot index per tail token, the
        # sequence's list of tail blocks and their ref_cnt, a token count per row in use
        return BYTES_PER_INDEX * (
            2 * self._num_blocks
            + int(self.tail_tokens.sum())
            + 2 * int(self.tail_blocks.sum())
            + int((self.tokens > 0).sum())
        )

    def reads(self, rows) -> int:
        tokens = self.tokens[rows]
        # each body block is one run; in the worst case every tail slot is a run of its own
        return int((tokens // self.block_size + tokens % self.block_size).sum())
