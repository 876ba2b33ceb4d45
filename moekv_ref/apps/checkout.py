"""Running code against another checkout of this repository, importing that checkout's files and
no others: what `bench step --against DIR` and `bench simulator --against DIR` time.

This repository is installed in editable mode, and the installer's import finder (the `__editable__`
finder in site-packages) answers for `moekv_ref` and `moekv_kernels` from this checkout. Putting
DIR first on PYTHONPATH is not enough: every module DIR lacks is then filled in from here, so an
empty `moekv_ref/__init__.py` in DIR times this checkout's code under DIR's name and reports "the
same decisions". So a worker runs under `python -I` (no PYTHONPATH, no user site, not the current
folder), with `PRELUDE` first: an import finder that looks for those two packages in DIR alone, and
`require_root_only()`, which the worker calls after its imports and which exits with a message when a
module came from anywhere else (a symbolic link back into this checkout, say).

A worker's code is `PRELUDE` followed by its own lines; `sys.argv[1]` is DIR, the rest its arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NOT_IN_CHECKOUT = 3  # the exit code of a worker whose imports are not all the checkout's own

PRELUDE = f"""
import importlib.machinery, json, os, sys
root = os.path.realpath(sys.argv[1])
PACKAGES = ("moekv_ref", "moekv_kernels")


class OnlyFromRoot:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [root] if path is None else path)
        if spec is None:
            raise ModuleNotFoundError(f"{{name}} is not there", name=name)
        return spec


def outside_root():
    found = []
    for name, module in sorted(sys.modules.items()):
        if name.partition(".")[0] in PACKAGES:
            places = [module.__file__] if getattr(module, "__file__", None) else []
            places += list(getattr(module, "__path__", []))
            found += [f"{{name}} from {{p}}" for p in places if not os.path.realpath(p).startswith(root + os.sep)]
    return found


def not_in_checkout(reason):
    print(json.dumps({{"not_in_checkout": reason}}), flush=True)
    sys.exit({NOT_IN_CHECKOUT})


def require_root_only():
    if outside_root():
        not_in_checkout("modules loaded from elsewhere: " + ", ".join(outside_root()))


sys.meta_path.insert(0, OnlyFromRoot)
sys.path.insert(0, root)
"""

# the import lines of a worker: wrapped so that a module the checkout lacks is reported, not raised
IMPORTS = """
try:
{imports}
except ImportError as error:
    not_in_checkout(f"importing {{error.name or 'a module'}} failed: {{error}}")
require_root_only()
"""


def worker_code(imports: list[str], body: str) -> str:
    """PRELUDE, then `imports` (lines such as "from moekv_ref.engine import LLMEngine") checked to load
    from the checkout alone, then `body`."""
    lines = "\n".join(f"    {line}" for line in imports)
    return PRELUDE + IMPORTS.format(imports=lines) + body


def worker_command(root: Path, code: str, arguments: list[str]) -> list[str]:
    """The command line that runs `code` (from `worker_code`) on the checkout at root."""
    return [sys.executable, "-I", "-c", code, str(root), *arguments]


def refusal(root: Path, line: str) -> ValueError | None:
    """The ValueError for a worker's output line that says root is not a whole checkout, else None."""
    if not line.startswith('{"not_in_checkout"'):
        return None
    reason = json.loads(line)["not_in_checkout"]
    return ValueError(
        f"--against={root} is not a complete checkout of this repository: {reason}; allowed: the root of a checkout"
    )


# what a checking worker prints once its imports are known to be the checkout's own
LOADED = """
print(json.dumps(sorted(n for n in sys.modules if n.partition(".")[0] in PACKAGES)))
"""


def check_checkout(root: Path, imports: list[str]) -> list[str]:
    """The moekv_ref and moekv_kernels modules `imports` load at root, all of them from root; a
    ValueError otherwise (before anything is timed)."""
    code = worker_code(imports, LOADED)
    done = subprocess.run(worker_command(root, code, []), cwd=root, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    error = refusal(root, lines[-1]) if lines else None
    if error is not None:
        raise error
    if done.returncode != 0:
        raise RuntimeError(f"checking the checkout at {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])
