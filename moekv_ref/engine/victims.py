"""Victim policies: which running request to preempt when a step's reservation does not fit.

One question, one method:

    choose_victim(candidates, memory, need) -> Request

candidates   the running requests the step has not scheduled yet, in the order they (re)joined the
             running batch (oldest first); it always includes the request being scheduled, so a
             policy may pick it (it then waits, and the others run)
memory       a read-only MemoryView: blocks and (layer, expert) token counts each sequence holds
need         how many more free blocks the step needs (>= 1)

The scheduler preempts the returned request (by recompute or swap), then asks again while the step
still does not fit. A policy that frees memory of one device of several will need to be told which
pool is short; that goes into `need` when pools are split.

    newest_first   the most recently (re)admitted request (vLLM's rule; the default)
"""

from __future__ import annotations

from typing import Sequence

from .memory import MemoryView
from .request import Request


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


VICTIM_POLICIES = {"newest_first": NewestFirst}
