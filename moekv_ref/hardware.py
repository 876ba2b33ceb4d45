"""The hardware every projection in this repository is made for: one table, each number with its source.

Three things read it: the expert-parallel step-time model (parallel/cost_model.py: HBM bandwidth,
peak FLOPs, links between GPUs), the recompute-versus-swap costs (sim/costs.py: the same GPU and the
host link), and the kernel report (kernels/report.py: per-SM limits for occupancy, HBM bandwidth for
the bound a kernel is measured against). Nothing here is measured on this machine; a number a
benchmark measures is reported beside the datasheet's, never written into this table.

    GPUS        name -> GPU: HBM bandwidth, dense BF16 tensor-core FLOP/s, SM count, architecture
    SM_LIMITS   architecture ("sm_90") -> what one streaming multiprocessor holds at once
    LINKS       name -> Link: bytes per second, one direction, per GPU
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    architecture: str           # the ptxas target, "sm_90"
    hbm_bytes_per_s: float      # peak memory bandwidth
    bf16_flops_per_s: float     # dense BF16 tensor-core peak (no sparsity)
    num_sms: int
    device_name_parts: tuple    # how torch.cuda.get_device_name() names it (all parts appear)
    source: str


@dataclass(frozen=True)
class SMLimits:
    architecture: str
    registers_per_sm: int
    shared_per_sm: int          # bytes of shared memory a block may use, all blocks of an SM together
    max_warps_per_sm: int
    max_blocks_per_sm: int
    reserved_shared_per_block: int   # the driver's share of each block
    source: str


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float          # one direction, per GPU
    source: str


GPUS = {
    "H200": GPU("H200", "sm_90", 4.8e12, 989e12, 132, ("H200",),
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16"),
    "H100": GPU("H100 SXM", "sm_90", 3.35e12, 989e12, 132, ("H100", "HBM3"),
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 "
                "(1,979 with sparsity); 132 SMs: NVIDIA H100 Tensor Core GPU architecture whitepaper"),
    "A100": GPU("A100 80GB", "sm_80", 2.039e12, 312e12, 108, ("A100-SXM4-80GB",),
                "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 2,039 GB/s HBM2e, 312 TFLOP/s dense "
                "BF16; 108 SMs: NVIDIA A100 Tensor Core GPU architecture whitepaper"),
}

_PROGRAMMING_GUIDE = ("NVIDIA CUDA C++ Programming Guide, table 'Technical Specifications per Compute "
                      "Capability'")
SM_LIMITS = {
    "sm_90": SMLimits("sm_90", 65536, 228 * 1024, 64, 32, 1024, _PROGRAMMING_GUIDE + " (9.0)"),
    "sm_80": SMLimits("sm_80", 65536, 164 * 1024, 64, 32, 1024, _PROGRAMMING_GUIDE + " (8.0)"),
}

LINKS = {
    "pcie_gen5_x16": Link("PCIe Gen5 x16", 64e9,
                          "PCI-SIG: 32 GT/s x 16 lanes, about 64 GB/s each direction (NVIDIA's H100 PCIe "
                          "figure, 128 GB/s, counts both directions)"),
    "nvlink_c2c": Link("NVLink-C2C", 450e9,
                       "NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s between Grace and Hopper, 450 GB/s "
                       "each direction"),
    "nvlink": Link("NVLink, intranode", 153e9,
                   "DeepEP README (deepseek-ai/DeepEP): 153 GB/s measured intranode dispatch on H800 "
                   "(about 160 GB/s the NVLink maximum there)"),
    "rdma": Link("RDMA, internode", 50e9,
                 "DeepEP README (deepseek-ai/DeepEP): 43-58 GB/s internode over CX7 400 Gb/s InfiniBand"),
}


def gpus_of(architecture: str) -> list[GPU]:
    """The GPUs of the table built on one architecture, in table order."""
    return [gpu for gpu in GPUS.values() if gpu.architecture == architecture]
