"""The real sweep on tiny models: the dev/test protocol, thresholds from dev quantiles, the oracle, the trained query
router, every method, determinism and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import answering_rows

from citer.config import RouterParams, SweepParams
from citer.evaluation.promotion import plan_promotion
from citer.evaluation.report import write_sweep
from citer.evaluation.sweep_rows import SWEEP_KEYS, SweepError
from citer.evaluation.thresholds import quantile_table, tau_at_fraction, tau_for_fraction, taus_at_fractions


def test_sweep_params_defaults():
    p = SweepParams()
    assert p.llm_fractions and all(0 < f < 1 for f in p.llm_fractions)
    with pytest.raises(ValueError, match="llm_fractions"):
        SweepParams(llm_fractions=[0.1, 1.5])


def test_tau_at_fraction_sends_that_share_below():
    scores = np.linspace(0.0, 1.0, 1001) ** 2  # any monotone scale: the fraction, not the value, is asked for
    for f in (0.01, 0.1, 0.37, 0.5, 0.9):
        tau = tau_at_fraction(scores, f)
        assert (scores < tau).mean() == pytest.approx(f, abs=1e-3)
    assert tau_at_fraction(scores, 0.0) == 0.0  # nothing is below the smallest score
    # Repeated τ (ties) collapse to one pass; the table interpolates between fractions.
    assert len(taus_at_fractions(np.zeros(50), [0.1, 0.2, 0.3])) == 1
    table = quantile_table(scores)
    assert len(table) == 101 and table == sorted(table)
    assert tau_for_fraction(table, 0.105) == pytest.approx((table[10] + table[11]) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="llm_fraction"):
        tau_for_fraction(table, 1.5)


# ------------------------------------------------------------------------------------------------ the real sweep


def _rows(n, offset=0):
    return [
        {"problem": f"{a} + {a % 3}", "solution": f"\\boxed{{{a + a % 3}}}"}
        for a in range(offset, offset + n)
    ]


@pytest.fixture(scope="module")
def swept(answering_pair):
    """The whole sweep on a pair that answers: the LLM every question, the SLM about half, CITER's router trained."""
    from citer.evaluation.sweep import run_sweep
    from citer.routing.labels import citer_s_labels
    from citer.routing.mlp import train_router

    pair = answering_pair
    citer_s, _ = train_router(citer_s_labels(pair.labels), RouterParams(epochs=30, batch_size=128, seed=1))
    params = SweepParams(
        llm_fractions=[0.02, 0.05, 0.1, 0.2, 0.5],
        batch_size=16,
        max_new_tokens=12,
        query={"train_examples": 64, "epochs": 100},
        intervals={"resamples": 300},
        verify={"rhos": [1.0, 4.0], "fractions": [0.05, 0.2], "windows": [4]},
    )
    logs = []
    res = run_sweep(
        pair.slm,
        pair.llm,
        pair.tok,
        answering_rows(11, 32),
        answering_rows(12, 32),
        "math",
        {"citer": pair.router, "citer_s": citer_s},
        params,
        train_rows=answering_rows(13, 64),
        champion=pair.router,
        log=logs.append,
    )
    return res, params, logs


def _by_method(rows):
    by = {}
    for r in rows:
        by.setdefault(r.method, []).append(r)
    return by


