"""Victim policies: which running request to preempt when a step's reservation does not fit.

    choose_victim(candidates, memory, need) -> Request, or a RowEviction

candidates: the running requests the step has not scheduled yet, oldest first, always including the
request being scheduled (picking it makes it wait); memory: a read-only MemoryView; need: a
`Shortage`. The scheduler preempts the answer and asks again while the step does not fit.

    newest_first, sequence_lru, expert_lru, pressure_aware    online (newest_first: the default)
    oracle, belady    offline: they read a routing trace's future (a FutureView, sim/runner.py)

A policy may also veto admissions (`admits`); only the oracle does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ..state import Stateful
from .memory import MemoryView
from .request import Request


@dataclass(frozen=True)
class Shortage:
    """A step lacks `num_blocks` free blocks on `device`; the request being scheduled
    (candidates[0]) would take `request_need` of them itself."""

    device: int
    num_blocks: int
    request_need: int = 0


def check_victim(policy: "VictimPolicy", victim, candidates: Sequence[Request]) -> None:
    """RuntimeError where the victim `policy` chose is not one of the candidates."""
    if not any(victim is c for c in candidates):
        raise RuntimeError(
            f"victim policy {policy!r} chose request "
            f"{getattr(victim, 'request_id', victim)!r}, not one of the candidates"
        )


def shortage_of(need) -> Shortage:
    """A Shortage, or an int read as device 0 (for a policy called by hand)."""
    return need if isinstance(need, Shortage) else Shortage(0, int(need))


@dataclass(frozen=True)
class RowEviction:
    """Drop the (layer, expert) rows `layer_experts` of `request`, which then cannot run until its
    whole context is recomputed (a row at layer l is rebuilt only by re-running layers 0..l)."""

    request: Request
    layer_experts: tuple[tuple[int, int], ...]


class VictimPolicy(Stateful):
    # a policy that remembers something across steps lists it in STATE (moekv_ref/state.py)

    name = "victim"
    evicts_rows = False  # True: may answer a RowEviction, which needs a manager that can_evict_rows

    def choose_victim(
        self, candidates: Sequence[Request], memory: MemoryView, need: Shortage | int
    ) -> Request | RowEviction:
        """need: the step's Shortage (an int is read as that many blocks on device 0: shortage_of)."""
        raise NotImplementedError

    def admits(self, request: Request, running: Sequence[Request], memory: MemoryView) -> bool:
        """Asked after the admission policy agreed."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NewestFirst(VictimPolicy):
    """The newest running request (vLLM's rule): it has done the least work, and the oldest, which
    have waited longest, keep their place."""

    name = "newest_first"

    def choose_victim(self, candidates, memory, need) -> Request:
        return candidates[-1]


class SequenceLRU(NewestFirst):
    """LRU over whole sequences: every running sequence is used at every step, so it ties and the
    tie-break, the newest, decides. Blind to *where* memory is short: the newest may hold nothing
    on the short device, and then another must go, and another."""

    name = "sequence_lru"


class ExpertLRU(VictimPolicy):
    """What a cache per expert buffer would do: drop the least recently appended (sequence, layer,
    expert) row on the short device (ties: the newest request, then the lowest layer and expert).
    It fits badly: the least recently used rows belong to sequences running now, and each dropped
    row costs a whole recompute. With no row on the short device, the scheduled request waits."""

    name = "expert_lru"
    evicts_rows = True

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)
        keys = []
        for order, request in enumerate(candidates):
            last_used = memory.row_last_used(request.request_id)
            counts = memory.token_counts([request.request_id])[0]  # (L, E)
            devices = memory.placement.of_sequences([request.request_id])[0]  # (L, E) its rows'
            on_short = (counts > 0) & (devices == shortage.device)  # (L, E)
            keys += [
                (int(last_used[layer, expert]), -order, layer, expert)
                for layer, expert in on_short.nonzero().tolist()
            ]
        if not keys:
            return candidates[0]
        _, order, layer, expert = min(keys)
        return RowEviction(candidates[-order], ((layer, expert),))


def room_and_lost_work(
    order: int, request: Request, memory: MemoryView, shortage: Shortage
) -> tuple[int, int]:
    """(blocks preempting candidates[order] frees on the short device, with its own step's need
    for order 0; the work lost, >= 1: tokens to recompute, or blocks to swap)."""
    held = memory.blocks_held_per_device(request.request_id)  # (D,)
    room = int(held[shortage.device]) + (shortage.request_need if order == 0 else 0)
    lost = int(held.sum()) if memory.has_swap_space else request.num_computed_tokens
    return room, max(1, lost)


def most_per_lost_work(candidates, memory: MemoryView, shortage: Shortage, value) -> Request:
    """The candidate with the most value(request, room) per work lost among those making room on
    the short device (ties: the newest); candidates[0] if none does."""

    def score(item):
        room, lost = room_and_lost_work(*item, memory, shortage)
        return (room > 0, (value(item[1], room) if room > 0 else 0) / lost, item[0])

    order, request = max(enumerate(candidates), key=score)
    return request if score((order, request))[0] else candidates[0]


class PressureAware(VictimPolicy):
    """The whole request freeing the most blocks on the *short* device per unit of work lost (ties:
    the newest). If none frees any there, the request being scheduled waits."""

    name = "pressure_aware"

    def choose_victim(self, candidates, memory, need):
        return most_per_lost_work(candidates, memory, shortage_of(need), lambda request, room: room)


class FutureView(Protocol):
    """What the offline policies read of a trace's future (sim/runner.py's TraceFuture)."""

    def future_block_steps(self, request: Request, device: int) -> int:
        """Blocks the request will hold on `device`, summed over its remaining steps."""

    def fits_to_completion(self, request: Request, running: Sequence[Request]) -> bool:
        """Would the reservations of `request` and every running request, each running to its end,
        fit every device at every future step?"""


class OfflinePolicy(VictimPolicy):
    """A policy that reads the future, for trace replay only."""

    def __init__(self, future: FutureView | None = None):
        if future is None:
            raise ValueError(
                f"victim={self.name!r} reads the future of a routing trace: give it future=, a "
                "FutureView (sim/runner.py's trace runner builds one); the engine serving live "
                "requests has no future to give, so use an online policy there: "
                f"{[name for name, cls in VICTIM_POLICIES.items() if not issubclass(cls, OfflinePolicy)]}"
            )
        self.future = future


class Oracle(OfflinePolicy):
    """Admit only what `future.fits_to_completion` says fits, so nothing admitted is preempted (a
    heuristic, not the best schedule). If a step is short anyway: the request with the most tokens
    still to generate (Belady's rule: the one needed furthest into the future)."""

    name = "oracle"

    def admits(self, request, running, memory):
        return self.future.fits_to_completion(request, running)

    def choose_victim(self, candidates, memory, need):
        return max(
            enumerate(candidates),
            key=lambda item: (item[1].max_new_tokens - len(item[1].output_token_ids), item[0]),
        )[1]


class Belady(OfflinePolicy):
    """Eviction that knows the future; admission as the online policies'. Belady's rule (Belady
    1966: evict the page next used furthest away) has no direct analogue, since every running
    request is used at every step; so: among the requests making room on the short device, the most
    *block-steps still to come there* per work lost (one about to finish frees its blocks soon)."""

    name = "belady"

    def choose_victim(self, candidates, memory, need):
        shortage = shortage_of(need)
        device, steps = shortage.device, self.future.future_block_steps
        return most_per_lost_work(candidates, memory, shortage, lambda r, room: steps(r, device))


VICTIM_POLICIES = {
    cls.name: cls for cls in (NewestFirst, SequenceLRU, ExpertLRU, PressureAware, Oracle, Belady)
}
