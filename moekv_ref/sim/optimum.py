"""The exact offline optimum over victim choices, on small instances: an exhaustive search.

Every decision of the Scheduler that the trace runner (runner.py) drives stays as it is but one: each time
a step does not fit, which candidate (a running request not yet scheduled this step, or the one
being scheduled) is preempted, whole. The optimum finishes every served request in the fewest steps
(ties: fewest modelled seconds; every schedule generates the same tokens). It is a floor for the
policies whose victims are whole candidates (newest_first, sequence_lru, pressure_aware, belady:
each run is one branch), not for oracle (it also vetoes admissions) nor expert_lru (it evicts rows).

Depth first over decisions with >= 2 candidates: a branch runs the real Scheduler with
ScriptedVictims, which raises NeedChoice at the first decision its script does not cover.
`Scheduler.schedule` cannot be copied half-way, so the runner is deep-copied at the start of every
step and a child replays the step's earlier choices from there. Branch and bound: a request with g
tokens left needs g more steps. States are not memoised (branches rarely meet, and the key would be
the hardest part to check), so instances are small: a few sequences, two devices.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..costs import CostModel
from ..engine.victims import VictimPolicy
from ..validation import is_integer, shown
from .runner import RunnerSetup, TraceRunner
from .traces import RoutingTrace


class NeedChoice(Exception):
    def __init__(self, num_candidates: int):
        super().__init__(
            f"a victim decision among {num_candidates} candidates that the script does not cover"
        )
        self.num_candidates = num_candidates


class ScriptedVictims(VictimPolicy):
    """At the i-th decision with two or more candidates, preempt candidates[script[i]] (0: the
    request being scheduled, which then waits)."""

    STATE = ("script", "used")

    name = "scripted"

    def __init__(self, script=()):
        self.follow(script)

    def follow(self, script) -> None:
        """From the next decision on, take the choices of `script`, from its first."""
        self.script = list(script)
        self.used = 0  # decisions taken from the script so far

    def choose_victim(self, candidates, memory, need):
        if len(candidates) == 1:
            return candidates[0]
        if self.used == len(self.script):
            raise NeedChoice(len(candidates))
        choice = self.script[self.used]
        if not is_integer(choice) or not 0 <= choice < len(candidates):
            raise ValueError(
                f"script[{self.used}]={shown(choice)} is not a candidate index: the decision has "
                f"{len(candidates)} candidates, so 0..{len(candidates) - 1}"
            )
        self.used += 1
        return candidates[choice]


@dataclass
class Optimum:
    """The best schedule (choices: a ScriptedVictims script) and the size of the search."""

    steps: int
    seconds: float
    choices: list[int]
    finished_tokens: int
    num_leaves: int  # complete schedules reached
    num_dead_ends: int  # branches where a step scheduled nothing (the engine raises)
    num_decisions: int  # branch points expanded
    pruned: bool
    worst_steps: int | None = None  # the most steps of any schedule (prune=False only: every leaf seen)
    wall_seconds: float = 0.0
    leaves: list[tuple[tuple[int, ...], int]] = field(
        default_factory=list
    )  # (choices, steps), keep_leaves only

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "modelled_seconds": self.seconds,
            "choices": self.choices,
            "finished_tokens": self.finished_tokens,
            "tokens_per_step": self.finished_tokens / self.steps,
            "leaves": self.num_leaves,
            "dead_ends": self.num_dead_ends,
            "decisions": self.num_decisions,
            "pruned": self.pruned,
            "worst_steps": self.worst_steps,
            "wall_seconds": self.wall_seconds,
        }


def search_optimum(
    trace: RoutingTrace,
    device_of_expert: torch.Tensor,
    setup: RunnerSetup,
    cost: CostModel,
    prune: bool = True,
    keep_leaves: bool = False,
    max_steps: int = 10_000,
) -> Optimum:
    """prune=False visits every leaf; keep_leaves=True keeps each leaf's (choices, steps)."""
    started = time.perf_counter()
    root = TraceRunner(trace, device_of_expert, setup, ScriptedVictims(), cost)
    memo_base = {id(trace): trace, id(cost): cost}  # shared and never changed: not copied
    best: dict = {}
    counts = {"leaves": 0, "dead": 0, "decisions": 0, "worst": 0}
    leaves = []

    def explore(
        start: TraceRunner,
        step: int,
        seconds: float,
        finished: int,
        choices: list[int],
        step_choices: list[int],
    ) -> None:
        """Run on from a copy of `start` (a runner at the start of `step`) with this step's
        decisions scripted, to the end, a dead end, a prune, or an uncovered decision, each of whose
        choices is explored from `start`. choices: the whole branch's."""
        runner, script = copy.deepcopy(start, dict(memo_base)), step_choices
        scheduler = runner.scheduler
        while scheduler.has_unfinished:
            left = max(
                (
                    scheduler.batching.num_new_tokens(r) - len(r.output_token_ids)
                    for r in (*scheduler.waiting, *scheduler.running)
                ),
                default=0,
            )
            if prune and best and step + left > best["steps"]:
                return  # cannot beat the best, nor tie it
            if step >= max_steps:
                raise RuntimeError(f"a branch ran past max_steps={max_steps} without finishing")
            runner.policy.follow(script)
            try:
                out = scheduler.schedule(step)
            except NeedChoice as need:
                counts["decisions"] += 1
                taken = script[: runner.policy.used]
                for choice in range(need.num_candidates):
                    explore(start, step, seconds, finished, choices + [choice], taken + [choice])
                return
            if not out.scheduled and not out.block_copies:
                counts["dead"] += 1  # every request waits: the engine raises here
                return
            entries = runner.append(out)
            seconds += runner.step_seconds(out)  # after the append, which reads the step's hot device
            done = scheduler.update_from_output(
                out, {item.request.request_id: 0 for item in out.scheduled}, entries
            )
            finished += sum(len(r.output_token_ids) for r in done)
            step, script = step + 1, []
            if scheduler.has_unfinished:
                start = copy.deepcopy(runner, dict(memo_base))  # the next step's start
        counts["leaves"] += 1
        counts["worst"] = max(counts["worst"], step)
        if keep_leaves:
            leaves.append((tuple(choices), step))
        if not best or (step, seconds) < (best["steps"], best["seconds"]):
            best.update(steps=step, seconds=seconds, choices=list(choices), finished=finished)

    explore(root, 0, 0.0, 0, [], [])
    if not best:
        raise RuntimeError(
            f"no schedule of victim choices finishes: all {counts['dead']} branches end in a step "
            "that schedules nothing"
        )
    return Optimum(
        best["steps"],
        best["seconds"],
        best["choices"],
        best["finished"],
        counts["leaves"],
        counts["dead"],
        counts["decisions"],
        prune,
        None if prune else counts["worst"],
        time.perf_counter() - started,
        leaves,
    )
