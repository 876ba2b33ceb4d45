"""Victim policies: which running request to preempt when a step's reservation does not fit.

One question, one method:

    choose_victim(candidates, memory, need) -> Request

candidates   the running requests the step has not scheduled yet, in the order they (re)joined the
             running batch (oldest first); it always includes the request being scheduled, so a
             policy may pick it (it then waits, and the others run)
memory       a read-only MemoryView: blocks and (layer, expert) token counts each sequence holds
need         a `Shortage`: which device is short (0 with one pool) and by how many blocks (>= 1)

The scheduler preempts the returned request (by recompute or swap), then asks again while the step
still does not fit. (`shortage_of(need)` also reads a bare int as device 0, for a policy called by
hand.) A policy may also
return a `RowEviction`: some (layer, expert) rows of a candidate on the short device are dropped,
and the request stops until it is recomputed (scheduler.py performs it, on plain pages).

    newest_first     the most recently (re)admitted request (vLLM's rule; the default)
    sequence_lru     least recently used over whole sequences, which under continuous batching ties
                     (every running sequence is used every step): the tie-break, the newest, decides
    expert_lru       the least recently appended rows on the short device (a cache per expert buffer)
    pressure_aware   the whole request that frees the most blocks on the short device per unit of
                     lost work (recomputed tokens, or blocks swapped)
    oracle, belady   offline heuristics that read the future of a routing trace (a FutureView, built
                     by the trace runner, sim/eviction.py): the engine serving live requests has no
                     future to give them, and constructing them without one raises

A policy may also veto admissions (`admits(request, running, memory)`, consulted by continuous
batching with the admission policy); only the oracle does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

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

    def admits(self, request: Request, running: Sequence[Request], memory: MemoryView) -> bool:
        """May `request` join `running` (asked after the admission policy agreed)? Yes, but for the
        oracle: choosing victims and admitting are separate decisions."""
        return True

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
            devices = memory.device_of_expert_of([request.request_id])[0]              # (L, E) its rows'
            on_short = (counts > 0) & (devices == shortage.device)                       # (L, E)
            for layer, expert in on_short.nonzero().tolist():
                key = (int(last_used[layer, expert]), -order, layer, expert)
                if best_key is None or key < best_key:
                    best, best_key = (request, layer, expert), key
        if best is None:
            return candidates[0]
        request, layer, expert = best
        return RowEviction(request, ((layer, expert),))


def room_and_lost_work(order: int, request: Request, memory: MemoryView, shortage: Shortage) -> tuple[int, int]:
    """What preempting candidates[order] gives and costs: (blocks it makes free on the short device:
    those it holds there, plus, for the request being scheduled (order 0), what its step would take
    there; the work lost, >= 1: its tokens to recompute, or, with a swap space, its blocks to copy)."""
    held = memory.blocks_held_per_device(request.request_id)                            # (D,)
    room = int(held[shortage.device]) + (shortage.request_need if order == 0 else 0)
    lost = int(held.sum()) if memory.has_swap_space else request.num_computed_tokens
    return room, max(1, lost)


class PressureAware(VictimPolicy):
    """The whole request that frees the most blocks on the *short* device per unit of work lost
    (room_and_lost_work). Requests holding nothing on the short device are chosen only when none
    holds anything (then the request being scheduled waits). Ties: the newest. Whole requests,
    because a request missing one row cannot run (ExpertLRU)."""
    name = "pressure_aware"

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)

        def score(item):
            room, lost = room_and_lost_work(*item, memory, shortage)
            return (room > 0, room / lost, item[0])

        order, request = max(enumerate(candidates), key=score)
        return request if score((order, request))[0] else candidates[0]


class FutureView(Protocol):
    """What the offline policies read of the future, for requests replayed from a routing trace
    (sim/eviction.py's TraceFuture)."""

    def future_block_steps(self, request: Request, device: int) -> int:
        """Blocks the request will hold on `device`, summed over its remaining steps if it keeps
        running."""

    def fits_to_completion(self, request: Request, running: Sequence[Request]) -> bool:
        """Would the scheduler's reservations of `request` and every running request, each running
        to its end one token a step, fit every device at every future step?"""


class OfflinePolicy(VictimPolicy):
    """A policy that reads the future (`future`: a FutureView), for trace replay only."""

    def __init__(self, future: FutureView | None = None):
        if future is None:
            raise ValueError(f"victim={self.name!r} reads the future of a routing trace: give it future=, a "
                             "FutureView (sim/eviction.py's trace runner builds one); the engine serving live "
                             "requests has no future to give, so use an online policy there: "
                             f"{[name for name, cls in VICTIM_POLICIES.items() if not issubclass(cls, OfflinePolicy)]}")
        self.future = future


class Oracle(OfflinePolicy):
    """Admission that knows the future: admit a request only if the future trace says that its
    reservations and every running request's, each running to completion, fit every device at every
    future step (`future.fits_to_completion`). Then nothing admitted is ever preempted, so no work
    is lost; what it gives up is the requests it holds back (a heuristic, not the best schedule). If
    a step were short anyway it takes the request with the most tokens still to generate (Belady's
    rule: the one needed furthest into the future)."""
    name = "oracle"

    def admits(self, request, running, memory):
        return self.future.fits_to_completion(request, running)

    def choose_victim(self, candidates, memory, need):
        return max(enumerate(candidates),
                   key=lambda item: (item[1].max_new_tokens - len(item[1].output_token_ids), item[0]))[1]


class Belady(OfflinePolicy):
    """Eviction that knows the future; admission as the online policies' (whatever fits the next
    step), so unlike `oracle` it never holds requests back.

    Belady's rule for a page cache (Belady 1966: evict the page whose next use is furthest away) has
    no direct analogue here, since every running request is used at every step; what the future
    does tell is how long each request will keep occupying the short device. So: among the requests
    making room there, the one with the most *block-steps still to come on the short device* (the
    blocks it will hold there at each of its remaining steps, summed: `future.future_block_steps`)
    per unit of work lost (room_and_lost_work). One about to finish frees its blocks soon anyway and
    is kept; one that will sit on the short device for long goes, unless it is costly to redo."""
    name = "belady"

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)

        def score(item):
            room, lost = room_and_lost_work(*item, memory, shortage)
            future = self.future.future_block_steps(item[1], shortage.device) if room > 0 else 0
            return (room > 0, future / lost, item[0])

        order, request = max(enumerate(candidates), key=score)
        return request if score((order, request))[0] else candidates[0]


VICTIM_POLICIES = {cls.name: cls for cls in (NewestFirst, SequenceLRU, ExpertLRU, PressureAware, Oracle, Belady)}
