"""A fast recompute forward for the one model code (model.py's modules).

model.py's `forward` builds a (B, E, 1, T, T) boolean mask for every layer and hands it to
scaled_dot_product_attention, which then takes its unfused path. `fast_forward` computes the same
function from the same modules and weights (routing, capacity, rotary, W_q/W_k/W_v/W_o, the MoE
feed-forward), but for dense attention it calls scaled_dot_product_attention with is_causal=True
and no mask, PyTorch's fused kernel; routed attention keeps the routing mask. `window=W` restricts
every query to the W most recent positions, itself included (a causal sliding window), in the same
fused call's mask.

Training goes through the one loop, training.py's `fit`, given `forward=fast_forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from ..attention import rotary, rotary_turns
from ..model import ExpertAttention, ModelOutput, MoEKVTransformer
from ..routing import Routing, apply_capacity


def attention_mask(T: int, window: int | None, device) -> torch.Tensor | None:
    """(T, T) bool: query i sees key j iff i - window < j <= i; None for plain causal attention."""
    if window is None:
        return None
    if window < 1:
        raise ValueError(f"window={window} is not allowed; allowed: an integer >= 1 or None")
    i = torch.arange(T, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def fast_attention(
    attention: ExpertAttention, x: torch.Tensor, window: int | None = None
) -> tuple[torch.Tensor, Routing]:
    """attention.forward_full(x) without a budget, as one fused call per layer: x (B, T, D)."""
    c = attention.config
    B, T, _ = x.shape
    E, H, Hkv, Dh = c.num_attention_experts, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    routing = attention.route(x)  # (B, T, E)
    if c.attention_capacity:
        routing = apply_capacity(routing, c.attention_routing, c.attention_capacity)
    qkv = einsum(x, attention.qkv_weight(), "b t d, e d f -> b t e f").unflatten(-1, (-1, Dh))
    turns = rotary_turns(torch.arange(T, device=x.device), Dh, c.rope_theta, x.dtype)  # (T, 1, Dh/2)
    qk = rotary(qkv[..., : H + Hkv, :], turns[:, None])  # queries and keys at once
    q = rearrange(qk[..., :H, :], "b t e h d -> b e h t d")
    k, v = (
        rearrange(t, "b t e h d -> b e h t d").repeat_interleave(H // Hkv, dim=2)
        for t in (qk[..., H:, :], qkv[..., H + Hkv :, :])
    )  # (B, E, H, T, Dh)
    band = attention_mask(T, window, x.device)
    if E == 1:  # dense: every token is routed to the one expert; 4-D, which the fused CPU kernel wants
        q, k, v = (t.squeeze(1) for t in (q, k, v))  # (B, H, T, Dh)
        if band is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        attn = attn.unsqueeze(1)
    else:  # as forward_full: keys routed to e, and always the query itself
        causal = band if band is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        sent = rearrange(routing.selected, "b t e -> b e t")  # (B, E, T)
        visible = (causal[None, None] & sent[:, :, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, :, None])
    attn = rearrange(attn, "b e h t d -> b t e (h d)")
    out = einsum(attn, attention.w_o, "b t e f, e f d -> b t e d")  # (B, T, E, D)
    return (out * routing.gates[..., None]).sum(2), routing


def fast_forward(model: MoEKVTransformer, tokens: torch.Tensor, window: int | None = None) -> ModelOutput:
    """model(tokens) (no budget) through fast_attention: tokens (B, T), every row from position 0."""
    c = model.config
    if tokens.dim() != 2 or tokens.shape[1] > c.max_position_embeddings:
        raise ValueError(
            f"tokens of shape {tuple(tokens.shape)} are not allowed; allowed: (B, T) with T <= "
            f"max_position_embeddings={c.max_position_embeddings}"
        )
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= c.vocab_size):
        raise ValueError(
            f"tokens=[{int(tokens.min())}, {int(tokens.max())}] is not allowed; allowed: [0, {c.vocab_size})"
        )
    x = model.embed(tokens)
    attention_routing, ffn_routing = [], []
    for block in model.blocks:
        h, r_attn = fast_attention(block.attention, block.attention_norm(x), window)
        x = x + h
        h, r_ffn = block.ffn(block.ffn_norm(x))
        x = x + h
        attention_routing.append(r_attn)
        ffn_routing.append(r_ffn)
    return ModelOutput(model.lm_head(model.norm(x)), attention_routing, ffn_routing)
