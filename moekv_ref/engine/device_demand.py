"""demand.py's worst cases, device by device, for per-device pools.

With the experts of each layer spread over D devices, a step fits only if it fits *every* device:
the scheduler reserves, per device, the most blocks the step's tokens could open there. On device d
layer l has E_d(l) experts, and a token reaches at most k_d(l) = min(k_max, E_d(l)) of them, so
demand.py's two bounds become, per (layer, device):

    bound A: every expert of d receives all n tokens      sum over e on d of ceil((c_e + n) / P) - ceil(c_e / P)
    bound B: k_d * n entries over m rows of d             m + (k_d * n - m) // P,   m = min(E_d, k_d * n)

The per-device worst cases add up to at least the one-pool worst case (each device may see its own
worst routing), which is the price of checking devices separately; a device with none of a layer's
experts reserves nothing for it.

Dimension legend: m sequences, L layers, E experts per layer, D devices.
"""

from __future__ import annotations

import torch

from ..cache.rows import ceil_div


def _experts_per_device(device_of_expert: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(L, E, D) one-hot of each expert's device."""
    return torch.nn.functional.one_hot(device_of_expert, num_devices)


def worst_case_step_blocks_per_device(token_counts: torch.Tensor, num_new_tokens: torch.Tensor, k_max: int,
                                      block_size: int, device_of_expert: torch.Tensor,
                                      num_devices: int) -> torch.Tensor:
    """token_counts (m, L, E), num_new_tokens (m,) -> (m, D): the most blocks each sequence's next
    tokens could take on each device (min of bounds A and B, summed over layers)."""
    m = token_counts.shape[0]
    one_hot = _experts_per_device(device_of_expert, num_devices)                     # (L, E, D)
    n = num_new_tokens.to(torch.int64).view(m, 1, 1)                                 # (m, 1, 1)
    grow = ceil_div(token_counts + n, block_size) - ceil_div(token_counts, block_size)   # (m, L, E)
    bound_a = torch.einsum("mle,led->mld", grow, one_hot)                            # (m, L, D)
    experts_on = one_hot.sum(1)                                                      # (L, D)
    k_on = torch.clamp(experts_on, max=k_max)                                        # (L, D)
    entries = k_on[None] * n                                                         # (m, L, D)
    rows = torch.minimum(entries, experts_on[None])
    bound_b = rows + (entries - rows) // block_size                                  # (m, L, D)
    return torch.minimum(bound_a, bound_b).sum(1)                                    # (m, D)


def worst_case_lifetime_blocks_per_device(num_tokens: int, k_max: int, block_size: int,
                                          device_of_expert: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(D,) the most blocks a sequence of `num_tokens` cached tokens can hold on each device: per
    layer min(E_d * ceil(T / P), m + (k_d * T - m) // P), m = min(E_d, k_d * T)."""
    experts_on = _experts_per_device(device_of_expert, num_devices).sum(1)           # (L, D)
    k_on = torch.clamp(experts_on, max=k_max)
    entries = k_on * num_tokens
    rows = torch.minimum(entries, experts_on)
    per_layer = torch.minimum(experts_on * ceil_div(num_tokens, block_size),
                              rows + (entries - rows) // block_size)                 # (L, D)
    return per_layer.sum(0)
