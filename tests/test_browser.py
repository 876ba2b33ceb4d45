"""Every notebook in JupyterLab, in a real browser, as a reader opens it.

JupyterLab starts with the README's own launch line, `jupyter lab`, from the repository root (so the
notebooks' links to docs/ resolve), plus only what a headless run needs (no browser of its own,
loopback, a free port, a token, the app exposed to the page so its notebook model can be read, and
--allow-root when run as root); PYTHONPATH is removed from its environment. The notebooks are
trusted first, as the README's `jupyter trust notebooks/*.ipynb` trusts them, but in a trust
database of the test's own. Debian's Chromium, driven through Playwright (its Python package only:
no browser is downloaded), opens each notebook found by glob, checks what it shows before anything
runs, clears the stored outputs and runs all cells top to bottom from the Run menu. Two
notebooks run at a time, each in a browser and a kernel of its own (BROWSER_TEST_BROWSERS=1: one at
a time), so the run-all times are those of a notebook sharing a two-core machine with another.
The test fails on:

- a widget cell that, on open and before anything runs, shows no controls, fewer figures than its
  saved widget state holds, or the widget's text form; or a widget whose state is not saved in the
  notebook's metadata (JupyterLab restores the controls and their first output from that state);

- an output that differs from the committed one, compared as nbval compares (the same skipped fields,
  cell tags and sanitizing file), read from JupyterLab's model of the notebook after run-all: this is
  nbval's check, so conftest.py skips nbval's run of the notebooks this test runs in the session;
- an error output (a traceback) or "Error displaying widget" anywhere, or a widget left as its text
  form ("IntSlider(value=...", "interactive(children=...");
- a notebook that imports ipywidgets but shows no working widget: in every cell with widgets, up to two
  controls are changed as a user would (a click on a slider's track or a toggle button, a new dropdown
  option), and the cell's output must change;
- a figure drawn after a change that is incomplete: each PNG is decoded and its non-background pixels
  counted; a redrawn figure must have at least 15% as many as the figure the same cell drew first (a
  blank redraw keeps about 5%: its frame);
- a figure wider than the output area (its natural width above the width it is shown at, in the
  1440 x 900 page): JupyterLab shrinks it to fit, and its text with it;
- an exercise check that does not refuse a wrong answer: in every exercise cell (the one with
  `answer = None`), each of two usual wrong answers (WRONG_ANSWERS) is typed in place of None and the
  cell run, and its output must begin "Not yet";
- a widget cell of an untrusted notebook (a copy not in the trust database, in runs/browser/) that
  shows the widget's text form, or not the still of its first figure that its stored output holds,
  or hides the text stored beside it (what the controls printed, and the hint to trust the notebook):
  JupyterLab shows no widget in an untrusted notebook.

Screenshots (each widget cell on open, after run-all, and each widget cell before and after each
change) and a summary
(summary.json: per notebook the run-all time, widgets changed, update latency and screenshot names)
go to runs/browser/; the table is printed at the end of the pytest run.

The test settings (in a temporary JupyterLab settings folder): no news prompt over the screenshots,
autosave off, so the committed notebooks are never rewritten (checked by hash), and every cell kept
in the page (windowingMode "none"; by default JupyterLab adds only the cells on screen), so every
output can be checked.

Skips, saying why, where Chromium (`apt-get install chromium`) or the playwright package is missing.
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import io
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from queue import Empty

import nbformat
import numpy as np
import pytest
from nbval.plugin import coalesce_streams, transform_streams_for_comparison

from moekv_ref.plots.tables import text_table

ROOT = Path(__file__).resolve().parents[1]
# every notebook; BROWSER_TEST_NOTEBOOKS="04_*" narrows the run to some while working on them
NOTEBOOKS = sorted((ROOT / "notebooks").glob(os.environ.get("BROWSER_TEST_NOTEBOOKS", "*.ipynb")))
OUT = ROOT / "runs" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUN_ALL_TIMEOUT_S = 900
UPDATE_TIMEOUT_S = 180
MANUAL_RETRY_S = 30  # an interact_manual cell's press that changed nothing by then is pressed again
CONTROLS_PER_CELL = 2
BROWSERS = int(os.environ.get("BROWSER_TEST_BROWSERS", "2"))  # notebooks run at once

if CHROMIUM is None:
    pytest.skip(
        "the browser test needs Chromium: on Debian/Ubuntu `apt-get install chromium` "
        "(no chromium or chromium-browser on PATH here)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="the browser test needs the playwright package (pip install -r requirements.txt installs it)",
)
Image = pytest.importorskip("PIL.Image")

# Two usual wrong answers per exercise, as a reader would type them in place of `answer = None`'s
# None (tests/test_exercises.py checks these mistakes and more, and what each message says).
WRONG_ANSWERS = {
    "01": ["EXERCISE_01_CONTEXT_LENGTH + 1", "(EXERCISE_01_CONTEXT_LENGTH + 1) ** 2"],
    "02": [
        "int(selected[EXERCISE_02_LAYER][:, EXERCISE_02_EXPERT].sum())",  # tokens, not bytes
        "int(selected[EXERCISE_02_LAYER].sum()) * 512",  # every expert's entries
    ],
    "03": ["4", "16"],
    "04": ["4", "16"],
    "05": [  # blocks summed over every device; blocks on the short device without the request's own step
        "lambda candidates, memory, need: max(candidates, "
        "key=lambda r: int(memory.blocks_held_per_device(r.request_id).sum()))",
        "lambda candidates, memory, need: max(candidates, "
        "key=lambda r: int(memory.blocks_held_per_device(r.request_id)[need.device]))",
    ],
    "06": ["100", "128"],
    "07": ["[0, 0, 0, 0, 1, 1, 1, 1]", "[0, 0, 1, 1, 1, 1, 0, 0]"],
    "08": ["256", "512"],
    "09": ["0.35", "0.78"],
    "10": ["20", "90"],
    "11": ["63", "3024"],
}
ANSWER_LINE = "answer = None"

# A widget shown as its repr instead of its view, or a view that failed.
WIDGET_TEXT_FORM = re.compile(
    r"Error displaying widget|interactive\(children=|"
    r"\b[A-Z][A-Za-z]*(Slider|Dropdown|Buttons|Box|Text|Textarea|Checkbox|Output)\("
)


def text_form(text: str) -> str | None:
    """The part of `text` around a widget's text form (or a failed view), or None if it shows none."""
    match = WIDGET_TEXT_FORM.search(text)
    return None if match is None else f"...{text[max(0, match.start() - 60) : match.end() + 60]}"


