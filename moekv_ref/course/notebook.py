"""What every notebook sets before its first cell runs: `from moekv_ref.course.notebook import setup; setup()`.

One call, so that the notebooks cannot drift apart:

* torch runs on one thread. The notebooks time small operations (a decode step of a 2 M-parameter
  model, a serving run) on machines that are often shared (a classroom server, a laptop with a
  browser open). With several threads each tiny matrix product is split across cores that wait for
  each other, and the timings swing with whatever else runs; with one thread they are steadier, and
  on a small model faster.
* Processes the notebook starts (notebook 07's ranks) inherit OMP_NUM_THREADS=1 for the same reason.
* torch's global random generator is seeded, so that anything drawn without an explicit generator is
  the same on every run (the notebooks' stored outputs are checked by nbval).
* In a Jupyter kernel, matplotlib's inline backend is switched on now. matplotlib picks its backend
  only when pyplot first draws, and until then `display(fig)` of a figure made without pyplot (the
  widget figures, `moekv_ref.plots.serving.plot_run`) shows the text "<Figure size ...>" instead of
  the picture.

`interact` is ipywidgets' interact for the notebooks' "Try it" cells: the same controls and output,
plus a still of what they printed and the first figure they drew (next to the controls in the cell's
stored output), so a notebook opened untrusted, or shown by a viewer that draws no widgets, shows
that text and figure instead of the widget's text form.
"""

from __future__ import annotations

import contextlib
import functools
import html
import io
import os
import sys

import torch

from ..validation import MAX_INT32, check_int, check_seed

NUM_THREADS = 1
SEED = 0


def setup(seed: int = SEED, num_threads: int = NUM_THREADS) -> None:
    """Set torch's threads (and its children's) and seed for a notebook. Prints nothing: a notebook's
    stored output must not depend on the machine or the torch version."""
    num_threads = check_int("num_threads", num_threads, 1, MAX_INT32)
    seed = check_seed("seed", seed)
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for processes started from the notebook
    torch.manual_seed(seed)
    _inline_figures()


def _inline_figures() -> None:
    """`%matplotlib inline` when running in a Jupyter kernel (not in a terminal IPython or a script)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "kernel"):
        shell.run_line_magic("matplotlib", "inline")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STILL_NOTE = (
    "[what these controls showed first, without them: trust the notebook (jupyter trust "
    "notebooks/*.ipynb) or run this cell to use them]"
)


def interact(function, manual: bool = False, **controls):
    """ipywidgets.interact(function, **controls), with the first output kept as a still.

    The controls and their output widget are ipywidgets' `interactive`, drawn once with the controls'
    first values (also when manual: then each later change waits for the "Run Interact" button, for
    callbacks that take seconds). What that first call prints and the first PNG figure it displays
    go, as they are shown, into the output widget, and are also kept: the cell's output is one bundle
    holding the widget's view, the printed text and that figure as one piece of HTML (`still_html`),
    the figure as image/png and the text as text/plain. JupyterLab shows the widget where it may (a
    trusted notebook, a running kernel) and the HTML anywhere else (an untrusted notebook shows only
    renderers that run no code). Returns the
    `interactive` widget (its controls, its output, `.update()`)."""
    import ipywidgets
    from IPython import get_ipython
    from IPython.display import display

    shell = get_ipython()
    first = {"text": io.StringIO(), "png": None}
    calls = []

    @functools.wraps(function)  # ipywidgets reads the parameters' names and defaults from it
    def run(**values):
        if calls or shell is None:
            return function(**values)
        calls.append(values)
        with _kept(shell, first):
            return function(**values)

    widget = ipywidgets.interactive(run, {"manual": manual}, **controls)
    if manual:
        widget.update()  # ipywidgets draws a manual interact only on the button: the first values' output now
    if shell is None:
        display(widget)
        return widget
    bundle, _ = shell.display_formatter.format(widget)  # what display(widget) would send
    if WIDGET_VIEW not in bundle:
        display(widget)
        return widget
    text = first["text"].getvalue().rstrip("\n")
    data = {
        WIDGET_VIEW: bundle[WIDGET_VIEW],
        "text/html": still_html(text, first["png"]),
        "text/plain": f"{text}\n{STILL_NOTE}".lstrip("\n"),
    }
    if first["png"] is not None:
        data["image/png"] = first["png"]
    display(data, raw=True)
    return widget


def still_html(text: str, png: str | None) -> str:
    """The still as one piece of HTML: the printed text, then the figure, then the note.

    A viewer shows one format of an output. JupyterLab shows the widget in a trusted notebook; in an
    untrusted one it shows the richest format that runs no code, which is HTML (sanitized) before
    image/png before text/plain. So the text and the figure go into the HTML together: with the figure
    alone as image/png, the printed tables and the hint to trust the notebook were hidden."""
    parts = []
    if text:
        parts.append(f"<pre>{html.escape(text)}</pre>")
    if png is not None:
        parts.append(
            f'<img src="data:image/png;base64,{png.strip()}" alt="the first figure these controls drew">'
        )
    parts.append(f"<p><em>{html.escape(STILL_NOTE)}</em></p>")
    return "\n".join(parts)


class _Tee(io.TextIOBase):
    """A stream writing to `stream` and keeping a copy in `kept`."""

    def __init__(self, stream, kept: io.StringIO):
        self.stream = stream
        self.kept = kept

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _kept(shell, first: dict):
    """While it lasts, stdout and every display still go where they went (the output widget), and
    the printed text and the first PNG displayed are also kept in `first`. The displays are read by a
    hook of the kernel's display publisher (ipykernel's; a shell without hooks keeps the text only)."""

    def keep(message):
        data = message.get("content", {}).get("data", {})
        if first["png"] is None and "image/png" in data:
            first["png"] = data["image/png"]
        return message  # sent on as it was

    publisher = shell.display_pub
    hooks = hasattr(publisher, "register_hook")
    if hooks:
        publisher.register_hook(keep)
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, first["text"])):
            yield
    finally:
        if hooks:
            publisher.unregister_hook(keep)
