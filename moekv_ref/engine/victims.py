"""Victim policies: which running request to preempt when a step's reservation does not fit.

One question, one method:

    choose_victim(candidates, memory, need) -> Request

candidates   the running requests the step has not scheduled yet, in the order they (re)joined the
             running batch (oldest first); it always includes the request being scheduled, so a
             policy may pick it (it then waits, and the others run)
memory       a read-only MemoryView: blocks and (layer, expert) token counts each sequence holds
need         how many more free blocks the step needs (>= 1)

The scheduler preempts the returned request (by recompute or swap), then asks again while the step
still does not fit. With per-device pools `need` is a `Shortage`: which device is short and by how
many blocks (with one pool, an int: device 0); `shortage_of(need)` reads either. A policy may also
return a `RowEviction`: some (layer, expert) rows of a candidate on the short device are dropped,
and the request stops until it is recomputed (scheduler.py performs it, on plain pages).

    newest_first     the most recently (re)admitted request (vLLM's rule; the default)
    sequence_lru     the same choice under its other name: least recently *started*, newest first
    expert_lru       the least recently appended rows on the short device (a cache per expert buffer)
    pressure_aware   the whole request that frees the most blocks on the short device per unit of
                     lost work (recomputed tokens, or blocks swapped)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory import MemoryView
from .request import Request


@dataclass(frozen=True)
class Shortage:
    """What a step lacks: `num_blocks` more free blocks on `device`; `request_need` is how many of
    them the request being scheduled (candidates[0]) would take there itself."""
    device: int
    num_blocks: int
    request_need: int = 0


def shortage_of(need) -> Shortage:
    """A Shortage from what the scheduler passed: a Shortage, or an int (one pool: device 0)."""
    return need if isinstance(need, Shortage) else Shortage(0, int(need))


@dataclass(frozen=True)
class RowEviction:
    """Drop the rows `layer_experts` ((layer, expert) pairs) of `request`. It cannot run again
    until its whole context is recomputed (a row at layer l is rebuilt only by re-running layers
    0..l over every token)."""
    request: Request
    layer_experts: tuple[tuple[int, int], ...]


class VictimPolicy:
    """Which of `candidates` to preempt. Subclasses answer `choose_victim`."""
    name = "victim"

    def choose_victim(self, candidates: Sequence[Request], memory: MemoryView, need: int) -> Request:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NewestFirst(VictimPolicy):
    """The newest running request: it has done the least work (the least prefill to recompute, the
    fewest blocks to swap), and the oldest ones, which have waited longest, keep their place."""
    name = "newest_first"

    def choose_victim(self, candidates, memory, need) -> Request:
        return candidates[-1]


class SequenceLRU(NewestFirst):
    """vLLM's whole-sequence choice under its name in the eviction literature: under continuous
    batching every running sequence is used at every step, so least-recently-used over sequences
    ties everywhere and comes down to the tie-break, the newest. Blind to *where* memory is short:
    the newest sequence may hold nothing on the short device, and then another must go, and another."""
    name = "sequence_lru"


class ExpertLRU(VictimPolicy):
    """What a cache per expert buffer would do: drop the least recently appended (sequence, layer,
    expert) row on the short device (ties: the newest request, then the lowest layer and expert).

    Low density is why this fits badly: each expert's buffer holds rows of many sequences and a
    sequence touches a given row only when a token is routed there, so the least recently used rows
    belong to sequences running right now, whose next token may need them. A sequence missing one
    row cannot run until the row is rebuilt, which takes the whole prefix through layers 0..l again:
    every row dropped costs a whole recompute and frees one row's blocks. When no candidate holds a
    row on the short device, the request being scheduled waits (whole)."""
    name = "expert_lru"

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)
        best, best_key = None, None
        for order, request in enumerate(candidates):
            last_used = memory.row_last_used(request.request_id)
            if last_used is None:
                raise ValueError("victim='expert_lru' drops single rows: it needs a scheduler that tracks and "
                                 "evicts rows (the engine's Scheduler on plain pages, without prefix caching)")
            counts = memory.token_counts([request.request_id])[0]                       # (L, E)
            on_short = (counts > 0) & (memory.device_of_expert == shortage.device)      # (L, E)
            for layer, expert in on_short.nonzero().tolist():
                key = (int(last_used[layer, expert]), -order, layer, expert)
                if best_key is None or key < best_key:
                    best, best_key = (request, layer, expert), key
        if best is None:
            return candidates[0]
        request, layer, expert = best
        return RowEviction(request, ((layer, expert),))


class PressureAware(VictimPolicy):
    """The whole request that frees the most blocks on the *short* device per unit of work lost:
    per token to recompute (recompute), or per block copied out and back (with a swap space). Room
    counts what it holds there, plus, for the request being scheduled, what its step would take
    there. Requests holding nothing on the short device are chosen only when none holds anything
    (then the request being scheduled waits). Ties: the newest. Whole requests, because a request
    missing one row cannot run (ExpertLRU)."""
    name = "pressure_aware"

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)

        def score(item):
            order, request = item
            held = memory.blocks_held_per_device(request.request_id)                    # (D,)
            room = int(held[shortage.device]) + (shortage.request_need if order == 0 else 0)
            if memory.has_swap_space:
                lost = max(1, int(held.sum()))
            else:
                lost = max(1, request.num_computed_tokens)
            return (room > 0, room / lost, order)

        order, request = max(enumerate(candidates), key=score)
        return request if score((order, request))[0] else candidates[0]


VICTIM_POLICIES = {cls.name: cls for cls in (NewestFirst, SequenceLRU, ExpertLRU, PressureAware)}
