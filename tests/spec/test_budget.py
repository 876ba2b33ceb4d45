"""Row budgets (moekv_ref/cache/budget.py): at most B tokens in each (sequence, layer, expert) row.

Equivalence: a budget at or above every row's length is the exact cache, bit for bit; under a binding
budget the paged cache, the budgeted recompute (`model(tokens, budget=...)`) and a plain per-row
reference written below in a few lines of Python keep the same tokens and give the same logits, on
random models and prompts, for every policy, dense and routed. Safety: no row ever holds more than B
tokens (property test); K/V of an evicted token, poisoned with NaN the moment it leaves, never reach
an output; the manager stays consistent after every step, with preemption; combinations that cannot
work are refused with their reason. Scenarios: exact kept positions and slots.
"""

import math

import pytest
import torch
from helpers import prefill_then_decode, random_model, random_prompts, small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from moekv_ref.attention import attend_by_position
from moekv_ref.cache import BudgetedPagedKVCache, make_paged_cache
from moekv_ref.cache.budget import BUDGET_POLICIES, SCORE_TIE, RowBudget
from moekv_ref.cache.budgeted_manager import BudgetedKVCacheManager
from moekv_ref.engine import LLMEngine, SchedulerConfig
from moekv_ref.generate import generate
from moekv_ref.plots.memory import block_owners
from moekv_ref.sampling import SamplingParams

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
CASES = [
    (mode, policy)
    for mode in ("expert", "dense")
    for policy in BUDGET_POLICIES
    if not (mode == "dense" and policy == "router_score")
]


# ----- the plain reference: one Python list per row, tokens one at a time ----------------------------
class PlainBudgetCache:
    """The cache contract (cache/__init__.py) for calls of at most one pair per row (a token-by-token
    decode), with budget.py's rules written as plainly as they read."""

    def __init__(self, budget: RowBudget, num_layers: int):
        self.limits, self.policy, self.sinks = (
            budget.limits(num_layers).tolist(),
            budget.policy,
            budget.num_sinks,
        )
        self.rows = {}  # (seq, layer, expert) -> list of dicts: position, score, k, v, received

    def append_kv(self, layer, seq_ids, experts, positions, k, v, scores=None):
        placed = []
        for i, (s, e, p) in enumerate(zip(seq_ids.tolist(), experts.tolist(), positions.tolist())):
            row = self.rows.setdefault((s, layer, e), [])
            score = 1.0 if scores is None else float(scores[i])
            new = dict(position=p, score=score, k=k[i], v=v[i], received=0.0)
            B = self.limits[layer]
            if len(row) == B:
                if self.policy == "drop":
                    placed.append(None)
                    continue
                if self.policy == "window":
                    victim = min(self.sinks, B - 1)  # the list stays in arrival order
                elif self.policy == "heavy_hitter":
                    older = sorted(range(B), key=lambda j: row[j]["position"])[: B - B // 2]
                    victim = self._lowest(row, older, "received")
                else:
                    victim = self._lowest(row, range(B), "score")
                    if not score > row[victim]["score"] + SCORE_TIE:
                        placed.append(None)
                        continue
                del row[victim]
            row.append(new)
            placed.append(row)
        return placed

    @staticmethod
    def _lowest(row, candidates, key):
        """The candidate of lowest score, the oldest among those within SCORE_TIE of it."""
        lowest = min(row[j][key] for j in candidates)
        return min(
            (j for j in candidates if row[j][key] <= lowest + SCORE_TIE), key=lambda j: row[j]["position"]
        )

    def attend(self, placed, q):
        out = torch.zeros_like(q)
        for i, row in enumerate(placed):
            if row is None:
                continue  # refused: adds nothing
            keys = torch.stack([t["k"] for t in row])
            values = torch.stack([t["v"] for t in row])
            every = torch.arange(len(row))
            out[i] = attend_by_position(q[i : i + 1], keys, values, torch.tensor([len(row)]), every)[0]
            if self.policy == "heavy_hitter":
                keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # (n, H, Dh)
                probs = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) / math.sqrt(q.shape[2]), -1)
                for t, p in zip(row, probs.sum(0).tolist()):
                    t["received"] += p
        return out

    def kept_positions(self, seq, layer, expert):
        return sorted(t["position"] for t in self.rows.get((seq, layer, expert), []))


