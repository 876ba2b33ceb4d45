"""Which device (or rank) each expert of each layer lives on.

Expert parallelism and per-device pools both need a map expert -> device, E / D experts of each
layer on every device (D must divide E), so weight memory is balanced whatever the strategy:

    contiguous     experts 0..E/D-1 on device 0, the next E/D on device 1, ...
    round_robin    expert e on device e % D
    coactivation   experts the router often chooses together for the same token share a device,
                   so a token's k experts touch fewer devices (fewer destinations for its hidden
                   state, fewer pools for its K/V). Greedy (`place_experts`); a heuristic for a
                   balanced graph partition, measured against round-robin, not assumed to win.

Dimension legend: E experts of a layer, D devices, N tokens, L layers.
"""

from __future__ import annotations

import torch

from .validation import MAX_INT32, a_type, check_choice, check_device_table, check_int, known_keywords, shown

PLACEMENTS = ("contiguous", "round_robin", "coactivation")


def check_selected(selected, name: str = "selected") -> torch.Tensor:
    """One layer's routing decisions: a bool tensor (N, E), returned as given."""
    allowed = "a bool tensor (N, E), True where token n chose expert e"
    if not isinstance(selected, torch.Tensor):
        raise ValueError(f"{name}={shown(selected)} is {a_type(selected)}; allowed: {allowed}")
    if selected.dtype != torch.bool or selected.dim() != 2:
        raise ValueError(
            f"{name} is a {selected.dtype} tensor of shape {tuple(selected.shape)}; allowed: {allowed}"
        )
    return selected


@known_keywords
def coactivation_counts(selected: torch.Tensor) -> torch.Tensor:
    """How often each pair of experts was chosen for the same token: (E, E) int64, the diagonal each
    expert's load. selected: (N, E) bool, one layer's routing decisions."""
    chosen = check_selected(selected).to(torch.int64)  # (N, E)
    return chosen.T @ chosen  # (E, E)


@known_keywords
def place_experts(
    num_experts: int, num_devices: int, strategy: str = "contiguous", coactivation: torch.Tensor | None = None
) -> torch.Tensor:
    """The device of each expert of one layer: (E,) int64. coactivation: (E, E) counts from
    `coactivation_counts`, for strategy="coactivation"."""
    check_choice("strategy", strategy, PLACEMENTS)
    num_experts = check_int("num_experts", num_experts, 1, MAX_INT32)
    num_devices = check_int("num_devices", num_devices, 1, MAX_INT32)
    if num_experts % num_devices:
        raise ValueError(
            f"num_devices={num_devices} must divide num_experts={num_experts}, so that every "
            f"device holds the same number of experts; try one of "
            f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0]}"
        )
    per_device = num_experts // num_devices
    if strategy == "contiguous":
        return torch.arange(num_experts) // per_device
    if strategy == "round_robin":
        return torch.arange(num_experts) % num_devices
    if not isinstance(coactivation, torch.Tensor) or coactivation.shape != (num_experts, num_experts):
        raise ValueError(
            f"strategy='coactivation' needs an ({num_experts}, {num_experts}) co-activation "
            f"matrix (coactivation_counts of the layer's routing)"
        )
    together = coactivation.to(torch.float64).clone()
    load = together.diagonal().clone()  # (E,)
    together.fill_diagonal_(0)
    device = torch.full((num_experts,), -1, dtype=torch.int64)
    for d in range(num_devices):
        members = []
        for _ in range(per_device):
            # the seed: the most loaded expert left; then the one most co-activated with the
            # members (ties: by load)
            score = together[:, members].sum(1) + 1e-9 * load if members else load  # (E,)
            best = int(torch.where(device < 0, score, -1.0).argmax())
            device[best] = d
            members.append(best)
    return device


@known_keywords
def place_layers(selected_per_layer: list[torch.Tensor], num_devices: int, strategy: str) -> torch.Tensor:
    """One placement per layer: (L, E) int64. selected_per_layer: L tensors (..., E) bool."""
    check_choice("strategy", strategy, PLACEMENTS)
    num_devices = check_int("num_devices", num_devices, 1, MAX_INT32)
    if not isinstance(selected_per_layer, (list, tuple)) or not selected_per_layer:
        raise ValueError(
            f"selected_per_layer={shown(selected_per_layer)} is {a_type(selected_per_layer)}; allowed: a "
            "non-empty list of bool tensors (..., E), one per layer"
        )
    maps = []
    for selected in selected_per_layer:
        if not isinstance(selected, torch.Tensor) or selected.dim() < 2:
            raise ValueError(
                f"selected_per_layer holds {shown(selected)}; allowed: bool tensors (..., E), one per layer"
            )
        selected = selected.flatten(0, -2)  # (N, E)
        counts = coactivation_counts(selected) if strategy == "coactivation" else None
        maps.append(place_experts(selected.shape[1], num_devices, strategy, counts))
    return torch.stack(maps)


@known_keywords
def devices_touched(selected: torch.Tensor, device_of_expert: torch.Tensor, num_devices: int) -> torch.Tensor:
    """How many distinct devices each token's chosen experts live on: (N,) int64.
    selected: (N, E) bool; device_of_expert: (E,) in [0, num_devices)."""
    selected = check_selected(selected)
    num_devices = check_int("num_devices", num_devices, 1, MAX_INT32)
    device_of_expert = check_device_table(
        device_of_expert,
        num_devices,
        1,
        selected.shape[1],
        every_layer=True,
        devices_meaning=f"num_devices={num_devices}",
    )[0]  # (E,)
    one_hot = torch.nn.functional.one_hot(device_of_expert, num_devices).to(torch.int64)  # (E, D)
    per_device = selected.to(torch.int64) @ one_hot  # (N, D)
    return (per_device > 0).sum(1)
