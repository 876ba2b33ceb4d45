"""Saving and loading models, verified.

A checkpoint is one `torch.save` file of plain values and tensors, loaded with
`torch.load(weights_only=True)` (never pickled code):

    format      "moekv_ref-checkpoint-v1"
    config      the ModelConfig as a dict (validated again at load)
    state_dict  name -> tensor (stored as bfloat16 by default)
    sha256      the content hash of the state dict: every tensor's name, dtype, shape and bytes, in
                name order -- a flipped bit or an altered weight no longer matches
    metadata    free-form (how it was trained)

Loading checks, in order, and stops at the first problem with one CheckpointError naming the file:
it exists and is a file, is not empty, reads as a torch file (not truncated, not something else),
is a checkpoint of this format, its config is valid (and matches the architecture asked for), its
hash matches its content, its tensors are exactly the model's (names and shapes), and every weight
is finite.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .config import ModelConfig, get_config
from .model import MoEKVTransformer

DEFAULT_CHECKPOINT = Path(__file__).parent / "weights" / "tiny.pt"
FORMAT = "moekv_ref-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


def state_dict_sha256(state: dict) -> str:
    """Hex sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(model: MoEKVTransformer, path: str | Path, metadata: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Weights are stored as `dtype` (bfloat16 keeps the embedded model at a few MB); they load back
    into float32 exactly, since every bfloat16 value is a float32 value. Refuses non-finite weights."""
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"weight {name!r} has non-finite values (in {dtype}): not saving {path}")
    torch.save({"format": FORMAT, "config": model.config.to_dict(), "state_dict": state,
                "sha256": state_dict_sha256(state), "metadata": metadata or {}}, path)


def _read(path: Path) -> dict:
    """The payload of a checkpoint file, or CheckpointError saying why it cannot be read."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory, not a checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {str(path)!r} is empty (0 bytes)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:          # zip, pickle, unicode and EOF errors all mean the same here
        if "central directory" in str(error) or isinstance(error, EOFError):
            reason = "its zip archive is incomplete: the file is truncated"
        elif "zip archive" in str(error):
            reason = "its zip archive is damaged"
        else:
            reason = "its bytes are not a torch save file"
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read as a torch file: {reason} (it is "
                              f"truncated, corrupted or not a checkpoint; {type(error).__name__} from torch.load)") from None
    if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
        raise CheckpointError(f"{str(path)!r} is not a moekv_ref checkpoint (expected a dict with 'format', "
                              "'config', 'state_dict' and 'sha256')")
    if payload.get("format") != FORMAT or "sha256" not in payload:
        raise CheckpointError(f"checkpoint {str(path)!r} has no manifest of format {FORMAT!r} (found "
                              f"{payload.get('format')!r}): re-save it with save_checkpoint, or add one with "
                              "moekv_ref.checkpoint.add_manifest")
    return payload


def _checked_state(path: Path, payload: dict, model: MoEKVTransformer) -> dict:
    state = payload["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"checkpoint {str(path)!r}: 'state_dict' is not a dict of tensors")
    if state_dict_sha256(state) != payload["sha256"]:
        raise CheckpointError(f"checkpoint {str(path)!r}: its weights do not match the content hash in its "
                              "manifest: the file was altered or corrupted")
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} does not hold this model's tensors: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"checkpoint {str(path)!r}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model needs {tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"checkpoint {str(path)!r}: weight {name!r} has {count} non-finite values "
                                  "(NaN or inf): refusing to load it")
    return state


def load_checkpoint(path: str | Path | None = None, config: ModelConfig | None = None,
                    dtype: torch.dtype = torch.float32, backend: str = "torch") -> MoEKVTransformer:
    """Build the model a checkpoint describes, on `backend` ("torch" or "triton", see model.py),
    after the checks in the module docstring. With `config`, the checkpoint must have been made for
    that architecture (routing may differ: it is not part of the weights)."""
    if config is not None and not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig (or None), got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating-point torch dtype")
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT
    payload = _read(path)
    try:
        saved = ModelConfig.from_dict(payload["config"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r} has an invalid config: {error}") from None
    if config is not None:
        mismatched = {key: (saved.architecture()[key], value)
                      for key, value in config.architecture().items() if saved.architecture()[key] != value}
        if mismatched:
            details = ", ".join(f"{k}: checkpoint has {a!r}, config asks for {b!r}" for k, (a, b) in mismatched.items())
            raise CheckpointError(f"checkpoint {str(path)!r} was made for another config ({details})")
        saved = config
    model = MoEKVTransformer(saved, backend)
    state = _checked_state(path, payload, model)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.to(dtype).eval()


def add_manifest(path: str | Path) -> None:
    """Give a checkpoint saved without a manifest (an older version of save_checkpoint) its format
    tag and content hash, in place. Its config and weights are checked as at load."""
    path = Path(path)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload["format"], payload["sha256"] = FORMAT, state_dict_sha256(payload["state_dict"])
    model = MoEKVTransformer(ModelConfig.from_dict(payload["config"]))
    _checked_state(path, payload, model)
    torch.save(payload, path)


def load_default_model(routing: str | None = None, dtype: torch.dtype = torch.float32,
                       backend: str = "torch") -> MoEKVTransformer:
    """The embedded `tiny` model, optionally with another attention routing."""
    config = get_config("tiny") if routing is None else get_config("tiny").with_routing(routing)
    return load_checkpoint(DEFAULT_CHECKPOINT, config, dtype, backend)
