"""Each fast path is the path that runs: break it, and the model's output must show it.

A fast path proven only by "gives the same tokens as the slow path" proves nothing if the slow path
quietly runs instead (a fallback that overwrites the fast result, a flag that never reaches the
dispatch). So every test here replaces one fast function with a broken one -- NaN, or the right
answer shifted by one -- and checks that the model's logits change: NaN must appear, or the shift
must be seen (NaN logits stop sampling with SamplingError, which is how NaN is seen here). Each
test would pass if the path were bypassed, so none is vacuous; and a first part
of each one checks the unbroken path against the torch model, so the breakage is what changes.

Paths and what stands in for them:
    triton decode      moekv_kernels.paged_attention   decode rows (one new token) of a layer, one launch
    triton store       moekv_kernels.store_kv          every new K/V written into the pool
    triton projections moekv_kernels.expert_gemm       every expert projection (Q/K/V/O and the FFN)
    batched            PagedKVCache._attend_padded   the torch path for every row (the default)
    grouped matmul     torch._grouped_mm             every expert projection of a float32 torch model
                                                     at inference (model.grouped_matmul), several experts
    every expert       model.swiglu_every_expert     an FFN step of few (token, expert) products: every
                                                     expert on every token, gated
    reference          attention.attend_by_position  the row-by-row path (via paged.py's import)
    decode slots       KVCacheManager.allocate_slots  a decode append's new slots, its rows in pair order
                                                     (no sort)
(The dense decode plan, PlannedPagedKVCache._append_planned, is broken the same way in
test_paged_cache.py.)
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers import max_logit_error, random_model, random_prompts, small_config  # noqa: E402

import moekv_kernels  # noqa: E402
import moekv_ref.cache.paged as paged  # noqa: E402
import moekv_ref.model as model_module  # noqa: E402
from moekv_ref.cache import PagedKVCache  # noqa: E402
from moekv_ref.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from moekv_ref.generate import generate  # noqa: E402
from moekv_ref.sampling import SamplingError, SamplingParams  # noqa: E402

# a 1-token prompt makes the prefill hold a decode row too; 3 forwards in all
PROMPT_LENGTHS = [5, 1, 9]
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0)


def _logits(model, attention=None):
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=4)
    options = {} if attention is None else {"attention": attention}
    result = generate(
        model,
        prompts,
        PARAMS,
        cache="paged",
        record_logits=True,
        block_size=4,
        num_blocks=256,
        shuffle_seed=0,
        **options,
    )
    return torch.cat(result.logits)  # (positions, V)


@pytest.fixture(scope="module")
def models():
    # threshold routing: tokens use 1 to 3 experts, so the rows of one sequence have ragged lengths
    return {
        backend: random_model(small_config(routing="threshold"), seed=3, dtype=torch.float32, backend=backend)
        for backend in ("torch", "triton")
    }


@pytest.fixture(scope="module")
def torch_logits(models):
    return _logits(models["torch"])


def _nan_like(result):
    return torch.full_like(result, float("nan"))


def test_triton_decode_output_is_the_kernels_output_bitwise(models):
    """The decode rows' attention is exactly what moekv_kernels.paged_attention returned (no other path
    writes over it)."""
    model = models["triton"]
    config = model.config
    cache = PagedKVCache.for_model(model, block_size=4, num_blocks=64, shuffle_seed=0)
    generator = torch.Generator().manual_seed(11)
    Hkv, H, Dh = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    # rows of 6, 3 and 1 tokens (prefill, several new tokens each), then one decode token per row
    seq_ids = torch.tensor([0] * 6 + [1] * 3 + [2])
    experts = torch.tensor([0] * 6 + [2] * 3 + [4])
    positions = torch.tensor(list(range(6)) + list(range(3)) + [0])
    n = seq_ids.numel()
    cache.append_kv(
        0,
        seq_ids,
        experts,
        positions,
        torch.randn(n, Hkv, Dh, generator=generator),
        torch.randn(n, Hkv, Dh, generator=generator),
    )
    appended = cache.append_kv(
        0,
        torch.tensor([0, 1, 2]),
        torch.tensor([0, 2, 4]),
        torch.tensor([6, 3, 1]),
        torch.randn(3, Hkv, Dh, generator=generator),
        torch.randn(3, Hkv, Dh, generator=generator),
    )
    q = torch.randn(3, H, Dh, generator=generator)
    out = cache.attend(appended, q)
    rows = appended.rows
    direct = moekv_kernels.paged_attention(
        q[torch.argsort(appended.pair_row)].contiguous(),
        cache.key_cache,
        cache.value_cache,
        cache.manager.block_tables[rows],
        cache.manager.row_tokens[rows].to(torch.int32),
    )
    assert torch.equal(out, direct[appended.pair_row])
    reference = PagedKVCache.for_model(
        model, block_size=4, num_blocks=64, shuffle_seed=0, attention="reference"
    )
    reference.key_cache.copy_(cache.key_cache), reference.value_cache.copy_(cache.value_cache)
    reference.manager = cache.manager
    assert (reference.attend(appended, q) - out).abs().max() < 1e-5  # and it is right


@pytest.mark.parametrize("broken", ["nan", "shifted"])
def test_triton_decode_kernel_reaches_the_logits(models, torch_logits, monkeypatch, broken):
    assert (_logits(models["triton"]) - torch_logits).abs().max() < 1e-4  # unbroken: equal
    original = moekv_kernels.paged_attention
    launches = []

    def broken_paged_attention(*args, **kwargs):
        launches.append(1)
        result = original(*args, **kwargs)
        return _nan_like(result) if broken == "nan" else result + 1.0

    monkeypatch.setattr(moekv_kernels, "paged_attention", broken_paged_attention)
    if broken == "nan":
        with pytest.raises(SamplingError, match="not finite"):  # NaN reached the logits
            _logits(models["triton"])
    else:
        assert (_logits(models["triton"]) - torch_logits).abs().max() > 1e-2
    assert launches, "the triton backend never launched the decode kernel"


def test_triton_store_kernel_reaches_the_logits(models, torch_logits, monkeypatch):
    original = moekv_kernels.store_kv

    def shifted_store_kv(k, v, key_cache, value_cache, slots):
        original(k + 1.0, v + 1.0, key_cache, value_cache, slots)

    monkeypatch.setattr(moekv_kernels, "store_kv", shifted_store_kv)
    assert (_logits(models["triton"]) - torch_logits).abs().max() > 1e-2


def test_triton_expert_gemm_reaches_the_logits(models, monkeypatch):
    original = moekv_kernels.expert_gemm

    def nan_expert_gemm(*args, **kwargs):
        return _nan_like(original(*args, **kwargs))

    monkeypatch.setattr(moekv_kernels, "expert_gemm", nan_expert_gemm)
    with pytest.raises(SamplingError, match="not finite"):
        _logits(models["triton"])


def test_batched_path_reaches_the_logits(models, torch_logits, monkeypatch):
    original = PagedKVCache._attend_padded

    def nan_attend_padded(self, appended, group, q, out):
        original(self, appended, group, q, out)
        out.fill_(float("nan"))

    monkeypatch.setattr(PagedKVCache, "_attend_padded", nan_attend_padded)
    with pytest.raises(SamplingError, match="not finite"):
        _logits(models["torch"])


def test_the_decode_only_batched_path_reaches_the_logits(models, monkeypatch):
    """A decode step (every row one new token) takes its own method, _attend_decode (no padded
    query table); NaN from it alone must reach the logits."""
    original = PagedKVCache._attend_decode
    calls = []

    def nan_when_decode_only(self, appended, q):
        calls.append(q.shape[0])
        return torch.full_like(original(self, appended, q), float("nan"))

    monkeypatch.setattr(PagedKVCache, "_attend_decode", nan_when_decode_only)
    with pytest.raises(SamplingError, match="not finite"):
        _logits(models["torch"])
    assert calls, "no decode step took the decode-only path"


def test_reference_path_reaches_the_logits(models, torch_logits, monkeypatch):
    assert (_logits(models["torch"], attention="reference") - torch_logits).abs().max() < 1e-5
    original = paged.attend_by_position
    monkeypatch.setattr(paged, "attend_by_position", lambda *args: original(*args) + 1.0)
    assert (_logits(models["torch"], attention="reference") - torch_logits).abs().max() > 1e-2


def test_torch_grouped_mm_reaches_the_logits(models, torch_logits, monkeypatch):
    """The experts' projections of the float32 torch model run on torch._grouped_mm; the per-expert
    loop (what runs without it) gives the same logits, and shifting its output shows in them."""
    calls = []
    original = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[1].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    monkeypatch.setattr(model_module, "EVERY_EXPERT_MAX_PRODUCTS", 0)  # the FFN's small steps grouped too
    assert (_logits(models["torch"]) - torch_logits).abs().max() < 1e-5  # the every-expert FFN's rounding
    config = models["torch"].config
    # 3 forwards x 2 layers x (2 attention projections: QKV fused, O; 3 FFN projections)
    assert calls.count(config.num_attention_experts) == 3 * config.num_hidden_layers * 2
    assert calls.count(config.num_local_experts) == 3 * config.num_hidden_layers * 3
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "_grouped_mm_applies", lambda x, weights: False)
        assert (_logits(models["torch"]) - torch_logits).abs().max() < 1e-5
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: original(*args, **kwargs) + 1.0)
    assert (_logits(models["torch"]) - torch_logits).abs().max() > 1e-2


def test_small_ffn_steps_run_every_expert_and_reach_the_logits(models, torch_logits, monkeypatch):
    """Up to EVERY_EXPERT_MAX_PRODUCTS (token, expert) products -- every forward here: 15 and 3
    tokens, 3 experts -- the FFN runs every expert on every token (model.swiglu_every_expert): the
    grouped path's logits, to 1e-12 in float64; and NaN from it reaches the logits."""
    model = random_model(small_config(routing="threshold"), seed=3)  # float64
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "EVERY_EXPERT_MAX_PRODUCTS", 0)
        grouped = _logits(model)
    assert 0 < (_logits(model) - grouped).abs().max() < 1e-12  # other arithmetic, same logits
    monkeypatch.setattr(
        model_module, "swiglu_every_expert", lambda x, *args: torch.full_like(x, float("nan"))
    )
    with pytest.raises(SamplingError):
        _logits(models["torch"])