def test_sweep_rows_are_sane(swept, tmp_path):
    res, params, logs = swept
    by = _by_method(res.test)
    assert set(by) == {"citer", "citer_s", "confidence", "random", "query", "oracle", "speculative", "slm", "llm",
                       "champion", "citer_verify", "bild"}  # fmt: skip
    llm, slm = by["llm"][0], by["slm"][0]
    assert llm.llm_token_fraction == 1.0 and llm.bytes_moved_rel_llm == 1.0 and llm.llm_calls > 0
    assert slm.llm_token_fraction == 0.0 and slm.llm_calls == 0 and 0 < slm.bytes_moved_rel_llm < 1
    for r in res.test:
        assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.llm_token_fraction <= 1.0
        assert r.bytes_moved > 0 and r.sec_per_token > 0 and r.gpu_sec_per_token > 0
        assert r.n_examples == 32 and r.examples_hash == llm.examples_hash and r.llm_accuracy == llm.accuracy
        assert len(r.correct) == len(r.question_bytes) == 32  # every row pairs with every other (bootstrap)
        assert sum(r.question_bytes) == pytest.approx(r.bytes_moved)
    # dev and test are different examples, and every choice comes from dev.
    assert {r.examples_hash for r in res.dev} != {r.examples_hash for r in res.test}
    for m in ("citer", "citer_s", "confidence"):
        taus = [t for _, t in res.thresholds[m]]
        assert [r.tau for r in by[m]] == taus and len(res.quantiles[m]) == 101
        # τ rises with the target fraction: each method is asked for the same cost range on its own score scale.
        assert taus == sorted(taus)
        # The dev quantile sends about the asked share of dev tokens to the LLM; test lands near it.
        for (f, _), r in zip(res.thresholds[m], by[m], strict=True):
            assert abs(r.llm_token_fraction - f) < 0.1
    # Greedy assisted generation is lossless and measured on the whole split, its accuracy graded.
    spec = by["speculative"][0]
    assert (
        spec.extra["llm_agreement"] == 1.0
        and spec.extra["n_measured"] == 32
        and spec.accuracy == llm.accuracy
    )
    assert spec.extra["llm_calls"] > 0 and spec.extra["slm_calls"] > 0 and "subset_only" not in spec.extra
    # The champion runs on test once, at the point its own dev pass chose.
    assert len(by["champion"]) == 1 and by["champion"][0].extra["selected_on_dev"]
    assert any("speculative" in m for m in logs) and any("query labels" in m for m in logs)
    write_sweep(tmp_path / "sweep.json", res.test)
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert all(list(r) == list(SWEEP_KEYS) for r in out) and "champion" not in {r["method"] for r in out}
    assert sum(r["selected_on_dev"] for r in out if r["method"] == "citer") == 1


def test_methods_differ_where_they_should(swept):
    """Accuracy that a wrong router, a wrong τ or a wrong grade would change."""
    res, _, _ = swept
    by = _by_method(res.test)
    llm, slm, oracle = by["llm"][0], by["slm"][0], by["oracle"][0]
    assert llm.accuracy == 1.0 and 0.25 <= slm.accuracy <= 0.75  # the SLM misses exactly the answers 5-9
    # The oracle returns the LLM's answers with the LLM writing only the answer token of the SLM's misses.
    assert oracle.extra["llm_agreement"] == 1.0 and oracle.accuracy == llm.accuracy
    assert oracle.llm_token_fraction < 0.1 and oracle.bytes_moved_rel_llm < 0.5
    # The trained router finds those tokens: asked for 5% of tokens (the misses are about 4.5%) it answers like the
    # LLM, which a router sending the same share at random does not; at 2% it cannot.
    tau = dict(res.thresholds["citer"])
    citer = {f: next(r for r in by["citer"] if r.tau == tau[f]) for f in (0.02, 0.05)}
    random5 = next(r for r in by["random"] if r.tau == 0.05)
    assert citer[0.05].accuracy >= 0.98 and random5.accuracy < 0.8 and citer[0.02].accuracy < 0.98
    # The trained query router sends the SLM's misses to the LLM: at half the questions it beats the SLM alone.
    top_query = max(by["query"], key=lambda r: r.llm_token_fraction)
    assert top_query.accuracy > slm.accuracy + 0.25


def test_tau_is_chosen_on_dev(swept):
    res, params, _ = swept
    from citer.evaluation.promotion import choose_tau

    rule = params.rule  # min bytes at >= 98% of LLM-only accuracy
    for m in ("citer", "confidence"):
        dev_pick = choose_tau(res.dev, rule, m)
        test_rows = [r for r in res.test if r.method == m]
        marked = [r for r in test_rows if r.extra.get("selected_on_dev")]
        assert dev_pick is not None and len(marked) == 1 and marked[0].tau == dev_pick.tau
    # CITER's dev choice is its least-bytes point that still answers like the LLM on dev; it holds on test.
    citer = next(r for r in res.test if r.method == "citer" and r.extra.get("selected_on_dev"))
    assert citer.accuracy >= 0.98 and citer.bytes_moved_rel_llm < 0.5


def test_promotion_is_chosen_on_dev_and_compared_on_test(swept):
    res, params, _ = swept
    plan = plan_promotion(res.dev, res.test, params.rule, champion_version="1")
    assert plan.best_dev is not None and plan.best_dev.examples_hash == res.dev[0].examples_hash
    assert plan.best is not None and plan.best.examples_hash == res.test[0].examples_hash
    assert (plan.best.method, plan.best.tau) == (plan.best_dev.method, plan.best_dev.tau)
    # The champion is the same router thresholded on the same dev scores: a tie keeps it.
    assert not plan.decision.promoted and "ties with" in plan.decision.reason


