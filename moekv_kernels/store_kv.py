"""Store new tokens' K and V into their slots of the paged pool.

What it computes
----------------
For each new token i with slot_mapping[i] = s >= 0:

    key_cache.view(-1, Hkv, Dh)[s]   = key[i]
    value_cache.view(-1, Hkv, Dh)[s] = value[i]

where s = block_id * P + offset was chosen by the cache's bookkeeping (allocate_slots). A negative
slot means "no slot" (a padding token of a fixed-size batch) and is skipped, as in vLLM.

Layout: key, value (n, Hkv, Dh); key_cache, value_cache (num_blocks, P, Hkv, Dh), contiguous;
slot_mapping (n,) int64. Slots must be distinct among the n tokens (the bookkeeping guarantees it);
with duplicates which token wins would be unspecified.

The kernel only moves bytes: the launcher converts key/value to the pool's dtype first with torch
(round to nearest, what the reference does). Converting inside the kernel would be as fast on a GPU,
but the interpreter rounds float32 -> bfloat16 differently, and a store must be bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device


# ----- the kernel ---------------------------------------------------------------------------------
@triton.jit
def store_kv_kernel(
    key_ptr,  # new keys (n, Hkv, Dh), contiguous, pool dtype
    value_ptr,  # new values, same layout
    key_cache_ptr,  # key pool (num_blocks, P, Hkv, Dh), contiguous
    value_cache_ptr,  # value pool, same layout
    slot_mapping_ptr,  # (n,) int64, slot of each new token; < 0 means skip
    values_per_token,  # Hkv * Dh: one token's K (or V) is this many contiguous elements
    TILE: tl.constexpr,  # elements copied per program, a power of two
):
    token = tl.program_id(0)
    tile = tl.program_id(1)  # which TILE of the token
    slot = tl.load(slot_mapping_ptr + token)  # int64
    offsets = tile * TILE + tl.arange(0, TILE)
    mask = (offsets < values_per_token) & (slot >= 0)
    source = token.to(tl.int64) * values_per_token + offsets
    target = slot * values_per_token + offsets
    tl.store(key_cache_ptr + target, tl.load(key_ptr + source, mask=mask), mask=mask)
    tl.store(value_cache_ptr + target, tl.load(value_ptr + source, mask=mask), mask=mask)


# ----- the launcher -------------------------------------------------------------------------------
def store_kv_launch(key, value, key_cache, value_cache, slot_mapping) -> Launch:
    """Checks, the conversion to the pool's dtype, and the launch (moekv_kernels/report.py compiles it)."""
    assert key.dim() == 3 and key.shape == value.shape, (
        f"key/value must be (n, Hkv, Dh), got {tuple(key.shape)}"
    )
    assert (
        key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
    )
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "the KV pools must be contiguous"
    assert key.shape[1:] == key_cache.shape[2:], (
        f"(Hkv, Dh) differ: {tuple(key.shape[1:])} vs {tuple(key_cache.shape[2:])}"
    )
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],)
    check_device(key, value, key_cache, value_cache, slot_mapping)
    key = key.to(key_cache.dtype).contiguous()
    value = value.to(value_cache.dtype).contiguous()
    values_per_token = key.shape[1] * key.shape[2]
    tile = min(triton.next_power_of_2(values_per_token), 1024)
    grid = (key.shape[0], triton.cdiv(values_per_token, tile))
    return Launch(
        store_kv_kernel,
        grid,
        (key, value, key_cache, value_cache, slot_mapping.contiguous(), values_per_token),
        dict(TILE=tile, num_warps=4),
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key, value (n, Hkv, Dh) into the pools at slot_mapping (n,) int64, in place."""
    launch = store_kv_launch(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] > 0:
        launch()


# ----- the reference it must equal ----------------------------------------------------------------
def store_kv_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The same store with torch indexing."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def random_store_inputs(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
):
    """New K/V in float32, pools of `dtype`, and distinct scattered slots; the last slot is -1."""
    generator = torch.Generator(device).manual_seed(seed)  # drawn on the device: large pools are cheap
    assert num_tokens <= num_blocks * block_size
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator, device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator, device=device)[:num_tokens]
    if num_tokens > 1:
        slot_mapping[-1] = -1
    return key, value, key_cache, value_cache, slot_mapping


# ----- a check against the reference (time it with python -m moekv_kernels.bench) ---------------------
if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = random_store_inputs(100, 2, 64, 16, 20, torch.bfloat16, device)
    expected = [t.clone() for t in inputs]
    store_kv(*inputs)
    store_kv_reference(*expected)
    same = torch.equal(inputs[2], expected[2]) and torch.equal(inputs[3], expected[3])
    print(f"store_kv vs reference, bfloat16: bit-exact {same}")
    print("timings: python -m moekv_kernels.bench (on a GPU)")
