"""The reference cache: one contiguous, growing buffer per (sequence, layer, expert).

This is the naive design the problem statement starts from: every expert of every layer keeps its
own buffer for every sequence. It is correct and easy to read, and it is what the paged cache must
equal. Growth is by concatenation (a real system would reserve capacity; the `reserved` baseline of
the memory benchmark models that).
"""

from __future__ import annotations

import torch

from ..attention import attend_by_position


class ContiguousKVCache:
    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers = num_layers
        self.num_experts = num_experts
        # (seq_id, layer, expert) -> (k (m, Hkv, Dh), v (m, Hkv, Dh), positions (m,))
        self._buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer, expert, seq_ids, positions, q, k, v):
        out = torch.empty_like(q)
        for seq_id in seq_ids.unique().tolist():
            rows = (seq_ids == seq_id).nonzero().squeeze(1)                  # this sequence's tokens
            key = (seq_id, layer, expert)
            if key in self._buffers:
                old_k, old_v, old_pos = self._buffers[key]
                if old_pos[-1] >= positions[rows[0]]:
                    raise ValueError(f"sequence {seq_id}: new position {int(positions[rows[0]])} does "
                                     f"not continue the cached ones (last {int(old_pos[-1])})")
                self._buffers[key] = (torch.cat([old_k, k[rows]]), torch.cat([old_v, v[rows]]),
                                      torch.cat([old_pos, positions[rows]]))
            else:
                self._buffers[key] = (k[rows].clone(), v[rows].clone(), positions[rows].clone())
            cached_k, cached_v, cached_pos = self._buffers[key]
            out[rows] = attend_by_position(q[rows], cached_k, cached_v, positions[rows], cached_pos)
        return out

    def num_tokens(self, seq_id: int, layer: int, expert: int) -> int:
        buffer = self._buffers.get((seq_id, layer, expert))
        return 0 if buffer is None else buffer[2].numel()

    def token_counts(self, seq_ids: list[int]) -> torch.Tensor:
        """Tokens held per (sequence, layer, expert): (num_seqs, L, E) int64."""
        counts = torch.zeros(len(seq_ids), self.num_layers, self.num_experts, dtype=torch.int64)
        for i, seq_id in enumerate(seq_ids):
            for layer in range(self.num_layers):
                for expert in range(self.num_experts):
                    counts[i, layer, expert] = self.num_tokens(seq_id, layer, expert)
        return counts

    def free(self, seq_id: int) -> None:
        keys = [key for key in self._buffers if key[0] == seq_id]
        if not keys:
            raise KeyError(f"sequence {seq_id} holds nothing in this cache (unknown or already freed)")
        for key in keys:
            del self._buffers[key]
