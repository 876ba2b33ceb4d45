"""A cost model of one decode step under expert parallelism: bytes, FLOPs, HBM reads -> time.

Two halves:

1. `measured_shape_bytes`: the bytes every collective of a step moves, from the shapes and the
   integer counts of what the routers decided (pairs sent to peers, K/V rows and tokens). It is the
   wire format of dispatch.py and kv_placements.py written as arithmetic, and a test checks that it
   equals the bytes the Communicator counted in real runs, category by category.

2. `project_step`: the same counts taken in expectation (uniform routing: each token's k experts
   uniformly among E, experts spread evenly over R ranks), plus FLOPs and HBM reads, turned into
   projected times on stated hardware. Per rank and balanced: attention and expert times are
   rooflines, max(FLOPs / peak, HBM bytes / bandwidth); communication is the bytes a rank sends
   divided by its link bandwidth. The step time is their sum (no overlap of compute and
   communication: an upper bound; DeepEP-style overlap can hide part of the communication).

Bytes are "logical": what leaves a rank for another, as the Communicator counts them. Hardware
figures (HBM bandwidth, dense BF16 FLOP/s of the H100 and H200; NVLink and RDMA bandwidths per GPU)
come from moekv_ref/hardware.py, each with its source.

What is modelled for the real-shape presets with dense attention (Mixtral-8x7B, Qwen3-30B-A3B,
DeepSeek-V3): data-parallel attention (each rank serves its own sequences with all the attention
weights: the replicated_attention placement with one "expert") and expert-parallel FFN. DeepSeek-V3's
multi-head latent attention is counted in its absorbed form (the cache holds the 576-value latent;
scores and values are taken against the latent); its shared expert and three dense first layers are
left out, as in the preset. Approximations are named where they are made.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..config import ModelConfig, get_config
from ..hardware import GPUS, LINKS

INT64_BYTES = 8


# ----- 1. the wire format as arithmetic -----------------------------------------------------------------
def size_exchanges_per_layer(kv_placement: str) -> int:
    """All-to-alls per layer whose split sizes are exchanged first: the FFN dispatch always, the
    attention dispatch unless attention is replicated, the K/V rows' metadata for kv_with_sequence."""
    return 1 + (kv_placement != "replicated_attention") + (kv_placement == "kv_with_sequence")


def measured_shape_bytes(config: ModelConfig, kv_placement: str, world_size: int, traffic: dict,
                         bytes_per_value: int) -> dict[str, int]:
    """Bytes sent to peers in one step, summed over ranks, per category, from the step's counts:

    traffic: attention_pairs_to_peers, ffn_pairs_to_peers ((token, rank) pairs whose rank is not the
    token's home), kv_rows_to_peers, kv_tokens_to_peers (cached K/V sent, kv_with_sequence),
    kv_new_pairs_to_peers ((token, expert) pairs whose new k, v come home, kv_with_sequence)."""
    D, b = config.hidden_size, bytes_per_value
    Ka, Kf = config.num_attention_experts_per_tok, config.num_experts_per_tok
    kv_row_values = 2 * config.num_key_value_heads * config.head_dim              # k and v of one token
    count = lambda name: int(traffic.get(name, 0))                                  # noqa: E731
    attention_pairs, ffn_pairs = count("attention_pairs_to_peers"), count("ffn_pairs_to_peers")
    return {
        "split_sizes": config.num_hidden_layers * size_exchanges_per_layer(kv_placement)
        * world_size * (world_size - 1) * INT64_BYTES,
        # floats: hidden state + K gates; ints: seq_id, position + K expert ids
        "attention_dispatch": attention_pairs * ((D + Ka) * b + (2 + Ka) * INT64_BYTES),
        "attention_combine": attention_pairs * D * b,
        # rows: [seq_id, expert, count]; then every cached token's k and v
        "kv_context": count("kv_rows_to_peers") * 3 * INT64_BYTES + count("kv_tokens_to_peers") * kv_row_values * b,
        "kv_new": count("kv_new_pairs_to_peers") * kv_row_values * b,
        # floats: hidden state + K gates; ints: K expert ids
        "ffn_dispatch": ffn_pairs * ((D + Kf) * b + Kf * INT64_BYTES),
        "ffn_combine": ffn_pairs * D * b,
    }


