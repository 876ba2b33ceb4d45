"""The model runner: its flat ragged batch (each request's tokens after the ones it has computed,
with their positions), and the swap copies it performs, in the order decided, moving exactly the
K/V of the blocks named."""

import torch
from helpers import random_model, small_config

from moekv_ref.cache.paged import PagedKVCache
from moekv_ref.engine.model_runner import ModelRunner, flatten_batch
from moekv_ref.engine.request import Request
from moekv_ref.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from moekv_ref.engine.swap import SWAP_IN, SWAP_OUT, BlockCopy
from moekv_ref.sampling import SamplingParams


def test_flat_batch_continues_each_request_where_its_cache_ends():
    prefill = Request(4, [10, 11, 12, 13, 14], SamplingParams())
    decode = Request(1, [20, 21], SamplingParams())
    decode.output_token_ids, decode.num_computed_tokens = [22, 23], 3  # 23 is pending
    chunk = Request(7, list(range(30, 40)), SamplingParams())
    chunk.num_computed_tokens = 4
    batch = flatten_batch(
        [ScheduledRequest(prefill, 5, 0), ScheduledRequest(decode, 1, 0), ScheduledRequest(chunk, 3, 0)]
    )
    assert batch.token_ids == [10, 11, 12, 13, 14, 23, 34, 35, 36]
    assert batch.seq_ids == [4] * 5 + [1] + [7] * 3
    assert batch.positions == [0, 1, 2, 3, 4, 3, 4, 5, 6]
    assert batch.num_tokens == [5, 1, 3]


def test_block_copies_move_exactly_the_named_blocks_in_order():
    model = random_model(small_config("expert", "threshold"), seed=0)
    cache = PagedKVCache.for_model(model, block_size=4, num_blocks=16)
    runner = ModelRunner(model, cache, num_swap_blocks=4)
    cache.key_cache.copy_(
        torch.arange(cache.key_cache.numel(), dtype=cache.key_cache.dtype).view_as(cache.key_cache)
    )
    cache.value_cache.copy_(-cache.key_cache)
    keys, values = cache.key_cache.clone(), cache.value_cache.clone()
    # out: device 5, 3 -> host 0, 1; then the freed device blocks are reused by a swap-in that
    # crosses them over (host 0 -> device 3, host 1 -> device 5): the copies out must have read them
    # first, or the swap-in would bring back the host pool's zeros
    runner.copy_blocks(
        [
            BlockCopy(SWAP_OUT, torch.tensor([5, 3]), torch.tensor([0, 1])),
            BlockCopy(SWAP_IN, torch.tensor([0, 1]), torch.tensor([3, 5])),
        ]
    )
    assert torch.equal(runner.host_key_cache[0], keys[5]) and torch.equal(runner.host_key_cache[1], keys[3])
    assert torch.equal(runner.host_value_cache[0], values[5])
    assert torch.equal(cache.key_cache[3], keys[5]) and torch.equal(cache.key_cache[5], keys[3])
    assert torch.equal(cache.value_cache[3], values[5]) and torch.equal(cache.value_cache[5], values[3])
    untouched = [b for b in range(16) if b not in (3, 5)]
    assert torch.equal(cache.key_cache[untouched], keys[untouched])
    assert torch.equal(runner.host_key_cache[2:], torch.zeros_like(runner.host_key_cache[2:]))


def test_copies_then_a_forward_over_the_scheduled_requests():
    model = random_model(small_config("expert", "threshold"), seed=0)
    cache = PagedKVCache.for_model(model, block_size=4, num_blocks=16)
    runner = ModelRunner(model, cache, num_swap_blocks=2)
    cache.key_cache[2] = 7.0
    decision = SchedulerOutput(
        step=0, block_copies=[BlockCopy(SWAP_OUT, torch.tensor([2]), torch.tensor([1]))]
    )
    runner.copy_blocks(decision.block_copies)
    assert (runner.host_key_cache[1] == 7.0).all()
    request = Request(0, [1, 2, 3], SamplingParams())
    output = runner.forward(SchedulerOutput(step=1, scheduled=[ScheduledRequest(request, 3, 0)]).scheduled)
    assert output.last_logits.shape == (1, model.config.vocab_size) and output.num_tokens == 3
    assert output.entries_per_layer.shape == (model.config.num_hidden_layers,)


def test_the_runner_returns_each_requests_logits_at_its_last_token():
    """last_logits[i] is request i's logits at its last scheduled token, after a ragged prefill
    (picked out of the flat batch) and after a decode step (every token a last one, taken as they
    are): a full recompute of each sequence, float64, to 1e-9."""
    model = random_model(small_config("expert", "threshold"), seed=1)
    runner = ModelRunner(model, PagedKVCache.for_model(model, block_size=4, num_blocks=32))
    a, b = Request(0, [5, 9, 2], SamplingParams()), Request(1, [7, 3], SamplingParams())
    prefill = runner.forward([ScheduledRequest(a, 3, 0), ScheduledRequest(b, 2, 0)])
    for request, token in ((a, 11), (b, 4)):
        request.num_computed_tokens, request.output_token_ids = request.num_tokens, [token]
    decode = runner.forward([ScheduledRequest(a, 1, 0), ScheduledRequest(b, 1, 0)])
    for output, lengths in ((prefill, (3, 2)), (decode, (4, 3))):
        for i, (request, length) in enumerate(zip((a, b), lengths)):
            full = model(torch.tensor([request.all_token_ids[:length]])).logits[0, -1]
            torch.testing.assert_close(output.last_logits[i], full, rtol=0, atol=1e-9)