def test_claims_carry_intervals_on_an_answering_pair(swept, tmp_path):
    from citer.evaluation.report import write_sweep_reports

    res, params, _ = swept
    found = write_sweep_reports(tmp_path, res, params)
    claims = json.loads((tmp_path / "sweep_claims.json").read_text())
    assert claims["protocol"]["selected_on"] == "dev" and found["llm_accuracy"] == 1.0
    bt = claims["bytes_at_target"]
    assert 0 < bt["value"] < 0.5 and bt["ci"][0] <= bt["value"] <= bt["ci"][1] and bt["holds_at_95"] is True
    ratio = claims["oracle_ratio"]
    # CITER pays the router's reads on every step and the oracle none: at equal accuracy it moves more than the oracle.
    assert ratio["value"] > 1.0 and ratio["holds_at_95"] is True
    assert "oracle's bytes" in ratio["statement"]
    # Random routing never reaches the LLM's accuracy below half the tokens: CITER saves bytes against it.
    rnd = claims["savings"]["random"]
    assert rnd["value"] > 0 and "CITER vs random" in rnd["statement"]
    for c in claims["savings"].values():
        assert isinstance(c["holds_at_95"], bool) and c["statement"]


def test_router_reads_are_counted(tiny_pair):
    import torch

    from citer.decoding.baselines import AlwaysSLM, ConfidenceRouter, router_read_bytes
    from citer.decoding.engine import RoutedEngine
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    mlp = MLPRouter(slm.config.hidden_size).eval()
    # Parameters and BatchNorm's running statistics: everything inference reads.
    own = sum(
        t.numel() * t.element_size() for t in [*mlp.parameters(), *mlp.buffers()] if t.is_floating_point()
    )
    assert router_read_bytes(mlp, slm) == own > 0
    assert router_read_bytes(ConfidenceRouter.from_model(slm), slm) == 0  # it reads the SLM's own head
    assert router_read_bytes(AlwaysSLM(), slm) == 0
    prompt = tok.encode("1 + 2", add_special_tokens=False)
    plain = RoutedEngine(slm, llm, AlwaysSLM(), tau=0.5, vocab_size=len(tok)).generate(prompt, 4)
    # A router that never sends to the LLM (scores >= 0 > τ = 0) gives the same tokens and costs one read per step.
    routed = RoutedEngine(slm, llm, mlp, tau=0.0, vocab_size=len(tok)).generate(prompt, 4)
    assert routed.tokens == plain.tokens
    steps = routed.rows[0].slm_calls
    assert routed.rows[0].bytes_alone == pytest.approx(plain.rows[0].bytes_alone + steps * own)


def test_sweep_is_deterministic(tiny_pair):
    import torch

    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    router = MLPRouter(slm.config.hidden_size).eval()
    params = SweepParams(llm_fractions=[0.5], batch_size=3, max_new_tokens=5, speculative=False, oracle=False)
    a = run_sweep(slm, llm, tok, _rows(4, 50), _rows(5), "math", {"citer": router}, params)
    b = run_sweep(slm, llm, tok, _rows(4, 50), _rows(5), "math", {"citer": router}, params)

    def strip(rows):
        return [(r.method, r.tau, r.accuracy, r.llm_token_fraction, r.llm_calls, r.bytes_moved) for r in rows]

    assert strip(a.test) == strip(b.test) and strip(a.dev) == strip(b.dev)


def test_sweep_refuses_bad_input(tiny_pair):
    from citer.evaluation.sweep import run_sweep

    slm, llm, tok = tiny_pair
    with pytest.raises(SweepError, match="key 'citer' missing"):
        run_sweep(slm, llm, tok, _rows(2), _rows(2), "math", {}, SweepParams())
    with pytest.raises(SweepError, match="unknown keys"):
        run_sweep(slm, llm, tok, _rows(2), _rows(2), "math", {"citer": None, "bild": None}, SweepParams())
    with pytest.raises(SweepError, match="row 2: field 'problem' missing"):
        run_sweep(
            slm,
            llm,
            tok,
            _rows(2),
            [_rows(1)[0], {"solution": "x"}],
            "math",
            {"citer": lambda h: h[:, 0]},
            SweepParams(),
        )


