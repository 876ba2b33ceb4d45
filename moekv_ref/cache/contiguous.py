"""The reference cache, what the paged cache must equal: one growing buffer per (sequence, layer,
expert). Growth is by concatenation (a real system would reserve capacity; the `reserved` baseline
of the memory benchmark models that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attend_by_position


@dataclass
class ContiguousRows:
    """What `append_kv` hands to `attend`."""

    keys: list[tuple[int, int, int]]  # (seq_id, layer, expert) of each distinct row of the call
    pairs: list[torch.Tensor]  # each row's pairs, as indices into the call
    positions: torch.Tensor  # (n,) each pair's position (the mask is by position here)


class ContiguousKVCache:
    """append_kv / attend (the contract of cache/__init__.py) over a buffer per row."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        # (seq_id, layer, expert) -> (k (m, Hkv, Dh), v (m, Hkv, Dh), positions (m,))
        self._buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def append_kv(self, layer, seq_ids, experts, positions, k, v, scores=None) -> ContiguousRows:
        """Checks every row first, so that a call that raises changes nothing. scores (the router's
        probabilities, which a budget reads) are not used: this cache keeps every token."""
        seq_ids, experts = torch.as_tensor(seq_ids).tolist(), torch.as_tensor(experts).tolist()
        index: dict[tuple[int, int, int], int] = {}  # each distinct row, in order
        pair_row = torch.tensor(
            [
                index.setdefault((seq_id, layer, expert), len(index))
                for seq_id, expert in zip(seq_ids, experts)
            ],
            dtype=torch.int64,
        )
        keys = list(index)
        mine = [(pair_row == i).nonzero().squeeze(1) for i in range(len(keys))]  # each row's pairs
        for key, pairs in zip(keys, mine):
            new = positions[pairs]
            last = self._buffers[key][2][-1] if key in self._buffers else None
            if (new[1:] <= new[:-1]).any() or (last is not None and new[0] <= last):
                raise ValueError(
                    f"sequence {key[0]}: new positions {new.tolist()[:8]} do not continue the "
                    f"cached ones (last {None if last is None else int(last)})"
                )
        for key, pairs in zip(keys, mine):
            old_k, old_v, old_positions = self._buffers.get(key, (k[:0], v[:0], positions[:0]))
            self._buffers[key] = (
                torch.cat([old_k, k[pairs]]),
                torch.cat([old_v, v[pairs]]),
                torch.cat([old_positions, positions[pairs]]),
            )
        return ContiguousRows(keys, mine, positions)

    def attend(self, appended: ContiguousRows, q):
        out = torch.empty_like(q)
        for key, pairs in zip(appended.keys, appended.pairs):
            cached_k, cached_v, cached_pos = self._buffers[key]
            out[pairs] = attend_by_position(
                q[pairs], cached_k, cached_v, appended.positions[pairs], cached_pos
            )
        return out

    def token_counts(self, seq_ids: list[int]) -> torch.Tensor:
        counts = torch.zeros(len(seq_ids), self.num_layers, self.num_experts, dtype=torch.int64)
        for i, seq_id in enumerate(seq_ids):
            for (held, layer, expert), (_, _, positions) in self._buffers.items():
                if held == seq_id:
                    counts[i, layer, expert] = positions.numel()
        return counts

    def free(self, seq_id: int) -> None:
        keys = [key for key in self._buffers if key[0] == seq_id]
        if not keys:
            raise KeyError(f"sequence {seq_id} holds nothing in this cache (unknown or already freed)")
        for key in keys:
            del self._buffers[key]
