"""How many blocks a sequence needs: the worst case of one step, of a lifetime, and a prediction.

Under threshold routing a token goes to 1..k_max experts per layer, decided only when the router
sees it, so the cache a request will need is not known when it arrives:

    prediction (admission)   DemandPredictor, from the routing seen so far
    worst case (one step)    every new token to k_max experts, each opening a block
    worst case (lifetime)    the most blocks any routing could make a request hold (above the pool:
                             refused at add_request, since it must be able to finish alone)

The worst number of blocks n new tokens can open in one layer of one sequence, whose E rows hold c_e
tokens (P slots per block, k_max experts per token, at most n tokens per expert):

    bound A: every expert receives all n tokens      sum_e ceil((c_e + n) / P) - ceil(c_e / P)
    bound B: k_max * n entries spread over m rows    m + (k_max * n - m) // P,  m = min(E, k_max * n)
             (a touched row opens at most one block for its first token and one per P more)

and the step's worst case is min(A, B). For a decode token (n = 1) that is min(k_max, number of rows
whose last block is exactly full): most decode steps need far fewer than k_max blocks per layer.

Per device (each sequence brings an (L, E) map of its rows' devices) the bounds are taken per
(layer, device), with the E_d(l) experts of layer l on device d and k_d(l) = min(k_max, E_d(l)) in
place of E and k_max. They add up to at least the one-pool bound (each device may see its own worst
routing); with D = 1 they are the one-pool bounds, so the scheduler has one code path.

Integer arithmetic on tensors only. Dimension legend: m sequences, L layers, E experts, D devices.
"""

from __future__ import annotations

from functools import cache

import torch

from ..cache.rows import ceil_div, worst_case_lifetime_blocks  # noqa: F401 (the pool's bound, used here)
from ..state import Stateful


def min_lifetime_blocks(
    num_tokens: int, num_layers: int, k_min: int, block_size: int, row_limits=None
) -> int:
    """The fewest blocks `num_tokens` cached tokens can hold: k_min entries per token per layer,
    packed into full blocks. row_limits: each layer's row budget B (None: none); a layer then
    keeps at least k_min * min(T, B) entries (k_min rows of T tokens each, each cut to B, is the
    fewest: a row's share of T tokens, cut to B, never falls below its share of min(T, B))."""
    if row_limits is None:
        return num_layers * ceil_div(k_min * num_tokens, block_size)
    return sum(ceil_div(k_min * min(num_tokens, int(b)), block_size) for b in row_limits)


def reserved_blocks(num_tokens: int, num_layers: int, num_experts: int, block_size: int) -> int:
    """A per-expert contiguous reservation: every (layer, expert) row reserves room for all tokens,
    since the router may send every token there."""
    return num_layers * num_experts * ceil_div(num_tokens, block_size)


class DemandPredictor(Stateful):
    """Predicts a request's blocks from k_avg[l], the mean experts per token at layer l so far
    (before any token: k_max, the safe prior). For T cached tokens, per layer,

        blocks = min(ceil(entries / P + rows * (P - 1) / P), the layer's worst case),
        entries = k_avg[l] * T,  rows = min(E, entries)

    the blocks the entries fill plus the partly filled last block of every row touched. Under top-k
    routing k_avg = k exactly, and only the split across experts, hence the tail, is unknown.
    """

    STATE = ("num_entries", "num_tokens")

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        k_max: int,
        block_size: int,
        max_row_tokens: int | None = None,
    ):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.k_max, self.block_size = k_max, block_size
        self.max_row_tokens = max_row_tokens  # a row budget caps every prediction's worst case
        self.num_entries = torch.zeros(num_layers, dtype=torch.float64)  # (L,) routed (token, expert)
        self.num_tokens = 0

    def observe(self, entries_per_layer: torch.Tensor, num_tokens: int) -> None:
        self.num_entries += entries_per_layer  # (L,) over a step's tokens, into float64
        self.num_tokens += int(num_tokens)

    @property
    def k_avg(self) -> torch.Tensor:
        if self.num_tokens == 0:
            return torch.full((self.num_layers,), float(self.k_max), dtype=torch.float64)
        return self.num_entries / self.num_tokens

    def predict(self, num_tokens: int) -> int:
        """Predicted blocks for `num_tokens` cached tokens (capped: for short sequences the tail
        bound alone could exceed E * ceil(T / P))."""
        return int(self.predict_many([num_tokens])[0])

    def predict_many(self, num_tokens: list[int]) -> torch.Tensor:
        """`predict` of each of num_tokens at once, (k,) int64 (an admission check asks it of every
        running request each time)."""
        P = self.block_size
        tokens = torch.tensor(num_tokens, dtype=torch.float64)
        entries = self.k_avg[None, :] * tokens[:, None]  # (k, L)
        rows = torch.clamp(entries, max=self.num_experts)
        per_layer = torch.ceil(entries / P + rows * (P - 1) / P - 1e-9)
        worst = torch.tensor(
            [
                one_layer_worst_case(t, self.num_experts, self.k_max, P, self.max_row_tokens)
                for t in num_tokens
            ],
            dtype=torch.float64,
        )  # (k,)
        return torch.minimum(per_layer, worst[:, None]).sum(1).to(torch.int64)


