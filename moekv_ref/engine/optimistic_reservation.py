"""OptimisticReservation: a ReservationPolicy (reservation.py) that, instead of WorstCaseReservation's
most a step's tokens could take, reserves what they are expected to take, and answers a step that
runs short with a Retry: the step is undone and scheduled again.

A decode token reserves nothing (its blocks are found as the routers decide) and a prefill or
recompute chunk the blocks the predictor expects of it, spread over the devices by their share of
the experts (the worst case where rows live on their sequence's home device, or a row budget caps
them). When a layer finds its device full, the engine (engine.py) and the trace runner
(sim/runner.py) undo the step (undo.py) and schedule it again as `retry` says. continuous_paged only:
the baselines' admission reserves whole lifetimes.
"""

from __future__ import annotations

import torch

from .reservation import ReservationPolicy, Retry


def expert_share(memory) -> torch.Tensor | None:
    """(D,) each device's share of the experts, where rows live on their experts' devices and no
    budget caps them; None otherwise."""
    experts_on = None if memory.max_row_tokens is not None else memory.placement.experts_per_device()
    if experts_on is None:
        return None
    return experts_on.sum(0).double() / experts_on.sum()  # (D,)


class OptimisticReservation(ReservationPolicy):
    """Reserve the expected blocks of prefill chunks and nothing for decode tokens; retry a step
    that ran short (module docstring)."""

    name = "optimistic"
    retries = True

    def step_needs(self, requests, num_tokens, worst_case, memory, predictor) -> torch.Tensor:
        needs = torch.zeros(len(requests), memory.num_devices, dtype=torch.int64)
        chunks = [
            i for i, (r, n) in enumerate(zip(requests, num_tokens)) if n > 1 or r.num_computed_tokens == 0
        ]
        if not chunks:
            return needs
        share = expert_share(memory)
        if share is None:
            needs[chunks] = worst_case([requests[i] for i in chunks], [num_tokens[i] for i in chunks])
            return needs
        for i in chunks:
            done = requests[i].num_computed_tokens
            expected = predictor.predict(done + num_tokens[i]) - (predictor.predict(done) if done else 0)
            needs[i] = torch.ceil(share * max(expected, 0)).to(torch.int64)
        return needs

    def may_run_short(self, running, may_join, worst_case, memory, token_budget) -> bool:
        """Whether a request may join the next step or the worst case of every running request's
        next tokens exceeds some device's free blocks."""
        if may_join:
            return True
        if not running:
            return False
        planned = [self.chunk_tokens(r, token_budget) for r in running]
        worst = worst_case(running, planned).sum(0)  # (D,)
        return not bool((worst <= memory.num_free_blocks_per_device).all())

    def retry(self, out, error, previous: Retry | None) -> Retry:
        """A try that admitted or resumed k requests is retried with at most k // 2 of them (at least
        one when nothing else runs: a request alone fits), since dropping joiners may be enough and
        preempting running requests to make room for new ones would thrash; a try that admitted none
        is retried admitting none, with its shortfall added to the tries' so far, which the victim
        policy frees first."""
        joined = len(out.admitted) + len(out.resumed)
        shortfall = torch.zeros_like(error.shortfall) if previous is None else previous.shortfall
        if joined:
            alone = joined == len(out.scheduled)  # nothing else ran in the try
            return Retry(shortfall, max(joined // 2, 1 if alone else 0))
        return Retry(shortfall + error.shortfall, 0)
