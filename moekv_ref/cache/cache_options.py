"""A paged cache's options, checked in one place into one frozen CacheOptions.

PagedKVCache(config, num_blocks, block_size, **settings) and every cache built on it take the same
keywords (CACHE_SETTINGS), checked here once, before anything is built or allocated:

    dtype, device           the K/V pool's (a floating-point dtype)
    attention               the attention path: "reference", "batched" or "triton" (paged.py)
    shuffle_seed            each device's free queue starts in a random order
    blocks_per_device       per-device pools, [N0, N1, ...] summing to num_blocks, with either of:
    device_of_expert        (E,) or (L, E): each expert's rows live on its device
    home_devices            True: every row of sequence s lives on device s % D

The manager's part of them (block size, seed, the pool's layout) is checked by the manager's own
rules and kept as a ManagerOptions; this module adds what only a cache has (dtype, attention, the
K/V's bytes) and the pool's least size for one token. A caller that checked them already (for_model,
make_paged_cache) passes `options=` the CacheOptions this module returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import require_backend
from ..config import ModelConfig
from ..validation import (
    MAX_BLOCKS,
    MAX_INT32,
    a_type,
    check_choice,
    check_fits_memory,
    check_int,
    check_keywords,
    number,
    shown,
)
from .kv_cache_manager import KVCacheManager
from .options import ManagerOptions, check_manager_options
from .rows import worst_case_lifetime_blocks

ATTENTION_PATHS = ("reference", "batched", "triton")
MANAGER_SETTINGS = ("shuffle_seed", "blocks_per_device", "device_of_expert", "home_devices")

# a cache's keywords beside config, num_blocks and block_size, in the order messages list them
CACHE_SETTINGS = (
    "dtype",
    "device",
    "shuffle_seed",
    "attention",
    "blocks_per_device",
    "device_of_expert",
    "home_devices",
)


@dataclass(frozen=True)
class CacheOptions:
    """A paged cache's options, checked together by check_cache_options: what a cache built with
    `options=` takes as given."""

    dtype: torch.dtype
    device: str | torch.device
    attention: str  # one of ATTENTION_PATHS
    manager: ManagerOptions  # block size, seed, the pool's layout (blocks per device, placement)
    variant: str  # the cache class they were checked for (its name): only that class takes them
    budget: object = None  # the row budget (a RowBudget) of a cache that keeps one, else None

    block_size = property(lambda self: self.manager.block_size)
    num_blocks = property(lambda self: self.manager.num_blocks)


def check_cache_options(
    config: ModelConfig,
    num_blocks,
    block_size,
    max_num_seqs=None,
    settings: dict | None = None,
    variant: str = "PagedKVCache",
    row_cap: int | None = None,
    budget=None,
) -> CacheOptions:
    """Every option of a paged cache, checked once, before anything is built or allocated: what the
    cache, its manager and its pool would otherwise check, and the bytes they would take. settings:
    CACHE_SETTINGS by name (their names checked by the caller). num_blocks=None with max_num_seqs
    (for_model): a pool for max_num_seqs sequences of max_position_embeddings tokens at their worst
    (rows.worst_case_lifetime_blocks, each row capped at row_cap tokens if given). budget: kept in
    the options. The bytes a variant's manager keeps beside its tables are checked when it is built,
    before the K/V are allocated."""
    settings = settings or {}
    own = ("budget",) if budget is not None else ()
    check_keywords(variant, settings, ("config", "num_blocks", "block_size", *CACHE_SETTINGS, *own))
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    dtype = settings.get("dtype", torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: a floating-point torch dtype")
    attention = check_choice("attention", settings.get("attention", "batched"), ATTENTION_PATHS)
    device = settings.get("device", "cpu")
    L = config.num_hidden_layers
    E = config.num_attention_experts
    K = config.num_attention_experts_per_tok
    sized = ""  # how a pool not given in blocks was sized, for the messages below
    if num_blocks is None and settings.get("blocks_per_device") is None and max_num_seqs is not None:
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1, MAX_INT32, "sequences the pool holds")
        sized = (
            f"num_blocks=None sizes the pool for max_num_seqs={max_num_seqs} sequences of "
            f"max_position_embeddings={config.max_position_embeddings} tokens at their worst: "
        )

        def num_blocks(checked_block_size: int) -> int:
            """The pool for max_num_seqs sequences at their worst, once the block size is checked."""
            blocks = max_num_seqs * worst_case_lifetime_blocks(
                config.max_position_embeddings, L, E, K, checked_block_size, row_cap
            )
            if blocks > MAX_BLOCKS:
                raise ValueError(
                    f"{sized}{blocks:,} blocks of {checked_block_size}; allowed: at most "
                    f"{number(MAX_BLOCKS)} blocks (block tables are int32): give num_blocks, or a "
                    "smaller max_num_seqs"
                )
            return blocks

    minimum = L * K  # one token: a block in each of its k rows of every layer
    manager = _check_manager(config, block_size, num_blocks, settings, variant, minimum)
    sizes = manager.blocks_per_device
    if sum(sizes) < minimum:
        raise ValueError(
            f"num_blocks={sum(sizes)} is too small for even one sequence: one "
            f"token needs {minimum} blocks (num_hidden_layers={L} x "
            f"num_attention_experts_per_tok={K}); allow at least {minimum}"
        )
    # each device must hold one token: a block in each of its experts a token can reach, every
    # layer (with home devices, all k of them)
    placement = manager.device_of_expert
    where = "a sequence homed there" if manager.home_devices else "its experts"
    for d, n in enumerate(sizes):
        if placement is None:  # home devices (or one pool): all k of a token's rows may land on d
            least = minimum
        else:
            least = int(torch.clamp((placement == d).sum(1), max=K).sum())
        if n < least:
            raise ValueError(
                f"blocks_per_device[{d}]={n} is too small for even one token of {where}: allow at least {least}"
            )
    Hkv, Dh = config.num_key_value_heads, config.head_dim
    check_fits_memory(
        f"{sized}the K/V of {sum(sizes):,} blocks of {manager.block_size} tokens "
        f"(num_key_value_heads={Hkv} x head_dim={Dh}, {dtype})",
        2 * sum(sizes) * manager.block_size * Hkv * Dh * dtype.itemsize,
        device,
        "give num_blocks, or a smaller max_num_seqs" if sized else "ask for fewer blocks",
    )
    return CacheOptions(dtype, device, attention, manager, variant, budget)


def settings_for_model(model, where: str, settings: dict, allowed) -> dict:
    """A for_model's settings (`allowed` names but dtype and device, checked as `where`'s), with the
    model's dtype and device, and attention=None (or left out) following its backend."""
    named = ("model", "block_size", "num_blocks", "max_num_seqs")
    check_keywords(
        where, settings, named + tuple(name for name in allowed if name not in ("dtype", "device"))
    )
    parameter = next(model.parameters())
    attention = settings.get("attention")
    if attention is None:
        attention = "triton" if model.backend == "triton" else "batched"
    return {**settings, "attention": attention, "dtype": parameter.dtype, "device": parameter.device}


