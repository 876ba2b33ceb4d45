"""The attention arithmetic every cache shares: rotary embeddings and causal attention by position.

Caches differ only in where K/V live and how they are gathered; once gathered, every cache calls
`attend_by_position`, so "paged = contiguous" tests the gathering, not two copies of the math.
"""

from __future__ import annotations

import math

import torch


def rotary(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels (x1, x2) of x (..., heads, Dh) to (x1 cos - x2 sin, x1 sin + x2 cos)
    at angles position * theta^(-2i/Dh): read as the complex number x1 + i x2, one product with
    turns = e^(i angle) (..., 1, Dh/2) from `rotary_turns`, as the LLaMA reference code writes it:
    half the time of x * cos + swapped x * signed sin on a CPU (measured), equal to it up to the
    last bit. In float32 at least (there is no complex bfloat16)."""
    pairs = torch.view_as_complex(x.to(score_dtype(x.dtype)).unflatten(-1, (-1, 2)))  # (..., H, Dh/2)
    return torch.view_as_real(pairs * turns).flatten(-2).to(x.dtype)


def rotary_turns(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """(..., 1, Dh/2) turns at positions (...,) for `dtype` inputs; made once a forward for every layer.
    Positions are absolute, never indices inside an expert's cache (whose distances must stay true)."""
    num_positions = int(positions.max()) + 1 if positions.numel() else 1
    table = rotary_pair_table(
        head_dim, theta, num_positions, positions.device, score_dtype(dtype)
    )  # (P, Dh/2)
    return table.index_select(0, positions.reshape(-1)).view(*positions.shape, 1, table.shape[1])


_PAIR_TABLES: dict[tuple, torch.Tensor] = {}


def rotary_pair_table(head_dim: int, theta: float, num_positions: int, device, dtype) -> torch.Tensor:
    """e^(i position * theta^(-2i/Dh)) for positions 0..P-1 and pairs i, (P, Dh/2) complex of the
    real dtype (float32 or float64), computed in float64. Computed once per dtype and kept (not for
    every layer of every step), regrown by doubling."""
    key = (head_dim, float(theta), torch.device(device), dtype)
    cached = _PAIR_TABLES.get(key)
    if cached is None or cached.shape[0] < num_positions:
        size = max(num_positions, 2 * cached.shape[0] if cached is not None else 256)
        # on the CPU, on one thread: a process's first torch.cos on two threads can differ in its last
        # bits (12 of 40 fresh processes; none of 40 on one thread), and the table is kept for good;
        # kept across calls, so never inference tensors (unfit for training)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode(False):
                inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
                angles = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq  # (P, Dh/2)
                table = torch.complex(torch.cos(angles), torch.sin(angles))
                cached = _PAIR_TABLES[key] = table.to(device, torch.promote_types(dtype, torch.complex64))
        finally:
            torch.set_num_threads(threads)
    return cached


def attend_by_position(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries q (n, H, Dh) over keys k, v (m, Hkv, Dh) of ONE sequence: a query
    at position p sees the keys at positions <= p, at least one (itself, written before attending).
    Returns (n, H, Dh) in q's dtype; scores, softmax and sum run in `score_dtype(q.dtype)`."""
    group = q.shape[1] // k.shape[1]  # H // Hkv
    compute = score_dtype(q.dtype)
    k = k.to(compute).repeat_interleave(group, dim=1)  # (m, H, Dh)
    v = v.to(compute).repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.to(compute), k) / math.sqrt(q.shape[-1])  # (H, n, m)
    visible = k_positions[None, :] <= q_positions[:, None]  # (n, m)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hnm,mhd->nhd", weights, v).to(q.dtype)  # (n, H, Dh)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least for scores and softmax, as the Triton kernels and PyTorch's fused attention
    do: in bfloat16 (8 bits of mantissa) a softmax over a few hundred scores loses most of its
    precision. Inputs and output keep the model's dtype."""
    return torch.promote_types(dtype, torch.float32)
