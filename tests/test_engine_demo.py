"""The functions notebook 04's widgets call, on the embedded model with a few requests (the `demo`
command itself is tested in test_cli.py)."""

import matplotlib
import pytest

from moekv_ref.apps.demo import explore, sparkline

matplotlib.use("Agg")


@pytest.mark.parametrize("routing,preemption", [("topk", "swap"), ("threshold", "recompute")])
def test_explore_runs_each_widget_setting(routing, preemption):
    summary, engine = explore(
        arrival_rate=2.0,
        num_blocks=180,
        routing=routing,
        preemption_mode=preemption,
        admission="optimistic",
        num_requests=3,
    )
    assert summary["finished"] == 3
    engine.memory.assert_no_leak()
    if routing == "topk":  # every token goes to exactly k experts
        assert summary["experts_per_token_per_layer"] == [2.0] * 4


def test_sparkline_scales_to_the_top():
    assert sparkline([0, 4, 8], width=3, top=8) == " ▄█"
    assert sparkline([], width=5) == ""


def test_notebook_04_names_the_pools_that_refuse_its_requests():
    """Notebook 04's widget text says which pools refuse which of explore's twelve requests: the long
    one below 276 blocks, others too below 124 (a request must be able to finish alone)."""
    import json
    import re
    from pathlib import Path

    from moekv_ref.checkpoint import load_default_model
    from moekv_ref.demo_workload import demo_workload
    from moekv_ref.engine.engine import LLMEngine
    from moekv_ref.engine.scheduler_config import SchedulerConfig

    model = load_default_model("threshold")
    workload = demo_workload(12, 0.5, 0)

    def refused(num_blocks: int) -> int:
        engine = LLMEngine(model, num_blocks, 16, SchedulerConfig(admission="optimistic"))
        count = 0
        for request in workload:
            try:
                engine.add_request(request.prompt, request.sampling_params)
            except ValueError:
                count += 1
        return count

    assert [refused(n) for n in (123, 124, 275, 276)] == [2, 1, 1, 0]
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "04_continuous_batching.ipynb"
    text = " ".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"])
    bullet = re.search(r"\*\*pool blocks\*\*[^*]+", text).group(0)
    assert "276 blocks" in bullet and "124 blocks" in bullet, bullet
    assert "always" not in bullet, bullet


def test_demo_title_counts_the_requests_that_ran():
    from moekv_ref.apps.demo import demo_title

    title = demo_title({"requests": 21, "refused": 1}, 200, "predicted", "recompute")
    assert title.startswith("demo: 20 requests served (1 refused), a pool of 200 blocks"), title
    assert "refused" not in demo_title({"requests": 3, "refused": 0}, 200, "optimistic", "swap")