def triton_kernels(attention: str):
    """moekv_kernels where attention="triton" (triton is installed only where it has wheels, Linux;
    importing the kernels sets TRITON_INTERPRET=1 when no GPU is visible, before triton loads), else
    None."""
    if attention != "triton":
        return None
    require_backend("triton")
    import moekv_kernels

    return moekv_kernels


def check_given_options(options, variant: str, num_blocks, settings: dict) -> None:
    """ValueError unless `options`, given to a cache of class `variant`, is a CacheOptions made for
    that class (its check_options), given alone."""
    if not isinstance(options, CacheOptions):
        raise ValueError(
            f"options={shown(options)} is {a_type(options)}; allowed: a CacheOptions ({variant}.check_options)"
        )
    also = ([f"num_blocks={shown(num_blocks)}"] if num_blocks is not None else []) + list(settings)
    if also:
        raise ValueError(
            f"options= with {', '.join(also)} is not allowed; allowed: options alone (it holds them), "
            "or the keywords without options"
        )
    if options.variant != variant:
        raise ValueError(
            f"options made for {options.variant} cannot build a {variant}: make them with "
            f"{variant}.check_options"
        )


def _check_manager(config, block_size, num_blocks, settings, variant, minimum) -> ManagerOptions:
    """The manager's part of the settings, checked by the manager's own rules (options.py)."""
    keywords = {name: settings[name] for name in MANAGER_SETTINGS if name in settings}
    return check_manager_options(
        config.num_hidden_layers,
        config.num_attention_experts,
        block_size,
        num_blocks,
        keywords,
        variant,
        pool_meaning=f"the pool's blocks; one token of one sequence takes {minimum}",
    )[2]


def new_manager(config: ModelConfig, options: CacheOptions, manager_class=KVCacheManager, **own):
    """The manager of a cache of these options (checked): a manager_class (KVCacheManager or one
    built on it) with its own arguments `own` (a budget)."""
    L, E = config.num_hidden_layers, config.num_attention_experts
    return manager_class(L, E, options.block_size, None, **own, options=options.manager)
