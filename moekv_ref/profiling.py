"""Where a step's time goes: named phases timed in CPU time, for `bench step --profile`.

The forward and the engine mark their phases where they happen (`with phase("attend"): ...`); outside `collect()`,
`phase` returns one shared null context (well under a microsecond), so the marks stay in the code.
CPU time because the machines are shared: with one thread it is the phase's own work. Named scopes
rather than torch.profiler, which splits Python around small tensor ops into hundreds of ops with
their own overhead. Phases do not nest, except "forward", which encloses the model's phases so
that what the forward spends outside them can be told.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

_NULL = nullcontext()
_totals: dict[str, float] | None = None  # phase -> seconds, while collect() is active


class _Timed:
    __slots__ = ("name", "start")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.start = time.process_time()

    def __exit__(self, *exc):
        _totals[self.name] = _totals.get(self.name, 0.0) + time.process_time() - self.start


def phase(name: str):
    """A context that adds its CPU time to `name` while collecting; a no-op otherwise."""
    return _NULL if _totals is None else _Timed(name)


@contextmanager
def collect():
    """Collect phase times inside the block; yields the dict (phase -> seconds) they add up in."""
    global _totals
    if _totals is not None:
        raise RuntimeError("phase times are already being collected")
    _totals = totals = {}
    try:
        yield totals
    finally:
        _totals = None
