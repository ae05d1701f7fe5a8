"""The sweep: choosing τ, promotion and claims on hand-made rows; the real sweep on tiny random models."""

from __future__ import annotations

import json

import pytest

from citer.config import SelectionRule, SweepParams
from citer.pareto import (
    METHODS,
    SWEEP_KEYS,
    SweepError,
    SweepRow,
    bytes_at_accuracy,
    bytes_saving,
    choose_tau,
    claims,
    decide_promotion,
    dominance,
    objective,
)
from citer.sweep_report import plot_pareto, read_sweep, write_pareto_json, write_plot_data, write_sweep


def R(method, tau, acc, rel, llm_acc=0.80, h="h", n=100):
    return SweepRow(
        method, tau, acc, rel, 0, rel * 1000.0, rel, 1e-3, llm_accuracy=llm_acc, examples_hash=h, n_examples=n
    )


@pytest.fixture()
def rows():
    return [
        R("llm", None, 0.80, 1.0),
        R("slm", None, 0.40, 0.05),
        R("citer", 0.2, 0.60, 0.15),
        R("citer", 0.4, 0.75, 0.25),
        R("citer", 0.6, 0.79, 0.35),
        R("citer", 0.8, 0.80, 0.50),
        R("citer_s", 0.4, 0.70, 0.30),
        R("citer_s", 0.8, 0.79, 0.60),
        R("random", 0.4, 0.55, 0.40),
        R("confidence", 0.5, 0.70, 0.30),
        R("query", 0.5, 0.62, 0.55),
        R("speculative", None, 0.80, 1.10),
    ]


# ------------------------------------------------------------------------------------------------ choosing τ


def test_choose_tau_min_bytes_at_accuracy(rows):
    rule = SelectionRule(kind="min_bytes_at_accuracy", accuracy_ratio=0.98)  # needs >= 0.784
    best = choose_tau(rows, rule)
    assert best.method == "citer" and best.tau == 0.6
    assert choose_tau(rows, SelectionRule(accuracy_ratio=1.0)).tau == 0.8
    assert choose_tau(rows, SelectionRule(accuracy_ratio=1.01)) is None
    assert choose_tau(rows, SelectionRule(accuracy_ratio=0.5)).tau == 0.2


def test_choose_tau_max_accuracy_under_bytes(rows):
    rule = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert choose_tau(rows, rule).tau == 0.4
    assert choose_tau(rows, SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.1)) is None
    # Equal accuracy: fewer bytes wins; fully equal rows: the smaller tau, whatever the row order.
    tie = [
        R("llm", None, 0.8, 1.0),
        R("citer", 0.7, 0.7, 0.2),
        R("citer", 0.3, 0.7, 0.2),
        R("citer", 0.5, 0.7, 0.25),
    ]
    rule = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert choose_tau(tie, rule).tau == 0.3
    assert choose_tau(list(reversed(tie)), rule).tau == 0.3


def test_choose_tau_needs_llm_row(rows):
    with pytest.raises(SweepError, match="no 'llm' row"):
        choose_tau([r for r in rows if r.method != "llm"], SelectionRule())


def test_objective_orders_feasible_first():
    rule = SelectionRule(accuracy_ratio=0.9)
    feasible = R("citer", 0.5, 0.75, 0.9)  # 0.75 >= 0.72
    infeasible = R("citer", 0.2, 0.70, 0.1)
    assert objective(feasible, rule) > objective(infeasible, rule)
    with pytest.raises(SweepError, match="llm_accuracy"):
        objective(SweepRow("citer", 0.5, 0.7, 0.1, 0, 1.0, 0.1, 0.0), rule)


# ------------------------------------------------------------------------------------------------ promotion


def test_decide_promotion_cases():
    rule = SelectionRule(accuracy_ratio=0.9)  # needs accuracy >= 0.72
    cand = R("citer", 0.5, 0.78, 0.30)
    d = decide_promotion(cand, None, rule)
    assert d.promoted and "no champion" in d.reason
    worse_champ = R("champion", 0.6, 0.79, 0.40)
    d = decide_promotion(cand, worse_champ, rule, previous="3")
    assert d.promoted and "beats" in d.reason and d.previous == "3"
    better_champ = R("champion", 0.4, 0.76, 0.20)
    d = decide_promotion(cand, better_champ, rule)
    assert not d.promoted and "does not beat" in d.reason and "alias kept" in d.reason
    d = decide_promotion(cand, R("champion", 0.5, 0.78, 0.30), rule)
    assert not d.promoted and "ties with" in d.reason
    # A champion that misses the constraint loses to a candidate that meets it, even with fewer bytes.
    assert decide_promotion(cand, R("champion", 0.1, 0.60, 0.05), rule).promoted
    d = decide_promotion(None, better_champ, rule)
    assert not d.promoted and "no tau" in d.reason
    d = decide_promotion(R("citer", 0.5, 0.5, 0.1), None, rule)
    assert not d.promoted and "does not meet" in d.reason


