"""Where a reader finds things: the layout table (docs/design.md, "Layout") names every module of the
package and only paths that exist; the modules of moekv_ref/ and moekv_kernels/ import each other
without a cycle -- counting every import outside a function, those under `if TYPE_CHECKING:` and
`if __name__ == "__main__":` too, since a reader follows those as well; and no function hides an
import of the package (the way one dodges a cycle), except the few with a stated reason."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moekv_ref"
PACKAGES = (PACKAGE, ROOT / "moekv_kernels")

# Function-level imports that are there on purpose, each with its reason.
ALLOWED_LAZY = {
    (
        "moekv_ref/model.py",
        "moekv_kernels",
    ),  # triton is optional, and kernels must set the interpreter flag first
    ("moekv_ref/cache/cache_options.py", "moekv_kernels"),  # the same
    ("moekv_ref/apps/bench_step.py", "moekv_ref.checkpoint"),  # a worker importing another checkout's package
    ("moekv_ref/apps/bench_step.py", "moekv_ref.engine"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.sampling"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.apps.options"),  # this module runs in that worker too
    ("moekv_ref/apps/bench_step.py", "moekv_ref.profiling"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.jsonout"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.apps.bench_peer"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.apps.checkout"),
    ("moekv_ref/apps/bench_step.py", "moekv_ref.paths"),
    ("moekv_ref/apps/cli.py", "moekv_kernels._utils"),  # triton is optional: only with --backend triton
}


def _layout_section() -> str:
    design = (ROOT / "docs" / "design.md").read_text()
    return design.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom | ast.Import, name: str | None = None) -> list[str]:
    """Absolute names of what an import statement in `module` imports (package modules only)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module.split(".")
    is_package = (ROOT / Path(*package) / "__init__.py").is_file()
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
    path = ROOT / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_imports(tree: ast.Module):
    """Every import statement outside a function: at the top, under `if TYPE_CHECKING:`, in
    `if __name__ == "__main__":`, in a try block."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)


def _modules(packages=PACKAGES):
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            yield path, _module_name(path), ast.parse(path.read_text())


def _import_graph(modules) -> dict[str, set[str]]:
    graph = {}
    for path, module, tree in modules:
        targets = set()
        for node in _module_imports(tree):
            targets.update(
                t
                for t in _resolve(module, node)
                if t.split(".")[0] in ("moekv_ref", "moekv_kernels") and t != module
            )
        graph[module] = targets
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle as a list of modules (first == last), or None. An import of `moekv_ref.x.y`
    also runs the packages above it, so those count as edges too."""

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
                    return stack[stack.index(step) :] + [step]
                if step not in state:
                    found = visit(step)
                    if found:
                        return found
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_layout_table_names_every_module_and_only_paths_that_exist():
    layout = _layout_section()
    missing = []
    for path in sorted(PACKAGE.iterdir()):
        if path.name.startswith(("_", ".")) or path.name == "__pycache__":
            continue
        if path.is_file() and path.suffix != ".py":
            continue
        if path.name not in layout:
            missing.append(path.name)
    assert not missing, f"docs/design.md's layout table does not name {missing}"
    for name in re.findall(r"`([\w./*-]+\.(?:py|pt|md)|[\w.-]+/)`", layout):
        if "*" in name:
            assert list(ROOT.glob(name)), f"layout table: nothing matches `{name}`"
            continue
        found = (ROOT / name).exists() or any(
            p for p in ROOT.rglob(Path(name).name) if ".venv" not in p.parts
        )
        assert found, f"docs/design.md's layout table names `{name}`, which does not exist"


