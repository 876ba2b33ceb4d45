"""Timing the simulator against another checkout (`bench cluster --speed --against DIR`) works on
checkouts from before the trace runner's module was named sim/runner.py: there it was
sim/eviction.py, with the setup named EvictionSetup, and the worker imports that instead."""

import re
import shutil
from pathlib import Path

from moekv_ref.apps import bench_cluster

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
    modules = bench_cluster.check_speed_checkout(older)
    assert "moekv_ref.sim.eviction" in modules and "moekv_ref.sim.runner" not in modules
    shape = (2, 4, 2, 2, 4000)
    ours = bench_cluster.speed_run(ROOT, shape, 4)
    theirs = bench_cluster.speed_run(older, shape, 4)
    assert theirs["blocks_in_use_summed"] == ours["blocks_in_use_summed"] > 0


def test_the_speed_options_accept_a_checkout_whose_runner_has_its_old_name(tmp_path):
    older = checkout_with_the_runner_s_old_name(tmp_path / "older")
    args = bench_cluster.build_parser().parse_args(["--speed", "--requests", "2", "--against", str(older)])
    bench_cluster.check_args(args)  # raises if a file the worker imports is missing