def test_decide_promotion_refuses_other_examples():
    rule = SelectionRule(accuracy_ratio=0.9)
    with pytest.raises(SweepError, match="different examples"):
        decide_promotion(R("citer", 0.5, 0.78, 0.3, h="a"), R("champion", 0.5, 0.7, 0.3, h="b"), rule)


# ------------------------------------------------------------------------------------------------ claims


def test_dominance_lists_violations(rows):
    # Every baseline of the fixture is under the citer curve: confidence @0.30 bytes has 0.70, citer has 0.75 at
    # 0.25; citer_s 0.79 @0.60 vs citer 0.79 @0.35; llm and speculative 0.80 vs citer 0.80 @0.50.
    d = dominance(rows)
    assert d["dominates_all"] and d["violations"] == [] and len(d["checks"]) == 7
    rows.append(R("confidence", 0.9, 0.78, 0.30))  # better than citer at 0.30 bytes (0.75)
    d = dominance(rows)
    assert {(v["method"], v["tau"]) for v in d["violations"]} == {("confidence", 0.9)}
    # Interpolating citer between 0.25 (0.75) and 0.35 (0.79) reaches 0.77 at 0.30: still a violation.
    assert not dominance(rows, interpolate=True)["dominates_all"]
    rows[-1] = R("confidence", 0.9, 0.76, 0.30)
    assert not dominance(rows)["dominates_all"]
    assert dominance(rows, interpolate=True)["dominates_all"]


def test_bytes_at_accuracy_and_saving(rows):
    assert bytes_at_accuracy(rows, "citer", 0.79, interpolate=False) == 0.35
    assert bytes_at_accuracy(rows, "citer", 0.77) == pytest.approx(0.30)
    assert bytes_at_accuracy(rows, "citer", 0.81) is None
    # Below every citer point: the SLM-only anchor (tau -> 0) answers it.
    assert bytes_at_accuracy(rows, "citer", 0.3, interpolate=False) == 0.05
    s = bytes_saving(rows)
    by_acc = {round(p["accuracy"], 2): p["saving"] for p in s["points"]}
    assert by_acc[0.79] == pytest.approx(1 - 0.35 / 0.60)
    assert s["min"] is not None and s["min"] > 0
    c = claims(rows, 0.98)
    assert c["citer_bytes_rel_at_target"] == 0.35 and c["target_accuracy"] == pytest.approx(0.784)


# ------------------------------------------------------------------------------------------------ files