def _decode_one_at_a_time(model, cache, sequences):
    """Logits (B, T, V) of feeding every sequence token by token, all sequences in each step."""
    logits = []
    seq_ids = torch.arange(len(sequences))
    for t in range(sequences.shape[1]):
        positions = torch.full((len(sequences),), t)
        logits.append(model.forward_cached(sequences[:, t], seq_ids, positions, cache).logits)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("mode,policy", CASES)
@pytest.mark.parametrize("max_tokens", [1, 3, [2, 5]])
def test_each_policy_equals_the_plain_reference_and_the_recompute(mode, policy, max_tokens):
    """Binding budgets: the paged cache (prefill chunk + decode, blocks of 2, attention "batched" and
    "reference"), the budgeted recompute and the plain per-row reference keep the same positions in
    every row and give the same logits (float64, 1e-10)."""
    model = random_model(small_config(mode), seed=3)
    sequences = torch.tensor(random_prompts([24, 24, 24], model.config.vocab_size, seed=7))
    budget = RowBudget(max_tokens, policy, num_sinks=0 if max_tokens == 1 else 1)  # a sink below B
    with torch.inference_mode():
        plain = PlainBudgetCache(budget, model.config.num_hidden_layers)
        reference = _decode_one_at_a_time(model, plain, sequences)
        recompute = model(sequences, budget=budget).logits
        for attention in ("batched", "reference"):
            paged = BudgetedPagedKVCache.for_model(
                model, block_size=2, attention=attention, budget=budget, shuffle_seed=1
            )
            logits = prefill_then_decode(model, paged, sequences, prefill=9)
            assert (logits - reference).abs().max() <= TOLERANCE[torch.float64]
            manager = paged.manager
            for s in range(len(sequences)):
                for layer in range(model.config.num_hidden_layers):
                    rows = manager.rows([s] * manager.num_experts, layer, list(range(manager.num_experts)))
                    assert manager.budget.kept_positions(rows) == [
                        plain.kept_positions(s, layer, e) for e in range(manager.num_experts)
                    ]
    assert (recompute - reference).abs().max() <= TOLERANCE[torch.float64]
    assert manager.budget.num_evicted + manager.budget.num_refused > 0  # the budget did bind


@pytest.mark.parametrize("mode,policy", CASES)
def test_a_budget_at_or_above_the_length_is_the_exact_cache_bit_for_bit(mode, policy):
    """generate with a budget no row can reach gives the tokens and logits of the cache without one,
    torch.equal, float32: the same operations run."""
    model = random_model(small_config(mode), seed=2, dtype=torch.float32)
    prompts = random_prompts([13, 5, 20], model.config.vocab_size, seed=4)
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i) for i, n in enumerate([9, 14, 6])]
    exact = generate(model, prompts, params, cache="paged", block_size=4, record_logits=True)
    longest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params))
    for attention in ("batched", "reference"):
        budgeted = generate(
            model,
            prompts,
            params,
            cache="paged",
            block_size=4,
            record_logits=True,
            attention=attention,
            budget=RowBudget(longest, policy),
        )
        if attention == "batched":
            assert budgeted.tokens == exact.tokens
            assert all(torch.equal(a, b) for a, b in zip(budgeted.logits, exact.logits))
        assert torch.equal(budgeted.cache_counts, exact.cache_counts)


