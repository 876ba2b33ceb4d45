"""Notebook 05's exercise: a victim rule for per-device pools."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..engine.request import Request, RequestStatus
from ..engine.victims import Shortage, VictimPolicy, room_and_lost_work
from ..sampling import SamplingParams
from ..sim.runner import RunnerSetup, simulate
from ..sim.workloads import skewed_workload, workload_cost_model
from .checks import MISSING, RIGHT, WRONG, wrapped


def exercise_05_setup():
    """(trace, device_of_expert, setup, cost): notebook 05's widget workload (20 sequences of 32 prompt
    and 128 output tokens on average, 4 layers, 16 experts on 4 devices placed by co-activation, topic
    skew 1.5), 160 blocks of 16 per device, recompute only."""
    trace, _, placement = skewed_workload(
        num_sequences=20, num_layers=4, num_devices=4, mean_prompt=32, mean_output=128, topic_s=1.5, seed=0
    )
    setup = RunnerSetup(blocks_per_device=160, block_size=16, max_num_seqs=16)
    return trace, placement, setup, workload_cost_model(trace, setup.block_size)


def room_on_short_device(order: int, request, memory, need) -> int:
    """Blocks preempting candidates[order] makes free on the short device (need.device): those it
    holds there, plus, for the request being scheduled (order 0), what its step would take there
    (need.request_need)."""
    return room_and_lost_work(order, request, memory, need)[0]


def solution_victim_rule(candidates, memory, need):
    """Preempt the candidate that makes the most room on the short device (ties: the newest)."""
    return max(enumerate(candidates), key=lambda item: (room_on_short_device(*item, memory, need), item[0]))[
        1
    ]


def _run_victim_rule(choose) -> tuple:
    """Run the rule as the scheduler's victim policy over the exercise's trace; returns (stats,
    decisions, error). Each decision is (short device, [(request id, order, blocks there, step blocks
    there, blocks everywhere)], chosen request id)."""
    decisions = []

    class ReaderRule(VictimPolicy):
        name = "your rule"

        def choose_victim(self, candidates, memory, need):
            choice = choose(list(candidates), memory, need)
            if not any(choice is c for c in candidates):
                raise ValueError(f"the rule returned {choice!r}; return one of the candidates given to it")
            entries = []
            for order, request in enumerate(candidates):
                held = memory.blocks_held_per_device(request.request_id)  # (D,)
                entries.append(
                    (
                        request.request_id,
                        order,
                        int(held[need.device]),
                        need.request_need if order == 0 else 0,
                        int(held.sum()),
                    )
                )
            decisions.append((need.device, entries, choice.request_id))
            return choice

    trace, placement, setup, cost = exercise_05_setup()
    try:
        stats = simulate(trace, placement, setup, ReaderRule(), cost)
    except Exception as error:  # the reader's code: report it, do not crash the notebook
        return None, decisions, error
    return stats, decisions, None


# Shortages the run rarely meets, put to the rule by hand: on the exercise's workload the request
# being scheduled seldom needs enough blocks for its own step to change the choice, and the request
# holding most on the short device usually holds most everywhere too. Each: (short device, request
# need, [blocks held per device of each candidate, oldest first]).
EXERCISE_05_SHORTAGES = (
    # the request being scheduled (2 held + 5 for its step) makes more room than request 101 (6 held);
    # request 102 holds most over every device but little on the short one
    (1, 5, [[0, 2, 1, 0], [1, 6, 0, 1], [9, 1, 8, 3]]),
    # request 101 holds most on the short device; request 102 holds most over every device
    (2, 0, [[1, 0, 1, 1], [0, 1, 4, 0], [5, 1, 2, 4]]),
)


class _ShortageMemory:
    """The part of the scheduler's MemoryView a victim rule reads, for a hand-built shortage."""

    has_swap_space = False

    def __init__(self, held: dict[int, list[int]]):
        self._held = {request_id: torch.tensor(blocks) for request_id, blocks in held.items()}
        self.num_devices = len(next(iter(held.values())))

    def blocks_held_per_device(self, request_id: int) -> torch.Tensor:
        return self._held[request_id].clone()


def _victim_rule_on_shortages(choose) -> list:
    """The rule's decisions on EXERCISE_05_SHORTAGES, in _run_victim_rule's format."""
    decisions = []
    for device, request_need, held in EXERCISE_05_SHORTAGES:
        candidates = [
            Request(
                100 + order,
                [0] * 16,
                SamplingParams(max_new_tokens=16),
                status=RequestStatus.RUNNING,
                num_computed_tokens=16 * sum(blocks),
            )
            for order, blocks in enumerate(held)
        ]
        memory = _ShortageMemory({r.request_id: blocks for r, blocks in zip(candidates, held)})
        need = Shortage(device, 1, request_need)
        choice = choose(list(candidates), memory, need)
        if not any(choice is c for c in candidates):
            raise ValueError(f"the rule returned {choice!r}; return one of the candidates given to it")
        entries = [
            (r.request_id, order, blocks[device], request_need if order == 0 else 0, sum(blocks))
            for order, (r, blocks) in enumerate(zip(candidates, held))
        ]
        decisions.append((device, entries, choice.request_id))
    return decisions


