"""moekv-ref: KV-cache management for mixture-of-experts attention, in readable PyTorch."""

from .config import PRESETS, ModelConfig, get_config
from .model import MoEKVTransformer

__all__ = ["PRESETS", "ModelConfig", "get_config", "MoEKVTransformer"]
