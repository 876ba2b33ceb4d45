"""The exact optimum over victim choices (sim/optimum.py): its search visits exactly the leaves a
naive enumeration finds (every choice prefix replayed from step 0), pruning does not change its
answer, its schedule replays to the steps it reports, and every policy that chooses whole victims is
one of its branches, so none finishes in fewer steps."""

import pytest

from moekv_ref.apps.bench_eviction import small_instance
from moekv_ref.engine.victims import VictimPolicy
from moekv_ref.sim.optimum import NeedChoice, ScriptedVictims, search_optimum
from moekv_ref.sim.runner import TraceRunner, simulate

WHOLE_VICTIM_POLICIES = ("newest_first", "sequence_lru", "pressure_aware", "belady")


def naive_leaves(trace, placement, setup, cost):
    """Every complete schedule, by replaying each choice prefix from step 0 (no copies, no pruning):
    {choices: steps}, and the number of dead ends (a step that scheduled nothing)."""
    leaves, dead, prefixes = {}, 0, [()]
    while prefixes:
        prefix = prefixes.pop()
        try:
            leaves[prefix] = simulate(trace, placement, setup, ScriptedVictims(prefix), cost).num_steps
        except NeedChoice as need:
            prefixes += [prefix + (choice,) for choice in range(need.num_candidates)]
        except RuntimeError as error:
            assert "nothing could be scheduled" in str(error)
            dead += 1
    return leaves, dead


class Recorder(VictimPolicy):
    """Another policy's choices, as candidate indices (decisions with one candidate are no choice)."""

    def __init__(self, inner):
        self.inner, self.name, self.choices = inner, inner.name, []

    def choose_victim(self, candidates, memory, need):
        choice = self.inner.choose_victim(candidates, memory, need)
        if len(candidates) > 1:
            self.choices.append(next(i for i, c in enumerate(candidates) if c is choice))
        return choice


def recorded_run(name, trace, placement, setup, cost):
    runner = TraceRunner(trace, placement, setup, name, cost)
    recorder = Recorder(runner.scheduler.victims)
    runner.scheduler.victims = recorder
    return runner.run(), recorder.choices


def test_search_visits_exactly_the_leaves_of_a_naive_enumeration():
    instance = small_instance()
    found = search_optimum(*instance, prune=False, keep_leaves=True)
    leaves, dead = naive_leaves(*instance)
    assert len(leaves) >= 3 and max(map(len, leaves)) >= 2  # a tree, not one decision
    assert dict(found.leaves) == leaves and len(found.leaves) == found.num_leaves == len(leaves)
    assert found.num_dead_ends == dead
    assert found.steps == min(leaves.values()) and found.worst_steps == max(leaves.values())


@pytest.mark.parametrize(
    "instance",
    [dict(), dict(num_sequences=5, seed=0), dict(blocks_per_device=80, seed=2)],
    ids=["6seq", "5seq", "6seq-80blocks"],
)
def test_every_whole_victim_policy_is_a_branch_and_none_beats_the_optimum(instance):
    trace, placement, setup, cost = small_instance(**instance)
    full = search_optimum(trace, placement, setup, cost, prune=False, keep_leaves=True)
    pruned = search_optimum(trace, placement, setup, cost)
    assert (pruned.steps, pruned.seconds) == (full.steps, full.seconds)
    assert pruned.num_leaves <= full.num_leaves
    leaves = dict(full.leaves)
    for name in WHOLE_VICTIM_POLICIES:
        stats, choices = recorded_run(name, trace, placement, setup, cost)
        assert leaves[tuple(choices)] == stats.num_steps, name  # its run is that branch
        assert full.steps <= stats.num_steps, name
    replay = simulate(trace, placement, setup, ScriptedVictims(full.choices), cost)
    assert (replay.num_steps, replay.seconds, replay.finished_tokens) == (
        full.steps,
        full.seconds,
        full.finished_tokens,
    )


def test_the_optimum_beats_some_policy_strictly():
    """On this instance pressure_aware and belady take, at the one decision, the request that frees
    the most on the short device; another choice finishes 7 steps sooner."""
    trace, placement, setup, cost = small_instance(num_sequences=5)
    best = search_optimum(trace, placement, setup, cost)
    steps = {name: simulate(trace, placement, setup, name, cost).num_steps for name in WHOLE_VICTIM_POLICIES}
    assert best.steps < min(steps["pressure_aware"], steps["belady"])


def test_a_script_index_out_of_range_is_named():
    trace, placement, setup, cost = small_instance(num_sequences=5)
    with pytest.raises(ValueError, match=r"script\[0\]=7 is not a candidate index"):
        simulate(trace, placement, setup, ScriptedVictims([7]), cost)


def test_bench_optimum_refuses_the_options_it_would_ignore():
    from moekv_ref.apps.bench_eviction import build_parser, check_args

    with pytest.raises(ValueError, match="--optimum runs .* alone: --quick, --host-blocks would be ignored"):
        check_args(build_parser().parse_args(["--optimum", "--quick", "--host-blocks", "4"]))
    check_args(build_parser().parse_args(["--optimum"]))  # alone: accepted


def test_figures_optimum_json_is_what_the_bench_computes_and_no_whole_victim_policy_beats_it():
    """figures/eviction_optimum.json (notebook 05's table): one instance recomputed (the quickest),
    and in every instance the optimum at most every whole-victim policy, at least the bound."""
    import json
    from pathlib import Path

    from moekv_ref.apps.bench_eviction import OPTIMUM_INSTANCES, compare_with_optimum

    rows = json.loads(
        (Path(__file__).resolve().parents[2] / "figures" / "eviction_optimum.json").read_text()
    )["instances"]
    assert [(r["num_sequences"], r["mean_output"], r["seed"]) for r in rows] == list(OPTIMUM_INSTANCES)
    for row in rows:
        steps = row["optimum"]["steps"]
        assert all(
            steps <= row["policies"][name]["steps"]
            for name in row["policies"]
            if name in WHOLE_VICTIM_POLICIES
        )
        assert row["bound"]["steps"] <= steps <= row["optimum"]["worst_steps"]
    quickest = next(r for r in rows if r["num_sequences"] == 10)
    again = compare_with_optimum([(10, 24, 0)])[0]
    assert again["optimum"]["steps"] == quickest["optimum"]["steps"]
    assert again["optimum"]["worst_steps"] == quickest["optimum"]["worst_steps"]
    assert {k: v["steps"] for k, v in again["policies"].items()} == {
        k: v["steps"] for k, v in quickest["policies"].items()
    }
