"""The pieces of expert parallelism that need no process group: the dispatch plan, the pairs a rank
runs, the cost model's expectations, and expert placement on routing with a known structure."""

import itertools

import pytest
import torch

from moekv_ref.config import get_config
from moekv_ref.costs import expected_remote_ranks, project_step
from moekv_ref.model import MoEKVTransformer
from moekv_ref.parallel.dispatch import DispatchPlan, Received, local_pairs
from moekv_ref.parallel.locality import compare_placements
from moekv_ref.parallel.runner import ParallelRunner


def test_dispatch_plan_sends_each_token_once_per_rank():
    # experts 0,1 on rank 0; 2,3 on rank 1. token 0 -> {0, 1} (one rank), token 1 -> {1, 2}, token 2 -> {3}
    selected = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    gates = torch.tensor([[0.6, 0.4, 0, 0], [0, 0.7, 0.3, 0], [0, 0, 0, 1.0]])
    plan = DispatchPlan.build(selected, gates, torch.tensor([0, 0, 1, 1]), world_size=2, slots=2)
    # pairs grouped by rank, tokens ascending within a rank: (0, r0), (1, r0), (1, r1), (2, r1)
    assert plan.token.tolist() == [0, 1, 1, 2]
    assert plan.rank.tolist() == [0, 0, 1, 1]
    assert plan.send_counts == [2, 2]
    assert plan.experts.tolist() == [[0, 1], [1, -1], [2, -1], [3, -1]]
    assert torch.equal(plan.gates, torch.tensor([[0.6, 0.4], [0.7, 0], [0.3, 0], [1.0, 0]]))
    # seen from home rank 0: 2 hidden states leave (tokens 1 and 2 to rank 1), as do 2 expert pairs;
    # from home rank 1: 2 leave (tokens 0, 1 to rank 0) but a per-expert dispatch would send 3
    assert (plan.pairs_to_peers(0), plan.expert_pairs_to_peers(0)) == (2, 2)
    assert (plan.pairs_to_peers(1), plan.expert_pairs_to_peers(1)) == (2, 3)


def test_local_pairs_sorted_by_expert_keep_token_order():
    experts = torch.tensor([[5, 7], [7, -1], [5, -1]])  # rank holds experts 5 and 7
    received = Received(
        torch.zeros(3, 2), torch.tensor([[0.5, 0.5], [1.0, 0], [1.0, 0]]), experts, None, None, [3]
    )
    pairs = local_pairs(received, torch.tensor([5, 7]))
    assert pairs.token.tolist() == [0, 2, 0, 1]  # expert 5: tokens 0, 2; expert 7: tokens 0, 1
    assert pairs.expert.tolist() == [5, 5, 7, 7]
    assert pairs.counts.tolist() == [2, 2]
    # order: each sorted pair's index among the row-major slots (0,0)=0 (0,1)=1 (1,0)=2 (2,0)=3
    assert pairs.order.tolist() == [0, 3, 1, 2]
    with pytest.raises(RuntimeError, match="does not hold"):
        local_pairs(received, torch.tensor([5]))


