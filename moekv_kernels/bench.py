"""GPU benchmark of the kernels: time against the references and the bandwidth bound, TFLOP/s.

    python -m moekv_kernels.bench [--out moekv_kernels/bench_results.json] [--quick]

What each number means
----------------------
- time: median of triton.testing.do_bench (CUDA events, warm caches flushed between runs).
- bound: the bytes the launch must move (moekv_kernels.report.bound_bytes: each cached K/V byte read once,
  queries read, outputs written; for store_kv the new K/V read and written; for the GEMM inputs
  read and output written once) over the datasheet HBM bandwidth of the GPU (H200, H100 SXM, A100
  80GB; moekv_kernels.report cites the datasheets). fraction_of_bound = bound / time: 1 is the best a
  launch can do.
- bandwidth: the same bytes over the measured time. It is also compared with a device-to-device copy
  (`dst.copy_(src)`, read + write bytes) measured in the same run, because the copy is what the
  memory system really delivers, unlike the datasheet's peak.
- TFLOP/s of the grouped GEMM (2 * N * D * F over all experts) beside torch.matmul doing the same
  total work as one dense (N, D) @ (D, F) product: an upper bound the grouped kernel approaches.
- speed-up: the readable PyTorch reference's time over the kernel's.

On a machine without CUDA it stops with a message and measures nothing: the interpreter's speed
says nothing about a GPU's, and a table of CPU numbers would be mistaken for one.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from moekv_ref.jsonout import write

from .report import Config, bound_bytes, hbm_bandwidth

NO_GPU_MESSAGE = (
    "moekv_kernels/bench.py measures Triton kernels on a GPU and this machine has no CUDA device: "
    "nothing was measured.\n"
    "On a CPU, correctness is checked in the interpreter instead: python -m pytest tests/spec/test_kernels.py"
)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written over the time)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def bench_paged_attention(
    num_rows,
    context_len,
    block_size,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    split_k=False,
    tokens_per_split=512,
    with_reference=True,
) -> dict:
    """One paged decode configuration: every row holds context_len tokens in scattered blocks."""
    from .paged_attention import paged_attention, paged_attention_reference, random_paged_inputs
    from .paged_attention_split_k import paged_attention_split_k

    inputs = random_paged_inputs(
        [context_len] * num_rows, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", spare_blocks=0
    )
    if split_k:
        ms = _time_ms(lambda: paged_attention_split_k(*inputs, tokens_per_split=tokens_per_split))
    else:
        ms = _time_ms(lambda: paged_attention(*inputs))
    config = Config(
        "paged_attention_split_k" if split_k else "paged_attention",
        _name(dtype),
        head_dim,
        num_kv_heads,
        num_heads // num_kv_heads,
        block_size,
        num_rows,
        context_len,
        tokens_per_split,
    )
    moved = bound_bytes(config, config.kernel) + (bound_bytes(config, "combine_splits") if split_k else 0)
    result = {
        "kernel": "paged_attention_split_k" if split_k else "paged_attention",
        "rows": num_rows,
        "context_len": context_len,
        "block_size": block_size,
        "cached_tokens": num_rows * context_len,
        "heads": f"{num_heads}/{num_kv_heads}x{head_dim}",
        "dtype": str(dtype).replace("torch.", ""),
        "time_ms": ms,
        "bound_bytes": moved,
        "bandwidth_gb_s": moved / (ms * 1e-3) / 1e9,
    }
    if with_reference:
        result["reference_ms"] = _time_ms(lambda: paged_attention_reference(*inputs))
        result["speedup"] = result["reference_ms"] / ms
    return result


def bench_store_kv(num_tokens, block_size, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16) -> dict:
    from .store_kv import random_store_inputs, store_kv, store_kv_reference

    num_blocks = 2 * num_tokens // block_size + 1
    key, value, key_cache, value_cache, slots = random_store_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, "cuda"
    )
    key, value = key.to(dtype), value.to(dtype)  # the model hands the pool's dtype
    ms = _time_ms(lambda: store_kv(key, value, key_cache, value_cache, slots))
    reference_ms = _time_ms(lambda: store_kv_reference(key, value, key_cache, value_cache, slots))
    moved = bound_bytes(Config("store_kv", _name(dtype), head_dim, num_kv_heads, rows=num_tokens), "store_kv")
    return {
        "kernel": "store_kv",
        "tokens": num_tokens,
        "block_size": block_size,
        "dtype": str(dtype).replace("torch.", ""),
        "time_ms": ms,
        "bound_bytes": moved,
        "bandwidth_gb_s": moved / (ms * 1e-3) / 1e9,
        "reference_ms": reference_ms,
        "speedup": reference_ms / ms,
    }


GEMM_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages), swept instead of autotuned
    (64, 64, 32, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 256, 64, 8, 4),
]


def bench_expert_gemm(
    num_tokens, num_experts, model_dim, out_dim, dtype=torch.bfloat16, tiles=GEMM_TILES
) -> dict:
    """Tokens spread unevenly over experts (a Zipf-like split), every tile config tried, best kept."""
    from .expert_gemm import expert_gemm, expert_gemm_reference, random_gemm_inputs

    shares = torch.tensor([1.0 / (e + 1) for e in range(num_experts)])
    counts = (shares / shares.sum() * num_tokens).long()
    counts[0] += num_tokens - int(counts.sum())
    x, weights, counts = random_gemm_inputs(counts.tolist(), model_dim, out_dim, dtype, "cuda")
    times = {}
    for tile in tiles:
        block_m, block_n, block_k, num_warps, num_stages = tile
        try:
            times[tile] = _time_ms(
                lambda: expert_gemm(x, weights, counts, block_m, block_n, block_k, num_warps, num_stages)
            )
        except Exception as error:  # a config the device cannot hold (shared memory) is skipped
            print(f"  tile {tile} skipped: {type(error).__name__}", file=sys.stderr)
    best_tile = min(times, key=times.get)
    dense_x = torch.randn(num_tokens, model_dim, device="cuda", dtype=dtype)
    matmul_ms = _time_ms(lambda: dense_x @ weights[0])
    reference_ms = _time_ms(lambda: expert_gemm_reference(x, weights, counts))
    flop = 2 * num_tokens * model_dim * out_dim
    return {
        "kernel": "expert_gemm",
        "tokens": num_tokens,
        "experts": num_experts,
        "shape": f"{model_dim}x{out_dim}",
        "dtype": str(dtype).replace("torch.", ""),
        "best_tile": list(best_tile),
        "time_ms": times[best_tile],
        "bound_bytes": bound_bytes(
            Config("expert_gemm", _name(dtype), gemm=(num_tokens, num_experts, model_dim, out_dim)),
            "expert_gemm",
        ),
        "tflops": flop / (times[best_tile] * 1e-3) / 1e12,
        "matmul_tflops": flop / (matmul_ms * 1e-3) / 1e12,
        "reference_ms": reference_ms,
        "speedup": reference_ms / times[best_tile],
    }


def run(quick: bool = False) -> dict:
    import triton

    copy_gb_s = copy_bandwidth()
    results = []
    contexts = [1024, 4096] if quick else [1024, 4096, 16384]
    for block_size in [16, 32]:
        for num_rows in [8, 64]:
            for context_len in contexts:
                results.append(bench_paged_attention(num_rows, context_len, block_size))
    for num_rows, context_len in [(2, 32768), (4, 32768)] if not quick else [(4, 32768)]:
        results.append(bench_paged_attention(num_rows, context_len, 16, split_k=True))
        results.append(bench_paged_attention(num_rows, context_len, 16, with_reference=False))
    for num_tokens in [64, 4096]:
        results.append(bench_store_kv(num_tokens, 16))
    results.append(bench_expert_gemm(4096, 8, 4096, 14336 if not quick else 4096))
    results.append(bench_expert_gemm(8192, 64, 2048, 768))
    datasheet = hbm_bandwidth(torch.cuda.get_device_name())
    for result in results:
        if datasheet is not None:
            result["bound_ms"] = result["bound_bytes"] / datasheet[1] * 1e3
            result["fraction_of_bound"] = result["bound_ms"] / result["time_ms"]
        if "bandwidth_gb_s" in result:
            result["fraction_of_copy"] = result["bandwidth_gb_s"] / copy_gb_s
        if "tflops" in result:
            result["fraction_of_matmul"] = result["tflops"] / result["matmul_tflops"]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "copy_bandwidth_gb_s": copy_gb_s,
        "datasheet_bandwidth": datasheet,
        "results": results,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
        f"copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s",
        f"{'kernel':<26}{'configuration':<44}{'time ms':>9}{'bound ms':>9}{'of bound':>9}{'GB/s':>8}{'of copy':>9}"
        f"{'TFLOP/s':>9}{'of mm':>7}{'speed-up':>10}",
    ]
    for r in report["results"]:
        if r["kernel"].startswith("paged"):
            config = f"rows {r['rows']} ctx {r['context_len']} P {r['block_size']} {r['heads']} {r['dtype']}"
        elif r["kernel"] == "store_kv":
            config = f"tokens {r['tokens']} P {r['block_size']} {r['dtype']}"
        else:
            config = f"N {r['tokens']} E {r['experts']} {r['shape']} {r['dtype']} tile {r['best_tile'][:3]}"

        def cell(key, width, fmt):
            return f"{r[key]:{width}{fmt}}" if key in r else " " * width

        lines.append(
            f"{r['kernel']:<26}{config:<44}{cell('time_ms', 9, '.3f')}{cell('bound_ms', 9, '.3f')}"
            f"{cell('fraction_of_bound', 9, '.0%')}{cell('bandwidth_gb_s', 8, '.0f')}"
            f"{cell('fraction_of_copy', 9, '.0%')}{cell('tflops', 9, '.1f')}{cell('fraction_of_matmul', 7, '.0%')}"
            f"{cell('speedup', 10, '.1f')}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="moekv_kernels/bench_results.json", help="where to write the JSON")
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (fewer contexts and shapes)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU_MESSAGE)
    report = run(quick=args.quick)
    print(format_table(report))
    write(args.out, report, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
