"""Paired bootstrap intervals on hand-made sweeps built from synthetic per-question vectors (no mocks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from citer.evaluation.intervals import (
    attach_intervals,
    bootstrap_stat,
    interval,
    percentile,
    resample_indices,
    resampled,
)
from citer.evaluation.pareto import claims
from citer.evaluation.sweep_rows import SweepRow


def row(method, tau, correct, qbytes, llm_bytes, llm_acc=None) -> SweepRow:
    """A row aggregated from per-question vectors, as passes.to_row does."""
    correct = [bool(c) for c in correct]
    qbytes = [float(b) for b in qbytes]
    return SweepRow(
        method=method,
        tau=tau,
        accuracy=sum(correct) / len(correct),
        llm_token_fraction=0.0,
        llm_calls=0,
        bytes_moved=sum(qbytes),
        bytes_moved_rel_llm=sum(qbytes) / float(np.sum(llm_bytes)),
        sec_per_token=1e-3,
        n_examples=len(correct),
        llm_accuracy=llm_acc,
        examples_hash="h",
        correct=correct,
        question_bytes=qbytes,
    )


def sweep(n: int = 200, seed: int = 0, n_taus: int = 5) -> list[SweepRow]:
    """LLM-only ~0.80, SLM-only ~0.40; CITER sends the questions the SLM gets wrong to the LLM first (a good
    router), random sends them at random (same cost, lower accuracy); plus oracle, confidence, citer_s."""
    rng = np.random.default_rng(seed)
    llm_c = rng.random(n) < 0.8
    slm_c = llm_c & (rng.random(n) < 0.5)
    llm_b = rng.uniform(500.0, 1500.0, n)
    slm_b = 0.05 * llm_b
    acc = float(llm_c.mean())
    rows = [row("llm", None, llm_c, llm_b, llm_b, acc), row("slm", None, slm_c, slm_b, llm_b, acc)]
    need = np.argsort(slm_c + 0.01 * rng.random(n))  # wrong-for-SLM questions first
    for f in np.linspace(0.1, 0.9, n_taus):
        k = int(f * n)
        for method, order in (("citer", need), ("random", rng.permutation(n)), ("citer_s", need[::-1])):
            to_llm = np.zeros(n, bool)
            to_llm[order[:k]] = True
            c = np.where(to_llm, llm_c, slm_c)
            b = np.where(to_llm, 0.9 * llm_b + slm_b, slm_b)
            rows.append(row(method, float(f), c, b, llm_b, acc))
    rows.append(row("oracle", None, llm_c, np.where(slm_c == llm_c, slm_b, 0.9 * llm_b + slm_b), llm_b, acc))
    return rows


def test_resample_indices_are_seeded():
    a = resample_indices(50, 20, seed=3)
    assert a.shape == (20, 50) and a.min() >= 0 and a.max() < 50
    assert np.array_equal(a, resample_indices(50, 20, seed=3))
    assert not np.array_equal(a, resample_indices(50, 20, seed=4))


def test_resampled_restricts_every_row_to_the_same_questions():
    llm_b = np.array([10.0, 20.0, 30.0, 40.0])
    rows = [
        row("llm", None, [1, 1, 0, 1], llm_b, llm_b),
        row("citer", 0.5, [1, 0, 0, 1], [1.0, 2.0, 3.0, 4.0], llm_b),
        SweepRow("speculative", None, 0.5, 1.0, 0, 9.0, 0.9, 1e-3, correct=[True], question_bytes=[9.0]),
    ]
    got = resampled(rows, [0, 0, 3])
    llm, citer, spec = got
    assert llm.accuracy == 1.0 and llm.bytes_moved_rel_llm == pytest.approx(1.0)
    assert citer.accuracy == 1.0 and citer.correct == [True, True, True] and citer.n_examples == 3
    assert citer.bytes_moved == pytest.approx(6.0) and citer.question_bytes == [1.0, 1.0, 4.0]
    assert citer.bytes_moved_rel_llm == pytest.approx(6.0 / 60.0) and citer.llm_accuracy == 1.0
    assert spec is rows[2]  # not aligned with LLM-only: kept as it is
    assert rows[1].accuracy == 0.5 and len(rows[1].correct) == 4  # the originals are untouched
    same = resampled(rows, np.arange(4))
    assert [r.accuracy for r in same] == [r.accuracy for r in rows]
    assert [r.bytes_moved_rel_llm for r in same] == pytest.approx([r.bytes_moved_rel_llm for r in rows])


def test_percentile_keeps_infinities_outward():
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0 and percentile([0.0, 1.0], 0.25) == 0.25
    assert percentile([1.0, 2.0, np.inf], 0.975) == np.inf
    assert interval([np.nan, np.nan]) is None
    assert interval([1.0, np.nan, 3.0], 0.5) == (1.5, 2.5)


def test_row_intervals_contain_the_estimate_and_shrink_with_more_questions():
    widths = {}
    for n in (200, 2000):
        rows = sweep(n)
        attach_intervals(rows, n_resamples=400, seed=0)
        for r in rows:
            lo, hi = r.accuracy_ci
            assert lo <= r.accuracy <= hi
            lo, hi = r.bytes_ci
            assert lo <= r.bytes_moved_rel_llm <= hi
        llm = rows[0]
        assert llm.bytes_ci == pytest.approx((1.0, 1.0)) and llm.accuracy_ci[1] > llm.accuracy_ci[0]
        mid = [r for r in rows if r.method == "random"][2]
        widths[n] = (mid.accuracy_ci[1] - mid.accuracy_ci[0], mid.bytes_ci[1] - mid.bytes_ci[0])
    assert widths[2000][0] < widths[200][0] / 2 and widths[2000][1] < widths[200][1] / 2


def test_same_seed_same_claims_other_seed_other_intervals():
    rows = sweep(200)
    a = claims(rows, n_resamples=200, seed=0)
    assert a == claims(rows, n_resamples=200, seed=0)
    b = claims(rows, n_resamples=200, seed=1)
    assert a["bytes_at_target"]["value"] == b["bytes_at_target"]["value"]
    assert a["savings"]["random"]["ci"] != b["savings"]["random"]["ci"]


def test_bootstrap_stat_is_generic_and_counts_valid_resamples():
    rows = sweep(200)
    diff = bootstrap_stat(rows, lambda rs: rs[2].accuracy - rs[3].accuracy, n_resamples=300, seed=0)
    assert diff["value"] == pytest.approx(rows[2].accuracy - rows[3].accuracy)
    assert diff["ci"][0] <= diff["value"] <= diff["ci"][1] and diff["n_valid"] == 300
    acc = rows[0].accuracy
    some = bootstrap_stat(rows, lambda rs: rs[0].accuracy if rs[0].accuracy >= acc else None, 300, 0)
    assert 0 < some["n_valid"] < 300 and some["ci"][0] >= acc
    never = bootstrap_stat(rows, lambda rs: None, 300, 0)
    assert never["value"] is None and never["ci"] is None and never["n_valid"] == 0


def test_a_clearly_better_method_holds_and_a_tie_is_not_significant():
    n = 200
    rng = np.random.default_rng(1)
    llm_c = rng.random(n) < 0.97
    llm_b = np.full(n, 100.0)
    good = llm_c & (rng.random(n) < 0.98)  # ~0.95
    bad = good & (rng.random(n) < 0.63)  # ~0.60
    rows = [
        row("llm", None, llm_c, llm_b, llm_b),
        row("slm", None, bad & (rng.random(n) < 0.5), 0.05 * llm_b, llm_b),
        row("citer", 0.5, good, 0.5 * llm_b, llm_b),
        row("confidence", 0.5, bad, 0.5 * llm_b, llm_b),  # same bytes, far lower accuracy
        row("citer_s", 0.5, good, 0.5 * llm_b, llm_b),  # identical to CITER: a tie
    ]
    c = claims(rows, n_resamples=500, seed=0)
    dom = c["dominance_at_95"]["confidence"]
    assert dom["holds_at_95"] is True and dom["ci"][0] > 0.2 and "at least as accurate" in dom["statement"]
    win = c["savings"]["confidence"]
    assert win["holds_at_95"] is True and win["ci"][0] > 0 and "significant" in win["statement"]
    tie = c["savings"]["citer_s"]
    assert tie["value"] == 0.0 and tie["ci"] == [0.0, 0.0] and tie["holds_at_95"] is False
    assert "not significant" in tie["statement"] and "does not win" in tie["statement"]
    # The tie is "not worse" under the dominance rule (gap exactly 0 on every resample).
    assert c["dominance_at_95"]["citer_s"]["ci"] == [0.0, 0.0]
    # Flip the roles: confidence now beats CITER clearly at equal bytes.
    rows[2], rows[3] = (
        row("citer", 0.5, bad, 0.5 * llm_b, llm_b),
        row("confidence", 0.5, good, 0.5 * llm_b, llm_b),
    )
    c = claims(rows, n_resamples=500, seed=0)
    dom = c["dominance_at_95"]["confidence"]
    assert dom["holds_at_95"] is False and dom["ci"][1] < 0 and "does not dominate" in dom["statement"]
    assert c["savings"]["confidence"]["holds_at_95"] is False
    assert "does not" in c["savings"]["confidence"]["statement"]


def test_bytes_at_target_holds_only_when_reached_on_enough_resamples():
    rows = sweep(300)
    c = claims(rows, 0.98, n_resamples=300, seed=0)
    bt = c["bytes_at_target"]
    assert bt["value"] == c["citer_bytes_rel_at_target"] and bt["ci"][0] <= bt["value"] <= bt["ci"][1]
    assert bt["holds_at_95"] is True and bt["reached_fraction"] >= 0.975
    assert bt["statement"].startswith(f"CITER reaches 98% of LLM-only accuracy at {bt['value']:.2f} [")
    # Only a point that just reaches the target, on other questions than LLM-only: missed on many resamples.
    n = 300
    rng = np.random.default_rng(2)
    llm_c = rng.random(n) < 0.8
    llm_b = np.full(n, 10.0)
    near = rng.permutation(llm_c)  # the same accuracy, other questions
    rows = [
        row("llm", None, llm_c, llm_b, llm_b),
        row("slm", None, llm_c & (rng.random(n) < 0.5), 0.05 * llm_b, llm_b),
        row("citer", 0.9, near, 0.8 * llm_b, llm_b),
    ]
    bt = claims(rows, 1.0, n_resamples=300, seed=0)["bytes_at_target"]
    assert bt["value"] == pytest.approx(0.8) and bt["ci"][1] is None and bt["holds_at_95"] is False
    assert "not reached" in bt["statement"] and 0.0 < bt["reached_fraction"] < 0.975


def test_claims_json_round_trip_oracle_and_unaligned_rows():
    rows = sweep(200)
    rows.append(
        SweepRow(
            "speculative", None, 0.7, 1.0, 0, 1.0, 1.1, 1e-3, correct=[True] * 3, question_bytes=[1.0] * 3
        )
    )
    c = claims(rows, 0.98, n_resamples=200, seed=0)
    assert json.loads(json.dumps(c, allow_nan=False)) == c
    assert c["bootstrap"] == {
        "n_resamples": 200,
        "seed": 0,
        "level": 0.95,
        "n_questions": 200,
        "paired": True,
    }
    orc = c["oracle_ratio"]
    assert orc["value"] is not None and orc["value"] >= 1.0 - 1e-9  # nothing beats the lossless bound
    assert orc["ci"] is not None and orc["accuracy_ratio"] == 0.99 and c["oracle_ratio_at_target"] is not None
    assert c["savings"]["random"]["holds_at_95"] is True  # the good router beats random routing
    # speculative has per-question data for 3 of 200 questions: no paired interval, but a point value.
    spec = c["savings"]["speculative"]
    assert spec["ci"] is None and spec["holds_at_95"] is None and "no interval" in spec["statement"]
    assert c["dominance_at_95"]["speculative"]["ci"] is None
    assert set(c["dominance_at_95"]) == {"citer_s", "llm", "random", "speculative"}
    assert all(isinstance(v["statement"], str) for v in c["savings"].values())


def test_rows_without_per_question_data_have_no_intervals(sweep_rows):
    attach_intervals(sweep_rows, n_resamples=100)
    assert all(r.accuracy_ci is None and r.bytes_ci is None for r in sweep_rows)
    c = claims(sweep_rows, 0.98, n_resamples=100)
    assert json.loads(json.dumps(c, allow_nan=False)) == c and c["bootstrap"]["paired"] is False
    assert c["citer_bytes_rel_at_target"] == 0.35 and c["oracle_ratio"] is None
    every = [c["bytes_at_target"], *c["savings"].values(), *c["dominance_at_95"].values()]
    assert all(x["ci"] is None and x["holds_at_95"] is None and x["n_valid"] == 0 for x in every)
    assert c["bytes_at_target"]["value"] == 0.35 and "no interval" in c["bytes_at_target"]["statement"]
    assert c["savings"]["citer_s"]["value"] == pytest.approx(c["citer_vs_citer_s"]["mean"])
    assert bootstrap_stat(sweep_rows, lambda rs: rs[0].accuracy)["ci"] is None
