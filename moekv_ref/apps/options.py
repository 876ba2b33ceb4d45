"""Checks of command-line options, run right after parsing and before anything runs (no model loaded,
no file written): a bad value ends in `parser.error`, so the command prints its usage and one line

    python -m moekv_ref bench eviction: error: --host-blocks=-1 is not allowed; allowed: an integer >= 0 (...)

and exits with status 2, the status argparse gives an unknown choice. Each command module has a
`check_args(args)` that raises ValueError through these helpers; `cli.main` (and a module's own
`__main__`) turns that into `parser.error` with `parse_checked`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..validation import MAX_BLOCKS, check_block_size, check_int, check_real, check_seed


def count(option: str, value, minimum: int = 1, maximum: int | None = None, meaning: str = "") -> None:
    """An integer option in [minimum, maximum] (None: not given, nothing to check). `meaning` says what
    a special value means, e.g. "0: recompute only"."""
    if value is not None:
        check_int(option, value, minimum, maximum, meaning)


def blocks(option: str, value, minimum: int = 1, meaning: str = "") -> None:
    """A count of blocks: an integer from minimum to what a block table (int32) can name."""
    count(option, value, minimum, MAX_BLOCKS, meaning)


def real(
    option: str,
    value,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    meaning: str = "",
) -> None:
    """A finite number option in the interval from low to high (open at an end where *_open is set)."""
    if value is not None:
        check_real(option, value, low, high, low_open, high_open, meaning)


def block_size(option: str, value) -> None:
    """Tokens per block: a power of two, at most validation.MAX_BLOCK_SIZE."""
    if value is not None:
        check_block_size(value, option)


def seed(option: str, value) -> None:
    if value is not None:
        check_seed(option, value)


def folder(option: str, value) -> None:
    """A folder to write into: made if missing, but not a path that is already a file."""
    if value is not None and Path(value).exists() and not Path(value).is_dir():
        raise ValueError(f"{option}={value} is a file; allowed: a folder (made if missing)")


def output_file(option: str, value, parents_made: bool = False) -> None:
    """A file the command writes at its end: checked now, so that a long run does not end in an
    error. Not a folder; its folder must exist unless the command makes it (parents_made)."""
    if value is None:
        return
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{option}={value} is a folder; allowed: a file path")
    if not parents_made and not path.parent.is_dir():
        raise ValueError(
            f"{option}={value}: its folder {path.parent} does not exist; allowed: a file in an "
            "existing folder"
        )


def parse_checked(parser: argparse.ArgumentParser, argv=None, check=None) -> argparse.Namespace:
    """parser.parse_args(argv), then check(args) (a module's check_args) with a ValueError turned into
    parser.error: usage and `error: ...` on stderr, exit status 2, before the command runs."""
    args = parser.parse_args(argv)
    fail_on(parser, check, args)
    return args


def fail_on(parser: argparse.ArgumentParser, check, args: argparse.Namespace) -> None:
    """check(args), a ValueError becoming parser.error (exit status 2)."""
    if check is None:
        return
    try:
        check(args)
    except ValueError as error:
        parser.error(str(error))
