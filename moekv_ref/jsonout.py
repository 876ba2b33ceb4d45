"""JSON as strict parsers read it, for every file the benchmarks write (figures/ among them).

JSON has no Infinity or NaN; Python's json module writes them unless told not to, and strict
parsers (JupyterLab's among them) then refuse the whole file. A number that is not finite is
written as null instead: bench eviction once wrote a measured swap link whose bytes cost nothing
measurable as swap_bytes_per_second = Infinity.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from .paths import output_path


def strict_json(value):
    """value with every float that is not finite replaced by None, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def dumps(value, **options) -> str:
    """json.dumps of strict_json(value), refusing anything else that is not JSON."""
    return json.dumps(strict_json(value), allow_nan=False, **options)


def dump(value, handle, **options) -> None:
    """dumps(value) written to an open text file."""
    handle.write(dumps(value, **options))


def write(path, value, **options) -> None:
    """dumps(value) (and a final newline) written to the file at path, its missing folders made."""
    output_path(path).write_text(dumps(value, **options) + "\n")


def source_commit() -> str:
    """The short commit of the checkout this package runs from, with -dirty where tracked files have
    changes ("unknown" outside a git checkout): what a result file records, so that a reader can
    tell which code produced it."""
    where = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=where, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=where,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if status.strip() else "")
