"""The refusal of a request that might not fit the pool even alone: preemption frees only *other*
sequences' memory, so once admitted it could never finish (Scheduler.check_fits_alone)."""

from __future__ import annotations

from typing import Callable

import torch

from .demand import min_lifetime_blocks, worst_case_lifetime_blocks_per_device
from .memory import MemoryView


def check_fits_alone(
    memory: MemoryView,
    max_blocks_alone: Callable[[int], int],
    prompt_len: int,
    max_new_tokens: int,
    request_id: int = 0,
) -> None:
    """ValueError if a request of this shape might not fit the pool (max_blocks_alone: the batching
    policy's most blocks of a request of so many cached tokens) or one of its devices even alone.
    request_id: whose rows' devices to check (with home devices they depend on it)."""
    shape = memory.shape
    num_blocks = memory.num_blocks
    num_tokens = prompt_len + max_new_tokens - 1
    worst = max_blocks_alone(num_tokens)
    if worst <= num_blocks:
        _check_fits_each_device(memory, prompt_len, max_new_tokens, request_id)
        return
    # capped rows lower the fewest blocks as they lower the most
    least = min_lifetime_blocks(
        num_tokens, memory.num_layers, shape.k_min, memory.block_size, memory.layer_limits
    )
    verdict = "can never fit" if least > num_blocks else "may not fit even alone"
    prompt_worst = max_blocks_alone(prompt_len)
    if prompt_worst > num_blocks:
        fix = (
            f"the prompt alone may need {prompt_worst}: give the pool at least {worst} blocks "
            "or shorten the prompt"
        )
    else:
        longest = max(t for t in range(prompt_len, num_tokens + 1) if max_blocks_alone(t) <= num_blocks)
        fix = (
            f"lower max_new_tokens to at most {longest - prompt_len + 1}, or give the pool at least "
            f"{worst} blocks"
        )
    raise ValueError(
        f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} {verdict} in the "
        f"pool of {num_blocks} blocks: it needs at least {least} and up to {worst} blocks "
        f"({memory.num_layers} layers, up to {shape.k_max} experts per token, "
        f"block size {memory.block_size}); {fix}"
    )


def _check_fits_each_device(
    memory: MemoryView, prompt_len: int, max_new_tokens: int, request_id: int
) -> None:
    worst = worst_case_lifetime_blocks_per_device(
        torch.tensor([prompt_len + max_new_tokens - 1]),
        memory.shape.k_max,
        memory.block_size,
        memory.placement.of_sequences([request_id]),
        memory.num_devices,
        memory.max_row_tokens,
    )[0]  # (D,)
    over = (worst > memory.blocks_per_device).nonzero().squeeze(1)
    if over.numel():
        d = int(over[0])
        raise ValueError(
            f"request of {prompt_len} prompt tokens + max_new_tokens={max_new_tokens} may not "
            f"fit device {d} even alone: its rows there may need up to {int(worst[d])} blocks, "
            f"the device has {int(memory.blocks_per_device[d])}; lower max_new_tokens or give "
            f"device {d} at least {int(worst[d])} blocks"
        )
