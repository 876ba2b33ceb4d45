"""The shared attention arithmetic: rotary embeddings and causal attention by absolute position."""

import math

import torch

from moekv_ref.attention import attend_by_position, rotary, rotary_table


def test_rotary_table_equals_the_formula_and_grows():
    cos, sin = rotary_table(8, 10000.0, 5, "cpu")
    angles = torch.arange(5, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.equal(cos[:5], torch.cos(angles)) and torch.equal(sin[:5], torch.sin(angles))
    longer, _ = rotary_table(8, 10000.0, 3000, "cpu")          # regrown past the first size
    assert longer.shape[0] >= 3000 and torch.equal(longer[:5], cos[:5])


def test_rotary_keeps_norms_and_scores_depend_only_on_distance():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 16, generator=generator, dtype=torch.float64)
    for shift in (0, 7, 1000):
        qr = rotary(q[None], torch.tensor([3 + shift]), 10000.0)[0]
        kr = rotary(k[None], torch.tensor([1 + shift]), 10000.0)[0]
        assert torch.allclose(qr.norm(), q.norm()) and torch.allclose(kr.norm(), k.norm())
        score = float((qr * kr).sum())
        if shift == 0:
            reference = score
        assert math.isclose(score, reference, rel_tol=1e-12)  # same distance 2: same score


def test_attend_by_position_masks_later_keys_and_groups_heads():
    """Two query heads share one KV head (GQA). The query at position 5 sees keys at 2 and 5, not 9;
    with all-equal scores its output is the mean of the visible values."""
    q = torch.zeros(1, 2, 4, dtype=torch.float64)                         # equal scores everywhere
    k = torch.zeros(3, 1, 4, dtype=torch.float64)
    v = torch.tensor([[[1.0, 0, 0, 0]], [[3.0, 0, 0, 0]], [[100.0, 0, 0, 0]]], dtype=torch.float64)
    out = attend_by_position(q, k, v, torch.tensor([5]), torch.tensor([2, 5, 9]))
    assert out.shape == (1, 2, 4)
    assert torch.equal(out[0, :, 0], torch.tensor([2.0, 2.0], dtype=torch.float64))
