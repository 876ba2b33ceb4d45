"""`python -m moekv_ref bench peer`: this project's decode against a peer implementation, Hugging
Face's `MixtralForCausalLM`, on the same weights.

Why a peer: a speedup against our own older commit says nothing about whether the code is slow in
absolute terms. In dense mode (one attention expert, k = 1) our model *is* Mixtral: grouped-query
attention with rotary embeddings, RMSNorm, and a top-k mixture of SwiGLU experts whose router is a
softmax over experts, top-k, renormalised over the k kept (moekv_ref/routing.py; Mixtral's
MixtralTopKRouter does the same). So the two can run the same weights, must produce the same greedy
tokens, and their tokens/s can be compared.

The weight copy (`copy_into_mixtral`), per layer:

    ours                                   Mixtral (nn.Linear weights are (out, in): x @ W.T)
    attention.w_q[0]    (D, H*Dh)          self_attn.q_proj.weight  (H*Dh, D)  transposed, rows permuted
    attention.w_k[0]    (D, Hkv*Dh)        self_attn.k_proj.weight  (Hkv*Dh, D) transposed, rows permuted
    attention.w_v[0]    (D, Hkv*Dh)        self_attn.v_proj.weight  transposed
    attention.w_o[0]    (H*Dh, D)          self_attn.o_proj.weight  (D, H*Dh)  transposed
    ffn.router.weight   (E, D)             mlp.gate.weight          (E, D)
    ffn.w_gate, w_up    (E, D, F) each     mlp.experts.gate_up_proj (E, 2F, D) [gate; up], transposed
    ffn.w_down          (E, F, D)          mlp.experts.down_proj    (E, D, F)  transposed
    attention_norm, ffn_norm               input_layernorm, post_attention_layernorm

The attention router (one expert: its gate is softmax of one logit = 1) has no counterpart. The row
permutation of q and k: our rotary rotates channel pairs (2i, 2i+1) of a head, Mixtral's pairs
(i, i + Dh/2) ("rotate half"); putting our channel 2i at Mixtral's i and 2i+1 at i + Dh/2 makes the
two rotations the same map, and q.k is unchanged by permuting q's and k's channels alike.

Timing: the four paths (HF generate with its KV cache, our generate(cache="paged"),
generate(cache="contiguous"), generate_with_engine) run greedy decode of the same prompts, one after
the other in a round, the order reversed every other round; each is timed in CPU time of this
process (one thread), and a ratio is the median over rounds of (our tokens/s) / (HF's tokens/s) in
that round, so a load change between rounds cancels. tokens/s counts new tokens, prefill included
in the time, as HF's generate reports it. The prompts have equal lengths, so HF needs no padding.

transformers is an optional extra: without it this command says so and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from ..config import get_config
from ..engine import generate_with_engine
from ..generate import generate
from ..jsonout import dumps
from ..model import MoEKVTransformer
from ..paths import output_path
from ..sampling import SamplingParams
from . import options

PATHS = ("hf", "paged", "contiguous", "engine")


def dense_config():
    """The embedded `tiny` model's dimensions with one attention expert: Mixtral's shape."""
    return dataclasses.replace(
        get_config("tiny"),
        name="tiny-dense",
        attention_mode="dense",
        num_attention_experts=1,
        num_attention_experts_per_tok=1,
    )


def random_dense_model(seed: int, config=None):
    """Our model in dense mode, random weights from `seed`, float32, eval mode."""
    torch.manual_seed(seed)
    return MoEKVTransformer(config or dense_config()).float().eval()


def rotate_half_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """(num_heads * Dh,) our channel index for each of Mixtral's: head by head, the even channels
    (first halves of the rotated pairs) then the odd ones. See the module docstring."""
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # (Dh,)
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)


def mixtral_config(config):
    """transformers.MixtralConfig with our model's dimensions."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        tie_word_embeddings=False,
        sliding_window=None,
        hidden_act="silu",
        router_jitter_noise=0.0,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


@torch.no_grad()
def copy_into_mixtral(model):
    """A MixtralForCausalLM holding `model`'s weights (dense attention only). See the module docstring."""
    config = model.config
    if config.num_attention_experts != 1:
        raise ValueError("only a dense model (one attention expert) has a Mixtral counterpart")
    from transformers import MixtralForCausalLM  # an optional extra: checked first

    hf = MixtralForCausalLM(mixtral_config(config)).float().eval()
    q_order = rotate_half_order(config.num_attention_heads, config.head_dim)
    k_order = rotate_half_order(config.num_key_value_heads, config.head_dim)
    hf.model.embed_tokens.weight.copy_(model.embed.weight)
    hf.model.norm.weight.copy_(model.norm.weight)
    hf.lm_head.weight.copy_(model.lm_head.weight)
    for block, layer in zip(model.blocks, hf.model.layers):
        a, attention = block.attention, layer.self_attn
        attention.q_proj.weight.copy_(a.w_q[0].T[q_order])  # (H*Dh, D)
        attention.k_proj.weight.copy_(a.w_k[0].T[k_order])  # (Hkv*Dh, D)
        attention.v_proj.weight.copy_(a.w_v[0].T)
        attention.o_proj.weight.copy_(a.w_o[0].T)  # (D, H*Dh)
        layer.input_layernorm.weight.copy_(block.attention_norm.weight)
        layer.post_attention_layernorm.weight.copy_(block.ffn_norm.weight)
        ffn, mlp = block.ffn, layer.mlp
        mlp.gate.weight.copy_(ffn.router.weight)  # (E, D)
        experts = mlp.experts
        experts.gate_up_proj.copy_(torch.cat([ffn.w_gate, ffn.w_up], dim=2).transpose(1, 2))  # (E, 2F, D)
        experts.down_proj.copy_(ffn.w_down.transpose(1, 2))  # (E, D, F)
    return hf


