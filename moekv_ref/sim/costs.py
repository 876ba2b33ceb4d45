"""What a step, a recompute and a swap cost, in seconds: the cost model of the trace runner (eviction.py).

A preempted sequence comes back in one of two ways:

    recompute   run its c cached tokens through the model again (a prefill of c tokens):
                    c * seconds_per_token + c^2 / 2 * seconds_per_token_pair
                (the linear part is the projections and experts, 2 FLOPs per active parameter per
                token; the quadratic part is attention, each token against the keys before it)
    swap        copy its blocks to host memory and back, b blocks of block_bytes each:
                    2 * (seconds_per_swap + b * (block_bytes / swap_bytes_per_second + seconds_per_block))
                (out and in; a swap moves whole blocks, so the padding in every row's partly filled
                tail block travels too: b grows with the number of rows a sequence touches, not only
                with its tokens)

Swap wins for long contexts (recompute grows faster: it is at least linear with a larger slope once the
link is fast, and quadratic in the end) and loses for short ones, where the fixed costs and the tail
padding of every (layer, expert) row dominate. `crossover_context` finds where.

Two sources of constants: `fit_cost_model` fits them to timings measured on this machine (the
`bench eviction` program times the embedded model's prefill and the engine's SwapSpace), and
`projected_gpu_cost_model` derives them from datasheet numbers for a GPU and a model shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..hardware import GPUS, LINKS

# the GPU and host link of the projection, from the one hardware table (moekv_ref/hardware.py)
H100 = GPUS["H100"]
PCIE_GEN5_X16_BYTES_PER_SECOND = LINKS["pcie_gen5_x16"].bytes_per_s


@dataclass(frozen=True)
class CostModel:
    name: str
    seconds_per_step: float          # fixed cost of one forward, whatever it computes
    seconds_per_token: float         # per token computed (prefill, recompute or decode)
    seconds_per_token_pair: float    # per (query, earlier key) pair of one sequence, all layers
    swap_bytes_per_second: float     # host link, each direction
    seconds_per_block: float         # per block copied (descriptor / small-copy overhead)
    seconds_per_swap: float          # per swap out or in of one sequence (launch, synchronisation)
    block_bytes: int                 # bytes of K and V one block holds

    def recompute_seconds(self, context):
        """Seconds to recompute `context` cached tokens (int or tensor)."""
        return context * self.seconds_per_token + context * (context + 1) / 2 * self.seconds_per_token_pair

    def swap_seconds(self, num_blocks):
        """Seconds to swap `num_blocks` blocks out and back in (int or tensor)."""
        per_block = self.block_bytes / self.swap_bytes_per_second + self.seconds_per_block
        return 2 * (self.seconds_per_swap + num_blocks * per_block)

    def decode_seconds(self, context):
        """Seconds one decode token adds to a step at `context` cached tokens."""
        return self.seconds_per_token + context * self.seconds_per_token_pair

    def to_dict(self) -> dict:
        return asdict(self)


def projected_gpu_cost_model(active_params: float, kv_bytes_per_slot: int, num_layers: int,
                             experts_per_token: int, num_experts: int, head_dim: int, num_heads: int,
                             block_size: int, flops: float = H100.bf16_flops_per_s,
                             link_bytes_per_second: float = PCIE_GEN5_X16_BYTES_PER_SECOND,
                             mfu: float = 0.5, seconds_per_swap: float = 20e-6,
                             seconds_per_block: float = 0.0, name: str = "H100 + PCIe Gen5 x16 (projected)") -> CostModel:
    """A cost model from datasheet numbers. Stated assumptions: prefill and recompute reach `mfu` of
    peak; a token's query meets, in each of its k experts of every layer, the keys that expert
    cached for the sequence (about k / E of the sequence's tokens), 4 * H * Dh FLOPs per pair (QK^T
    and PV); swap copies are batched into one transfer per sequence and direction (vLLM's swap
    kernel does this), so the per-block overhead is 0 and the per-swap latency `seconds_per_swap`;
    a step reads the active weights (bf16) once from HBM at least: seconds_per_step."""
    per_token = 2.0 * active_params / (flops * mfu)
    seconds_per_step = 2.0 * active_params / H100.hbm_bytes_per_s       # active weights read once
    pair_flops = 4 * num_heads * head_dim * num_layers * experts_per_token * experts_per_token / num_experts
    return CostModel(name, seconds_per_step, per_token, pair_flops / (flops * mfu), link_bytes_per_second, seconds_per_block,
                     seconds_per_swap, kv_bytes_per_slot * block_size)


def fit_cost_model(contexts, recompute_seconds, swapped_blocks, swap_seconds, block_bytes: int,
                   name: str = "this machine (measured)") -> CostModel:
    """Least-squares constants from measurements: recompute_seconds[i] of a prefill of contexts[i]
    tokens (fit a + b c + q c^2/2, a dropped: a step's fixed cost is paid anyway), and swap_seconds[i]
    for swapped_blocks[i] blocks out and in (fit 2 (s + n t)). Coefficients are clamped at 0."""
    c = torch.as_tensor(contexts, dtype=torch.float64)
    design = torch.stack([torch.ones_like(c), c, c * (c + 1) / 2], 1)                     # (m, 3)
    a, b, q = torch.linalg.lstsq(design, torch.as_tensor(recompute_seconds, dtype=torch.float64)[:, None]).solution[:, 0]
    n = torch.as_tensor(swapped_blocks, dtype=torch.float64)
    design = torch.stack([2 * torch.ones_like(n), 2 * n], 1)                              # (m, 2)
    s, t = torch.linalg.lstsq(design, torch.as_tensor(swap_seconds, dtype=torch.float64)[:, None]).solution[:, 0]
    return CostModel(name, max(float(a), 0.0), max(float(b), 0.0), max(float(q), 0.0), float("inf"),
                     max(float(t), 0.0), max(float(s), 0.0), block_bytes)


def crossover_context(cost: CostModel, contexts, blocks_at_context) -> int | None:
    """The shortest context from which swapping is cheaper than recomputing (and stays so over the
    contexts given), or None if it never is. blocks_at_context[i]: blocks a sequence of
    contexts[i] tokens holds (tail padding included)."""
    contexts = torch.as_tensor(contexts)
    swap = cost.swap_seconds(torch.as_tensor(blocks_at_context, dtype=torch.float64))
    recompute = cost.recompute_seconds(contexts.to(torch.float64))
    wins = (swap < recompute).tolist()
    for i in range(len(wins)):
        if all(wins[i:]):
            return int(contexts[i])
    return None