def test_verified_methods_are_chosen_on_dev_in_stages_and_reported_on_test(swept):
    res, params, _ = swept
    v = params.verify
    dev, test = _by_method(res.dev), _by_method(res.test)
    assert res.notes["verify"]["citer_verify_router"] == "citer"  # the only router variant given
    for m, router in (("citer_verify", "citer"), ("bild", "confidence")):
        rows = dev[m]
        stage1 = [r for r in rows if r.extra["verify_window"] == 0 and r.extra["verify_final"] is v.final]
        # every rho at every τ its fractions give (repeated τ collapse to one pass)
        taus = sorted({r.tau for r in stage1})
        assert 1 <= len(taus) <= len(v.fractions) and len(stage1) == len(v.rhos) * len(taus)
        assert {r.extra["verify_rho"] for r in stage1} == set(v.rhos)
        stage2 = [r for r in rows if r.extra["verify_window"] > 0]
        assert [r.extra["verify_window"] for r in stage2] == v.windows  # one point, every window
        flipped = [r for r in rows if r.extra["verify_final"] is not v.final]
        assert (
            len(flipped) == 1 and flipped[0].extra["verify_window"] == 0
        )  # and the final check flipped there
        assert all(r.extra["router"] == router for r in rows)
        # test: one curve, at the ρ and W of the dev-chosen (or closest) point, which is marked
        trows = test[m]
        assert len({(r.extra["verify_rho"], r.extra["verify_window"]) for r in trows}) == 1
        chosen = res.chosen[m]
        if chosen is not None:
            marked = [r for r in trows if r.extra.get("selected_on_dev")]
            assert len(marked) == 1 and marked[0].tau == chosen.tau
            assert marked[0].extra["verify_rho"] == chosen.extra["verify_rho"]
        for r in trows:
            assert r.n_examples == 32 and len(r.correct) == 32 and r.extra["rolled_back_tokens"] >= 0
    # a small rho takes tokens back somewhere on dev: the check ran
    assert any(r.extra["rolled_back_tokens"] > 0 for m in ("citer_verify", "bild") for r in dev[m])


def test_the_verified_decoder_has_claims_of_its_own(swept):
    from citer.evaluation.pareto import claims

    res, _, _ = swept
    c = claims(res.test, 0.98, n_resamples=200, method="citer_verify")
    assert c["method"] == "citer_verify"
    assert {"bild", "speculative", "citer"} <= set(
        c["savings"]
    )  # the anchor, the lossless decoder, plain CITER
    assert "citer_verify" not in c["savings"] and "citer" in c["dominance_at_95"]
    assert (
        c["oracle_ratio"]["statement"].startswith("At 99%")
        or "CITER (citer_verify)" in (c["oracle_ratio"]["statement"])
    )
    assert all("CITER (citer_verify)" in s["statement"] for s in c["savings"].values())


def test_the_decoding_batch_moves_only_the_batch_shared_columns(tiny_pair):
    """``decode_batch_size`` is a speed knob: every row, interval and per-question figure is the same at any decoding
    batch; only the batch-shared bytes (and wall time) follow it."""
    import torch

    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    router = MLPRouter(slm.config.hidden_size).eval()
    runs = {}
    for decode in (1, 5):
        params = SweepParams(
            llm_fractions=[0.3],
            batch_size=3,
            decode_batch_size=decode,
            max_new_tokens=5,
            speculative_examples=3,
        )
        runs[decode] = run_sweep(slm, llm, tok, _rows(4, 50), _rows(5), "math", {"citer": router}, params)

    def fixed(rows):
        out = []
        for r in rows:
            d = r.to_details()  # no wall-clock seconds per token: they are the run's, not the row's
            d["extra"] = {
                k: v
                for k, v in d["extra"].items()
                if not k.startswith("bytes_moved_batch") and not k.endswith("seconds")
            }
            out.append(d)
        return out

    def shared(rows):
        return [r.extra.get("bytes_moved_batch") for r in rows]

    for split in ("dev", "test"):
        one, five = getattr(runs[1], split), getattr(runs[5], split)
        assert fixed(one) == fixed(five), split
        moved = [(a, b) for a, b in zip(shared(one), shared(five), strict=True) if a is not None and a != b]
        assert moved, f"{split}: no batch-shared figure followed the decoding batch"
