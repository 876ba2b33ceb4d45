"""Victim policies: when a device's pool is short, what to take off it.

Every policy answers one call,

    policy.choose(state, device, candidates) -> Eviction

where `device` is the short device, `candidates` the running sequences (a `Candidate` each: what it
holds on every device, what its tokens of this step would take there, its context, its admission
order), and `state` answers what a policy may ask of the serving state:

    state.cost               CostModel: recompute_seconds(context), swap_seconds(num_blocks)
    state.host_free_blocks   room left in the host swap space
    state.lru_rows(device)   rows holding blocks on the device, least recently appended first, with
                             their sequence ids: (rows (r,), seq_ids (r,), blocks (r,))
    state.remaining_tokens(seq_id)   tokens the sequence has still to generate (known to a server that
                             runs every request to its max_new_tokens; the simulator reads the trace)

An `Eviction` takes a whole sequence off every device (mode "recompute": its K/V are dropped and
rerun later; "swap": copied to host memory and back), or some of its rows (mode "rows": those rows
are dropped; the sequence cannot run again until it is recomputed). A policy may also veto
admissions (`admits`); only the oracle does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Candidate:
    seq_id: int
    order: int                   # admission / resumption order: larger is newer
    context: int                 # tokens a recompute would run again
    blocks: torch.Tensor         # (D,) blocks it holds on each device
    step_blocks: torch.Tensor    # (D,) blocks its tokens of this step would take on each device


@dataclass
class Eviction:
    seq_id: int
    mode: str                    # "recompute", "swap" or "rows"
    rows: torch.Tensor | None = None    # mode "rows": the rows dropped


def cheaper_mode(state, candidate: Candidate) -> str:
    """Swap when the host has room and copying the sequence's blocks out and back costs less than
    recomputing its context (CostModel: measured or projected); recompute otherwise."""
    num_blocks = int(candidate.blocks.sum())
    if num_blocks > state.host_free_blocks:
        return "recompute"
    return "swap" if state.cost.swap_seconds(num_blocks) < state.cost.recompute_seconds(candidate.context) \
        else "recompute"


def eviction_seconds(state, candidate: Candidate) -> float:
    return float(state.cost.swap_seconds(int(candidate.blocks.sum())) if cheaper_mode(state, candidate) == "swap"
                 else state.cost.recompute_seconds(candidate.context))


class VictimPolicy:
    name = "policy"

    def choose(self, state, device: int, candidates: list[Candidate]) -> Eviction:
        raise NotImplementedError

    def admits(self, state, seq_id: int) -> bool:
        return True


class SequenceLRU(VictimPolicy):
    """vLLM's choice: preempt the whole sequence that started (or resumed) last.

    Under continuous batching every running sequence is used at every step, so least-recently-used
    over sequences ties everywhere and comes down to the tie-break vLLM uses: the newest, which has
    the least work to lose. It never looks at *where* memory is short: the newest sequence may hold
    almost nothing on the short device, and then another and another must go."""
    name = "sequence_lru"

    def choose(self, state, device, candidates):
        victim = max(candidates, key=lambda c: c.order)
        return Eviction(victim.seq_id, cheaper_mode(state, victim))


class ExpertLRU(VictimPolicy):
    """What a cache per expert buffer would do: drop the least recently appended (sequence, layer,
    expert) rows of the short device, one row at a time, until the device has room.

    Low density makes this a poor fit: an expert's buffer holds rows of many sequences, each touched
    only when a token is routed there, so its least recently used rows belong to sequences that are
    running right now, whose next token may need them. A sequence that lost a row cannot run until
    the row is rebuilt, and a row at layer l can only be rebuilt by running the sequence's whole
    prefix through layers 0..l again: each row dropped costs a whole recompute and frees one row's
    blocks (the simulator counts that cost), while the sequence's other rows stay in memory."""
    name = "expert_lru"

    def choose(self, state, device, candidates):
        rows, seq_ids, _ = state.lru_rows(device)
        if rows.numel() == 0:
            raise RuntimeError(f"device {device} is short but holds no rows")
        return Eviction(int(seq_ids[0]), "rows", rows[:1])


class PressureAware(VictimPolicy):
    """The whole sequence that makes the most room on the *short* device per second of recompute
    (or of swap, when swapping it is cheaper): room = the blocks it holds there + the blocks its
    tokens of this step would have taken there. Sequences holding nothing there are never chosen
    while another does. Whole sequences, because a sequence missing one row cannot run (ExpertLRU)."""
    name = "pressure_aware"

    def choose(self, state, device, candidates):
        def score(c: Candidate):
            room = int(c.blocks[device] + c.step_blocks[device])
            return (room / max(eviction_seconds(state, c), 1e-12), c.order)
        victim = max(candidates, key=score)
        return Eviction(victim.seq_id, cheaper_mode(state, victim))


class Oracle(VictimPolicy):
    """The offline limit, simulator only: admits a request only when the whole future trace says
    that it and every running sequence, each running to completion, fit every device at every
    future step (`state.fits_to_completion`). Nothing admitted is ever evicted, so no work is lost
    and no swap is paid; what it gives up is the requests it holds back. If an eviction were needed
    anyway it would take the sequence with the most tokens still to generate (Belady's rule: the one
    needed furthest into the future)."""
    name = "oracle"

    def admits(self, state, seq_id):
        return state.fits_to_completion(seq_id)

    def choose(self, state, device, candidates):
        victim = max(candidates, key=lambda c: (state.remaining_tokens(c.seq_id), c.order))
        return Eviction(victim.seq_id, cheaper_mode(state, victim))


VICTIM_POLICIES = {cls.name: cls for cls in (SequenceLRU, ExpertLRU, PressureAware, Oracle)}


def make_policy(name: str) -> VictimPolicy:
    if name not in VICTIM_POLICIES:
        raise ValueError(f"policy={name!r} is not one of {tuple(VICTIM_POLICIES)}")
    return VICTIM_POLICIES[name]()
