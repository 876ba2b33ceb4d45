"""Per-device predicted admission (engine/per_device_admission.py): the predicted peak checked on
every device. On one pool it is the summed rule exactly; where one device fills first it refuses
what the summed rule lets in, which would be preempted later."""

import random

import torch

from moekv_ref.cache.kv_cache_manager import KVCacheManager
from moekv_ref.engine.admission import predicted_peak
from moekv_ref.engine.memory import ModelShape
from moekv_ref.engine.per_device_admission import predicted_peak_per_device
from moekv_ref.engine.request import Request
from moekv_ref.engine.scheduler import Scheduler
from moekv_ref.engine.scheduler_config import SchedulerConfig
from moekv_ref.sampling import SamplingParams

SHAPE = ModelShape(k_max=2, k_min=1, max_num_positions=64)


def scheduler_on(blocks_per_device: list[int], admission: str) -> Scheduler:
    """2 layers x 4 experts, block size 4; with two devices, experts 0 and 1 on device 0."""
    if len(blocks_per_device) == 1:
        manager = KVCacheManager(2, 4, 4, blocks_per_device[0])
    else:
        manager = KVCacheManager(2, 4, 4, blocks_per_device=blocks_per_device, device_of_expert=[0, 0, 1, 1])
    return Scheduler(SchedulerConfig(max_num_seqs=8, admission=admission), manager, SHAPE)


def serve_step(scheduler: Scheduler, step: int, experts: torch.Tensor) -> None:
    """schedule(), every scheduled token routed to `experts` (E,) in both layers, then the update."""
    out = scheduler.schedule(step)
    manager = scheduler.manager
    for item in out.scheduled:
        seq = item.request.request_id
        if seq not in manager.sequences:
            manager.add_sequence(seq)
        rows = manager.index.sequence_rows(torch.tensor([manager.seq_index(seq)]))[0]
        manager.allocate_slots(rows, (experts * item.num_tokens).repeat(2))
    scheduler.update_from_output(out, {item.request.request_id: 1 for item in out.scheduled if item.samples})


def request(request_id: int, prompt_len: int, max_new_tokens: int) -> Request:
    return Request(request_id, [7] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens))


def test_on_one_pool_the_per_device_peak_is_the_summed_one():
    """Fresh random states (running requests part-way, waiting ones): the two formulas agree."""
    rng = random.Random(7)
    for _ in range(20):
        scheduler = scheduler_on([400], "optimistic")
        for i in range(rng.randint(2, 6)):
            scheduler.add_request(request(i, rng.randint(1, 12), rng.randint(1, 10)))
        for step in range(rng.randint(1, 4)):
            serve_step(
                scheduler, step, torch.tensor([1, 1, 0, 0]) if step % 2 else torch.tensor([0, 1, 1, 0])
            )
        requests = [*scheduler.running, *scheduler.waiting]
        per_device = predicted_peak_per_device(requests, scheduler.memory, scheduler.predictor)
        assert per_device.tolist() == [predicted_peak(requests, scheduler.memory, scheduler.predictor)]


def test_a_device_the_routing_fills_first_refuses_what_the_sum_lets_in():
    """Request 0 routes every token to experts 0 and 1 (device 0, 20 blocks). Summed over both
    devices (40 blocks) the predicted peak with request 1 fits; on device 0, where the running
    requests' share puts request 1 too, it does not: per-device admission waits, the summed rule
    admits."""
    decisions = {}
    for admission in ("predicted", "predicted_per_device"):
        scheduler = scheduler_on([20, 20], admission)
        scheduler.add_request(request(0, 8, 4))
        serve_step(scheduler, 0, torch.tensor([1, 1, 0, 0]))
        scheduler.add_request(request(1, 2, 4))
        out = scheduler.schedule(1)
        decisions[admission] = [r.request_id for r in out.admitted]
        requests = [*scheduler.running, *scheduler.waiting]
        peak = predicted_peak_per_device(requests, scheduler.memory, scheduler.predictor)
        decisions[admission + " peak"] = peak.tolist()
        decisions[admission + " summed"] = predicted_peak(requests, scheduler.memory, scheduler.predictor)
    assert decisions["predicted"] == [1] and decisions["predicted_per_device"] == []
    device_0, device_1 = decisions["predicted_per_device peak"]
    assert device_0 > 20 >= device_1 and decisions["predicted summed"] <= 40
    assert device_1 == 0  # the waiting request split as the running ones are: all on device 0
