"""A budget per row: each (sequence, layer, expert) row holds at most B tokens, and a policy decides
what leaves when a full row receives another one.

Routing decides how large a per-expert cache grows (the problem this project is about), so a
cache whose memory must be known in advance needs a cap. The cap is per row, B tokens (one B for
every layer, or one per layer); what happens at the cap is a policy:

    drop          the newcomer is refused: a full row takes nothing more, as the capacity of
                  Switch Transformer and GShard drops tokens beyond an expert's capacity
    window        the oldest token leaves, except the row's first `num_sinks` tokens, which stay
                  for good: StreamingLLM's attention sinks plus a window of recent tokens
                  (Xiao et al., arXiv 2309.17453; 4 sinks is their default)
    heavy_hitter  the token that has received the least attention so far leaves, except the
                  newest B // 2, which are kept as a recent window: H2O (Zhang et al., arXiv
                  2306.14048, half heavy hitters and half recent tokens in its experiments)
    router_score  the token with the lowest router probability for the row's expert leaves, the
                  newcomer included (then it is refused): the row keeps the B best-scored tokens
                  so far, Mixture of Sparse Attention's expert choice made causal (arXiv 2505.00315)

Semantics, the same on every path (the paged cache, the budgeted recompute below, the tests' plain
reference): tokens arrive one at a time in position order. A token routed to a row that holds
fewer than B tokens is appended. At a full row the policy picks the victim among the row's tokens
and the newcomer; the newcomer takes the victim's slot, or, if the newcomer is the victim, it is
*refused*: it is treated as not routed to that expert. Its attention output there is zero, so the
token's output is the gated sum over the experts that took it, with the gates the router gave
(not renormalised), and a token every expert refused passes through the layer's residual alone,
as a token over capacity does in Switch. An accepted token's query attends over the row as it is
after its arrival (itself included). Under heavy_hitter each key then adds the attention
probability it received from that query, summed over heads (the heads of a row share its slots;
H2O keeps a set per head). Ties leave the oldest token.

The part owns, per row and slot index i < B (the rows' slot arrays, what the policy reads):

    slot_position  (R, S) int64    position of the token at index i of the row (-1: empty)
    slot_score     (R, S) float64  its router probability (router_score) or the attention it has
                                   received (heavy_hitter); unused by drop and window

S is the largest B over layers, or fewer where fewer is all a row can ever hold: a cache built for a
model (PagedKVCache, the engine) gives its part the model's max_position_embeddings, and a row never
holds more tokens than its sequence has positions, nor more than the pool's blocks hold. A B above
that never binds (a budget at or above the length is the exact cache), so it is kept as given (in
max_tokens, and in what a report shows) but its slot arrays are sized, and its rows limited, to what
can be held: RowBudget(10**6) on a model of 512 positions allocates 512 slots a row, not 10**6. A row
never holds more than B tokens, so never more than
ceil(B / P) blocks; a full row keeps its blocks (one token in, one out), and blocks go back to the
pool when the sequence is freed. With B at or above a row's length nothing ever leaves, and the
cache computes exactly what the exact cache computes, in the same operations.
"""

from __future__ import annotations

import math

import torch

from ..state import Stateful
from ..validation import (
    MAX_INT32,
    a_type,
    check_choice,
    check_fits_memory,
    check_int,
    known_keywords,
    memory_of,
    number,
    shown,
)

BUDGET_POLICIES = ("drop", "window", "heavy_hitter", "router_score")
DEFAULT_SINKS = 4  # StreamingLLM's attention sinks


