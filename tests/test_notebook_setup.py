"""moekv_ref.course.notebook: setup, the one call every notebook's first cell makes (threads, seed), and
interact, the "Try it" cells' controls with a still of their first figure."""

import base64
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from moekv_ref.course.notebook import STILL_NOTE, WIDGET_VIEW, interact, setup, still_html

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def restore_torch_state():
    threads, rng, omp = torch.get_num_threads(), torch.get_rng_state(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def test_setup_sets_one_thread_for_torch_and_child_processes_and_seeds(restore_torch_state):
    torch.set_num_threads(2)
    setup()
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    first = torch.rand(3)
    setup()
    assert torch.equal(torch.rand(3), first)  # seeded again: the same draw


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_setup_refuses_a_bad_thread_count_before_changing_anything(restore_torch_state, bad):
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="num_threads"):
        setup(num_threads=bad)
    assert torch.get_num_threads() == 2


def test_notebooks_call_setup_in_their_first_code_cell_and_set_no_threads_themselves():
    """Every notebook leaves thread and seed settings to setup()."""
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        first = "".join(cells[0]["source"])
        assert "setup()" in first, path.name
        assert re.search(r"from moekv_ref\.course\.notebook import (\w+, )*setup\b", first), path.name
        every = "".join("".join(c["source"]) for c in cells)
        assert "set_num_threads" not in every, path.name


def test_setup_switches_on_inline_figures_in_a_kernel_only(restore_torch_state, monkeypatch):
    """In a Jupyter kernel setup() runs %matplotlib inline (so that display(fig) of a figure made
    without pyplot shows a picture); outside one (get_ipython() None, or a terminal shell) it does not."""
    import IPython

    class Shell:
        def __init__(self, kernel):
            if kernel:
                self.kernel = object()
            self.magics = []

        def run_line_magic(self, name, line):
            self.magics.append((name, line))

    for in_kernel, expected in ((True, [("matplotlib", "inline")]), (False, [])):
        shell = Shell(in_kernel)
        monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
        setup()
        assert shell.magics == expected
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    setup()  # a plain script: nothing to switch on, no error


