"""Saving and loading models, verified.

A checkpoint is one `torch.save` file of plain values and tensors, loaded with
`torch.load(weights_only=True)` (never pickled code): its manifest is MANIFEST_KEYS plus free-form
metadata (not hashed: no code reads it). The sha256 covers the config as sorted JSON, then every
tensor's name, dtype, shape and bytes in name order, so an edited config (a changed rope_theta
changes every output) or an altered weight no longer matches. Format v1 hashed the weights only:
v1 files are refused, and `add_manifest` upgrades one (or a file without a manifest).

Loading stops at the first problem with one CheckpointError naming the file and what is wrong (a
missing file: FileNotFoundError), before any model is built. It checks, in order:
  1. the file exists, is a regular file, is not empty (paths.check_input_file: a loop of symbolic
     links, a FIFO or a device each named as such);
  2. it reads with weights_only=True (the loader refuses pickled code before anything in it runs);
  3. its manifest: this format, every key, a 64-hex-digit sha256, dense tensors in its dtype;
  4. the config's size (at most MAX_CONFIG_VALUES values, MAX_CONFIG_DEPTH levels deep: hashing
     writes a list out each time it is referenced, and a file of a few MB can reference one 2**40
     times), then the hash; 5. the config is valid (and of the architecture asked for);
  6. its tensors' names and shapes against `weight_shapes` (worked out, not built), so a config
     implying a huge model is refused before anything is allocated;
  7. every weight is finite.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
from pathlib import Path

import torch

from .backends import require_backend
from .config import ModelConfig, get_config
from .model import MoEKVTransformer
from .paths import check_input_file
from .validation import check_path, known_keywords, shown

DEFAULT_CHECKPOINT = Path(__file__).parent / "weights" / "tiny.pt"
FORMAT = "moekv_ref-checkpoint-v2"
FORMAT_V1 = "moekv_ref-checkpoint-v1"  # weights-only hash: refused at load, see add_manifest
MANIFEST_KEYS = ("format", "config", "dtype", "state_dict", "sha256")  # metadata is optional
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}  # what a checkpoint stores
# what a run may compute in, by name (the command line, the parallel programs): float64 for the equivalences
COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# a config is a dict of about 25 plain fields (ModelConfig): these bounds leave it plenty of room and
# cap the work a hostile file can ask of the hash
MAX_CONFIG_VALUES = 10_000
MAX_CONFIG_DEPTH = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


def state_dict_sha256(state: dict) -> str:
    """Hex sha256 over every tensor's name, dtype, shape and bytes, in name order (format v1's hash)."""
    return _hash_tensors(hashlib.sha256(), state).hexdigest()


def checkpoint_sha256(config: dict, state: dict) -> str:
    """The content hash of the module docstring; TypeError for a config not of JSON values."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(f"config|{len(text)}|".encode() + text + b"|")
    return _hash_tensors(digest, state).hexdigest()


def _hash_tensors(digest, state: dict):
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest


