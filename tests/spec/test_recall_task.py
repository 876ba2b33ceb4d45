"""The recall study's task (moekv_ref/study/recall_task.py) and fast forward (study/train_fast.py)."""

from __future__ import annotations

import json

import pytest
import torch

from moekv_ref.apps.capacity import DENSE
from moekv_ref.apps.train import stdlib_corpus
from moekv_ref.cache.budget import RowBudget
from moekv_ref.config import get_config
from moekv_ref.model import MoEKVTransformer
from moekv_ref.study import recall_task
from moekv_ref.study.recall_task import (
    ASSERT_LENGTH,
    ASSERT_VALUE_OFFSET,
    ASSIGN_LENGTH,
    ASSIGN_VALUE_OFFSET,
    DRILL,
    FULL,
    SHORT,
    Scores,
    batch,
    make_windows,
)
from moekv_ref.study.train_fast import attention_mask, fast_forward
from moekv_ref.training import fit

NUM_WINDOWS = 60


@pytest.fixture(scope="module")
def splits():
    return stdlib_corpus()


@pytest.fixture(scope="module")
def windows(splits):
    """Windows of both splits and both shapes, with the source each was drawn from."""
    train, valid = splits
    drawn = []
    for spec in (FULL, SHORT, DRILL):
        drawn += [(w, train, spec) for w in make_windows(train, "train", 3, 0, NUM_WINDOWS, spec)]
        drawn += [(w, valid, spec) for w in make_windows(valid, "validation", 3, 0, 12, spec, exclude=train)]
    return drawn


def text(window) -> bytes:
    return bytes(window.tokens.tolist())


def base_text(window) -> bytes:
    """The window with its inserted lines taken out."""
    data = text(window)
    inserted = set()
    for a, s in zip(window.assign_positions, window.assert_positions):
        inserted.update(range(a - ASSIGN_VALUE_OFFSET, a - ASSIGN_VALUE_OFFSET + ASSIGN_LENGTH))
        inserted.update(range(s - ASSERT_VALUE_OFFSET, s - ASSERT_VALUE_OFFSET + ASSERT_LENGTH))
    return bytes(b for i, b in enumerate(data) if i not in inserted)


def test_windows_are_deterministic_per_seed(splits):
    train, _ = splits
    first = make_windows(train, "train", 5, 10, 8)
    again = make_windows(train, "train", 5, 10, 8)
    other = make_windows(train, "train", 6, 10, 8)
    assert [text(w) for w in first] == [text(w) for w in again]
    assert [(w.names, w.values, w.assert_positions) for w in first] == [
        (w.names, w.values, w.assert_positions) for w in again
    ]
    assert all(text(a) != text(b) for a, b in zip(first, other))
    # window i is the same whichever batch draws it: a resumed run sees what it would have
    assert text(make_windows(train, "train", 5, 13, 1)[0]) == text(first[3])


def test_every_assert_recalls_its_assignment(windows):
    for window, _, spec in windows:
        data = text(window)
        assert len(data) == spec.window
        assert spec.num_assignments[0] <= len(window.names) <= spec.num_assignments[1]
        assert len(set(window.names)) == len(window.names)
        for name, value, a, s in zip(
            window.names, window.values, window.assign_positions, window.assert_positions
        ):
            assert data[a - ASSIGN_VALUE_OFFSET : a - ASSIGN_VALUE_OFFSET + ASSIGN_LENGTH] == (
                f"{name} = '{value}'\n".encode()
            )
            assert data[s - ASSERT_VALUE_OFFSET : s - ASSERT_VALUE_OFFSET + ASSERT_LENGTH] == (
                f"assert {name} == '{value}'\n".encode()
            )
            assert len(value) == 3 and value.isalpha() and value.islower()
        # each name once as an assignment and once as an assert, nowhere else
        for name in window.names:
            assert data.count(name.encode()) == 2


def test_distances_and_regions_lie_in_the_stated_ranges(windows):
    low, high = FULL.distances
    seen = []
    for window, _, spec in windows:
        assert all(spec.distances[0] <= d <= spec.distances[1] for d in window.distances)
        assert all(a < spec.assign_end for a in window.assign_positions)
        assert all(
            spec.assert_start <= s <= spec.window - ASSERT_LENGTH + ASSERT_VALUE_OFFSET
            for s in window.assert_positions
        )
        if spec == FULL:
            seen += window.distances
    assert low <= min(seen) and max(seen) <= high
    assert max(seen) - min(seen) > (high - low) // 2  # the range is used, not one distance


def test_train_and_validation_windows_share_no_source_text(splits, windows):
    train, valid = splits
    assert len(valid) > 100_000
    for window, source, _ in windows:
        base = source[window.start : window.start + window.base_length]
        assert base_text(window) == base  # nothing else in the window
        if source is valid:  # checked apart from shares_text: no 79-byte piece at a stride of 8 is in
            # the training text, so no run of 86 bytes is (shares_text promises 79)
            assert not any(base[i : i + 79] in train for i in range(0, len(base) - 78, 8))


