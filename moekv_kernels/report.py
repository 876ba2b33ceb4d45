"""What each kernel asks of a GPU, read from its compiled code on a machine without one.

    python -m moekv_kernels.report [--json PATH] [--quick] [--target sm_90|sm_80]

Why this works without a GPU
----------------------------
Triton compiles ahead of time for a named target: `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))` runs the whole pipeline down to a cubin with the `ptxas` that
Triton ships (triton/backends/nvidia/bin). No driver and no device are needed. The cubin then
tells, through Triton's `cuobjdump`:

- registers per thread (REG) and local memory (STACK: the stack frame, where ptxas puts the
  registers it spills; LOCAL: other per-thread local arrays). Local memory is DRAM behind the
  caches: a kernel bound by memory bandwidth must not add traffic of its own.
- shared memory per block (Triton's dynamic shared memory plus any static shared memory).
- the machine code (SASS), where tensor-core instructions are visible: HMMA (Ampere's mma.sync,
  also used on Hopper for small tiles) and HGMMA (Hopper's warpgroup wgmma).

Each kernel is compiled from the same launch description its launcher runs (moekv_kernels._utils.Launch:
grid, arguments, constexprs, num_warps), built from small CPU tensors of the configuration's shapes
and specialized by Triton's own argument binder (integers equal to 1 become constants, integers
and pointers divisible by 16 are marked so), so the code measured is the code a launch would run.

Occupancy: how many blocks fit on one SM
----------------------------------------
An SM holds a block only if its registers, shared memory and warps all fit:

    registers per warp = ceil(regs per thread * 32 / 256) * 256      (allocated in units of 256)
    blocks by registers = floor(floor(65536 / registers per warp) / warps per block)
    blocks by shared    = floor(shared per SM / (shared per block + 1 KB the driver reserves))
    blocks by warps     = floor(64 / warps per block),   and at most 32 blocks
    resident blocks     = the smallest of these;  resident warps = blocks * warps per block

Bandwidth bound
---------------
The least time one launch can take at a stated shape is the bytes it must move (every K/V byte of
every row read once, queries read, outputs written, block tables read; for a GEMM the inputs read
and the output written once) over the GPU's memory bandwidth. moekv_kernels/bench.py measures the same
launches on a GPU against this bound.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from moekv_ref.apps import options
from moekv_ref.costs import GPUS, SM_LIMITS, gpus_of
from moekv_ref.jsonout import dump, write

from ._utils import Launch, describing_launches, is_interpreting

# ----- the targets --------------------------------------------------------------------------------
# Per-SM limits and HBM bandwidths come from moekv_ref/costs.py, the one hardware table, where
# each number has its source.


@dataclass(frozen=True)
class Target:
    name: str  # as printed: "sm_90"
    capability: int  # 90 = compute capability 9.0
    gpus: tuple  # ((GPU name, HBM bytes per second), ...) built on this architecture
    registers_per_sm: int
    shared_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    reserved_shared_per_block: int


def _target(architecture: str) -> Target:
    limits = SM_LIMITS[architecture]
    return Target(
        architecture,
        int(architecture.split("_")[1]),
        tuple((gpu.name, gpu.hbm_bytes_per_s) for gpu in gpus_of(architecture)),
        limits.registers_per_sm,
        limits.shared_per_sm,
        limits.max_warps_per_sm,
        limits.max_blocks_per_sm,
        limits.reserved_shared_per_block,
    )


TARGETS = {architecture: _target(architecture) for architecture in ("sm_90", "sm_80")}


def hbm_bandwidth(device_name: str) -> tuple[str, float] | None:
    """(GPU, datasheet HBM bytes/s) for a device name, e.g. "NVIDIA H100 80GB HBM3"; None for a GPU
    not in the hardware table (then the benchmark reports no bound rather than a wrong one; the PCIe
    and 40 GB parts have other bandwidths)."""
    for gpu in GPUS.values():
        if all(part in device_name for part in gpu.device_name_parts):
            return gpu.name, gpu.hbm_bytes_per_s
    return None


def occupancy(target: Target, registers: int, shared_bytes: int, num_warps: int) -> dict:
    """Resident blocks and warps per SM, and which resource runs out first (the formulas above)."""
    registers_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = {
        "registers": (target.registers_per_sm // registers_per_warp) // num_warps,
        "shared": target.shared_per_sm // (shared_bytes + target.reserved_shared_per_block),
        "warps": target.max_warps_per_sm // num_warps,
        "blocks": target.max_blocks_per_sm,
    }
    blocks = min(limits.values())
    limited_by = next(k for k in ("warps", "blocks", "registers", "shared") if limits[k] == blocks)
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps, "limited_by": limited_by}


# ----- the configurations -------------------------------------------------------------------------
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Config:
    """One kernel at one configuration, and the shape its bandwidth bound is stated for."""

    kernel: str  # paged_attention | paged_attention_split_k | store_kv | expert_gemm
    dtype: str  # bfloat16 | float16 | float32 (cache, or GEMM operands)
    head_dim: int = 128  # Dh
    num_kv_heads: int = 8  # Hkv
    group: int = 4  # query heads per KV head
    block_size: int = 16  # P
    rows: int = 64  # bound shape: rows of one decode launch (or new tokens for store_kv)
    context_len: int = 4096  # bound shape: tokens per row
    tokens_per_split: int = 512  # bound shape of the split-K kernels
    gemm: tuple = (4096, 8, 4096, 14336)  # bound shape of expert_gemm: N tokens, E experts, D, F
    tiles: tuple = (64, 64, 32, 4, 3)  # expert_gemm's block_m, block_n, block_k, warps, stages

    @property
    def name(self) -> str:
        if self.kernel == "expert_gemm":
            return (
                f"{self.dtype} tiles {'x'.join(map(str, self.tiles[:3]))} w{self.tiles[3]} s{self.tiles[4]}"
            )
        if self.kernel == "store_kv":
            return f"{self.dtype} Hkv {self.num_kv_heads} Dh {self.head_dim}"
        return f"{self.dtype} Dh {self.head_dim} group {self.group} P {self.block_size}"


def decode_configs(kernel: str, **shape) -> list[Config]:
    return [Config(kernel, dtype, **shape) for dtype in DTYPES]


# The model presets' attention (moekv_ref/config.py): Mixtral-8x7B 32/8 heads of 128 (group 4),
# Qwen3-30B-A3B 32/4 (group 8), JetMoE-8B 16/16 (group 1), plus Dh = 64 and the embedded tiny model
# (2/2 heads of 32, float32); block sizes 1, 16 (the default) and 64; each storage dtype. Not every
# product of these: float16 and bfloat16 compile to the same code but for the conversions, and
# the block size only changes the index arithmetic, so a representative grid keeps the static
# check near a minute on two cores.
CONFIGS: list[Config] = [
    *decode_configs("paged_attention", head_dim=128, num_kv_heads=4, group=8),
    Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=8, group=4),
    Config("paged_attention", "float16", head_dim=128, num_kv_heads=16, group=1),
    Config("paged_attention", "bfloat16", head_dim=64, num_kv_heads=8, group=1),
    Config("paged_attention", "float32", head_dim=64, num_kv_heads=8, group=1),
    Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=4, group=8, block_size=1),
    Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=4, group=8, block_size=64),
    Config("paged_attention", "float32", head_dim=32, num_kv_heads=2, group=1, block_size=16),
    *[
        Config("paged_attention_split_k", d, head_dim=128, num_kv_heads=4, group=8, rows=4, context_len=32768)
        for d in ("bfloat16", "float32")
    ],
    Config(
        "paged_attention_split_k", "float16", head_dim=64, num_kv_heads=8, group=1, rows=4, context_len=32768
    ),
    *[Config("store_kv", d, num_kv_heads=8, head_dim=128, rows=64) for d in DTYPES],
    *[Config("expert_gemm", d) for d in DTYPES],
    # two of the larger tiles moekv_kernels/bench.py sweeps on a GPU
    *[Config("expert_gemm", "bfloat16", tiles=t) for t in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]],
]

# a few lines for the notebook: the decode kernel at the presets' shapes, and one of each other kernel
QUICK = [
    Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=4, group=8),
    Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=16, group=1),
    Config("paged_attention", "float32", head_dim=128, num_kv_heads=4, group=8),
    Config(
        "paged_attention_split_k",
        "bfloat16",
        head_dim=128,
        num_kv_heads=4,
        group=8,
        rows=4,
        context_len=32768,
    ),
    Config("store_kv", "bfloat16", rows=64),
    Config("expert_gemm", "bfloat16"),
]


USES_DOT = {"paged_attention", "paged_attention_split_k", "expert_gemm"}  # kernels built on tl.dot


def launches(config: Config) -> list[tuple[str, Launch]]:
    """The launch descriptions of one configuration, built from small CPU tensors of its shapes
    (two rows, two blocks: sizes that do not change the compiled code)."""
    from .expert_gemm import expert_gemm_launch
    from .paged_attention import paged_attention_launch
    from .paged_attention_split_k import paged_attention_split_k_launches
    from .store_kv import store_kv_launch

    dtype = DTYPES[config.dtype]
    hkv, dh, p = config.num_kv_heads, config.head_dim, config.block_size
    with describing_launches():
        if config.kernel == "expert_gemm":
            # (D, F) = (64, 64) instead of the stated shape's: both divisible by 16, so the same
            # specialization and the same code, without allocating gigabytes of weights
            num_experts = config.gemm[1]
            x = torch.zeros(2 * num_experts, 64, dtype=dtype)
            weights = torch.zeros(num_experts, 64, 64, dtype=dtype)
            counts = torch.full((num_experts,), 2, dtype=torch.int32)
            return [("expert_gemm", expert_gemm_launch(x, weights, counts, *config.tiles))]
        if config.kernel == "store_kv":
            kv = torch.zeros(2, hkv, dh, dtype=dtype)
            pool = torch.zeros(2, p, hkv, dh, dtype=dtype)
            return [("store_kv", store_kv_launch(kv, kv, pool, pool, torch.zeros(2, dtype=torch.int64)))]
        q = torch.zeros(2, hkv * config.group, dh, dtype=dtype)
        pool = torch.zeros(2, p, hkv, dh, dtype=dtype)
        tables = torch.zeros(2, math.ceil(config.context_len / p), dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        if config.kernel == "paged_attention":
            return [("paged_attention", paged_attention_launch(q, pool, pool, tables, lens))]
        split, combine = paged_attention_split_k_launches(q, pool, pool, tables, lens)
        return [("paged_attention_split_k", split), ("combine_splits", combine)]


def bound_bytes(config: Config, kernel: str) -> int:
    """Bytes one launch must move at the configuration's stated shape (the least DRAM traffic)."""
    e = torch.finfo(DTYPES[config.dtype]).bits // 8
    rows, ctx, hkv, dh = config.rows, config.context_len, config.num_kv_heads, config.head_dim
    heads = hkv * config.group
    if kernel == "expert_gemm":
        tokens, experts, model_dim, out_dim = config.gemm
        return e * (tokens * model_dim + experts * model_dim * out_dim + tokens * out_dim)
    if kernel == "store_kv":
        return 2 * 2 * rows * hkv * dh * e + rows * 8  # K and V read and written, slots read
    kv = 2 * rows * ctx * hkv * dh * e  # every cached K/V byte once
    tables = rows * (math.ceil(ctx / config.block_size) * 4 + 4)
    splits = math.ceil(ctx / config.tokens_per_split)
    partial = rows * heads * splits * (dh + 1) * 4  # float32 partial outputs and lse
    if kernel == "paged_attention":
        return kv + tables + 2 * rows * heads * dh * e  # + q read, out written
    if kernel == "paged_attention_split_k":
        return kv + tables + rows * heads * dh * e + partial  # + q read, partials written
    return partial + rows * heads * dh * e  # combine: partials read, out written


