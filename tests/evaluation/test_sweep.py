"""The real sweep on tiny random models: every method, determinism, bad input."""

from __future__ import annotations

import json

import pytest

from citer.config import SweepParams
from citer.evaluation.pareto import claims
from citer.evaluation.promotion import choose_tau
from citer.evaluation.report import write_sweep
from citer.evaluation.rows import METHODS, SWEEP_KEYS, SweepError


def test_sweep_params_defaults():
    p = SweepParams()
    assert p.taus and all(0 <= t <= 1 for t in p.taus)


# ------------------------------------------------------------------------------------------------ the real sweep


def _rows(n):
    return [{"problem": f"{a} + {a % 3}", "solution": f"\\boxed{{{a + a % 3}}}"} for a in range(n)]


@pytest.fixture(scope="module")
def swept(tiny_pair):
    import torch

    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import MLPRouter

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

    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import MLPRouter

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
    from citer.evaluation.sweep import run_sweep

    slm, llm, tok = tiny_pair
    with pytest.raises(SweepError, match="key 'citer' missing"):
        run_sweep(slm, llm, tok, _rows(2), "math", {}, SweepParams())
    with pytest.raises(SweepError, match="unknown keys"):
        run_sweep(slm, llm, tok, _rows(2), "math", {"citer": None, "bild": None}, SweepParams())
    with pytest.raises(SweepError, match="row 2: field 'problem' missing"):
        run_sweep(
            slm,
            llm,
            tok,
            [_rows(1)[0], {"solution": "x"}],
            "math",
            {"citer": lambda h: h[:, 0]},
            SweepParams(),
        )
