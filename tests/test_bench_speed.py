"""bench/speed.py on the CPU at tiny shapes: the GPU run's code path (fixed-shape steps compiled per layer and replayed
per bucket, traced here by ``aot_eager``) and the CPU run's (Inductor), every variant in its order, rows saved as they
come, at most three compiles per model, targets that never substitute a missing baseline, the re-derivation from the
raw reps, and the plan of the one-shot GPU script."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, bench_module, make_qwen2

from citer.decoding.engine import RoutedEngine


@pytest.fixture(scope="module")
def speed():
    return bench_module("speed")


TINY = [
    "--tiny",
    "--batches",
    "1,2",
    "--new-tokens",
    "4",
    "--prompt-len",
    "5",
    "--reps",
    "2",
    "--engine-eager",
]


@pytest.fixture(scope="module")
def tiny_report(speed, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_speed") / "bench.json"
    assert speed.main([*TINY, "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_tiny_run_measures_every_variant_baselines_and_routed_first(tiny_report):
    _, rep = tiny_report
    assert rep["errors"] == []
    assert rep["device"]["cuda"] is False and "--tiny" in rep["device"]["name"]
    order = [(r["batch"], r["variant"]) for r in rep["rows"]]
    for b in (1, 2):
        names = [v for bb, v in order if bb == b]
        base = ["engine_llm", "routed_f0.1", "engine_llm_eager", "hf_llm"]
        # the LLM-only baselines and the routed row run (and are saved) first, in turn
        assert names[:4] == base
        assert "engine_slm" in names[4:]
    assert {
        (1, "assisted_alpha0.9"),
        (2, "shared_f0.1"),
        (2, "overlap_f0.1"),
        (2, "overlap_shared_f0.1"),
    } <= set(order)
    rows = {(r["batch"], r["variant"]): r for r in rep["rows"]}
    assert rows[1, "routed_f0.1"]["engine_forward"] == "aot_eager"
    assert rows[1, "engine_llm_eager"]["engine_forward"] == "eager"
    assert rows[1, "routed_f0.1"]["forward"] == {"slm": "lean", "llm": "lean"}
    assert all(len(r["reps_s"]) == 2 for r in rep["rows"])
    assert rows[2, "overlap_f0.1"]["overlap"] is True and rows[2, "routed_f0.1"]["overlap"] is False


def test_tiny_run_compiles_each_model_at_most_three_times(tiny_report):
    """The traced fixed-shape steps compile each model's layer and head once for every bucket and row the run uses:
    the count the GPU plan holds to (``--plan``), measured through the same bucket plan."""
    _, rep = tiny_report
    per_model = {m: sum(r.get(f"{m}_compiles", 0) for r in rep["rows"]) for m in ("slm", "llm")}
    assert 1 <= per_model["slm"] <= 3 and 1 <= per_model["llm"] <= 3, per_model
    # engine_llm, the first variant, runs the LLM alone: it compiles the LLM's layer and head, nothing of the SLM's
    first = next(r for r in rep["rows"] if r["variant"] == "engine_llm")
    assert first["llm_compiles"] == 2 and "slm_compiles" not in first


def test_tiny_run_ratios_are_finite_and_targets_named(tiny_report):
    _, rep = tiny_report
    for r in rep["rows"]:
        for k in ("ms_per_token", "tokens_per_s", "bw_limit_ms_per_token", "ratio_to_bw"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["variant"], k)
        if r["variant"].startswith(("routed", "shared", "overlap")):
            assert 0.0 <= r["llm_fraction"] <= 1.0
    t = rep["targets"]["tiny"]
    for b in (1, 2):
        assert t[f"b{b}_routed_f0.1_over_best_llm_only"] > 0
        assert t[f"b{b}_best_llm_only"].split(" ")[0] in ("hf_llm", "engine_llm", "engine_llm_eager")
        assert t[f"b{b}_engine_llm_ratio_to_bw"] > 0
    assert t["b1_routed_f0.1_over_assisted_alpha0.9"] > 0
    by = {(r["batch"], r["variant"]): r["bytes_per_token"] for r in rep["rows"]}
    assert all(by[b, "engine_slm"] < by[b, "engine_llm"] for b in (1, 2))


def test_hf_forward_times_the_same_engines_through_the_hf_modules(speed, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--forward", "params", "--batches", "2", "--new-tokens", "4", "--prompt-len", "5", "--reps",
            "1", "--hf-forward", "--out", str(out)]  # fmt: skip
    assert speed.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("engine_llm", "engine_slm", "routed_f0.1", "shared_f0.1"):
        lean, hf = rows[name], rows[f"{name}_hf_forward"]
        assert set(lean["forward"].values()) == {"lean"}
        assert set(hf["forward"].values()) == {"hf: forward='hf'"}, hf["forward"]
        assert hf["llm_fraction"] == lean["llm_fraction"]  # the same router seed and rows: the same decisions
    assert rows["routed_f0.1_hf_forward"]["ratio_to_ideal"] > 0  # against the HF-forward engines alone
    # Shared LLM calls read the LLM's weights at no more steps than routing alone, at the same p.
    for fw in ("", "_hf_forward"):
        assert (
            rows[f"shared_f0.1{fw}"]["llm_calls_per_step"] <= rows[f"routed_f0.1{fw}"]["llm_calls_per_step"]
        )


def test_a_missing_baseline_is_named_never_substituted(speed, tiny_report, tmp_path):
    path, _ = tiny_report
    rep = json.loads(path.read_text())
    rep["rows"] = [r for r in rep["rows"] if not (r["batch"] == 1 and r["variant"] == "hf_llm")]
    src = tmp_path / "partial.json"
    src.write_text(json.dumps(rep))
    out = tmp_path / "again.json"
    assert speed.main(["--recompute", str(src), "--out", str(out)]) == 0
    t = json.loads(out.read_text())["targets"]["tiny"]
    assert t["b1_routed_f0.1_over_best_llm_only"] == "baseline missing: hf_llm"
    assert t["b1_baseline_missing"] == ["hf_llm"]
    assert isinstance(t["b2_routed_f0.1_over_best_llm_only"], float)


# Raw reps (seconds) written over the measured ones: engine_llm / engine_slm / every other variant are 4 : 1 : 2.
REPS = {"engine_slm": [0.005, 0.001, 0.002], "engine_llm": [0.020, 0.004, 0.008]}
OTHER_REPS = [0.010, 0.002, 0.004]
# ms per token of a batch-1 row of 4 new tokens, by hand from the reps above: median, min.
HAND_MS = {
    "median": {"engine_slm": 2 / 4, "engine_llm": 8 / 4, "other": 4 / 4},
    "min": {"engine_slm": 1 / 4, "engine_llm": 4 / 4, "other": 2 / 4},
}


@pytest.mark.parametrize("stat", ["median", "min"])
def test_recompute_rederives_the_same_numbers(speed, tiny_report, tmp_path, stat):
    path, rep = tiny_report
    tampered = json.loads(path.read_text())
    for r in tampered["rows"]:
        r["reps_s"] = REPS.get(r["variant"], OTHER_REPS)
    src = tmp_path / "tampered.json"
    src.write_text(json.dumps(tampered))
    out = tmp_path / "again.json"
    assert speed.main(["--recompute", str(src), "--stat", stat, "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["stat"] == stat
    assert [(r["batch"], r["variant"]) for r in again["rows"]] == [
        (r["batch"], r["variant"]) for r in rep["rows"]
    ]
    hand = HAND_MS[stat]
    for a, b in zip(rep["rows"], again["rows"], strict=True):
        where = (b["batch"], b["variant"])
        for k in ("bw_limit_ms_per_token", "llm_fraction", "llm_calls_per_token"):
            assert b.get(k) == a.get(k), (where, k)
        ms = hand.get(b["variant"], hand["other"]) * 4 / b["new_tokens"] / b["batch"]
        assert b["ms_per_token"] == pytest.approx(ms, rel=1e-9), where
        assert b["ratio_to_bw"] == pytest.approx(ms / a["bw_limit_ms_per_token"], rel=1e-9), where
        if b["variant"].startswith(("routed", "shared", "overlap")):
            # ideal = f * LLM alone + SLM alone = (f * 8 + 2) / 4 / batch against this row's 4 / 4 / batch
            assert b["ratio_to_ideal"] == pytest.approx(2 / (4 * a["llm_fraction"] + 1), rel=1e-9), where


def test_a_run_out_of_time_keeps_what_it_measured(speed, tmp_path):
    """The budget is checked before every warm-up and rep: a budget spent early leaves a valid report that says what
    was skipped."""
    out = tmp_path / "short.json"
    assert speed.main([*TINY, "--time-budget", "12", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["errors"] == [] and rep["notes"]
    assert any("skipped" in n for n in rep["notes"])


def test_the_one_shot_gpu_script_plans_within_its_budget():
    """``bash bench/gpu_oneshot.sh --plan`` on a CPU: at most three compiles per model of ours, and the whole script
    (CUDA tests, both pairs) estimated at <= 480 s of device time, leaving room for one rerun in 15 minutes."""
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", "bench/gpu_oneshot.sh", "--plan"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    ours = {m: n for m, n in plan["compiles_per_model"].items() if not m.startswith("hf ")}
    assert ours and all(1 <= n <= 3 for n in ours.values()), ours
    assert 0 < plan["estimated_device_s"] <= 480
    assert plan["captures"] > 0


def test_a_plan_over_its_budget_exits_non_zero(speed, capsys):
    argv = ["--plan", "--device", "cuda", "--pairs", "1.5b-14b", "--batches", "1,32", "--time-budget", "30"]
    assert speed.main(argv) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimated_device_s"] > 30


def test_agree_processor_masks_and_forces(speed):
    measure = sys.modules["bench.speed_measure"]
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 7))
    scores = torch.randn(64, 60)
    cut = measure.AgreeProcessor(50, 0.0)(ids, scores)
    assert torch.isinf(cut[:, 50:]).all() and torch.equal(cut[:, :50], scores[:, :50])
    forced = measure.AgreeProcessor(50, 1.0)(ids, scores)
    tok = forced.argmax(-1)
    assert (tok < 50).all() and torch.isfinite(forced).sum(-1).eq(1).all()
    # A function of the prefix only: another model's scores get the same forced token.
    assert torch.equal(measure.AgreeProcessor(50, 1.0)(ids, torch.randn(64, 55)).argmax(-1), tok)
    half = measure.AgreeProcessor(50, 0.5)(ids, scores)
    assert 0.2 < torch.isfinite(half).sum(-1).eq(1).float().mean().item() < 0.8


def test_plain_bytes_matches_the_engine_meter(speed):
    from citer.decoding.baselines import AlwaysSLM
    from citer.decoding.cost import ModelCost

    report = sys.modules["bench.speed_report"]
    slm = report.build_model("tiny-slm", "cpu", torch.float32, seed=1)
    res = RoutedEngine(slm, None, AlwaysSLM()).generate_batch([[5, 6, 7, 8]] * 3, 5)
    assert report.plain_bytes(ModelCost.from_model(slm), 3, 4, 5) == pytest.approx(res.batch.bytes_moved)
    assert report.spec_params("tiny-slm") == report.n_params(slm)


def test_the_gguf_files_for_llama_cpp_are_the_model_transformers_reads_back(speed, tmp_path):
    """The peer's GGUF file holds the model as llama.cpp's own converter writes it (q/k rows permuted for its RoPE):
    transformers, which undoes that permutation when it reads a GGUF file, gets the same logits back."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.speed_measure import gguf_arrays

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for name, arr in gguf_arrays(model).items():
        np.save(tmp_path / f"{name}.npy", arr)
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings")  # fmt: skip
    peer_cfg = {k: getattr(cfg, k) for k in keys} | {
        "dtype": "fp32",
        "rope_theta": cfg.rope_parameters["rope_theta"],
    }
    (tmp_path / "config.json").write_text(json.dumps(peer_cfg))
    speed.write_gguf(tmp_path, tmp_path / "model.gguf")
    back = LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


