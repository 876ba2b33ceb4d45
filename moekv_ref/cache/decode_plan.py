"""The dense decode plan: PlannedPagedKVCache, a PagedKVCache that works a decode append out once a step.

What it adds to PagedKVCache: with one attention expert every layer's row of a sequence holds as many
tokens, so a decode append (each pair the one new token of its own row) that gives no row a block
keeps a DecodePlan, and the next layer's append of the same pairs takes the same block-table
columns, offsets, lengths and gather padding; only the rows (E further on) and their block ids
differ. Where the plan does not apply (other pairs or layer, a sequence's slot changed, rows holding
other counts) the append is the base's, unchanged. It reaches the base through append_kv (super())
and the gather's `block_padding`.

Measured on a dense model of the embedded model's size (generate, 16 sequences, 32-token prompts, 64
new tokens, one thread, CPU time of four runs each): 0.26-0.29 s with it, 0.28-0.31 s without, about
7%. tests/spec/test_paged_cache.py breaks the planned slots and bypasses the plan, and sees both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import AppendedRows, PagedKVCache


@dataclass
class DecodePlan:
    """A decode append's layer-independent work, for the next layer's append of the same pairs."""

    layer: int  # the layer it last served
    key: tuple  # (seq_ids, experts, positions) of the pairs, as lists of ints
    slots: list  # each pair's sequence slot (manager.seq_slots)
    rows: torch.Tensor  # (n,) the rows at `layer`
    old: torch.Tensor  # (n,) tokens each row held before the append
    column: torch.Tensor  # (n,) block-table column and offset of each new token
    offset: torch.Tensor
    appended: AppendedRows  # what attend needs: the same at every layer but the rows and slots
    padding: tuple  # the gather's (width, valid, padding index): PagedKVCache.block_padding

    def served(self, layer: int, rows: torch.Tensor) -> None:
        """The plan now stands at `layer`, whose rows are `rows`."""
        self.layer = layer
        self.rows = rows


class PlannedPagedKVCache(PagedKVCache):
    """A PagedKVCache whose decode appends at layers after the first follow the first's DecodePlan
    (one attention expert); equal to the plain cache, bit for bit (tests)."""

    plan: DecodePlan | None = None  # the last decode append's, for the next layer

    def append_kv(self, layer: int, seq_ids, experts, positions, k, v, scores=None) -> AppendedRows:
        """PagedKVCache.append_kv, served from the plan where it applies."""
        plan, self.plan = self.plan, None
        ids, expert_ids, position_ids = self._check_pairs(seq_ids, experts, positions, k, v)
        key = (ids.tolist(), expert_ids.tolist(), position_ids.tolist())
        appended = self._append_planned(plan, layer, key, position_ids, k, v)
        if appended is not None:
            self.plan = plan
            return appended
        appended = super().append_kv(layer, ids, expert_ids, position_ids, k, v, scores)
        if appended.rows.numel() == k.shape[0]:  # a decode: each pair its own row, in pair order
            self.plan = self._plan_next_layer(layer, key, appended)
        return appended

    def _plan_next_layer(self, layer, key, appended: AppendedRows) -> DecodePlan | None:
        """The plan the next layer's append of the same pairs follows, or None: with one attention
        expert, when no row took a block (so the next layer's take none either)."""
        if self.manager.num_experts != 1:
            return None
        column = appended.pair_index // self.block_size
        offset = appended.pair_index % self.block_size
        if bool((offset == 0).any()):
            return None
        padding = super().block_padding(appended.context_lens)
        slots = self.manager.seq_slots(key[0])
        return DecodePlan(
            layer, key, slots, appended.rows, appended.pair_index, column, offset, appended, padding
        )

    def _append_planned(self, plan, layer, key, positions, k, v) -> AppendedRows | None:
        """append_kv of the plan's pairs at the next layer; None (nothing changed) where the plan does
        not apply: other pairs or layer, a sequence's slot changed, rows holding other counts."""
        manager = self.manager
        if (
            plan is None
            or type(layer) is not int
            or not layer == plan.layer + 1 < manager.num_layers
            or key != plan.key
            or manager.seq_slots(key[0]) != plan.slots
        ):
            return None
        rows = plan.rows + manager.num_experts  # the same (sequence, expert)
        if not torch.equal(manager.row_tokens[rows], plan.old):
            return None
        self._check_positions(rows, positions, rows, None)
        manager.extend_rows_in_place(rows, plan.appended.context_lens, positions)
        slots = plan.offset.add(manager.block_tables[rows, plan.column], alpha=self.block_size)
        self._store(k, v, slots)
        plan.served(layer, rows)
        a = plan.appended  # (dataclasses.replace costs ten times this)
        return AppendedRows(rows, a.num_new, a.context_lens, a.pair_row, a.pair_index, slots)

    def block_padding(self, lens: torch.Tensor):
        """The plan's padding when `lens` are its rows' lengths (its appends' context_lens)."""
        plan = self.plan
        if plan is not None and lens is plan.appended.context_lens:
            return plan.padding
        return super().block_padding(lens)
