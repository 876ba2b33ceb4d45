import pytest

from moekv_ref.config import PRESETS, ModelConfig, get_config


def test_presets_have_real_kv_sizes():
    # Mixtral: 8 KV heads x 128 x (K and V) x 2 bytes (bf16) per token per layer; dense attention is
    # one expert per token, so a token costs 32 layers of that
    assert get_config("mixtral-8x7b").kv_bytes_per_entry() == 8 * 128 * 2 * 2
    assert get_config("mixtral-8x7b").kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    # DeepSeek-V3 MLA: one latent of 512 + 64 values per token per layer, 61 layers
    assert get_config("deepseek-v3").kv_values_per_entry == 576
    assert get_config("deepseek-v3").kv_bytes_per_token == 61 * 576 * 2
    # tiny in float32: 2 heads x 32 x (K and V) x 4 bytes per entry, 4 layers x top-2 entries per token
    assert get_config("tiny").kv_bytes_per_entry(4) == 2 * 32 * 2 * 4
    assert get_config("qwen3-30b-a3b").num_local_experts == 128
    assert get_config("jetmoe-8b").num_attention_experts == 8
    assert get_config("tiny").max_kv_entries_per_token == 4 * 2
    assert set(PRESETS) >= {"tiny", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "jetmoe-8b"}


def test_jetmoe_8b_caches_what_the_published_model_caches():
    # JetMoE-8B's config.json: 24 layers, num_key_value_heads=16, kv_channels=128, bfloat16; one
    # kv_proj per layer shared by its attention experts, so one K/V entry per layer per token
    layers, entries_per_layer, kv_heads, head_dim, bytes_per_value = 24, 1, 16, 128, 2
    real = get_config("jetmoe-8b")
    assert real.shared_kv
    assert real.kv_entries_per_layer == entries_per_layer
    assert real.kv_bytes_per_token == layers * entries_per_layer * 2 * kv_heads * head_dim * bytes_per_value
    assert real.kv_bytes_per_token == 196_608
    # the hypothetical expert-attention model of its shape: each of the top-2 experts keeps its own K/V
    expert_kv = get_config("jetmoe-8b-expert-kv")
    assert not expert_kv.shared_kv
    assert expert_kv.kv_entries_per_layer == 2
    assert expert_kv.kv_bytes_per_token == 2 * real.kv_bytes_per_token == 393_216
    assert {f: getattr(real, f) for f in real.architecture()} == expert_kv.architecture()


def test_shared_kv_is_for_sizing_only():
    from moekv_ref.costs import cluster_cost_model, project_step
    from moekv_ref.model import MoEKVTransformer

    shared = get_config("tiny", shared_kv=True)
    assert shared.max_kv_entries_per_token == 4
    with pytest.raises(ValueError, match="sizing only"):
        MoEKVTransformer(shared)
    with pytest.raises(ValueError, match="share K/V"):
        project_step(get_config("jetmoe-8b"), "kv_with_expert", 8, 256, 4096)
    with pytest.raises(ValueError, match="share K/V"):
        cluster_cost_model(get_config("jetmoe-8b"), 2.2e9, 8, 16)
    with pytest.raises(ValueError, match="must be True or False"):
        get_config("tiny", shared_kv=1)
    with pytest.raises(ValueError, match="needs attention_mode='expert'"):
        get_config("mixtral-8x7b", shared_kv=True)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt5'.*tiny"):
        get_config("gpt5")


def test_top_k_greater_than_experts():
    with pytest.raises(
        ValueError, match=r"num_attention_experts_per_tok=9 is greater than num_attention_experts=8"
    ):
        get_config("tiny", num_attention_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 is greater than num_local_experts=4"):
        get_config("tiny", num_experts_per_tok=5)


@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_hidden_layers",
        "head_dim",
        "num_attention_experts",
        "max_position_embeddings",
        "vocab_size",
    ],
)
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_must_be_positive(field, value):
    with pytest.raises(
        ValueError, match=rf"{field}={value} is not allowed; allowed: an integer in \[1, 2\*\*31 - 1\]"
    ):
        get_config("tiny", **{field: value})


def test_bad_modes_and_dense_shape():
    with pytest.raises(ValueError, match="attention_mode='sparse'"):
        ModelConfig(attention_mode="sparse")
    with pytest.raises(ValueError, match="attention_routing='random'"):
        ModelConfig(attention_routing="random")
    with pytest.raises(ValueError, match="E=1, k=1"):
        ModelConfig(attention_mode="dense")  # dense needs one attention expert
    with pytest.raises(ValueError, match="routing_threshold=1.5"):
        ModelConfig(routing_threshold=1.5)


def test_routing_is_not_architecture():
    tiny = get_config("tiny")
    assert tiny.with_routing("threshold").architecture() == tiny.architecture()
    assert ModelConfig.from_dict(tiny.to_dict()) == tiny
    with pytest.raises(ValueError, match="unknown config fields"):
        ModelConfig.from_dict({**tiny.to_dict(), "n_embd": 3})


def test_unknown_fields_are_named_a_few_at_a_time():
    """A dict of 100,000 unknown fields gets a message of a few lines: the first names and the count."""
    values = {**get_config("tiny").to_dict(), **{f"extra_{i}": i for i in range(100_000)}}
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict(values)
    message = str(info.value)
    assert len(message) < 1000, len(message)
    assert (
        "unknown config fields ['extra_0', 'extra_1', 'extra_2', 'extra_3', 'extra_4', and 99,995 more]"
        in message
    )
    assert "(100,000 in all); allowed: " in message
