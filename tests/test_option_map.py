"""The maps of each option's class (README.md's "Each option is a class beside its base" and
docs/design.md's table under "The plain path, and each option a class beside it") name classes that
their files define, and the one place the README says picks a class does name it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moekv_ref"
CLASS_IN_FILE = re.compile(r"`(\w+)` \(`([\w/]+\.py)`\)")
PICKERS = {
    "make_paged_cache": PACKAGE / "cache" / "factory.py",
    "make_scheduler": PACKAGE / "engine" / "scheduler_factory.py",
    "the trace runner": PACKAGE / "sim" / "runner.py",
}


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^class {re.escape(name)}\b", path.read_text(), re.MULTILINE) is not None


def _resolve(path: str) -> Path:
    """A file as the tables name it: from moekv_ref/, or (a bare name) from moekv_ref/cache/."""
    for candidate in (PACKAGE / path, PACKAGE / "cache" / path):
        if candidate.is_file():
            return candidate
    raise AssertionError(f"no file {path} under moekv_ref/ or moekv_ref/cache/")


def _readme_rows() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## One decode token, file by file", 1)[1].split("\n## ", 1)[0]
    table = section.split("Each option is a class beside its base", 1)[1]
    return [line for line in table.splitlines() if line.startswith("| ") and "`" in line]


def _design_rows() -> list[str]:
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = design.split("### The plain path, and each option a class beside it", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`" in line]


def _undefined(rows: list[str]) -> list[str]:
    return [
        f"{name} in {path}"
        for row in rows
        for name, path in CLASS_IN_FILE.findall(row)
        if not _defines(_resolve(path), name)
    ]


def test_each_option_class_named_in_the_readme_is_defined_in_its_file():
    rows = _readme_rows()
    options = [row.split("|")[1].strip() for row in rows]
    for option in ("prefix caching", "shared tails", "a row budget", "the dense decode plan"):
        assert option in options, (option, options)
    assert len(CLASS_IN_FILE.findall("".join(rows))) >= 12
    assert _undefined(rows) == []


def test_each_option_class_named_in_the_design_table_is_defined_in_its_file():
    rows = _design_rows()
    assert len(rows) >= 8
    assert _undefined(rows) == []


def test_the_readme_s_picker_names_each_cache_and_scheduler_class_it_picks():
    """A paged cache class under make_paged_cache is named in cache/factory.py, a scheduler class
    under make_scheduler in engine/scheduler_factory.py, a class under the trace runner in
    sim/runner.py."""
    unnamed = []
    for row in _readme_rows():
        classes = [name for name, _ in CLASS_IN_FILE.findall(row)]
        picked_by = row.rstrip(" |").rsplit("|", 1)[1]
        for picker, path in PICKERS.items():
            if picker not in picked_by:
                continue
            source = path.read_text()
            for name in classes:
                kind = "PagedKVCache" if picker == "make_paged_cache" else "Scheduler"
                if picker == "the trace runner":
                    kind = "KVCacheManager"
                if name.endswith(kind) and not re.search(rf"\b{name}\b", source):
                    unnamed.append(f"{name} not named in {path.relative_to(ROOT)}")
    assert unnamed == []


def test_the_class_check_sees_a_class_its_file_does_not_define():
    """Not vacuous: a row naming a class in the wrong file, or one that does not exist, is found."""
    rows = [
        "| shared tails | `SharedTailKVCacheManager` (`cache/kv_cache_manager.py`) | `make_paged_cache` |",
        "| parts | `SharedTails` (`cache/shared_tail_manager.py`) | `make_paged_cache` |",
    ]
    assert _undefined(rows) == [
        "SharedTailKVCacheManager in cache/kv_cache_manager.py",
        "SharedTails in cache/shared_tail_manager.py",
    ]
