"""Saving and loading models. Loading uses `torch.load(weights_only=True)`: a checkpoint is a dict of
plain values and tensors, never pickled code."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig, get_config
from .model import MoEKVTransformer

DEFAULT_CHECKPOINT = Path(__file__).parent / "weights" / "tiny.pt"


def save_checkpoint(model: MoEKVTransformer, path: str | Path, metadata: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Weights are stored as `dtype` (bfloat16 keeps the embedded model at a few MB); they load back
    into float32 exactly, since every bfloat16 value is a float32 value."""
    state = {name: tensor.detach().to(dtype).clone() for name, tensor in model.state_dict().items()}
    torch.save({"config": model.config.to_dict(), "state_dict": state, "metadata": metadata or {}}, path)


def load_checkpoint(path: str | Path | None = None, config: ModelConfig | None = None,
                    dtype: torch.dtype = torch.float32, backend: str = "torch") -> MoEKVTransformer:
    """Build the model a checkpoint describes, on `backend` ("torch" or "triton", see model.py).
    With `config`, the checkpoint must have been made for that architecture (routing may differ: it
    is not part of the weights)."""
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
        raise ValueError(f"{path} is not a moekv_ref checkpoint (expected keys 'config' and 'state_dict')")
    saved = ModelConfig.from_dict(payload["config"])
    if config is not None:
        mismatched = {key: (saved.architecture()[key], value)
                      for key, value in config.architecture().items() if saved.architecture()[key] != value}
        if mismatched:
            details = ", ".join(f"{k}: checkpoint has {a!r}, config asks for {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"checkpoint {path.name} was made for another config ({details})")
        saved = config
    model = MoEKVTransformer(saved, backend)
    model.load_state_dict({k: v.to(torch.float32) for k, v in payload["state_dict"].items()})
    return model.to(dtype).eval()


def load_default_model(routing: str | None = None, dtype: torch.dtype = torch.float32,
                       backend: str = "torch") -> MoEKVTransformer:
    """The embedded `tiny` model, optionally with another attention routing."""
    config = get_config("tiny") if routing is None else get_config("tiny").with_routing(routing)
    return load_checkpoint(DEFAULT_CHECKPOINT, config, dtype, backend)
