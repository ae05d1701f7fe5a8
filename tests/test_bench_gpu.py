"""bench/gpu.py on the CPU at tiny shapes (``--tiny``): every variant runs, the report has the documented structure and
finite ratios, a re-derivation from the raw reps agrees, and the agreement processor behind the assisted rows works.
The GPU run itself (random Qwen2 pairs at real shapes) happens on a GPU box; see docs/gpu.md."""

from __future__ import annotations

import importlib.util
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
            "--assisted-tokens", "3", "--profile", "--profile-tokens", "3", "--out", str(out)]  # fmt: skip
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
    # This checkout's RoutedEngine takes llm_min_rows and llm_max_wait_steps: shared calls are measured at batch > 1.
    assert {(2, "shared_f0.05"), (2, "shared_f0.1"), (2, "shared_f0.3")} <= got
    assert not any(b == 1 and v.startswith(("shared", "overlap")) for b, v in got)
    # Overlapped steps (RoutedEngine(overlap=True)) at batch > 1, plain and with shared calls.
    assert {(2, "overlap_f0.1"), (2, "overlap_shared_f0.1")} <= got
    assert rep["shared_llm_calls"] == "measured (RoutedEngine takes llm_min_rows, llm_max_wait_steps)"
    # The engine as it now runs (lean forward, fixed-shape steps) beside the engine before it (v0_), same run.
    assert {(b, f"v0_{v}") for b in (1, 2) for v in ("engine_slm", "engine_llm", "routed_f0.1")} <= got
    rows = {(r["batch"], r["variant"]): r for r in rep["rows"]}
    assert rows[1, "routed_f0.1"]["forward"] == {"slm": "lean", "llm": "lean"}
    assert rows[1, "routed_f0.1"]["static_steps"] == "eager"
    assert rows[2, "overlap_f0.1"]["overlap"] is True and rows[2, "routed_f0.1"]["overlap"] is False
    # the meter's count of overlapped steps reaches the rows (3 tokens at p = 0.1 may overlap none)
    assert (
        isinstance(rows[2, "overlap_f0.1"]["overlapped_steps"], int)
        and rows[2, "routed_f0.1"]["overlapped_steps"] == 0
    )
    assert (
        rows[2, "overlap_f0.1"]["method"] == "overlap" and rows[2, "overlap_shared_f0.1"]["llm_min_rows"] == 2
    )
    assert rows[1, "v0_routed_f0.1"]["forward"]["llm"] == "hf: pinned by set_forward_path"
    assert rows[1, "v0_routed_f0.1"]["static_steps"] is None
    for b in (1, 2):
        assert rep["targets"]["tiny"][f"b{b}_routed_f0.1_over_best_llm_only"] > 0


def test_tiny_run_profiles_the_engine_as_its_rows_run_it(tiny_report):
    """--profile (CPU activities only here): the engine with the run's fixed-shape steps, overlapped steps included."""
    _, rep = tiny_report
    prof = rep["pairs"]["tiny"]["profile"]
    assert {
        "engine_slm_b1",
        "routed_f0.1_b2",
        "shared_f0.1_b2",
        "overlap_f0.1_b2",
        "overlap_shared_f0.1_b2",
    } <= set(prof)
    assert all(p["static_steps"] == "eager" and p["wall_ms_per_step"] > 0 for p in prof.values())
    assert (
        prof["overlap_f0.1_b2"]["overlapped_steps"] is not None
        and prof["routed_f0.1_b2"]["overlapped_steps"] == 0
    )


def test_tiny_run_ratios_are_finite(tiny_report):
    _, rep = tiny_report
    for r in rep["rows"]:
        for k in ("ms_per_token", "tokens_per_s", "bw_limit_ms_per_token", "ratio_to_bw"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["variant"], k)
        if r["variant"].startswith(("routed", "shared", "overlap")):
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


# Raw reps (seconds) written over the measured ones; median and min differ from the mean and from each other, and
# engine_llm / engine_slm / every other variant are 4 : 1 : 2.
REPS = {"engine_slm": [0.005, 0.001, 0.002], "engine_llm": [0.020, 0.004, 0.008]}
# The engine before (v0_): its alone-rows twice as slow, so a v0_ row's ideal must use them, not the current ones.
REPS |= {f"v0_{k}": [2 * x for x in v] for k, v in REPS.items()}
OTHER_REPS = [0.010, 0.002, 0.004]
# ms per token of a batch-1 row (3 new tokens), worked out by hand from the reps above: median, min.
HAND_MS = {
    "median": {"engine_slm": 2 / 3, "engine_llm": 8 / 3, "other": 4 / 3},
    "min": {"engine_slm": 1 / 3, "engine_llm": 4 / 3, "other": 2 / 3},
}


@pytest.mark.parametrize("stat", ["median", "min"])
def test_recompute_rederives_the_same_numbers(gpu_bench, tiny_report, tmp_path, stat):
    path, rep = tiny_report
    tampered = json.loads(path.read_text())
    for r in tampered["rows"]:
        r["reps_s"] = REPS.get(r["variant"], OTHER_REPS)
    src = tmp_path / "tampered.json"
    src.write_text(json.dumps(tampered))
    out = tmp_path / "again.json"
    assert gpu_bench.main(["--recompute", str(src), "--stat", stat, "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["stat"] == stat
    order = [(r["batch"], r["variant"]) for r in rep["rows"]]
    assert [(r["batch"], r["variant"]) for r in again["rows"]] == order
    hand = HAND_MS[stat]
    for a, b in zip(rep["rows"], again["rows"], strict=True):
        where = (b["batch"], b["variant"])
        # Inputs that recompute must carry over unchanged, then the numbers derived from them.
        for k in ("bw_limit_ms_per_token", "llm_fraction", "llm_calls_per_token"):
            assert b.get(k) == a.get(k), (where, k)
        v0 = b["variant"].startswith("v0_")
        name = b["variant"].removeprefix("v0_")
        ms = hand.get(name, hand["other"]) * (2 if v0 and name in hand else 1) / b["batch"]
        assert b["ms_per_token"] == pytest.approx(ms, rel=1e-9), where
        assert b["ratio_to_bw"] == pytest.approx(ms / a["bw_limit_ms_per_token"], rel=1e-9), where
        if b["variant"].removeprefix("v0_").startswith(("routed", "shared", "overlap")):
            # ideal = f * LLM-alone + SLM-alone = (f * 8/3 + 2/3) / batch against this row's 4/3 / batch (halved
            # for min): 2 / (4 f + 1) for either stat.
            # A v0_ row: the same 4/3 against alone-rows twice as slow: 1 / (4 f + 1).
            want = (1 if v0 else 2) / (4 * a["llm_fraction"] + 1)
            assert b["ratio_to_ideal"] == pytest.approx(want, rel=1e-9), where
        else:
            assert "ratio_to_ideal" not in b, where


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
