"""A manager's and a pool's options, checked in one place into one frozen object; and the checks of
the arguments their calls take.

KVCacheManager(num_layers, num_experts, block_size, num_blocks, **options) and every manager built
on it take the same keywords, checked here once, before anything is allocated, into a
ManagerOptions (the manager keeps it as `options`):

    shuffle_seed            each device's free queue starts in a random order (tests use it to show
                            that nothing depends on a row's blocks being adjacent)
    blocks_per_device       per-device pools, [N0, N1, ...] summing to num_blocks, with either of:
    device_of_expert        (E,) or (L, E): each expert's rows live on its device
    home_devices            True: every row of sequence s lives on device s % D
    initial_num_seqs        sequence slots the tables start with (they double as needed)
    initial_blocks_per_row  columns each block table starts with (they double as needed)

A caller that checked them already (a paged cache checks them with its own options) passes
`options=` the ManagerOptions this module returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import (
    MAX_BLOCKS,
    MAX_INT32,
    check_block_size,
    check_blocks_per_device,
    check_device_table,
    check_fits_memory,
    check_flag,
    check_ids,
    check_int,
    check_keywords,
    check_seed,
    preview,
    shown,
)

# bytes the pool's own tensors take per block: a free-stack entry (8), a ref count (4), a cached flag (1)
BYTES_PER_BLOCK = 13

MANAGER_KEYWORDS = (
    "shuffle_seed",
    "blocks_per_device",
    "device_of_expert",
    "home_devices",
    "initial_num_seqs",
    "initial_blocks_per_row",
)


@dataclass(frozen=True)
class ManagerOptions:
    """A manager's sizes and placement, checked and resolved by check_manager_options."""

    block_size: int
    blocks_per_device: list[int]  # (D,) [num_blocks] for one pool
    shuffle_seed: int | None = None
    device_of_expert: torch.Tensor | None = None  # (L, E) int64; None: one pool, or home devices
    home_devices: bool = False
    initial_num_seqs: int = 4
    initial_blocks_per_row: int = 4

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_per_device)


def check_pool_size(num_blocks, blocks_per_device, meaning: str = "the pool's blocks") -> list[int]:
    """The pool's blocks per device: [num_blocks] (one device), or blocks_per_device (num_blocks, if
    given too, their sum), each a count of MAX_BLOCKS at most in all, whose bookkeeping fits the
    machine; ValueError naming the bad value before anything is allocated. `meaning`: what a
    message says num_blocks is."""
    if blocks_per_device is None:
        sizes = [check_int("num_blocks", num_blocks, 1, MAX_BLOCKS, meaning)]
    else:
        sizes = check_blocks_per_device(blocks_per_device)
        if num_blocks is not None and num_blocks != sum(sizes):
            raise ValueError(f"num_blocks={shown(num_blocks)} must equal sum(blocks_per_device)={sum(sizes)}")
    check_pool_fits(sum(sizes))
    return sizes


def check_pool_fits(num_blocks: int) -> None:
    """ValueError when the pool's own tensors for num_blocks blocks would not fit the machine."""
    check_fits_memory(
        f"the bookkeeping of a pool of {num_blocks:,} blocks",
        BYTES_PER_BLOCK * num_blocks,
        "cpu",
        "ask for fewer blocks",
    )


def check_devices(home_devices, blocks_per_device, device_of_expert) -> bool:
    """Per-device pools take blocks_per_device with device_of_expert (each expert's rows on its
    device) or with home_devices=True (every row of sequence s on device s % D); one pool, neither."""
    check_flag("home_devices", home_devices)
    if home_devices and device_of_expert is not None:
        raise ValueError(
            "home_devices=True takes no device_of_expert: every row of sequence s lives on "
            "device s % D, whatever its expert"
        )
    if home_devices and blocks_per_device is None:
        raise ValueError(
            "home_devices=True needs blocks_per_device: every row of sequence s lives on device "
            "s % D of the pools it gives"
        )
    if not home_devices and (blocks_per_device is None) != (device_of_expert is None):
        raise ValueError(
            "per-device pools need both blocks_per_device and device_of_expert "
            "(or home_devices=True instead of device_of_expert)"
        )
    return home_devices


def checked_placement(device_of_expert, num_layers: int, num_experts: int, num_devices: int) -> torch.Tensor:
    """device_of_expert as (L, E) int64: given (E,) for every layer or (L, E), devices in [0, D), or
    ValueError naming the first bad value (validation.check_device_table, the rule of every table of
    devices)."""
    return check_device_table(device_of_expert, num_devices, num_layers, num_experts, every_layer=True)


def check_bookkeeping_fits(num_layers: int, num_experts: int, options: ManagerOptions, extra_bytes) -> None:
    """ValueError, before anything is allocated, when a manager's tables for its first sequence
    slots take more than the machine's memory. extra_bytes(num_layers, num_rows, options): what a manager
    built on the plain one keeps beside them."""
    num_rows = options.initial_num_seqs * num_layers * num_experts
    # per row a count, a device, a position and a clock (8 bytes each) and its int32 table entries
    needed = num_rows * (4 * 8 + 4 * options.initial_blocks_per_row)
    needed += extra_bytes(num_layers, num_rows, options)
    check_fits_memory(
        f"the tables of {num_rows:,} rows (num_layers={num_layers} x num_experts={num_experts} x "
        f"{options.initial_num_seqs} sequences) over {options.num_blocks:,} blocks of {options.block_size}",
        needed,
        "cpu",
        "ask for fewer layers, experts, sequences or blocks",
    )


