"""bench/slm_step.py at tiny shapes, in float32 and bf16: a row per batch and decoder, each ratio by its definition,
cpu_linear's paths left as the bench found them; with llama.cpp importable, its files' rows beside torch's."""

from __future__ import annotations

import json

import pytest
from conftest import bench_module

from citer.decoding.llama_cpp_runner import missing
from citer.kernels import cpu_linear


@pytest.mark.parametrize(("dtype", "types"), [("fp32", ""), ("fp32", "F32,Q8_0"), ("bf16", "BF16")])
def test_the_report_holds_a_step_per_batch_and_decoder(tmp_path, dtype, types):
    if types and missing():
        pytest.skip(missing())
    bench = bench_module("slm_step")
    out = tmp_path / "bench_slm_step.json"
    args = ["--pair", "tiny", "--batches", "1,2", "--prompt-len", "4", "--new-tokens", "3", "--reps", "1",
            "--dtype", dtype, "--llama-cpp-types", types, "--out", str(out)]  # fmt: skip
    before = (cpu_linear._fp32_packed(), cpu_linear._enabled(), cpu_linear.amx(), cpu_linear.step_ops_on())
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["dtype"] == dtype
    other_rows = (
        ["torch packed", "torch F.linear"] if dtype == "fp32" else ["torch kernel, no AMX", "torch F.linear"]
    )
    torch_rows = ["torch kernel", "torch kernel, torch ops", *other_rows, "torch kernel, 4 KiB pages"]
    decoders = torch_rows + [f"llama.cpp {t}" for t in types.split(",") if t]
    assert [(r["batch"], r["decoder"]) for r in rep["rows"]] == [(b, d) for b in (1, 2) for d in decoders]
    best = rep["read_bytes_per_s"]["best"]
    assert len(rep["read_passes"]) == 2 and best == max(rep["read_passes"])  # before and after the timed runs
    for b, rate in rep["kernel_macs_per_s"].items():  # the best of the samples beside each rep
        samples = rep["kernel_macs_samples"][b]
        assert len(samples) == (1 if cpu_linear.f32_available() and dtype == "fp32" else 0)  # one rep
        assert rate == (max(samples) if samples else None)
    for r in rep["rows"]:
        assert r["bytes_ms"] == pytest.approx(r["weight_mb"] * 1e6 / best * 1e3)
        assert r["x_bytes"] == pytest.approx(r["step_ms"] / r["bytes_ms"])
        assert len(r["walls_s"]["3"]) == len(r["walls_s"]["1"]) == 1
        rate = rep["kernel_macs_per_s"][str(r["batch"])]
        if rate is not None and r["decoder"].startswith("torch"):
            assert r["compute_ms"] == pytest.approx(r["batch"] * r["weight_mb"] * 1e6 / 4 / rate * 1e3)
            assert r["x_roof"] == pytest.approx(r["step_ms"] / max(r["bytes_ms"], r["compute_ms"]))
        else:
            assert "compute_ms" not in r
    torch_mb = {r["weight_mb"] for r in rep["rows"] if r["decoder"].startswith("torch")}
    assert len(torch_mb) == 1  # one model's bytes whatever the linear
    assert (rep["llama_cpp_missing"] is None) == bool(types)
    assert (
        cpu_linear._fp32_packed(),
        cpu_linear._enabled(),
        cpu_linear.amx(),
        cpu_linear.step_ops_on(),
    ) == before