@known_keywords
def save_checkpoint(
    model: MoEKVTransformer,
    path: str | Path,
    metadata: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Weights are stored as `dtype` (bfloat16 keeps the embedded model at a few MB); they load
    back into float32 exactly, which holds every bfloat16 and float16 value."""
    if not isinstance(model, MoEKVTransformer):
        raise ValueError(f"model must be a MoEKVTransformer, got {type(model).__name__}")
    check_path("path", path)
    if dtype not in DTYPES.values():
        raise ValueError(
            f"dtype={dtype!r} is not allowed for a checkpoint: use one of "
            f"{', '.join('torch.' + name for name in DTYPES)}"
        )
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"weight {name!r} has non-finite values (in {dtype}): not saving {path}")
    config = model.config.to_dict()
    torch.save(
        {
            "format": FORMAT,
            "config": config,
            "dtype": str(dtype).removeprefix("torch."),
            "state_dict": state,
            "sha256": checkpoint_sha256(config, state),
            "metadata": metadata or {},
        },
        path,
    )


def _load_file(path: Path):
    check_input_file(path, f"checkpoint {str(path)!r}", CheckpointError)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # zip, pickle, unicode and EOF errors all mean the same here
        message = str(error)
        # the weights-only unpickler names the first class or function outside its allowlist that the
        # pickle asks for ("GLOBAL posix.system") and stops there: nothing in the file was called or built
        refused = re.search(r"GLOBAL ([\w.]+)", message)
        if isinstance(error, pickle.UnpicklingError) and refused:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was refused: it contains pickled code or objects "
                f"({refused.group(1)}), which weights_only loading does not allow; it was not executed. "
                "A checkpoint holds only plain values and tensors: re-save the model with save_checkpoint"
            ) from None
        if "central directory" in message or isinstance(error, EOFError):
            reason = "its zip archive is incomplete: the file is truncated"
        elif "zip archive" in message:
            reason = "its zip archive is damaged"
        else:
            reason = "its bytes are not a torch save file"
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read as a torch file: {reason} (it is "
            f"truncated, corrupted or not a checkpoint; {type(error).__name__} from torch.load)"
        ) from None


def _read(path: Path) -> dict:
    """Steps 1-3 of the module docstring."""
    payload = _load_file(path)
    where = f"checkpoint {str(path)!r}"
    is_dict = isinstance(payload, dict)
    if not is_dict or ("format" not in payload and not {"config", "state_dict"} <= payload.keys()):
        got = f"keys {sorted(map(str, payload))[:8]}" if is_dict else f"a {type(payload).__name__}"
        raise CheckpointError(
            f"{str(path)!r} is not a moekv_ref checkpoint (expected a dict with "
            f"{', '.join(map(repr, MANIFEST_KEYS))}, found {got})"
        )
    if "format" not in payload:
        raise CheckpointError(
            f"{where} has no manifest (no 'format' key; this version reads {FORMAT!r}): "
            "re-save it with save_checkpoint, or add one with moekv_ref.checkpoint.add_manifest"
        )
    found = payload["format"]
    if isinstance(found, str) and found == FORMAT_V1:
        raise CheckpointError(
            f"{where} has format {FORMAT_V1!r}, this version reads {FORMAT!r} only: a v1 hash "
            "covers the weights but not the config, so an edited config would go unnoticed; "
            "if you trust its config, upgrade it with moekv_ref.checkpoint.add_manifest"
        )
    if not isinstance(found, str) or found != FORMAT:
        raise CheckpointError(f"{where} has format {shown(found)}, this version reads {FORMAT!r} only")
    missing = [key for key in MANIFEST_KEYS if key not in payload]
    if missing:
        raise CheckpointError(
            f"{where}: its manifest (format {FORMAT!r}) lacks the key(s) {missing}; it needs "
            f"{list(MANIFEST_KEYS)}: re-save it with save_checkpoint"
        )
    sha = payload["sha256"]
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise CheckpointError(f"{where}: its 'sha256' is {shown(sha)}, not 64 lowercase hex digits")
    if not isinstance(payload["dtype"], str) or payload["dtype"] not in DTYPES:
        raise CheckpointError(f"{where}: its 'dtype' is {shown(payload['dtype'])}; allowed: {sorted(DTYPES)}")
    _check_tensors(where, payload["state_dict"], DTYPES[payload["dtype"]])
    return payload


def _check_tensors(where: str, state, dtype: torch.dtype | None) -> None:
    """A dict of str -> plain CPU tensors, every one in `dtype` (or, when None, in one allowed dtype)."""
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{where}: 'state_dict' is not a non-empty dict of tensors")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{where}: 'state_dict' is not a dict of tensors (entry {shown(name)} is a "
                f"{type(tensor).__name__})"
            )
        if tensor.layout != torch.strided or tensor.device.type != "cpu":
            raise CheckpointError(
                f"{where}: tensor {name!r} is a {tensor.layout} tensor on {tensor.device}; "
                "allowed: dense (torch.strided) tensors with their data in the file"
            )
        if tensor.dtype not in DTYPES.values():
            raise CheckpointError(
                f"{where}: tensor {name!r} has dtype {tensor.dtype}; allowed: "
                f"{', '.join('torch.' + n for n in DTYPES)} (weights are floating point)"
            )
        dtype = dtype or tensor.dtype
        if tensor.dtype != dtype:
            raise CheckpointError(
                f"{where}: tensor {name!r} has dtype {tensor.dtype}, the checkpoint says its "
                f"tensors are {dtype}"
            )


def _check_config_size(where: str, config) -> None:
    """Step 4's bound, before anything walks the config whole: a walk that counts every value it
    reaches (a list referenced twice counts twice, as json.dumps writes it twice) and stops as soon
    as a limit is passed, so that its cost is bounded by the limits, not by the tree."""
    allowed = (
        f"allowed: a dict of ModelConfig's fields, at most {MAX_CONFIG_VALUES:,} values and "
        f"{MAX_CONFIG_DEPTH} levels deep"
    )
    num_values = 1
    pending = [(config, 1)]  # (value, its depth)
    while pending:
        value, depth = pending.pop()
        if not isinstance(value, (dict, list, tuple)) or not value:
            continue
        if depth == MAX_CONFIG_DEPTH:
            raise CheckpointError(
                f"{where}: its config nests values more than {MAX_CONFIG_DEPTH} levels deep; {allowed}"
            )
        num_values += len(value)
        if num_values > MAX_CONFIG_VALUES:
            raise CheckpointError(
                f"{where}: its config holds more than {MAX_CONFIG_VALUES:,} values; {allowed}"
            )
        pending.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))


def _sha256(where: str, config, state: dict) -> str:
    _check_config_size(where, config)
    try:
        return checkpoint_sha256(config, state)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: its config is not plain JSON values ({error})") from None


def _config(where: str, payload: dict) -> ModelConfig:
    try:
        return ModelConfig.from_dict(payload["config"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where} has an invalid config: {error}") from None


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of MoEKVTransformer(config)'s state dict, in its order, nothing
    built (tests/test_checkpoint.py checks that the two agree)."""
    V, D, L = config.vocab_size, config.hidden_size, config.num_hidden_layers
    E, H, Hkv, Dh = (
        config.num_attention_experts,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    Ef, Fw = config.num_local_experts, config.moe_intermediate_size
    block = {
        "attention_norm.weight": (D,),
        "attention.w_q": (E, D, H * Dh),
        "attention.w_k": (E, D, Hkv * Dh),
        "attention.w_v": (E, D, Hkv * Dh),
        "attention.w_o": (E, H * Dh, D),
        "attention.router.weight": (E, D),
        "ffn_norm.weight": (D,),
        "ffn.w_gate": (Ef, D, Fw),
        "ffn.w_up": (Ef, D, Fw),
        "ffn.w_down": (Ef, Fw, D),
        "ffn.router.weight": (Ef, D),
    }
    shapes = {"embed.weight": (V, D)}
    for i in range(L):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return {**shapes, "norm.weight": (D,), "lm_head.weight": (V, D)}


def _checked_state(where: str, state: dict, config: ModelConfig) -> None:
    """Steps 6 and 7 of the module docstring."""
    if config.num_hidden_layers > len(state):  # every layer has weights: it cannot match
        raise CheckpointError(
            f"{where}: its config has num_hidden_layers={config.num_hidden_layers} but the file "
            f"holds {len(state)} tensors in all: refusing before building the model"
        )
    expected = weight_shapes(config)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not hold this model's tensors: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    implied = sum(math.prod(shape) for shape in expected.values())
    held = sum(tensor.numel() for tensor in state.values())
    for name in expected:  # in the model's order: embed.weight first
        if tuple(state[name].shape) != expected[name]:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, the model needs "
                f"{expected[name]} (its config implies {implied:,} weights in all, the file "
                f"holds {held:,}): refusing before building the model"
            )
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"{where}: weight {name!r} has {count} non-finite values (NaN or inf): refusing to load it"
            )


