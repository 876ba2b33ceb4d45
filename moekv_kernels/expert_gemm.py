"""Grouped GEMM for expert projections: every expert's tokens times that expert's weight, in one launch.

What it computes
----------------
Tokens are sorted by expert: rows [offset_e, offset_e + count_e) of x belong to expert e, with
offset_e = count_0 + ... + count_{e-1}. For every expert e:

    out[offset_e : offset_e + count_e] = x[offset_e : offset_e + count_e] @ weights[e]

x (N, D), counts (E,) with sum N, weights (E, D, F), out (N, F). This is what an MoE layer does for
each projection (the attention experts' W_q/W_k/W_v/W_o, the FFN experts' gate/up/down); a loop of E
small matmuls, one per expert, is the reference.

How the kernel works
--------------------
The launcher cuts each expert's rows into tiles of BLOCK_M and lists the tiles: for tile i, its
expert, its first row and its expert's end row (the schedule, built with torch on the device). The
grid is (tiles, F / BLOCK_N); each program computes a (BLOCK_M, BLOCK_N) tile of out with a loop
over D in steps of BLOCK_K. Rows past the expert's end are masked: padding to the tile happens inside
the kernel, the caller copies nothing. Counts of 0 give no tiles.

Arithmetic: products accumulate in float32. For float32 inputs the dot is IEEE float32 (TF32
would miss the 1e-5 check). For float16 / bfloat16 inputs a GPU multiplies in the input type, which is
exact: the product of two 11-bit (or 8-bit) significands fits in float32's 24 bits. The interpreter
cannot multiply bfloat16, so there the launcher asks the kernel to convert tiles to float32 first;
the result is the same up to the order of additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, is_interpreting


# ----- the kernel ---------------------------------------------------------------------------------
@triton.jit
def expert_gemm_kernel(
    out_ptr,  # output (N, F), dtype of x
    x_ptr,  # tokens sorted by expert (N, D)
    weights_ptr,  # (E, D, F), any strides
    tile_expert_ptr,  # (num_tiles,) int32: expert of each row tile
    tile_row_start_ptr,  # (num_tiles,) int32: first row of each row tile
    tile_row_end_ptr,  # (num_tiles,) int32: end row of the tile's expert (masks the padding)
    model_dim,  # D, the reduction length
    out_dim,  # F
    stride_x_row,
    stride_x_col,  # x strides
    stride_w_expert,
    stride_w_row,
    stride_w_col,  # weight strides
    stride_out_row,
    stride_out_col,  # out strides
    BLOCK_M: tl.constexpr,  # rows per tile (>= 16)
    BLOCK_N: tl.constexpr,  # output columns per tile (>= 16)
    BLOCK_K: tl.constexpr,  # reduction step (>= 16)
    UPCAST: tl.constexpr,  # convert tiles to float32 before tl.dot (float32 inputs, or the interpreter)
):
    tile = tl.program_id(0)
    column_tile = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    rows = row_start + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_valid = rows < row_end
    column_valid = columns < out_dim
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row
    w_columns = weights_ptr + expert * stride_w_expert + columns[None, :] * stride_w_col
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, model_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < model_dim
        x_tile = tl.load(
            x_rows + ks[None, :] * stride_x_col, mask=row_valid[:, None] & k_valid[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_K)
        w_tile = tl.load(
            w_columns + ks[:, None] * stride_w_row, mask=k_valid[:, None] & column_valid[None, :], other=0.0
        )  # (BLOCK_K, BLOCK_N)
        if UPCAST:
            accumulator = tl.dot(
                x_tile.to(tl.float32), w_tile.to(tl.float32), accumulator, input_precision="ieee"
            )
        else:
            accumulator = tl.dot(x_tile, w_tile, accumulator)
    out_offsets = rows.to(tl.int64)[:, None] * stride_out_row + columns[None, :] * stride_out_col
    tl.store(
        out_ptr + out_offsets,
        accumulator.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & column_valid[None, :],
    )


# ----- the launcher -------------------------------------------------------------------------------
def tile_schedule(counts: torch.Tensor, block_m: int):
    """Row tiles of BLOCK_M over each expert's rows: (tile_expert, tile_row_start, tile_row_end).

    counts (E,) -> three (num_tiles,) int32 tensors on counts' device. Example with counts [3, 0, 5]
    and BLOCK_M = 4: tiles (expert 0, rows 0..3 end 3), (expert 2, rows 3..7 end 8), (2, 7..11, 8).
    """
    counts = counts.long()
    ends = counts.cumsum(0)  # (E,)
    starts = ends - counts
    tiles_per_expert = (counts + block_m - 1) // block_m  # (E,)
    experts = torch.arange(counts.numel(), device=counts.device)
    tile_expert = experts.repeat_interleave(tiles_per_expert)  # (num_tiles,)
    first_tile = tiles_per_expert.cumsum(0) - tiles_per_expert  # (E,)
    index_in_expert = torch.arange(tile_expert.numel(), device=counts.device) - first_tile[tile_expert]
    tile_row_start = starts[tile_expert] + index_in_expert * block_m
    return tile_expert.int(), tile_row_start.int(), ends[tile_expert].int()


def expert_gemm_launch(
    x, weights, counts, block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3
) -> Launch:
    """Checks, the tile schedule, the output and the launch (moekv_kernels/report.py compiles it)."""
    assert x.dim() == 2 and weights.dim() == 3, (
        f"x (N, D), weights (E, D, F); got {tuple(x.shape)}, {tuple(weights.shape)}"
    )
    num_tokens, model_dim = x.shape
    num_experts, weight_rows, out_dim = weights.shape
    assert weight_rows == model_dim, f"weights rows {weight_rows} != x columns {model_dim}"
    assert counts.shape == (num_experts,), (
        f"counts must be (E,) = ({num_experts},), got {tuple(counts.shape)}"
    )
    assert x.dtype == weights.dtype, f"x is {x.dtype}, weights {weights.dtype}"
    assert min(block_m, block_n, block_k) >= 16, "tiles under 16 do not compile for tl.dot on a GPU"
    check_device(x, weights, counts)
    tile_expert, tile_row_start, tile_row_end = tile_schedule(counts, block_m)
    # the only device-to-host reads: the grid size, and the check that counts cover x
    assert int(counts.sum()) == num_tokens, f"counts sum to {int(counts.sum())}, x has {num_tokens} rows"
    out = torch.empty(num_tokens, out_dim, dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(out_dim, block_n))
    return Launch(
        expert_gemm_kernel,
        grid,
        (
            out,
            x,
            weights,
            tile_expert,
            tile_row_start,
            tile_row_end,
            model_dim,
            out_dim,
            x.stride(0),
            x.stride(1),
            weights.stride(0),
            weights.stride(1),
            weights.stride(2),
            out.stride(0),
            out.stride(1),
        ),
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            UPCAST=x.dtype == torch.float32 or is_interpreting(),
            num_warps=num_warps,
            num_stages=num_stages,
        ),
    )


def expert_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x (N, D) sorted by expert, weights (E, D, F), counts (E,) -> out (N, F) in x's dtype.

    Tile sizes are fixed arguments (no autotune: it needs a GPU, and moekv_kernels/bench.py sweeps them).
    """
    launch = expert_gemm_launch(x, weights, counts, block_m, block_n, block_k, num_warps, num_stages)
    if launch.grid[0] > 0 and launch.grid[1] > 0:
        launch()
    return launch.args[0]


