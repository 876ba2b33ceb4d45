"""Admission policies: may the request at the head of the waiting line join the running ones?

    allows(request, running, memory, predictor) -> bool

asked only when the request's next step already fits and others are running (an empty engine
admits the head of the line, which fits alone).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..state import Stateful
from .demand import DemandPredictor
from .memory import MemoryView
from .request import Request, RequestStatus


class AdmissionPolicy(Stateful):
    # a policy that remembers something across steps lists it in STATE (moekv_ref/state.py)

    name = "admission"
    uses_prediction = False

    def allows(
        self, request: Request, running: Sequence[Request], memory: MemoryView, predictor: DemandPredictor
    ) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OptimisticAdmission(AdmissionPolicy):
    """Admit whenever the next step fits (vLLM's rule). Keeps the pool full and recovers by
    preempting when decode growth outruns it: cheap when preemption is cheap (swap), wasteful when it
    throws away prefill work (recompute)."""

    name = "optimistic"

    def allows(self, request, running, memory, predictor) -> bool:
        return True


class PredictedAdmission(AdmissionPolicy):
    """Admit while the pool's predicted peak fits (the default): the next step alone would let in
    requests that will certainly be preempted later (wasted prefill)."""

    name = "predicted"
    uses_prediction = True  # admission decides on the predictor's estimate

    def allows(self, request, running, memory, predictor) -> bool:
        return predicted_peak(list(running) + [request], memory, predictor) <= memory.num_blocks


def predicted_peak(requests: Sequence[Request], memory: MemoryView, predictor: DemandPredictor) -> int:
    """The most blocks the pool is predicted to hold at any future step while `requests` run.

    Generation runs to max_new_tokens, so each request's remaining steps g are known; its blocks
    grow from b, held now, to its predicted final demand f >= b, then all return when it finishes:

        demand_r(s) = b_r + (f_r - b_r) * (s + 1) / g_r   for s < g_r,   0 afterwards

    The sum peaks just before some request finishes, so it is evaluated at s = g_r - 1. Summing
    final demands would assume everyone peaks at once and leave the pool half idle.
    """
    held, final, remaining = [], [], []
    for r in requests:
        if r.status is RequestStatus.RUNNING:
            b = memory.num_blocks_held(r.request_id)
        elif memory.is_swapped(r.request_id):
            b = memory.num_blocks_swapped(r.request_id)
        else:  # its prefill (or recompute) arrives in one go
            b = predictor.predict(r.num_tokens)
        held.append(b)
        final.append(max(predictor.predict(r.max_cached_tokens), b))
        remaining.append(max(1, r.max_new_tokens - len(r.output_token_ids)))
    b, f, g = (torch.tensor(x, dtype=torch.float64) for x in (held, final, remaining))  # (k,) each
    s = g - 1  # (k,) peaks to test
    progress = torch.clamp((s[:, None] + 1) / g[None, :], max=1.0)  # (k steps, k requests)
    demand = torch.where(s[:, None] < g[None, :], b + (f - b) * progress, torch.zeros(()))  # (k, k)
    return int(math.ceil(float(demand.sum(1).max()) - 1e-9))


ADMISSIONS = {"predicted": PredictedAdmission, "optimistic": OptimisticAdmission}
