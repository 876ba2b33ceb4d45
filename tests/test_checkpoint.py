"""Checkpoints: a manifest (format, dtype, a content hash of config and weights) checked at load;
every way a file can be broken gets one CheckpointError naming the file and what is wrong, before
any model is built; non-finite weights are refused, at save and at load; the embedded model loads
and its weights are what they were."""

import os
import time

import pytest
import torch

import moekv_ref.checkpoint as checkpoint
from moekv_ref.checkpoint import (
    DEFAULT_CHECKPOINT,
    CheckpointError,
    add_manifest,
    checkpoint_sha256,
    load_checkpoint,
    load_default_model,
    save_checkpoint,
    state_dict_sha256,
    weight_shapes,
)
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
        payload["sha256"] = checkpoint_sha256(payload["config"], payload["state_dict"])
    torch.save(payload, path)


def test_round_trip_is_exact(saved):
    model, path = saved
    loaded = load_checkpoint(path, CONFIG)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())


def test_the_embedded_model_has_a_manifest_and_loads():
    payload = torch.load(DEFAULT_CHECKPOINT, weights_only=True)
    assert payload["format"] == "moekv_ref-checkpoint-v2" and payload["dtype"] == "bfloat16"
    assert payload["sha256"] == checkpoint_sha256(payload["config"], payload["state_dict"])
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
        (
            "truncated",
            truncated,
            "cannot be read as a torch file: its zip archive is incomplete: the file is truncated",
        ),
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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/null are POSIX's")
def test_a_symlink_loop_a_fifo_and_a_device_are_named_as_such(tmp_path):
    """Not "does not exist" for a loop of links (Path.exists() is False there), nor "empty" for a FIFO
    or a device (their size is 0); a link to nothing does not exist, and says so."""
    loop = tmp_path / "loop.pt"
    loop.symlink_to(tmp_path / "other.pt")
    (tmp_path / "other.pt").symlink_to(loop)
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.pt"
    dangling.symlink_to(tmp_path / "nothing.pt")
    cases = [
        (loop, CheckpointError, "leads into a loop of symbolic links"),
        (fifo, CheckpointError, "is a FIFO (named pipe), not a regular file"),
        (os.devnull, CheckpointError, "is a character device, not a regular file"),
        (
            dangling,
            FileNotFoundError,
            f"does not exist: it is a symbolic link to {str(tmp_path / 'nothing.pt')!r}",
        ),
    ]
    for path, error, fragment in cases:
        with pytest.raises(error) as info:
            load_checkpoint(path, CONFIG)
        assert fragment in str(info.value) and str(path) in str(info.value), path


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
    bf16 = torch.bfloat16  # the dtype the manifest says: shapes are what is wrong here
    rewrite(
        path, lambda payload: payload["state_dict"].__setitem__("embed.weight", torch.zeros(3, 3, dtype=bf16))
    )
    with pytest.raises(CheckpointError, match=r"'embed.weight' has shape \(3, 3\)"):
        load_checkpoint(path, CONFIG)
    rewrite(path, lambda payload: payload["state_dict"].__setitem__("extra", torch.zeros(1, dtype=bf16)))
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
        del payload["format"], payload["sha256"], payload["dtype"]

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


def test_an_edited_config_fails_the_content_hash(saved):
    """The hash covers the config: rope_theta changes every output and is not in any tensor."""
    model, path = saved
    rewrite(path, lambda payload: payload["config"].__setitem__("rope_theta", 500.0), rehash=False)
    with pytest.raises(CheckpointError, match="its config and weights do not match the content hash") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_a_v1_file_is_refused_and_add_manifest_upgrades_it(saved):
    model, path = saved

    def v1(payload):  # what the previous save_checkpoint wrote: a weights-only hash
        payload["format"], payload["sha256"] = (
            "moekv_ref-checkpoint-v1",
            state_dict_sha256(payload["state_dict"]),
        )
        del payload["dtype"]

    rewrite(path, v1, rehash=False)
    with pytest.raises(
        CheckpointError,
        match="has format 'moekv_ref-checkpoint-v1', this version reads 'moekv_ref-checkpoint-v2' only",
    ):
        load_checkpoint(path, CONFIG)
    add_manifest(path)
    assert torch.equal(
        load_checkpoint(path, CONFIG).embed.weight, model.embed.weight.to(torch.bfloat16).float()
    )
    with pytest.raises(CheckpointError, match="add_manifest upgrades files without a manifest or of format"):
        add_manifest(path)  # a v2 file is never re-hashed
    rewrite(path, v1, rehash=False)
    rewrite(
        path, lambda payload: payload["state_dict"]["embed.weight"].view(-1).__setitem__(0, 9.0), rehash=False
    )
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="do not match its moekv_ref-checkpoint-v1 content hash"):
        add_manifest(path)
    assert path.read_bytes() == before


