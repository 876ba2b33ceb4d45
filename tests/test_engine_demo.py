"""`python -m moekv_ref demo` and the functions notebook 04's widgets call (issue 4), on the embedded
model with a few requests: the summary's counts agree with the engine, the oversized request is
refused, the figures are written, and nothing is left in the pool."""

import json

import matplotlib
import pytest

from moekv_ref.apps.cli import main
from moekv_ref.apps.demo import explore, sparkline

matplotlib.use("Agg")


def test_demo_cli_writes_summary_and_figures(tmp_path, capsys):
    assert main(["demo", "--num-requests", "3", "--num-blocks", "200", "--figures", str(tmp_path), "--json"]) == 0
    summaries = json.loads(capsys.readouterr().out)
    assert set(summaries) == {"predicted", "optimistic"}
    for admission, summary in summaries.items():
        assert summary["requests"] == 4 and summary["finished"] == 3 and summary["refused"] == 1
        assert "can never fit" in summary["refusals"][0] or "may not fit" in summary["refusals"][0]
        assert summary["resumed"] == summary["preempted"]
        assert summary["peak_used_blocks"] <= 200
        assert (tmp_path / f"demo_serving_{admission}.png").stat().st_size > 10_000


@pytest.mark.parametrize("routing,preemption", [("topk", "swap"), ("threshold", "recompute")])
def test_explore_runs_each_widget_setting(routing, preemption):
    summary, engine = explore(arrival_rate=2.0, num_blocks=180, routing=routing, preemption_mode=preemption,
                              admission="optimistic", num_requests=3)
    assert summary["finished"] == 3
    engine.memory.assert_no_leak()
    if routing == "topk":      # every token goes to exactly k experts
        assert summary["experts_per_token_per_layer"] == [2.0] * 4


def test_sparkline_scales_to_the_top():
    assert sparkline([0, 4, 8], width=3, top=8) == " ▄█"
    assert sparkline([], width=5) == ""
