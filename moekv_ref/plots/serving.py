"""What a serving run did, as data and as figures: the timeline of every request, the pool's use per
step, and the admission prediction against what routing then needed. The demo, notebook 04 and the
tests share these functions."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..engine import LLMEngine

STATE_COLORS = {"waiting": "#d9d9d9", "running": "#4c9be8", "preempted": "#e8a33d"}


def _check_history(engine: LLMEngine) -> None:
    if not engine.record_history:
        raise ValueError(
            "this engine kept no history: build it with LLMEngine(..., record_history=True) "
            "to draw its timeline, pool use or demand"
        )


def request_segments(engine: LLMEngine) -> dict[int, list[tuple[int, int, str]]]:
    """Per request, its life as (first step, last step + 1, state) segments, state in waiting /
    running / preempted, built from the engine's events. Segments of a request tile
    [arrival step, finished step + 1) without gaps."""
    _check_history(engine)
    segments: dict[int, list[tuple[int, int, str]]] = {}
    state: dict[int, tuple[int, str]] = {}  # request -> (since step, state)
    for event in engine.events:
        rid, step = event.request_id, event.step
        new = {
            "arrived": "waiting",
            "admitted": "running",
            "resumed": "running",
            "preempted": "preempted",
            "finished": None,
            "aborted": None,
            "failed": None,
        }[event.kind]
        if rid in state:
            since, old = state.pop(rid)
            end = step + 1 if new is None else step
            if end > since:
                segments.setdefault(rid, []).append((since, end, old))
        if new is not None:
            state[rid] = (step, new)
    for rid, (since, old) in state.items():  # still in flight
        segments.setdefault(rid, []).append((since, engine.step_count, old))
    return segments


def pool_use(engine: LLMEngine) -> dict[str, np.ndarray]:
    """Per step: blocks used (after the forward; and when the step was scheduled), reserved for the
    step's worst case, in the swap space, and sequences running / waiting / preempted. Arrays of
    length num_steps. Invariant: scheduled_used_blocks + reserved_blocks <= the pool."""
    _check_history(engine)
    timeline = engine.timeline
    return {
        "step": np.array([s.step for s in timeline]),
        "used_blocks": np.array([s.used_blocks for s in timeline]),
        "scheduled_used_blocks": np.array([s.scheduled_used_blocks for s in timeline]),
        "reserved_blocks": np.array([s.reserved_blocks for s in timeline]),
        "swapped_blocks": np.array([s.swapped_blocks for s in timeline]),
        "num_running": np.array([s.num_running for s in timeline]),
        "num_waiting": np.array([s.num_waiting for s in timeline]),
        "num_preempted": np.array([s.num_preempted for s in timeline]),
    }


def demand_table(engine: LLMEngine) -> list[dict]:
    """Per finished request: tokens cached, the admission prediction in blocks, and the blocks it
    actually held at the end."""
    _check_history(engine)
    rows = []
    for request in engine.requests.values():
        if request.actual_blocks is None:
            continue
        rows.append(
            {
                "request_id": request.request_id,
                "num_tokens": request.max_cached_tokens,
                "predicted_blocks": request.predicted_blocks,
                "actual_blocks": request.actual_blocks,
            }
        )
    return rows


def plot_timeline(engine: LLMEngine, ax=None):
    ax = ax or plt.gca()
    segments = [
        (rid, start, end, state)
        for rid, segs in sorted(request_segments(engine).items())
        for start, end, state in segs
    ]
    if segments:  # one call for every bar: a call per bar cost more than drawing them
        rid, start, end, state = map(np.array, zip(*segments))
        ax.barh(rid, end - start, left=start, color=[STATE_COLORS[s] for s in state], height=0.8, linewidth=0)
    ax.invert_yaxis()
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("engine step (one forward of the running batch)")
    ax.set_ylabel("request id")
    ax.set_title("each request's life")
    handles = [Patch(color=color, label=state) for state, color in STATE_COLORS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=10, frameon=False)
    return ax


def plot_pool_use(engine: LLMEngine, ax=None):
    ax = ax or plt.gca()
    use = pool_use(engine)
    ax.fill_between(use["step"], use["used_blocks"], step="post", alpha=0.6, label="blocks in use")
    ax.plot(
        use["step"],
        use["scheduled_used_blocks"] + use["reserved_blocks"],
        drawstyle="steps-post",
        lw=0.8,
        color="k",
        label="in use when scheduled + the step's worst case",
    )
    if use["swapped_blocks"].any():
        ax.plot(
            use["step"],
            use["swapped_blocks"],
            drawstyle="steps-post",
            color="tab:orange",
            label="blocks in the CPU swap space",
        )
    ax.axhline(engine.memory.num_blocks, color="tab:red", ls="--", lw=1, label="pool size")
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"blocks ({engine.memory.block_size} slots each)")
    ax.set_ylim(0, engine.memory.num_blocks * 1.08)
    ax.set_title("pool use over time")
    ax.legend(
        fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False
    )  # below: covers no data;
    # one column, centred under this panel: two would run past the figure's left edge
    return ax


def plot_demand(engine: LLMEngine, ax=None):
    ax = ax or plt.gca()
    table = demand_table(engine)
    predicted = np.array([r["predicted_blocks"] for r in table])
    actual = np.array([r["actual_blocks"] for r in table])
    ax.scatter(actual, predicted, s=14)
    top = max(predicted.max(initial=1), actual.max(initial=1)) * 1.05
    ax.plot([0, top], [0, top], color="k", lw=0.8, ls=":", label="prediction = actual")
    ax.set_xlabel("held by the request at its end (blocks)")
    ax.set_ylabel("predicted at its admission (blocks)")
    if engine.scheduler.batching.admits_on_prediction():
        ax.set_title("admission prediction vs routed demand")
    else:  # recorded, but this admission rule never consulted it
        ax.set_title("prediction (unused by this admission)\nvs routed demand")
    ax.legend(fontsize=10, loc="upper left")  # the points sit on or above the diagonal, away from this corner
    return ax


def plot_run(engine: LLMEngine, title: str = "") -> Figure:
    """The three panels, the timeline above the pool use and the demand; returns the figure: show it
    with IPython's `display(fig)`, save it with `fig.savefig(path)`.

    The figure is made without pyplot, so it is not among pyplot's open figures, which any thread may
    show and close: in JupyterLab, widget messages are handled on a second kernel thread, and after each
    one matplotlib-inline shows and closes every open pyplot figure. A figure that an interact callback
    was still drawing on the main thread was then shown half drawn (mostly blank) and closed, in most
    fresh kernels on the first one or two changes of notebook 04's widgets."""
    fig = Figure(figsize=(9.4, 8.2))  # two rows; under 10 in wide, so JupyterLab shows it unshrunk
    # fixed margins, not a layout engine: constrained layout measures every tick label again on each
    # draw; rendered as IPython does, 0.47 s with it, 0.39 s without (measured)
    grid = fig.add_gridspec(
        2,
        2,
        height_ratios=[1, 1.15],
        left=0.08,
        right=0.86,
        bottom=0.2,
        top=0.9 if title else 0.96,
        hspace=0.35,
        wspace=0.3,
    )
    plot_timeline(engine, fig.add_subplot(grid[0, :]))
    plot_pool_use(engine, fig.add_subplot(grid[1, 0]))
    plot_demand(engine, fig.add_subplot(grid[1, 1]))
    if title:
        fig.suptitle(title)
    return fig