def test_decode_slots_run_in_pair_order_and_reach_the_logits(models, torch_logits, monkeypatch):
    """A decode append (every pair the one new token of its row) is not sorted: append_kv hands
    allocate_slots its rows in pair order, and some decode appends give rows a block. Shifting the
    slots allocate_slots returns for those appends, and only those, shows in the logits."""
    calls = []
    original_allocate = KVCacheManager.allocate_slots

    def recording_allocate(self, rows, num_new_tokens):
        full = bool((self.row_tokens[torch.as_tensor(rows)] % self.block_size == 0).any())  # takes a block
        calls.append((torch.as_tensor(rows).clone(), torch.as_tensor(num_new_tokens).clone(), full))
        return original_allocate(self, rows, num_new_tokens)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", recording_allocate)
    assert (_logits(models["torch"]) - torch_logits).abs().max() == 0  # unbroken: equal
    decode = [call for call in calls if bool((call[1] == 1).all())]
    assert decode, "no append had one new token per row"
    assert any(full for _, _, full in decode), "no decode append took a block"
    assert any(bool((rows[1:] < rows[:-1]).any()) for rows, *_ in decode), "decode rows were sorted first"

    def shifted_decode_slots(self, rows, num_new_tokens):
        allocation = original_allocate(self, rows, num_new_tokens)
        if bool((torch.as_tensor(num_new_tokens) == 1).all()):  # the decode appends' slots only
            allocation.slot_mapping.add_(1)
        return allocation

    monkeypatch.setattr(KVCacheManager, "allocate_slots", shifted_decode_slots)
    assert (_logits(models["torch"]) - torch_logits).abs().max() > 1e-2


