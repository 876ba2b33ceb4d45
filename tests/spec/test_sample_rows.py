"""sample_rows (a decode step's rows at once, for generate and the engine alike) gives each row's own
token, greedy and sampled rows mixed, as sampling them one by one does; raises SamplingError for
non-finite logits, or, given an `errors` dict, fails only the rows that have them."""

import pytest
import torch
from helpers import random_model, random_prompts, small_config

import moekv_ref.sampling as sampling_module
from moekv_ref.engine import LLMEngine
from moekv_ref.generate import generate
from moekv_ref.sampling import SamplingError, SamplingParams, sample_rows

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_p=0.8, seed=3),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=4),
    SamplingParams(temperature=0.0),
]


def one_by_one(logits, params):
    """The rule written out for one row at a time, each with a fresh generator from its seed: the
    reference the batched sampler must equal token for token."""
    tokens = []
    for row, p in zip(logits, params):
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        probs = torch.softmax(row.double() / p.temperature, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            sorted_probs[torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        tokens.append(int(torch.multinomial(probs, 1, generator=p.generator())))
    return tokens


def test_sample_rows_equals_sampling_row_by_row():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    assert sample_rows(logits, MIXED, [p.generator() for p in MIXED]) == one_by_one(logits, MIXED)
    greedy = [SamplingParams(temperature=0.0)] * 5
    assert sample_rows(logits, greedy, [p.generator() for p in greedy]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_sample_rows_equals_row_by_row_on_ties_and_every_temperature_and_top_p(seed):
    """Fresh random batches, logits rounded so that many tie (a sort's order among equal values
    matters to the nucleus), temperatures and top_p mixed in one batch."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(25):
        b, scale = int(torch.randint(1, 9, (1,), generator=g)), [0.1, 1.0, 5.0, 30.0][seed]
        logits = torch.round(torch.randn(b, 64, generator=g) * scale)
        pick = torch.randint(0, 5, (b, 3), generator=g).tolist()
        params = [
            SamplingParams(
                temperature=[0.0, 0.3, 0.8, 1.0, 2.5][t], top_p=[1.0, 0.95, 0.5, 0.1, 1e-9][q], seed=s
            )
            for t, q, s in pick
        ]
        assert sample_rows(logits, params, [p.generator() for p in params]) == one_by_one(logits, params)


def test_sample_rows_refuses_non_finite_logits():
    logits = torch.zeros(3, 8)
    logits[1, 2] = float("nan")
    params = [SamplingParams(temperature=0.0)] * 3
    with pytest.raises(SamplingError, match="not finite"):
        sample_rows(logits, params, [p.generator() for p in params])


@pytest.mark.parametrize("bad_row", [0, 1, 4])  # a greedy row, a sampled one, the last greedy one
def test_with_errors_only_the_rows_with_bad_logits_fail(bad_row):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    expected = one_by_one(logits, MIXED)
    logits[bad_row, 7] = float("inf")
    errors = {}
    tokens = sample_rows(logits, MIXED, [p.generator() for p in MIXED], errors)
    assert (
        list(errors) == [bad_row] and isinstance(errors[bad_row], SamplingError) and tokens[bad_row] is None
    )
    assert [t for i, t in enumerate(tokens) if i != bad_row] == [
        t for i, t in enumerate(expected) if i != bad_row
    ]


def test_the_engine_samples_its_greedy_rows_with_one_argmax(monkeypatch):
    """The batched greedy choice is the path the engine runs: no row is sampled on its own in a greedy
    run (it would pass the token check just as well, so the calls are counted), and the tokens are
    generate's."""
    model = random_model(small_config(), seed=2)
    prompts = random_prompts([5, 1, 9], model.config.vocab_size, seed=3)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    expected = generate(model, prompts, params).tokens
    calls, real = [], sampling_module._sample_next
    monkeypatch.setattr(sampling_module, "_sample_next", lambda *args: calls.append(1) or real(*args))
    outputs = LLMEngine(model, num_blocks=256, block_size=4).generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected and calls == []