@lru_cache(maxsize=None)
def _exercise_05_baseline():
    trace, placement, setup, cost = exercise_05_setup()
    return simulate(trace, placement, setup, "sequence_lru", cost)


@wrapped
def check_victim_rule(choose) -> str:
    """Does `choose(candidates, memory, need)` always preempt a request making the most room on the
    short device? Runs it as the scheduler's victim policy over a trace, puts it to the hand-built
    EXERCISE_05_SHORTAGES (where the usual mistakes choose differently), and checks every decision;
    names the usual mistakes."""
    if choose is None:
        return (
            f"{MISSING}: replace None with your function choose(candidates, memory, need) that returns "
            f"one of the candidates. Hint: memory.blocks_held_per_device(r.request_id)[need.device] is "
            f"what request r holds on the short device; the first candidate's step would also take "
            f"need.request_need blocks there."
        )
    if not callable(choose):
        return f"{WRONG}: {choose!r} is not a function; write def choose(candidates, memory, need): ..."
    stats, decisions, error = _run_victim_rule(choose)
    num_run = len(decisions)
    if error is None:
        try:
            decisions += _victim_rule_on_shortages(choose)
        except Exception as raised:  # the reader's code: report it, do not crash the notebook
            error = raised
    if error is not None:
        return f"{WRONG}: the run stopped with an error from your rule: {type(error).__name__}: {error}"
    if not decisions:
        return (
            f"{WRONG}: the workload needed no eviction, so the rule was never asked (this should not happen)."
        )

    def room(entry):
        return entry[2] + entry[3]

    missed = []
    for index, (device, entries, chosen) in enumerate(decisions):
        chosen_entry = next(e for e in entries if e[0] == chosen)
        if room(chosen_entry) < max(room(e) for e in entries):
            missed.append((device, entries, chosen_entry, index >= num_run))
    base = _exercise_05_baseline()
    if not missed:
        return (
            f"{RIGHT}: every one of the {len(decisions)} decisions ({num_run} in the run, "
            f"{len(decisions) - num_run} on shortages built by hand) took a request making the most room "
            f"on the short device. Over the run it freed {stats.freed_per_eviction:.1f} blocks there per "
            f"eviction ({stats.num_evictions} evictions, {stats.recomputed_tokens} tokens recomputed, "
            f"{stats.num_steps} steps) where sequence_lru, which takes the newest request wherever its "
            f"blocks are, freed {base.freed_per_eviction:.1f} ({base.num_evictions} evictions, "
            f"{base.num_steps} steps). pressure_aware also divides the room by what the eviction costs."
        )
    device, entries, chosen_entry, by_hand = missed[0]
    best = max(entries, key=room)
    newest = all(chosen == max(entries, key=lambda e: e[1])[0] for _, entries, chosen in decisions)
    held_only = all(
        next(e for e in entries if e[0] == chosen)[2] == max(e[2] for e in entries)
        for _, entries, chosen in decisions
    )
    everywhere = all(
        next(e for e in entries if e[0] == chosen)[4] == max(e[4] for e in entries)
        for _, entries, chosen in decisions
    )
    lowest = all(
        room(next(e for e in entries if e[0] == chosen)) == min(room(e) for e in entries)
        for _, entries, chosen in decisions
    )
    first = "a shortage the check builds by hand" if by_hand else "one of the run"
    where = (
        f"In {len(missed)} of {len(decisions)} decisions ({num_run} in the run, "
        f"{len(decisions) - num_run} on shortages built by hand) it did not take the request making "
        f"the most room; the first, {first}: device {device} was short and you took request "
        f"{chosen_entry[0]}, which makes {room(chosen_entry)} block(s) of room there, while request "
        f"{best[0]} would have made {room(best)}."
    )
    if newest:
        return (
            f"{WRONG}: your rule takes the newest request, sequence_lru's rule, which never looks at "
            f"where memory is short. {where}"
        )
    if lowest:
        return f"{WRONG}: your rule takes the request making the *least* room (min instead of max?). {where}"
    if held_only:
        return (
            f"{WRONG}: your rule counts the blocks a request holds on the short device but not the "
            f"blocks the first candidate's step would take there (need.request_need), which preempting "
            f"it also spares. {where}"
        )
    if everywhere:
        return (
            f"{WRONG}: your rule counts a request's blocks on every device; only the short device is "
            f"short, and blocks freed elsewhere do not help it. {where}"
        )
    return f"{WRONG}: {where}"