@pytest.mark.parametrize("policy", BUDGET_POLICIES)
def test_an_evicted_token_s_kv_never_reaches_an_output(policy, monkeypatch):
    """The moment a token leaves its row its slot is filled with NaN (before the newcomer is written),
    and every slot that holds no kept token is NaN after every step: the logits stay finite and equal
    to the run without poison. (Skipping the newcomer's store makes this test fail: a row would read
    its victim's NaN.)"""
    model = random_model(small_config("expert"), seed=5, dtype=torch.float32)
    sequences = torch.tensor(random_prompts([40, 40], model.config.vocab_size, seed=8))
    budget = RowBudget(3, policy, num_sinks=1)
    with torch.inference_mode():
        clean = prefill_then_decode(
            model, BudgetedPagedKVCache.for_model(model, block_size=2, budget=budget), sequences, prefill=11
        )
    cache = BudgetedPagedKVCache.for_model(model, block_size=2, budget=budget)
    allocate = cache.manager.allocate_within_budget

    def poisoning(rows, positions, scores):
        slots, accepted = allocate(rows, positions, scores)
        for pool in (cache.key_cache, cache.value_cache):
            pool.view(-1, *pool.shape[2:])[slots] = math.nan  # the victims' K/V, now gone
        return slots, accepted

    monkeypatch.setattr(cache.manager, "allocate_within_budget", poisoning)
    forward = model.forward_cached

    def poison_unheld(*args):
        owner, used = block_owners(cache.manager)
        for pool in (cache.key_cache, cache.value_cache):
            pool[owner < 0] = math.nan  # free blocks
            for block in (used < cache.block_size).nonzero().squeeze(1).tolist():
                pool[block, int(used[block]) :] = math.nan  # past a row's last token
        return forward(*args)

    monkeypatch.setattr(model, "forward_cached", poison_unheld)
    with torch.inference_mode():
        poisoned = prefill_then_decode(model, cache, sequences, prefill=11)
    assert cache.manager.budget.num_evicted + cache.manager.budget.num_refused > 0
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(BUDGET_POLICIES),
    limits=st.lists(st.integers(1, 6), min_size=2, max_size=2),
    block_size=st.sampled_from([1, 2, 4]),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_no_row_ever_holds_more_than_its_budget(policy, limits, block_size, chunks, seed):
    """Random chunks of random routing through BudgetedPagedKVCache: after every call every row holds at most
    its layer's B tokens in at most ceil(B / P) blocks, and the manager's invariants hold."""
    config = small_config("expert")
    cache = BudgetedPagedKVCache(
        config,
        num_blocks=400,
        block_size=block_size,
        budget=RowBudget(limits, policy, num_sinks=min(1, min(limits) - 1)),
    )
    manager = cache.manager
    generator = torch.Generator().manual_seed(seed)
    E, Hkv, H, Dh = (
        config.num_attention_experts,
        config.num_key_value_heads,
        config.num_attention_heads,
        config.head_dim,
    )
    start = [0, 0]
    for n in chunks:
        for seq in (0, 1):
            positions = torch.arange(start[seq], start[seq] + n)
            start[seq] += n
            for layer in range(2):
                experts = torch.randint(0, E, (n,), generator=generator)
                k, v, q = (torch.randn(n, h, Dh, generator=generator) for h in (Hkv, Hkv, H))
                scores = torch.rand(n, generator=generator)
                cache.attend(
                    cache.append_kv(layer, torch.full((n,), seq), experts, positions, k, v, scores), q
                )
        manager.assert_consistent()
        limit = torch.tensor(limits).repeat_interleave(E).repeat(manager.row_tokens.numel() // (2 * E))
        assert (manager.row_tokens <= limit).all()
        owner, _ = block_owners(manager)
        held = torch.bincount(owner[owner >= 0], minlength=manager.row_tokens.numel())
        assert (held <= (limit + block_size - 1) // block_size).all()


@pytest.mark.parametrize("policy", BUDGET_POLICIES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_engine_under_preemption_serves_what_each_request_gets_alone(policy, mode):
    """A pool too small for the batch: requests are preempted (by recompute, or by swap, which keeps the
    rows' policy state with their blocks) and resumed, the manager stays consistent after every step,
    and every request gets the tokens it gets alone under the same budget."""
    model = random_model(small_config("expert"), seed=6, dtype=torch.float32)
    prompts = random_prompts([3, 5, 2, 4, 6, 3], model.config.vocab_size, seed=9)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    budget = RowBudget(6, policy, num_sinks=1)
    alone = [
        generate(model, [p], [q], cache="paged", block_size=2, budget=budget).tokens[0]
        for p, q in zip(prompts, params)
    ]
    engine = LLMEngine(
        model,
        num_blocks=80,
        block_size=2,
        budget=budget,
        scheduler_config=SchedulerConfig(admission="optimistic", preemption_mode=mode),
    )
    for prompt, param in zip(prompts, params):
        engine.add_request(prompt, param)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
        engine.cache.manager.assert_consistent()
    assert engine.stats().num_preemptions > 0
    assert (engine.stats().num_swapped_out_blocks > 0) == (mode == "swap")
    assert [outputs[i] for i in sorted(outputs)] == alone


class InjectedFault(RuntimeError):
    pass


@pytest.mark.parametrize(
    "site,policy",
    [
        ("allocate_within_budget", "router_score"),
        ("allocate_within_budget", "window"),
        ("add_attention", "heavy_hitter"),
    ],
)
@pytest.mark.parametrize("at_call", [1, 3, 9])
def test_a_fault_inside_a_budgeted_wave_is_undone_whole(site, policy, at_call, monkeypatch):
    """A budgeted prefill places its waiting tokens inside attend; a fault at the at_call-th placement
    (or heavy_hitter's attention record) raises out of the step, which is undone whole: stepping on,
    every request gets its tokens alone, and no block leaks."""
    model = random_model(small_config("expert"), seed=6, dtype=torch.float32)
    prompts = random_prompts([12, 5, 9], model.config.vocab_size, seed=4)
    params = [SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(3)]
    budget = RowBudget(3, policy, num_sinks=1)
    alone = [
        generate(model, [p], [q], cache="paged", block_size=2, budget=budget).tokens[0]
        for p, q in zip(prompts, params)
    ]
    engine = LLMEngine(model, num_blocks=80, block_size=2, budget=budget)
    owner = engine.cache.manager if site == "allocate_within_budget" else engine.cache.manager.budget
    calls = [0]
    original = getattr(type(owner), site)

    def faulty(self, *args):
        calls[0] += 1
        if calls[0] == at_call:
            raise InjectedFault(f"{site} call {at_call}")
        return original(self, *args)

    monkeypatch.setattr(type(owner), site, faulty)
    for prompt, param in zip(prompts, params):
        engine.add_request(prompt, param)
    outputs, faults = {}, 0
    while engine.has_unfinished_requests():
        try:
            for output in engine.step():
                outputs[output.request_id] = output.token_ids
        except InjectedFault:
            faults += 1
        engine.cache.manager.assert_consistent()
    assert faults == 1 and engine.stats().num_failed_steps == 1
    assert [outputs[i] for i in sorted(outputs)] == alone
    engine.memory.assert_no_leak()


def test_combinations_that_cannot_work_are_refused_with_their_reason():
    model = random_model(small_config("dense"), seed=1)
    with pytest.raises(ValueError, match="neither shared tails nor prefix caching"):
        make_paged_cache(model, budget=RowBudget(4), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="neither shared tails nor prefix caching"):
        make_paged_cache(model, budget=RowBudget(4), shared_tails=True)
    with pytest.raises(
        ValueError, match="unknown keyword shared_tails=True for BudgetedPagedKVCache.for_model"
    ):
        BudgetedPagedKVCache.for_model(model, budget=RowBudget(4), shared_tails=True)
    with pytest.raises(ValueError, match="router_score' needs routed attention"):
        BudgetedPagedKVCache.for_model(model, budget=RowBudget(4, "router_score"))
    with pytest.raises(ValueError, match="router_score' needs routed attention"):
        model(torch.zeros(1, 3, dtype=torch.int64), budget=RowBudget(4, "router_score"))
    with pytest.raises(ValueError, match="one per layer"):
        BudgetedPagedKVCache.for_model(model, budget=RowBudget([4, 4, 4]))
    with pytest.raises(ValueError, match="budget=4 is an int; allowed: a RowBudget"):
        BudgetedPagedKVCache.for_model(model, budget=4)
    for bad, match in (
        ((0,), "max_tokens=0"),
        ((2.5,), "max_tokens=2.5"),
        (([],), r"max_tokens=\[\]"),
        (([3, True],), r"max_tokens\[1\]=True"),
        ((4, "lru"), "policy='lru'"),
        ((4, "window", -1), "num_sinks=-1"),
    ):
        with pytest.raises(ValueError, match=match):
            RowBudget(*bad)


# ----- scenarios: exact positions and slots -----------------------------------------------------------
def _feed(manager, row, positions, scores=None):
    """Tokens one at a time into one row of a manager with a budget; the slot each took (or None)."""
    taken = []
    for i, p in enumerate(positions):
        score = torch.tensor([0.5 if scores is None else scores[i]], dtype=torch.float64)
        slots, accepted = manager.allocate_within_budget(torch.tensor([row]), torch.tensor([p]), score)
        taken.append(int(slots[0]) if bool(accepted[0]) else None)
    return taken


def _manager(policy, max_tokens=4, **options):
    manager = BudgetedKVCacheManager(
        1, 2, block_size=2, num_blocks=8, budget=RowBudget(max_tokens, policy, **options)
    )
    manager.add_sequence(0)
    return manager, int(manager.rows([0], 0, 0)[0])


def test_window_keeps_its_sink_and_the_newest_tokens_in_place():
    """B = 4, one sink, blocks of 2: tokens 0-3 fill blocks 0 and 1; token 4 takes the slot of token 1
    (the oldest that is not a sink), token 5 that of token 2, and so on round the window."""
    manager, row = _manager("window", num_sinks=1)
    assert _feed(manager, row, range(8)) == [0, 1, 2, 3, 1, 2, 3, 1]
    assert manager.budget.kept_positions([row]) == [[0, 5, 6, 7]]
    assert manager.blocks_of_sequence(0).tolist() == [0, 1] and manager.num_free_blocks == 6
    manager.assert_consistent()


def test_drop_refuses_every_token_after_the_first_b():
    manager, row = _manager("drop", max_tokens=3)
    assert _feed(manager, row, range(6)) == [0, 1, 2, None, None, None]
    assert manager.budget.kept_positions([row]) == [[0, 1, 2]] and manager.budget.num_refused == 3


def test_router_score_keeps_the_best_scores_so_far_and_refuses_ties():
    """Scores 0.3 0.9 0.5 0.2 0.6 0.5: 0.2 is refused, 0.6 replaces 0.3, the second 0.5 ties the
    lowest kept (the first 0.5) and is refused."""
    manager, row = _manager("router_score", max_tokens=3)
    scores = [0.3, 0.9, 0.5, 0.2, 0.6, 0.5]
    assert _feed(manager, row, range(6), scores) == [0, 1, 2, None, 0, None]
    assert manager.budget.kept_positions([row]) == [[1, 2, 4]]


def test_heavy_hitter_keeps_the_most_attended_and_the_newest_half():
    """B = 4: the newest 2 kept tokens are protected; of the others, the one that has received the
    least attention leaves, and the newcomer takes its slot."""
    manager, row = _manager("heavy_hitter")
    _feed(manager, row, range(4))
    manager.budget.add_attention(torch.tensor([row]), torch.tensor([[0.1, 0.7, 0.9, 0.05]]))
    assert _feed(manager, row, [4]) == [0]  # token 0 (0.1) leaves; 3 (0.05) is recent
    assert manager.budget.kept_positions([row]) == [[1, 2, 3, 4]]
    assert _feed(manager, row, [5]) == [1]  # newest 4 and 3; token 1 (0.7 < 0.9) leaves
    assert manager.budget.kept_positions([row]) == [[2, 3, 4, 5]]


@pytest.mark.parametrize("policy", BUDGET_POLICIES)
def test_a_budgeted_manager_counts_the_blocks_an_append_takes_up_to_each_rows_budget(policy):
    """blocks_needed_per_device (what can_allocate asks) equals the blocks allocate_within_budget
    then takes, on random one-token appends to rows of per-layer budgets: a full row keeps its
    blocks (its newcomer replaces a token, or is refused), so it needs none however many tokens
    arrive."""
    generator = torch.Generator().manual_seed(len(policy))
    manager = BudgetedKVCacheManager(
        2, 4, 4, blocks_per_device=[60, 60], device_of_expert=[0, 1, 1, 0], budget=RowBudget([5, 8], policy)
    )
    for seq in range(3):
        manager.add_sequence(seq)
    full_rows_seen = 0
    for step in range(60):
        layer = step % 2
        rows = manager.rows([0, 1, 2], layer, torch.randint(0, 4, (3,), generator=generator))
        positions = manager.last_position[rows] + 1
        scores = torch.rand(3, generator=generator, dtype=torch.float64)
        limits = torch.tensor([5, 8])[layer]
        full_rows_seen += int((manager.row_tokens[rows] == limits).sum())
        needed = manager.blocks_needed_per_device(rows, torch.ones(3, dtype=torch.int64))  # (D,)
        free = manager.num_free_blocks_per_device
        manager.allocate_within_budget(rows, positions, scores)
        assert torch.equal(free - manager.num_free_blocks_per_device, needed)
        assert manager.can_allocate(rows, torch.full((3,), 10))  # past the budget: the budget's blocks
        manager.assert_consistent()
    assert full_rows_seen > 0  # the budget bound