# --------------------------------------------------------------------------- llama.cpp: quantized peers, every batch
def _row(variant: str, tps: float, batch: int = 1, dtype: str = "bf16", precision: str | None = None) -> dict:
    return {"pair": "smollm2", "dtype": dtype, "precision": precision or dtype, "batch": batch, "variant": variant,
            "tokens_per_s": tps}  # fmt: skip


LLAMA_SETTINGS = {"llama_cpp_python": "py", "llama_cpp_quants": ["Q8_0", "Q4_K_M", "Q4_0"],
                  "llama_cpp_batches": [1, 8], "fractions": [0.1]}  # fmt: skip


def test_the_best_llm_only_decoder_is_the_fastest_at_any_precision(speed):
    """A quantized llama.cpp row faster than every full-precision decoder is the baseline (named with its precision
    and the dtype it was quantized from); llama.cpp's SLM rows never are; a quantized row the run set out to measure
    and did not is named, at that batch only."""
    report = sys.modules["bench.speed_report"]
    quant = {"q8_0": 8.0, "q4_k_m": 11.0, "q4_0": 12.0}
    rows = [_row("hf_llm", 5.0), _row("engine_llm", 7.0), _row("engine_llm", 6.0, dtype="fp32"),
            _row("llama_cpp_llm", 4.0), *[_row(f"llama_cpp_llm_{q}", v, precision=q) for q, v in quant.items()],
            _row("llama_cpp_slm_q4_0", 90.0, precision="q4_0"), _row("routed_f0.1", 18.0)]  # fmt: skip
    at8 = [{**r, "batch": 8} for r in rows if r["variant"] != "llama_cpp_llm_q4_k_m"]
    t = report.targets({"pairs": {"smollm2": {}}, "settings": LLAMA_SETTINGS, "rows": rows + at8})["smollm2"]
    assert t["b1_best_llm_only"] == "llama_cpp_llm_q4_0 (q4_0 from bf16)"
    assert t["b1_routed_f0.1_over_best_llm_only"] == pytest.approx(18.0 / 12.0)
    assert t["b1_best_llama_cpp"] == "llama_cpp_llm_q4_0 (q4_0 from bf16)"
    assert t["b1_routed_f0.1_over_best_llama_cpp"] == pytest.approx(1.5)
    assert t["b1_best_routed_f0.1"] == "routed_f0.1 (bf16)" and "b1_baseline_missing" not in t
    assert t["b8_baseline_missing"] == ["llama_cpp_llm_q4_k_m"]
    assert t["b8_routed_f0.1_over_best_llm_only"] == "baseline missing: llama_cpp_llm_q4_k_m"
    assert t["b8_routed_f0.1_over_best_llama_cpp"] == "baseline missing: llama_cpp_llm_q4_k_m"
    # without the quantized rows the fastest full-precision decoder is the baseline again
    plain = [r for r in rows if r.get("precision") == r["dtype"]]
    settings = {**LLAMA_SETTINGS, "llama_cpp_quants": []}
    t = report.targets({"pairs": {"smollm2": {}}, "settings": settings, "rows": plain})["smollm2"]
    assert t["b1_best_llm_only"] == "engine_llm (bf16)" and t["b1_best_llama_cpp"] == "llama_cpp_llm (bf16)"
    assert t["b1_routed_f0.1_over_best_llama_cpp"] == pytest.approx(18.0 / 4.0)


