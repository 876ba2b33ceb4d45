"""Every kernel compiles for the GPUs it is meant for, without one: sm_90 (H100/H200) and sm_80 (A100).

moekv_kernels.report compiles each kernel ahead of time with the ptxas Triton ships, at the configurations
the model and the real-shape presets use (moekv_kernels.report.CONFIGS: Dh 64 and 128, query groups 1 to
8, block sizes 1 to 64, float16 / bfloat16 / float32 caches, the tiles the launchers and the
benchmark choose), and reads registers, local memory and instructions from the cubins. A compile
error fails here, and so does any local memory (spilled registers), which a kernel bound by memory
bandwidth cannot afford.

All configurations are compiled once per session (two at a time) and shared by the tests below;
Triton's on-disk cache makes later sessions faster still.
"""

import pytest

pytest.importorskip("triton")

from moekv_kernels import report  # noqa: E402

TARGETS = ("sm_90", "sm_80")


@pytest.fixture(scope="module")
def rows():
    if report.triton_tool("ptxas") is None or report.triton_tool("cuobjdump") is None:
        pytest.skip(
            "ptxas / cuobjdump not found: the static GPU check needs the CUDA tools Triton ships "
            "(triton/backends/nvidia/bin); install a triton wheel that bundles them"
        )
    return report.collect(report.CONFIGS, TARGETS, jobs=2)


def test_every_kernel_compiles_for_every_target(rows):
    compiled = {(r["kernel"], r["config"], r["target"]) for r in rows}
    expected_kernels = {
        "paged_attention",
        "paged_attention_split_k",
        "combine_splits",
        "store_kv",
        "expert_gemm",
    }
    assert {kernel for kernel, _, _ in compiled} == expected_kernels
    for target in TARGETS:
        for config in report.CONFIGS:
            assert any(c == config.name and t == target for _, c, t in compiled), (config, target)


def test_no_kernel_spills_registers(rows):
    spilling = [
        (r["kernel"], r["config"], r["target"], r["registers"], r["stack_bytes"], r["local_bytes"])
        for r in rows
        if r["stack_bytes"] or r["local_bytes"]
    ]
    assert not spilling, f"local memory (spilled registers) in: {spilling}"


def test_decode_kernels_leave_room_for_four_blocks_per_sm(rows):
    """At Dh = 128, query groups up to 8, float16 and bfloat16: at most 128 registers per thread, so at
    least 4 blocks of 4 warps are resident on an SM (the bytes in flight they need: see the
    docstring of moekv_kernels/paged_attention.py)."""
    decode = [
        r
        for r in rows
        if r["kernel"] in ("paged_attention", "paged_attention_split_k")
        and r["settings"]["head_dim"] == 128
        and r["settings"]["dtype"] in ("float16", "bfloat16")
    ]
    assert {r["settings"]["group"] for r in decode} >= {1, 4, 8}
    for r in decode:
        assert r["registers"] <= 128, r
        assert r["warps"] == 4 and r["blocks_per_sm"] >= 4, r


def test_tensor_cores_where_the_kernels_use_tl_dot(rows):
    """16-bit tl.dot becomes tensor-core instructions: Hopper's HGMMA for the GEMM's 64-row tiles on
    sm_90, mma.sync (HMMA) for the decode kernels' 16-row tiles and everything on sm_80."""
    for r in rows:
        if r["kernel"] in report.USES_DOT and r["settings"]["dtype"] != "float32":
            assert r["tensor_core"] != "none", r
        if r["kernel"] == "expert_gemm" and r["target"] == "sm_90" and r["settings"]["dtype"] != "float32":
            assert "HGMMA" in r["tensor_core"], r


def test_occupancy_arithmetic():
    """The resident-block formula of moekv_kernels.report on numbers worked by hand."""
    h100 = report.TARGETS["sm_90"]
    # 255 registers: 256 * 32 = 8192 per warp, 8 warps per SM, 2 blocks of 4 warps
    assert report.occupancy(h100, 255, 5 * 1024, 4) == {
        "blocks_per_sm": 2,
        "warps_per_sm": 8,
        "limited_by": "registers",
    }
    # 80 registers: 2560 per warp, 25 warps, 6 blocks of 4
    assert report.occupancy(h100, 80, 10 * 1024, 4)["blocks_per_sm"] == 6
    # 32 registers: registers allow 16 blocks of 4 warps, the 64-warp limit too: 16
    assert report.occupancy(h100, 32, 0, 4) == {
        "blocks_per_sm": 16,
        "warps_per_sm": 64,
        "limited_by": "warps",
    }
    # 100 KB of shared memory: 2 blocks on an H100 (228 KB), 1 on an A100 (164 KB)
    assert report.occupancy(h100, 32, 100 * 1024, 4)["blocks_per_sm"] == 2
    assert report.occupancy(report.TARGETS["sm_80"], 32, 100 * 1024, 4)["limited_by"] == "shared"


def test_bandwidth_bound_counts_each_byte_once():
    """Decode at 64 rows x 4096 tokens, 4 KV heads of 128 (group 8), bfloat16, P = 16, worked by hand:
    K and V 2 * 64 * 4096 * 4 * 128 * 2 B = 536,870,912; block tables and lengths 64 * (256 * 4 + 4)
    = 65,792; queries read and outputs written 2 * 64 * 32 * 128 * 2 = 1,048,576."""
    config = report.Config("paged_attention", "bfloat16", head_dim=128, num_kv_heads=4, group=8)
    assert report.bound_bytes(config, "paged_attention") == 536_870_912 + 65_792 + 1_048_576
    # at the H200's 4.8 TB/s that is 112.1 microseconds
    assert round(report.bound_bytes(config, "paged_attention") / 4.8e12 * 1e6, 1) == 112.1
    assert report.hbm_bandwidth("NVIDIA H200") == ("H200", 4.8e12)
    assert report.hbm_bandwidth("NVIDIA A100-SXM4-80GB") == ("A100 80GB", 2.039e12)
    assert (
        report.hbm_bandwidth("NVIDIA H100 PCIe") is None
        and report.hbm_bandwidth("NVIDIA GeForce RTX 4090") is None
    )
