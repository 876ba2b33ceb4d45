"""The cluster bench cluster simulates, and notebook 11's exercise asks about: an expert-attention
model of JetMoE-8B's size (the preset MODEL) served by expert parallelism, each GPU holding E / D
experts of every layer and their rows' blocks of BLOCK_SIZE tokens.
"""

from __future__ import annotations

import torch

from ..config import get_config

MODEL = "jetmoe-8b-expert-kv"
BLOCK_SIZE = 16


def cluster_placement(num_devices: int) -> torch.Tensor:
    """(E,) the GPU of each of MODEL's attention experts within one group of num_devices GPUs:
    contiguous, E / D experts of every layer a GPU."""
    experts = get_config(MODEL).num_attention_experts
    return torch.arange(experts) // (experts // num_devices)


def pool_blocks(gib_per_device: float) -> int:
    """Blocks of BLOCK_SIZE tokens that `gib_per_device` GiB of KV memory holds on one GPU."""
    return int(gib_per_device * 2**30 // (BLOCK_SIZE * get_config(MODEL).kv_bytes_per_entry()))
