"""Where a reader finds things: the README's layout table names every module of the package and only
paths that exist; the package's modules import each other without a cycle; and no function hides an
import of the package (the way one dodges a cycle), except the few with a stated reason."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moekv_ref"

# Function-level imports that are there on purpose, each with its reason.
ALLOWED_LAZY = {
    ("moekv_ref/model.py", "kernels"),            # triton is optional, and kernels must set the interpreter flag first
    ("moekv_ref/cache/paged.py", "kernels"),      # the same
    ("moekv_ref/apps/bench_step.py", "moekv_ref.checkpoint"),   # a worker importing another checkout's package
    ("moekv_ref/apps/bench_step.py", "moekv_ref.engine"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.sampling"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.apps.options"),   # this module runs in that worker too
}


def _layout_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Layout", 1)[1].split("\n## ", 1)[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom | ast.Import, name: str | None = None) -> list[str]:
    """Absolute names of what an import statement in `module` imports (package modules only)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module.split(".")
    is_package = (PACKAGE.parent / Path(*package) / "__init__.py").is_file()
    base = package if is_package else package[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    # `from .x import y` imports the module x.y when y is a module, else x
    names = []
    for alias in node.names:
        candidate = f"{target}.{alias.name}"
        names.append(candidate if _exists(candidate) else target)
    return names


def _exists(module: str) -> bool:
    path = PACKAGE.parent / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _top_level_imports(tree: ast.Module):
    """Import statements run when the module loads (not under `if TYPE_CHECKING:`)."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    yield child


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, _module_name(path), ast.parse(path.read_text())


def test_readme_layout_names_every_module_and_only_paths_that_exist():
    layout = _layout_section()
    missing = []
    for path in sorted(PACKAGE.iterdir()):
        if path.name.startswith(("_", ".")) or path.name == "__pycache__":
            continue
        if path.is_file() and path.suffix != ".py":
            continue
        if path.name not in layout:
            missing.append(path.name)
    assert not missing, f"the README's layout table does not name {missing}"
    for name in re.findall(r"`([\w./*-]+\.(?:py|pt|md)|[\w.-]+/)`", layout):
        if "*" in name:
            assert list(ROOT.glob(name)), f"layout table: nothing matches `{name}`"
            continue
        found = (ROOT / name).exists() or any(p for p in ROOT.rglob(Path(name).name) if ".venv" not in p.parts)
        assert found, f"the README's layout table names `{name}`, which does not exist"


def test_the_package_imports_without_a_cycle():
    graph = {}
    for path, module, tree in _modules():
        targets = set()
        for node in _top_level_imports(tree):
            targets.update(t for t in _resolve(module, node) if t.startswith("moekv_ref") and t != module)
        graph[module] = targets

    # a module's import of `moekv_ref.x.y` also runs the packages above it; follow edges depth-first
    def parents(name):
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(2, len(parts))]

    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            for step in parents(target) + [target]:
                if step == module or step not in graph:
                    continue
                if state.get(step) == "open" and not module.startswith(step + "."):
                    cycle = stack[stack.index(step):] + [step]
                    raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
                if step not in state:
                    visit(step)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_function_hides_an_import_of_the_package():
    hidden = set()
    for path, module, tree in _modules():
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(module, node):
                        if target.split(".")[0] in ("moekv_ref", "kernels"):
                            hidden.add((str(path.relative_to(ROOT)), target))
    assert hidden <= ALLOWED_LAZY, f"imports hidden in functions: {sorted(hidden - ALLOWED_LAZY)}"
