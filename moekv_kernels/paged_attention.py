"""Paged decode attention over per-expert KV caches.

What it computes
----------------
One decode step of attention for R rows. A row is one (sequence, layer, expert): the tokens that
sequence routed to that expert of that layer, cached in a pool of fixed-size blocks shared by every
row (the paged cache, moekv_ref/cache/paged.py). For row r and query head h:

    out[r, h] = softmax(q[r, h] . K_r^T / sqrt(Dh)) V_r

where K_r, V_r are the context_lens[r] tokens of the row, found through its block table:

    logical token t of row r  ->  block block_tables[r, t // P], offset t % P
                              ->  slot  block * P + offset  in  key_cache.view(-1, Hkv, Dh)

Every cached token is visible: the new token's K/V is stored (store_kv.py) before it attends.
Grouped-query attention: query head h reads KV head h // (H // Hkv). A row of length 0 attends to
nothing and gets zeros (so does the reference).

Memory layout (the paged cache, moekv_ref/cache/paged.py, owns it):
    key_cache, value_cache   (num_blocks, P, Hkv, Dh), contiguous, float32 / float16 / bfloat16
    block_tables             (R, max_blocks_per_row) int32; entries past a row's used blocks are
                             padding and are never read
    context_lens             (R,) int32, each >= 0
    q, out                   (R, H, Dh)

How the kernel works
--------------------
One program per (row, KV head). It holds the whole query-head group of that KV head (GQA), so each
K/V byte is read from memory once per row. It walks the row's tokens in tiles of TOKEN_TILE logical
tokens and keeps an online softmax (running max, running sum, rescaled accumulator) in float32, as
in FlashAttention. Each token of a tile finds its own slot through the block table, so a tile may
span several blocks (P < TOKEN_TILE) or part of one (P > TOKEN_TILE): P need not divide the tile
nor be a power of two. A token at or past the row's end is masked before its block-table entry and
its K/V are loaded: padding and stale slots are never read.

Both products are tl.dot on (GROUP_TILE, Dh) x (Dh, TOKEN_TILE) and (GROUP_TILE, TOKEN_TILE) x
(TOKEN_TILE, Dh) tiles, with the query group padded to 16 rows (tl.dot's smallest tile on a GPU;
the padded rows are zeros and never stored). Why tl.dot, when decode has one query per head and is
bound by memory, not arithmetic: registers. Written as elementwise products reduced with tl.sum, the
(group, tokens, Dh) float32 product is materialized in registers: 255 registers per thread at
Dh = 128 and a group of 8 (Triton 3.7, sm_90), so only 2 blocks of 4 warps fit on an SM. tl.dot
keeps operands in the tensor cores' fragments instead: 72 registers, 7 blocks (python -m
moekv_kernels.report measures such numbers from the compiled code).

Precision. With a float16 / bfloat16 cache (and a query of the same dtype) the dot multiplies the
stored values in their own type, which is exact (11- or 8-bit significands: the product fits in
float32), and accumulates in float32; the 1/sqrt(Dh) scale is applied to the float32 scores. The
softmax weights enter the second product rounded to the cache's dtype (relative error 2^-9 for
bfloat16, 2^-12 for float16, far inside the tests' 1e-2 and 2e-3), and the running sum adds the same
rounded weights, so every row's weights still sum to one. A float32 cache (or a query of another
dtype) converts the tiles to float32 and asks for IEEE products: TF32 would miss the 1e-5 check.
The interpreter (no GPU) takes the float32 path with the weights rounded the same way.

Occupancy, and why 7 blocks per SM are enough (Little's law)
------------------------------------------------------------
Decode attention streams K/V from HBM, so what matters is whether enough bytes are in flight to
cover the memory latency. Little's law: bytes in flight = bandwidth x latency. An H200 moves 4.8
TB/s over 132 SMs, 36 bytes per ns per SM; with a loaded DRAM latency of the order of 700 ns (an
assumption, not a measurement here) each SM needs about 36 x 700 = 25 KB in flight. One iteration
of this kernel loads TOKEN_TILE x Dh K and V values: 16 x 128 x 2 bytes x 2 = 8 KB in bfloat16 at
Dh = 128 (TOKEN_TILE = 32 at Dh = 64: the same 8 KB). At 72 registers per thread 7 blocks of 4 warps
are resident (registers: 72 x 32 = 2,304 per warp, 65,536 / 2,304 = 28 warps, 7 blocks), so 56 KB
are in flight per SM, about twice the need; the previous elementwise kernel fit 2 blocks (16 KB),
less than the need. A launch needs enough programs for that too: R x Hkv programs over 132 SMs is
7 per SM only from about 920 programs (e.g. 230 rows with 4 KV heads); with fewer rows and long
contexts the split-K variant (paged_attention_split_k.py) multiplies the programs by the splits.

The split-K (flash-decoding) variant reuses `attend_token_range` below.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, is_interpreting


# ----- the kernel ---------------------------------------------------------------------------------
@triton.jit
def attend_token_range(
    query,  # (GROUP_TILE, HEAD_DIM_TILE) query heads of one KV head, zero-padded rows
    key_cache_ptr,  # key pool, (num_blocks, P, Hkv, Dh) contiguous
    value_cache_ptr,  # value pool, same layout as the key pool
    block_table_ptr,  # this row's block table: logical block i -> physical block id (int32)
    kv_head,  # which KV head of the pool this program reads
    token_start,  # first logical token of the row to attend over
    token_end,  # one past the last (the row's context length, or a split's end)
    stride_slot,  # elements between consecutive slots of the pool (Hkv * Dh)
    stride_head,  # elements between consecutive KV heads of a slot (Dh)
    head_dim,  # Dh, the real width; HEAD_DIM_TILE >= Dh is its power-of-two tile
    scale,  # 1 / sqrt(Dh), applied to the float32 scores
    BLOCK_SIZE: tl.constexpr,  # P, tokens per block
    TOKEN_TILE: tl.constexpr,  # logical tokens per loop iteration (>= 16, a power of two)
    GROUP_TILE: tl.constexpr,  # query heads in `query`, a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM_TILE: tl.constexpr,  # next power of two >= max(Dh, 16)
    UPCAST: tl.constexpr,  # convert K/V tiles to float32 before tl.dot (see the module docstring)
):
    """Online softmax of `query` over logical tokens [token_start, token_end) of one row.

    Returns (accumulator, running_max, running_sum): the unnormalized output sum_t e^(s_t - m) v_t
    (GROUP_TILE, HEAD_DIM_TILE), m = max_t s_t (GROUP_TILE,), and sum_t e^(s_t - m) (GROUP_TILE,).
    An empty range returns zeros, -inf and zeros. Tokens at or past token_end are never loaded: the
    block-table entry and the K/V of a masked token are not read, so padding is never touched.
    """
    dims = tl.arange(0, HEAD_DIM_TILE)
    dim_valid = dims < head_dim
    running_max = tl.full([GROUP_TILE], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_TILE], tl.float32)
    accumulator = tl.zeros([GROUP_TILE, HEAD_DIM_TILE], tl.float32)
    for tile_start in range(token_start, token_end, TOKEN_TILE):
        tokens = tile_start + tl.arange(0, TOKEN_TILE)  # logical token indices
        token_valid = tokens < token_end
        block_ids = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_valid, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE  # (TOKEN_TILE,)
        row_offsets = slots * stride_slot + kv_head * stride_head  # int64, one per token
        load_mask = token_valid[:, None] & dim_valid[None, :]
        keys = tl.load((key_cache_ptr + row_offsets)[:, None] + dims[None, :], mask=load_mask, other=0.0)
        values = tl.load((value_cache_ptr + row_offsets)[:, None] + dims[None, :], mask=load_mask, other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)
        # scores s = q . k / sqrt(Dh) for every (query head, token): (GROUP_TILE, TOKEN_TILE), float32
        scores = tl.dot(query, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(token_valid[None, :], scores, float("-inf"))
        # every tile holds >= 1 valid token, so new_max is finite and no -inf - -inf appears
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)  # 0 on the first tile
        # softmax weights in the cache's dtype, the operand type of the second product; the sum is
        # taken of the same rounded weights, so each row's weights still add up to exactly one
        weights = tl.exp(scores - new_max[:, None]).to(value_cache_ptr.dtype.element_ty)
        running_sum = running_sum * correction + tl.sum(weights.to(tl.float32), axis=1)
        accumulator = tl.dot(
            weights.to(values.dtype), values, accumulator * correction[:, None], input_precision="ieee"
        )
        running_max = new_max
    return accumulator, running_max, running_sum


@triton.jit
def load_query_group(
    q_ptr,  # queries (R, H, Dh), contiguous
    row,  # which row
    kv_head,  # which KV head; its query heads are kv_head * group ... + group - 1
    num_heads,  # H
    group,  # H // Hkv, query heads per KV head
    head_dim,  # Dh
    GROUP_TILE: tl.constexpr,  # power of two >= max(group, 16)
    HEAD_DIM_TILE: tl.constexpr,  # power of two >= max(Dh, 16)
    UPCAST: tl.constexpr,  # float32 (the K/V tiles are converted too), else the cache's dtype
):
    """The query heads of one KV head as a (GROUP_TILE, HEAD_DIM_TILE) tile, zero-padded."""
    heads = kv_head * group + tl.arange(0, GROUP_TILE)
    dims = tl.arange(0, HEAD_DIM_TILE)
    mask = (tl.arange(0, GROUP_TILE) < group)[:, None] & (dims < head_dim)[None, :]
    offsets = (row * num_heads + heads)[:, None] * head_dim + dims[None, :]
    query = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    if UPCAST:
        query = query.to(tl.float32)
    return query


@triton.jit
def paged_attention_kernel(
    out_ptr,  # output (R, H, Dh), contiguous, dtype of q
    q_ptr,  # queries (R, H, Dh), contiguous, one decode token per row
    key_cache_ptr,  # key pool (num_blocks, P, Hkv, Dh), contiguous
    value_cache_ptr,  # value pool, same layout
    block_tables_ptr,  # (R, max_blocks_per_row) int32
    context_lens_ptr,  # (R,) int32, tokens cached per row (0 gives a zero output)
    max_blocks_per_row,  # row stride of block_tables
    num_heads,  # H
    group,  # H // Hkv
    head_dim,  # Dh
    stride_slot,  # Hkv * Dh
    stride_head,  # Dh
    scale,  # 1 / sqrt(Dh)
    BLOCK_SIZE: tl.constexpr,  # P
    TOKEN_TILE: tl.constexpr,  # tokens per loop iteration, >= 16
    GROUP_TILE: tl.constexpr,  # power of two >= max(group, 16)
    HEAD_DIM_TILE: tl.constexpr,  # power of two >= max(Dh, 16)
    UPCAST: tl.constexpr,  # products in float32 (float32 cache, mixed dtypes, interpreter)
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + row)
    query = load_query_group(
        q_ptr, row, kv_head, num_heads, group, head_dim, GROUP_TILE, HEAD_DIM_TILE, UPCAST
    )
    accumulator, _, running_sum = attend_token_range(
        query,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + row.to(tl.int64) * max_blocks_per_row,
        kv_head,
        0,
        context_len,
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
    # an empty row (context_len 0) has running_sum 0 and an all-zero accumulator: it writes zeros
    out = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    heads = kv_head * group + tl.arange(0, GROUP_TILE)
    dims = tl.arange(0, HEAD_DIM_TILE)
    mask = (tl.arange(0, GROUP_TILE) < group)[:, None] & (dims < head_dim)[None, :]
    offsets = (row * num_heads + heads)[:, None] * head_dim + dims[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


# ----- the launcher -------------------------------------------------------------------------------
def check_paged_inputs(q, key_cache, value_cache, block_tables, context_lens) -> None:
    """Shape, dtype and layout checks shared by both paged decode launchers."""
    assert q.dim() == 3, f"q must be (R, H, Dh), got {tuple(q.shape)}"
    assert key_cache.dim() == 4, f"key_cache must be (num_blocks, P, Hkv, Dh), got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "the KV pools must be contiguous"
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape[3] == head_dim, f"Dh differs: q {head_dim}, cache {key_cache.shape[3]}"
    assert num_heads % num_kv_heads == 0, f"H={num_heads} is not a multiple of Hkv={num_kv_heads}"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_rows
    assert block_tables.is_contiguous()
    assert context_lens.dtype == torch.int32 and context_lens.shape == (num_rows,)
    check_device(q, key_cache, value_cache, block_tables, context_lens)


def decode_tiles(group: int, head_dim: int, token_tile: int | None = None) -> dict:
    """Compile-time sizes of a decode launch: the tiles and the warps.

    GROUP_TILE: the query group padded to 16 rows, tl.dot's smallest tile (most groups are 1 to 8).
    TOKEN_TILE: 16 tokens per step at Dh = 128 (8 KB of bfloat16 K and V), 32 at Dh = 64, the same
    bytes. 32 tokens at Dh = 128 measured 124 registers on sm_90 (4 blocks per SM), and 168 with a
    32-byte stack frame for a float32 cache; 16 measure 72 (python -m moekv_kernels.report).
    num_stages=2: with 1, ptxas spilled 8 bytes in the float32 split-K kernel on sm_80.
    """
    head_dim_tile = max(16, triton.next_power_of_2(head_dim))
    token_tile = token_tile or max(16, 2048 // head_dim_tile)
    assert token_tile >= 16 and token_tile & (token_tile - 1) == 0, "token_tile: a power of two >= 16"
    return dict(
        GROUP_TILE=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_TILE=head_dim_tile,
        TOKEN_TILE=token_tile,
        num_warps=4,
        num_stages=2,
    )


def products_in_float32(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """UPCAST: tl.dot in float32 (IEEE) instead of the cache's 16-bit type. Needed for a float32 cache
    (TF32 would miss the 1e-5 check), for a query whose dtype differs from the cache's (tl.dot takes
    one type), and in the interpreter (no bfloat16 arithmetic there)."""
    return key_cache.dtype == torch.float32 or q.dtype != key_cache.dtype or is_interpreting()


def paged_attention_launch(q, key_cache, value_cache, block_tables, context_lens, token_tile=None) -> Launch:
    """Checks, output buffer and the one launch of the decode kernel (moekv_kernels/report.py compiles it)."""
    check_paged_inputs(q, key_cache, value_cache, block_tables, context_lens)
    q = q.contiguous()
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    return Launch(
        paged_attention_kernel,
        (num_rows, num_kv_heads),
        (
            out,
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
        ),
        dict(
            BLOCK_SIZE=block_size,
            UPCAST=products_in_float32(q, key_cache),
            **decode_tiles(group, head_dim, token_tile),
        ),
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    token_tile: int | None = None,
) -> torch.Tensor:
    """Decode attention of q (R, H, Dh) over each row's paged K/V. Returns (R, H, Dh), dtype of q.
    A row with context length 0 gets zeros."""
    launch = paged_attention_launch(q, key_cache, value_cache, block_tables, context_lens, token_tile)
    if q.shape[0] > 0:
        launch()
    return launch.args[0]


# ----- the reference it must equal ----------------------------------------------------------------
def gather_row(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The row's tokens in logical order: (context_len, Hkv, Dh). Only the used blocks are read."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # (num_blocks, P, Hkv, Dh)
    return blocks.flatten(0, 1)[:context_len]  # (context_len, Hkv, Dh)


def paged_attention_reference(q, key_cache, value_cache, block_tables, context_lens) -> torch.Tensor:
    """The same attention in plain PyTorch: gather each row's blocks, then softmax attention in float32."""
    num_rows, num_heads, head_dim = q.shape
    group = num_heads // key_cache.shape[2]
    out = torch.empty_like(q)
    for row in range(num_rows):
        context_len = int(context_lens[row])
        keys = gather_row(key_cache, block_tables[row], context_len).float()  # (n, Hkv, Dh)
        values = gather_row(value_cache, block_tables[row], context_len).float()
        keys = keys.repeat_interleave(group, dim=1)  # (n, H, Dh)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), keys) / math.sqrt(head_dim)  # (H, n)
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


# ----- random inputs for tests, the notebook and the benchmark ------------------------------------
def random_paged_inputs(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
):
    """A pool whose blocks are handed to rows in a shuffled order (scattered block ids), plus the
    queries, block tables (padded with -1, which the kernel must never read) and context lengths."""
    generator = torch.Generator(device).manual_seed(seed)  # drawn on the device: large pools are cheap
    blocks_per_row = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_row) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=generator, device=device)
    block_tables = torch.full(
        (len(context_lens), max(blocks_per_row) + 1), -1, dtype=torch.int32, device=device
    )
    used = 0
    for row, count in enumerate(blocks_per_row):
        block_tables[row, :count] = order[used : used + count].int()
        used += count
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator, device=device).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, key_cache, value_cache, block_tables, lens


# ----- a check against the reference (time it with python -m moekv_kernels.bench) ---------------------
if __name__ == "__main__":
    from ._utils import max_relative_error

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = random_paged_inputs([1, 37, 64, 200], 8, 2, 64, 16, torch.float16, device)
    error = max_relative_error(paged_attention(*inputs), paged_attention_reference(*inputs))
    print(f"paged_attention vs reference, float16: max relative error {error:.1e}")
    print("timings: python -m moekv_kernels.bench (on a GPU)")
