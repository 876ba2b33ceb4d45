"""The paged cache with a row budget: PagedKVCache whose rows each keep at most B tokens (budget.py).

What it adds to PagedKVCache: its manager is a BudgetedKVCacheManager (budgeted_manager.py), whose
RowBudget says where a newcomer at a full row goes (its policy) and keeps what the policy reads; it
overrides the two verbs of cache/__init__.py, check_options (the budget) and make_manager. The
semantics are budget.py's, token by token: a newcomer at a full row sees the row its
predecessors left (and under heavy_hitter the victim depends on the attention just computed), so one
call cannot place a prefill chunk's tokens at once. `append_kv` appends what fits, with the plain
cache's own operations (a budget no row reaches changes no bit), and hands `attend` the rest
(WaitingPairs); `attend` attends the appended pairs by the plain path, then places the waiting pairs
one per row at a time (BudgetedKVCacheManager.allocate_within_budget) and attends each wave in turn. A
refused pair's output is zero: it adds nothing to its token's gated sum.

factory.make_paged_cache is the one place that chooses the class: the cache generate, the engine and
budget_map build for a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import score_dtype
from ..config import ModelConfig
from .budget import RowBudget, check_budget_kind, model_budget
from .budgeted_manager import BudgetedKVCacheManager
from .cache_options import CacheOptions, check_cache_options, new_manager
from .paged import AppendedRows, PagedKVCache


@dataclass
class WaitingPairs:
    """Pairs of a budgeted call that reach rows full by then, one pair per row: the i-th such pair of
    every row is in wave i. `attend` places them (the budget's policy decides, as each must see the
    row its predecessors left) and attends, wave after wave."""

    pairs: torch.Tensor  # (w,) indices into the call
    rows: torch.Tensor  # (w,) distinct rows
    positions: torch.Tensor  # (w,)
    scores: torch.Tensor  # (w,) router probabilities
    k: torch.Tensor  # (w, Hkv, Dh) each
    v: torch.Tensor


@dataclass
class BudgetedAppendedRows(AppendedRows):
    """What the budgeted `append_kv` hands to `attend`: the rows of the pairs appended now (as
    AppendedRows), which pairs of the call those are, and the pairs that wait for full rows."""

    pairs: torch.Tensor | None = None  # (f,) indices into the call of the pairs appended now
    waiting: list[WaitingPairs] | None = None  # one wave each


def checked_budget(budget, config: ModelConfig) -> RowBudget:
    """The budget a budgeted cache keeps: `budget`, or the model's own capacity's (model_budget);
    ValueError for another kind, or for None on a model without a capacity."""
    check_budget_kind(budget)
    budget = budget if budget is not None else model_budget(config)
    if budget is None:
        raise ValueError(
            "budget=None is not allowed for a model without attention_capacity; allowed: a RowBudget "
            "(cache/budget.py), or a PagedKVCache for a cache without a budget"
        )
    return budget


class BudgetedPagedKVCache(PagedKVCache):
    """A PagedKVCache whose every (sequence, layer, expert) row keeps at most B tokens, a policy at a
    full row (budget: a RowBudget; None: the model's own capacity's, budget.model_budget). The
    RowBudget given is a setting: the manager keeps a fresh copy of it (RowBudget.fresh), so one
    can build many caches. A budget combines with neither shared tails nor prefix caching
    (factory.py says why). BudgetedPagedKVCache(config, num_blocks, block_size, budget=, **settings)
    and for_model(model, ..., budget=) take the base's settings and the budget."""

    SETTINGS = (*PagedKVCache.SETTINGS, "budget")

    budget = property(lambda self: self.options.budget)  # the setting (the manager keeps a copy)

    @classmethod
    def check_options(
        cls, config, num_blocks=None, block_size=16, max_num_seqs=None, budget=None, **settings
    ) -> CacheOptions:
        """The base's options with the budget, checked for the model, kept in them; its manager's copy
        checked with the others, and a pool sized for max_num_seqs with each row capped at its
        largest B (rows.worst_case_lifetime_blocks)."""
        budget = checked_budget(budget, config)
        budget.check_model(config.num_hidden_layers, config.num_attention_experts)
        return check_cache_options(
            config,
            num_blocks,
            block_size,
            max_num_seqs,
            settings,
            cls.__name__,
            row_cap=budget.largest(config.num_hidden_layers),
            budget=budget,
        )

    def make_manager(self, config: ModelConfig, options: CacheOptions):
        """A manager with its own copy of the budget, its rows no longer than the model's positions."""
        budget = options.budget.fresh(config.max_position_embeddings)
        return new_manager(config, options, BudgetedKVCacheManager, budget=budget)

    # ----- verb 1: bookkeeping and store ----------------------------------------------------------
    def append_kv(self, layer: int, seq_ids, experts, positions, k, v, scores=None) -> BudgetedAppendedRows:
        """The pairs a row has room for are appended now, as without a budget (the same operations,
        so a budget no row reaches changes no bit); the rest wait for `attend`, which places them one
        per row at a time (WaitingPairs). scores (n,): each pair's router probability, which the
        router_score policy reads (ones when left out)."""
        seq_ids, experts, positions = self._check_pairs(seq_ids, experts, positions, k, v)
        n = k.shape[0]
        scores = (
            torch.ones(n, dtype=torch.float64)
            if scores is None
            else torch.as_tensor(scores).cpu().reshape(-1)
        )
        if scores.shape != (n,):
            raise ValueError(f"scores must be (n,) = ({n},); got {tuple(scores.shape)}")
        manager = self.manager
        new_seqs = sorted(set(seq_ids.tolist()).difference(manager.sequences))
        for s in new_seqs:
            manager.add_sequence(s)
        try:
            pair_rows = manager.rows(seq_ids, layer, experts)  # (n,)
            rows, pair_row, num_new = torch.unique(pair_rows, return_inverse=True, return_counts=True)
            order = torch.argsort(pair_rows, stable=True)  # (n,) grouped by row
            first = torch.cumsum(num_new, 0) - num_new  # (m,) into order
            self._check_positions(pair_rows[order], positions[order], rows, first)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel()) - first[pair_row[order]]  # (n,) i-th of its row
            room = manager.budget.limit_of_rows(rows) - manager.row_tokens[rows]  # (m,)
            fits = rank < room[pair_row]  # (n,)
            now = fits.nonzero().squeeze(1)  # (f,) in call order
            fit_rows, fit_pair_row, fit_new = torch.unique(
                pair_rows[now], return_inverse=True, return_counts=True
            )
            old = manager.row_tokens[fit_rows]  # (r,)
            allocation = manager.allocate_slots(fit_rows, fit_new)  # may raise
        except Exception:
            for s in new_seqs:  # as it was
                manager.free(s)
            raise
        pair_index = old[fit_pair_row] + rank[now]  # (f,) index in its row
        manager.budget.record(pair_rows[now], pair_index, positions[now], scores[now])
        last = torch.zeros(fit_rows.numel(), dtype=torch.int64).scatter_reduce_(
            0, fit_pair_row, positions[now], "amax", include_self=False
        )  # (r,)
        manager.note_positions(fit_rows, last)
        slots = torch.empty(now.numel(), dtype=torch.int64)
        slots[torch.argsort(pair_rows[now], stable=True)] = allocation.slot_mapping  # row after row -> pairs
        self._store(k[now], v[now], slots)
        waiting = []
        late = rank - room[pair_row]  # (n,) >= 0: waits
        for wave in range(int(late.max()) + 1 if not bool(fits.all()) else 0):
            pairs = (late == wave).nonzero().squeeze(1)  # (w,) one per row
            waiting.append(
                WaitingPairs(pairs, pair_rows[pairs], positions[pairs], scores[pairs], k[pairs], v[pairs])
            )
        if fit_rows.numel() == now.numel():  # each pair its own row: rows in pair order (a decode)
            fit_rows, fit_new, fit_pair_row = pair_rows[now], torch.ones_like(now), torch.arange(now.numel())
        context_lens = manager.row_tokens[fit_rows]
        return BudgetedAppendedRows(
            fit_rows, fit_new, context_lens, fit_pair_row, pair_index, slots=slots, pairs=now, waiting=waiting
        )

    # ----- verb 2: the math -----------------------------------------------------------------------
    def attend(self, appended: BudgetedAppendedRows, q: torch.Tensor) -> torch.Tensor:
        """The pairs appended by append_kv, then each wave of waiting pairs placed
        (BudgetedKVCacheManager.allocate_within_budget) and attended in turn, each group by the plain
        cache's attend. A refused pair's output stays zero: it adds nothing to its token's gated sum
        (budget.py)."""
        n = appended.pairs.numel() + sum(wave.pairs.numel() for wave in appended.waiting)
        if q.shape[0] != n:
            raise ValueError(f"q has {q.shape[0]} queries for {n} appended pairs")
        out = q.new_zeros(q.shape)  # (n, H, Dh)
        self._attend_group(appended, appended.pairs, q, out)
        for wave in appended.waiting:  # after the last wave's attention: it may overwrite a key
            slots, accepted = self.manager.allocate_within_budget(wave.rows, wave.positions, wave.scores)
            self._store(wave.k[accepted], wave.v[accepted], slots)
            rows = wave.rows[accepted]  # (a,) one pair each
            lens = self.manager.row_tokens[rows]
            # the newcomer sees its whole row: every slot holds an earlier position, or its own
            placed = AppendedRows(rows, torch.ones_like(rows), lens, torch.arange(rows.numel()), lens - 1)
            self._attend_group(placed, wave.pairs[accepted], q, out)
        return out

    def _attend_group(self, appended: AppendedRows, pairs: torch.Tensor, q: torch.Tensor, out) -> None:
        """out[pairs] = attention of those pairs (the plain cache's attend); under heavy_hitter their
        rows' slots also receive the attention probabilities (H2O's accumulated attention)."""
        if not pairs.numel():
            return
        out[pairs] = super().attend(appended, q[pairs])
        if self.manager.budget.policy == "heavy_hitter":
            self.manager.budget.add_attention(appended.rows, self._attention_received(appended, q[pairs]))

    def _attention_received(self, appended: AppendedRows, q: torch.Tensor) -> torch.Tensor:
        """(m, Lmax) the probability each slot of each row received from the call's queries, summed
        over queries and heads. The fused attention does not return its probabilities, so they are
        computed beside it: the outputs stay exactly those of the path without a budget."""
        H, Dh = q.shape[1], q.shape[2]
        compute = score_dtype(q.dtype)
        keys, _, valid = self._gather_rows(
            appended.rows, appended.context_lens, compute
        )  # (m, Lmax, Hkv, Dh)
        keys = keys[appended.pair_row].repeat_interleave(H // keys.shape[2], dim=2)  # (n, Lmax, H, Dh)
        logits = torch.einsum("nhd,nlhd->nhl", q.to(compute), keys) / Dh**0.5  # (n, H, Lmax)
        slot = torch.arange(keys.shape[1], device=keys.device)
        visible = valid[appended.pair_row] & (slot[None, :] <= appended.pair_index[:, None].to(keys.device))
        probs = torch.softmax(logits.masked_fill(~visible[:, None, :], -torch.inf), dim=-1)  # (n, H, Lmax)
        received = torch.zeros(appended.rows.numel(), keys.shape[1], dtype=compute, device=keys.device)
        return received.index_add_(0, appended.pair_row.to(keys.device), probs.sum(1)).cpu()  # (m, Lmax)
