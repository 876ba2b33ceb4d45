"""What a newcomer meets in a fresh clone: the commands of the README and docs/results.md from a
folder with no runs/, the Triton backend on a CPU, the thread count of `generate`, `bench memory`
leaving the committed figures alone, and `bench simulator --against DIR` timing DIR's code and
nothing else."""

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moekv_ref.apps import (
    bench_eviction,
    bench_memory,
    bench_simulator,
    bench_step,
    cli,
    options,
)
from moekv_ref.apps.cli import main
from moekv_ref.sim import synthetic_trace

ROOT = Path(__file__).resolve().parent.parent
APPS = [ROOT / "moekv_ref" / "apps", ROOT / "moekv_kernels"]


class Stop(Exception):
    """Raised by a stand-in for the generation, once it has seen what it came to see."""


# ----- --against: only the other checkout's code ---------------------------------------------------
def test_bench_simulator_refuses_a_folder_holding_only_an_empty_package(tmp_path, capsys):
    """A folder with an empty moekv_ref/__init__.py once reported "faster, the same decisions": the
    editable install's import finder filled in every module it lacked with this checkout's, so this
    code was timed against itself. Now it is refused before anything is timed, by the command's
    checks and by the timing itself."""
    (tmp_path / "moekv_ref").mkdir()
    (tmp_path / "moekv_ref" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match=f"--against={tmp_path} is not a complete checkout"):
        bench_simulator.measure_speed(2, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "simulator", "--requests", "2", "--against", str(tmp_path)])
    assert exit_info.value.code == 2
    assert (
        f"--against={tmp_path} is not a complete checkout of this repository: it lacks "
        "moekv_ref/sim/runner.py, moekv_ref/sim/traces.py; allowed: the root of a checkout"
    ) in capsys.readouterr().err


def copy_of_the_package(root: Path) -> Path:
    """A copy of this checkout's moekv_ref (its code and data, not the weights) under root."""
    shutil.copytree(
        ROOT / "moekv_ref", root / "moekv_ref", ignore=shutil.ignore_patterns("__pycache__", "*.pt")
    )
    return root


def test_bench_simulator_imports_a_checkout_from_its_own_files_only(tmp_path):
    """A whole copy passes, every module loaded from the copy; a copy missing a module the runner
    imports is refused naming it (the editable finder would have lent this checkout's); a module that
    is a link into this checkout is refused too (it would time this code)."""
    whole = copy_of_the_package(tmp_path / "whole")
    modules = bench_simulator.check_speed_checkout(whole)
    assert {"moekv_ref", "moekv_ref.sim.runner", "moekv_ref.costs"} <= set(modules)

    lacking = copy_of_the_package(tmp_path / "lacking")
    (lacking / "moekv_ref" / "costs.py").unlink()
    with pytest.raises(ValueError, match=r"importing moekv_ref\.costs failed: moekv_ref\.costs is not there"):
        bench_simulator.check_speed_checkout(lacking)

    linked = copy_of_the_package(tmp_path / "linked")
    (linked / "moekv_ref" / "costs.py").unlink()
    (linked / "moekv_ref" / "costs.py").symlink_to(ROOT / "moekv_ref" / "costs.py")
    with pytest.raises(ValueError, match=r"modules loaded from elsewhere: moekv_ref\.costs from "):
        bench_simulator.check_speed_checkout(linked)


def test_bench_step_against_times_the_other_checkouts_code_only(tmp_path):
    """bench step --against had the same hole: its worker put DIR first on PYTHONPATH and the editable
    finder lent this checkout's modules. A folder with an empty package, or a copy missing a module the
    engine imports, is refused before a step is timed; a whole copy runs from its own files."""
    (tmp_path / "empty" / "moekv_ref").mkdir(parents=True)
    (tmp_path / "empty" / "moekv_ref" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match="is not a complete checkout of this repository: importing"):
        bench_step.measure(tmp_path / "empty", num_seqs=2, max_new_tokens=2, num_rounds=1)
    lacking = copy_of_the_package(tmp_path / "lacking")
    (lacking / "moekv_ref" / "cache" / "paged.py").unlink()
    with pytest.raises(ValueError, match=r"importing moekv_ref\.cache\.paged failed"):
        bench_step.measure(lacking, num_seqs=2, max_new_tokens=2, num_rounds=1)
    whole = copy_of_the_package(tmp_path / "whole")
    shutil.copy(ROOT / "moekv_ref" / "weights" / "tiny.pt", whole / "moekv_ref" / "weights" / "tiny.pt")
    result = bench_step.measure(whole, num_seqs=2, max_new_tokens=2, num_rounds=1)
    assert result["num_decode_pairs"] >= 1


