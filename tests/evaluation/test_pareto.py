"""Frontiers and claims on hand-made rows: dominance, bytes at an accuracy, savings against CITER-S."""

from __future__ import annotations

import pytest
from conftest import sweep_row as R

from citer.evaluation.pareto import bytes_at_accuracy, bytes_saving, claims, dominance


def test_dominance_lists_violations(sweep_rows):
    # Every baseline of the fixture is under the citer curve: confidence @0.30 bytes has 0.70, citer has 0.75 at
    # 0.25; citer_s 0.79 @0.60 vs citer 0.79 @0.35; llm and speculative 0.80 vs citer 0.80 @0.50.
    d = dominance(sweep_rows)
    assert d["dominates_all"] and d["violations"] == [] and len(d["checks"]) == 7
    sweep_rows.append(R("confidence", 0.9, 0.78, 0.30))  # better than citer at 0.30 bytes (0.75)
    d = dominance(sweep_rows)
    assert {(v["method"], v["tau"]) for v in d["violations"]} == {("confidence", 0.9)}
    # Interpolating citer between 0.25 (0.75) and 0.35 (0.79) reaches 0.77 at 0.30: still a violation.
    assert not dominance(sweep_rows, interpolate=True)["dominates_all"]
    sweep_rows[-1] = R("confidence", 0.9, 0.76, 0.30)
    assert not dominance(sweep_rows)["dominates_all"]
    assert dominance(sweep_rows, interpolate=True)["dominates_all"]


def test_bytes_at_accuracy_and_saving(sweep_rows):
    assert bytes_at_accuracy(sweep_rows, "citer", 0.79, interpolate=False) == 0.35
    assert bytes_at_accuracy(sweep_rows, "citer", 0.77) == pytest.approx(0.30)
    assert bytes_at_accuracy(sweep_rows, "citer", 0.81) is None
    # Below every citer point: the SLM-only anchor (tau -> 0) answers it.
    assert bytes_at_accuracy(sweep_rows, "citer", 0.3, interpolate=False) == 0.05
    s = bytes_saving(sweep_rows)
    by_acc = {round(p["accuracy"], 2): p["saving"] for p in s["points"]}
    assert by_acc[0.79] == pytest.approx(1 - 0.35 / 0.60)
    assert s["min"] is not None and s["min"] > 0
    c = claims(sweep_rows, 0.98)
    assert c["citer_bytes_rel_at_target"] == 0.35 and c["target_accuracy"] == pytest.approx(0.784)


def test_bytes_at_accuracy_is_exact_at_a_measured_point():
    # Interpolating to a frontier point's own accuracy gives its measured bytes exactly (0.1 + (0.45 - 0.1) is
    # 0.44999999999999996), so identical curves compare as an exact tie: a saving of 0, not -2e-16.
    rows = [R("llm", None, 0.80, 1.0), R("slm", None, 0.40, 0.1), R("citer", 0.5, 0.75, 0.45)]
    assert bytes_at_accuracy(rows, "citer", 0.75, interpolate=True) == 0.45
    rows.append(R("citer_s", 0.5, 0.75, 0.45))
    assert bytes_saving(rows)["mean"] == 0.0