def test_committed_cpu_reports_keep_their_targets(speed):
    """Every committed CPU report derives the targets it holds; reports written before llama.cpp ran quantized and
    batched (no ``precision``, no ``llama_cpp_quants``, llama.cpp at batch 1 only) apart from the llama.cpp ratios
    added since, and those written before the other engine settings' routed rows stood apart from the headline apart
    from those rows' ratio."""
    report = sys.modules["bench.speed_report"]
    for name in ("bench_cpu.json", "bench_cpu_fp32.json"):
        rep = json.loads((REPO / "reports" / name).read_text())
        again = report.targets(rep)
        for pair, held in rep["targets"].items():
            fresh = again[pair]
            if not rep["settings"].get("llama_cpp_quants"):  # written before llama.cpp ran quantized
                fresh = {k: v for k, v in fresh.items() if "llama_cpp" not in k}
            # written before the other settings' routed rows stood apart from the headline
            if not any("other_routed" in k for k in held):
                fresh = {k: v for k, v in fresh.items() if "other_routed" not in k}
            assert fresh.keys() == held.keys(), (name, pair)
            for k, v in held.items():
                assert fresh[k] == (pytest.approx(v) if isinstance(v, float) else v), (name, pair, k)


def test_a_peer_s_quantized_runs_fill_rows_of_their_own(speed, tmp_path):
    """One llama.cpp call's result (the model's dtype and each quantized copy) becomes a row per precision, each with
    the bytes its own file reads per call and what llama.cpp's quantizer did; the tokens stay out of the report."""
    measure, report = sys.modules["bench.speed_measure"], sys.modules["bench.speed_report"]
    args = speed.parse_args(["--tiny", "--pairs", "tiny-llama", "--new-tokens", "4", "--prompt-len", "5",
                             "--llama-cpp-python", "py", "--out", str(tmp_path / "r.json")])  # fmt: skip
    run = report.BenchRun(args)
    models = report.build_pair("tiny-llama", "cpu", "fp32")
    one = {"reps_s": [0.4, 0.2, 0.3], "warmup_s": 0.5, "tokens": [[1, 2, 3, 4]], "flash_attn": "auto"}
    got = {**one, "version": "9.9", "precision": "fp32", "system_info": "CPU : AVX2 = 1",
           "quantized": {"q8_0": {**one, "reps_s": [0.2, 0.1, 0.3], "weight_bytes": 1000, "quantize_s": 0.1,
                                  "tensor_types": {"F32": 5, "Q8_0": 14}, "quantize_fallbacks": []},
                         "q4_k_m": {**one, "weight_bytes": 600, "tensor_types": {"Q4_K": 10, "Q6_K": 4},
                                    "quantize_fallbacks": ["warning: x -> falling back to q5_0"]}}}  # fmt: skip
    v = measure.Variant(
        "llama_cpp_llm", lambda n: got, {"method": "llama_cpp", "model": "llm", "f": 1.0}, external=True
    )
    measure._external(run, models, 1, v)
    rows = {r["variant"]: r for r in run.report["rows"]}
    assert list(rows) == ["llama_cpp_llm", "llama_cpp_llm_q8_0", "llama_cpp_llm_q4_k_m"]
    assert [r["precision"] for r in rows.values()] == ["fp32", "q8_0", "q4_k_m"]
    q8, q4 = rows["llama_cpp_llm_q8_0"], rows["llama_cpp_llm_q4_k_m"]
    assert q8["ms_per_token"] == pytest.approx(1e3 * 0.2 / 4) and q8["peer_tensor_types"]["Q8_0"] == 14
    assert q4["peer_quantize_fallbacks"] == ["warning: x -> falling back to q5_0"]
    assert q8["peer_version"] == "9.9" and q8["peer_system_info"] == "CPU : AVX2 = 1"
    kv = models.costs[1].kv_bytes_per_token
    for r, wb in ((q8, 1000), (q4, 600), (rows["llama_cpp_llm"], models.costs[1].weight_bytes)):
        cost = sys.modules["citer.decoding.cost"].ModelCost(wb, kv)
        assert r["bytes_per_token"] == pytest.approx(report.plain_bytes(cost, 1, 5, 4) / 4)
    assert all("tokens" not in r and "peer_tokens" not in r for r in rows.values())


