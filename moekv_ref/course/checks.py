"""What every exercise check shares: the first word of its message, and its paragraph wrapped at a
notebook's width.

Every check returns a message starting with RIGHT or WRONG (or MISSING for the placeholder the
notebooks are saved with), so a notebook cell just prints it.
"""

from __future__ import annotations

import functools
import textwrap

RIGHT = "Right"
WRONG = "Not yet"
MISSING = "No answer yet"


def wrapped(check):
    """Checks return one paragraph; wrap it at 100 columns so that it reads at notebook width."""

    @functools.wraps(check)
    def wrapped_check(*args, **kwargs):
        return textwrap.fill(check(*args, **kwargs), width=100)

    return wrapped_check


def close(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * abs(target)