def check_manager_options(
    num_layers,
    num_experts,
    block_size,
    num_blocks,
    keywords: dict,
    where: str = "KVCacheManager",
    extra_bytes=lambda num_layers, num_rows, options: 0,
    pool_meaning: str = "the pool's blocks",
) -> tuple[int, int, ManagerOptions]:
    """(num_layers, num_experts, options) for a manager's arguments, each value checked once, before
    anything is allocated; keywords: MANAGER_KEYWORDS by name, or options= a ManagerOptions already
    checked. num_blocks: an int, None (blocks_per_device gives the pool), or a function of the checked
    block size (a pool sized for a workload). pool_meaning: what a block count means, for the pool
    size's message."""
    num_layers = check_int("num_layers", num_layers, 1, MAX_INT32)
    num_experts = check_int("num_experts", num_experts, 1, MAX_INT32)
    if "options" in keywords:
        given = keywords["options"]
        if len(keywords) > 1 or not isinstance(given, ManagerOptions):
            raise ValueError(
                f"options={shown(given)} is not allowed with {sorted(set(keywords) - {'options'})}; "
                "allowed: a ManagerOptions (cache/options.py) alone, or the keywords it holds"
            )
        # the values were checked; what this manager keeps beside its tables is weighed here
        check_bookkeeping_fits(num_layers, num_experts, given, extra_bytes)
        return num_layers, num_experts, given
    check_keywords(
        where,
        keywords,
        ("num_layers", "num_experts", "block_size", "num_blocks", *MANAGER_KEYWORDS, "options"),
    )
    block_size = check_block_size(block_size)
    blocks_per_device = keywords.get("blocks_per_device")
    device_of_expert = keywords.get("device_of_expert")
    home_devices = check_devices(keywords.get("home_devices", False), blocks_per_device, device_of_expert)
    if callable(num_blocks):
        num_blocks = num_blocks(block_size)
    sizes = check_pool_size(num_blocks, blocks_per_device, pool_meaning)
    shuffle_seed = check_seed("shuffle_seed", keywords.get("shuffle_seed"), len(sizes), allow_none=True)
    if device_of_expert is not None:
        device_of_expert = checked_placement(device_of_expert, num_layers, num_experts, len(sizes))
    options = ManagerOptions(
        block_size,
        sizes,
        shuffle_seed,
        device_of_expert,
        home_devices,
        check_int("initial_num_seqs", keywords.get("initial_num_seqs", 4), 1, MAX_INT32),
        check_int("initial_blocks_per_row", keywords.get("initial_blocks_per_row", 4), 1, MAX_INT32),
    )
    check_bookkeeping_fits(num_layers, num_experts, options, extra_bytes)
    return num_layers, num_experts, options


# ----- the arguments of a pool's and a manager's calls ------------------------------------------------
def check_pool_device(device, num_devices: int) -> int:
    """device as an int in [0, D), or ValueError (TypeError when left out on several devices)."""
    if device is None:
        if num_devices > 1:
            raise TypeError(
                f"allocate on a pool of {num_devices} devices needs a device: allocate(num_blocks, device=d)"
            )
        return 0
    return check_int("device", device, 0, num_devices - 1, "a device of this pool")


def check_counts_per_device(num_blocks, num_devices: int) -> torch.Tensor:
    """num_blocks as (D,) int64 counts >= 0, one per device, or ValueError."""
    num_blocks = check_ids(num_blocks, "num_blocks")
    if num_blocks.shape != (num_devices,) or bool((num_blocks < 0).any()):
        raise ValueError(
            f"num_blocks={preview(num_blocks)} must be ({num_devices},) counts >= 0, one per device"
        )
    return num_blocks


def check_appends(manager, rows, num_new_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """rows and num_new_tokens of an append as 1-D int64 of equal length: distinct rows of sequences
    the manager holds, counts >= 0; ValueError naming the bad value otherwise."""
    rows = check_ids(rows, "rows")
    num_new_tokens = check_ids(num_new_tokens, "num_new_tokens")
    if rows.shape != num_new_tokens.shape or rows.dim() != 1:
        raise ValueError(
            f"rows and num_new_tokens must be 1-D of equal length, got "
            f"{tuple(rows.shape)} and {tuple(num_new_tokens.shape)}"
        )
    if num_new_tokens.numel() and int(num_new_tokens.min()) < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {int(num_new_tokens.min())}")
    check_rows_held(manager, rows, "allocate_slots")
    check_distinct_rows(manager, rows, "allocate_slots")
    return rows, num_new_tokens


def check_distinct_rows(manager, rows: torch.Tensor, call: str) -> None:
    """ValueError unless the rows (held rows, 1-D) are distinct: one mark per row of the manager,
    not a sort (an append of the simulator lists tens of thousands)."""
    marked = torch.zeros(manager.row_tokens.numel(), dtype=torch.bool).index_fill_(0, rows, True)
    if int(marked.count_nonzero()) != rows.numel():
        raise ValueError(f"rows must be distinct within one {call} call")


def check_rows_held(manager, rows: torch.Tensor, call: str) -> None:
    """ValueError unless every row id (int64, 1-D) is a row of a sequence the manager holds: a few
    tensor operations, whatever the number of rows."""
    if rows.numel() == 0:
        return
    lowest, highest = (int(bound) for bound in torch.aminmax(rows))
    in_range = lowest >= 0 and highest < manager.row_tokens.numel()
    if in_range and bool(manager.slot_held[rows // manager.rows_per_seq].all()):
        return
    raise ValueError(
        f"{call}: rows {rows.tolist()[:8]} are not all rows of sequences the cache holds; allowed: "
        "rows of held sequences (add_sequence first, then rows(seq_ids, layer, experts))"
    )