def test_llama_cpp_settings_default_to_three_quantized_types_at_every_batch(speed):
    a = speed.parse_args(["--device", "cpu", "--llama-cpp-python", "py", "--out", "x.json"])
    assert a.llama_cpp_quants == ["Q8_0", "Q4_K_M", "Q4_0"] and a.llama_cpp_batches == [1, 8]
    a = speed.parse_args(["--device", "cpu", "--llama-cpp-python", "py", "--llama-cpp-quants", "none",
                          "--llama-cpp-batches", "1", "--out", "x.json"])  # fmt: skip
    assert a.llama_cpp_quants == [] and a.llama_cpp_batches == [1]
    a = speed.parse_args(["--device", "cpu", "--out", "x.json"])
    assert a.llama_cpp_quants == [] and a.llama_cpp_batches == []


@pytest.fixture
def host_flags(monkeypatch, tmp_path):
    """Make this process's CPU one listing ``flags`` (the real /proc/cpuinfo reader over a file of that text)."""
    from citer.ops import cpu

    def use(flags: str) -> None:
        info = tmp_path / "cpuinfo"
        info.write_text(f"vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\n")
        monkeypatch.setattr(cpu, "CPUINFO", info)
        cpu.host_cpu.cache_clear()

    yield use
    monkeypatch.undo()
    cpu.host_cpu.cache_clear()


