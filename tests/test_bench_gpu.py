"""bench/gpu.py on the CPU at tiny shapes (``--tiny``): every variant runs, the report has the documented structure and
finite ratios, a re-derivation from the raw reps agrees, and the agreement processor behind the assisted rows works.
The GPU run itself (random Qwen2 pairs at real shapes) happens on a GPU box; see docs/gpu.md."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import sys

import pytest
import torch
from conftest import REPO

from citer.decoding.engine import RoutedEngine


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_report(gpu_bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "bench_gpu.json"
    argv = ["--tiny", "--batches", "1,2", "--new-tokens", "3", "--prompt-len", "4", "--reps", "1",
            "--assisted-tokens", "3", "--out", str(out)]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    return out, json.loads(out.read_text())


def test_tiny_run_covers_every_variant(tiny_report):
    _, rep = tiny_report
    assert rep["errors"] == []
    assert rep["device"]["cuda"] is False and "cpu" in rep["device"]["name"]
    assert rep["pairs"]["tiny"]["llm_params"] > rep["pairs"]["tiny"]["slm_params"]
    got = {(r["batch"], r["variant"]) for r in rep["rows"]}
    for b in (1, 2):
        for v in (
            "hf_slm",
            "hf_llm",
            "engine_slm",
            "engine_llm",
            "routed_f0.05",
            "routed_f0.1",
            "routed_f0.3",
        ):
            assert (b, v) in got
    assert {(1, "routed_always_llm"), (1, "assisted_alpha0"), (1, "assisted_alpha0.9")} <= got
    shared = all(
        k in inspect.signature(RoutedEngine.__init__).parameters
        for k in ("llm_min_rows", "llm_max_wait_steps")
    )
    assert ((2, "shared_f0.1") in got) == shared
    assert rep["shared_llm_calls"].startswith("measured" if shared else "skipped")


def test_tiny_run_ratios_are_finite(tiny_report):
    _, rep = tiny_report
    for r in rep["rows"]:
        for k in ("ms_per_token", "tokens_per_s", "bw_limit_ms_per_token", "ratio_to_bw"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["variant"], k)
        if r["variant"].startswith(("routed", "shared")):
            assert math.isfinite(r["ratio_to_ideal"]) and r["ratio_to_ideal"] > 0
            assert 0.0 <= r["llm_fraction"] <= 1.0
            assert r["llm_calls_per_token"] <= r["llm_fraction"] + 1e-12
        if r["variant"] == "engine_llm":
            assert r["llm_fraction"] == 1.0 and r["llm_calls_per_step"] == 1.0
        if r["variant"].startswith("assisted"):
            assert 0 < r["llm_calls_per_token"] <= 1.0 and r["assisted_over_routed"] > 0
    # The SLM moves fewer bytes per token than the LLM, at every batch size.
    by = {(r["batch"], r["variant"]): r["bytes_per_token"] for r in rep["rows"]}
    assert all(by[b, "hf_slm"] < by[b, "hf_llm"] for b in (1, 2))
    assert "tiny" in rep["targets"] and "routed_b1_worst_ratio_to_ideal" in rep["targets"]["tiny"]


def test_recompute_rederives_the_same_numbers(gpu_bench, tiny_report, tmp_path):
    path, rep = tiny_report
    out = tmp_path / "again.json"
    assert gpu_bench.main(["--recompute", str(path), "--stat", "median", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["stat"] == "median" and len(again["rows"]) == len(rep["rows"])
    for a, b in zip(rep["rows"], again["rows"], strict=True):
        for k in ("ms_per_token", "ratio_to_bw", "ratio_to_ideal"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-9), (a["variant"], k)


def test_agree_processor_masks_and_forces(gpu_bench):
    gpu_assisted = sys.modules["bench.gpu_assisted"]  # imported by bench/gpu.py from this checkout
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 7))
    scores = torch.randn(64, 60)
    cut = gpu_assisted.AgreeProcessor(50, 0.0)(ids, scores)
    assert torch.isinf(cut[:, 50:]).all() and torch.equal(cut[:, :50], scores[:, :50])
    forced = gpu_assisted.AgreeProcessor(50, 1.0)(ids, scores)
    tok = forced.argmax(-1)
    assert (tok < 50).all() and torch.isfinite(forced).sum(-1).eq(1).all()
    # A function of the prefix only: another model's scores get the same forced token.
    assert torch.equal(gpu_assisted.AgreeProcessor(50, 1.0)(ids, torch.randn(64, 55)).argmax(-1), tok)
    half = gpu_assisted.AgreeProcessor(50, 0.5)(ids, scores)
    share = torch.isfinite(half).sum(-1).eq(1).float().mean().item()
    assert 0.2 < share < 0.8


def test_plain_bytes_matches_the_engine_meter(gpu_bench):
    from citer.decoding.baselines import AlwaysSLM
    from citer.decoding.cost import ModelCost

    pairs, timing = sys.modules["bench.gpu_pairs"], sys.modules["bench.gpu_timing"]
    slm = pairs.build_model("tiny-slm", "cpu", torch.float32, seed=1)
    eng = RoutedEngine(slm, None, AlwaysSLM())
    res = eng.generate_batch([[5, 6, 7, 8]] * 3, 5)
    cost = ModelCost.from_model(slm)
    assert timing.plain_bytes(cost, 3, 4, 5) == pytest.approx(res.batch.bytes_moved)
