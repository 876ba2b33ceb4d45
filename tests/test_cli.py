import json
import os
import subprocess
import sys

import pytest
import torch

from moekv_ref.apps.bench_serving import DESIGNS as SERVING_DESIGNS
from moekv_ref.apps.cli import main
from moekv_ref.backends import triton_available
from moekv_ref.checkpoint import load_checkpoint, save_checkpoint
from moekv_ref.config import get_config
from moekv_ref.model import MoEKVTransformer

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (Linux wheels only)"
)


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_none_equals_contiguous(capsys):
    args = ["--prompt", "def ", "--max-new-tokens", "64", "--greedy"]
    none = run_json(capsys, *args, "--cache", "none")
    contiguous = run_json(capsys, *args, "--cache", "contiguous")
    assert len(contiguous["tokens"]) == 64
    assert none["tokens"] == contiguous["tokens"]
    assert none["cache"] == contiguous["cache"]
    # top-k: every layer's caches hold k * (prompt + generated - 1) tokens
    assert [layer["total_tokens"] for layer in contiguous["cache"]["layers"]] == [2 * (4 + 63)] * 4


def test_generate_streams_text_and_report(capsys):
    assert main(["generate", "--prompt", "import ", "--max-new-tokens", "8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import ")
    assert "KV cache per (layer, expert)" in out and "max/mean" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "--prompt='' is empty"),
        (["--prompt", "x" * 600], "600 tokens, more than the model's max_position_embeddings=512"),
        (["--prompt", "x" * 500, "--max-new-tokens", "20"], "ask for at most 13 new tokens"),
        (
            ["--prompt", "x", "--max-new-tokens", "0"],
            "--max-new-tokens=0 is not allowed; allowed: an integer in [1, 512]",
        ),
        (
            ["--prompt", "x", "--temperature", "-1"],
            "--temperature=-1.0 is not allowed; allowed: a finite number in [0, inf)",
        ),
        (["--prompt", "x", "--top-p", "0"], "--top-p=0.0 is not allowed; allowed: a finite number in (0, 1]"),
    ],
)
def test_bad_option_is_a_parser_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "x", "--checkpoint", "/nonexistent.pt"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--cache", "mmap"), ("--routing", "random"), ("--dtype", "int8")])
def test_unknown_cli_choice(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", option, value])
    assert exit_info.value.code == 2
    assert f"invalid choice: '{value}'" in capsys.readouterr().err


def test_checkpoint_for_another_config_is_refused(tmp_path, capsys):
    other = get_config("tiny", hidden_size=64, num_attention_experts=4)
    path = tmp_path / "other.pt"
    save_checkpoint(MoEKVTransformer(other), path)
    with pytest.raises(
        ValueError, match=r"made for another config \(hidden_size: checkpoint has 64, config asks for 128"
    ):
        load_checkpoint(path, get_config("tiny"))
    assert main(["generate", "--prompt", "x", "--checkpoint", str(path)]) == 2
    assert "made for another config" in capsys.readouterr().err


def test_checkpoint_round_trip_is_exact_and_weights_only(tmp_path):
    model = MoEKVTransformer(get_config("tiny", num_hidden_layers=1))
    path = tmp_path / "m.pt"
    save_checkpoint(model, path)
    payload = torch.load(path, weights_only=True)  # plain tensors and dicts only
    loaded = load_checkpoint(path)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, payload["state_dict"][name].float())


def test_module_entry_point_runs():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moekv_ref",
            "generate",
            "--prompt",
            "def ",
            "--max-new-tokens",
            "4",
            "--greedy",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4