@pytest.mark.parametrize(
    ("flags", "win"),
    [("avx2 fma", "fp32"), ("avx2 fma avx512f avx512_bf16", "bf16"), ("avx2 amx_tile amx_bf16", "bf16")],
)
def test_the_cpu_headline_runs_in_the_precision_that_wins_on_the_host(speed, host_flags, flags, win):
    host_flags(flags)
    assert speed.parse_args(["--device", "cpu", "--quick", "--out", "x.json"]).dtypes == [win]
    both = speed.parse_args(["--device", "cpu", "--out", "x.json"]).dtypes
    assert both[0] == win and sorted(both) == ["bf16", "fp32"]
    assert speed.parse_args(["--device", "cpu", "--quick", "--dtypes", "bf16", "--out", "x.json"]).dtypes == [
        "bf16"
    ]


def test_a_python_without_llama_cpp_skips_its_rows_with_one_line(speed, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--tiny", "--pairs", "tiny-llama", "--batches", "1", "--new-tokens", "2", "--prompt-len", "3", "--reps",
            "1", "--alphas", "", "--forward", "params", "--llama-cpp-python", str(tmp_path / "no-python"),
            "--out", str(out)]  # fmt: skip
    assert speed.main(argv) == 0
    rep = json.loads(out.read_text())
    skipped = [n for n in rep["notes"] if n.startswith("llama.cpp rows skipped")]
    assert len(skipped) == 1 and "\n" not in skipped[0] and "no-python" in skipped[0]
    assert rep["errors"] == [] and not any(r["variant"].startswith("llama_cpp") for r in rep["rows"])
    assert (
        rep["settings"]["llama_cpp_python"] == ""
        and "b1_baseline_missing" not in rep["targets"]["tiny-llama"]
    )