def test_the_packages_import_without_a_cycle():
    cycle = _find_cycle(_import_graph(_modules()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_sees_type_checking_and_main_imports():
    """The check above is not vacuous: a circle closed only by an import under TYPE_CHECKING, or only
    under `if __name__ == "__main__":`, is found, and it is the injected one."""

    def injected(changes):
        return [
            (path, module, ast.parse(changes[module]) if module in changes else tree)
            for path, module, tree in _modules()
        ]

    for guard in ("if TYPE_CHECKING:", 'if __name__ == "__main__":'):
        cycle = _find_cycle(
            _import_graph(injected({"moekv_ref.config": f"{guard}\n    from moekv_ref.apps import cli\n"}))
        )
        assert cycle is not None and "moekv_ref.config" in cycle, (guard, cycle)
    cycle = _find_cycle(
        _import_graph(
            injected(
                {
                    "moekv_kernels.store_kv": 'if __name__ == "__main__":\n    from .report import occupancy\n',
                    "moekv_kernels.report": "if TYPE_CHECKING:\n    from .store_kv import store_kv\n",
                }
            )
        )
    )
    assert cycle is not None and {"moekv_kernels.store_kv", "moekv_kernels.report"} <= set(cycle), cycle


def test_no_kernel_imports_the_benchmark():
    """moekv_kernels/bench.py is a program over the kernels: none of them imports it, anywhere."""
    importers = []
    for path, module, tree in _modules((ROOT / "moekv_kernels",)):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "moekv_kernels.bench" in _resolve(
                module, node
            ):
                importers.append(module)
    assert not importers, importers


def test_no_function_hides_an_import_of_the_package():
    hidden = set()
    for path, module, tree in _modules((PACKAGE,)):
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(module, node):
                        if target.split(".")[0] in ("moekv_ref", "moekv_kernels"):
                            hidden.add((str(path.relative_to(ROOT)), target))
    assert hidden <= ALLOWED_LAZY, f"imports hidden in functions: {sorted(hidden - ALLOWED_LAZY)}"


LIBRARY_LEFT_OUT = ("moekv_ref/apps/", "moekv_ref/plots/")


def _package_imports(prefix: str, modules=None) -> list[tuple[str, str]]:
    """(importing file, imported module) for every import of a module whose name starts with
    `prefix`, outside a function or inside one."""
    found = []
    for path, module, tree in modules if modules is not None else _modules((PACKAGE,)):
        relative = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [
                    (relative, t) for t in _resolve(module, node) if t == prefix or t.startswith(prefix + ".")
                ]
    return found


def test_nothing_outside_the_programs_imports_them():
    """Data flows from the library to the programs in apps/: no module outside apps/ -- the library,
    the plots, the course -- imports from apps/, except the package's command line,
    moekv_ref/__main__.py, which hands its arguments to apps/cli.py."""
    upward = [
        (path, target)
        for path, target in _package_imports("moekv_ref.apps")
        if not path.startswith("moekv_ref/apps/") and path != "moekv_ref/__main__.py"
    ]
    assert not upward, f"modules outside apps/ importing the programs: {upward}"


def test_the_course_imports_only_the_library_and_nothing_imports_the_course():
    """The course (the notebooks' helpers and exercises, course/) stands on the library alone: it
    imports neither the programs nor the plots, and no module of the package imports it."""
    course = [
        (path, target)
        for path, target in _package_imports("moekv_ref")
        if path.startswith("moekv_ref/course/") and target.startswith(("moekv_ref.apps", "moekv_ref.plots"))
    ]
    assert not course, f"the course importing more than the library: {course}"
    inward = [
        (path, target)
        for path, target in _package_imports("moekv_ref.course")
        if not path.startswith("moekv_ref/course/")
    ]
    assert not inward, f"modules importing the course: {inward}"


def test_the_import_checks_see_an_injected_import():
    """The two checks above are not vacuous: an import of apps/ from a library module, and of the
    plots from the course, are found."""
    injected = [
        (ROOT / "moekv_ref/costs.py", "moekv_ref.costs", ast.parse("from .apps import cli\n")),
        (
            ROOT / "moekv_ref/course/checks.py",
            "moekv_ref.course.checks",
            ast.parse("def f():\n    from ..plots import tables\n"),
        ),
    ]
    assert _package_imports("moekv_ref.apps", injected) == [("moekv_ref/costs.py", "moekv_ref.apps.cli")]
    assert _package_imports("moekv_ref.plots", injected) == [
        ("moekv_ref/course/checks.py", "moekv_ref.plots.tables")
    ]


def _top_level_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """name -> the library files that define it at module level (a function, a class, or a constant
    written in capitals); programs, plots and the notebooks' helpers left out."""
    defined: dict[str, list[str]] = {}
    for path, source in sources.items():
        for node in ast.parse(source).body:
            names = (
                [node.name]
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                else [
                    t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name) and t.id.isupper()
                ]
            )
            for name in names:
                defined.setdefault(name, []).append(path)
    return defined


def test_no_name_is_defined_in_two_library_modules():
    """One name, one meaning: no function, class or constant of the library is defined in two of its
    modules (the second would be a copy, or a different thing under the same name); and the check
    sees a copy when one is made."""
    sources = {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
        if not str(p.relative_to(ROOT)).startswith(LIBRARY_LEFT_OUT)
    }
    twice = {name: paths for name, paths in _top_level_names(sources).items() if len(paths) > 1}
    assert not twice, twice
    copied = dict(sources, **{"moekv_ref/copy.py": "class KVCacheManager:\n    pass\nBYTES_PER_INDEX = 4\n"})
    assert {n for n, p in _top_level_names(copied).items() if len(p) > 1} == {
        "KVCacheManager",
        "BYTES_PER_INDEX",
    }


def test_every_importable_package_has_the_project_s_prefix():
    """The packages pip installs from this repository are named moekv_*: a top-level package named
    like another distribution shadows it, or is shadowed by it, depending on the directory Python
    starts in. The kernels were once the package `kernels`, which is also Hugging Face's distribution
    of that name, a dependency of transformers (the `bench peer` extra): with it installed, notebook
    08 imported Hugging Face's package and transformers imported ours."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert all(pattern.startswith("moekv_") for pattern in found["include"]), found["include"]
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top_level == {"moekv_ref", "moekv_kernels"}, top_level


# One writer per state: a module changes its own objects' attributes (through `self`), the objects a
# function builds, and nothing else; it asks the owner of any other state to change it, through a
# public method. The few exceptions are objects of other libraries, each with its reason.
ALLOWED_WRITES = {
    ("moekv_ref/apps/demo.py", "bar"): "tqdm's progress is set through its `n` attribute",
    ("moekv_ref/cache/prefix_cache.py", "self.stats"): "its own counters, a record it made and hands out",
    **{
        (f"moekv_ref/apps/{name}.py", "args"): "the options argparse made for this program"
        for name in ("parallel_run",)
    },
    ("moekv_ref/parallel/programs.py", "block"): "scaling the routers of the model this function just built",
    **{
        (
            "moekv_ref/apps/bench_peer.py",
            name,
        ): "our weights copied into the Hugging Face model this function built"
        for name in ("attention", "layer", "mlp", "experts")
    },
}
ALLOWED_PRIVATE = {
    ("moekv_kernels/report.py", "kernel._pack_args"): "triton has no public call that compiles a launch for "
    "another GPU's target",
    ("moekv_ref/validation.py", "function.__init__"): "a class decorator (known_keywords) completing the "
    "class it decorates, as @dataclass does",
}
_OWN = ("self", "cls")


def _imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    """The name an expression starts from: `manager` in manager.block_tables.view(-1)[rows]."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _attribute_path(node: ast.expr) -> str:
    """'self.stats' for self.stats.num_lookups, self.stats[i].x: the data attributes from the root,
    less the last one written."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = (
            node.func.value
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            else node.func
            if isinstance(node, ast.Call)
            else node.value
        )
    return ".".join([node.id if isinstance(node, ast.Name) else "?", *reversed(names[1:])])


def _attribute_depth(node: ast.expr) -> int:
    """How many data attributes an assignment target goes through: 1 for self.x and self.x[i], 2
    for self.manager.clock."""
    depth = 0
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            depth += 1
        node = (
            node.func.value
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            else node.func
            if isinstance(node, ast.Call)
            else node.value
        )
    return depth


def _through_attribute(node: ast.expr) -> bool:
    """Whether the object an expression names is reached through a data attribute (x.table[i],
    x.table.view(-1)[i]), not only through items and method calls of a name (key_cache.view(-1)[i],
    counts.setdefault(k, {})[j], the objects a caller hands in to be filled)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Call):
            node = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            continue
        if isinstance(node, ast.Attribute):
            return True
        node = node.value
    return False


