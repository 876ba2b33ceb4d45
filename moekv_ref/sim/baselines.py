"""The naive designs the paged cache is measured against, as memory accounting only.

They answer the calls listed in designs.py, on the same routing traces as the paged designs.

  ReservedDesign   every (sequence, layer, expert) reserves, contiguously and up front, the worst
                   case: every token of the sequence routed to that expert. We even grant it an
                   oracle -- it knows each sequence's final length -- so its numbers are the best a
                   reservation can do. Waste: the (E - k) / E of rows a token does not use, and more.
  FirstFitDesign   every (sequence, layer, expert) owns one buffer in ONE address space; when full
                   it moves to one twice as large at the lowest address that fits (first fit),
                   leaving a hole. Holes below the top of the heap are external fragmentation, the
                   unused end of each buffer internal. "Allocated" is the top of the heap: memory
                   below it cannot be handed back.

Units are slots (one token's K and V in one (layer, expert) row); addresses are in slots too.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from ..cache.rows import RowIndex
from .designs import BYTES_PER_INDEX


class _RowTokens:
    """Token counts per row (rows.py numbering, seq_index = trace sequence), for both baselines."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        self.index = RowIndex(num_layers, num_experts)
        self.rows_per_seq = self.index.rows_per_seq
        self.tokens = torch.zeros(num_sequences * self.rows_per_seq, dtype=torch.int64)   # (S*L*E,)

    def live_slots_of(self, seqs) -> int:
        return int(self.tokens.view(-1, self.rows_per_seq)[seqs].sum())

    def reads(self, rows) -> int:
        return int((self.tokens[rows] > 0).sum())    # one contiguous run per row


class ReservedDesign(_RowTokens):
    """Worst-case contiguous reservation per (sequence, layer, expert)."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        super().__init__(num_sequences, num_layers, num_experts)
        self.name = "reserved"
        self.reserved = torch.zeros(num_sequences, dtype=torch.int64)   # (S,) slots per sequence

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
        self.hole_starts = np.zeros(0, dtype=np.int64)
        self.hole_sizes = np.zeros(0, dtype=np.int64)
        self.top = 0

    def allocate(self, size: int) -> int:
        fits = np.flatnonzero(self.hole_sizes >= size)
        if fits.size == 0:
            start, self.top = self.top, self.top + size
            return start
        i = int(fits[0])
        start = int(self.hole_starts[i])
        if self.hole_sizes[i] == size:
            self.hole_starts = np.delete(self.hole_starts, i)
            self.hole_sizes = np.delete(self.hole_sizes, i)
        else:
            self.hole_starts[i] += size
            self.hole_sizes[i] -= size
        return start

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.hole_starts, start)
        # merge with the hole before and the hole after, when adjacent
        if i > 0 and self.hole_starts[i - 1] + self.hole_sizes[i - 1] == start:
            i -= 1
            start, size = int(self.hole_starts[i]), int(self.hole_sizes[i]) + size
            self.hole_starts = np.delete(self.hole_starts, i)
            self.hole_sizes = np.delete(self.hole_sizes, i)
        if i < self.hole_starts.size and start + size == self.hole_starts[i]:
            size += int(self.hole_sizes[i])
            self.hole_starts = np.delete(self.hole_starts, i)
            self.hole_sizes = np.delete(self.hole_sizes, i)
        if start + size == self.top:        # the hole reaches the top: the heap shrinks
            self.top = start
            return
        self.hole_starts = np.insert(self.hole_starts, i, start)
        self.hole_sizes = np.insert(self.hole_sizes, i, size)

    @property
    def num_holes(self) -> int:
        return int(self.hole_starts.size)

    @property
    def hole_slots(self) -> int:
        return int(self.hole_sizes.sum())


class FirstFitDesign(_RowTokens):
    """Variable-size per-(sequence, layer, expert) buffers, grown by doubling, placed first fit."""

    def __init__(self, num_sequences: int, num_layers: int, num_experts: int):
        super().__init__(num_sequences, num_layers, num_experts)
        self.name = "first_fit"
        self.capacity = torch.zeros_like(self.tokens)        # (S*L*E,) buffer sizes, 0 = none
        self.start = torch.zeros_like(self.tokens)           # (S*L*E,) addresses
        self.space = AddressSpace()

    def admit(self, seqs, final_lens) -> None:
        pass

    def append(self, rows: torch.Tensor, num_new: torch.Tensor) -> None:
        new = self.tokens[rows] + num_new                                         # (a,)
        grow = new > self.capacity[rows]
        for row, needed in zip(rows[grow].tolist(), new[grow].tolist()):
            old_size = int(self.capacity[row])
            size = max(2 * old_size, 1 << (needed - 1).bit_length())
            # allocate the new buffer before freeing the old one: the copy needs both
            start = self.space.allocate(size)
            if old_size:
                self.space.free(int(self.start[row]), old_size)
            self.start[row] = start
            self.capacity[row] = size
        self.tokens[rows] = new

    def release(self, seqs) -> None:
        for seq in torch.as_tensor(seqs).reshape(-1).tolist():
            first = seq * self.rows_per_seq
            for row in (self.capacity[first:first + self.rows_per_seq] > 0).nonzero().squeeze(1).tolist():
                self.space.free(int(self.start[first + row]), int(self.capacity[first + row]))
            self.tokens[first:first + self.rows_per_seq] = 0
            self.capacity[first:first + self.rows_per_seq] = 0

    def allocated_slots(self) -> int:
        return self.space.top

    def metadata_bytes(self) -> int:
        # per buffer: address (8), capacity and count (4 each); per hole: address and size (8 each)
        return int((self.capacity > 0).sum()) * 16 + self.space.num_holes * 16

    def memory_map(self) -> dict:
        """Every live buffer (start, size, used, seq, layer, expert), hole and the top, to draw."""
        rows = (self.capacity > 0).nonzero().squeeze(1)
        seq, layer, expert = self.index.split(rows)
        return {
            "start": self.start[rows].numpy(), "size": self.capacity[rows].numpy(),
            "used": self.tokens[rows].numpy(), "seq": seq.numpy(),
            "layer": layer.numpy(), "expert": expert.numpy(),
            "hole_start": self.space.hole_starts.copy(), "hole_size": self.space.hole_sizes.copy(),
            "top": self.space.top,
        }