@pytest.fixture(scope="module")
def llama_cpp_python():
    """The Python named by ``CITER_LLAMA_CPP_PYTHON`` when it imports llama_cpp and gguf (a venv of its own: the
    project's does not hold llama-cpp-python)."""
    py = os.environ.get("CITER_LLAMA_CPP_PYTHON", "")
    if not py:
        pytest.skip("CITER_LLAMA_CPP_PYTHON unset: no llama.cpp to run")
    why = sys.modules["bench.speed_measure"].peer_missing(py, "import llama_cpp, gguf")
    if why:
        pytest.skip(why)
    return py


def _tiny_llama(hidden: int, inter: int, vocab: int = 256) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider logits than the default init's: greedy picks far from ties
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
    return model


def _run_peer(speed, python: str, model: torch.nn.Module, where, **cfg) -> dict:
    import numpy as np

    from bench.speed_measure import gguf_arrays

    where.mkdir()
    for name, arr in gguf_arrays(model).items():
        np.save(where / f"{name}.npy", arr)
    c = model.config
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings")  # fmt: skip
    full = {k: getattr(c, k) for k in keys} | {"dtype": "fp32", "rope_theta": c.rope_parameters["rope_theta"],
                                               "threads": 2, "reps": 1, **cfg}  # fmt: skip
    (where / "config.json").write_text(json.dumps(full))
    res = subprocess.run([python, str(REPO / "bench" / "speed.py"), "peer", "llama_cpp", str(where)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_llama_cpp_batched_greedy_decodes_as_transformers(speed, llama_cpp_python, tmp_path):
    """llama.cpp's batch API as the peer drives it (one sequence id per row, every row in one batch per step) decodes
    each row of a float32 model as transformers' greedy ``generate`` does, at batch 1 and 3."""
    import numpy as np

    model = _tiny_llama(128, 256)
    prompt_len, n_new = 7, 6
    for batch in (1, 3):
        got = _run_peer(speed, llama_cpp_python, model, tmp_path / f"b{batch}", batch=batch, prompt_len=prompt_len,
                        new_tokens=n_new, quants=[])  # fmt: skip
        prompts = torch.tensor(np.random.default_rng(0).integers(3, 256, (batch, prompt_len)))
        with torch.no_grad():
            ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert got["tokens"] == ref[:, prompt_len:].tolist(), batch
        assert len(got["reps_s"]) == 1 and got["precision"] == "fp32" and got["quantized"] == {}


def test_llama_cpp_quantizes_with_its_own_rules_and_says_where_it_fell_back(
    speed, llama_cpp_python, tmp_path
):
    """Q8_0, Q4_K_M and Q4_0 copies from llama.cpp's quantizer, each decoded: rows of 256 take K-quant blocks, rows
    of 96 cannot and llama.cpp's fallbacks are reported; fewer bits, fewer bytes per call."""
    runs = {}
    for hidden, inter in ((256, 512), (96, 192)):
        runs[hidden] = _run_peer(speed, llama_cpp_python, _tiny_llama(hidden, inter), tmp_path / f"h{hidden}",
                                 batch=2, prompt_len=5, new_tokens=3, quants=["Q8_0", "Q4_K_M", "Q4_0"])  # fmt: skip
    for got in runs.values():
        q = got["quantized"]
        assert list(q) == ["q8_0", "q4_k_m", "q4_0"]
        assert all(
            len(r["tokens"]) == 2 and len(r["tokens"][0]) == 3 and len(r["reps_s"]) == 1 for r in q.values()
        )
        assert q["q4_0"]["weight_bytes"] < q["q8_0"]["weight_bytes"]
        assert q["q8_0"]["tensor_types"].get("Q8_0", 0) >= 2 * 7  # every layer's projections
        assert q["q4_0"]["tensor_types"].get("Q4_0", 0) >= 2 * 6
    wide, narrow = runs[256]["quantized"], runs[96]["quantized"]
    assert wide["q4_k_m"]["tensor_types"].get("Q4_K", 0) > 0 and wide["q4_k_m"]["quantize_fallbacks"] == []
    assert "Q4_K" not in narrow["q4_k_m"]["tensor_types"]
    assert any("falling back" in w for w in narrow["q4_k_m"]["quantize_fallbacks"])
    assert any("required fallback quantization" in w for w in narrow["q4_k_m"]["quantize_fallbacks"])


def test_the_bench_races_llama_cpp_at_every_precision_and_batch(speed, llama_cpp_python, tmp_path):
    """``--llama-cpp-python`` at tiny Llama shapes through the real peer path: llama.cpp in the model's dtype and at
    Q8_0, Q4_K_M and Q4_0 for both models at batch 1 and 2, every row timed, and the targets' baseline the fastest
    LLM-only row of any precision."""
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--pairs", "tiny-llama", "--batches", "1,2", "--new-tokens", "4", "--prompt-len", "5", "--reps",
            "2", "--alphas", "", "--llama-cpp-python", llama_cpp_python, "--out", str(out)]  # fmt: skip
    assert speed.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["errors"] == [], rep["errors"]
    rows = {(r["batch"], r["variant"]): r for r in rep["rows"]}
    for b in (1, 2):
        for m in ("llm", "slm"):
            for q, prec in (("", "fp32"), ("_q8_0", "q8_0"), ("_q4_k_m", "q4_k_m"), ("_q4_0", "q4_0")):
                r = rows[b, f"llama_cpp_{m}{q}"]
                assert r["precision"] == prec and len(r["reps_s"]) == 2 and r["tokens_per_s"] > 0, (b, m, q)
        assert rows[b, "llama_cpp_llm_q4_0"]["bytes_per_token"] < rows[b, "llama_cpp_llm"]["bytes_per_token"]
        assert rows[b, "llama_cpp_llm_q4_k_m"]["peer_quantize_fallbacks"] == []  # the LLM's rows of 256
        assert rows[b, "llama_cpp_slm_q4_k_m"]["peer_quantize_fallbacks"]  # the SLM's rows of 96
        t = rep["targets"]["tiny-llama"]
        assert f"b{b}_baseline_missing" not in t
        llm_only = [
            r for (bb, v), r in rows.items() if bb == b and sys.modules["bench.speed_report"].is_llm_only(v)
        ]
        best = max(llm_only, key=lambda r: r["tokens_per_s"])
        assert t[f"b{b}_best_llm_only"].split(" ")[0] == best["variant"]
        assert isinstance(t[f"b{b}_routed_f0.1_over_best_llama_cpp"], float)


def test_a_type_llama_cpp_does_not_know_stops_the_run_before_it_starts(speed, llama_cpp_python, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--pairs", "tiny-llama", "--llama-cpp-python", llama_cpp_python, "--llama-cpp-quants",
            "Q8_0,Q3_X", "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit, match="LLAMA_FTYPE_MOSTLY_Q3_X"):
        speed.main(argv)
    assert not out.exists()


def test_the_cpu_default_times_the_engines_citer_route_builds(speed, tmp_path):
    """With ``--forward params`` (a CPU run's default) every engine row is built as ``route_engine`` (what ``citer route`` and
    ``citer serve`` call) from ``--params``' engine block: a changed block reaches every row, each row records the
    settings it ran with, and they equal ``route_engine``'s from the same block plus the variant's own (shared calls,
    overlap)."""
    import yaml

    from bench.speed_report import build_pair
    from citer.config import load_params
    from citer.config.serving import EngineParams
    from citer.decoding.baselines import RandomRouter
    from citer.serving.champion import route_engine

    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    raw["engine"] = {**raw["engine"], "llm_schedule": "measured", "llm_prefill": "admit"}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw), encoding="utf-8")
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--forward", "params", "--batches", "2", "--new-tokens", "4", "--prompt-len", "5", "--reps",
            "1", "--params", str(params), "--out", str(out)]  # fmt: skip
    assert speed.main(argv) == 0
    rep = json.loads(out.read_text())
    block = load_params(params).engine
    assert rep["engine"] == block.model_dump()
    pair = build_pair("tiny", "cpu", "fp32")
    rows = {r["variant"]: r for r in rep["rows"] if "engine" in r}
    assert {"engine_llm", "engine_slm", "routed_f0.1", "shared_f0.1", "overlap_f0.1"} <= set(rows)
    for name, row in rows.items():
        over = {k: row[k] for k in ("llm_min_rows", "llm_max_wait_steps") if k in row}
        over |= {"overlap": True} if name.startswith("overlap") else {}
        want = route_engine(pair.slm, pair.llm, RandomRouter(0.1, seed=0), 0.5,
                            EngineParams.model_validate(block.model_dump() | over), vocab_size=pair.vocab)  # fmt: skip
        got = {k: v for k, v in row["engine"].items() if k != "forward_paths"}
        assert got == {k: getattr(want, k) for k in got}, name
        assert got["llm_schedule"] == "measured" and got["forward"] == "eager"


