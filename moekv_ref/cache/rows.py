"""A *row* is the cache of one sequence at one layer for one attention expert. Every table over
rows (token counts, block tables, the simulator's counters) numbers them sequence-major,

    row = seq_index * (L * E) + layer * E + expert

so a sequence's rows are one contiguous slice (freeing it is one slice) and those of one of its
layers E consecutive entries. seq_index is a slot number (the manager gives each sequence id one,
reused after `free`; the simulator uses the trace's sequence number).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..validation import MAX_INT32, MAX_INT64, check_device_table, check_ids, check_int, number, shown


def ceil_div(a, b):
    """ceil(a / b) for integers or integer tensors; a tensor over a power of two (every block size)
    is shifted, three times faster than a floor division (the same answer, negatives included)."""
    if isinstance(a, torch.Tensor) and type(b) is int and b > 0 and not b & (b - 1):
        return (a + (b - 1)) >> (b.bit_length() - 1)
    return (a + b - 1) // b


def ragged_arange(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts (m,) int64 >= 0 -> owner, index (t,), t = counts.sum(): entry j is number index[j] of
    the counts[owner[j]] entries of owner[j], owners in order. For counts [2, 0, 3]: owner
    [0, 0, 2, 2, 2], index [0, 1, 0, 1, 2]. A row's blocks or tokens, for many rows in one pass."""
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)  # (t,)
    first = torch.cumsum(counts, 0) - counts  # (m,) the first entry of each owner
    return owner, torch.arange(total) - first[owner]