@cache
def one_layer_worst_case(
    num_tokens: int, num_experts: int, k_max: int, block_size: int, max_row_tokens
) -> int:
    """rows.py's worst case of one layer for num_tokens cached tokens (remembered: a pure function the
    predictor asks of every running request's length at every admission check)."""
    return worst_case_lifetime_blocks(num_tokens, 1, num_experts, k_max, block_size, max_row_tokens)


def worst_case_step_blocks(
    token_counts: torch.Tensor, num_new_tokens: torch.Tensor, k_max: int, block_size: int
) -> torch.Tensor:
    """token_counts (m, L, E), num_new_tokens (m,) -> (m,): the one-pool (D = 1) worst case."""
    return worst_case_step_blocks_per_device(
        token_counts, num_new_tokens, k_max, block_size, torch.zeros(token_counts.shape, dtype=torch.int64), 1
    )[:, 0]


def _per_device(values: torch.Tensor, device_of_expert: torch.Tensor, num_devices: int) -> torch.Tensor:
    """(m, L, E) values of rows, device_of_expert (m, L, E) -> (m, L, D): summed per device."""
    return (
        values.sum(2, keepdim=True)
        if num_devices == 1  # one pool: over experts
        else torch.zeros(values.shape[:2] + (num_devices,), dtype=torch.int64).scatter_add_(
            2, device_of_expert, values
        )
    )


def blocks_held_per_device(
    token_counts: torch.Tensor, block_size: int, device_of_expert: torch.Tensor, num_devices: int
) -> torch.Tensor:
    """token_counts (m, L, E), device_of_expert (m, L, E) -> (m, D): blocks held (ceil(c / P))."""
    return _per_device(ceil_div(token_counts, block_size), device_of_expert, num_devices).sum(1)


def worst_case_step_blocks_per_device(
    token_counts: torch.Tensor,
    num_new_tokens: torch.Tensor,
    k_max: int,
    block_size: int,
    device_of_expert: torch.Tensor,
    num_devices: int,
    max_row_tokens: int | None = None,
) -> torch.Tensor:
    """token_counts (m, L, E), num_new_tokens (m,), device_of_expert (m, L, E) -> (m, D): the most
    blocks each sequence's next tokens could take on each device (min of bounds A and B); a row
    budget caps each row at max_row_tokens."""
    m = token_counts.shape[0]
    n = num_new_tokens.to(torch.int64).view(m, 1, 1)  # (m, 1, 1)
    grown = token_counts + n if max_row_tokens is None else torch.clamp(token_counts + n, max=max_row_tokens)
    grow = ceil_div(grown, block_size) - ceil_div(token_counts, block_size)  # (m, L, E)
    bound_a = _per_device(grow, device_of_expert, num_devices)  # (m, L, D)
    experts_on = _per_device(torch.ones_like(token_counts), device_of_expert, num_devices)  # (m, L, D)
    entries = torch.clamp(experts_on, max=k_max) * n  # (m, L, D) k_d * n
    rows = torch.minimum(entries, experts_on)
    bound_b = rows + (entries - rows) // block_size  # (m, L, D)
    return torch.minimum(bound_a, bound_b).sum(1)  # (m, D)


def decode_step_blocks_per_device(
    open_rows: torch.Tensor, k_max: int, experts_on: torch.Tensor
) -> torch.Tensor:
    """open_rows (m, L, D): rows of each (layer, device) whose next token opens a block (empty or
    last block full); experts_on (L, D): experts of each layer on each device -> (m, D): the most
    blocks one decode token can take on each device. That is the step bound for n = 1, read from
    two small tables instead of every row: bound A is the open rows, bound B is k_d = min(k_max, E_d)."""
    return (
        torch.minimum(open_rows, torch.clamp(experts_on, max=k_max).to(open_rows.dtype))
        .sum(1)
        .to(torch.int64)
    )


def worst_case_lifetime_blocks_per_device(
    num_tokens: torch.Tensor,
    k_max: int,
    block_size: int,
    device_of_expert: torch.Tensor,
    num_devices: int,
    max_row_tokens: int | None = None,
) -> torch.Tensor:
    """num_tokens (m,), device_of_expert (m, L, E) -> (m, D): the most blocks T cached tokens can
    hold on each device; per layer min(E_d * ceil(T / P), r + (k_d * T - r) // P),
    r = min(E_d, k_d * T): bounds A and B of one step of T tokens into empty rows (A with each row
    capped at max_row_tokens under a budget)."""
    empty = torch.zeros(device_of_expert.shape, dtype=torch.int64)  # (m, L, E)
    return worst_case_step_blocks_per_device(
        empty, num_tokens, k_max, block_size, device_of_expert, num_devices, max_row_tokens
    )


def step_need(step: torch.Tensor, lifetime: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """What a scheduler reserves for a step (any shape, elementwise): the step's worst case, capped
    by the lifetime's worst case minus what is held (so a request alone always fits), never below 0.
    The one formula the Scheduler and the trace runner's offline policies use."""
    return torch.clamp(torch.minimum(step, lifetime - held), min=0)
