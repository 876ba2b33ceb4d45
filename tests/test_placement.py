"""Expert placement: every strategy balances experts per device; co-activation groups experts that are
chosen together, so tokens touch fewer devices than under round-robin when routing has such pairs."""

import pytest
import torch

from moekv_ref.placement import coactivation_counts, devices_touched, place_experts, place_layers


@pytest.mark.parametrize("strategy", ["contiguous", "round_robin"])
def test_fixed_strategies_exact(strategy):
    expected = {"contiguous": [0, 0, 0, 1, 1, 1], "round_robin": [0, 1, 0, 1, 0, 1]}[strategy]
    assert place_experts(6, 2, strategy).tolist() == expected


def test_coactivation_puts_pairs_together_and_touches_fewer_devices():
    # 8 experts; every token picks one of the pairs (0,5), (1,4), (2,7), (3,6). Round-robin on 4
    # devices (e % 4) splits every pair; co-activation must keep each pair on one device.
    generator = torch.Generator().manual_seed(0)
    pairs = torch.tensor([[0, 5], [1, 4], [2, 7], [3, 6]])
    chosen = pairs[torch.randint(0, 4, (400,), generator=generator)]  # (N, 2)
    selected = torch.zeros(400, 8, dtype=torch.bool)
    selected[torch.arange(400)[:, None], chosen] = True
    device = place_experts(8, 4, "coactivation", coactivation_counts(selected))
    assert torch.bincount(device, minlength=4).tolist() == [2, 2, 2, 2]  # balanced
    for a, b in pairs.tolist():
        assert device[a] == device[b]
    assert devices_touched(selected, device, 4).float().mean() == 1.0
    round_robin = devices_touched(selected, place_experts(8, 4, "round_robin"), 4).float().mean()
    assert round_robin == 2.0  # every pair split


def test_place_layers_and_bad_arguments():
    selected = [torch.rand(50, 8) < 0.3 for _ in range(3)]
    maps = place_layers(selected, 2, "coactivation")
    assert maps.shape == (3, 8) and all(torch.bincount(m, minlength=2).tolist() == [4, 4] for m in maps)
    with pytest.raises(ValueError, match="must divide num_experts=8"):
        place_experts(8, 3)
    with pytest.raises(ValueError, match="strategy='random' is not one of"):
        place_experts(8, 2, "random")
    with pytest.raises(ValueError, match="co-activation"):
        place_experts(8, 2, "coactivation")