def bench_prompts(num_seqs: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_seqs, prompt_len), generator=generator).tolist()


def run_path(path: str, model, hf, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of one path."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    if path == "hf":
        input_ids = torch.tensor(prompts)
        with torch.no_grad():
            out = hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[:, input_ids.shape[1] :].tolist()
    if path == "engine":
        return generate_with_engine(model, prompts, params).tokens
    return generate(model, prompts, params, cache=path).tokens


def measure(
    num_seqs: int = 8,
    max_new_tokens: int = 64,
    prompt_len: int = 16,
    rounds: int = 5,
    seed: int = 0,
    paths=PATHS,
) -> dict:
    torch.set_num_threads(1)
    model = random_dense_model(seed)
    hf = copy_into_mixtral(model)
    prompts = bench_prompts(num_seqs, prompt_len, model.config.vocab_size, seed)
    reference = run_path("hf", model, hf, prompts, max_new_tokens)  # also a warm-up
    identical = {}
    for path in paths:
        identical[path] = run_path(path, model, hf, prompts, max_new_tokens) == reference
    seconds = {path: [] for path in paths}
    for r in range(rounds):
        for path in paths if r % 2 == 0 else tuple(reversed(paths)):
            start = time.process_time()
            run_path(path, model, hf, prompts, max_new_tokens)
            seconds[path].append(time.process_time() - start)
    new_tokens = num_seqs * max_new_tokens
    result = {
        "num_seqs": num_seqs,
        "max_new_tokens": max_new_tokens,
        "prompt_len": prompt_len,
        "rounds": rounds,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "paths": {},
    }
    for path in paths:
        ratios = [h / s for h, s in zip(seconds["hf"], seconds[path])]  # ours/HF tokens/s
        result["paths"][path] = {
            "tokens_per_s": new_tokens / statistics.median(seconds[path]),
            "ratio_vs_hf": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "identical_tokens": identical[path],
        }
    return result


def format_result(result: dict) -> str:
    lines = [
        f"greedy decode of {result['num_seqs']} sequences x {result['max_new_tokens']} new tokens "
        f"(prompts of {result['prompt_len']}), float32, {result['threads']} thread, "
        f"{result['rounds']} rounds; load average {', '.join(f'{x:.2f}' for x in result['load_average'])}",
        f"  {'path':<28}{'tokens/s':>10}{'vs HF':>8}   {'range':<13} identical tokens",
    ]
    names = {
        "hf": "HF Mixtral generate",
        "paged": "generate(cache='paged')",
        "contiguous": "generate(cache='contiguous')",
        "engine": "generate_with_engine",
    }
    for path, p in result["paths"].items():
        low, high = p["ratio_range"]
        lines.append(
            f"  {names[path]:<28}{p['tokens_per_s']:>10.0f}{p['ratio_vs_hf']:>7.2f}x   "
            f"{low:.2f}-{high:.2f}{'':<4} {'yes' if p['identical_tokens'] else 'NO'}"
        )
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds of the four paths (default 5)"
    )
    parser.add_argument("--num-seqs", type=int, default=8, help="sequences decoded at once (default 8)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="greedy tokens per sequence (default 64)"
    )
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens of every prompt (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights and prompts")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    return parser


def check_args(args) -> None:
    """The options, before any model is built."""
    positions = get_config("tiny").max_position_embeddings
    options.count("--rounds", args.rounds, 5, meaning="at least 5: a median of per-round ratios")
    options.count("--num-seqs", args.num_seqs, 1, 256)
    options.count("--prompt-len", args.prompt_len, 1, positions - 1)
    options.count("--max-new-tokens", args.max_new_tokens, 1, positions - args.prompt_len)
    options.seed("--seed", args.seed)
    options.output_file("--json", args.json, parents_made=True)


def main(args) -> int:
    check_args(args)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("error: bench peer needs transformers, an optional extra (pip install transformers)")
        return 2
    result = measure(args.num_seqs, args.max_new_tokens, args.prompt_len, args.rounds, args.seed)
    print(format_result(result))
    if args.json is not None:
        output_path(args.json).write_text(dumps(result, indent=2) + "\n")
    return 0 if all(p["identical_tokens"] for p in result["paths"].values()) else 1