class RowBudget(Stateful):
    """At most `max_tokens` tokens per row (an int, or one int per layer), `policy` at a full row.

    What a BudgetedKVCacheManager is built with (budgeted_manager.py,
    `BudgetedKVCacheManager(..., budget=RowBudget(64, "window"))`): the manager keeps its block
    tables and counts and asks the budget where a newcomer goes (`choose`); the budget keeps what the
    policies read (`record`, `add_attention`) and nothing else. `attend_with_budget` runs the same rules over a
    whole padded batch, the recompute a budgeted cache must equal, which the model reaches through
    `recompute_attention`.

    num_sinks: the tokens `window` keeps for good, each below every layer's B (at least one slot must
    move), or None: StreamingLLM's 4, or B - 1 where the smallest B is 4 or less. A num_sinks at or
    above a B is refused (a window of no slot would be drop under another name).

    max_row_tokens: set by `fresh` for a cache's own copy: the most tokens one of its rows can hold
    (the model's positions); None: no bound but the pool's (the module's docstring)."""

    STATE = ("slot_position", "slot_score", "num_refused", "num_evicted")

    @known_keywords
    def __init__(self, max_tokens, policy: str = "window", num_sinks: int | None = None):
        self.policy = check_choice("policy", policy, BUDGET_POLICIES)
        if isinstance(max_tokens, (list, tuple)):
            if not max_tokens:
                raise ValueError("max_tokens=[] is not allowed: give one int, or one per layer")
            self.max_tokens = tuple(
                check_int(f"max_tokens[{i}]", b, 1, MAX_INT32, "tokens a row keeps")
                for i, b in enumerate(max_tokens)
            )
        else:
            self.max_tokens = check_int("max_tokens", max_tokens, 1, MAX_INT32, "tokens a row keeps")
        smallest = min(self.max_tokens) if isinstance(self.max_tokens, tuple) else self.max_tokens
        if num_sinks is None:
            self.num_sinks = min(DEFAULT_SINKS, smallest - 1)
        elif policy == "window":
            self.num_sinks = check_int(
                "num_sinks",
                num_sinks,
                0,
                smallest - 1,
                f"window keeps them for good; below max_tokens={shown(max_tokens)}, so that a slot moves",
            )
        else:
            self.num_sinks = check_int("num_sinks", num_sinks, 0, MAX_INT32, "read by policy='window' only")
        self.max_row_tokens = None
        self.manager = None
        self.num_refused = 0  # pairs refused at a full row (drop, router_score)
        self.num_evicted = 0  # tokens that left a row for a newcomer

    def fresh(self, max_row_tokens: int | None = None) -> "RowBudget":
        """The same settings with no rows: what a cache is built with, so that one RowBudget can be
        handed to many caches (each keeps its own rows). max_row_tokens: the most tokens a row of that
        cache can hold (its model's max_position_embeddings), to which a larger B is lowered."""
        copy = RowBudget(self.max_tokens, self.policy, self.num_sinks)
        copy.max_row_tokens = max_row_tokens
        return copy

    def __repr__(self) -> str:
        return (
            f"RowBudget(max_tokens={self.max_tokens!r}, policy={self.policy!r}, num_sinks={self.num_sinks})"
        )

    def limits(self, num_layers: int) -> torch.Tensor:
        """(L,) int64 B of each layer; ValueError when a per-layer list has another length."""
        if isinstance(self.max_tokens, int):
            return torch.full((num_layers,), self.max_tokens, dtype=torch.int64)
        if len(self.max_tokens) != num_layers:
            raise ValueError(
                f"max_tokens has {len(self.max_tokens)} entries; the model has {num_layers} "
                "layers: give one int, or one per layer"
            )
        return torch.tensor(self.max_tokens, dtype=torch.int64)

    def largest(self, num_layers: int) -> int:
        """The largest B over the layers: what bounds any row (the scheduler's worst cases cap rows at it)."""
        return int(self.limits(num_layers).max())

    def limit_of_layer(self, layer: int) -> int:
        """B of one layer (the model checked the per-layer list's length: check_model)."""
        return self.max_tokens if isinstance(self.max_tokens, int) else self.max_tokens[layer]

    def check_model(self, num_layers: int, num_experts: int) -> None:
        """ValueError for a budget the model cannot have: a per-layer list of the wrong length, or
        router_score with one attention expert (its router probability is 1 for every token, so
        the policy would be drop under another name)."""
        self.limits(num_layers)
        if self.policy == "router_score" and num_experts == 1:
            raise ValueError(
                "policy='router_score' needs routed attention: with one attention expert "
                "every token's router probability is 1; use 'drop' for a capacity"
            )

    # ----- its life in a manager -----------------------------------------------------------------
    def slots_of_rows(self, num_blocks: int, block_size: int, num_layers: int) -> int:
        """S: the largest B, lowered to the most tokens a row can hold (max_row_tokens, and the
        pool's num_blocks * block_size slots)."""
        held = num_blocks * block_size
        if self.max_row_tokens is not None:
            held = min(held, self.max_row_tokens)
        return min(self.largest(num_layers), held)

    def bytes_needed(self, num_rows: int, num_blocks: int, block_size: int, num_layers: int) -> int:
        """slot_position and slot_score: 16 bytes a slot. ValueError, naming this budget, where
        they alone would not fit this machine's memory."""
        slots = self.slots_of_rows(num_blocks, block_size, num_layers)
        needed = 16 * num_rows * slots
        fits = max(1, (memory_of("cpu") or needed) // (16 * num_rows))
        check_fits_memory(
            f"the slot arrays of {self!r}, {number(slots)} slots for each of {num_rows:,} rows "
            f"(16 bytes a slot; a row holds at most {number(slots)} tokens of a pool of {num_blocks:,} "
            f"blocks of {block_size})",
            needed,
            "cpu",
            f"max_tokens at most {number(min(fits, MAX_INT32))} here, or a smaller pool",
        )
        return needed

    def attach(self, manager) -> None:
        """The manager checked this budget (check_model) and that no other manager has it."""
        self.manager = manager
        self.num_slots = self.slots_of_rows(manager.num_blocks, manager.block_size, manager.num_layers)  # S
        # rows limited to the positions a row can have, which changes no decision (no row reaches
        # them); the pool's bound sizes the slots only: a row that fills the pool runs out of blocks
        # before it could need another slot
        self.layer_limits = self.limits(manager.num_layers)  # (L,)
        if self.max_row_tokens is not None:
            self.layer_limits = self.layer_limits.clamp(max=self.max_row_tokens)
        num_rows = manager.row_tokens.numel()
        self.slot_position = torch.full((num_rows, self.num_slots), -1, dtype=torch.int64)  # (R, S)
        self.slot_score = torch.zeros(num_rows, self.num_slots, dtype=torch.float64)  # (R, S)

    def limit_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(m,) B of each row (its layer's)."""
        _, layer, _ = self.manager.index.split(rows)
        return self.layer_limits[layer]

    @torch.inference_mode(False)  # kept across steps: never inference tensors
    def grow_rows(self, num_rows: int) -> None:
        extra = num_rows - self.slot_position.shape[0]
        self.slot_position = torch.cat(
            [self.slot_position, torch.full((extra, self.num_slots), -1, dtype=torch.int64)]
        )
        self.slot_score = torch.cat(
            [self.slot_score, torch.zeros(extra, self.num_slots, dtype=torch.float64)]
        )

    def clear_rows(self, rows) -> None:
        self.slot_position[rows] = -1
        self.slot_score[rows] = 0.0

    # ----- the policy ---------------------------------------------------------------------------
    def choose(self, rows: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(m,) the slot index each newcomer takes in its distinct row, -1 where it is refused."""
        return choose_slots(
            self.policy,
            self.num_sinks,
            self.limit_of_rows(rows),
            self.manager.row_tokens[rows],
            self.slot_position[rows],
            self.slot_score[rows],
            positions,
            scores,
        )

    def record(
        self, rows: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor
    ) -> None:
        """Newcomers placed as `choose` said: at slot index[i] of rows[i], or refused (-1). Keeps
        their positions and scores, and counts the refused and the evicted."""
        accepted = index >= 0
        self.num_refused += int((~accepted).sum())
        rows, index = rows[accepted], index[accepted]
        self.num_evicted += int((self.slot_position[rows, index] >= 0).sum())
        self.slot_position[rows, index] = positions[accepted]
        self.slot_score[rows, index] = initial_scores(self.policy, scores[accepted])

    def add_attention(self, rows: torch.Tensor, weights: torch.Tensor) -> None:
        """heavy_hitter: weights (m, w) the attention the first w slots of each row just received
        (w may run past the slots into a block's padding, which received none)."""
        width = min(weights.shape[1], self.num_slots)
        self.slot_score[rows, :width] += weights[:, :width].to(torch.float64)

    def rows_state(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, scores) of these rows' slots, copies: what a swapped-out sequence keeps."""
        return self.slot_position[rows].clone(), self.slot_score[rows].clone()

    def restore_rows(self, rows: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put back what rows_state saved, for rows the manager refilled with the same counts."""
        self.slot_position[rows], self.slot_score[rows] = state

    # ----- the recompute ---------------------------------------------------------------------------
    def recompute_attention(self, q, k, v, selected, scores, layer: int):
        """What `model(tokens, budget=self)` calls at each layer (model.RowRule): this budget's
        rule over the whole padded batch, attend_with_budget."""
        return attend_with_budget(q, k, v, selected, scores, self, layer)

    def kept_positions(self, rows) -> list[list[int]]:
        """The positions each row keeps, ascending (what the notebooks draw)."""
        return [sorted(p for p in self.slot_position[int(r)].tolist() if p >= 0) for r in rows]

    def assert_consistent(self) -> None:
        manager = self.manager
        limits = self.limit_of_rows(torch.arange(manager.row_tokens.numel()))
        assert (manager.row_tokens <= limits).all(), "a row holds more tokens than its budget"
        # a row of n tokens fills exactly its slots 0 .. n - 1 (a row below its budget never lost one)
        filled = torch.arange(self.num_slots)[None, :] < manager.row_tokens[:, None]  # (R, S)
        assert torch.equal(self.slot_position >= 0, filled), "a row's slot positions do not match its count"


def check_budget_kind(budget) -> None:
    """A budget setting is a RowBudget, or None: ValueError naming the value otherwise."""
    if budget is not None and not isinstance(budget, RowBudget):
        raise ValueError(
            f"budget={shown(budget)} is {a_type(budget)}; allowed: a RowBudget (cache/budget.py), or None"
        )


def model_budget(config) -> RowBudget | None:
    """The budget a model's own capacity implies for its caches (config.attention_capacity): under
    expert choice the causal version of its training rule, router_score; under token choice the
    same rule, drop. None without a capacity."""
    if not config.attention_capacity:
        return None
    policy = "router_score" if config.attention_routing == "expert_choice" else "drop"
    return RowBudget(config.attention_capacity, policy)


def initial_scores(policy: str, router_scores: torch.Tensor) -> torch.Tensor:
    """A newcomer's score: its router probability (router_score), else zero (heavy_hitter adds the
    attention it receives, starting with its own query's)."""
    if policy == "router_score":
        return router_scores.to(torch.float64)
    return torch.zeros(router_scores.shape, dtype=torch.float64)


# Scores closer than this are tied. The same router probability computed in a batch of another shape
# (a prefill, a decode step, the recompute) can differ in its last bits, and at the first layer, whose
# router sees only the token, equal tokens have equal scores: an exact comparison would let those bits
# decide which token stays, and the paths would disagree.
SCORE_TIE = 1e-6


def _oldest_lowest(score: torch.Tensor, position: torch.Tensor, candidate: torch.Tensor):
    """Per row (m,) the candidate slot of lowest score, the oldest (lowest position) among the tied,
    and (m,) that lowest score."""
    lowest = torch.where(candidate, score, math.inf).amin(1)  # (m,)
    tied = candidate & (score <= lowest[:, None] + SCORE_TIE)  # (m, S)
    return torch.where(tied, position, torch.iinfo(torch.int64).max).argmin(1), lowest  # (m,) each


def choose_slots(
    policy: str,
    num_sinks: int,
    limit: torch.Tensor,
    count: torch.Tensor,
    slot_position: torch.Tensor,
    slot_score: torch.Tensor,
    position: torch.Tensor,
    score: torch.Tensor,
) -> torch.Tensor:
    """Where each newcomer goes in its row, for m distinct rows: the index of the slot it takes, or
    -1 where it is refused. limit, count (m,) B and tokens held; slot_position, slot_score (m, S)
    the rows' slots (-1: empty); position, score (m,) the newcomers'. A row below its limit appends."""
    m, S = slot_position.shape
    index = count.clone()  # (m,) append
    full = count >= limit
    if not bool(full.any()):
        return index
    slot = torch.arange(S)[None, :]  # (1, S)
    kept = slot < limit[:, None]  # (m, S) a full row's slots
    if policy == "drop":
        victim = torch.full((m,), -1, dtype=torch.int64)
    elif policy == "window":
        sinks = torch.clamp(limit - 1, max=num_sinks)  # (m,) at least 1 slot moves
        victim, _ = _oldest_lowest(
            slot_position.to(torch.float64), slot_position, kept & (slot >= sinks[:, None])
        )
    elif policy == "heavy_hitter":
        newer = (slot_position[:, None, :] > slot_position[:, :, None]) & kept[
            :, None, :
        ]  # (m, S, S) j newer than i
        recent = newer.sum(2) < (limit // 2)[:, None]  # (m, S) among the newest B // 2
        victim, _ = _oldest_lowest(slot_score, slot_position, kept & ~recent)
    else:  # router_score
        victim, lowest = _oldest_lowest(slot_score, slot_position, kept)
        victim = torch.where(score.to(torch.float64) > lowest + SCORE_TIE, victim, -1)  # ties: refused
    return torch.where(full, victim, index)


def attend_with_budget(q, k, v, selected, scores, budget: RowBudget, layer: int):
    """The budgeted recompute of one layer: every row's tokens one at a time, over the whole padded batch.

    q (B, E, H, T, Dh) and k, v (B, E, H, T, Dh) (keys and values repeated to every query head),
    rotated; selected, scores (B, T, E) the routing and the router probabilities. Each (b, e) is a
    row with slot arrays like the part's, and token t, if routed there, is placed by `choose_slots`
    and attends over the row's slots. Returns attention (B, E, H, T, Dh), zero where a token was
    not routed or was refused, and accepted (B, T, E). Its cost is T small steps per layer: a
    reference, not a training path."""
    B, E, H, T, Dh = q.shape
    limit = min(budget.limit_of_layer(layer), T)  # a row of T tokens never fills more than T slots
    rows = B * E
    slot_token = torch.full((rows, limit), -1, dtype=torch.int64)  # (R, S) token index
    slot_score = torch.zeros(rows, limit, dtype=torch.float64)
    count = torch.zeros(rows, dtype=torch.int64)
    q, k, v = (t.reshape(rows, H, T, Dh) for t in (q, k, v))  # (R, H, T, Dh)
    routed = selected.permute(0, 2, 1).reshape(rows, T)  # (R, T)
    router_score = scores.permute(0, 2, 1).reshape(rows, T)
    out = torch.zeros_like(q)
    accepted = torch.zeros(rows, T, dtype=torch.bool)
    for t in range(T):
        here = routed[:, t].nonzero().squeeze(1)  # (m,) rows t goes to
        index = choose_slots(
            budget.policy,
            budget.num_sinks,
            torch.full_like(here, limit),
            count[here],
            slot_token[here],
            slot_score[here],
            torch.full_like(here, t),
            router_score[here, t],
        )
        here, index = here[index >= 0], index[index >= 0]  # accepted ones
        slot_token[here, index] = t
        slot_score[here, index] = initial_scores(budget.policy, router_score[here, t])
        count[here] = torch.clamp(count[here] + 1, max=limit)
        accepted[here, t] = True
        keys_at = slot_token[here].clamp(min=0)  # (a, S)
        gather = keys_at[:, None, :, None].expand(-1, H, -1, Dh)  # (a, H, S, Dh)
        keys, values = k[here].gather(2, gather), v[here].gather(2, gather)  # (a, H, S, Dh)
        logits = torch.einsum("ahd,ahsd->ahs", q[here, :, t], keys) / math.sqrt(Dh)  # (a, H, S)
        logits = logits.masked_fill((slot_token[here] < 0)[:, None, :], -math.inf)
        probs = torch.softmax(
            logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1
        )
        out[here, :, t] = torch.einsum("ahs,ahsd->ahd", probs.to(values.dtype), values)
        if budget.policy == "heavy_hitter":
            slot_score[here] += probs.sum(1).to(torch.float64)
    return out.reshape(B, E, H, T, Dh), accepted.reshape(B, E, T).permute(0, 2, 1)
