"""The row budget lives beside the plain paged cache, not inside it, and the model imports no cache:
PagedKVCache holds the plain path only, BudgetedPagedKVCache (cache/budget_paged.py) overrides its
two verbs, make_paged_cache is the one place that picks between them, and `model(tokens, budget=...)`
reaches the budgeted recompute through the budget's own method. The equivalences themselves are
tests/spec/test_budget.py's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from helpers import prefill_then_decode, random_model, random_prompts, small_config

from moekv_ref.cache import BudgetedPagedKVCache, PagedKVCache, make_paged_cache
from moekv_ref.cache.budget import RowBudget, model_budget
from moekv_ref.cache.budgeted_manager import BudgetedKVCacheManager
from moekv_ref.model import RowRule

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, relative ones with their leading dots."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_the_model_imports_nothing_from_the_caches():
    imported = _imported_modules(ROOT / "moekv_ref" / "model.py")
    caches = [name for name in imported if re.match(r"(\.|moekv_ref\.)cache(\.|$)", name)]
    assert not caches, f"model.py imports {caches}"


def test_the_plain_paged_cache_names_no_budget():
    source = (ROOT / "moekv_ref" / "cache" / "paged.py").read_text()
    found = [line.strip() for line in source.splitlines() if re.search(r"budget", line, re.IGNORECASE)]
    assert not found, f"paged.py names a budget: {found[:3]}"
    assert issubclass(BudgetedPagedKVCache, PagedKVCache)
    assert "append_kv" in vars(BudgetedPagedKVCache) and "attend" in vars(BudgetedPagedKVCache)


def test_make_paged_cache_picks_the_class_by_the_budget_and_the_model_s_capacity():
    plain_model = random_model(small_config("expert"), seed=1)
    plain = make_paged_cache(plain_model, block_size=2)
    assert type(plain) is PagedKVCache and not hasattr(plain, "budget")
    budgeted = make_paged_cache(plain_model, 2, budget=RowBudget(4, "window"))
    assert type(budgeted) is BudgetedPagedKVCache and budgeted.manager.budget.max_tokens == 4
    assert budgeted.block_size == 2  # the positional options reach for_model in its order
    capacity = random_model(small_config("expert", attention_capacity=3), seed=1)
    implied = make_paged_cache(capacity, block_size=2)
    assert type(implied) is BudgetedPagedKVCache
    assert repr(implied.manager.budget) == repr(model_budget(capacity.config).fresh())
    exact = PagedKVCache.for_model(capacity, block_size=2)  # the plain class never caps a row
    assert type(exact) is PagedKVCache and not isinstance(exact.manager, BudgetedKVCacheManager)
    with pytest.raises(ValueError, match="budget=4 is an int; allowed: a RowBudget"):
        make_paged_cache(plain_model, budget=4)
    with pytest.raises(ValueError, match="budget=None is not allowed for a model without attention_capacity"):
        BudgetedPagedKVCache.for_model(plain_model)
    with pytest.raises(ValueError, match="unknown keyword budget=.* for PagedKVCache.for_model"):
        PagedKVCache.for_model(plain_model, budget=RowBudget(4))


def test_the_model_reaches_the_recompute_through_the_budget_s_own_method(monkeypatch):
    """model(tokens, budget=...) calls RowBudget.recompute_attention at every layer and nothing else
    of the caches; another object of the RowRule protocol is taken, anything else refused."""
    model = random_model(small_config("expert"), seed=2, dtype=torch.float64)
    tokens = torch.tensor(random_prompts([9], model.config.vocab_size, seed=3))
    budget = RowBudget(3, "window", num_sinks=1)
    layers = []
    original = RowBudget.recompute_attention

    def spy(self, q, k, v, selected, scores, layer):
        layers.append(layer)
        return original(self, q, k, v, selected, scores, layer)

    monkeypatch.setattr(RowBudget, "recompute_attention", spy)
    with torch.inference_mode():
        model(tokens, budget=budget)
    assert layers == list(range(model.config.num_hidden_layers))
    assert isinstance(budget, RowRule)
    with pytest.raises(ValueError, match="budget=3 must be a RowBudget"):
        model(tokens, budget=3)


def _nan_where_refused(original):
    """BudgetedPagedKVCache.attend whose refused pairs (output all zeros) answer NaN."""

    def attend(self, appended, q):
        out = original(self, appended, q)
        out[(out == 0).flatten(1).all(1)] = float("nan")
        return out

    return attend


def _no_attention_received(original):
    """BudgetedPagedKVCache._attention_received that reports none: heavy_hitter's scores stay zero."""
    return lambda self, appended, q: torch.zeros_like(original(self, appended, q))


@pytest.mark.parametrize(
    "policy, method, mutation",
    [("drop", "attend", _nan_where_refused), ("heavy_hitter", "_attention_received", _no_attention_received)],
)
def test_a_broken_budgeted_override_is_seen_by_the_recompute(monkeypatch, policy, method, mutation):
    """The equivalence has teeth: the intact BudgetedPagedKVCache gives the recompute's logits; one
    whose attend lets NaN out of a refused pair, or whose heavy_hitter rows never hear the attention
    their keys received, does not."""
    model = random_model(small_config("expert"), seed=4, dtype=torch.float64)
    sequences = torch.tensor(random_prompts([16, 16], model.config.vocab_size, seed=5))
    budget = RowBudget(3, policy)

    def cached_logits():
        cache = BudgetedPagedKVCache.for_model(model, block_size=2, budget=budget)
        return prefill_then_decode(model, cache, sequences, prefill=6)

    with torch.inference_mode():
        recompute = model(sequences, budget=budget).logits
        assert (cached_logits() - recompute).abs().max() <= 1e-10
        monkeypatch.setattr(BudgetedPagedKVCache, method, mutation(getattr(BudgetedPagedKVCache, method)))
        broken = cached_logits()
    assert not (broken - recompute).abs().max() <= 1e-6  # NaN compares False
