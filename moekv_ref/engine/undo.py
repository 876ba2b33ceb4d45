"""Undo for one engine step: remember the scheduler's state, put it back if the step raises.

A step changes many small objects (queues, request counters, the block manager's tables, the swap
space, the predictor, the policies' and prefix cache's state); undoing each change by hand is how a
request gets lost. So the engine takes a `Snapshot` at two points of a step and, if anything after
it raises, restores every object it reached, in place (every reference stays valid):

    before schedule()   nothing has moved K/V yet: the state is exactly the one before the step
    before the forward  after the block copies: a later fault frees the blocks the forward took and
                        gives finishing requests theirs back (nothing allocates after the forward);
                        the first one again if scheduling moved no request and freed no block

A snapshot copies the attributes of the scheduler and, recursively, of every object of this package
they reach (tensors cloned, containers copied). Not copied: frozen dataclasses, objects of other
packages (the engine restores the torch generators that sampled), and attributes a class lists in
`_UNDO_SHARED`, which never change after construction. The cost is a copy of the bookkeeping: a few
kilobytes of integers for the embedded model, small beside a forward.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque

import torch

_PACKAGE = __name__.split(".")[0]
_KEPT = {int, float, bool, str, bytes, type(None)}  # by reference: atoms, and classes found not to be state
_STATE_KINDS: dict[type, bool] = {}  # class -> whether its objects are state


class Snapshot:
    def __init__(self, root: object):
        self._saved: dict[int, tuple[object, dict]] = {}
        self._pending = [root]
        while self._pending:
            obj = self._pending.pop()
            if id(obj) in self._saved:
                continue
            shared = getattr(type(obj), "_UNDO_SHARED", ())
            # atoms inline: most attributes are ints and strings, and a call each was most of the cost
            self._saved[id(obj)] = (
                obj,
                {
                    name: value if type(value) in _KEPT or name in shared else self._copy(value)
                    for name, value in vars(obj).items()
                },
            )

    def restore(self) -> None:
        """Once only: the saved copies become the objects' state."""
        for obj, values in self._saved.values():
            obj.__dict__.clear()
            obj.__dict__.update(values)
        self._saved = {}

    def _copy(self, value):
        kind = type(value)
        if kind in _KEPT:
            return value
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (list, set)):  # token ids, free slots: atoms, usually
            if _KEPT.issuperset(map(type, value)):  # then one copy in C
                return kind(value)
            return kind(v if type(v) in _KEPT else self._copy(v) for v in value)
        if isinstance(value, deque):
            return deque((self._copy(v) for v in value), maxlen=value.maxlen)
        if isinstance(value, dict):
            return type(value)((k, self._copy(v)) for k, v in value.items())
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v) for v in value)
        if self._is_state(value):
            self._pending.append(value)  # restored in place: the reference stays
        else:
            _KEPT.add(kind)  # not a container, not state: kept, decided once
        return value

    @staticmethod
    def _is_state(value) -> bool:
        """An object of this package with attributes, not an enum member, a frozen dataclass or a
        network module (weights are never a step's state)."""
        kind = type(value)
        if kind not in _STATE_KINDS:  # a property of the class: decided once per class
            _STATE_KINDS[kind] = (
                kind.__module__.startswith(_PACKAGE + ".")
                and hasattr(value, "__dict__")
                and not issubclass(kind, (enum.Enum, torch.nn.Module))
                and not (dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen)
            )
        return _STATE_KINDS[kind]
