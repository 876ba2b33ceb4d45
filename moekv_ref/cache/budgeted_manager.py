"""BudgetedKVCacheManager: a KVCacheManager (kv_cache_manager.py) whose rows hold at most B tokens.

What it adds to the plain manager: a RowBudget (budget.py), which keeps per row what its policy
reads, and

- `allocate_within_budget`: one newcomer per row, placed where the policy says: appended below the
  row's budget (which may take a block), in a victim's slot at a full row, or refused;
- a row stops growing at its budget, so the blocks an append needs are counted up to it
  (`blocks_needed_per_device`), and `layer_limits` tells a scheduler each layer's B;
- the budget's per-row state emptied, grown and checked with the rows'.

budget_paged.py builds the paged cache over it; a budget at or above a row's length is the exact
cache (tests/spec/test_budget.py).
"""

from __future__ import annotations

import torch

from ..validation import check_ids, shown
from .budget import RowBudget, check_budget_kind
from .kv_cache_manager import KVCacheManager
from .options import ManagerOptions


def check_budget(budget, num_layers, num_experts) -> RowBudget:
    """A RowBudget no other manager holds, which the model can have; ValueError otherwise."""
    check_budget_kind(budget)
    if budget is None:
        raise ValueError("budget=None is not allowed; allowed: a RowBudget (cache/budget.py)")
    if budget.manager is not None:
        raise ValueError(
            f"budget={shown(budget)} already belongs to another KVCacheManager: a budget keeps one "
            "manager's rows; build a new RowBudget (or budget.fresh()) for this one"
        )
    budget.check_model(num_layers, num_experts)
    return budget


class BudgetedKVCacheManager(KVCacheManager):
    """KVCacheManager with a RowBudget (module docstring); the plain manager's arguments."""

    PARTS = (*KVCacheManager.PARTS, "budget")

    def __init__(
        self, num_layers: int, num_experts: int, block_size: int, num_blocks=None, budget=None, **options
    ):
        self.budget = check_budget(budget, num_layers, num_experts)
        super().__init__(num_layers, num_experts, block_size, num_blocks, **options)
        budget.attach(self)

    def _bytes_beside_tables(self, num_layers: int, num_rows: int, options: ManagerOptions) -> int:
        return self.budget.bytes_needed(num_rows, options.num_blocks, options.block_size, num_layers)

    @property
    def layer_limits(self) -> list[int]:
        return self.budget.layer_limits.tolist()

    def blocks_needed_per_device(self, rows, num_new_tokens) -> torch.Tensor:
        """KVCacheManager.blocks_needed_per_device, each row stopping at its budget."""
        rows = check_ids(rows, "rows")
        room = self.budget.limit_of_rows(rows) - self.row_tokens[rows]
        return super().blocks_needed_per_device(
            rows, torch.minimum(check_ids(num_new_tokens, "num_new_tokens"), room)
        )

    def allocate_within_budget(
        self, rows: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One newcomer for each of the distinct rows: the budget's policy says where each goes
        (budget.py); a row below its budget appends it (which may take a block, OutOfBlocksError
        changing nothing), a full row gives it the victim's slot, or refuses it. Returns the
        accepted newcomers' slots (a,) and accepted (m,) bool."""
        index = self.budget.choose(rows, positions, scores)  # (m,) -1: refused
        accepted = index >= 0
        taken = rows[accepted]  # (a,)
        slot_index = index[accepted]  # (a,)
        appending = slot_index == self.row_tokens[taken]  # (a,) below budget
        self.grow_rows(taken[appending], torch.ones(int(appending.sum()), dtype=torch.int64))
        self.budget.record(rows, index, positions, scores)
        self.last_position[taken] = positions[accepted]
        self.last_appended[taken] = self.clock
        return self.slot_of(taken, slot_index), accepted

    def _clear_rows(self, rows) -> None:
        super()._clear_rows(rows)
        self.budget.clear_rows(rows)

    @torch.inference_mode(False)
    def _grow_rows(self) -> None:
        super()._grow_rows()
        self.budget.grow_rows(self.row_tokens.numel())

    def assert_consistent(self) -> None:
        super().assert_consistent()
        self.budget.assert_consistent()
