"""Expert placement: every strategy balances experts per device; co-activation groups experts that are
chosen together, so tokens touch fewer devices than under round-robin when routing has such pairs."""

import pytest
import torch

from moekv_ref.cache import KVCacheManager, RowPlacement
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


# ----- RowPlacement: which device every (sequence, layer, expert) row lives on ----------------------------
def test_row_placement_answers_for_every_row_by_expert_and_by_sequence():
    """By expert, every sequence's rows follow the (L, E) table; by sequence, every row of s is on
    s % D whatever its expert; the per-(layer, device) expert counts exist only by expert."""
    table = torch.tensor([[0, 1, 1, 2], [2, 2, 0, 1]])  # (L, E) = (2, 4) over 3 devices
    by_expert = RowPlacement.by_expert(table, 3)
    assert not by_expert.follows_sequence
    devices = by_expert.of_sequences([0, 7, 11])
    assert devices.shape == (3, 2, 4)
    assert all(torch.equal(devices[i], table) for i in range(3))
    assert by_expert.experts_per_device().tolist() == [[1, 2, 1], [1, 1, 2]]

    by_sequence = RowPlacement.by_sequence(2, 4, 3)
    assert by_sequence.follows_sequence and by_sequence.experts_per_device() is None
    devices = by_sequence.of_sequences([0, 7, 11])
    assert [devices[i].unique().tolist() for i in range(3)] == [[0], [1], [2]]
    one_pool = RowPlacement.by_sequence(2, 4, 1)
    assert not one_pool.follows_sequence and int(one_pool.of_sequences([5]).max()) == 0


def test_the_manager_places_each_row_where_its_placement_says():
    """A row's blocks come from the device the manager's placement names, by expert and by sequence."""
    table = torch.tensor([[0, 1], [1, 0]])
    for options in (dict(device_of_expert=table), dict(home_devices=True)):
        manager = KVCacheManager(2, 2, 2, blocks_per_device=[8, 8], **options)
        for seq_id in (0, 1):
            manager.add_sequence(seq_id)
            rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq_id)]))[0]
            manager.allocate_slots(rows, torch.full((4,), 3))
            expected = manager.placement.of_sequences([seq_id])[0].reshape(-1)  # (L*E,)
            for row, device in zip(rows.tolist(), expected.tolist()):
                blocks = manager.block_tables[row, :2].to(torch.int64)
                assert manager.pool.device_of_blocks(blocks).tolist() == [device, device]