def bound_shape(config: Config, kernel: str) -> str:
    if kernel == "expert_gemm":
        return "N {} E {} {}x{}".format(*config.gemm)
    if kernel == "store_kv":
        return f"{config.rows} tokens"
    return f"{config.rows} rows x {config.context_len} tokens, Hkv {config.num_kv_heads}"


# ----- compiling for a target and reading the cubin -----------------------------------------------
def triton_tool(name: str) -> str | None:
    """Path of a CUDA tool Triton ships (ptxas, cuobjdump), or on PATH; None when there is none."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.access(bundled, os.X_OK) else shutil.which(name)


def compile_launch(launch: Launch, target: Target):
    """triton.compile of one launch for `target`, specialized as Triton's launcher would.

    Uses Triton's own binder (triton.runtime.jit.create_function_from_signature and
    JITFunction._pack_args, as of triton 3.7) so the signature, constants and divisibility
    attributes are the ones a real launch computes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    assert isinstance(kernel, JITFunction), (
        f"{kernel!r} is not compiled code: the interpreter (TRITON_INTERPRET=1) was on when triton was imported"
    )
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.meta)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.meta, bound_args, specialization, options
    )
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__
    )


def read_cubin(cubin: bytes) -> dict:
    """Registers, local memory and static shared memory (cuobjdump -res-usage), and the tensor-core
    instructions in its SASS (cuobjdump -sass)."""
    cuobjdump = triton_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [cuobjdump, "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    mma = sorted({m for m in re.findall(r"\b(HGMMA|HMMA)\b", sass)})
    return {
        "registers": int(found["REG"]),
        "stack_bytes": int(found["STACK"]),
        "local_bytes": int(found["LOCAL"]),
        "static_shared_bytes": int(found["SHARED"]),
        "tensor_core": "+".join(mma) or "none",
    }


def spilled_bytes(ptx: str, target: Target) -> int:
    """Bytes of spill stores + spill loads that `ptxas -v` reports for the kernel's PTX.

    Run only when the cubin has a stack frame: a stack frame may also hold other things (a local
    array, the call ABI), and only ptxas's own count says whether registers were spilled. The flags
    are Triton's (its make_cubin step) and the architecture name too (sm_90a on Hopper)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        log = subprocess.run(
            [
                triton_tool("ptxas"),
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={sm_arch_from_capability(target.capability)}",
                source,
                "-o",
                os.path.join(folder, "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def measure(config: Config, target: Target, kernel_name: str, launch: Launch) -> dict:
    """One row of the report: one compiled kernel of a configuration on a target."""
    compiled = compile_launch(launch, target)
    usage = read_cubin(compiled.asm["cubin"])
    usage["spill_bytes"] = spilled_bytes(compiled.asm["ptx"], target) if usage["stack_bytes"] else 0
    shared = compiled.metadata.shared + usage.pop("static_shared_bytes")
    warps = compiled.metadata.num_warps
    moved = bound_bytes(config, kernel_name)
    return {
        "kernel": kernel_name,
        "config": config.name,
        "target": target.name,
        **usage,
        "shared_bytes": shared,
        "warps": warps,
        **occupancy(target, usage["registers"], shared, warps),
        "uses_dot": kernel_name in USES_DOT,
        "bound_shape": bound_shape(config, kernel_name),
        "bound_bytes": moved,
        "bound_us": {gpu: moved / bandwidth * 1e6 for gpu, bandwidth in target.gpus},
        "settings": asdict(config),
    }


def collect(configs=None, targets=("sm_90", "sm_80"), jobs: int = 2) -> list[dict]:
    """Compile every configuration for every target; rows as in measure().

    In the interpreter (no GPU here) triton.jit made interpreted functions, which cannot be
    compiled: the work then runs in a child process started with TRITON_INTERPRET=0."""
    configs = CONFIGS if configs is None else configs
    if triton_tool("ptxas") is None or triton_tool("cuobjdump") is None:
        raise FileNotFoundError(
            "ptxas / cuobjdump not found (Triton ships them in triton/backends/nvidia/bin)"
        )
    if is_interpreting():
        return _collect_in_child(configs, targets, jobs)
    work = [
        (config, TARGETS[name], kernel_name, launch)
        for config in configs
        for kernel_name, launch in launches(config)
        for name in targets
    ]
    if jobs == 1:
        return [measure(*item) for item in work]
    from concurrent.futures import ThreadPoolExecutor  # ptxas and cuobjdump run as child processes

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda item: measure(*item), work))


def _collect_in_child(configs, targets, jobs) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        request, answer = os.path.join(folder, "configs.json"), os.path.join(folder, "rows.json")
        with open(request, "w") as file:
            dump([asdict(c) for c in configs], file)
        env = dict(os.environ, TRITON_INTERPRET="0")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [
            sys.executable,
            "-m",
            "moekv_kernels.report",
            "--configs",
            request,
            "--json",
            answer,
            "--jobs",
            str(jobs),
            "--silent",
            *[arg for t in targets for arg in ("--target", t)],
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling for a GPU failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        with open(answer) as file:
            return json.load(file)


# ----- the table ----------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    gpus = [gpu for target in TARGETS.values() for gpu, _ in target.gpus]
    header = (
        f"{'kernel':<24}{'configuration':<32}{'target':<7}{'regs':>5}{'spill B':>8}{'smem KB':>8}"
        f"{'warps':>6}{'blocks/SM':>10}{'warps/SM':>9}  {'limited by':<11}{'tensor core':<12}"
        f"{'moves MB':>9}  bound at HBM bandwidth"
    )
    lines = [header, "-" * (len(header) + 12)]
    for r in rows:
        bounds = ", ".join(f"{gpu} {us:.1f} us" for gpu, us in r["bound_us"].items() if gpu in gpus)
        tensor_core = r["tensor_core"] if r["uses_dot"] else "(no dot)"
        lines.append(
            f"{r['kernel']:<24}{r['config']:<32}{r['target']:<7}{r['registers']:>5}"
            f"{r['spill_bytes']:>8}{r['shared_bytes'] / 1024:>8.1f}{r['warps']:>6}"
            f"{r['blocks_per_sm']:>10}{r['warps_per_sm']:>9}  {r['limited_by']:<11}{tensor_core:<12}"
            f"{r['bound_bytes'] / 1e6:>9.1f}  {bounds}   [{r['bound_shape']}]"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a few configurations instead of all")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: all")
    parser.add_argument("--jobs", type=int, default=2, help="compilations at once (default 2)")
    parser.add_argument("--configs", help=argparse.SUPPRESS)  # JSON list of Config fields (child)
    parser.add_argument("--silent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:  # before the compiling (a minute with every configuration): the folder is made if missing
        options.output_file("--json", args.json, parents_made=True)
    except ValueError as error:
        parser.error(str(error))
    if args.configs:
        with open(args.configs) as file:
            configs = [
                Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
                for c in json.load(file)
            ]
    else:
        configs = QUICK if args.quick else CONFIGS
    rows = collect(configs, tuple(args.target or TARGETS), args.jobs)
    if not args.silent:
        print(format_table(rows))
    if args.json:
        write(args.json, rows, indent=1)
        if not args.silent:
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