def test_scores_count_probes_and_other_bytes(splits):
    train, _ = splits
    drawn = make_windows(train, "train", 0, 0, 3)
    x, y, probe, corpus = batch(drawn)
    assert int(probe.sum()) == 3 * sum(len(w.names) for w in drawn)
    assert not (probe & corpus).any()
    perfect = torch.nn.functional.one_hot(y, 256).double() * 50
    scores = Scores()
    scores.add(perfect, y, probe, corpus)
    summary = scores.summary()
    assert summary["retrieval_accuracy"] == 1.0 and summary["value_accuracy"] == 1.0
    assert summary["bits_per_byte_text"] < 1e-6
    shifted = perfect.roll(1, dims=-1)  # every byte predicted wrong
    scores = Scores()
    scores.add(shifted, y, probe, corpus)
    assert scores.summary()["retrieval_accuracy"] == 0.0
    assert summary["other_bytes"] == probe.numel() - int(probe.sum())
    assert recall_task.wilson_interval(50, 100)[0] < 0.5 < recall_task.wilson_interval(50, 100)[1]


VARIANTS = {
    "dense": DENSE,
    "expert_topk": {},
    "expert_topk_capacity": dict(attention_capacity=12),
    "expert_choice": dict(
        attention_routing="expert_choice", num_attention_experts_per_tok=8, attention_capacity=12
    ),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
}


def model_of(variant: str, seed: int = 0) -> MoEKVTransformer:
    torch.manual_seed(seed)
    return MoEKVTransformer(get_config("tiny", **VARIANTS[variant])).double().eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_forward_equals_the_model_forward(variant):
    """float64, random bytes: within 1e-10 of model.py's training forward, logits and routing."""
    model = model_of(variant)
    tokens = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens)
        fast = fast_forward(model, tokens)
    torch.testing.assert_close(fast.logits, reference.logits, rtol=0, atol=1e-10)
    for a, b in zip(fast.attention_routing, reference.attention_routing):
        assert torch.equal(a.selected, b.selected)
        torch.testing.assert_close(a.gates, b.gates, rtol=0, atol=1e-12)


def test_fast_forward_gradients_equal_the_model_forward():
    model = model_of("dense")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    grads = []
    for forward in (lambda: model(tokens), lambda: fast_forward(model, tokens)):
        model.zero_grad()
        forward().logits.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", ["dense", "expert_topk"])
def test_a_window_as_long_as_the_sequence_is_full_causal_attention(variant):
    model = model_of(variant)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = fast_forward(model, tokens).logits
        for window in (32, 33, 500):
            assert torch.equal(fast_forward(model, tokens, window).logits, full)
        assert not torch.allclose(fast_forward(model, tokens, 31).logits, full)


def test_the_sliding_window_is_the_budgeted_window_policy():
    """Window W is what a per-row budget of W tokens with no sinks keeps (cache/budget.py), the
    query itself included: an independent recompute of the same rule."""
    model = model_of("dense")
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for window in (1, 2, 5, 16):
            budgeted = model(tokens, budget=RowBudget(window, "window", num_sinks=0)).logits
            torch.testing.assert_close(
                fast_forward(model, tokens, window).logits, budgeted, rtol=0, atol=1e-10
            )


def test_attention_mask_rows():
    mask = attention_mask(10, 4, "cpu")
    assert mask.sum(1).tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    assert torch.equal(mask, mask.tril())
    assert mask.diagonal().all()
    assert attention_mask(10, None, "cpu") is None
    with pytest.raises(ValueError, match="window=0 is not allowed"):
        attention_mask(10, 0, "cpu")


def test_the_pilot_writes_its_numbers_and_resumes(tmp_path):
    from moekv_ref.apps import study_pilot

    out = tmp_path / "figures" / "pilot.json"
    argv = ["--json", str(out), "--runs", str(tmp_path / "runs"), "--drill-steps", "1", "--short-steps", "1"]
    argv += ["--steps", "1"]
    argv += ["--short-batch-size", "2", "--batch-size", "1", "--probe-windows", "2", "--windows", "4", "2048"]
    assert study_pilot.main(argv) == 0
    first = json.loads(out.read_text())
    assert first["training"]["bytes"] == 2 * DRILL.window + 2 * SHORT.window + FULL.window
    assert [r["window"] for r in first["window_sweep"]] == [4, 2048]
    assert first["window_sweep"][1]["retrieval_accuracy"] == first["full_attention"]["retrieval_accuracy"]
    assert first["full_attention"]["probe_bytes"] == 3 * first["full_attention"]["probe_values"]
    assert first["commit"] and first["gate"]["threshold"] == 0.9
    assert study_pilot.main(argv) == 0  # resumed: nothing trained or measured again
    second = json.loads(out.read_text())
    assert second["training"] == first["training"]
    assert second["measure_seconds"] == first["measure_seconds"]
    with pytest.raises(SystemExit):
        study_pilot.main([*argv, "--steps", "0"])


def test_weighted_training_weighs_the_targets():
    """Weights of one train as no weights; other weights train otherwise."""
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(5))
    x, y = tokens[:, :-1], tokens[:, 1:]
    heavier = torch.ones(y.shape, dtype=torch.float64)
    heavier[:, -3:] = 4
    trained = []
    for batch_of in (lambda s: (x, y), lambda s: (x, y, torch.ones(y.shape)), lambda s: (x, y, heavier)):
        model = model_of("dense").float()
        fit(model, batch_of, num_steps=2, forward=fast_forward, warmup=1, balance_weight=0.0)
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(trained[0], trained[1])
    assert not torch.allclose(trained[0], trained[2])
