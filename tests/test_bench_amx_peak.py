"""bench/amx_peak.py: on an AMX CPU, the tile steps' and oneDNN's rates in a report and a roofline report's ceilings
rescaled by the formula the roofline itself uses; elsewhere a clear refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_module

from citer.ops.cpu import host_cpu

AMX = host_cpu().has("amx_tile", "amx_bf16")
ROOFLINE = Path(__file__).resolve().parents[1] / "reports" / "bench_roofline.json"


def test_a_roofline_scaled_by_one_keeps_its_ceilings_and_a_faster_prompt_raises_them():
    bench = bench_module("amx_peak")
    roofline = json.loads(ROOFLINE.read_text())
    same = bench.ceilings_at(roofline, 1.0)
    assert [r["batch"] for r in same] == [r["batch"] for r in roofline["rows"]]
    assert all(r["ceiling_at_tiles_l1"] == pytest.approx(r["ceiling"]) for r in same)
    assert all(
        f["ceiling_at_tiles_l1"] > r["ceiling"]
        for f, r in zip(bench.ceilings_at(roofline, 2.0), same, strict=True)
    )


def test_the_layer_shapes_are_the_llms_four_products():
    shapes = bench_module("amx_peak").layer_shapes("smollm2")
    assert shapes == [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 here")
def test_the_report_holds_the_tiles_and_onednns_rates(tmp_path):
    out = tmp_path / "amx.json"
    args = ["--pair", "tiny", "--rows", "4,8", "--steps", "2000", "--reps", "1", "--roofline", str(ROOFLINE),
            "--out", str(out)]  # fmt: skip
    assert bench_module("amx_peak").main(args) == 0
    rep = json.loads(out.read_text())
    for kind in ("tiles", "tiles_l1"):
        assert (
            set(rep["tflops"][kind]) == {"one_thread", "all_threads"}
            and min(rep["tflops"][kind].values()) > 0
        )
    assert set(rep["onednn_tflops"]) == {"4", "8"}
    per_rep = rep["per_rep_tflops"]
    assert all(len(v) == 1 for v in per_rep.values()) and rep["onednn_tflops"]["8"] == per_rep["onednn 8"][0]
    share = per_rep["onednn 8"][0] / per_rep["tiles_l1 all_threads"][0]  # the same rep's runs
    assert rep["onednn_of_tiles_l1"]["8"] == pytest.approx(share)
    assert rep["roofline"]["prompt_rate_scale"] == pytest.approx(1 / share)
    assert len(rep["roofline"]["rows"]) == len(json.loads(ROOFLINE.read_text())["rows"])
    assert set(rep["citer_tflops"]) == {"4", "8"}  # both within the tiles' rows
    over = per_rep["citer 8"][0] / per_rep["onednn 8"][0]
    assert rep["citer_over_onednn"]["8"] == pytest.approx(over) and rep["citer_tflops"]["8"] > 0


@pytest.mark.skipif(AMX, reason="this CPU has AMX")
def test_without_amx_it_refuses_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "amx.json"
    assert bench_module("amx_peak").main(["--out", str(out)]) == 2
    assert "no AMX-BF16" in capsys.readouterr().err and not out.exists()
