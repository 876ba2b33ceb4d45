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
