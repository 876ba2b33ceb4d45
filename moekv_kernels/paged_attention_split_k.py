"""Split-K (flash-decoding) paged decode attention, for few rows with long contexts.

What it computes
----------------
Exactly what paged_attention.py computes (same inputs, same layout, same result). The plain kernel
runs one program per (row, KV head): with few rows and long contexts that is too few programs to
keep a GPU busy, and each walks thousands of tokens alone. Flash-decoding splits each row's tokens
into chunks of `tokens_per_split` and runs one program per (row, KV head, split); a second, small
kernel combines the partial results.

Each split s over tokens [s * S, (s + 1) * S) of a row returns, per query head,

    o_s   = sum_t e^(x_t - m_s) v_t / l_s         (its own normalized output)
    lse_s = m_s + log l_s                          (log of its softmax denominator, sum_t e^(x_t))

and the exact softmax over all tokens is the lse-weighted mean of the splits' outputs:

    out = sum_s e^(lse_s - M) o_s / sum_s e^(lse_s - M),      M = max_s lse_s

A split that starts past the row's end is empty: it writes lse = -inf and o = 0, and gets weight 0;
a row of length 0 has only empty splits and gets zeros, as from the plain kernel.
The number of splits comes from the block table's width (max_blocks_per_row * P), not from the
longest row, so launching needs no device-to-host read of context_lens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._utils import Launch

# the reference it must equal is the plain kernel's: same contract, same result
from .paged_attention import (  # noqa: F401  (re-exported)
    attend_token_range,
    check_paged_inputs,
    decode_tiles,
    load_query_group,
    paged_attention_reference,
    products_in_float32,
    random_paged_inputs,
)


# ----- the kernels --------------------------------------------------------------------------------
@triton.jit
def paged_attention_split_kernel(
    partial_out_ptr,  # (R, H, num_splits, Dh) float32: each split's normalized output
    partial_lse_ptr,  # (R, H, num_splits) float32: each split's log-sum-exp of scores
    q_ptr,  # queries (R, H, Dh), contiguous
    key_cache_ptr,  # key pool (num_blocks, P, Hkv, Dh), contiguous
    value_cache_ptr,  # value pool, same layout
    block_tables_ptr,  # (R, max_blocks_per_row) int32
    context_lens_ptr,  # (R,) int32, >= 0
    max_blocks_per_row,  # row stride of block_tables
    num_heads,  # H
    group,  # H // Hkv
    head_dim,  # Dh
    stride_slot,  # Hkv * Dh
    stride_head,  # Dh
    scale,  # 1 / sqrt(Dh)
    num_splits,  # splits per row
    tokens_per_split,  # S, a multiple of TOKEN_TILE
    BLOCK_SIZE: tl.constexpr,  # P
    TOKEN_TILE: tl.constexpr,  # tokens per loop iteration, >= 16
    GROUP_TILE: tl.constexpr,  # power of two >= max(group, 16)
    HEAD_DIM_TILE: tl.constexpr,  # power of two >= max(Dh, 16)
    UPCAST: tl.constexpr,  # products in float32 (float32 cache, mixed dtypes, interpreter)
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row)
    token_start = split * tokens_per_split
    token_end = tl.minimum(token_start + tokens_per_split, context_len)  # <= start when empty
    query = load_query_group(
        q_ptr, row, kv_head, num_heads, group, head_dim, GROUP_TILE, HEAD_DIM_TILE, UPCAST
    )
    accumulator, running_max, running_sum = attend_token_range(
        query,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + row.to(tl.int64) * max_blocks_per_row,
        kv_head,
        token_start,
        token_end,
        stride_slot,
        stride_head,
        head_dim,
        scale,
        BLOCK_SIZE,
        TOKEN_TILE,
        GROUP_TILE,
        HEAD_DIM_TILE,
        UPCAST,
    )
    nonempty = running_sum > 0  # (GROUP_TILE,)
    safe_sum = tl.where(nonempty, running_sum, 1.0)  # no 0/0, no log(0)
    out = accumulator / safe_sum[:, None]  # an empty split writes 0
    lse = tl.where(nonempty, running_max + tl.log(safe_sum), float("-inf"))
    group_index = tl.arange(0, GROUP_TILE)
    heads = kv_head * group + group_index
    dims = tl.arange(0, HEAD_DIM_TILE)
    head_valid = group_index < group
    lse_offsets = (row * num_heads + heads) * num_splits + split  # (GROUP_TILE,)
    tl.store(partial_lse_ptr + lse_offsets, lse, mask=head_valid)
    out_offsets = lse_offsets[:, None] * head_dim + dims[None, :]
    tl.store(partial_out_ptr + out_offsets, out, mask=head_valid[:, None] & (dims < head_dim)[None, :])


@triton.jit
def combine_splits_kernel(
    out_ptr,  # output (R, H, Dh), dtype of q
    partial_out_ptr,  # (R, H, num_splits, Dh) float32
    partial_lse_ptr,  # (R, H, num_splits) float32
    num_splits,  # splits per row
    head_dim,  # Dh
    SPLIT_TILE: tl.constexpr,  # next power of two >= num_splits
    HEAD_DIM_TILE: tl.constexpr,  # next power of two >= Dh
):
    row_head = tl.program_id(0)  # row * H + head
    splits = tl.arange(0, SPLIT_TILE)
    dims = tl.arange(0, HEAD_DIM_TILE)
    split_valid = splits < num_splits
    lse = tl.load(partial_lse_ptr + row_head * num_splits + splits, mask=split_valid, other=float("-inf"))
    # an empty split has lse = -inf and weight e^-inf = 0. When every split is empty (a row of length
    # 0) the max is -inf too: M = 0 then, so no -inf - -inf (NaN) appears, all weights are 0 and
    # the row gets zeros
    split_max = tl.max(lse, axis=0)
    split_max = tl.where(split_max > float("-inf"), split_max, 0.0)
    weights = tl.exp(lse - split_max)  # (SPLIT_TILE,)
    total = tl.sum(weights, axis=0)
    offsets = (row_head * num_splits + splits)[:, None] * head_dim + dims[None, :]
    # an empty split's partial output is never read (its weight is 0 either way)
    partial = tl.load(
        partial_out_ptr + offsets, mask=(weights > 0)[:, None] & (dims < head_dim)[None, :], other=0.0
    )
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)  # (HEAD_DIM_TILE,)
    tl.store(out_ptr + row_head * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# ----- the launcher -------------------------------------------------------------------------------
def paged_attention_split_k_launches(
    q, key_cache, value_cache, block_tables, context_lens, tokens_per_split=512, token_tile=None
) -> list[Launch]:
    """Checks, buffers and the two launches (splits, then their combination) that
    moekv_kernels/report.py compiles and the launcher runs."""
    check_paged_inputs(q, key_cache, value_cache, block_tables, context_lens)
    assert tokens_per_split >= 1, f"tokens_per_split={tokens_per_split} must be positive"
    q = q.contiguous()
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    tiles = decode_tiles(group, head_dim, token_tile)
    tokens_per_split = triton.cdiv(tokens_per_split, tiles["TOKEN_TILE"]) * tiles["TOKEN_TILE"]
    max_tokens = block_tables.shape[1] * block_size  # an upper bound, no sync
    num_splits = max(1, triton.cdiv(max_tokens, tokens_per_split))
    out = torch.empty_like(q)
    partial_out = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    splits = Launch(
        paged_attention_split_kernel,
        (num_rows, num_kv_heads, num_splits),
        (
            partial_out,
            partial_lse,
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            block_tables.shape[1],
            num_heads,
            group,
            head_dim,
            num_kv_heads * head_dim,
            head_dim,
            1.0 / math.sqrt(head_dim),
            num_splits,
            tokens_per_split,
        ),
        dict(BLOCK_SIZE=block_size, UPCAST=products_in_float32(q, key_cache), **tiles),
    )
    combine = Launch(
        combine_splits_kernel,
        (num_rows * num_heads,),
        (out, partial_out, partial_lse, num_splits, head_dim),
        dict(
            SPLIT_TILE=triton.next_power_of_2(num_splits), HEAD_DIM_TILE=tiles["HEAD_DIM_TILE"], num_warps=4
        ),
    )
    return [splits, combine]


def paged_attention_split_k(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    tokens_per_split: int = 512,
    token_tile: int | None = None,
) -> torch.Tensor:
    """Decode attention of q (R, H, Dh) over each row's paged K/V, split along tokens.

    Same contract as moekv_kernels.paged_attention.paged_attention; the result equals it up to the order
    of float32 additions. tokens_per_split is rounded up to a multiple of the token tile.
    """
    launches = paged_attention_split_k_launches(
        q, key_cache, value_cache, block_tables, context_lens, tokens_per_split, token_tile
    )
    if q.shape[0] > 0:
        for launch in launches:
            launch()
    return launches[1].args[0]


# ----- a check against the reference (time it with python -m moekv_kernels.bench) ---------------------
if __name__ == "__main__":
    from ._utils import max_relative_error

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = random_paged_inputs([1, 300, 64, 1000], 8, 2, 64, 16, torch.float16, device)
    out = paged_attention_split_k(*inputs, tokens_per_split=128)
    error = max_relative_error(out, paged_attention_reference(*inputs))
    print(f"paged_attention_split_k vs reference, float16: max relative error {error:.1e}")
    print("timings: python -m moekv_kernels.bench (on a GPU)")
