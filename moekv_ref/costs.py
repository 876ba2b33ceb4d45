"""What a step, a recompute and a swap cost, in seconds, on hardware from one table.

1. The hardware table: every number with its source, none measured here. The cost models below and
   moekv_kernels/report.py pick their hardware from it by name.
2. One decode step under expert parallelism: `measured_shape_bytes` is the wire format of
   parallel/dispatch.py and parallel/kv_placements.py as arithmetic (a test checks it against the
   Communicator's counts); `project_step` takes the counts in expectation (uniform routing) and adds
   up ideal per-rank components (roofline compute, HBM reads, link time) with nothing overlapped:
   neither an upper nor a lower bound on a real step (notebook 07, section 5).
   DeepSeek-V3's latent attention is counted absorbed (against the 576-value latent), its shared
   expert and three dense first layers left out, as in the preset.
3. Recompute or swap (sim/runner.py): a preempted sequence of c tokens in b blocks comes back by a
   prefill of c tokens (quadratic in attention) or by copying its blocks out and in (linear in b,
   tail padding included); `crossover_context` finds the context from which swap wins. Constants are
   fitted to this machine (`fit_cost_model`) or derived from the table (`projected_gpu_cost_model`;
   `cluster_cost_model` for D GPUs serving by expert parallelism, whose step of n tokens,
   `CostModel.step_fixed_seconds(n)`, reads the experts those tokens activate on the busiest GPU and
   pays a latency plus bytes for each dispatch and combine). `CostModel.scaled(f)` multiplies every
   time by f, to check whether a result holds when everything costs f times as much.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch

from .config import BYTES_PER_DTYPE, ModelConfig, get_config
from .validation import MAX_INT32, check_int, check_real


# ===== 1. the hardware table ================================================================================
@dataclass(frozen=True)
class GPU:
    name: str
    architecture: str  # the ptxas target, "sm_90"
    hbm_bytes_per_s: float  # peak memory bandwidth
    bf16_flops_per_s: float  # dense BF16 tensor-core peak (no sparsity)
    num_sms: int
    device_name_parts: tuple  # how torch.cuda.get_device_name() names it (all parts appear)
    source: str

    def compute_seconds(self, flops, utilization: float = 1.0):
        return flops / (self.bf16_flops_per_s * utilization)

    def read_seconds(self, num_bytes):
        return num_bytes / self.hbm_bytes_per_s

    def roofline_seconds(self, flops, num_bytes):
        return max(self.compute_seconds(flops), self.read_seconds(num_bytes))


@dataclass(frozen=True)
class SMLimits:
    architecture: str
    registers_per_sm: int
    shared_per_sm: int  # bytes of shared memory a block may use, all blocks of an SM together
    max_warps_per_sm: int
    max_blocks_per_sm: int
    reserved_shared_per_block: int  # the driver's share of each block
    source: str


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # one direction, per GPU
    source: str
    # what one collective (an all-to-all dispatch or combine) costs beyond its bytes: launch and
    # synchronisation, the alpha of alpha + bytes / bandwidth (None: no published figure here)
    seconds_per_collective: float | None = None


GPUS = {
    "H200": GPU(
        "H200",
        "sm_90",
        4.8e12,
        989e12,
        132,
        ("H200",),
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16",
    ),
    "H100": GPU(
        "H100 SXM",
        "sm_90",
        3.35e12,
        989e12,
        132,
        ("H100", "HBM3"),
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 "
        "(1,979 with sparsity); 132 SMs: NVIDIA H100 Tensor Core GPU architecture whitepaper",
    ),
    "A100": GPU(
        "A100 80GB",
        "sm_80",
        2.039e12,
        312e12,
        108,
        ("A100-SXM4-80GB",),
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 2,039 GB/s HBM2e, 312 TFLOP/s dense "
        "BF16; 108 SMs: NVIDIA A100 Tensor Core GPU architecture whitepaper",
    ),
}

_PROGRAMMING_GUIDE = (
    "NVIDIA CUDA C++ Programming Guide, table 'Technical Specifications per Compute Capability'"
)
SM_LIMITS = {
    "sm_90": SMLimits("sm_90", 65536, 228 * 1024, 64, 32, 1024, _PROGRAMMING_GUIDE + " (9.0)"),
    "sm_80": SMLimits("sm_80", 65536, 164 * 1024, 64, 32, 1024, _PROGRAMMING_GUIDE + " (8.0)"),
}

LINKS = {
    "pcie_gen5_x16": Link(
        "PCIe Gen5 x16",
        64e9,
        "PCI-SIG: 32 GT/s x 16 lanes, about 64 GB/s each direction "
        "(NVIDIA's H100 PCIe figure, 128 GB/s, counts both directions)",
    ),
    "nvlink_c2c": Link(
        "NVLink-C2C",
        450e9,
        "NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s between Grace and Hopper, 450 GB/s each direction",
    ),
    "nvlink": Link(
        "NVLink, intranode",
        153e9,
        "DeepEP README (deepseek-ai/DeepEP): 153 GB/s measured "
        "intranode dispatch on H800 (about 160 GB/s the NVLink maximum there); per collective 10 us: "
        "NCCL all-to-all (nccl-tests alltoall_perf) over the 8 Hopper GPUs (H20) of one NVLink node "
        "takes 10.3-11.1 us per call from 128 B to 4 KiB, where bytes cost next to nothing (a user's "
        "measurement, github.com/deepseek-ai/DeepEP/issues/303)",
        10e-6,
    ),
    "rdma": Link(
        "RDMA, internode",
        50e9,
        "DeepEP README (deepseek-ai/DeepEP): 43-58 GB/s internode over CX7 400 Gb/s InfiniBand",
    ),
}


def gpus_of(architecture: str) -> list[GPU]:
    return [gpu for gpu in GPUS.values() if gpu.architecture == architecture]


ACCELERATORS = {name: GPUS[name] for name in ("H100", "H200")}
# between the GPUs of one node: NVLink, or PCIe where a server has no NVLink; between nodes: RDMA
INTERCONNECTS = {name: LINKS[name] for name in ("nvlink", "pcie_gen5_x16", "rdma")}
# between a GPU and its host's memory, where swapped blocks go
HOST_LINKS = {name: LINKS[name] for name in ("pcie_gen5_x16", "nvlink_c2c")}


def pick(choices: dict, name: str, what: str):
    if name not in choices:
        raise ValueError(f"{what}={name!r} must be one of {sorted(choices)}")
    return choices[name]


# ===== 2. one decode step under expert parallelism: bytes, FLOPs, HBM reads -> time =========================
INT64_BYTES = 8
WEIGHT_BYTES = 2  # bfloat16 weights and activations, as served


def activated_experts(num_experts: int, k: int, num_tokens):
    """Expected experts of one layer that a batch of num_tokens tokens activates when each token
    picks k of num_experts uniformly (top-k routing, no capacity): E * (1 - (1 - k/E)^n). n = 1
    activates k; from n of a few times E / k on, all of them (within 1e-6 from n = 48 at E=8, k=2)."""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** num_tokens)


@functools.lru_cache(maxsize=65536)
def busiest_gpu_experts(num_experts: int, k: int, num_devices: int, num_tokens: int) -> float:
    """Expected activated experts of one layer on the busiest of num_devices GPUs, each holding
    E / D of them, when num_tokens tokens each pick k of E uniformly: a step waits for that GPU.
    D = 1: `activated_experts`; D = E (one expert a GPU): 1 from the first token on, where the
    mean over the GPUs, activated_experts / D, is k / E of that.

    Exact, not sampled: the number a of activated experts is a Markov chain over the tokens (a new
    token adds j of its k picks among the E - a still idle, hypergeometrically); given a, every
    a-subset of the experts is as likely, so the chance that no GPU holds j or more of them is the
    share of a-subsets with fewer than j on each: [x^a] (sum_{i<j} C(E/D, i) x^i)^D / C(E, a)."""
    if num_devices == 1:
        return activated_experts(num_experts, k, num_tokens)
    E = num_experts
    step = torch.zeros(E + 1, E + 1, dtype=torch.float64)  # step[a, a + j]: a token adds j
    for a in range(E + 1):
        for j in range(max(0, k - a), min(k, E - a) + 1):
            step[a, a + j] = math.comb(E - a, j) * math.comb(a, k - j) / math.comb(E, k)
    active = torch.linalg.matrix_power(step, num_tokens)[0].tolist()  # P(a activated), a = 0..E
    busiest = _busiest_given_active(E, num_devices)
    return min(sum(p * most for p, most in zip(active, busiest)), E // num_devices)  # no rounding past all


@functools.lru_cache(maxsize=64)
def _busiest_given_active(num_experts: int, num_devices: int) -> list[float]:
    """E[the most activated experts on one GPU | a of them activated], for a = 0..E."""
    E, per_gpu = num_experts, num_experts // num_devices
    expected = [0.0] * (E + 1)
    for j in range(1, per_gpu + 1):  # E[max] = sum over j of P(max >= j)
        one_gpu = [math.comb(per_gpu, i) for i in range(j)]  # ways a GPU holds i < j activated
        all_gpus = [1]
        for _ in range(num_devices):
            product = [0] * min(len(all_gpus) + len(one_gpu) - 1, E + 1)
            for x, a in enumerate(all_gpus):
                for y, b in enumerate(one_gpu):
                    if x + y <= E:
                        product[x + y] += a * b
            all_gpus = product
        for a in range(E + 1):
            below = all_gpus[a] if a < len(all_gpus) else 0
            expected[a] += 1 - below / math.comb(E, a)
    return expected


def parameter_split(config: ModelConfig, tied_embeddings: bool = False) -> dict[str, int]:
    """Parameters of `config`, from its shapes, by how a decode step reads them:

    - always_read: read in full by every step: the LM head, each layer's norms and routers, and
      attention when it is dense (or its K/V projection, when the attention experts share one);
    - embedding: the input table, of which a step gathers only its tokens' rows (0 when tied to
      the LM head, which is then counted once, in always_read);
    - attention_experts, ffn_experts: every routed expert of all layers; a step reads those its
      tokens activate (`activated_experts`). An attention expert holds q and o (H heads of Dh) and,
      unless shared, its own k and v (Hkv heads); an FFN expert its gate, up (D x F each) and down.

    JetMoE-8B (preset jetmoe-8b, tied embeddings as its config.json has them): attention experts
    24 x 8 x 2 x 2048 x 2048 = 1.61 B, FFN experts 24 x 8 x 3 x 2048 x 5632 = 6.64 B, always read
    0.27 B (the shared K/V projection 0.20 B, the tied LM head 0.066 B, routers and norms): 8.52 B in
    all, 2.33 B active at top-2 of 8 (the paper: 8 B and 2.2 B). The expert-attention counterpart
    jetmoe-8b-expert-kv gives each attention expert its own k and v: 3.22 B of attention experts,
    9.93 B in all. Biases (JetMoE's: D per MoE layer) are left out; DeepSeek-V3's latent attention
    counts q, o and the latent projection only, as in `step_flops_and_reads`."""
    if not isinstance(tied_embeddings, bool):
        raise ValueError(f"tied_embeddings={tied_embeddings!r} must be True or False")
    L, D, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    Ea, Ef, F = config.num_attention_experts, config.num_local_experts, config.moe_intermediate_size
    query_output = 2 * D * H * Dh
    if config.kv_lora_rank > 0:  # MLA: one latent projection, shared by the heads
        key_value = D * (config.kv_lora_rank + config.qk_rope_head_dim)
    else:
        key_value = 2 * D * Hkv * Dh
    norms = L * 2 * D + D  # two per layer and the final one
    ffn_router = L * D * Ef
    if config.attention_mode == "dense":
        attention_dense = L * (query_output + key_value)
        attention_router = 0
        attention_experts = 0
    elif config.shared_kv:
        attention_dense = L * key_value
        attention_router = L * D * Ea
        attention_experts = L * Ea * query_output
    else:
        attention_dense = 0
        attention_router = L * D * Ea
        attention_experts = L * Ea * (query_output + key_value)
    return {
        "always_read": V * D + norms + ffn_router + attention_router + attention_dense,
        "embedding": 0 if tied_embeddings else V * D,
        "attention_experts": attention_experts,
        "ffn_experts": L * Ef * 3 * D * F,
    }


def check_even_split(config: ModelConfig, kv_placement: str, world_size: int) -> None:
    """Expert parallelism over world_size ranks places E / R experts of each sharded kind per rank."""
    sharded = [config.num_local_experts] + [config.num_attention_experts] * (
        kv_placement != "replicated_attention"
    )
    if any(experts % world_size for experts in sharded):
        # expected_remote_ranks spreads E // R experts per rank: with fewer experts than ranks it would
        # project no traffic at all, and with an uneven split the wrong traffic
        raise ValueError(
            f"world_size={world_size} does not split {config.name}'s {sharded} experts per layer "
            f"evenly: at least one expert per rank, the same number on each"
        )


def measured_shape_bytes(
    config: ModelConfig, kv_placement: str, world_size: int, traffic: dict, bytes_per_value: int
) -> dict[str, int]:
    """Bytes sent to peers in one step, summed over ranks, per category. traffic:
    attention_pairs_to_peers, ffn_pairs_to_peers ((token, rank) pairs off the token's home rank);
    under kv_with_sequence kv_rows_to_peers, kv_tokens_to_peers (cached K/V sent) and
    kv_new_pairs_to_peers ((token, expert) pairs whose new k, v come home)."""
    D, b = config.hidden_size, bytes_per_value
    Ka, Kf = config.num_attention_experts_per_tok, config.num_experts_per_tok
    kv_row_values = 2 * config.num_key_value_heads * config.head_dim  # k and v of one token
    count = lambda name: int(traffic.get(name, 0))  # noqa: E731
    attention_pairs, ffn_pairs = count("attention_pairs_to_peers"), count("ffn_pairs_to_peers")
    # all-to-alls per layer whose split sizes are exchanged first: the FFN dispatch always, the
    # attention dispatch unless attention is replicated, the K/V rows' metadata for kv_with_sequence
    exchanges = 1 + (kv_placement != "replicated_attention") + (kv_placement == "kv_with_sequence")
    return {
        "split_sizes": config.num_hidden_layers * exchanges * world_size * (world_size - 1) * INT64_BYTES,
        # floats: hidden state + K gates; ints: seq_id, position + K expert ids
        "attention_dispatch": attention_pairs * ((D + Ka) * b + (2 + Ka) * INT64_BYTES),
        "attention_combine": attention_pairs * D * b,
        # rows: [seq_id, expert, count]; then every cached token's k and v
        "kv_context": count("kv_rows_to_peers") * 3 * INT64_BYTES
        + count("kv_tokens_to_peers") * kv_row_values * b,
        "kv_new": count("kv_new_pairs_to_peers") * kv_row_values * b,
        # floats: hidden state + K gates; ints: K expert ids
        "ffn_dispatch": ffn_pairs * ((D + Kf) * b + Kf * INT64_BYTES),
        "ffn_combine": ffn_pairs * D * b,
    }


def expected_remote_ranks(num_experts: int, k: int, world_size: int) -> float:
    """Expected ranks other than the home rank among a token's k experts, chosen uniformly among E
    experts spread evenly over R ranks: (R - 1) * P(a given rank holds at least one of them)."""
    per_rank = num_experts // world_size
    miss = math.comb(num_experts - per_rank, k) / math.comb(num_experts, k)
    return (world_size - 1) * (1.0 - miss)


def expected_traffic(
    config: ModelConfig, kv_placement: str, world_size: int, num_seqs: int, context: int
) -> dict[str, float]:
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


def step_flops_and_reads(
    config: ModelConfig, kv_placement: str, world_size: int, num_seqs: int, context: int
) -> dict[str, float]:
    """FLOPs and HBM bytes of one decode step over all ranks. Weights are read once per step by each
    rank that uses them; K/V once per (token, expert) pair that attends over it (twice under
    kv_with_sequence: read to send, read to attend)."""
    L, D, b = config.num_hidden_layers, config.hidden_size, BYTES_PER_DTYPE[config.kv_cache_dtype]
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    Ea, Ka = config.num_attention_experts, config.num_attention_experts_per_tok
    Ef, Kf, F = config.num_local_experts, config.num_experts_per_tok, config.moe_intermediate_size
    pairs = num_seqs * Ka  # (token, expert) per layer
    row_context = context * Ka / Ea + 1  # keys one pair attends over
    if config.kv_lora_rank > 0:  # MLA, absorbed: q and o of H heads, one shared latent of kv_lora + rope
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        projection_flops = 2 * D * H * Dh * 2 + 2 * D * latent
        score_flops = 2 * H * latent * row_context + 2 * H * config.kv_lora_rank * row_context
        expert_weight_bytes = (2 * D * H * Dh + D * latent) * b
    else:
        projection_flops = 2 * D * (H * Dh + 2 * Hkv * Dh) + 2 * H * Dh * D
        score_flops = 2 * 2 * H * Dh * row_context
        expert_weight_bytes = (2 * D * H * Dh + 2 * D * Hkv * Dh) * b
    attention_flops = L * pairs * (projection_flops + score_flops)
    kv_reads = (
        L
        * pairs
        * row_context
        * config.kv_bytes_per_entry()
        * (2 if kv_placement == "kv_with_sequence" else 1)
    )
    # attention weights: every rank reads all of them when replicated, its own experts otherwise
    copies = world_size if kv_placement == "replicated_attention" else 1
    attention_weight_reads = L * Ea * expert_weight_bytes * copies
    # FFN experts: each expert that gets a token reads its weights once
    active = activated_experts(Ef, Kf, num_seqs)
    expert_flops = L * num_seqs * Kf * 3 * 2 * D * F
    expert_reads = L * active * 3 * D * F * b
    return {
        "attention_flops": attention_flops,
        "attention_hbm_bytes": attention_weight_reads + kv_reads,
        "expert_flops": expert_flops,
        "expert_hbm_bytes": expert_reads,
    }


@dataclass
class StepProjection:
    model: str
    kv_placement: str
    world_size: int
    num_seqs: int
    context: int
    accelerator: str
    interconnect: str
    bytes_per_step: dict  # category -> bytes, all ranks
    attention_ms: float
    experts_ms: float
    communication_ms: float
    step_ms: float
    sources: dict

    def to_dict(self) -> dict:
        return asdict(self)


def project_step(
    config: ModelConfig,
    kv_placement: str,
    world_size: int,
    num_seqs: int,
    context: int,
    accelerator: str = "H100",
    interconnect: str = "nvlink",
) -> StepProjection:
    """Decode step time (ms) of num_seqs sequences at `context`, balanced over world_size ranks: a
    no-overlap sum of ideal per-component times (roofline compute, HBM reads, link time), neither an
    upper nor a lower bound on a real step (it leaves out per-collective latency and load imbalance,
    and overlaps nothing that a real step overlaps)."""
    gpu, link = (
        pick(ACCELERATORS, accelerator, "accelerator"),
        pick(INTERCONNECTS, interconnect, "interconnect"),
    )
    if config.shared_kv:
        raise ValueError(
            f"{config.name}'s attention experts share K/V (shared_kv=True): the projections place "
            "per-expert caches; project its expert-attention counterpart instead"
        )
    if config.attention_mode == "dense" and kv_placement != "replicated_attention":
        raise ValueError(
            f"{config.name} has dense attention: its KV placement is data-parallel attention, "
            f"kv_placement='replicated_attention', not {kv_placement!r}"
        )
    check_even_split(config, kv_placement, world_size)
    traffic = expected_traffic(config, kv_placement, world_size, num_seqs, context)
    b = BYTES_PER_DTYPE[config.kv_cache_dtype]
    moved = measured_shape_bytes(config, kv_placement, world_size, traffic, b)
    work = step_flops_and_reads(config, kv_placement, world_size, num_seqs, context)

    per_rank = {name: value / world_size for name, value in work.items()}  # balanced
    attention_ms = gpu.roofline_seconds(per_rank["attention_flops"], per_rank["attention_hbm_bytes"]) * 1e3
    experts_ms = gpu.roofline_seconds(per_rank["expert_flops"], per_rank["expert_hbm_bytes"]) * 1e3
    communication_ms = sum(moved.values()) / world_size / link.bytes_per_s * 1e3
    return StepProjection(
        config.name,
        kv_placement,
        world_size,
        num_seqs,
        context,
        gpu.name,
        link.name,
        {k: int(round(v)) for k, v in moved.items()},
        attention_ms,
        experts_ms,
        communication_ms,
        attention_ms + experts_ms + communication_ms,
        {"accelerator": gpu.source, "interconnect": link.source},
    )


# Clusters the projections use: which presets, how many GPUs, which link between them.
REAL_SHAPE_SETUPS = (
    ("mixtral-8x7b", 8, "nvlink", ("replicated_attention",)),  # one node of 8 GPUs
    ("deepseek-v3", 32, "rdma", ("replicated_attention",)),  # 4 nodes: most dispatch crosses
    # JetMoE-8B's shape as an expert-attention model (each attention expert keeps its own K/V)
    ("jetmoe-8b-expert-kv", 8, "nvlink", ("kv_with_expert", "kv_with_sequence", "replicated_attention")),
)


def real_shape_projections(
    contexts=(4096, 32768), seqs_per_rank: int = 32, accelerator: str = "H200"
) -> list[dict]:
    return [
        project_step(
            get_config(name), placement, world_size, seqs_per_rank * world_size, context, accelerator, link
        ).to_dict()
        for name, world_size, link, placements in REAL_SHAPE_SETUPS
        for placement in placements
        for context in contexts
    ]


# ===== 3. recompute or swap =================================================================================
@dataclass(frozen=True)
class ExpertReads:
    """One kind of routed experts (attention or FFN), spread evenly over num_devices GPUs: reading
    one GPU's share of them, all layers, takes `seconds`; a step reads, in each layer, the experts
    its tokens activate on the busiest GPU (`busiest_gpu_experts`; on one GPU, all it activates)."""

    seconds: float
    num_experts: int  # E, per layer
    experts_per_token: int  # k
    num_devices: int = 1  # D: each GPU holds E / D experts of every layer

    def __post_init__(self):
        check_real("seconds", self.seconds, 0)
        check_int("num_experts", self.num_experts, 1, MAX_INT32)
        check_int("experts_per_token", self.experts_per_token, 1, self.num_experts, meaning="k <= E")
        check_int("num_devices", self.num_devices, 1, self.num_experts, meaning="at most one GPU an expert")
        if self.num_experts % self.num_devices:
            raise ValueError(
                f"num_devices={self.num_devices} is not allowed; allowed: a divisor of "
                f"num_experts={self.num_experts} (the same number of experts on every GPU)"
            )

    def step_seconds(self, num_tokens: int) -> float:
        if num_tokens == 0:
            return 0.0
        busiest = busiest_gpu_experts(self.num_experts, self.experts_per_token, self.num_devices, num_tokens)
        return self.seconds * busiest / (self.num_experts // self.num_devices)


@dataclass(frozen=True)
class CostModel:
    """What a step costs: `step_fixed_seconds(n)` for a step of n tokens, plus each token's
    `decode_seconds` or `recompute_seconds`, plus its swaps. Models that leave the new fields at
    their defaults (fitted ones, projected single-GPU ones) charge seconds_per_step per step."""

    name: str
    seconds_per_step: float  # fixed cost of one forward (the weights every step reads), whatever it computes
    seconds_per_token: float  # per token computed (prefill, recompute or decode)
    seconds_per_token_pair: float  # per (query, earlier key) pair of one sequence, all layers
    swap_bytes_per_second: float  # host link, each direction
    seconds_per_block: float  # per block copied (descriptor / small-copy overhead)
    seconds_per_swap: float  # per swap out or in of one sequence (launch, synchronisation)
    block_bytes: int  # bytes of K and V one block holds
    # per earlier token one decode token reads K/V of (all layers); a decode token over context c
    # takes c * max(pair compute, this read): memory-bound on a GPU (0: compute only, as fitted here)
    seconds_per_context_read: float = 0.0
    # each step of at least one token: collectives_per_step collectives (dispatch and combine of each
    # routed layer) of seconds_per_collective each, and link_seconds_per_token of bytes per token
    seconds_per_collective: float = 0.0
    collectives_per_step: int = 0
    link_seconds_per_token: float = 0.0
    # the routed experts' weights, read as far as a step's tokens activate them (ExpertReads)
    expert_reads: tuple = ()

    def step_fixed_seconds(self, num_tokens: int) -> float:
        """What a step of num_tokens tokens costs beyond each token's compute and attention: the
        always-read weights (seconds_per_step), the activated experts' weights, the collectives and
        the link bytes of num_tokens tokens. A step of no tokens reads no expert and sends nothing."""
        num_tokens = check_int("num_tokens", num_tokens, 0, MAX_INT32)
        if num_tokens == 0:
            return self.seconds_per_step
        seconds = self.seconds_per_step + self.collectives_per_step * self.seconds_per_collective
        seconds += num_tokens * self.link_seconds_per_token
        for reads in self.expert_reads:
            seconds += reads.step_seconds(num_tokens)
        return seconds

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every time term multiplied by factor (rates divided by it, bytes and
        counts kept): does a result hold when every step, token, swap and collective costs factor
        times as much?"""
        factor = check_real("factor", factor, 0, low_open=True, meaning="what every time is multiplied by")
        return replace(
            self,
            name=f"{self.name}, every time x {factor:g}",
            seconds_per_step=self.seconds_per_step * factor,
            seconds_per_token=self.seconds_per_token * factor,
            seconds_per_token_pair=self.seconds_per_token_pair * factor,
            swap_bytes_per_second=self.swap_bytes_per_second / factor,
            seconds_per_block=self.seconds_per_block * factor,
            seconds_per_swap=self.seconds_per_swap * factor,
            seconds_per_context_read=self.seconds_per_context_read * factor,
            seconds_per_collective=self.seconds_per_collective * factor,
            link_seconds_per_token=self.link_seconds_per_token * factor,
            expert_reads=tuple(replace(reads, seconds=reads.seconds * factor) for reads in self.expert_reads),
        )

    def recompute_seconds(self, context):  # context, num_blocks: an int or a tensor
        return context * self.seconds_per_token + context * (context + 1) / 2 * self.seconds_per_token_pair

    def swap_seconds(self, num_blocks):  # out and back in
        per_block = self.block_bytes / self.swap_bytes_per_second + self.seconds_per_block
        return 2 * (self.seconds_per_swap + num_blocks * per_block)

    def decode_seconds(self, context):  # what one decode token adds to a step
        return self.seconds_per_token + context * max(
            self.seconds_per_token_pair, self.seconds_per_context_read
        )

    def to_dict(self) -> dict:
        return asdict(self)


def projected_gpu_cost_model(
    active_params: float,
    kv_bytes_per_slot: int,
    num_layers: int,
    experts_per_token: int,
    num_experts: int,
    head_dim: int,
    num_heads: int,
    block_size: int,
    accelerator: str = "H100",
    host_link: str = "pcie_gen5_x16",
    mfu: float = 0.5,
    seconds_per_swap: float = 20e-6,
    seconds_per_block: float = 0.0,
    name: str = "H100 + PCIe Gen5 x16 (projected)",
) -> CostModel:
    """A cost model from datasheet numbers. Assumed: prefill and recompute reach `mfu` of peak; a
    query meets about k / E of the keys in each of its k experts, 4 * H * Dh FLOPs per pair; swaps
    are one copy per sequence and direction (as vLLM's swap kernel does), `seconds_per_swap` each;
    a step reads the active bf16 weights from HBM at least once."""
    gpu, link = pick(ACCELERATORS, accelerator, "accelerator"), pick(HOST_LINKS, host_link, "host_link")
    per_token = gpu.compute_seconds(2.0 * active_params, mfu)
    seconds_per_step = gpu.read_seconds(2.0 * active_params)  # active weights read once
    pair_flops = 4 * num_heads * head_dim * num_layers * experts_per_token * experts_per_token / num_experts
    return CostModel(
        name,
        seconds_per_step,
        per_token,
        gpu.compute_seconds(pair_flops, mfu),
        link.bytes_per_s,
        seconds_per_block,
        seconds_per_swap,
        kv_bytes_per_slot * block_size,
    )


def cluster_cost_model(
    config: ModelConfig,
    active_params: float,
    num_devices: int,
    block_size: int,
    accelerator: str = "H200",
    host_link: str = "pcie_gen5_x16",
    mfu: float = 0.5,
) -> CostModel:
    """`config` served by num_devices GPUs together by expert parallelism over NVLink (each GPU holds
    E / D experts of every layer, of both kinds, and their rows' blocks: kv_with_expert), every term
    an ideal per-component time, nothing overlapped, load imbalance left to the caller (the trace
    runner multiplies a step's token work by its busiest device's load). Per step:

    - the always-read weights (`parameter_split`: LM head, norms, routers, shared K/V), which every
      GPU holds a copy of and reads whole; and the routed experts' weights of each kind as far as
      the step's n tokens activate them, each GPU reading its activated experts of its E / D, the
      step waiting for the busiest (`busiest_gpu_experts`): on one GPU the activated fraction
      (`activated_experts` / E), on 8 GPUs of 8 experts one expert a layer from the first token
      on; all of them, total / D, once a batch activates every expert;
    - for D > 1, a dispatch and a combine all-to-all for each routed layer of each kind (attention
      and FFN experts: 4 L of them), each the link's per-collective latency plus its bytes
      (`expected_traffic` and `measured_shape_bytes` for one token, per GPU, over the link's
      bandwidth). D = 1 has no collectives.

    Per token: 2 * active_params FLOPs at `mfu` of peak, split over the D GPUs. A decode token
    reads, per earlier token, L * k * k / E K/V entries (in each of its k experts, the k / E of the
    context routed there) at the GPU's HBM bandwidth. Swaps stay per GPU."""
    num_devices = check_int("num_devices", num_devices, 1, MAX_INT32)
    if config.shared_kv:
        raise ValueError(
            f"{config.name}'s attention experts share K/V (shared_kv=True): this model reads "
            "per-expert caches; use its expert-attention counterpart"
        )
    kv_placement = "kv_with_expert" if config.attention_mode == "expert" else "replicated_attention"
    check_even_split(config, kv_placement, num_devices)
    one = projected_gpu_cost_model(
        active_params,
        config.kv_bytes_per_entry(),
        config.num_hidden_layers,
        config.num_attention_experts_per_tok,
        config.num_attention_experts,
        config.head_dim,
        config.num_attention_heads,
        block_size,
        accelerator,
        host_link,
        mfu,
    )
    gpu, link = pick(ACCELERATORS, accelerator, "accelerator"), INTERCONNECTS["nvlink"]
    L, E, K = config.num_hidden_layers, config.num_attention_experts, config.num_attention_experts_per_tok
    read_bytes = L * K * K / E * config.kv_bytes_per_entry()  # per context token

    split = parameter_split(config)
    expert_reads = []
    routed_kinds = 0  # kinds of routed layers whose experts are spread over the GPUs
    for kind, experts, k in (
        ("attention_experts", E, K),
        ("ffn_experts", config.num_local_experts, config.num_experts_per_tok),
    ):
        if split[kind] > 0:
            one_gpu_share = gpu.read_seconds(WEIGHT_BYTES * split[kind]) / num_devices
            expert_reads.append(ExpertReads(one_gpu_share, experts, k, num_devices))
            routed_kinds += 1
    # one token's dispatch and combine bytes, all layers, summed over the GPUs it leaves and comes back
    # to: counted for 2**20 tokens, as measured_shape_bytes counts whole (token, rank) pairs
    tokens = 2**20
    traffic = expected_traffic(config, kv_placement, num_devices, tokens, 0)
    moved = measured_shape_bytes(config, kv_placement, num_devices, traffic, WEIGHT_BYTES)
    token_bytes = sum(moved[name] for name in moved if name != "split_sizes") / tokens  # DeepEP sends none
    collectives = 0 if num_devices == 1 else 2 * L * routed_kinds
    links = (
        "no collectives (one GPU)"
        if collectives == 0
        else f"{collectives} NVLink collectives a step, {link.seconds_per_collective * 1e6:g} us each plus its bytes"
    )
    name = (
        f"{config.name} on {num_devices} x {accelerator} (projected: compute split evenly; HBM reads of "
        f"the always-read weights and of the experts a step activates on the busiest GPU; {links}; "
        "nothing overlapped, "
        "load imbalance left to the caller)"
    )
    return replace(
        one,
        name=name,
        seconds_per_step=gpu.read_seconds(WEIGHT_BYTES * split["always_read"]),  # each GPU its copy
        seconds_per_token=one.seconds_per_token / num_devices,
        seconds_per_token_pair=one.seconds_per_token_pair / num_devices,
        seconds_per_context_read=gpu.read_seconds(read_bytes) / num_devices,
        seconds_per_collective=link.seconds_per_collective,
        collectives_per_step=collectives,
        link_seconds_per_token=token_bytes / num_devices / link.bytes_per_s,
        expert_reads=tuple(expert_reads),
    )


def fit_cost_model(
    contexts,
    recompute_seconds,
    swapped_blocks,
    swap_seconds,
    block_bytes: int,
    name: str = "this machine (measured)",
) -> CostModel:
    """Least-squares constants from measurements: recompute_seconds[i] of a prefill of contexts[i]
    tokens (fit a + b c + q c^2/2, a dropped: a step's fixed cost is paid anyway), and swap_seconds[i]
    for swapped_blocks[i] blocks out and in (fit 2 (s + n t)). Coefficients are clamped at 0."""
    c = torch.as_tensor(contexts, dtype=torch.float64)
    design = torch.stack([torch.ones_like(c), c, c * (c + 1) / 2], 1)  # (m, 3)
    a, b, q = torch.linalg.lstsq(
        design, torch.as_tensor(recompute_seconds, dtype=torch.float64)[:, None]
    ).solution[:, 0]
    n = torch.as_tensor(swapped_blocks, dtype=torch.float64)
    design = torch.stack([2 * torch.ones_like(n), 2 * n], 1)  # (m, 2)
    s, t = torch.linalg.lstsq(design, torch.as_tensor(swap_seconds, dtype=torch.float64)[:, None]).solution[
        :, 0
    ]
    return CostModel(
        name,
        max(float(a), 0.0),
        max(float(b), 0.0),
        max(float(q), 0.0),
        float("inf"),
        max(float(t), 0.0),
        max(float(s), 0.0),
        block_bytes,
    )


def crossover_context(cost: CostModel, contexts, blocks_at_context) -> int | None:
    """The shortest of `contexts` from which swapping stays cheaper than recomputing, or None.
    blocks_at_context[i]: blocks a sequence of contexts[i] tokens holds (tail padding included)."""
    contexts = torch.as_tensor(contexts)
    swap = cost.swap_seconds(torch.as_tensor(blocks_at_context, dtype=torch.float64))
    wins = (swap < cost.recompute_seconds(contexts.to(torch.float64))).tolist()
    return next((int(contexts[i]) for i in range(len(wins)) if all(wins[i:])), None)