# ----- 2. projections -------------------------------------------------------------------------------------
# the hardware the projections are for, from the one table (moekv_ref/hardware.py)
ACCELERATORS = {name: GPUS[name] for name in ("H100", "H200")}
# between the GPUs of one node: NVLink, or PCIe where a server has no NVLink; between nodes: RDMA
INTERCONNECTS = {name: LINKS[name] for name in ("nvlink", "pcie_gen5_x16", "rdma")}


def expected_remote_ranks(num_experts: int, k: int, world_size: int) -> float:
    """Expected ranks other than the home rank among a token's k experts, chosen uniformly among E
    experts spread evenly over R ranks: (R - 1) * P(a given rank holds at least one of them)."""
    per_rank = num_experts // world_size
    miss = math.comb(num_experts - per_rank, k) / math.comb(num_experts, k)
    return (world_size - 1) * (1.0 - miss)


def expected_traffic(config: ModelConfig, kv_placement: str, world_size: int, num_seqs: int,
                     context: int) -> dict[str, float]:
    """The counts of `measured_shape_bytes` for one decode step (one new token per sequence, each with
    `context` earlier tokens), expected under uniform routing, summed over layers."""
    L, R = config.num_hidden_layers, world_size
    Ea, Ka = config.num_attention_experts, config.num_attention_experts_per_tok
    Ef, Kf = config.num_local_experts, config.num_experts_per_tok
    traffic = {"ffn_pairs_to_peers": L * num_seqs * expected_remote_ranks(Ef, Kf, R)}
    if kv_placement != "replicated_attention":
        remote_expert_pairs = L * num_seqs * Ka * (R - 1) / R
        traffic["attention_pairs_to_peers"] = L * num_seqs * expected_remote_ranks(Ea, Ka, R)
        if kv_placement == "kv_with_sequence":
            traffic["kv_rows_to_peers"] = remote_expert_pairs
            traffic["kv_tokens_to_peers"] = remote_expert_pairs * context * Ka / Ea
            traffic["kv_new_pairs_to_peers"] = remote_expert_pairs
    return traffic


def _bytes_per_value(config: ModelConfig) -> int:
    return {"float32": 4, "float64": 8, "float8": 1}.get(config.kv_cache_dtype, 2)


def step_flops_and_reads(config: ModelConfig, kv_placement: str, world_size: int, num_seqs: int,
                         context: int) -> dict[str, float]:
    """FLOPs and HBM bytes of one decode step over the whole system (all ranks), split into
    attention and experts. Weights are read once per step by each rank that uses them; K/V once per
    (token, expert) pair that attends over it (twice under kv_with_sequence: read to send, read to
    attend)."""
    L, D, b = config.num_hidden_layers, config.hidden_size, _bytes_per_value(config)
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    Ea, Ka = config.num_attention_experts, config.num_attention_experts_per_tok
    Ef, Kf, F = config.num_local_experts, config.num_experts_per_tok, config.moe_intermediate_size
    pairs = num_seqs * Ka                                                     # (token, expert) per layer
    row_context = context * Ka / Ea + 1                                       # keys one pair attends over
    if config.kv_lora_rank > 0:   # MLA, absorbed: q and o of H heads, one shared latent of kv_lora + rope
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        projection_flops = 2 * D * H * Dh * 2 + 2 * D * latent
        score_flops = 2 * H * latent * row_context + 2 * H * config.kv_lora_rank * row_context
        expert_weight_bytes = (2 * D * H * Dh + D * latent) * b
    else:
        projection_flops = 2 * D * (H * Dh + 2 * Hkv * Dh) + 2 * H * Dh * D
        score_flops = 2 * 2 * H * Dh * row_context
        expert_weight_bytes = (2 * D * H * Dh + 2 * D * Hkv * Dh) * b
    attention_flops = L * pairs * (projection_flops + score_flops)
    kv_reads = L * pairs * row_context * config.kv_bytes_per_entry() * (2 if kv_placement == "kv_with_sequence" else 1)
    # attention weights: every rank reads all of them when replicated, its own experts otherwise
    copies = world_size if kv_placement == "replicated_attention" else 1
    attention_weight_reads = L * Ea * expert_weight_bytes * copies
    # FFN experts: each expert that gets a token reads its weights once
    active = Ef * (1 - (1 - Kf / Ef) ** num_seqs)
    expert_flops = L * num_seqs * Kf * 3 * 2 * D * F
    expert_reads = L * active * 3 * D * F * b
    return {"attention_flops": attention_flops, "attention_hbm_bytes": attention_weight_reads + kv_reads,
            "expert_flops": expert_flops, "expert_hbm_bytes": expert_reads}


