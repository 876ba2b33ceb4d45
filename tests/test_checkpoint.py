"""Checkpoints: a manifest (format, content hash, config) checked at load; every way a file can be
broken gets one CheckpointError naming the file and what is wrong; non-finite weights are refused,
at save and at load; the embedded model loads and its weights are what they were."""

import pytest
import torch

from moekv_ref.checkpoint import (DEFAULT_CHECKPOINT, CheckpointError, add_manifest, load_checkpoint,
                                  load_default_model, save_checkpoint, state_dict_sha256)
from moekv_ref.config import get_config
from moekv_ref.model import MoEKVTransformer

CONFIG = get_config("tiny", num_hidden_layers=1)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = MoEKVTransformer(CONFIG)
    path = tmp_path / "model.pt"
    save_checkpoint(model, path)
    return model, path


def rewrite(path, change, rehash=True):
    """Apply change(payload) to a saved checkpoint; rehash: keep its manifest consistent, so that
    the check after the hash is the one that must catch it."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    if rehash:
        payload["sha256"] = state_dict_sha256(payload["state_dict"])
    torch.save(payload, path)


def test_round_trip_is_exact(saved):
    model, path = saved
    loaded = load_checkpoint(path, CONFIG)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())


def test_the_embedded_model_has_a_manifest_and_loads():
    payload = torch.load(DEFAULT_CHECKPOINT, weights_only=True)
    assert payload["format"] == "moekv_ref-checkpoint-v1"
    assert payload["sha256"] == state_dict_sha256(payload["state_dict"])
    assert load_default_model("threshold").config.attention_routing == "threshold"


def broken_files(tmp_path, path):
    """(name, path, fragment): one broken file per way a file can be broken."""
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    text = tmp_path / "notes.pt"
    text.write_text("these are not weights\n")
    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(range(256)) * 8)
    a_list = tmp_path / "list.pt"
    torch.save([1, 2, 3], a_list)
    no_keys = tmp_path / "dict.pt"
    torch.save({"weights": torch.zeros(2)}, no_keys)
    folder = tmp_path / "folder"
    folder.mkdir()
    return [
        ("missing", tmp_path / "absent.pt", "does not exist"),
        ("a directory", folder, "is a directory"),
        ("empty", empty, "is empty (0 bytes)"),
        ("truncated", truncated, "cannot be read as a torch file: its zip archive is incomplete: the file is truncated"),
        ("a text file", text, "cannot be read as a torch file: its bytes are not a torch save file"),
        ("random bytes", noise, "cannot be read as a torch file: its bytes are not a torch save file"),
        ("a saved list", a_list, "is not a moekv_ref checkpoint"),
        ("a dict without config", no_keys, "is not a moekv_ref checkpoint"),
    ]


def test_every_broken_file_gets_one_clear_error_naming_it(saved, tmp_path):
    _, path = saved
    for name, broken, fragment in broken_files(tmp_path, path):
        with pytest.raises((CheckpointError, FileNotFoundError)) as info:
            load_checkpoint(broken, CONFIG)
        assert fragment in str(info.value) and str(broken) in str(info.value), name


def test_altered_weights_fail_the_content_hash(saved):
    _, path = saved

    def alter(payload):
        weight = payload["state_dict"]["embed.weight"]
        weight.view(-1)[:1000] += 1.0

    rewrite(path, alter, rehash=False)
    with pytest.raises(CheckpointError, match="do not match the content hash"):
        load_checkpoint(path, CONFIG)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(saved, value):
    model, path = saved
    rewrite(path, lambda payload: payload["state_dict"]["embed.weight"].view(-1).__setitem__(7, value))
    with pytest.raises(CheckpointError, match="weight 'embed.weight' has 1 non-finite values"):
        load_checkpoint(path, CONFIG)
    with torch.no_grad():
        model.embed.weight[0, 0] = value
    with pytest.raises(ValueError, match="non-finite values"):
        save_checkpoint(model, path.with_name("out.pt"))
    assert not path.with_name("out.pt").exists()


def test_missing_extra_and_misshapen_tensors_are_named(saved):
    _, path = saved
    rewrite(path, lambda payload: payload["state_dict"].pop("embed.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['embed.weight'\]"):
        load_checkpoint(path, CONFIG)
    rewrite(path, lambda payload: payload["state_dict"].__setitem__("embed.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"'embed.weight' has shape \(3, 3\)"):
        load_checkpoint(path, CONFIG)
    rewrite(path, lambda payload: payload["state_dict"].__setitem__("extra", torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra'\]"):
        load_checkpoint(path, CONFIG)


def test_an_invalid_or_other_config_is_refused(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match="made for another config"):
        load_checkpoint(path, get_config("tiny"))
    rewrite(path, lambda payload: payload["config"].__setitem__("rope_theta", float("nan")))
    with pytest.raises(CheckpointError, match="has an invalid config: rope_theta=nan"):
        load_checkpoint(path)


def test_a_checkpoint_without_manifest_is_refused_until_one_is_added(saved):
    _, path = saved

    def legacy(payload):
        del payload["format"], payload["sha256"]

    rewrite(path, legacy, rehash=False)
    with pytest.raises(CheckpointError, match="has no manifest"):
        load_checkpoint(path, CONFIG)
    add_manifest(path)
    load_checkpoint(path, CONFIG)


def test_bad_arguments_of_load(saved):
    _, path = saved
    with pytest.raises(ValueError, match="dtype=torch.int8 must be a floating-point"):
        load_checkpoint(path, CONFIG, dtype=torch.int8)
    with pytest.raises(ValueError, match="config must be a ModelConfig"):
        load_checkpoint(path, {"name": "tiny"})
