"""Progress bars do not flood logs: tqdm(disable=None) draws nothing when stderr is not a terminal."""

import sys

from moekv_ref.apps.demo import format_summary, run_demo
from moekv_ref.plots.serving import plot_run


def test_demo_progress_bar_stays_off_when_stderr_is_not_a_terminal(capsys):
    """tqdm with disable=None: under pytest stderr is captured, not a terminal, so no bar lines."""
    assert not sys.stderr.isatty()
    summary, _ = run_demo(num_requests=2, num_blocks=200, figures=None, progress=True)
    assert summary["finished"] == 2
    assert "admission predicted" not in capsys.readouterr().err


def test_the_demo_reports_a_prediction_only_where_admission_uses_it():
    """Optimistic admission never consults the predictor: its summary has no 'admission predicted'
    line, and the demand panel says the prediction was unused; predicted admission keeps both."""
    for admission, used in (("predicted", True), ("optimistic", False)):
        summary, engine = run_demo(
            num_requests=3, num_blocks=200, admission=admission, figures=None, progress=False
        )
        assert summary["admission_uses_prediction"] is used
        assert ("admission predicted" in format_summary(summary, engine)) is used
        titles = [ax.get_title() for ax in plot_run(engine).axes]
        assert ("admission prediction vs routed demand" in titles) is used
        assert any("unused" in title for title in titles) is not used