@dataclass
class StepProjection:
    model: str
    kv_placement: str
    world_size: int
    num_seqs: int
    context: int
    accelerator: str
    interconnect: str
    bytes_per_step: dict          # category -> bytes, all ranks
    attention_ms: float
    experts_ms: float
    communication_ms: float
    step_ms: float
    sources: dict

    def to_dict(self) -> dict:
        return asdict(self)


def project_step(config: ModelConfig, kv_placement: str, world_size: int, num_seqs: int, context: int,
                 accelerator: str = "H100", interconnect: str = "nvlink") -> StepProjection:
    """Projected decode step time (ms) of num_seqs sequences at `context`, balanced over world_size
    ranks, on the named accelerator and interconnect (ACCELERATORS, INTERCONNECTS)."""
    if accelerator not in ACCELERATORS or interconnect not in INTERCONNECTS:
        raise ValueError(f"accelerator={accelerator!r} must be one of {sorted(ACCELERATORS)} and "
                         f"interconnect={interconnect!r} one of {sorted(INTERCONNECTS)}")
    if config.attention_mode == "dense" and kv_placement != "replicated_attention":
        raise ValueError(f"{config.name} has dense attention: its KV placement is data-parallel attention, "
                         f"kv_placement='replicated_attention', not {kv_placement!r}")
    sharded = [config.num_local_experts] + [config.num_attention_experts] * (kv_placement != "replicated_attention")
    if any(experts % world_size for experts in sharded):
        # expected_remote_ranks spreads E // R experts per rank: with fewer experts than ranks it would
        # project no traffic at all, and with an uneven split the wrong traffic
        raise ValueError(f"world_size={world_size} does not split {config.name}'s {sharded} experts per layer "
                         f"evenly: at least one expert per rank, the same number on each")
    gpu, link = ACCELERATORS[accelerator], INTERCONNECTS[interconnect]
    traffic = expected_traffic(config, kv_placement, world_size, num_seqs, context)
    moved = measured_shape_bytes(config, kv_placement, world_size, traffic, _bytes_per_value(config))
    work = step_flops_and_reads(config, kv_placement, world_size, num_seqs, context)

    def roofline(flops, reads):
        return max(flops / world_size / gpu.bf16_flops_per_s, reads / world_size / gpu.hbm_bytes_per_s) * 1e3

    attention_ms = roofline(work["attention_flops"], work["attention_hbm_bytes"])
    experts_ms = roofline(work["expert_flops"], work["expert_hbm_bytes"])
    communication_ms = sum(moved.values()) / world_size / link.bytes_per_s * 1e3
    return StepProjection(config.name, kv_placement, world_size, num_seqs, context, gpu.name, link.name,
                          {k: int(round(v)) for k, v in moved.items()}, attention_ms, experts_ms,
                          communication_ms, attention_ms + experts_ms + communication_ms,
                          {"accelerator": gpu.source, "interconnect": link.source})


# Clusters the projections use: which presets, how many GPUs, which link between them.
REAL_SHAPE_SETUPS = (
    # Mixtral-8x7B: 8 FFN experts on the 8 GPUs of one node
    ("mixtral-8x7b", 8, "nvlink", ("replicated_attention",)),
    # DeepSeek-V3: 256 FFN experts over 4 nodes of 8 GPUs; most dispatch crosses nodes
    ("deepseek-v3", 32, "rdma", ("replicated_attention",)),
    # JetMoE-8B sized as an expert-attention model (8 attention experts, each keeping its own K/V):
    # every KV placement, on the 8 GPUs of one node
    ("jetmoe-8b", 8, "nvlink", ("kv_with_expert", "kv_with_sequence", "replicated_attention")),
)


def real_shape_projections(contexts=(4096, 32768), seqs_per_rank: int = 32, accelerator: str = "H100") -> list[dict]:
    """Projections for the real-shape presets at the given contexts (a table for the JSON and plots)."""
    rows = []
    for name, world_size, link, placements in REAL_SHAPE_SETUPS:
        config = get_config(name)
        for placement in placements:
            for context in contexts:
                rows.append(project_step(config, placement, world_size, seqs_per_rank * world_size, context,
                                         accelerator, link).to_dict())
    return rows
