import json
import subprocess
import sys

import pytest
import torch

from moekv_ref.apps.cli import main
from moekv_ref.checkpoint import load_checkpoint, save_checkpoint
from moekv_ref.config import get_config
from moekv_ref.model import MoEKVTransformer


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


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x" * 600], "600 tokens, more than the model's max_position_embeddings=512"),
    (["--prompt", "x" * 500, "--max-new-tokens", "20"], "ask for at most 13 new tokens"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0 must be an integer >= 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["--prompt", "x", "--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
    (["--prompt", "x", "--checkpoint", "/nonexistent.pt"], "does not exist"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


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
    with pytest.raises(ValueError, match=r"made for another config \(hidden_size: checkpoint has 64, config asks for 128"):
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
    done = subprocess.run([sys.executable, "-m", "moekv_ref", "generate", "--prompt", "def ", "--max-new-tokens",
                           "4", "--greedy", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4