def stable_order(keys: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts keys (int64 >= 0) stably, as torch.argsort(keys, stable=True).
    Keys below 2**16 (devices) go through numpy's radix sort: on one thread, 7 us for 3,000
    keys against 80 us for torch's sort, which the simulator pays each step when it hands out
    the blocks of 64 devices. A few keys (a decode step's new blocks) go to torch's sort."""
    if keys.numel() > 256 and int(keys.max()) < 2**16:  # a few keys: numpy's round trip costs more
        return torch.from_numpy(np.argsort(keys.numpy().astype(np.uint16), kind="stable")).to(torch.int64)
    return torch.argsort(keys, stable=True)


@dataclass(frozen=True)
class RowIndex:
    num_layers: int  # L
    num_experts: int  # E
    rows_per_seq = property(lambda self: self.num_layers * self.num_experts)

    def row(self, seq_index, layer, expert):
        """Row id of (seq_index, layer, expert); ints or broadcastable int64 tensors."""
        return seq_index * self.rows_per_seq + layer * self.num_experts + expert

    def split(self, row):
        """The inverse of `row`."""
        seq_index, rest = row // self.rows_per_seq, row % self.rows_per_seq
        return seq_index, rest // self.num_experts, rest % self.num_experts

    def sequence_rows(self, seq_index: torch.Tensor) -> torch.Tensor:
        """All L * E rows of each sequence slot in seq_index (m,): (m, L * E) int64, layer-major."""
        return torch.as_tensor(seq_index, dtype=torch.int64)[:, None] * self.rows_per_seq + torch.arange(
            self.rows_per_seq
        )


@dataclass(frozen=True, eq=False)
class RowPlacement:
    """Which device each row takes its blocks from, answered for every row. Two ways to shard:

    by expert    row (s, l, e) on expert_devices[l, e]   expert parallelism's kv_with_expert;
                                                         one pool is this with every entry 0
    by sequence  every row of s on its home s % D       kv_with_sequence, replicated_attention
                 (expert_devices is None)
    """

    num_layers: int  # L
    num_experts: int  # E
    num_devices: int  # D
    expert_devices: torch.Tensor | None  # (L, E) int64; None: rows follow their sequence's home

    def __post_init__(self):
        """Each size an integer >= 1, the table (L, E) integers in [0, D) (a list of lists is read as
        the tensor it makes); frozen: the checked values replace what was given."""
        for name in ("num_layers", "num_experts", "num_devices"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1, MAX_INT32))
        if self.expert_devices is not None:
            table = check_device_table(
                self.expert_devices,
                self.num_devices,
                self.num_layers,
                self.num_experts,
                "expert_devices",
                devices_meaning=f"num_devices={self.num_devices}",
            )
            object.__setattr__(self, "expert_devices", table)

    @classmethod
    def by_expert(cls, expert_devices, num_devices: int) -> "RowPlacement":
        """expert_devices: (L, E) integers in [0, num_devices), L and E read from its shape."""
        num_devices = check_int("num_devices", num_devices, 1, MAX_INT32)
        table = check_device_table(
            expert_devices, num_devices, name="expert_devices", devices_meaning=f"num_devices={num_devices}"
        )
        num_layers, num_experts = table.shape
        return cls(num_layers, num_experts, num_devices, table)

    @classmethod
    def by_sequence(cls, num_layers: int, num_experts: int, num_devices: int) -> "RowPlacement":
        return cls(num_layers, num_experts, num_devices, None)

    @property
    def follows_sequence(self) -> bool:
        """Whether a row's device depends on its sequence (so a question about rows needs the id)."""
        return self.expert_devices is None and self.num_devices > 1

    def of_sequences(self, seq_ids) -> torch.Tensor:
        """(m, L, E) the device of every row of these sequence ids (integers >= 0), held or not."""
        if type(seq_ids) is list and all(type(s) is int for s in seq_ids):  # the engine's, at once
            if seq_ids and not 0 <= min(seq_ids) <= max(seq_ids) <= MAX_INT64:
                raise ValueError(
                    f"seq_ids={shown(seq_ids)} is not allowed; allowed: sequence ids in [0, {number(MAX_INT64)}]"
                )
            seq_ids = torch.tensor(seq_ids, dtype=torch.int64)  # (m,)
        else:
            if hasattr(seq_ids, "__iter__") and not isinstance(
                seq_ids, (list, torch.Tensor, np.ndarray, str, bytes)
            ):
                seq_ids = list(seq_ids)  # a range, a generator, a dict's keys
            seq_ids = check_ids(seq_ids, "seq_ids").reshape(-1)  # (m,)
            if seq_ids.numel() and int(seq_ids.min()) < 0:
                raise ValueError(
                    f"seq_ids={shown(seq_ids.tolist())} is not allowed; allowed: sequence ids in "
                    f"[0, {number(MAX_INT64)}]"
                )
        if self.expert_devices is None:
            homes = seq_ids % self.num_devices  # (m,)
            return homes.view(-1, 1, 1).expand(-1, self.num_layers, self.num_experts)
        return self.expert_devices.expand(seq_ids.numel(), -1, -1)

    def experts_per_device(self) -> torch.Tensor | None:
        """(L, D) how many experts of each layer live on each device; None by sequence, where the
        answer depends on the sequence."""
        if self.expert_devices is None:
            return None
        counts = torch.zeros(self.num_layers, self.num_devices, dtype=torch.int64)
        return counts.scatter_add_(1, self.expert_devices, torch.ones_like(self.expert_devices))


def worst_case_lifetime_blocks(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    k_max: int,
    block_size: int,
    max_row_tokens: int | None = None,
) -> int:
    """The most blocks a sequence of T = `num_tokens` cached tokens can hold under any routing: per
    layer k_max * T entries over E rows of at most C = T tokens each (C = min(T, B) under a row
    budget of B tokens), so at most min(E * ceil(C / P), m + (N - m) // P) blocks, N = min(k_max *
    T, E * C) entries, m = min(E, N)."""
    most = num_tokens if max_row_tokens is None else min(num_tokens, max_row_tokens)  # C
    entries = min(k_max * num_tokens, num_experts * most)
    rows = min(num_experts, entries)
    per_layer = min(num_experts * ceil_div(most, block_size), rows + (entries - rows) // block_size)
    return num_layers * per_layer