def test_an_integer_weight_is_refused_naming_tensor_and_dtype(saved):
    _, path = saved
    rewrite(
        path,
        lambda payload: payload["state_dict"].__setitem__(
            "embed.weight", torch.zeros(CONFIG.vocab_size, CONFIG.hidden_size, dtype=torch.int8)
        ),
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'embed.weight' has dtype torch.int8; allowed: "
        r"torch.bfloat16, torch.float16, torch.float32",
    ) as info:
        load_checkpoint(path, CONFIG)
    assert str(path) in str(info.value)
    rewrite(
        path,
        lambda payload: payload["state_dict"].__setitem__(
            "embed.weight", payload["state_dict"]["embed.weight"].float()
        ),
    )
    with pytest.raises(
        CheckpointError,
        match=r"'embed.weight' has dtype torch.float32, the checkpoint says its "
        r"tensors are torch.bfloat16",
    ):
        load_checkpoint(path, CONFIG)
    with pytest.raises(ValueError, match="dtype=torch.int8 is not allowed for a checkpoint"):
        save_checkpoint(MoEKVTransformer(CONFIG), path.with_name("int8.pt"), dtype=torch.int8)
    assert not path.with_name("int8.pt").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "hidden_size",
            2**20,
            r"tensor 'embed.weight' has shape \(256, 128\), the model needs \(256, 1048576\) "
            r"\(its config implies [\d,]+ weights in all, the file holds [\d,]+\)",
        ),
        ("num_hidden_layers", 10**9, r"num_hidden_layers=1000000000 but the file holds 14 tensors in all"),
    ],
)
def test_a_huge_config_is_refused_before_anything_is_allocated(saved, monkeypatch, field, value, message):
    """A config whose model would take gigabytes (or a billion layers), with the small tensors of the
    file and a hash made for it: refused from the shapes it implies, no model built at all."""
    _, path = saved
    rewrite(path, lambda payload: payload["config"].__setitem__(field, value))
    built = []

    class Recording(MoEKVTransformer):
        def __init__(self, config, *args, **kwargs):
            built.append(config)
            super().__init__(config, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "MoEKVTransformer", Recording)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)
    assert time.perf_counter() - start < 0.5
    assert built == []


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        get_config("tiny"),
        get_config("tiny", num_key_value_heads=1, num_local_experts=3, vocab_size=100),
        get_config("tiny", attention_mode="dense", num_attention_experts=1, num_attention_experts_per_tok=1),
    ],
)
def test_weight_shapes_are_the_models(config):
    model = MoEKVTransformer(config)
    assert weight_shapes(config) == {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert list(weight_shapes(config)) == list(model.state_dict())


class RunsACommand:
    """Unpickling this calls os.system: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("zipped", [True, False])
def test_a_pickle_that_would_run_code_is_refused_and_not_run(tmp_path, zipped):
    marker = tmp_path / "it-ran"
    path = tmp_path / "malicious.pt"
    torch.save(
        {"format": "moekv_ref-checkpoint-v2", "config": RunsACommand(marker)},
        path,
        _use_new_zipfile_serialization=zipped,
    )
    assert not marker.exists()
    for load in (load_checkpoint, add_manifest):
        with pytest.raises(CheckpointError) as info:
            load(path)
        assert str(path) in str(info.value)
        assert "was refused: it contains pickled code or objects (posix.system)" in str(info.value)
        assert "it was not executed" in str(info.value) and "truncated" not in str(info.value)
    assert not marker.exists()
    module = tmp_path / "module.pt"
    torch.save({"state_dict": torch.nn.Linear(2, 2)}, module)
    with pytest.raises(
        CheckpointError, match=r"contains pickled code or objects \(torch.nn.modules.linear.Linear\)"
    ):
        load_checkpoint(module)


@pytest.mark.parametrize("key", ["sha256", "dtype", "config"])
def test_a_manifest_missing_a_key_names_it(saved, key):
    _, path = saved
    rewrite(path, lambda payload: payload.pop(key), rehash=False)
    with pytest.raises(
        CheckpointError,
        match=rf"its manifest \(format 'moekv_ref-checkpoint-v2'\) lacks the "
        rf"key\(s\) \['{key}'\]",
    ) as info:
        load_checkpoint(path, CONFIG)
    assert str(path) in str(info.value)


def test_a_config_too_deep_to_hash_is_refused_before_hashing(saved):
    """The hash writes the config out as JSON, a list once for each reference to it: a config nesting
    a list [a, a] 40 levels deep (the same list twice at each level: a file of about 1 MB) would
    write 2**40 values. A walk that stops at the bound refuses it at once, naming the file."""
    _, path = saved
    deep = 0
    for _ in range(40):
        deep = [deep, deep]
    rewrite(path, lambda payload: payload["config"].__setitem__("name", deep), rehash=False)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="its config nests values more than 8 levels deep") as info:
        load_checkpoint(path)
    assert time.perf_counter() - start < 5
    assert str(path) in str(info.value)


def test_a_config_of_100000_unknown_fields_gets_a_short_message(saved):
    """With a matching hash, 100,000 unknown fields were all named: a message of 1.5 MB. Now the file
    is refused by the bound on the config's size, in one line naming it."""
    _, path = saved
    rewrite(path, lambda payload: payload["config"].update({f"extra_{i}": i for i in range(100_000)}))
    with pytest.raises(CheckpointError, match="its config holds more than 10,000 values") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and len(str(info.value)) < 1000


def test_a_config_beyond_the_int32_sizes_is_refused_at_load(saved):
    """max_position_embeddings=2**40 used to load, and a paged cache then asked the allocator for
    terabytes: the config itself is refused, naming the field and its bound."""
    _, path = saved
    rewrite(path, lambda payload: payload["config"].__setitem__("max_position_embeddings", 2**40))
    with pytest.raises(
        CheckpointError,
        match=r"has an invalid config: max_position_embeddings=1099511627776 is not allowed; allowed: an "
        r"integer in \[1, 2\*\*31 - 1\]",
    ):
        load_checkpoint(path)
