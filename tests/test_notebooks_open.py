"""The notebooks open the way the README says: `jupyter lab` (from the repository root) starts a
notebook's kernel in notebooks/, with no PYTHONPATH. Their imports work only because requirements.txt
installs this repository as a package; before it did, every notebook failed at its first code cell
with ModuleNotFoundError while nbval (which ran with the path set by the test session) passed.

Every notebook's first code cell (its imports and set-up) runs here through `jupyter nbconvert
--execute`, in a subprocess started in notebooks/ with PYTHONPATH removed from its environment. The
whole notebooks run in tests/test_browser.py (in JupyterLab itself), or through nbval where there is
no browser.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from moekv_ref.backends import triton_available

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def clean_environment() -> dict:
    """This process's environment without anything that adds to Python's import path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def first_code_cell(notebook: dict) -> dict:
    """The notebook's first code cell (its imports and set-up), outputs cleared."""
    cell = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    return dict(cell, outputs=[], execution_count=None)


def test_first_cells_run_in_notebooks_directory_without_pythonpath():
    """One kernel (starting one per notebook costs ~12 s each on two cores) runs every notebook's
    first code cell in turn, as a reader opening each notebook would."""
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS
    names, cells = [], []
    for path in NOTEBOOKS:
        source = path.read_text(encoding="utf-8")
        if not triton_available() and ("import moekv_kernels" in source or "from moekv_kernels" in source):
            continue  # the kernels' notebook; conftest.py skips it under nbval too
        names.append(path.name)
        cells.append(first_code_cell(json.loads(source)))
    notebook = json.loads(NOTEBOOKS[0].read_text(encoding="utf-8"))
    notebook["cells"] = cells
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jupyter",
            "nbconvert",
            "--stdin",
            "--to",
            "notebook",
            "--execute",
            "--stdout",
            "--allow-errors",
            "--ExecutePreprocessor.timeout=300",
        ],
        input=json.dumps(notebook),
        capture_output=True,
        text=True,
        cwd=ROOT / "notebooks",
        env=clean_environment(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    executed = json.loads(done.stdout)["cells"]
    assert [c["execution_count"] for c in executed] == list(range(1, len(names) + 1))
    failures = {
        name: f"{o['ename']}: {o['evalue']}"
        for name, cell in zip(names, executed)
        for o in cell["outputs"]
        if o["output_type"] == "error"
    }
    assert not failures, f"first code cells failing in a kernel started in notebooks/: {failures}"


def saved_figures(state: dict, model_id: str) -> int:
    """Figures a saved widget model holds in its Output, its children's included."""
    model = state.get(model_id, {}).get("state", {})
    own = sum("image/png" in output.get("data", {}) for output in model.get("outputs", []))
    return own + sum(
        saved_figures(state, child.removeprefix("IPY_MODEL_")) for child in model.get("children", [])
    )


def test_a_press_to_run_widget_opens_with_its_first_figure():
    """A widget that runs only when its Run Interact button is pressed (a run takes seconds) drew the
    default setting's figure once when the notebook was executed, and its saved state holds it: a
    reader opening the notebook sees a figure, not an empty space under the controls.
    interact_manual cannot do that (it draws nothing until pressed), so no notebook uses it."""
    checked = 0
    for path in NOTEBOOKS:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        state = notebook["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
        for cell in notebook["cells"]:
            source = "".join(cell["source"])
            assert "interact_manual" not in source, (
                f"{path.name}: interact_manual draws nothing until pressed"
            )
            if cell["cell_type"] != "code" or "manual=True" not in source:
                continue
            views = [
                output["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
                for output in cell["outputs"]
                if "application/vnd.jupyter.widget-view+json" in output.get("data", {})
            ]
            assert views, f"{path.name}: a press-to-run cell shows no widget"
            assert sum(saved_figures(state.get("state", {}), view) for view in views) >= 1, (
                f"{path.name}: a press-to-run widget's saved state holds no figure"
            )
            checked += 1
    assert checked >= 3  # notebooks 05, 06 and 07
