"""The trace runner's counting manager: a KVCacheManager (cache/kv_cache_manager.py) over a BlockPool
(cache/block_pool.py) that counts each row's blocks and lists none.

The simulator writes no K/V, and where no prefix cache or swap space is on, no scheduling decision
reads a block id: the scheduler asks for counts (free blocks per device, each slot's open_rows and
count_blocks, each row's tokens). The plain manager still writes every new block's id into its
block tables (rows of up to 512 entries at 64 experts, scattered over hundreds of megabytes) and
every block's reference count, only to read them back when a sequence finishes. These two classes
keep the counts alone:

    CountingBlockPool        BlockPool with no free stacks, reference counts or cached flags: each
                             device's number of free blocks, lent by number (allocate_per_device)
                             and given back by number (free_per_device)
    CountingKVCacheManager   KVCacheManager over a CountingBlockPool, its block tables without
                             columns: a row's blocks are ceil(n / P), as the plain manager counts
                             them; a finished sequence gives back count_blocks, one count per
                             device, instead of a list of about 9,000 ids

Every count, and so every decision, is the plain manager's. The trace runner builds it unless a
prefix cache, a swap space or RunnerSetup.list_block_ids asks for ids: a step then takes 55-60% of
the time at 64 experts, 1.7-1.8x at the fine shape (24 layers, 64 experts top-8 on 64 devices) in
two side-by-side runs of 1,000 requests. What needs an id (slots, a sequence's block list, the
block owners, placing or restoring blocks, a swap space, shared tails, prefix caching, a row
budget) is refused by name, changing nothing. tests/spec/test_sim_fast_paths.py runs the runner with
both managers on random traces and compares every step, and miscounts a block on purpose to show
the comparison sees it.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from ..cache.block_pool import BlockPool
from ..cache.kv_cache_manager import KVCacheManager, SlotAllocation
from ..validation import shown

NO_IDS = torch.zeros(0, dtype=torch.int64)  # what a counting manager's _take_blocks hands back
LISTS_IDS = "a KVCacheManager (cache/kv_cache_manager.py), which lists them"


class CountingBlockPool(BlockPool):
    """BlockPool keeping only each device's number of free blocks (module docstring): it lends
    blocks by number and names none; every call that names a block by id is refused."""

    def _make_block_state(self, shuffle_seed: int | None) -> None:
        """No state per block: empty tensors, so that the attributes BlockPool's STATE names (saved
        and restored with a step) exist as in any pool."""
        self._free_stack = torch.empty(0, dtype=torch.int64)
        self.ref_cnt = torch.zeros(0, dtype=torch.int32)
        self.is_cached = torch.zeros(0, dtype=torch.bool)

    def allocate_per_device(self, num_blocks: torch.Tensor) -> None:
        """num_blocks (D,) blocks of each device counted as lent; OutOfBlocksError, changing
        nothing, when one is short."""
        num_blocks = self._checked_counts(num_blocks)
        self._check_free(num_blocks)
        self._num_free -= num_blocks

    def free_per_device(self, num_blocks: torch.Tensor) -> None:
        """num_blocks (D,) blocks back on each device. ValueError, pool unchanged, when more come
        back to a device than it has lent."""
        num_blocks = self._checked_counts(num_blocks)
        lent = self.blocks_per_device - self._num_free  # (D,)
        if not bool((num_blocks <= lent).all()):
            d = int((num_blocks > lent).nonzero()[0])
            raise ValueError(
                f"free_per_device: device {d} gets {int(num_blocks[d])} blocks back but has lent "
                f"{int(lent[d])}: a double free (pool unchanged)"
            )
        self._num_free += num_blocks

    def _refuse_ids(self, call: str) -> NoReturn:
        raise ValueError(
            f"{call}: this pool ({type(self).__name__}) counts its blocks without ids; allowed: "
            "allocate_per_device and free_per_device, or a BlockPool, which lists them"
        )

    def allocate(self, num_blocks: int, device: int | None = None):
        self._refuse_ids("allocate")

    def free_block_ids(self):
        self._refuse_ids("free_block_ids")

    def _checked_ids(self, block_ids):
        """Every call given block ids (free, incref, reuse, mark_cached, uncache,
        device_of_blocks) is refused here, before it changes anything."""
        self._refuse_ids("a call with block ids")

    def assert_consistent(self) -> None:
        """No inference tensor, and each device's free count within [0, its blocks]."""
        self._assert_no_inference_tensors()
        assert bool(((self._num_free >= 0) & (self._num_free <= self.blocks_per_device)).all()), (
            f"free blocks per device {self._num_free.tolist()} outside [0, {self._device_sizes}]"
        )