def _png(color: str) -> bytes:
    """A real PNG: a tiny figure filled with `color`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(0.5, 0.5), facecolor=color)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


class _Publisher:
    """A kernel's display publisher as `interact` uses it: hooks see each message before it is sent
    (ipykernel's ZMQDisplayPublisher), and what is sent is recorded."""

    def __init__(self):
        self.hooks = []
        self.sent = []

    def register_hook(self, hook):
        self.hooks.append(hook)

    def unregister_hook(self, hook):
        self.hooks.remove(hook)

    def publish(self, data, metadata=None, **kwargs):
        message = {"content": {"data": data, "metadata": metadata or {}}}
        for hook in self.hooks:
            message = hook(message)
        self.sent.append(message["content"]["data"])

    def clear_output(self, wait=False):
        pass


def _png_bytes(data):
    return base64.b64decode(data) if isinstance(data, str) else data


@pytest.mark.parametrize("manual", [False, True])
def test_interact_shows_the_widget_with_a_still_of_its_first_figure_and_text(monkeypatch, manual):
    """The cell's one output is the widget's view, the first call's first PNG and its printed text
    (with the note saying where the controls are); the first call's outputs still reach the widget,
    later calls are not kept, and the publisher's hook is gone after the first call."""
    import IPython
    import ipywidgets
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import Image, display

    shell = InteractiveShell.instance()
    publisher = _Publisher()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(shell, "display_pub", publisher)
    calls = []
    red, blue = _png("red"), _png("blue")

    def show(n=3, kind="a"):
        calls.append((n, kind))
        print(f"n = {n}, kind {kind}")
        display(Image(data=red if len(calls) == 1 else blue))
        display(Image(data=blue))  # a second figure: the still is the first
        print("done")

    widget = interact(show, manual=manual, n=ipywidgets.IntSlider(value=3, min=1, max=9), kind=["a", "b"])
    assert calls == [(3, "a")]  # drawn once with the first values, also when manual
    figures = [d for d in publisher.sent if WIDGET_VIEW not in d]  # the first call's, sent to its output
    assert [_png_bytes(d["image/png"]) for d in figures] == [red, blue]
    cell = [d for d in publisher.sent if WIDGET_VIEW in d]
    assert len(cell) == 1
    bundle = cell[0]
    assert bundle[WIDGET_VIEW]["model_id"] == widget.model_id
    assert _png_bytes(bundle["image/png"]) == red
    assert bundle["text/plain"] == f"n = 3, kind a\ndone\n{STILL_NOTE}"
    assert bundle["text/html"] == still_html("n = 3, kind a\ndone", bundle["image/png"])
    assert publisher.hooks == []
    publisher.sent.clear()
    widget.children[0].value = 5
    if manual:
        widget.update()
    assert calls[-1] == (5, "a")
    assert not [d for d in publisher.sent if WIDGET_VIEW in d]  # a later call shows in the widget only


def test_the_html_still_holds_the_text_the_figure_and_the_note_in_order():
    """What an untrusted notebook shows of a widget cell: its printed text (escaped, so a table with
    `<` stays text), then its first figure, then the hint to trust the notebook; no figure, no image."""
    html = still_html("p < 0.5 & q", "iVBORw0K\n")
    assert html.index("<pre>p &lt; 0.5 &amp; q</pre>") < html.index('src="data:image/png;base64,iVBORw0K"')
    assert html.index("data:image/png") < html.index("jupyter trust")
    assert "<img" not in still_html("text only", None)
    assert "<pre>" not in still_html("", "iVBORw0K")


def test_interact_outside_ipython_is_plain_interactive(monkeypatch):
    import IPython
    import ipywidgets

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    calls = []
    widget = interact(lambda n=1: calls.append(n), n=ipywidgets.IntSlider(value=2))
    assert isinstance(widget, ipywidgets.interactive)
    assert calls == [2]


WIDGET_TEXT_FORM = re.compile(r"interactive\(children=|[A-Z][A-Za-z]*(Slider|Dropdown|Buttons)\(")


def _first_png(state: dict, model_id: str):
    """The first PNG an Output widget under this widget holds in the saved state, depth first."""
    model = state.get(model_id, {}).get("state", {})
    for output in model.get("outputs", []):
        if "image/png" in output.get("data", {}):
            return output["data"]["image/png"]
    for child in model.get("children", []):
        found = _first_png(state, child.removeprefix("IPY_MODEL_"))
        if found is not None:
            return found
    return None


def test_every_widget_cell_stores_a_still_of_its_first_figure():
    """Opened untrusted (JupyterLab then shows no widget) or on GitHub, a "Try it" cell shows the
    text its controls printed and the figure they drew first, not the widget's text form: the stored
    bundle holds them together as HTML, and that figure,
    the same PNG the saved widget state holds for the widget's output (or, where they print only,
    their text)."""
    checked = 0
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        state = notebook["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
        for cell in notebook["cells"]:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if WIDGET_VIEW not in data:
                    continue
                checked += 1
                where = f"{path.name}: {''.join(cell['source'])[:60]!r}"
                text = "".join(data["text/plain"])
                assert not WIDGET_TEXT_FORM.search(text), where
                assert text.endswith(STILL_NOTE), where
                first = _first_png(state.get("state", {}), data[WIDGET_VIEW]["model_id"])
                assert data.get("image/png") == first, where  # None where the controls draw text only
                # an untrusted notebook shows the HTML: the printed text and the figure together
                assert "".join(data["text/html"]) == still_html(
                    text.removesuffix(STILL_NOTE).rstrip("\n"), first
                ), where
                if first is None:
                    assert text.removesuffix(STILL_NOTE).strip(), where  # then their text shows
    assert checked >= 12
