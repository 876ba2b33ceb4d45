"""Progress bars do not flood logs: tqdm(disable=None) draws nothing when stderr is not a terminal."""

import sys

from moekv_ref.apps.demo import run_demo


def test_demo_progress_bar_stays_off_when_stderr_is_not_a_terminal(capsys):
    """tqdm with disable=None: under pytest stderr is captured, not a terminal, so no bar lines."""
    assert not sys.stderr.isatty()
    summary, _ = run_demo(num_requests=2, num_blocks=200, figures=None, progress=True)
    assert summary["finished"] == 2
    assert "admission predicted" not in capsys.readouterr().err
