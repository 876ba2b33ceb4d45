"""sample_rows (a decode step's rows at once) gives sample_next's tokens, greedy and sampled rows mixed,
and raises SamplingError for non-finite logits as sample_next does."""

import pytest
import torch

from moekv_ref.sampling import SamplingError, SamplingParams, sample_next, sample_rows


def test_sample_rows_equals_sample_next_row_by_row():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.0)]
    one_by_one = [sample_next(row, p, p.generator()) for row, p in zip(logits, params)]
    assert sample_rows(logits, params, [p.generator() for p in params]) == one_by_one
    greedy = [SamplingParams(temperature=0.0)] * 5
    assert sample_rows(logits, greedy, [p.generator() for p in greedy]) == logits.argmax(-1).tolist()


def test_sample_rows_refuses_non_finite_logits():
    logits = torch.zeros(3, 8)
    logits[1, 2] = float("nan")
    params = [SamplingParams(temperature=0.0)] * 3
    with pytest.raises(SamplingError, match="not finite"):
        sample_rows(logits, params, [p.generator() for p in params])
