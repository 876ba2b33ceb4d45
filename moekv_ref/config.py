"""Model configuration: one dataclass, validated, with derived sizes and named presets.

Field names follow the Hugging Face configs of the presets' models, except the attention-expert
fields, which are ours: no mainstream model routes attention with per-expert K/V (docs/design.md,
"Where per-expert caches come from"). Only `tiny` is ever built; the other presets size things.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .validation import (
    MAX_INT32,
    a_type,
    check_choice,
    check_int,
    check_keywords,
    check_real,
    keywords_of,
    known_keywords,
    shown,
)

ATTENTION_MODES = ("expert", "dense")
TOKEN_CHOICE_ROUTINGS = ("topk", "threshold")
ROUTINGS = TOKEN_CHOICE_ROUTINGS + ("expert_choice",)
BYTES_PER_DTYPE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8": 1}


@known_keywords
@dataclass(frozen=True)
class ModelConfig:
    """Shapes of an MoE transformer whose attention may itself be a mixture of experts (model.py's
    ExpertAttention); attention_mode "dense" is grouped-query attention, the E=1, k=1 case."""

    name: str = "custom"
    vocab_size: int = 256
    hidden_size: int = 128  # D
    num_hidden_layers: int = 4  # L
    num_attention_heads: int = 2  # H, per attention expert
    num_key_value_heads: int = 2  # Hkv, per attention expert (GQA when < H)
    head_dim: int = 32  # Dh
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # attention experts (our addition)
    attention_mode: str = "expert"
    num_attention_experts: int = 8  # E
    num_attention_experts_per_tok: int = 2  # K (k_max under threshold routing)
    attention_routing: str = "topk"
    routing_threshold: float = 0.5
    # at most this many tokens per (sequence, expert) row in training and recompute (routing.py's
    # apply_capacity) and in a cache (its budget: cache/budget.py's model_budget); 0: none
    attention_capacity: int = 0
    # the attention experts route only queries and outputs; K and V come from one projection that
    # they all share (Mixture of Attention heads, JetMoE), so a token caches one entry per layer,
    # not one per expert. Sizing only: model.py gives each expert its own K/V and refuses this.
    shared_kv: bool = False
    # feed-forward experts (Mixtral's names)
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192
    # multi-head latent attention (DeepSeek-V3), when kv_lora_rank > 0: see kv_values_per_entry
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # storage type of the KV cache, for sizing
    kv_cache_dtype: str = "float32"

    def __post_init__(self):
        # every size fits the int32 tables and kernels it ends up in (a row's tokens, block ids);
        # frozen: the checked value (a Python int) replaces what was given
        for field in (f.name for f in dataclasses.fields(self) if f.type == "int"):
            least = 0 if field in ("kv_lora_rank", "qk_rope_head_dim", "attention_capacity") else 1  # 0: none
            object.__setattr__(self, field, check_int(field, getattr(self, field), least, MAX_INT32))
        check_real("rope_theta", self.rope_theta, 0, low_open=True)
        check_real(
            "rms_norm_eps",
            self.rms_norm_eps,
            0,
            1,
            low_open=True,
            high_open=True,
            meaning="it keeps RMSNorm from dividing by zero and should be small",
        )
        check_real("routing_threshold", self.routing_threshold, 0, 1, low_open=True)
        if not isinstance(self.shared_kv, bool):
            raise ValueError(f"shared_kv={self.shared_kv!r} must be True or False")
        if self.shared_kv and self.attention_mode == "dense":
            raise ValueError(
                "shared_kv=True needs attention_mode='expert': dense attention has one K/V anyway"
            )
        if not isinstance(self.name, str):
            raise ValueError(f"name={shown(self.name)} is {a_type(self.name)}; allowed: a str")
        check_choice("attention_mode", self.attention_mode, ATTENTION_MODES)
        check_choice("attention_routing", self.attention_routing, ROUTINGS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(BYTES_PER_DTYPE))
        E, K = self.num_attention_experts, self.num_attention_experts_per_tok
        if self.attention_mode == "dense" and (E, K) != (1, 1):
            raise ValueError(
                "attention_mode='dense' is the E=1, k=1 case: num_attention_experts "
                f"and num_attention_experts_per_tok must be 1, got {E} and {K} "
                "(or use attention_mode='expert')"
            )
        if self.attention_routing == "expert_choice" and (K != E or self.attention_capacity == 0 or E == 1):
            raise ValueError(
                "attention_routing='expert_choice' lets each of several experts choose its "
                "tokens: it needs num_attention_experts > 1, num_attention_experts_per_tok equal "
                f"to it (every token is a candidate of every expert; got {K} of {E}) and "
                f"attention_capacity >= 1 (the tokens an expert keeps; got {self.attention_capacity})"
            )
        for k, e in (
            ("num_attention_experts_per_tok", "num_attention_experts"),
            ("num_experts_per_tok", "num_local_experts"),
        ):
            if getattr(self, k) > getattr(self, e):
                raise ValueError(
                    f"{k}={getattr(self, k)} is greater than {e}={getattr(self, e)}: top-k needs k <= E"
                )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0 and self.kv_lora_rank == 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    # ----- derived sizes --------------------------------------------------------------------------
    @property
    def kv_values_per_entry(self) -> int:
        """Numbers one token stores in one (layer, expert) row: K and V for every KV head, or the
        MLA latent (DeepSeek-V3 caches one compressed vector plus the rotary part of the key)."""
        if self.kv_lora_rank > 0:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    def kv_bytes_per_entry(self, bytes_per_value: int | None = None) -> int:
        """Bytes one token adds to one (layer, expert) row, in kv_cache_dtype by default."""
        b = BYTES_PER_DTYPE[self.kv_cache_dtype] if bytes_per_value is None else bytes_per_value
        return self.kv_values_per_entry * b

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token adds to the whole cache, at most (k_max experts per layer)."""
        return self.max_kv_entries_per_token * self.kv_bytes_per_entry()

    @property
    def kv_entries_per_layer(self) -> int:
        """K/V entries one token adds to one layer, at most: one per chosen expert (k_max), or one
        when the experts share K/V."""
        return 1 if self.shared_kv else self.num_attention_experts_per_tok

    @property
    def max_kv_entries_per_token(self) -> int:
        return self.num_hidden_layers * self.kv_entries_per_layer

    def with_routing(self, routing: str, threshold: float | None = None) -> "ModelConfig":
        """The same architecture with another attention routing (routing is not part of the weights)."""
        threshold = self.routing_threshold if threshold is None else threshold
        return dataclasses.replace(self, attention_routing=routing, routing_threshold=threshold)

    def architecture(self) -> dict:
        """The fields that decide the shapes of the weights; a checkpoint must match these."""
        keys = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "attention_mode",
            "num_attention_experts",
            "num_local_experts",
            "moe_intermediate_size",
        )
        return {key: getattr(self, key) for key in keys}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        if not isinstance(values, dict):
            raise ValueError(f"a config must be a dict of fields, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [key for key in values if key not in known]
        if unknown:  # the first few named: a file may hold any number of them
            named = ", ".join(shown(key) for key in unknown[:5])
            more = f", and {len(unknown) - 5:,} more" if len(unknown) > 5 else ""
            raise ValueError(
                f"unknown config fields [{named}{more}] ({len(unknown):,} in all); allowed: {sorted(known)}"
            )
        return cls(**values)


# ----- presets ------------------------------------------------------------------------------------
def _ffn_only_moe(**fields) -> ModelConfig:
    """A model whose experts are only in the FFN (Mixtral, Qwen3-MoE, DeepSeek-V3): one dense
    attention per layer, heads of 128, its KV cache stored in bfloat16, like a dense model's."""
    return ModelConfig(
        **{
            "head_dim": 128,
            "attention_mode": "dense",
            "num_attention_experts": 1,
            "num_attention_experts_per_tok": 1,
            "kv_cache_dtype": "bfloat16",
            **fields,
        }
    )


def _jetmoe_8b(**fields) -> ModelConfig:
    """JetMoE-8B's shape (its preset below), attention experts and all, its cache in bfloat16."""
    return ModelConfig(
        **{
            "vocab_size": 32000,
            "hidden_size": 2048,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "max_position_embeddings": 4096,
            "attention_mode": "expert",
            "num_attention_experts": 8,
            "num_attention_experts_per_tok": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 5632,
            "kv_cache_dtype": "bfloat16",
            **fields,
        }
    )


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: byte-level, trained on two CPU cores in minutes (apps/train.py), every
    # notebook runs in seconds. Its routers put 0.32-0.43 of the probability on the first expert on
    # average, so a threshold of 0.35 uses 1.2-1.8 experts per token depending on the layer (0.5
    # would use 1.7-1.9, nearly always k_max=2, and show little of what dynamic routing does).
    "tiny": ModelConfig(name="tiny", routing_threshold=0.35),
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json; Jiang et al., arXiv 2401.04088):
    # dense GQA attention (32 query heads, 8 KV heads of 128), 8 FFN experts, top-2.
    "mixtral-8x7b": _ffn_only_moe(
        name="mixtral-8x7b",
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rope_theta=1e6,
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json; Qwen3 technical report, arXiv 2505.09388):
    # 48 layers, 32 query heads / 4 KV heads of 128, 128 fine-grained FFN experts, top-8.
    "qwen3-30b-a3b": _ffn_only_moe(
        name="qwen3-30b-a3b",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=40960,
        rope_theta=1e6,
        num_local_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; arXiv 2412.19437): 61 layers, 128 heads,
    # multi-head latent attention caching kv_lora_rank=512 + qk_rope_head_dim=64 values per token,
    # 256 routed FFN experts, top-8 (the shared expert is not modelled: it holds no KV).
    "deepseek-v3": _ffn_only_moe(
        name="deepseek-v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        max_position_embeddings=163840,
        num_local_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    ),
    # JetMoE-8B (jetmoe/jetmoe-8b config.json; Shen et al., arXiv 2404.07413, Table 1): 24 layers, 8
    # attention experts, top-2, 16 KV heads of kv_channels=128, 8 FFN experts (ffn_hidden_size 5632),
    # top-2. Its num_attention_heads=32 counts the query heads of both chosen experts; ours, per expert.
    # Its experts share K/V (one kv_proj per layer, docs/design.md): a token caches one entry per layer.
    "jetmoe-8b": _jetmoe_8b(name="jetmoe-8b", shared_kv=True),
    # The same shape as a hypothetical expert-attention model in which each attention expert keeps its
    # own K/V (model.py's ExpertAttention): the per-expert caches this repository is about, at a real
    # model's size, two entries per layer per token.
    "jetmoe-8b-expert-kv": _jetmoe_8b(name="jetmoe-8b-expert-kv"),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with optional field overrides (validated like any config)."""
    if not isinstance(name, str):
        raise ValueError(
            f"name={shown(name)} is {a_type(name)}; allowed: a preset name, one of {sorted(PRESETS)}"
        )
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; allowed: {sorted(PRESETS)}")
    check_keywords(f"get_config({name!r})", overrides, keywords_of(ModelConfig))
    return dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