def test_the_gpu_run_builds_its_engines_from_the_params_block_without_pydantic(monkeypatch, tmp_path):
    """The GPU image has no pydantic: the bench then reads the params' engine block as written, and the engine it
    builds with ``--forward graphs`` is the one ``route_engine`` builds from the validated block with
    ``engine.forward: graphs`` -- what ``citer route`` runs on a GPU is what the GPU run times."""
    import yaml

    from bench.speed_measure import engine_block
    from bench.speed_report import build_pair
    from citer.config import load_params
    from citer.decoding.baselines import RandomRouter
    from citer.decoding.engine import ENGINE_SETTINGS, engine_from_block
    from citer.serving.champion import route_engine

    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    raw["engine"] = {"llm_min_rows": 3, "llm_max_wait_steps": 2, "forward": "graphs"}  # the rest: defaults
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    validated = engine_block(path)
    monkeypatch.setitem(sys.modules, "citer.config", None)  # import citer.config now raises ImportError
    written = engine_block(path)
    assert written == raw["engine"] and validated == load_params(path).engine.model_dump()
    monkeypatch.undo()
    pair = build_pair("tiny", "cpu", "fp32")
    router = RandomRouter(0.2, seed=0)
    bench = engine_from_block(pair.slm, pair.llm, router, 0.5, written, vocab_size=pair.vocab)
    route = route_engine(pair.slm, pair.llm, router, 0.5, load_params(path).engine, vocab_size=pair.vocab)
    assert {k: getattr(bench, k) for k in ENGINE_SETTINGS} == {k: getattr(route, k) for k in ENGINE_SETTINGS}
    assert bench.forward == "graphs" and bench.slm_runner.static is not None
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    assert bench.generate_batch(prompts, 6).tokens == route.generate_batch(prompts, 6).tokens