def test_dense_pairs_are_made_once_a_forward(monkeypatch):
    """With one attention expert every layer's (token, expert) pairs are the tokens: the model makes
    them once a forward and hands them to each layer (not once a layer), and cached decoding still
    equals full recompute."""
    model = random_model(small_config("dense"), seed=7, dtype=torch.float64)
    calls = []
    original = model_module.dense_pairs
    monkeypatch.setattr(model_module, "dense_pairs", lambda *args: calls.append(args) or original(*args))
    prompts = random_prompts([6, 3], model.config.vocab_size, seed=8)
    result = generate(
        model, prompts, SamplingParams(max_new_tokens=4, temperature=0.0), cache="paged", record_logits=True
    )
    assert model.config.num_hidden_layers == 2 and len(calls) == 4  # the prefill and 3 decode forwards
    assert max_logit_error(model, result) < 1e-10


@pytest.mark.parametrize("mode", ["dense", "expert"])
def test_rotary_turns_are_made_once_a_forward(monkeypatch, mode):
    """Every layer rotates the same positions: the cached forward looks their turns up once and
    hands them to each layer (expert pairs index them by token), and cached decoding still equals
    full recompute."""
    model = random_model(small_config(mode), seed=7, dtype=torch.float64)
    calls = []
    original = model_module.rotary_turns
    monkeypatch.setattr(
        model_module, "rotary_turns", lambda *args: calls.append(args[0].tolist()) or original(*args)
    )
    prompts = random_prompts([6, 3], model.config.vocab_size, seed=8)
    result = generate(
        model, prompts, SamplingParams(max_new_tokens=4, temperature=0.0), cache="paged", record_logits=True
    )
    assert model.config.num_hidden_layers == 2 and len(calls) == 4  # the prefill and 3 decode forwards
    assert calls[1] == [6, 3]  # the first decode: each sequence's position
    assert max_logit_error(model, result) < 1e-10
