"""Each Triton kernel equals its PyTorch reference.

On a CPU these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which is slow:
the cases are small but each one hits an edge the kernels must handle — scattered block ids, rows of
length 1 and exact block multiples, block sizes smaller and larger than the token tile and not powers
of two, head widths that are not powers of two, GQA groups, experts with no tokens.

Error measure: max |out - ref| / max |ref| (moekv_kernels._utils.max_relative_error), against bounds per
dtype: float32 summation order, plus for float16 / bfloat16 the rounding of the output and of the
softmax weights to the storage dtype. The references compute in float32 from the same stored values, so the error is
float32 summation order plus the final rounding to the output dtype.
"""

import pytest
import torch

pytest.importorskip("triton")

from moekv_kernels._utils import max_relative_error  # noqa: E402
from moekv_kernels.expert_gemm import expert_gemm, expert_gemm_reference, random_gemm_inputs, tile_schedule  # noqa: E402
from moekv_kernels.paged_attention import paged_attention, paged_attention_reference, random_paged_inputs  # noqa: E402
from moekv_kernels.paged_attention_split_k import paged_attention_split_k  # noqa: E402
from moekv_kernels.store_kv import random_store_inputs, store_kv, store_kv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)

# (H, Hkv, Dh, P): plain MHA with P = the token tile; GQA with P smaller than the tile and not a
# power of two, Dh not a power of two; one KV head for 4 query heads with P larger than the tile.
PAGED_SHAPES = [(2, 2, 32, 16), (4, 2, 24, 5), (4, 1, 16, 32)]
# lengths: 1, a row ending exactly on a block boundary for every P above (80 = 5*16 = 16*5),
# lengths that divide neither the tile nor the block
CONTEXT_LENS = [1, 80, 37, 17, 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PAGED_SHAPES, ids=lambda s: "H{}-Hkv{}-Dh{}-P{}".format(*s))
def test_paged_attention_matches_reference(dtype, shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    inputs = random_paged_inputs(
        CONTEXT_LENS,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        DEVICE,
        seed=PAGED_SHAPES.index(shape) + 10 * DTYPES.index(dtype),
    )
    out = paged_attention(*inputs, token_tile=16)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert max_relative_error(out, paged_attention_reference(*inputs)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PAGED_SHAPES[1:], ids=lambda s: "H{}-Hkv{}-Dh{}-P{}".format(*s))
def test_paged_attention_split_k_matches_reference(dtype, shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    # 70 tokens in splits of 32: a full split, a partial one, and (for short rows) empty ones
    inputs = random_paged_inputs(
        [1, 70, 32, 5], num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed=7
    )
    out = paged_attention_split_k(*inputs, tokens_per_split=32, token_tile=16)
    assert max_relative_error(out, paged_attention_reference(*inputs)) <= TOLERANCE[dtype]


def test_paged_attention_never_reads_padding():
    """Block-table entries past a row's blocks are garbage here (huge ids): a read would fault or differ."""
    inputs = random_paged_inputs([1, 16, 20], 2, 2, 16, 16, torch.float32, DEVICE, seed=3)
    q, key_cache, value_cache, block_tables, context_lens = inputs
    used = (context_lens.long() + 15) // 16  # blocks each row uses
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    poisoned = block_tables.masked_fill(columns[None, :] >= used[:, None], 10**9)
    expected = paged_attention_reference(q, key_cache, value_cache, block_tables, context_lens)
    for kernel in (paged_attention, paged_attention_split_k):
        out = kernel(q, key_cache, value_cache, poisoned, context_lens)
        assert max_relative_error(out, expected) <= 1e-5


def only_rows_are_finite(cache, block_tables, context_lens):
    """A copy of the pool where every slot that is not one of a row's first context_len tokens is NaN."""
    block_size = cache.shape[1]
    keep = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool, device=cache.device)
    for row, length in enumerate(context_lens.tolist()):
        tokens = torch.arange(length, device=cache.device)
        keep[block_tables[row, tokens // block_size].long() * block_size + tokens % block_size] = True
    poisoned = cache.clone().view(-1, *cache.shape[2:])
    poisoned[~keep] = float("nan")
    return poisoned.view(cache.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernels_read_only_the_rows_tokens(dtype):
    """Every slot outside the rows (tails of partly filled blocks, spare blocks) holds NaN and every
    block-table entry past a row's blocks is a huge id: reading any of them as data would turn the
    output into NaN or fault."""
    inputs = random_paged_inputs([1, 0, 37, 16, 5], 4, 2, 24, 5, dtype, DEVICE, spare_blocks=4, seed=11)
    q, key_cache, value_cache, block_tables, context_lens = inputs
    key_cache = only_rows_are_finite(key_cache, block_tables, context_lens)
    value_cache = only_rows_are_finite(value_cache, block_tables, context_lens)
    assert key_cache.isnan().any() and value_cache.isnan().any()
    used = (context_lens.long() + 4) // 5  # blocks each row uses
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    block_tables = block_tables.masked_fill(columns[None, :] >= used[:, None], 10**9)
    expected = paged_attention_reference(q, key_cache, value_cache, block_tables, context_lens)
    assert expected.isfinite().all()
    for out in (
        paged_attention(q, key_cache, value_cache, block_tables, context_lens, token_tile=16),
        paged_attention_split_k(
            q, key_cache, value_cache, block_tables, context_lens, tokens_per_split=16, token_tile=16
        ),
    ):
        assert out.isfinite().all()
        assert max_relative_error(out, expected) <= TOLERANCE[dtype]


def test_empty_row_gives_zeros_everywhere():
    """A row of context length 0 attends to nothing: zeros from both kernels and from the reference,
    and the other rows are unaffected."""
    inputs = random_paged_inputs([0, 20, 0], 4, 2, 16, 8, torch.float32, DEVICE, seed=12)
    expected = paged_attention_reference(*inputs)
    assert torch.equal(expected[0], torch.zeros_like(expected[0])) and torch.equal(expected[2], expected[0])
    for out in (paged_attention(*inputs), paged_attention_split_k(*inputs, tokens_per_split=16)):
        assert torch.equal(out[0], expected[0]) and torch.equal(out[2], expected[2])
        assert max_relative_error(out[1], expected[1]) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_is_bit_exact(dtype):
    # 37 tokens with Hkv*Dh = 2*24 = 48 values each (not a power of two), P = 5; the last slot is -1
    inputs = random_store_inputs(37, 2, 24, 5, 9, dtype, DEVICE)
    expected = [t.clone() for t in inputs]
    store_kv(*inputs)
    store_kv_reference(*expected)
    assert torch.equal(inputs[2], expected[2]) and torch.equal(inputs[3], expected[3])


def test_store_then_attend_sees_the_new_token():
    """The decode order of the cache: store the new token's K/V, then attend over all of the row."""
    q, key_cache, value_cache, block_tables, context_lens = random_paged_inputs(
        [4], 2, 2, 16, 16, torch.float32, DEVICE, seed=5
    )
    new_key = torch.randn(1, 2, 16, device=DEVICE) * 10  # a key that dominates
    new_value = torch.randn(1, 2, 16, device=DEVICE)
    slot = block_tables[0, 0].long() * 16 + 4  # logical token 4
    store_kv(new_key, new_value, key_cache, value_cache, slot.view(1))
    context_lens += 1
    out = paged_attention(q, key_cache, value_cache, block_tables, context_lens)
    assert (
        max_relative_error(
            out, paged_attention_reference(q, key_cache, value_cache, block_tables, context_lens)
        )
        <= 1e-5
    )


def test_tile_schedule_example():
    tile_expert, tile_row_start, tile_row_end = tile_schedule(torch.tensor([3, 0, 5]), 4)
    assert tile_expert.tolist() == [0, 2, 2]
    assert tile_row_start.tolist() == [0, 3, 7]
    assert tile_row_end.tolist() == [3, 8, 8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", [[1], [5, 0, 70, 33]], ids=["one-token", "ragged-with-empty-expert"])
def test_expert_gemm_matches_reference(dtype, counts):
    # D = 40 and F = 24 divide none of the tiles
    x, weights, counts = random_gemm_inputs(counts, 40, 24, dtype, DEVICE, seed=len(counts))
    out = expert_gemm(x, weights, counts, block_m=16, block_n=16, block_k=16)
    assert out.shape == (x.shape[0], 24) and out.dtype == dtype
    assert max_relative_error(out, expert_gemm_reference(x, weights, counts)) <= TOLERANCE[dtype]


def test_expert_gemm_rejects_counts_that_do_not_cover_x():
    x, weights, counts = random_gemm_inputs([4, 4], 16, 16, torch.float32, DEVICE)
    with pytest.raises(AssertionError, match="counts sum"):
        expert_gemm(x, weights, counts + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs for real")
def test_bench_refuses_to_run_without_a_gpu():
    """No fake numbers: on a CPU the benchmark says why it measured nothing, and exits non-zero."""
    from moekv_kernels import bench

    with pytest.raises(SystemExit, match="no CUDA device: nothing was measured"):
        bench.main(["--out", "/nonexistent/never-written.json"])