def test_forward_params_is_the_blocks_own_mode_for_the_plan_and_the_baselines(speed, tmp_path):
    """``--forward params`` resolves to the block's ``forward``: a block that compiles is planned with compiles and
    keeps the eager LLM-only baseline beside it; an eager block needs no second eager row."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    for mode, eager_row in (("compiled", True), ("eager", False)):
        raw["engine"] = {**raw["engine"], "forward": mode}
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        a = speed.parse_args(
            ["--device", "cpu", "--forward", "params", "--params", str(path), "--out", "x.json"]
        )
        assert (a.forward, a.engine_eager) == (mode, eager_row)
        compiles = speed.plan(a)["compiles_per_model"]
        ours = [n for k, n in compiles.items() if not k.startswith("hf ")]
        assert (sum(ours) > 0) == (mode == "compiled"), compiles


def test_an_engine_block_with_an_unknown_setting_is_refused():
    """Read without pydantic (the GPU image), a typo or a setting of older params must not be dropped unseen."""
    from citer.decoding.baselines import AlwaysSLM
    from citer.decoding.engine import EngineInputError, engine_from_block

    model = make_qwen2(97, hidden_size=32, num_hidden_layers=1, seed=1)
    for bad in ({"compile_forward": True}, {"llm_min_row": 4}):
        with pytest.raises(EngineInputError, match="unknown settings") as err:
            engine_from_block(model, None, AlwaysSLM(), 0.5, bad)
        # The message names every setting the block may hold, the runner's own included.
        assert all(repr(k) in str(err.value) for k in ("llm_min_rows", "forward", "runner", "llama_cpp_type"))
    assert (
        engine_from_block(
            model, None, AlwaysSLM(), 0.5, {"runner": "torch", "llama_cpp_type": "Q8_0"}
        ).forward
        == "eager"
    )


def test_the_headline_reads_the_params_routed_row_timed_in_turn_and_the_other_settings_apart(speed):
    """A shared or overlapped row (timed in the next group, at other minutes) never makes the headline, however fast:
    it has its own ratio, named with its variant."""
    report = sys.modules["bench.speed_report"]
    rows = [_row("hf_llm", 5.0), _row("engine_llm", 10.0), _row("routed_f0.1", 9.0), _row("shared_f0.1", 14.0),
            _row("overlap_f0.1", 12.0)]  # fmt: skip
    t = report.targets({"pairs": {"smollm2": {}}, "settings": {"fractions": [0.1]}, "rows": rows})["smollm2"]
    assert t["b1_routed_f0.1_over_best_llm_only"] == pytest.approx(0.9)
    assert t["b1_best_routed_f0.1"] == "routed_f0.1 (bf16)"
    assert t["b1_other_routed_f0.1_over_best_llm_only"] == pytest.approx(1.4)
    assert t["b1_best_other_routed_f0.1"] == "shared_f0.1 (bf16)"
