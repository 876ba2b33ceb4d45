"""Timing the simulator against another checkout (`bench simulator --against DIR`) works on
checkouts from before the trace runner's module was named sim/runner.py: there it was
sim/eviction.py, with the setup named EvictionSetup, and the worker imports that instead."""

import re
import shutil
from pathlib import Path

import pytest

from moekv_ref.apps import bench_simulator
from moekv_ref.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]


def checkout_with_the_runner_s_old_name(root: Path) -> Path:
    """A copy of this checkout's moekv_ref as an older commit had it: sim/eviction.py, EvictionSetup."""
    shutil.copytree(
        ROOT / "moekv_ref", root / "moekv_ref", ignore=shutil.ignore_patterns("__pycache__", "*.pt")
    )
    sim = root / "moekv_ref" / "sim"
    runner = (sim / "runner.py").read_text(encoding="utf-8")
    (sim / "eviction.py").write_text(re.sub(r"\bRunnerSetup\b", "EvictionSetup", runner), encoding="utf-8")
    (sim / "runner.py").unlink()
    return root


def test_the_speed_worker_runs_a_checkout_whose_runner_has_its_old_name(tmp_path):
    older = checkout_with_the_runner_s_old_name(tmp_path / "older")
    modules = bench_simulator.check_speed_checkout(older)
    assert "moekv_ref.sim.eviction" in modules and "moekv_ref.sim.runner" not in modules
    shape = (2, 4, 2, 2, 4000)
    ours = bench_simulator.speed_run(ROOT, shape, 4)
    theirs = bench_simulator.speed_run(older, shape, 4)
    assert theirs["blocks_in_use_summed"] == ours["blocks_in_use_summed"] > 0


def test_the_speed_options_accept_a_checkout_whose_runner_has_its_old_name(tmp_path):
    older = checkout_with_the_runner_s_old_name(tmp_path / "older")
    args = bench_simulator.build_parser().parse_args(["--requests", "2", "--against", str(older)])
    bench_simulator.check_args(args)  # raises if a file the worker imports is missing


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--scale", "--against", "."],
            "--against applies to the speed run (no --scale), not to --scale: it would be ignored",
        ),
        (["--threads", "1"], "--threads applies to --scale, not to the speed run (no --scale)"),
        (["--scale", "--threads", "0"], "--threads=0 is not allowed"),
        (["--requests", "0"], "--requests=0 is not allowed"),
    ],
)
def test_bench_simulator_refuses_an_option_its_run_ignores_or_cannot_take(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "simulator", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_cluster_keeps_the_cluster_study_only(capsys):
    """The simulator's speed is its own program: bench cluster takes neither --speed nor --scale."""
    for option in ("--speed", "--scale", "--against", "--threads"):
        with pytest.raises(SystemExit):
            main(["bench", "cluster", option])
        assert f"unrecognized arguments: {option}" in capsys.readouterr().err
