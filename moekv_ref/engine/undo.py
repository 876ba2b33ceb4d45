"""Undo for one engine step: remember the scheduler's state, put it back if the step raises.

A step changes many small objects (queues, request counters, the block manager's tables, the swap
space, the predictor, the policies' and prefix cache's state); undoing each change by hand is how a
request gets lost. So the engine takes a `Snapshot` at two points of a step and, if anything after
it raises, restores every object's state in place (every reference stays valid):

    before schedule()   nothing has moved K/V yet: the state is exactly the one before the step
    before the forward  after the block copies: a later fault frees the blocks the forward took and
                        gives finishing requests theirs back (nothing allocates after the forward);
                        the first one again if scheduling moved no request and freed no block

What a snapshot copies, each class says (moekv_ref/state.py): the Scheduler its queues and counters,
its unfinished requests' state, and its parts' (the KV cache manager with its block pool and parts,
the swap space, the predictor, the policies), each of those its own. The engine restores the torch
generators that sampled. The cost is a copy of the bookkeeping: a few kilobytes of integers for the
embedded model, small beside a forward.
"""

from __future__ import annotations


class Snapshot:
    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._saved = scheduler.save()

    def restore(self) -> None:
        """The saved copies become the objects' state; again, nothing (the engine may restore the
        snapshot the forward was undone to once more, when it starts the step over)."""
        if self._saved is not None:
            self._scheduler.restore(self._saved)
            self._saved = None