# ----- output paths: folders made ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "eviction", "--json", "runs/e.json"],
        ["bench", "serving", "--json", "runs/s.json"],
        ["bench", "parallel", "--json", "runs/p.json"],
        ["bench", "step", "--json", "runs/step.json"],
        ["bench", "peer", "--json", "runs/peer.json"],
        ["bench", "cluster", "--json", "runs/c.json"],
        ["bench", "simulator", "--json", "runs/sim.json"],
        ["bench", "memory", "--json", "runs/m.json"],
        ["train-family", "--out", "runs/family.json"],
        ["capacity", "--out", "runs/capacity.json"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_command_accepts_an_output_in_a_folder_not_made_yet(tmp_path, monkeypatch, argv):
    """A fresh clone has no runs/: docs/results.md's `--json runs/...` commands once stopped at their
    checks (or, `moekv_kernels.report`, after the work) because the folder was missing."""
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(argv)
    options.fail_on(args.command_parser, args.check, args)  # no SystemExit
    assert list(tmp_path.iterdir()) == []  # checked, nothing made yet


def test_train_accepts_an_output_in_a_folder_not_made_yet(tmp_path, monkeypatch):
    from moekv_ref.apps import train

    monkeypatch.chdir(tmp_path)
    train.check_args(SimpleNamespace(out=Path("runs/tiny.pt")))  # no ValueError
    assert list(tmp_path.iterdir()) == []


def test_every_writer_makes_the_folders_of_its_file(tmp_path, monkeypatch):
    """Each program's writer, from a folder with no runs/ (bench cluster and bench simulator write
    with jsonout.write itself)."""
    from moekv_ref.jsonout import write

    monkeypatch.chdir(tmp_path)
    write("runs/a/plain.json", {"x": 1.0})
    bench_eviction._write_json("runs/b/eviction.json", {"x": 1})
    bench_step.write_json("runs/d/step.json", {"x": 1})
    for name in ("a/plain", "b/eviction", "d/step"):
        assert (tmp_path / "runs" / f"{name}.json").read_text().startswith("{")


def test_every_output_option_is_checked_with_its_folder_made():
    """Every --json / --out check of every program lets the folder be made (the writers make it):
    none keeps the old rule of an existing folder, which a fresh clone's runs/ fails."""
    calls = []
    for folder in APPS:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            calls += [(path.name, call) for call in re.findall(r"output_file\((.*?)\)\n", text)]
    assert len(calls) >= 10
    assert [c for c in calls if "parents_made=True" not in c[1]] == []


def test_kernel_report_json_makes_its_folder_before_the_work(tmp_path, monkeypatch, capsys):
    """`python -m moekv_kernels.report --json runs/...` once printed its whole table (17 s), then
    raised a raw FileNotFoundError; now the folder is made, and a path whose folder cannot be made is
    refused before anything compiles."""
    from moekv_kernels import report

    compiled = []
    monkeypatch.setattr(report, "collect", lambda *args: compiled.append(args) or [])
    monkeypatch.chdir(tmp_path)
    report.main(["--quick", "--json", "runs/kernels_report.json"])
    assert (tmp_path / "runs" / "kernels_report.json").read_text().strip() == "[]"
    assert len(compiled) == 1
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--quick", "--json", "/dev/null/runs/kernels_report.json"])
    assert exit_info.value.code == 2 and len(compiled) == 1
    assert "/dev/null is a character device, not a directory" in capsys.readouterr().err


# ----- bench memory ------------------------------------------------------------------------------------
def small_report(block_size: int = 16, quick: bool = False) -> dict:
    traces = {
        name: synthetic_trace(
            8, num_layers=4, num_experts=E, top_k=K, mean_prompt=64, mean_output=64, seed=i, name=name
        )
        for i, (name, E, K) in enumerate([("W1", 8, 2), ("W2", 64, 8), ("W3", 8, 2)])
    }
    return bench_memory.build_report(traces, block_size, "test", speed_repeats=1, sweep_sequences=4)


def test_bench_memory_writes_under_runs_by_default_and_leaves_figures_alone(tmp_path, monkeypatch, capsys):
    """`bench memory` with no options writes runs/bench_memory.json (its folder made), not the
    committed figures/bench_memory.json, which `python -m moekv_ref figures` regenerates on purpose."""
    monkeypatch.setattr(bench_memory, "run", small_report)
    monkeypatch.chdir(tmp_path)
    assert bench_memory.main([]) == 0
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == [
        "runs",
        "runs/bench_memory.json",
    ]
    assert "wrote runs/bench_memory.json" in capsys.readouterr().out
    docs = (ROOT / "README.md").read_text() + (ROOT / "docs" / "results.md").read_text()
    assert "python -m moekv_ref bench memory --json figures/" not in docs
    assert f"(writes {bench_memory.DEFAULT_JSON})" in (ROOT / "docs" / "results.md").read_text()
    figures_source = (ROOT / "moekv_ref" / "apps" / "figures.py").read_text()
    assert '(directory / "bench_memory.json")' in figures_source


def test_bench_memory_states_each_goal_as_a_measurement_not_a_failure():
    """The table once ended `targets: {... false ...}`, which reads as a failed run. Now each goal
    says what was measured against what, and whether it was reached."""
    report = small_report()
    closing = bench_memory.format_table(report).split("\n\n")[-1]
    assert "false" not in closing and "true" not in closing and "targets" not in closing
    lines = closing.splitlines()
    assert lines[0].startswith("measured against the design goals")
    paged = report["workloads"]["W1"]["paged"]["effective_utilization"]
    assert f"W1 {paged:.3f} (" in lines[1] and "(goal 0.96 or more)" in lines[1]
    w2 = report["workloads"]["W2"]
    assert (
        f"paged sequences held at once on W2: {w2['paged']['max_concurrent_sequences']}, against "
        f"reserved's {w2['reserved']['max_concurrent_sequences']} (goal 3x as many or more: "
    ) in lines[3]
    assert "M slot appends/s (goal 5 M or more: " in lines[4]
    assert len(lines) == 5 and all("reached" in line for line in lines[1:])


# ----- generate: threads and the Triton interpreter ----------------------------------------------------
def test_generate_runs_on_one_thread_unless_told(monkeypatch):
    """`generate` once used every torch thread: under load, 64 tokens took 13-61 s, against about 7 s
    on one. It now runs on --threads (default 1), said in --help, and gives the count back after."""
    seen = []

    def stand_in(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise Stop

    monkeypatch.setattr(cli, "generate", stand_in)
    before = torch.get_num_threads()
    for argv, threads in (([], 1), (["--threads", "2"], 2)):
        with pytest.raises(Stop):
            main(["generate", "--prompt", "x", *argv])
        assert seen[-1] == threads and torch.get_num_threads() == before
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert re.search(r"--threads THREADS\s+torch threads while generating \(default 1", help_text)
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--threads", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled, not interpreted")
def test_generate_on_the_triton_backend_says_it_runs_in_the_interpreter(monkeypatch, capsys):
    """On a CPU, `--backend triton` runs minutes in Triton's interpreter: a notice says so on stderr
    before the first token, so the command does not look hung."""
    pytest.importorskip("triton")
    told = []

    def stand_in(*args, **kwargs):
        told.append(capsys.readouterr().err)
        raise Stop

    monkeypatch.setattr(cli, "generate_with_engine", stand_in)
    with pytest.raises(Stop):
        main(["generate", "--prompt", "x", "--cache", "paged", "--backend", "triton"])
    assert told == [cli.INTERPRETER_NOTICE + "\n"]
    assert "Triton's CPU interpreter" in told[0] and "much slower than --backend torch" in told[0]
    monkeypatch.setattr(cli, "generate", stand_in)
    with pytest.raises(Stop):
        main(["generate", "--prompt", "x"])
    assert told[-1] == ""  # the torch backend says nothing
