"""bench/cpu_linear.py on two small shapes: each ratio by its definition, the kernel it says the library chose is the
one ``citer.kernels.cpu_linear`` takes for such a weight here, and the report renders as its per-CPU docs block."""

from __future__ import annotations

import json

import pytest
from conftest import bench_module

from citer.evaluation.docs_blocks import render_blocks
from citer.kernels import cpu_linear


def test_the_report_holds_its_ratios_and_the_librarys_choice(tmp_path):
    bench = bench_module("cpu_linear")
    out = tmp_path / "bench_cpu_linear_here.json"
    args = ["--quick", "--rows", "1,8", "--reps", "1", "--cold-mb", "4", "--out", str(out),
            "--engine", "1,2", "--pair", "tiny", "--prompt-len", "4", "--new-tokens", "3"]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert [(x["shape"], x["rows"]) for x in rep["rows"]] == [
        ("small", 1),
        ("small", 8),
        ("mid", 1),
        ("mid", 8),
    ]
    assert rep["fp32_packed_here"] == cpu_linear._fp32_packed()
    for x in rep["rows"]:
        assert x["torch_over_packed"] == pytest.approx(x["torch_ms"] / x["packed_ms"])
        assert x["packed_gb_s"] == pytest.approx(x["out"] * x["in"] * 4 / 1e9 / (x["packed_ms"] / 1e3))
        big = x["out"] * x["in"] >= cpu_linear.FP32_PACKED_MIN
        kernel = x["rows"] <= cpu_linear.F32_MAX_ROWS and cpu_linear.f32_available()
        assert ("kernel_ms" in x) == kernel and (not kernel or x["row_invariant"]["kernel"])
        path = ("kernel" if kernel else "packed") if big and rep["fp32_packed_here"] else "torch"
        assert x["chosen"] == path
        assert x["int8_bf16_ms"] > 0 and ("int8_fp32_ms" in x) == (x["rows"] == 1)
    assert [(x["batch"], x["engine"]) for x in rep["engine_rows"]] == [
        (b, e) for b in (1, 2) for e in ("llm", "slm", "routed")
    ]
    for x in rep["engine_rows"]:
        assert x["torch_over_packed"] == pytest.approx(x["torch_s"] / x["packed_s"])
        assert x["packed_over_kernel"] == pytest.approx(x["packed_s"] / x["kernel_s"])
        assert x[
            "same_tokens"
        ]  # the tiny pair's weights are all below the threshold: torch's linear both times
    assert cpu_linear._fp32_packed() == rep["fp32_packed_here"]  # the bench leaves the path as it found it
    body, files = render_blocks(tmp_path, ["cpu_linear_here"])["cpu_linear_here"]
    assert (
        files == ["bench_cpu_linear_here.json"]
        and "| mid (1024 × 256) |" in body
        and "| 2 | routed |" in body
    )
    assert "int8 weights, bf16 activations, 8 rows" in body
    # the kernel's own table and engine columns, each ratio as the report has it
    if cpu_linear.f32_available():
        mid1, mid8 = rep["rows"][2], rep["rows"][3]
        assert (f"| mid (1024 × 256) | {mid1['kernel_gb_s']:.1f} | {mid1['packed_ms'] / mid1['kernel_ms']:.2f}× | "
                f"{mid8['packed_ms'] / mid8['kernel_ms']:.2f}× |") in body  # fmt: skip
        e = rep["engine_rows"][-1]
        assert (
            f"| 2 | routed | {e['kernel_s']:.2f} s | {e['torch_s']:.2f} s | {e['packed_s']:.2f} s | " in body
        )
        assert "the kernel's row 0 bit for bit the same alone and beside the others: 4/4 calls" in body
    else:  # no kernel timed per weight (an Intel CPU: float32 keeps MKL), so no table of the kernel's own
        assert "kernel GB/s, 1 row" not in body
