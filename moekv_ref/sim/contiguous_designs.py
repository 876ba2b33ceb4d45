"""The naive designs the paged cache is measured against, as memory accounting only; they answer
the calls listed in designs.py. Units are slots (one token's K and V in one row), addresses too.

  ReservedDesign   every row reserves, contiguously and up front, its worst case: every token of
                   the sequence routed to it. It is even told each sequence's final length, so its
                   numbers are the best a reservation can do; it wastes at least the (E - k) / E of
                   rows a token does not use.
  FirstFitDesign   every row owns one buffer in ONE address space; a full buffer moves to one twice
                   as large at the lowest address that fits (first fit), leaving a hole. "Allocated"
                   is the top of the heap: memory below it cannot be handed back.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .designs import BYTES_PER_INDEX, RowTokens


class ReservedDesign(RowTokens):
    """Worst-case contiguous reservation per row (module docstring)."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        super().__init__(num_sequences, num_layers, num_experts)
        self.name = "reserved"
        self.reserved = torch.zeros(num_sequences, dtype=torch.int64)  # (S,) slots per sequence

    def admit(self, seqs, final_lens) -> None:
        self.reserved[seqs] = torch.as_tensor(final_lens, dtype=torch.int64) * self.rows_per_seq

    def append(self, rows, num_new) -> None:
        self.tokens[rows] += num_new

    def release(self, seqs) -> None:
        self.reserved[seqs] = 0
        self.tokens.view(-1, self.rows_per_seq)[seqs] = 0

    def allocated_slots(self) -> int:
        return int(self.reserved.sum())

    def metadata_bytes(self) -> int:
        # a base address (8 bytes) and a token count (4) per row of every admitted sequence
        return int((self.reserved > 0).sum()) * self.rows_per_seq * (8 + BYTES_PER_INDEX)


class AddressSpace:
    """One linear address space with first-fit placement and coalescing of holes.

    holes: sorted, non-adjacent (start, size) ranges below `top`, above which all is free; numpy
    arrays, so first fit is one vectorized scan."""

    def __init__(self):
        self.hole_starts, self.hole_sizes = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.top = 0

    def allocate(self, size: int) -> int:
        fits = np.flatnonzero(self.hole_sizes >= size)
        if fits.size == 0:
            start, self.top = self.top, self.top + size
            return start
        i = int(fits[0])
        start = int(self.hole_starts[i])
        self.hole_starts[i] += size
        self.hole_sizes[i] -= size
        if self.hole_sizes[i] == 0:
            self.hole_starts, self.hole_sizes = np.delete(self.hole_starts, i), np.delete(self.hole_sizes, i)
        return start

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.hole_starts, start)
        starts, sizes = np.insert(self.hole_starts, i, start), np.insert(self.hole_sizes, i, size)
        for j in (i, i - 1):  # merge with the hole after, then the one before
            if 0 <= j < starts.size - 1 and starts[j] + sizes[j] == starts[j + 1]:
                sizes[j] += sizes[j + 1]
                starts, sizes = np.delete(starts, j + 1), np.delete(sizes, j + 1)
        if starts[-1] + sizes[-1] == self.top:  # the last hole reaches the top: the heap shrinks
            self.top = int(starts[-1])
            starts, sizes = starts[:-1], sizes[:-1]
        self.hole_starts, self.hole_sizes = starts, sizes

    @property
    def num_holes(self) -> int:
        return int(self.hole_starts.size)

    @property
    def hole_slots(self) -> int:
        return int(self.hole_sizes.sum())


class FirstFitDesign(RowTokens):
    """Per-row buffers grown by doubling, placed first fit (module docstring)."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        super().__init__(num_sequences, num_layers, num_experts)
        self.name = "first_fit"
        self.capacity = torch.zeros_like(self.tokens)  # (S*L*E,) buffer sizes, 0 = none
        self.start = torch.zeros_like(self.tokens)  # (S*L*E,) addresses
        self.space = AddressSpace()

    def append(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        new = self.tokens[rows] + num_new  # (a,)
        grow = new > self.capacity[rows]
        for row, needed in zip(rows[grow].tolist(), new[grow].tolist()):
            old_size = int(self.capacity[row])
            size = max(2 * old_size, 1 << (needed - 1).bit_length())
            # allocate the new buffer before freeing the old one: the copy needs both
            start = self.space.allocate(size)
            if old_size:
                self.space.free(int(self.start[row]), old_size)
            self.start[row], self.capacity[row] = start, size
        self.tokens[rows] = new

    def release(self, seqs) -> None:
        rows = self.index.sequence_rows(torch.as_tensor(seqs).reshape(-1)).reshape(-1)  # (m*L*E,)
        held = rows[self.capacity[rows] > 0]
        for start, size in zip(self.start[held].tolist(), self.capacity[held].tolist()):
            self.space.free(start, size)
        self.tokens[rows] = self.capacity[rows] = 0

    def allocated_slots(self) -> int:
        return self.space.top

    def metadata_bytes(self) -> int:
        # per buffer: address (8), capacity and count (4 each); per hole: address and size (8 each)
        return int((self.capacity > 0).sum()) * 16 + self.space.num_holes * 16

    def memory_map(self) -> dict:
        """Every live buffer (start, size, used, seq, layer, expert), hole and the top, to draw."""
        rows = (self.capacity > 0).nonzero().squeeze(1)
        seq, layer, expert = self.index.split(rows)
        columns = dict(
            start=self.start[rows],
            size=self.capacity[rows],
            used=self.tokens[rows],
            seq=seq,
            layer=layer,
            expert=expert,
        )
        return {
            **{name: column.numpy() for name, column in columns.items()},
            "top": self.space.top,
            "hole_start": self.space.hole_starts.copy(),
            "hole_size": self.space.hole_sizes.copy(),
        }
