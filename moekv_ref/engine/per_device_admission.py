"""PerDevicePredictedAdmission: an AdmissionPolicy (admission.py) that checks PredictedAdmission's
predicted peak on every device, not summed over them.

Summed over the devices, the predicted peak lets the device a routing skew fills first overflow
while the others have room: the requests then admitted are preempted later, their prefill thrown
away (a reservation that sets aside less than the worst case, like calibrated_reservation.py,
admits more and meets this more often). Here each request's predicted final blocks are split over
the devices by its share of them:

    a running (or swapped) request   its own share, the blocks it holds on each device
    a waiting request                the running requests' share together (their blocks held on
                                     each device over all they hold; each device's share of the
                                     experts when none runs)

and admission needs, on every device d, the predicted peak of the blocks there (admission.py's
formula, per device) to fit its blocks.
"""

from __future__ import annotations

import torch

from .admission import AdmissionPolicy
from .request import RequestStatus


class PerDevicePredictedAdmission(AdmissionPolicy):
    """Admit while the predicted peak fits every device (module docstring)."""

    name = "predicted_per_device"
    uses_prediction = True

    def allows(self, request, running, memory, predictor) -> bool:
        peak = predicted_peak_per_device(list(running) + [request], memory, predictor)  # (D,)
        return bool((peak <= memory.blocks_per_device).all())


def predicted_peak_per_device(requests, memory, predictor) -> torch.Tensor:
    """(D,) the most blocks each device is predicted to hold at any future step while `requests`
    run: admission.predicted_peak's held-to-final ramps, each request's split over the devices by
    its share (module docstring), the peak evaluated at every request's last step."""
    D = memory.num_devices
    if not requests:
        return torch.zeros(D, dtype=torch.int64)
    held = torch.zeros(len(requests), D, dtype=torch.float64)  # (k, D)
    waiting = []
    for i, r in enumerate(requests):
        if r.status is RequestStatus.RUNNING:
            held[i] = memory.blocks_held_per_device(r.request_id).double()
        elif memory.is_swapped(r.request_id):
            held[i, 0] = memory.num_blocks_swapped(r.request_id)  # (its split is unknown on the host)
            waiting.append(i)
        else:
            waiting.append(i)
    final = torch.maximum(
        predictor.predict_many([r.max_cached_tokens for r in requests]).double(), held.sum(1)
    )  # (k,) over all devices
    remaining = torch.tensor(
        [max(1, r.max_new_tokens - len(r.output_token_ids)) for r in requests], dtype=torch.float64
    )
    together = held.sum(0)  # (D,) the running requests' blocks on each device
    if float(together.sum()) > 0:
        prior = together / together.sum()
    else:
        experts = memory.placement.experts_per_device().sum(0).double()  # (D,)
        prior = experts / experts.sum()
    share = held / held.sum(1, keepdim=True).clamp(min=1)  # (k, D) each running request's own
    share[waiting] = prior
    for i in waiting:  # a waiting request's prefill arrives in one go: predicted, on the prior
        r = requests[i]
        held[i] = prior * max(predictor.predict(r.num_tokens), float(held[i].sum()))
    final_d = torch.maximum(final[:, None] * share, held)  # (k, D)
    s = remaining - 1  # (k,) the peaks to test: each request's last step
    progress = torch.clamp((s[:, None] + 1) / remaining[None, :], max=1.0)  # (k steps, k requests)
    alive = (s[:, None] < remaining[None, :]).double()  # (k, k)
    ramp = held[None, :, :] + (final_d - held)[None, :, :] * progress[:, :, None]  # (k, k, D)
    demand = (ramp * alive[:, :, None]).sum(1)  # (k steps, D)
    return torch.ceil(demand.max(0).values - 1e-9).to(torch.int64)