class CountingKVCacheManager(KVCacheManager):
    """KVCacheManager counting each row's blocks without listing them (module docstring). Takes the
    plain manager's arguments; tails, prefix_cache and budget are refused, since each reads or
    places block ids."""

    can_swap = False  # a swap copies a sequence's blocks by id

    def __init__(self, *args, tails=None, prefix_cache=None, budget=None, **options):
        """KVCacheManager's arguments (the base checks their names), less the parts it refuses."""
        for role, part in (("tails", tails), ("prefix_cache", prefix_cache), ("budget", budget)):
            if part is not None:
                raise ValueError(
                    f"{role}={shown(part)}: a {type(self).__name__} takes no tails, prefix_cache or "
                    f"budget: each reads or places block ids, which it does not keep; allowed: None, "
                    f"or {LISTS_IDS}"
                )
        super().__init__(*args, **options)

    # ----- the seams of KVCacheManager ------------------------------------------------------------
    def _make_pool(self, num_blocks: int | None, shuffle_seed: int | None, blocks_per_device) -> BlockPool:
        return CountingBlockPool(num_blocks, shuffle_seed, blocks_per_device, checked=True)

    def _initial_table_width(self, initial_blocks_per_row: int) -> int:
        return 0  # no entries, ever

    def _take_blocks(
        self,
        rows: torch.Tensor,
        device: torch.Tensor,
        needed: torch.Tensor,
        num_new_tokens: torch.Tensor,
        num_rows: int,
    ) -> torch.Tensor:
        """The needed blocks counted as lent on their rows' devices, per device; no ids (an empty
        tensor, so allocate_slots lists none). OutOfBlocksError, changing nothing, when short."""
        per_device = self._sum_needed_per_device(device, needed.to(torch.int64), num_rows, num_new_tokens)
        self.pool.allocate_per_device(per_device)
        return NO_IDS

    def _return_sequence_blocks(self, seq_id: int, index: int) -> None:
        """The sequence's blocks per device, as its slot counts them, back to the pool."""
        self.pool.free_per_device(self.count_blocks[index])

    def _return_row_blocks(self, rows: torch.Tensor) -> int:
        """Each row's ceil(n / P) blocks back on its device; returns how many."""
        per_row = self.num_used_columns(rows)  # (m,)
        per_device = torch.zeros(self.num_devices, dtype=torch.int64)
        per_device.index_add_(0, self.row_device[rows], per_row)
        self.pool.free_per_device(per_device)
        return int(per_row.sum())

    def _assert_blocks_consistent(self) -> None:
        """No ids to check: the pool lends, per device, the blocks the held rows count."""
        slots = sorted(self._seq_index.values())
        counted = self.count_blocks[slots].sum(0)  # (D,) zeros when nothing is held
        lent = self.blocks_per_device - self.num_free_blocks_per_device
        assert torch.equal(counted, lent), (
            f"the pool lends {lent.tolist()} blocks per device, the held rows count {counted.tolist()}"
        )

    # ----- what needs a block id, refused ---------------------------------------------------------
    def allocate_slots(
        self,
        rows: torch.Tensor,
        num_new_tokens: torch.Tensor,
        rows_are_distinct: bool = False,
        with_slots: bool = True,
        one_each: bool = False,
    ) -> SlotAllocation:
        """KVCacheManager.allocate_slots with with_slots=False only: there are no slots."""
        if with_slots:
            raise ValueError(
                f"allocate_slots: a {type(self).__name__} has no slots; allowed: with_slots=False, "
                f"or {LISTS_IDS}"
            )
        return super().allocate_slots(rows, num_new_tokens, rows_are_distinct, False, one_each)

    def _refuse_ids(self, call: str) -> NoReturn:
        raise ValueError(
            f"{call}: this manager ({type(self).__name__}) counts blocks without listing them; "
            f"allowed: {LISTS_IDS}, to read or place block ids"
        )

    def slot_of(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        self._refuse_ids("slots")

    def blocks_of_sequence(self, seq_id: int, by_device: bool = False) -> torch.Tensor:
        self._refuse_ids("blocks_of_sequence")

    def block_owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._refuse_ids("block_owners")

    def place_blocks(self, rows: torch.Tensor, columns: torch.Tensor, block_ids: torch.Tensor) -> None:
        self._refuse_ids("place_blocks")

    def start_from_blocks(
        self,
        seq_id: int,
        row_counts: torch.Tensor,
        shared_rows: torch.Tensor,
        shared_columns: torch.Tensor,
        shared_blocks: torch.Tensor,
        copied_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._refuse_ids("start_from_blocks")

    def restore_sequence(self, seq_id: int, token_counts: torch.Tensor, last_appended: torch.Tensor):
        self._refuse_ids("restore_sequence")