def test_write_and_plot(rows, tmp_path):
    rows.append(R("champion", 0.5, 0.7, 0.3))
    write_sweep(tmp_path / "sweep.json", rows, tmp_path / "details.json")
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert all(list(r) == list(SWEEP_KEYS) for r in out)
    assert {r["method"] for r in out} <= set(METHODS) and len(out) == len(rows) - 1
    back = read_sweep(tmp_path / "details.json")
    assert back == rows
    write_plot_data(tmp_path / "pareto", rows)
    citer_csv = (tmp_path / "pareto" / "citer.csv").read_text().splitlines()
    assert (
        citer_csv[0] == "method,tau,bytes_moved_rel_llm,accuracy,llm_token_fraction" and len(citer_csv) == 5
    )
    write_pareto_json(tmp_path / "pareto.json", rows)
    pts = json.loads((tmp_path / "pareto.json").read_text())
    assert len(pts) == len(rows) - 1 and pts[0]["method"] == "citer"
    assert set(pts[0]) == {"method", "tau", "bytes_moved_rel_llm", "accuracy", "llm_token_fraction"}
    png = plot_pareto(rows, tmp_path / "plots" / "pareto.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["pareto.png"]  # no temporary left behind


def test_read_sweep_names_bad_row(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps([{"method": "citer", "tau": 0.5}]))
    with pytest.raises(SweepError, match=r"s.json: row 0: .*missing"):
        read_sweep(p)


def test_sweep_params_defaults():
    p = SweepParams()
    assert p.taus and all(0 <= t <= 1 for t in p.taus)


# ------------------------------------------------------------------------------------------------ the real sweep


def _rows(n):
    return [{"problem": f"{a} + {a % 3}", "solution": f"\\boxed{{{a + a % 3}}}"} for a in range(n)]


@pytest.fixture(scope="module")
def swept(tiny_pair):
    import torch

    from citer.router import MLPRouter
    from citer.sweep import run_sweep

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    citer = MLPRouter(slm.config.hidden_size).eval()
    torch.manual_seed(1)
    citer_s = MLPRouter(slm.config.hidden_size).eval()
    params = SweepParams(
        taus=[0.0, 0.5, 1.0],
        batch_size=4,
        max_new_tokens=6,
        confidence_thresholds=[0.05, 0.5],
        query_llm_fractions=[0.0, 0.5, 1.0],
        speculative_examples=3,
    )
    logs = []
    rows = run_sweep(
        slm,
        llm,
        tok,
        _rows(6),
        "math",
        {"citer": citer, "citer_s": citer_s},
        params,
        champion=(citer, 0.5),
        log=logs.append,
    )
    return rows, params, logs


def test_sweep_rows_are_sane(swept, tmp_path):
    rows, params, logs = swept
    by = {}
    for r in rows:
        by.setdefault(r.method, []).append(r)
    assert set(by) == set(METHODS) | {"champion"}
    assert len(by["citer"]) == len(by["citer_s"]) == len(by["random"]) == 3 and len(by["confidence"]) == 2
    llm, slm = by["llm"][0], by["slm"][0]
    assert llm.llm_token_fraction == 1.0 and llm.bytes_moved_rel_llm == 1.0 and llm.llm_calls > 0
    assert slm.llm_token_fraction == 0.0 and slm.llm_calls == 0 and 0 < slm.bytes_moved_rel_llm < 1
    for r in rows:
        assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.llm_token_fraction <= 1.0
        assert r.bytes_moved > 0 and r.sec_per_token > 0 and r.gpu_sec_per_token > 0
        assert r.n_examples == 6 and r.examples_hash == llm.examples_hash and r.llm_accuracy == llm.accuracy
    citer = {r.tau: r for r in by["citer"]}
    # tau = 0 never calls the LLM: the SLM-only run, token for token (same bytes, same accuracy).
    assert citer[0.0].llm_token_fraction == 0.0 and citer[0.0].bytes_moved == pytest.approx(slm.bytes_moved)
    # tau = 1 sends every token to the LLM (scores < 1) and also runs the SLM: more bytes than LLM-only.
    assert citer[1.0].llm_token_fraction == 1.0 and citer[1.0].bytes_moved_rel_llm > 1.0
    # Random points are matched to citer's LLM fractions; p = 0 and p = 1 are exact.
    assert sorted(r.tau for r in by["random"]) == sorted(r.llm_token_fraction for r in by["citer"])
    rand = {r.extra["matched_citer_tau"]: r for r in by["random"]}
    assert rand[0.0].llm_token_fraction == 0.0 and rand[1.0].llm_token_fraction == 1.0
    # Query routing at 0 / 1 is SLM-only / LLM-only plus, for 1, the SLM's scoring prefill.
    q = {r.extra["question_llm_fraction"]: r for r in by["query"]}
    assert q[0.0].bytes_moved == pytest.approx(slm.bytes_moved) and q[0.0].accuracy == slm.accuracy
    assert q[1.0].llm_token_fraction == 1.0 and q[1.0].bytes_moved > llm.bytes_moved
    assert 0.0 < q[0.5].llm_token_fraction < 1.0
    # Greedy assisted generation is lossless: the same tokens as LLM-only on the measured questions.
    spec = by["speculative"][0]
    assert (
        spec.extra["llm_agreement"] == 1.0 and spec.extra["n_measured"] == 3 and spec.accuracy == llm.accuracy
    )
    assert spec.extra["batch1_llm_calls"] > 0 and spec.extra["batch1_slm_calls"] > 0
    champ = by["champion"][0]
    assert (
        champ.bytes_moved == pytest.approx(citer[0.5].bytes_moved) and champ.accuracy == citer[0.5].accuracy
    )
    assert any("speculative" in m for m in logs)
    write_sweep(tmp_path / "sweep.json", rows)
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert all(list(r) == list(SWEEP_KEYS) for r in out) and "champion" not in {r["method"] for r in out}
    d = claims(rows)
    assert "dominance" in d and "citer_vs_citer_s" in d
    best = choose_tau(rows, params.rule)
    assert best is not None and best.method == "citer"


def test_sweep_is_deterministic(tiny_pair):
    import torch

    from citer.router import MLPRouter
    from citer.sweep import run_sweep

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    router = MLPRouter(slm.config.hidden_size).eval()
    params = SweepParams(
        taus=[0.5],
        batch_size=3,
        max_new_tokens=5,
        confidence_thresholds=[0.3],
        query_llm_fractions=[0.5],
        speculative=False,
    )
    a = run_sweep(slm, llm, tok, _rows(5), "math", {"citer": router}, params)
    b = run_sweep(slm, llm, tok, _rows(5), "math", {"citer": router}, params)

    def strip(rows):
        return [(r.method, r.tau, r.accuracy, r.llm_token_fraction, r.llm_calls, r.bytes_moved) for r in rows]

    assert strip(a) == strip(b)


def test_sweep_refuses_bad_input(tiny_pair):
    from citer.sweep import run_sweep

    slm, llm, tok = tiny_pair
    with pytest.raises(SweepError, match="key 'citer' missing"):
        run_sweep(slm, llm, tok, _rows(2), "math", {}, SweepParams())
    with pytest.raises(SweepError, match="unknown keys"):
        run_sweep(slm, llm, tok, _rows(2), "math", {"citer": None, "bild": None}, SweepParams())
    with pytest.raises(SweepError, match="row 1, field 'problem' missing"):
        run_sweep(
            slm,
            llm,
            tok,
            [_rows(1)[0], {"solution": "x"}],
            "math",
            {"citer": lambda h: h[:, 0]},
            SweepParams(),
        )
