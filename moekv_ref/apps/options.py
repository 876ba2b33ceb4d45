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

from ..paths import check_input_file, check_input_folder
from ..sampling import MAX_SEED


def count(option: str, value, minimum: int = 1, maximum: int | None = None, meaning: str = "") -> None:
    """An integer option in [minimum, maximum] (None: not given, nothing to check). `meaning` says what
    a special value means, e.g. "0: recompute only"."""
    if value is None:
        return
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(
            f"{option}={value} is not allowed; allowed: an integer {bound}"
            + (f" ({meaning})" if meaning else "")
        )


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
    if value is None:
        return
    inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not (math.isfinite(value) and inside):
        left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        interval = f"{left}{low:g}, {'inf' if high == math.inf else format(high, 'g')}{right}"
        raise ValueError(
            f"{option}={value} is not allowed; allowed: a finite number in {interval}"
            + (f" ({meaning})" if meaning else "")
        )


def block_size(option: str, value) -> None:
    """Tokens per block: a power of two (cache.kv_cache_manager.check_block_size)."""
    if value is not None and (value < 1 or value & (value - 1)):
        raise ValueError(f"{option}={value} is not allowed; allowed: a power of two (1, 2, 4, ..., 256)")


def seed(option: str, value) -> None:
    count(option, value, 0, MAX_SEED, "a seed for torch.Generator")


def distinct(option: str, values, why: str = "each value runs once") -> None:
    """A list option (nargs="+") without repeats: a repeated seed, rate or policy would run again (or
    be read back from the first run) and count twice in a mean, a spread or a count of runs. Values
    compare as parsed, so `--rates 150 150.0` repeats 150.0."""
    if values is None:
        return
    seen = []
    for value in values:
        if value in seen:
            given = " ".join(str(v) for v in values)
            raise ValueError(
                f"{option}={given} is not allowed: {value} is given twice; allowed: distinct values ({why})"
            )
        seen.append(value)


def input_file(option: str, value, allowed: str) -> None:
    """A file the command reads (paths.check_input_file: there, a regular file, not empty), its
    message ending in what is `allowed`."""
    if value is None:
        return
    try:
        check_input_file(value, f"{option}={value}")
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{error}; allowed: {allowed}") from None


def input_folder(option: str, value, allowed: str) -> None:
    """A folder the command reads from (paths.check_input_folder), its message ending in what is
    `allowed`."""
    if value is None:
        return
    try:
        check_input_folder(value, f"{option}={value}")
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{error}; allowed: {allowed}") from None


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


def utf8_text(option: str, value) -> None:
    """Text to be encoded as UTF-8. Python decodes sys.argv with the locale's encoding and keeps each
    byte it cannot decode as a lone surrogate (b"\\xff" becomes "\\udcff"), which UTF-8 cannot encode:
    without this check the codec's own error names no option."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = value[error.start : error.end]
        try:  # the bytes the command line held, for surrogates that stand for them
            raw = bad.encode("utf-8", "surrogateescape")
            listed = " ".join(f"0x{byte:02x}" for byte in raw)
            found = f"byte {listed} is" if len(raw) == 1 else f"bytes {listed} are"
            found = f"{found} not valid UTF-8"
        except UnicodeEncodeError:  # a lone surrogate passed in from Python, not from a command line
            found = f"the lone surrogate {ascii(bad)} has no UTF-8 encoding"
        raise ValueError(
            f"{option} is not UTF-8 text: at character {error.start}, {found}; allowed: UTF-8 text"
        ) from None


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
