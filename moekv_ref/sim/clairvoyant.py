"""ClairvoyantReservation: a ReservationPolicy (engine/reservation.py) for trace replay only, which
reads the trace's future: each request's next tokens reserve exactly the blocks the trace will make
them take on each device.

No step then runs short and no block is set aside that goes unused, so at the same admission and
victim policies no reservation admits more or preempts less: the bound the others are measured
against. The engine serving live requests has no future to read.
"""

from __future__ import annotations

import torch

from ..engine.reservation import ReservationPolicy


class ClairvoyantReservation(ReservationPolicy):
    """Reserve what the trace will take (module docstring). future: the runner's TraceFuture."""

    name = "clairvoyant"

    def __init__(self, future):
        self.future = future

    def step_needs(self, requests, num_tokens, worst_case, memory, predictor) -> torch.Tensor:
        needs = torch.zeros(len(requests), memory.num_devices, dtype=torch.int64)
        for i, (request, n) in enumerate(zip(requests, num_tokens)):
            held = self.future.held(request.request_id)  # (len + 1, D) after each token count
            done = request.num_computed_tokens  # it holds held[done] (nothing swapped: recompute only)
            needs[i] = held[done + n] - held[done]
        return needs