def _builds(value: ast.expr) -> bool:
    """A call that makes a new object: `f(...)`, `module.Class(...)`, `Class(...).eval()`; not a
    method's answer (`self.waiting.popleft()` hands back an object someone else holds)."""
    if not isinstance(value, ast.Call):
        return False
    if isinstance(value.func, ast.Name) or (
        isinstance(value.func, ast.Attribute) and value.func.attr[:1].isupper()
    ):
        return True
    # a new object's own methods handing it back: Model(config).float().eval()
    return isinstance(value.func, ast.Attribute) and _builds(value.func.value)


def _built_here(function: ast.AST) -> set[str]:
    """Names a function (or its enclosing function, for a closure) binds to a new object, which it
    may fill in."""
    names, pending = set(), list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # its own scope
        if isinstance(node, ast.Assign) and _builds(node.value):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        pending.extend(ast.iter_child_nodes(node))
    return names


def outside_writes(source: str, path: str) -> list[str]:
    """'path:line: what' for every write to another object's state and every use of another object's
    `_private` member in `source`: an assignment (plain, augmented or to an item) to `x.attr` or an
    in-place tensor method (`x.attr.add_(...)`) whose `x` is neither self, cls, an imported module,
    nor an object the function built; and `x._name` with `x` neither self nor cls nor a module."""
    tree = ast.parse(source)
    modules = _imported_names(tree)
    found = []

    def check(function: ast.AST, built: set[str]) -> None:
        built = built | _built_here(function)
        for node in ast.iter_child_nodes(function):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                check(node, built)
                continue
            visit(node, built)

    def visit(node: ast.AST, built: set[str]) -> None:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, (ast.Attribute, ast.Subscript)) and _foreign(part, built):
                    found.append(f"{path}:{node.lineno}: assigns {ast.unparse(part)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, node.func.value
            in_place = method.endswith("_") and not method.endswith("__")
            if in_place and isinstance(owner, (ast.Attribute, ast.Subscript)) and _foreign(owner, built):
                found.append(f"{path}:{node.lineno}: changes {ast.unparse(owner)} in place")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = _root(node.value)
            via_super = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"
            if not via_super and not (isinstance(base, ast.Name) and (base.id in _OWN or base.id in modules)):
                found.append(f"{path}:{node.lineno}: uses {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                check(child, built)
            else:
                visit(child, built)

    def _foreign(target: ast.expr, built: set[str]) -> bool:
        base = _root(target)
        if not isinstance(base, ast.Name):
            return True
        if not _through_attribute(target):
            return False
        if base.id in _OWN:  # its own attribute, not one of an object it holds
            return _attribute_depth(target) > 1 and (path, _attribute_path(target)) not in ALLOWED_WRITES
        if base.id in modules or base.id in built:
            return False
        return (path, base.id) not in ALLOWED_WRITES

    check(tree, set())
    return [
        line
        for line in found
        if not any(line.startswith(f"{p}:") and f" {what}" in line for p, what in ALLOWED_PRIVATE)
    ]


def test_no_module_writes_another_object_s_state_or_calls_its_private_members():
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            found += outside_writes(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "writes to another object's state (ask its owner through a method):\n" + "\n".join(
        found
    )


def test_the_one_writer_check_sees_each_kind_of_outside_write():
    """Injected cases: each kind the check looks for is found, and each kind it allows is allowed."""
    caught = """
def f(manager, request, hit):
    manager.block_tables[0, 1] = 5
    manager.last_position[rows] = positions
    request.status = 1
    request.num_computed_tokens += 1
    manager.row_tokens.index_add_(0, rows, ones)
    a, manager.clock = 1, 2
    manager._take_blocks(rows)
    return hit._secret
class B:
    def g(self, step):
        self.manager.clock = step
        self.manager.row_tokens.view(-1)[0] = 1
"""
    found = outside_writes(caught, "x.py")
    assert len(found) == 10, found
    allowed = """
import os
from dataclasses import dataclass
class A:
    def f(self, rows):
        self.table[rows] = 0
        self.table.view(-1)[rows] = 1
        self.table.index_add_(0, rows, rows)
        self._private()
        result = Result()
        result.value = 1
        items = {}
        items[1] = 2
        os.environ["X"] = "1"
        os._exit(0)
"""
    assert outside_writes(allowed, "x.py") == []


# ----- one direction: the plain path in the base classes, each variant beside it ------------------
BASE_FILES = (
    "moekv_ref/cache/block_pool.py",
    "moekv_ref/cache/kv_cache_manager.py",
    "moekv_ref/cache/paged.py",
    "moekv_ref/engine/scheduler.py",
)
# each adds to a base class (or is the one place that picks one), in a file of its own
VARIANT_MODULES = (
    "moekv_ref.cache.caching_block_pool",
    "moekv_ref.cache.prefix_cache",
    "moekv_ref.cache.prefix_caching_manager",
    "moekv_ref.cache.prefix_caching_paged",
    "moekv_ref.cache.shared_tail_manager",
    "moekv_ref.cache.shared_tail_paged",
    "moekv_ref.cache.budget",
    "moekv_ref.cache.budgeted_manager",
    "moekv_ref.cache.budget_paged",
    "moekv_ref.cache.decode_plan",
    "moekv_ref.cache.factory",
    "moekv_ref.engine.optimistic_reservation",
    "moekv_ref.engine.prefix_caching_scheduler",
    "moekv_ref.engine.row_evicting_scheduler",
    "moekv_ref.engine.scheduler_factory",
    "moekv_ref.sim",
)
OPTION_WORDS = re.compile(r"\b(counts_only|tails|budget|prefix_cache|open_rows|one_each|checked)\b")
POOL_MUTATORS = {
    "allocate",
    "allocate_per_device",
    "free",
    "free_per_device",
    "incref",
    "mark_cached",
    "uncache",
    "reuse",
}
POOL_OWNERS = {"KVCacheManager", "SwapSpace"}  # each changes its own pool (a swap space: its host pool)


def _variant_imports(modules) -> list[tuple[str, str]]:
    """(base file, variant module) for every import, anywhere in a base file, of a variant."""
    found = []
    for path, target in _package_imports("moekv_ref", modules):
        if path in BASE_FILES and any(target == v or target.startswith(v + ".") for v in VARIANT_MODULES):
            found.append((path, target))
    return found


def _pool_mutations(modules) -> list[tuple[str, str]]:
    """(file, call) for every call of a pool's mutator through `.pool.` outside the classes that own
    the pool (a manager, or a subclass of one, changing `self.pool`; a swap space its own)."""
    modules = list(modules)
    bases = {}
    for _, _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                ]

    def owns(name):
        return name in POOL_OWNERS or any(owns(b) for b in bases.get(name, ()) if b != name)

    found = []
    for path, _, tree in modules:
        for cls in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
            scope = tree if cls is None else cls
            for node in ast.walk(scope):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                call = node.func
                if call.attr not in POOL_MUTATORS or not isinstance(call.value, ast.Attribute):
                    continue
                if call.value.attr != "pool":
                    continue
                mine = cls is not None and owns(cls.name) and isinstance(call.value.value, ast.Name)
                if mine and call.value.value.id == "self":
                    continue
                found.append((str(path.relative_to(ROOT)), ast.unparse(call)))
    # a call inside a class is seen from the module too: keep the verdict of its innermost class
    owned_calls = set()
    for path, _, tree in modules:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and owns(n.name)):
            for node in ast.walk(cls):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if ast.unparse(node.func).startswith("self.pool."):
                        owned_calls.add((str(path.relative_to(ROOT)), ast.unparse(node.func)))
    return sorted(set(found) - owned_calls)


def test_the_base_classes_never_import_a_variant_and_hold_no_option():
    """The four base files (pool, manager, paged cache, scheduler) import no variant module, name no
    option or speed-up switch of the variants, and take at most 6 named parameters in each
    constructor: a variant is a class of its own beside its base, never a flag inside it."""
    assert not _variant_imports(list(_modules((PACKAGE,))))
    for name in BASE_FILES:
        source = (ROOT / name).read_text()
        assert not OPTION_WORDS.findall(source), f"{name} names {sorted(set(OPTION_WORDS.findall(source)))}"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                named = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg != "self"]
                assert len(named) <= 6, f"{name}: __init__ takes {len(named)} named parameters: {named}"


def test_only_a_pools_owner_changes_it():
    """Parts never call the pool's mutators: only a manager (or a class built on one) changes its own
    pool, through `self.pool`; the prefix index, the scheduler, the engine and the simulator ask the
    manager."""
    assert _pool_mutations(_modules((PACKAGE,))) == []


def test_the_direction_checks_see_an_injected_violation():
    """The two checks above are not vacuous: a base file importing a variant, and the prefix index
    freeing a block through its manager's pool, are found."""
    injected = [
        (ROOT / "moekv_ref/cache/paged.py", "moekv_ref.cache.paged", ast.parse("from .factory import x\n")),
        (
            ROOT / "moekv_ref/cache/prefix_cache.py",
            "moekv_ref.cache.prefix_cache",
            ast.parse("class PrefixCache:\n    def f(self, m, b):\n        m.pool.free(b)\n"),
        ),
    ]
    assert _variant_imports(injected) == [("moekv_ref/cache/paged.py", "moekv_ref.cache.factory")]
    assert _pool_mutations(injected) == [("moekv_ref/cache/prefix_cache.py", "m.pool.free")]