TRACEBACK = re.compile(
    r"Traceback \(most recent call last\)|^\s*Cell In\[\d+\], line \d+|"
    r"^[A-Za-z_.]*(Error|Exception)\b.*$",
    re.MULTILINE,
)

# State of the page, read in the browser.
JS_CODE_PROMPTS = (
    "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent)"
)
JS_KERNEL_STATUS = """() => {
    const e = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
    return e ? e.getAttribute('data-status') : null; }"""
JS_STDERR_TEXTS = """() => [...document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(e => e.textContent)"""
JS_OUTPUT_TEXTS = "() => [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.textContent)"
# the open notebook as JupyterLab holds it (expose_app_in_browser gives the page window.jupyterapp)
JS_NOTEBOOK = """() => { const panel = window.jupyterapp.shell.currentWidget;
    return {path: panel.context.path, cells: panel.content.model.toJSON().cells}; }"""
JS_FIGURE_WIDTHS = """() => [...document.querySelectorAll('.jp-OutputArea-output img')]
    .filter(i => i.naturalWidth > 0).map(i => [i.naturalWidth, i.clientWidth])"""
JS_RUN_ALL_DONE = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim());
    const status = document.querySelector('.jp-Notebook-ExecutionIndicator');
    if (prompts.length === 0 || !status || status.getAttribute('data-status') !== 'idle') return false;
    if (prompts.some(p => p.includes('*'))) return false;
    if (prompts.every(p => /\\[\\d+\\]/.test(p))) return true;
    return [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
        .some(e => e.textContent.includes('Traceback') || /Error/.test(e.textContent));
}"""


# What nbval leaves out of a comparison (its defaults without nbdime) and how it sanitizes the rest:
# the browser run checks the stored outputs exactly as nbval would, so nbval need not run them again.
NBVAL_SKIPS = (
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
)
SANITIZE = configparser.ConfigParser()
SANITIZE.read(ROOT / "tests" / "nbval_sanitize.cfg")


def sanitized(value):
    if isinstance(value, list):  # a multi-line string as the JSON stores it
        value = "".join(value)
    if not isinstance(value, str):
        return value
    for section in SANITIZE.sections():
        value = re.sub(SANITIZE[section]["regex"], SANITIZE[section]["replace"], value)
    return value


def compared_fields(outputs) -> dict[str, list]:
    """A cell's outputs as nbval compares them: streams merged per name, each field (a stream name, a
    MIME type of data) mapped to its sanitized values in order."""
    outputs = [
        nbformat.from_dict(
            {k: "".join(v) if isinstance(v, list) and k == "text" else v for k, v in o.items()}
        )
        for o in outputs
    ]
    fields: dict[str, list] = {}
    for output in transform_streams_for_comparison(coalesce_streams(outputs)):
        for key, value in output.items():
            if key in NBVAL_SKIPS:
                continue
            for field, item in value.items() if key == "data" else [(key, value)]:
                if field not in NBVAL_SKIPS:
                    fields.setdefault(field, []).append(sanitized(item))
    return fields


def stored_output_differences(path: Path, cells: list[dict]) -> list[str]:
    """Code cells whose outputs after run-all (JupyterLab's model) differ from the committed ones,
    cell tags honoured as nbval honours them."""
    stored = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    ran = [c for c in cells if c["cell_type"] == "code"]
    if len(ran) != len(stored):
        return [f"{path.name}: {len(ran)} code cells in JupyterLab, {len(stored)} in the file"]
    problems = []
    for i, (old, new) in enumerate(zip(stored, ran)):
        tags = old.metadata.get("tags", [])
        if "nbval-skip" in tags or "nbval-ignore-output" in tags:
            continue
        expected, got = compared_fields(old.outputs), compared_fields(new.get("outputs", []))
        if expected != got:
            field = next(f for f in sorted(set(expected) | set(got)) if expected.get(f) != got.get(f))
            problems.append(
                f"{path.name}: code cell {i} ({''.join(old.source)[:60]!r}...): its '{field}' "
                f"output differs from the stored one:\nstored: {expected.get(field)!r:.1500}"
                f"\nnow:    {got.get(field)!r:.1500}"
            )
    return problems


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CONTROLS = ".widget-toggle-buttons, .widget-dropdown, .widget-hslider, .widget-checkbox"


def stored_widget_cells(path: Path) -> tuple[dict[int, int], list[str]]:
    """The code cells (by index among code cells) whose stored outputs show a widget, each with the
    number of figures its saved widget state holds (the first figure an interact drew into its
    Output), and the problems found in the file: a widget whose state was not saved cannot be
    shown when the notebook opens."""
    notebook = nbformat.read(path, as_version=4)
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def figures(model_id: str) -> int:
        model = state.get(model_id, {})
        own = sum("image/png" in o.get("data", {}) for o in model.get("state", {}).get("outputs", []))
        children = model.get("state", {}).get("children", [])
        return own + sum(figures(c.removeprefix("IPY_MODEL_")) for c in children)

    cells, problems = {}, []
    code = [c for c in notebook.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if not view:
                continue
            if view["model_id"] not in state:
                problems.append(
                    f"{path.name}: code cell {i}: its widget's state is not saved in the notebook "
                    "(execute with --ExecutePreprocessor.store_widget_state=True)"
                )
            cells[i] = cells.get(i, 0) + figures(view["model_id"])
    return cells, problems


JS_WIDGET_CELLS_ON_OPEN = """([indices, controls]) => {
    const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
    return indices.map(i => { const c = cells[i]; return c ? {
        controls: c.querySelectorAll('.jp-OutputArea-output :is(' + controls + ')').length,
        figures: c.querySelectorAll('.jp-OutputArea-output img').length,
        text: [...c.querySelectorAll('.jp-OutputArea-output')].map(e => e.textContent).join('\\n')} : null; });
}"""


def widgets_on_open(page, path: Path, problems: list[str], shot) -> int:
    """The notebook as opened, before anything runs: every widget cell shows its saved controls and
    its first figure (restored by JupyterLab's widget manager from the notebook's metadata), and no
    widget is left as its text form. Returns the number of widget cells checked."""
    name = path.name
    expected, found = stored_widget_cells(path)
    problems += found
    if not expected:
        return 0
    indices = sorted(expected)
    deadline = time.monotonic() + 60  # the manager restores after the kernel connects
    while True:
        shown = page.evaluate(JS_WIDGET_CELLS_ON_OPEN, [indices, CONTROLS])
        ready = all(s and s["controls"] and s["figures"] >= expected[i] for i, s in zip(indices, shown))
        if ready or time.monotonic() > deadline:
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(500)  # the last image decoded before the screenshots
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    for i, s in zip(indices, shown):
        if s is None:
            problems.append(f"{name} (on open): code cell {i} is not in the page")
            continue
        shot(cells.nth(i), f"cell{i}-on-open")
        shown_as_text = text_form(s["text"])
        if shown_as_text:
            problems.append(f"{name} (on open): code cell {i}: its widget shows as text: {shown_as_text}")
        elif not s["controls"]:
            problems.append(f"{name} (on open): code cell {i}: its widget shows no controls")
        if s["figures"] < expected[i]:
            problems.append(
                f"{name} (on open): code cell {i}: {s['figures']} figures shown, {expected[i]} saved"
            )
    return len(indices)


def untrusted_copy(path: Path) -> Path:
    """The notebook with one metadata field added, in runs/browser/untrusted/: its signature is in no
    trust database, so JupyterLab opens it untrusted, as it opens a notebook nobody has trusted."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    notebook["metadata"]["untrusted_copy"] = True
    copy = OUT / "untrusted" / path.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(json.dumps(notebook), encoding="utf-8")
    return copy


def untrusted_on_open(page, lab: "Lab", path: Path, problems: list[str], shot) -> int:
    """The notebook opened untrusted: every widget cell shows, instead of the widget (JupyterLab
    renders none in an untrusted notebook), the still its stored output holds (image/png) or its
    printed text, never the widget's text form. Returns the number of widget cells checked."""
    expected, _ = stored_widget_cells(path)
    if not expected:
        return 0
    notebook = nbformat.read(path, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    stills = {
        i: sum("image/png" in o.get("data", {}) and WIDGET_VIEW in o["data"] for o in code[i].outputs)
        for i in expected
    }
    printed = {  # each widget cell's stored text: what its controls printed, then the hint to trust
        i: [
            line.strip()
            for o in code[i].outputs
            if WIDGET_VIEW in o.get("data", {})
            for line in o["data"]["text/plain"].splitlines()
            if line.strip()
        ]
        for i in expected
    }
    copy = untrusted_copy(path)
    relative = copy.relative_to(ROOT).as_posix()
    page.goto(f"{lab.url}/lab/workspaces/test-{path.stem}-untrusted/tree/{relative}?reset&token={lab.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=120_000)
    indices = sorted(expected)
    deadline = time.monotonic() + 60
    while True:
        shown = page.evaluate(JS_WIDGET_CELLS_ON_OPEN, [indices, CONTROLS])
        ready = all(  # a still shown, or the text of controls that draw none
            s and s["figures"] >= stills[i] and (stills[i] or s["text"].strip())
            for i, s in zip(indices, shown)
        )
        if ready or time.monotonic() > deadline:
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(500)
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    for i, s in zip(indices, shown):
        where = f"{path.name} (untrusted, on open): code cell {i}"
        if s is None:
            problems.append(f"{where} is not in the page")
            continue
        shot(cells.nth(i), f"cell{i}-untrusted")
        shown_as_text = text_form(s["text"])
        if shown_as_text:
            problems.append(f"{where}: shows the widget's text form: {shown_as_text}")
        if s["figures"] < stills[i]:
            problems.append(f"{where}: {s['figures']} figures shown, its output stores a still")
        if not s["figures"] and not s["text"].strip():
            problems.append(f"{where}: shows nothing")
        hidden = [line for line in printed[i] if line not in s["text"]]
        if hidden:  # beside the figure, the printed tables and the hint to trust must show too
            problems.append(f"{where}: its stored text is hidden: {hidden[0]!r}")
    lab.shut_down_kernel(relative)
    return len(indices)


def exercise_cells_refuse_wrong_answers(page, path: Path, problems: list[str], record: dict) -> None:
    """Each exercise cell (the one setting `answer = None`), with each of the notebook's
    WRONG_ANSWERS typed over its None as a reader would (click, select all, type, Shift+Enter), must
    answer "Not yet"."""
    name = path.name
    cells = page.evaluate(JS_NOTEBOOK)["cells"]
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    exercises = [
        i for i, (c, s) in enumerate(zip(cells, sources)) if c["cell_type"] == "code" and ANSWER_LINE in s
    ]
    wrong = WRONG_ANSWERS.get(path.stem[:2], [])
    if exercises and len(wrong) < 2:
        problems.append(f"{name}: an exercise with fewer than two wrong answers in WRONG_ANSWERS")
    if wrong and not exercises:
        problems.append(f"{name}: WRONG_ANSWERS has answers but no cell sets {ANSWER_LINE!r}")
    for i in exercises:
        cell = page.locator(".jp-Notebook .jp-Cell").nth(i)
        for answer in wrong:
            before = cell.locator(".jp-InputArea-prompt").inner_text()
            cell.locator(".cm-content").click()
            page.keyboard.press("Control+a")
            page.keyboard.insert_text(sources[i].replace(ANSWER_LINE, f"answer = {answer}", 1))
            page.keyboard.press("Shift+Enter")
            deadline = time.monotonic() + UPDATE_TIMEOUT_S
            while True:
                prompt = cell.locator(".jp-InputArea-prompt").inner_text()
                done = prompt != before and re.search(r"\[\d+\]", prompt)
                if done and page.evaluate(JS_KERNEL_STATUS) == "idle":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"exercise cell {i} did not run answer {answer!r} within {UPDATE_TIMEOUT_S} s"
                    )
                page.wait_for_timeout(200)
            reply = "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())
            record.setdefault("exercise_replies", []).append(
                {"answer": answer, "reply": reply.strip()[-160:]}
            )
            if not re.search(r"^Not yet", reply, re.MULTILINE):
                problems.append(
                    f"{name}: exercise cell {i} did not refuse answer = {answer}: {reply.strip()[:300]}"
                )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def drawn_pixels(png: bytes) -> int:
    """Pixels that differ from the figure's background (its top-left corner) by more than a faint tint."""
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    return int((np.abs(image - image[0, 0]).max(axis=-1) > 24).sum())


def jupyter_launcher() -> list[str]:
    jupyter = Path(sys.executable).with_name("jupyter")
    return [str(jupyter)] if jupyter.exists() else [sys.executable, "-m", "jupyter"]


def trusted_notebooks(db_file: Path) -> Path:
    """A notebook-trust database of its own (not the user's) in which every notebook is trusted, as
    the README's `jupyter trust notebooks/*.ipynb` trusts them for a reader: JupyterLab renders a
    stored widget (ipywidgets' renderer is not "safe") only in a trusted notebook, and shows its
    text form, "interactive(children=...", in any other. Signing writes to the database only."""
    subprocess.run(
        jupyter_launcher()
        + ["trust", f"--NotebookNotary.db_file={db_file}"]
        + [str(p.relative_to(ROOT)) for p in NOTEBOOKS],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return db_file


class Lab:
    """`jupyter lab` in the repository root on loopback, with a token and the notebook-trust
    database given; stopped at the end."""

    def __init__(self, settings: Path, workspaces: Path, log: Path, trust_db: Path):
        self.port, self.token = free_port(), base64.urlsafe_b64encode(os.urandom(18)).decode()
        command = jupyter_launcher() + [
            "lab",  # the README's line
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            "--LabApp.expose_app_in_browser=True",
            f"--NotebookNotary.db_file={trust_db}",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(workspaces))
        self.log = log
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"jupyter lab exited ({self.process.returncode}):\n{log.read_text()[-3000:]}"
                )
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not answer in 120 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)

    def api(self, method: str, path: str):
        request = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernel_idle(self, notebook: str) -> bool:
        return any(
            session["path"].endswith(notebook)
            and session["kernel"]
            and session["kernel"]["execution_state"] == "idle"
            for session in self.api("GET", "/api/sessions")
        )

    def shut_down_kernel(self, notebook: str):
        for session in self.api("GET", "/api/sessions"):
            if session["path"].endswith(notebook):
                self.api("DELETE", f"/api/sessions/{session['id']}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def lab_settings(folder: Path) -> Path:
    for plugin, values in {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # no "get notified about Jupyter news?" prompt over the screenshots (nor a request outside)
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return folder


def menu(page, top: str, item: str):
    page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{top}$")).click()
    page.locator(".lm-Menu-item:visible", has_text=re.compile(rf"^{re.escape(item)}")).first.click()


def widget_snapshot(cell) -> dict:
    """What a widget cell shows besides its controls: the text and the PNGs of its output widgets."""
    return cell.evaluate("""(cell) => {
        const outs = [...cell.querySelectorAll('.widget-output')];
        const roots = outs.length ? outs : [cell.querySelector('.jp-Cell-outputArea')];
        return {text: roots.map(o => o.innerText).join('\\n'),
                images: roots.flatMap(o => [...o.querySelectorAll('img')].map(i => i.src))};
    }""")


def png_bytes(page, src: str) -> bytes:
    if src.startswith("data:image/png;base64,"):
        return base64.b64decode(src.split(",", 1)[1])
    return base64.b64decode(
        page.evaluate(
            """async (src) => {
        const b = new Uint8Array(await (await fetch(src)).arrayBuffer()); let s = '';
        for (const x of b) s += String.fromCharCode(x); return btoa(s); }""",
            src,
        )
    )


def change_control(page, control) -> str | None:
    """Change one ipywidgets control as a user would; returns what was done, or None if it could not."""
    kind = control.evaluate("e => e.className")
    label = control.evaluate("e => (e.querySelector('.widget-label') || {}).textContent || ''").strip()
    if control.locator("select:disabled, input:disabled, button:disabled, .noUi-target[disabled]").count():
        return None  # a control that does not apply now is disabled: a user cannot move it
    if "widget-toggle-buttons" in kind:
        buttons = control.locator("button:not(.mod-active)")
        if buttons.count() == 0:
            return None
        text = buttons.first.inner_text().strip()
        buttons.first.click()
        return f"{label or 'toggle'} -> {text}"
    if "widget-dropdown" in kind:
        select = control.locator("select")
        options = select.locator("option").all_inner_texts()
        current = select.evaluate("e => e.selectedIndex")
        if len(options) < 2:
            return None
        choice = (current + 1) % len(options)
        select.select_option(index=choice)
        return f"{label or 'dropdown'} -> {options[choice].strip()}"
    if "widget-slider" in kind or "widget-hslider" in kind:
        track = control.locator(".noUi-target, .slider").first
        readout = control.locator(".widget-readout")
        before = readout.inner_text() if readout.count() else None
        box = track.bounding_box()
        for fraction in (0.7, 0.3):
            page.mouse.click(box["x"] + fraction * box["width"], box["y"] + box["height"] / 2)
            page.wait_for_timeout(150)
            after = readout.inner_text() if readout.count() else None
            if after != before:
                return f"{label or 'slider'} {before} -> {after}"
        return None
    if "widget-checkbox" in kind:
        control.locator("input").click()
        return f"{label or 'checkbox'} toggled"
    return None


def press_run_interact(cell) -> bool:
    """Press a cell's "Run Interact" button (ipywidgets' interact_manual, for slow callbacks), as a user
    would after changing its controls. False when the cell has none."""
    button = cell.locator("button", has_text=re.compile(r"^\s*Run Interact\s*$"))
    if button.count() == 0:
        return False
    button.first.click()
    return True


def wait_for_update(
    page, cell, before: dict, figures: int, timeout_s: float, hold_s: float = 1.0
) -> tuple[dict, float]:
    """Wait until the cell's output differs from `before`, shows at least `figures` images (those of
    the first render: text arrives before the figure that follows it) and has held still for hold_s
    with the kernel idle. Returns the output and the moment (time.monotonic) it first appeared whole:
    the hold only confirms it, so a redraw's latency ends there. On timeout returns the last output
    if it changed at all (the caller reports missing figures), and the moment of giving up."""
    start = time.monotonic()
    last, since = None, None
    while time.monotonic() - start < timeout_s:
        now = widget_snapshot(cell)
        settled = (
            page.evaluate(JS_KERNEL_STATUS) == "idle"
            and now != before
            and (now["text"].strip() or now["images"])
            and len(now["images"]) >= figures
        )
        if settled and now == last:
            if time.monotonic() - since >= hold_s:
                return now, since
        elif settled:
            last, since = now, time.monotonic()
        else:
            last = None
        page.wait_for_timeout(100)
    now = widget_snapshot(cell)
    if now != before:
        return now, time.monotonic()
    raise TimeoutError(f"the output did not change within {timeout_s} s")


def run_notebook(page, lab: Lab, path: Path, problems: list[str]) -> dict:
    stem, name = path.stem, path.name
    record = {
        "notebook": name,
        "run_all_s": None,
        "widgets_changed": [],
        "update_latency_s": [],
        "screenshots": [],
    }

    def shot(locator, suffix):
        file = f"{stem}-{suffix}.png"
        locator.screenshot(path=str(OUT / file))
        record["screenshots"].append(file)

    record["untrusted_widget_cells"] = untrusted_on_open(page, lab, path, problems, shot)
    # a workspace of its own, reset: only this notebook open
    page.goto(f"{lab.url}/lab/workspaces/test-{stem}/tree/notebooks/{name}?reset&token={lab.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=120_000)
    deadline = time.monotonic() + 180
    while not lab.kernel_idle(name):  # JupyterLab may ask which kernel, as it would ask a reader
        dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
        if dialog.count() and dialog.first.is_visible():
            dialog.locator("button", has_text=re.compile(r"^Select$")).click()
        if time.monotonic() > deadline:
            raise TimeoutError("the notebook's kernel did not start within 180 s")
        page.wait_for_timeout(250)
    page.wait_for_function(f"({JS_KERNEL_STATUS})() === 'idle'", timeout=60_000)
    page.wait_for_timeout(500)  # JupyterLab writes the kernel's name into the model now
    if page.locator(".lm-TabBar-tab.jp-mod-dirty").count():
        problems.append(
            f"{name}: opening it marks it modified (its stored kernel name or language "
            "differs from what the kernel reports), and autosave would rewrite it"
        )
    record["widget_cells_on_open"] = widgets_on_open(page, path, problems, shot)
    menu(page, "Edit", "Clear Outputs of All Cells")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]"
        ".every(e => !/\\d/.test(e.textContent))",
        timeout=30_000,
    )
    start = time.monotonic()
    menu(page, "Run", "Run All Cells")
    page.wait_for_function(JS_RUN_ALL_DONE, timeout=RUN_ALL_TIMEOUT_S * 1000, polling=250)
    record["run_all_s"] = round(time.monotonic() - start, 1)
    interactive = "ipywidgets" in path.read_text(encoding="utf-8")
    if interactive:  # widget views render after the kernel is idle
        try:
            page.wait_for_selector(".jp-OutputArea-output .jupyter-widgets", timeout=30_000)
        except sync_api.TimeoutError:
            pass
        page.wait_for_timeout(1000)
    shot(page, "run-all")
    model = page.evaluate(JS_NOTEBOOK)
    if model["path"] != f"notebooks/{name}":
        problems.append(f"{name}: the page shows {model['path']}, not the notebook")
    problems += stored_output_differences(path, model["cells"])

    prompts = page.evaluate(JS_CODE_PROMPTS)
    if not all(re.search(r"\[\d+\]", p) for p in prompts):
        problems.append(f"{name}: not every code cell ran: prompts {prompts}")

    def check_outputs(when):
        for text in page.evaluate(JS_STDERR_TEXTS):
            if TRACEBACK.search(text):
                problems.append(f"{name} ({when}): error output: {text.strip()[:600]}")
        for text in page.evaluate(JS_OUTPUT_TEXTS):
            shown_as_text = text_form(text)
            if shown_as_text:
                problems.append(f"{name} ({when}): a widget did not render: {shown_as_text}")

    check_outputs("after run-all")
    exercise_cells_refuse_wrong_answers(page, path, problems, record)
    # a figure wider than the output area is shrunk to fit, and its text with it
    sizes = page.evaluate(JS_FIGURE_WIDTHS)
    record["figure_widths"] = [{"natural": n, "shown": w} for n, w in sizes]
    for natural, shown in sizes:
        if shown and shown < natural - 2:
            problems.append(
                f"{name}: a figure {natural} px wide is shown {shown} px wide: its text shrinks to "
                f"{shown / natural:.0%}; draw it narrower"
            )
    if not interactive:
        return record

    cells = page.locator(".jp-CodeCell:has(.jp-OutputArea-output .jupyter-widgets)")
    if cells.count() == 0:
        problems.append(f"{name}: imports ipywidgets but no widget view rendered")
    for c in range(cells.count()):
        cell = cells.nth(c)
        manual = press_run_interact(cell)  # an interact_manual cell draws only when asked to
        # the first render, settled: on a loaded machine the page can show a widget's text seconds
        # before the figure that follows it, though the kernel is done
        wait_for_update(page, cell, {"text": "", "images": []}, 0, UPDATE_TIMEOUT_S, hold_s=3.0)
        first = widget_snapshot(cell)
        first_pixels = [drawn_pixels(png_bytes(page, src)) for src in first["images"]]
        record.setdefault("first_figure_pixels", []).append(first_pixels)
        if first_pixels and min(first_pixels) == 0:
            problems.append(f"{name}: widget cell {c}: the first figure is blank")
        controls = cell.locator(CONTROLS)
        changed = 0
        for i in range(controls.count()):
            if changed == CONTROLS_PER_CELL:
                break
            before = widget_snapshot(cell)
            shot(cell, f"cell{c}-change{changed + 1}-before")
            t0 = time.monotonic()
            done = change_control(page, controls.nth(i))
            if done is None:
                continue
            if manual:  # a reader presses after choosing, not within a millisecond of it
                page.wait_for_timeout(300)
                page.wait_for_function(f"({JS_KERNEL_STATUS})() === 'idle'", timeout=60_000)
                t0 = time.monotonic()  # the latency a reader waits: from the press
                press_run_interact(cell)
            try:
                try:
                    after, appeared = wait_for_update(
                        page, cell, before, len(first_pixels), MANUAL_RETRY_S if manual else UPDATE_TIMEOUT_S
                    )
                except TimeoutError:
                    if not manual:
                        raise
                    # a press the kernel never acted on (seen once in CI, on a loaded machine, and not
                    # since): press again, as a reader would, and say so in the record
                    record.setdefault("pressed_twice", []).append(done)
                    t0 = time.monotonic()
                    press_run_interact(cell)
                    after, appeared = wait_for_update(page, cell, before, len(first_pixels), UPDATE_TIMEOUT_S)
            except TimeoutError as error:
                problems.append(f"{name}: widget cell {c}: after '{done}': {error}")
                shot(cell, f"cell{c}-change{changed + 1}-after")
                break
            latency = round(appeared - t0, 2)  # from the change to the whole new output
            changed += 1
            record["widgets_changed"].append(done)
            record["update_latency_s"].append(latency)
            shot(cell, f"cell{c}-change{changed}-after")
            pixels = [drawn_pixels(png_bytes(page, src)) for src in after["images"]]
            record.setdefault("figure_pixels_after_changes", []).append(pixels)
            if len(pixels) != len(first_pixels):
                problems.append(
                    f"{name}: widget cell {c}: after '{done}' {len(pixels)} figures, first {len(first_pixels)}"
                )
            # a blank redraw keeps only its frame: 5% of the first figure's drawn pixels in notebook 04's
            # old bug; a correct redraw can lose more than half (notebook 05: a policy that never
            # evicts leaves its evictions panel empty, 19%), so the line is drawn at 15%
            for k, (n, n0) in enumerate(zip(pixels, first_pixels)):
                if n < 0.15 * n0:
                    problems.append(
                        f"{name}: widget cell {c}: after '{done}' figure {k} is incomplete: "
                        f"{n} drawn pixels against {n0} in the first figure"
                    )
        if changed == 0:
            problems.append(f"{name}: widget cell {c}: no control could be changed")
        check_outputs(f"after changing widgets in cell {c}")
    return record


def widest(record: dict) -> str:
    """The widest figure of a notebook: shown px / natural px."""
    widths = record.get("figure_widths") or []
    if not widths:
        return "-"
    w = max(widths, key=lambda x: x["natural"])
    return f"{w['shown']}/{w['natural']}"


def format_table(records: list[dict]) -> str:
    return text_table(
        [
            "notebook",
            "widget cells on open",
            "run all (s)",
            "widgets changed",
            "latency (s)",
            "widest figure (shown/px)",
        ],
        [
            [
                r["notebook"],
                r.get("widget_cells_on_open", 0),
                r["run_all_s"] or 0,
                "; ".join(r["widgets_changed"]) or "-",
                ", ".join(f"{x:.1f}" for x in r["update_latency_s"]) or "-",
                widest(r),
            ]
            for r in records
        ],
        [None, None, "{:.1f}", None, None, None],
    ) + "".join(
        f"\n{r['notebook']}: drew only at a second press of Run Interact after: {'; '.join(r['pressed_twice'])}"
        for r in records
        if r.get("pressed_twice")
    )


def unreachable_links(lab: Lab) -> list[str]:
    """Every relative link of every notebook's text (to docs/, to another notebook), asked of the
    running JupyterLab: a target outside the folder JupyterLab serves is a 404 for the reader."""
    problems = []
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for target in re.findall(r"\]\(([^)#\s]+)", "".join(cell["source"])):
                if "://" in target:
                    continue
                served = (path.parent / target).resolve().relative_to(ROOT).as_posix()
                try:
                    lab.api("GET", "/api/contents/" + urllib.parse.quote(served) + "?content=0")
                except urllib.error.HTTPError as error:
                    problems.append(
                        f"{path.name}: link {target} -> {served}: HTTP {error.code} from JupyterLab"
                    )
    return problems


def run_notebooks(lab: Lab, queue: "queue.Queue[Path]", problems: list[str], records: list[dict]) -> None:
    """One browser of its own, taking notebooks from the queue until it is empty."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        while True:
            try:
                path = queue.get_nowait()
            except Empty:
                break
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(60_000)
            try:
                records.append(run_notebook(page, lab, path, problems))
            except Exception as error:  # keep going: report all notebooks
                problems.append(f"{path.name}: {type(error).__name__}: {error}")
                page.screenshot(path=str(OUT / f"{path.stem}-failure.png"))
            finally:
                page.close()
                lab.shut_down_kernel(path.name)
        browser.close()


def test_every_notebook_runs_and_its_widgets_work_in_jupyterlab(tmp_path, record_property):
    assert NOTEBOOKS, "no notebooks found"
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.png"):
        old.unlink()
    hashes = {path: digest(path) for path in NOTEBOOKS}
    lab = Lab(
        lab_settings(tmp_path / "settings"),
        tmp_path / "workspaces",
        OUT / "jupyterlab.log",
        trusted_notebooks(tmp_path / "nbsignatures.db"),
    )
    problems, records = [], []
    try:
        problems += unreachable_links(lab)
        # BROWSERS notebooks at a time, each in its own browser with its own kernel: a notebook runs
        # on one torch thread, so on a two-core machine two of them take the time of one
        work: queue.Queue[Path] = queue.Queue()
        for path in NOTEBOOKS:
            work.put(path)
        workers = [
            threading.Thread(target=run_notebooks, args=(lab, work, problems, records))
            for _ in range(min(BROWSERS, len(NOTEBOOKS)))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        lab.stop()
    records.sort(key=lambda r: r["notebook"])
    table = format_table(records)
    (OUT / "summary.json").write_text(json.dumps({"notebooks": records, "problems": problems}, indent=1))
    (OUT / "table.txt").write_text(table + "\n")
    record_property("browser_table", table)
    changed_on_disk = [p.name for p, h in hashes.items() if digest(p) != h]
    assert not changed_on_disk, f"the browser run rewrote committed notebooks: {changed_on_disk}"
    assert not problems, "\n".join(problems)
    interactive = [p.name for p in NOTEBOOKS if "ipywidgets" in p.read_text(encoding="utf-8")]
    assert interactive
    for record in records:
        if record["notebook"] in interactive:
            assert record["widgets_changed"], record


def test_the_output_comparison_is_nbvals():
    """stored_output_differences on a committed notebook against itself, changed: a changed printed
    character is found, a changed timing is sanitized away, and a cell tagged nbval-ignore-output
    is not compared."""
    path = ROOT / "notebooks" / "01_why_a_kv_cache.ipynb"  # it prints in tagged cells too

    def changed(text, ignored=False):
        """The notebook's cells, as the page's model holds them, with the first stdout of the first
        cell that is (ignored=True) or is not tagged nbval-ignore-output replaced by text."""
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        output = next(
            o
            for c in cells
            if c["cell_type"] == "code"
            and ("nbval-ignore-output" in c["metadata"].get("tags", [])) == ignored
            for o in c["outputs"]
            if o["output_type"] == "stream"
        )
        if text is not None:
            output["text"] = text
        return cells

    assert stored_output_differences(path, changed(None)) == []
    found = stored_output_differences(path, changed("a line it does not print\n"))
    assert len(found) == 1 and "'stdout' output differs" in found[0], found
    assert stored_output_differences(path, changed("anything\n", ignored=True)) == []

    def stdout(text):
        return compared_fields([{"output_type": "stream", "name": "stdout", "text": text}])

    assert stdout(["took 1.5 s", " for 3 tokens\n"]) == stdout("took 9.25 ms for 3 tokens\n")
    assert stdout("took 1.5 s for 3 tokens\n") != stdout("took 1.5 s for 4 tokens\n")