# ----- the reference it must equal ----------------------------------------------------------------
def expert_gemm_reference(x, weights, counts) -> torch.Tensor:
    """One matmul per expert over its slice of the sorted tokens, in float32."""
    out = torch.empty(x.shape[0], weights.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        out[start : start + count] = (x[start : start + count].float() @ weights[expert].float()).to(x.dtype)
        start += count
    return out


def random_gemm_inputs(
    counts: list[int],
    model_dim: int,
    out_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
):
    """x (sum(counts), D), weights (E, D, F) scaled so outputs are O(1), counts (E,) int32."""
    generator = torch.Generator(device).manual_seed(seed)  # drawn on the device: large pools are cheap
    x = torch.randn(sum(counts), model_dim, generator=generator, device=device).to(dtype)
    weights = (
        torch.randn(len(counts), model_dim, out_dim, generator=generator, device=device) * model_dim**-0.5
    ).to(dtype)
    return x, weights, torch.tensor(counts, dtype=torch.int32, device=device)


# ----- a check against the reference (time it with python -m moekv_kernels.bench) ---------------------
if __name__ == "__main__":
    from ._utils import max_relative_error

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = random_gemm_inputs([5, 0, 70, 33], 96, 80, torch.bfloat16, device)
    error = max_relative_error(expert_gemm(*inputs), expert_gemm_reference(*inputs))
    print(f"expert_gemm vs reference, bfloat16: max relative error {error:.1e}")
    print("timings: python -m moekv_kernels.bench (on a GPU)")