@known_keywords
def load_checkpoint(
    path: str | Path | None = None,
    config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
) -> MoEKVTransformer:
    """The model a checkpoint describes, on `backend`. With `config`, the checkpoint must have been
    made for its architecture (routing may differ: it is not in the weights); the model runs it."""
    check_path("path", path, allow_none=True)
    require_backend(backend)  # before the file is read
    if config is not None and not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig (or None), got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating-point torch dtype")
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT
    where = f"checkpoint {str(path)!r}"
    payload = _read(path)
    if _sha256(where, payload["config"], payload["state_dict"]) != payload["sha256"]:
        raise CheckpointError(
            f"{where}: its config and weights do not match the content hash in its "
            "manifest: the file was altered or corrupted"
        )
    saved = _config(where, payload)
    if config is not None:
        made, asked = saved.architecture(), config.architecture()
        details = ", ".join(
            f"{key}: checkpoint has {made[key]!r}, config asks for {asked[key]!r}"
            for key in asked
            if made[key] != asked[key]
        )
        if details:
            raise CheckpointError(f"{where} was made for another config ({details})")
        saved = config
    state = payload["state_dict"]
    _checked_state(where, state, saved)
    model = MoEKVTransformer(saved, backend)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.to(dtype).eval()


@known_keywords
def add_manifest(path: str | Path) -> None:
    """Give a checkpoint without a manifest, or with a v1 one, the current manifest, in place. A v1
    file's weights must match its v1 hash (its config was never hashed: check it yourself); nothing
    is written unless every check of a load passes."""
    path = Path(check_path("path", path))
    where = f"checkpoint {str(path)!r}"
    payload = _load_file(path)
    if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
        raise CheckpointError(
            f"{str(path)!r} is not a moekv_ref checkpoint (expected a dict with 'config' and 'state_dict')"
        )
    found = payload.get("format")
    if found is not None and not (isinstance(found, str) and found == FORMAT_V1):
        raise CheckpointError(
            f"{where} has format {shown(found)}: add_manifest upgrades files without a "
            f"manifest or of format {FORMAT_V1!r} only"
        )
    state = payload["state_dict"]
    _check_tensors(where, state, None)
    v1_sha = payload.get("sha256")
    if found is not None and not (isinstance(v1_sha, str) and v1_sha == state_dict_sha256(state)):
        raise CheckpointError(
            f"{where}: its weights do not match its {FORMAT_V1} content hash: the file was "
            "altered or corrupted; not upgrading it"
        )
    _checked_state(where, state, _config(where, payload))
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    payload.update(format=FORMAT, dtype=dtype, sha256=_sha256(where, payload["config"], state))
    payload.setdefault("metadata", {})
    torch.save(payload, path)


def load_default_model(
    routing: str | None = None, dtype: torch.dtype = torch.float32, backend: str = "torch"
) -> MoEKVTransformer:
    """The embedded `tiny` model, optionally with another attention routing."""
    config = get_config("tiny") if routing is None else get_config("tiny").with_routing(routing)
    return load_checkpoint(DEFAULT_CHECKPOINT, config, dtype, backend)