@pytest.mark.parametrize("num_experts,k,world_size", [(8, 2, 4), (8, 3, 2), (6, 2, 3), (4, 1, 4)])
def test_expected_remote_ranks_by_enumeration(num_experts, k, world_size):
    rank_of = [e // (num_experts // world_size) for e in range(num_experts)]
    subsets = list(itertools.combinations(range(num_experts), k))
    # the home rank is any rank with equal chance; by symmetry, rank 0
    brute = sum(len({rank_of[e] for e in s} - {0}) for s in subsets) / len(subsets)
    assert expected_remote_ranks(num_experts, k, world_size) == pytest.approx(brute)


def test_projection_bytes_grow_with_context_only_when_kv_travels():
    config = get_config("jetmoe-8b-expert-kv")
    steps = {
        (p, c): project_step(config, p, 8, 256, c)
        for p in ("kv_with_expert", "kv_with_sequence", "replicated_attention")
        for c in (4096, 32768)
    }
    total = {key: sum(step.bytes_per_step.values()) for key, step in steps.items()}
    assert total[("kv_with_expert", 4096)] == total[("kv_with_expert", 32768)]
    assert total[("replicated_attention", 4096)] == total[("replicated_attention", 32768)]
    assert total[("kv_with_sequence", 32768)] > 7.9 * total[("kv_with_sequence", 4096)]
    assert steps[("replicated_attention", 4096)].bytes_per_step["attention_dispatch"] == 0
    with pytest.raises(ValueError, match="dense attention"):
        project_step(get_config("mixtral-8x7b"), "kv_with_expert", 8, 64, 4096)


def test_coactivation_placement_keeps_pairs_together():
    # experts come in fixed pairs (0,5), (1,4), (2,7), (3,6): co-activation puts each pair on one rank
    # (one rank touched per token); round-robin (e % 2) splits all four pairs (two ranks per token)
    generator = torch.Generator().manual_seed(0)
    pairs = torch.tensor([[0, 5], [1, 4], [2, 7], [3, 6]])
    choice = pairs[torch.randint(0, 4, (2048,), generator=generator)]  # (N, 2)
    selected = torch.zeros(2048, 8, dtype=torch.bool).scatter_(1, choice, True)
    rows = {r["strategy"]: r for r in compare_placements([selected], world_sizes=(2,), hidden_size=4)}
    assert rows["coactivation"]["ranks_touched_per_token_layer"] == 1.0
    assert rows["round_robin"]["ranks_touched_per_token_layer"] == 2.0
    # once-per-rank dispatch: a pair on one rank travels once, not twice
    assert (
        rows["coactivation"]["dispatch_bytes_per_token_layer_once_per_expert"]
        == 2 * rows["coactivation"]["dispatch_bytes_per_token_layer_once_per_rank"]
    )


def test_bad_inputs_are_refused_before_anything_starts():
    # (the command lines' options: tests/test_cli.py)
    from moekv_ref.parallel import launch
    from moekv_ref.parallel.locality import kv_location_map

    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda context: None, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        launch(compare_placements, 0)
    for name, value in [("timeout_s", 0), ("timeout_s", float("nan")), ("start_timeout_s", float("inf"))]:
        with pytest.raises(ValueError, match=f"{name}={value!r} must be a number of seconds > 0"):
            launch(compare_placements, 2, **{name: value})
    with pytest.raises(ValueError, match="grace_s=-1 must be"):
        launch(compare_placements, 2, grace_s=-1)
    with pytest.raises(ValueError, match=r"backend='mpi' is not one of \('gloo', 'nccl'\)"):
        launch(compare_placements, 2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
            launch(compare_placements, 2, backend="nccl")
    with pytest.raises(ValueError, match="kv_placement='kv_everywhere'"):
        kv_location_map([torch.ones(3, 4, dtype=torch.bool)], torch.zeros(1, 4), "kv_everywhere", 0)


def test_mixtral_decode_attention_is_bound_by_reading_its_cache():
    # by hand: 32 sequences per GPU, each reading 4097 tokens x 32 layers x 4096 bytes (8 KV heads of
    # 128, K and V, bf16) = 17.2 GB per GPU, at 3.35 TB/s = 5.1 ms; the attention weights every GPU
    # reads add 32 layers x 84 MB = 2.7 GB (0.8 ms)
    step = project_step(get_config("mixtral-8x7b"), "replicated_attention", 8, 256, 4096)
    kv_ms = 32 * 4097 * 32 * 4096 / 3.35e12 * 1e3
    weights_ms = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024) * 2 / 3.35e12 * 1e3
    assert step.attention_ms == pytest.approx(kv_ms + weights_ms, rel=1e-3)


def test_projected_step_bars_stand_on_the_axis_and_pcie_is_slower_by_its_bandwidth():
    """Notebook 07's projection figure: on its log axis every bar starts at the axis (none stacked on
    another, whose height a log scale would misstate), and PCIe's communication is NVLink's times the
    ratio of their bandwidths, the rest of the step unchanged."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from moekv_ref.costs import LINKS
    from moekv_ref.parallel.kv_placements import KV_PLACEMENTS
    from moekv_ref.plots.parallel import draw_projected_step, draw_step_vs_context

    config = get_config("jetmoe-8b-expert-kv")
    rows = {
        link: [project_step(config, p, 8, 256, 4096, "H200", link).to_dict() for p in KV_PLACEMENTS]
        for link in ("nvlink", "pcie_gen5_x16")
    }
    for nvlink, pcie in zip(rows["nvlink"], rows["pcie_gen5_x16"]):
        ratio = LINKS["nvlink"].bytes_per_s / LINKS["pcie_gen5_x16"].bytes_per_s
        assert pcie["communication_ms"] == pytest.approx(nvlink["communication_ms"] * ratio)
        assert pcie["attention_ms"] == nvlink["attention_ms"] and pcie["experts_ms"] == nvlink["experts_ms"]
    ax = Figure().subplots()
    draw_projected_step(ax, rows["nvlink"])
    assert ax.get_yscale() == "log"
    assert len(ax.patches) == 3 * len(KV_PLACEMENTS) and all(bar.get_y() == 0 for bar in ax.patches)
    with pytest.raises(ValueError, match="evenly"):
        project_step(config, "kv_with_expert", 16, 256, 4096)  # 8 experts cannot fill 16 ranks
    ax = Figure().subplots()
    sweep = [
        project_step(config, "kv_with_expert", 8, 256, c, "H200", "nvlink").to_dict() for c in (1024, 4096)
    ]
    draw_step_vs_context(ax, sweep, 4096)
    assert ax.lines[-2].get_xdata().tolist() == [4096]  # the chosen context, circled


def test_a_model_with_a_capacity_is_refused_by_expert_parallelism():
    """Its ranks' caches would need its budget and each pair's router score: refused with the reason,
    before any cache or collective is made."""
    model = MoEKVTransformer(get_config("tiny", attention_capacity=16))
    with pytest.raises(
        ValueError, match="attention_capacity=16: expert parallelism does not run models with a capacity"
    ):
        ParallelRunner(model, None, "kv_with_expert", torch.zeros(4, 8), torch.zeros(4, 4), num_blocks=64)
