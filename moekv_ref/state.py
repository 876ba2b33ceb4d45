"""What a step can change, said by each class that holds it (for the engine's step undo, engine/undo.py).

A class whose objects a step changes lists those attributes in STATE, and the attributes holding
objects that keep state of their own in PARTS. `save` copies the first and asks the second;
`restore` puts both back, in place: the object and its parts stay the same objects, so every
reference to them stays valid. Attributes set once by the constructor (sizes, placements, the
configuration, references to the objects a class works with but does not own) are not listed:
nothing in a step changes them. A class that adds an attribute a step changes lists it in STATE;
tests/spec/test_step_atomic.py compares every attribute before a failed step and after its undo, so a
forgotten one shows.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch


def copied(value):
    """A copy that later in-place changes to `value` do not reach: tensors cloned; lists, sets,
    dicts and deques copied with their items copied; numbers, strings, tuples and objects
    (requests, records that are never changed in place) by reference."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, set)):
        return type(value)(copied(item) for item in value)
    if isinstance(value, deque):
        return deque((copied(item) for item in value), maxlen=value.maxlen)
    if isinstance(value, (dict, OrderedDict)):
        return type(value)((key, copied(item)) for key, item in value.items())
    return value


class Stateful:
    STATE: tuple[str, ...] = ()  # attributes a step changes
    PARTS: tuple[str, ...] = ()  # attributes holding Stateful objects this one owns (or None)

    def save(self) -> tuple:
        """A copy of this object's state and its parts', for `restore`."""
        own = tuple(copied(getattr(self, name)) for name in self.STATE)
        parts = tuple(
            None if getattr(self, name) is None else getattr(self, name).save() for name in self.PARTS
        )
        return own, parts

    def restore(self, saved: tuple) -> None:
        """Once per `save`: its copies become this object's state again (and its parts')."""
        own, parts = saved
        for name, value in zip(self.STATE, own):
            setattr(self, name, value)
        for name, part in zip(self.PARTS, parts):
            if part is not None:
                getattr(self, name).restore(part)