def test_a_prompt_that_is_not_utf8_is_named_before_anything_loads():
    """The shell hands over bytes; Python keeps one it cannot decode as a lone surrogate (b"\\xff" as
    "\\udcff"), which the UTF-8 codec refuses with a message naming no option."""
    done = subprocess.run(
        [sys.executable, "-m", "moekv_ref", "generate", "--prompt", b"def \xff"],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONUTF8": "1"},  # argv decoded as UTF-8 whatever the locale
    )
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "python -m moekv_ref generate: error: --prompt is not UTF-8 text: at character 4, byte 0xff is "
        "not valid UTF-8; allowed: UTF-8 text"
    )


# ----- moved here so that every command-line test is in one file ---------------------------------
def test_cli_generate_paged_gives_the_contiguous_tokens(capsys):
    """`generate --cache paged [--block-size P] --json` = `--cache contiguous` on the embedded model."""
    tokens = {}
    for cache in (["contiguous"], ["paged"], ["paged", "--block-size", "1"]):
        argv = [
            "generate",
            "--prompt",
            "def ",
            "--max-new-tokens",
            "24",
            "--greedy",
            "--json",
            "--cache",
            *cache,
        ]
        assert main(argv) == 0
        tokens[" ".join(cache)] = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens["paged"] == tokens["contiguous"] == tokens["paged --block-size 1"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "def ", "--cache", "paged", "--block-size", "3"])
    assert exit_info.value.code == 2 and "power of two" in capsys.readouterr().err


@needs_triton
def test_cli_triton_backend_gives_the_torch_tokens(capsys, monkeypatch):
    """`generate --backend triton --cache paged --json` (through the serving engine) = `--backend torch`.

    3 new tokens (6 before: on a CPU each step of the Triton interpreter takes seconds): the prefill
    and two decode steps, the second reading K/V the first stored; that the kernels ran, in both
    decode steps of every layer, is counted below (the 4 + 6 tokens of before fit in one block too)."""
    import moekv_kernels

    calls = {name: 0 for name in ("paged_attention", "store_kv", "expert_gemm")}

    def counted(name, kernel):
        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return run

    for name in calls:
        monkeypatch.setattr(moekv_kernels, name, counted(name, getattr(moekv_kernels, name)))
    tokens, launches = {}, {}
    for backend in ("torch", "triton"):
        calls.update(dict.fromkeys(calls, 0))
        assert (
            main(
                [
                    "generate",
                    "--prompt",
                    "def ",
                    "--max-new-tokens",
                    "3",
                    "--greedy",
                    "--json",
                    "--cache",
                    "paged",
                    "--backend",
                    backend,
                ]
            )
            == 0
        )
        output = json.loads(capsys.readouterr().out)
        assert output["backend"] == backend
        tokens[backend], launches[backend] = output["tokens"], dict(calls)
    assert len(tokens["torch"]) == 3 and tokens["triton"] == tokens["torch"]
    num_layers = get_config("tiny").num_hidden_layers
    assert launches["torch"] == dict.fromkeys(calls, 0), launches
    assert launches["triton"]["paged_attention"] >= 2 * num_layers, launches  # each decode step, each layer
    assert launches["triton"]["store_kv"] >= 3 * num_layers and launches["triton"]["expert_gemm"] > 0, (
        launches
    )


