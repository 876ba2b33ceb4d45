"""Checks of command-line options, run right after parsing and before anything runs (no model loaded,
no file written): a bad value ends in `parser.error`, so the command prints its usage and one line

    python -m moekv_ref bench eviction: error: --host-blocks=-1 is not allowed; allowed: an integer >= 0 (...)

and exits with status 2, the status argparse gives an unknown choice. Each command module has a
`check_args(args)` that raises ValueError through these helpers; `cli.main` (and a module's own
`__main__`) turns that into `parser.error` with `parse_checked`.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import stat
import sys
import tempfile
from pathlib import Path

from ..paths import check_input_file, check_input_folder, kind_of, stat_named
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


def _mode_of_output(option: str, value, allowed: str) -> int | None:
    """st_mode of what is at an output path now (links followed), None when nothing is there."""
    try:
        return stat_named(value, f"{option}={value}").st_mode
    except FileNotFoundError:  # nothing there, a link to nothing, or a file where a folder should be
        return None
    except ValueError as error:  # a loop of symbolic links, or a path this user cannot look at
        raise ValueError(f"{error}; allowed: {allowed}") from None


def _nearest_existing(folder: Path) -> Path:
    """folder, or the closest folder above it that is there (where `mkdir(parents=True)` starts)."""
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def _can_create_in(option: str, value, folder: Path, label: str, allowed: str) -> None:
    """folder is a folder in which this process can create a file; else ValueError naming the option.

    Asked by creating a file, not with os.access(folder, os.W_OK): access() reads permission bits, so
    it says yes to root for any folder, and to folders that refuse new files all the same (sysfs, an
    access-control list, a network mount that maps root to nobody). tempfile.TemporaryFile creates a
    file without a name on Linux (O_TMPFILE), which nothing else sees and nothing can leave behind,
    and elsewhere a named one it removes at once: a run that fails later finds its folder as it was."""
    try:
        check_input_folder(folder, label)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{error}; allowed: {allowed}") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"{option}={value}: this user cannot create files in {folder} ({error.strerror}); "
            f"allowed: {allowed}"
        ) from None


def folder(option: str, value) -> None:
    """A folder to write into: made if missing, but not a path that is already a file; checked by
    creating (and at once dropping) a file in it, or in the folder that would hold it."""
    if value is None:
        return
    allowed = "a folder this user can write in (made if missing)"
    mode = _mode_of_output(option, value, allowed)
    if mode is not None and not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
        raise ValueError(f"{option}={value} is {what}; allowed: a folder (made if missing)")
    path = Path(value)
    above = _nearest_existing(path)
    label = f"{option}={value}" if above == path else f"{option}={value} cannot be made: {above}"
    _can_create_in(option, value, above, label, allowed)


def output_file(option: str, value, parents_made: bool = False) -> None:
    """A file the command writes at its end: checked now, so that a long run does not end in an
    error. Not a folder; its folder must exist unless the command makes it (parents_made), and this
    user must be able to create a file there, or to write the file that is there already. Nothing is
    written or left behind by the check."""
    if value is None:
        return
    allowed = (
        "a file in a folder this user can write in (made if missing)"
        if parents_made
        else "a file in an existing folder this user can write in"
    )
    mode = _mode_of_output(option, value, allowed)
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{option}={value} is a folder; allowed: a file path")
    if mode is not None:
        _can_write_over(option, value, mode, allowed)
        return
    path = Path(value)
    if os.path.islink(path):  # a link to nothing: writing creates the file it points to
        path = Path(os.path.realpath(path))
    parent = path.parent
    above = _nearest_existing(parent) if parents_made else parent
    if above == parent:
        label = f"{option}={value}: its folder {parent}"
    else:
        label = f"{option}={value}: its folder {parent} cannot be made: {above}"
    _can_create_in(option, value, above, label, allowed)


def _can_write_over(option: str, value, mode: int, allowed: str) -> None:
    """An output that is there already (not a folder) can be written. A regular file is opened for
    writing as the command will open it, but without O_CREAT or O_TRUNC: nothing is made and nothing
    it holds is lost. Anything else (a FIFO, a device) is asked with os.access, since opening a FIFO
    waits for a reader and opening a device may act on it."""
    try:
        if stat.S_ISREG(mode):
            os.close(os.open(value, os.O_WRONLY | os.O_APPEND))
        elif not os.access(value, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as error:
        raise ValueError(
            f"{option}={value} cannot be written ({error.strerror}); allowed: {allowed}"
        ) from None


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


def signed_values(argv=None) -> list[str]:
    """argv (None: sys.argv[1:]) with each `--option VALUE` whose VALUE is a number written with a
    leading minus (-inf, -1e3, -nan) joined into `--option=VALUE`. argparse reads only -1 and -0.5 as
    negative numbers and takes any other word that starts with "-" for an option, so that
    `--temperature -inf` would end in "expected one argument" instead of the option's own rule."""
    argv = list(sys.argv[1:] if argv is None else argv)
    joined = []
    i = 0
    while i < len(argv):
        word = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if word.startswith("--") and "=" not in word and following.startswith("-") and _is_number(following):
            joined.append(f"{word}={following}")
            i += 2
        else:
            joined.append(word)
            i += 1
    return joined


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def parse_checked(parser: argparse.ArgumentParser, argv=None, check=None) -> argparse.Namespace:
    """parser.parse_args(argv), then check(args) (a module's check_args) with a ValueError turned into
    parser.error: usage and `error: ...` on stderr, exit status 2, before the command runs. A negative
    number after an option is its value (signed_values)."""
    args = parser.parse_args(signed_values(argv))
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
