"""Files and folders a person names to be read (a checkpoint, another checkout's root), checked in
one place so that each problem reads the same wherever it is found, and says what it is:

    'x.pt' does not exist                              nothing there, or a link to nothing
    'x.pt' leads into a loop of symbolic links         following the links never ends (ELOOP)
    'x.pt' is a FIFO (named pipe), not a regular file  likewise a socket or a device
    'x.pt' is a directory, not a regular file
    'x.pt' is empty (0 bytes)

os.stat (which follows links) is asked once and its answer read: Path.exists() answers False for a
loop of links, which reads as "does not exist", and a FIFO's or a device's size is 0, which reads
as "empty".

Files a program writes go through `output_path`, which makes their missing folders.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# st_mode tests and what they say a path is, in the order asked
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def kind_of(mode: int) -> str:
    """What an st_mode says a path is, in words ("a FIFO (named pipe)")."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return "neither a file nor a directory"


def stat_named(path, name: str, error: type[Exception] = ValueError) -> os.stat_result:
    """os.stat(path), following links; if that fails, one error naming `name` (e.g. "checkpoint
    'x.pt'", "--against=x") and why: FileNotFoundError when nothing is there, `error` otherwise."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileNotFoundError(
                f"{name} does not exist: it is a symbolic link to {os.readlink(path)!r}, where nothing is"
            ) from None
        raise FileNotFoundError(f"{name} does not exist") from None
    except NotADirectoryError:
        raise FileNotFoundError(
            f"{name} does not exist: a part of its path is a file, not a folder"
        ) from None
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise error(
                f"{name} leads into a loop of symbolic links: following them never reaches a file"
            ) from None
        raise error(f"{name} cannot be looked at: {failure.strerror}") from None


def check_input_file(path, name: str, error: type[Exception] = ValueError) -> None:
    """A file to read: there, a regular file (not a folder, FIFO, socket or device) and not empty.
    FileNotFoundError when nothing is there, `error` (a ValueError by default) for the rest."""
    mode_and_size = stat_named(path, name, error)
    if not stat.S_ISREG(mode_and_size.st_mode):
        raise error(f"{name} is {kind_of(mode_and_size.st_mode)}, not a regular file")
    if mode_and_size.st_size == 0:
        raise error(f"{name} is empty (0 bytes)")


def check_input_folder(path, name: str, error: type[Exception] = ValueError) -> None:
    """A folder to read from: there, and a folder (links followed). FileNotFoundError when nothing is
    there, `error` for the rest."""
    mode = stat_named(path, name, error).st_mode
    if not stat.S_ISDIR(mode):
        raise error(f"{name} is {kind_of(mode)}, not a directory")


def output_path(path) -> Path:
    """A file about to be written, as a Path, with its missing parent folders made first: every
    program's --json, --out and figure files go through it, so that `--json runs/x.json` works in a
    fresh clone, which has no runs/ (options.output_file checked before the run that they can be made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