def test_cli_triton_backend_needs_the_paged_cache(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--backend", "triton", "--cache", "contiguous"])
    assert exit_info.value.code == 2
    assert "--backend triton runs on the paged cache: add --cache paged" in capsys.readouterr().err


def test_demo_cli_writes_summary_and_figures(tmp_path, capsys):
    assert (
        main(["demo", "--num-requests", "3", "--num-blocks", "200", "--figures", str(tmp_path), "--json"])
        == 0
    )
    summaries = json.loads(capsys.readouterr().out)
    assert set(summaries) == {"predicted", "optimistic"}
    for admission, summary in summaries.items():
        assert summary["requests"] == 4 and summary["finished"] == 3 and summary["refused"] == 1
        assert "can never fit" in summary["refusals"][0] or "may not fit" in summary["refusals"][0]
        assert summary["resumed"] == summary["preempted"]
        assert summary["peak_used_blocks"] <= 200
        assert (tmp_path / f"demo_serving_{admission}.png").stat().st_size > 10_000


@pytest.mark.filterwarnings("ignore")
def test_cli_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "serving.json"
    assert main(["bench", "serving", "--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert set(report["designs"]) == set(SERVING_DESIGNS)
    assert report["speedup_paged_vs_static"] > 0
    assert "speedup continuous_paged vs static" in capsys.readouterr().out


def test_bench_step_against_itself(tmp_path, capsys):
    """Two workers on the same checkout, interleaved: the per-pair ratio is measured, not assumed,
    and stays near 1 (a loose band: the two processes share a noisy machine)."""
    from moekv_ref.apps import bench_step

    out = tmp_path / "step.json"
    assert (
        main(
            [
                "bench",
                "step",
                "--against",
                str(bench_step.REPOSITORY),
                "--num-seqs",
                "3",
                "--max-new-tokens",
                "4",
                "--rounds",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["num_decode_pairs"] == 3  # 1 prefill step + 3 decode steps per round
    assert result["this_decode_step_cpu_ms"] > 0 and result["against_decode_step_cpu_ms"] > 0
    assert 0.2 < result["speedup_median"] < 5
    assert "speedup (median of per-pair ratios)" in capsys.readouterr().out


def test_bench_step_refuses_a_folder_without_the_package(tmp_path, capsys):
    for argv, message in (
        (["--against", str(tmp_path)], f"--against={tmp_path} has no moekv_ref package"),
        (["--rounds", "0"], "--rounds=0 is not allowed; allowed: an integer >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "step", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_results_first_generate_example_prints_python_shaped_text(capsys):
    """docs/results.md's first `generate` command, at the CLI's sampling defaults, prints what
    docs/results.md says: the prompt continued by a call and an indented line, without the runs of dozens of spaces
    that lower temperatures fall into."""
    import re
    import shlex
    from pathlib import Path

    results = (Path(__file__).resolve().parent.parent / "docs" / "results.md").read_text()
    line = next(text for text in results.splitlines() if text.startswith("python -m moekv_ref generate"))
    argv = shlex.split(line.split("#")[0])[3:]  # after `python -m moekv_ref`
    assert main(argv) == 0
    text = capsys.readouterr().out.split("\n\n\n")[0]
    assert text.startswith("if __name__ == self.stoption()") and "`if __name__ == self.stoption()`" in results
    assert re.search(r"\n {4,}\S", text)  # an indented line
    assert max(len(run) for run in re.findall(r" +", text)) <= 12


# ----- the parallel programs: every option checked before anything starts --------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc 0: must be 1, 2, 4 or 8"),
        (["--nproc", "3"], "--nproc 3: must be 1, 2, 4 or 8"),
        (["--timeout", "0"], "--timeout 0: must be a number of seconds > 0 and at most 86400"),
        (["--timeout", "nan"], "--timeout nan: must be a number of seconds > 0"),
        (["--timeout", "inf"], "--timeout inf: must be a number of seconds > 0"),
        (["--start-timeout", "-1"], "--start-timeout -1: must be a number of seconds > 0"),
        (["--decode-steps", "-1"], "--decode-steps -1: must be an integer from 1 to 4095"),
        (["--decode-steps", "0"], "--decode-steps 0: must be an integer from 1 to 4095"),
        (
            ["--context", "100000"],
            "--context 100000: must be an integer from 1 to 4092: the sweep model's "
            "max_position_embeddings=4096 positions hold the context and the 4 decode steps",
        ),
        (["--context", "0"], "--context 0: must be an integer from 1 to 4092"),
        (["--context", "4000", "--decode-steps", "100"], "--context 4000: must be an integer from 1 to 3996"),
        (["--context", "x"], "argument --context: invalid int value: 'x'"),
        (["--placement", "kv_everywhere"], "argument --placement: invalid choice: 'kv_everywhere'"),
        (
            ["--expert-placement", "coactivation"],
            "argument --expert-placement: invalid choice: 'coactivation'",
        ),
    ],
)
def test_parallel_cli_refuses_bad_values(capsys, monkeypatch, argv, message):
    from moekv_ref.apps import parallel_run as parallel_main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MOEKV_FAULT", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parallel_main.main(argv)
    assert exit_info.value.code == 2
    assert f"python -m moekv_ref.apps.parallel_run: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "3"}, "torchrun started WORLD_SIZE=3 ranks: must be 1, 2, 4 or 8"),
        ({"MOEKV_FAULT": "hang"}, "MOEKV_FAULT='hang' must be MODE@RANK:AT"),
        ({"MOEKV_FAULT": "hang@2:1"}, "MOEKV_FAULT=hang@2:1: rank 2 does not exist: the ranks are 0 to 1"),
        (
            {"MOEKV_FAULT": "die@1:5"},
            "MOEKV_FAULT=die@1:5: step 5 never comes: the run has steps 0 (the prefill) to 4",
        ),
    ],
)
def test_parallel_cli_refuses_bad_environments(capsys, monkeypatch, environment, message):
    from moekv_ref.apps import parallel_run as parallel_main

    monkeypatch.delenv("RANK", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        parallel_main.main([])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--contexts", "-5"],
            "--contexts -5: must be an integer from 1 to 4094: the sweep model's "
            "max_position_embeddings=4096 positions hold the context and the 2 decode steps",
        ),
        (["--contexts", "128", "4095"], "--contexts 4095: must be an integer from 1 to 4094"),
        (["--decode-steps", "0"], "--decode-steps 0: must be an integer from 1 to 4095"),
        (
            ["--contexts", "128", "512", "128"],
            "--contexts=128 512 128 is not allowed: 128 is given twice; allowed: distinct values",
        ),
        (["--world-size", "3"], "--world-size 3: must be 2, 4 or 8"),
        (["--world-size", "1"], "--world-size 1: must be 2, 4 or 8"),
        (
            ["--json", "/dev/null/runs/parallel.json"],
            "--json=/dev/null/runs/parallel.json: its folder /dev/null/runs cannot be made: /dev/null is a "
            "character device, not a directory; allowed: a file in a folder this user can write in (made "
            "if missing)",
        ),
    ],
)
def test_bench_parallel_refuses_bad_values(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "parallel", *argv])
    assert exit_info.value.code == 2
    assert f"python -m moekv_ref bench parallel: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            "hang@1:1",
            "MOEKV_FAULT=hang@1:1: bench parallel injects only slow_start faults; 'hang' at a decode step "
            "is injected by `python -m moekv_ref.apps.parallel_run`",
        ),
        ("die@0:1", "MOEKV_FAULT=die@0:1: bench parallel injects only slow_start faults; 'die'"),
        ("slow_start@2:1", "MOEKV_FAULT=slow_start@2:1: rank 2 does not exist: the ranks are 0 to 1"),
        ("hang", "MOEKV_FAULT='hang' must be MODE@RANK:AT"),
    ],
)
def test_bench_parallel_refuses_a_fault_it_would_not_inject(capsys, monkeypatch, fault, message):
    """(The options make the run short, should the refusal be missing.)"""
    monkeypatch.setenv("MOEKV_FAULT", fault)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "parallel", "--world-size", "2", "--contexts", "8", "--decode-steps", "1"])
    assert exit_info.value.code == 2
    assert f"python -m moekv_ref bench parallel: error: {message}" in capsys.readouterr().err


def test_parallel_cli_exit_code_from_the_shell():
    """The same check through a real process: exit code 2 and the message, no traceback."""
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", "moekv_ref.apps.parallel_run", "--context", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 2 and "--context 100000: must be an integer from 1 to 4092" in done.stderr
    assert "Traceback" not in done.stderr
