"""The promotion rule on hand-made rows: choosing τ, candidate against champion, the registry record."""

from __future__ import annotations

import json

import pytest
from conftest import sweep_row as R

from citer.config import SelectionRule
from citer.evaluation.promotion import (
    choose_tau,
    decide_promotion,
    objective,
    plan_promotion,
    promotion_record,
    version_tags,
)
from citer.evaluation.rows import SweepError, SweepRow

NONE_MEETS = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.1)  # citer's least is 0.15


def test_choose_tau_min_bytes_at_accuracy(sweep_rows):
    rule = SelectionRule(kind="min_bytes_at_accuracy", accuracy_ratio=0.98)  # needs >= 0.784
    best = choose_tau(sweep_rows, rule)
    assert best.method == "citer" and best.tau == 0.6
    assert choose_tau(sweep_rows, SelectionRule(accuracy_ratio=1.0)).tau == 0.8
    assert choose_tau(sweep_rows, NONE_MEETS) is None
    with pytest.raises(ValueError, match="accuracy_ratio"):
        SelectionRule(accuracy_ratio=1.01)  # above LLM-only accuracy no router can be asked for
    assert choose_tau(sweep_rows, SelectionRule(accuracy_ratio=0.5)).tau == 0.2


def test_choose_tau_max_accuracy_under_bytes(sweep_rows):
    rule = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert choose_tau(sweep_rows, rule).tau == 0.4
    assert (
        choose_tau(sweep_rows, SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.1))
        is None
    )
    # Equal accuracy: fewer bytes wins; fully equal sweep_rows: the smaller tau, whatever the row order.
    tie = [
        R("llm", None, 0.8, 1.0),
        R("citer", 0.7, 0.7, 0.2),
        R("citer", 0.3, 0.7, 0.2),
        R("citer", 0.5, 0.7, 0.25),
    ]
    rule = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert choose_tau(tie, rule).tau == 0.3
    assert choose_tau(list(reversed(tie)), rule).tau == 0.3


def test_choose_tau_needs_llm_row(sweep_rows):
    with pytest.raises(SweepError, match="no 'llm' row"):
        choose_tau([r for r in sweep_rows if r.method != "llm"], SelectionRule())


def test_objective_orders_feasible_first():
    rule = SelectionRule(accuracy_ratio=0.9)
    feasible = R("citer", 0.5, 0.75, 0.9)  # 0.75 >= 0.72
    infeasible = R("citer", 0.2, 0.70, 0.1)
    assert objective(feasible, rule) > objective(infeasible, rule)
    with pytest.raises(SweepError, match="llm_accuracy"):
        objective(SweepRow("citer", 0.5, 0.7, 0.1, 0, 1.0, 0.1, 0.0), rule)


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


# ------------------------------------------------------------------------------------------------ the plan and record


def test_plan_promotion_cases(sweep_rows):
    rule = SelectionRule(accuracy_ratio=0.98)  # needs accuracy >= 0.784: citer at 0.35 bytes
    plan = plan_promotion(sweep_rows, sweep_rows, rule)
    assert plan.best.tau == 0.6 and plan.decision.promoted and plan.decision.previous is None
    # A champion that exists but has no row here (another SLM) is kept, and the note says why.
    plan = plan_promotion(
        sweep_rows, sweep_rows, rule, champion_version="4", champion_note="routes for SLM other"
    )
    assert not plan.decision.promoted and plan.best.tau == 0.6
    assert plan.decision.reason == "kept v4: routes for SLM other; it cannot be compared here"
    assert plan.decision.previous == "4"
    # A champion re-evaluated in the same sweep: the candidate must strictly beat it.
    better = sweep_rows + [R("champion", 0.7, 0.80, 0.30)]
    plan = plan_promotion(better, better, rule, champion_version="4")
    assert not plan.decision.promoted and "does not beat" in plan.decision.reason
    worse = sweep_rows + [R("champion", 0.7, 0.80, 0.45)]
    plan = plan_promotion(worse, worse, rule, champion_version="4")
    assert plan.decision.promoted and plan.decision.previous == "4"
    # No τ meets the rule: nothing to register, alias unchanged.
    plan = plan_promotion(sweep_rows, sweep_rows, NONE_MEETS, champion_version="4")
    assert plan.best is None and not plan.decision.promoted
    plan = plan_promotion(sweep_rows, sweep_rows, NONE_MEETS)
    assert plan.best is None and not plan.decision.promoted and "on dev" in plan.decision.reason


def test_version_tags_and_promotion_record(sweep_rows):
    rule = SelectionRule(accuracy_ratio=0.98)
    plan = plan_promotion(sweep_rows, sweep_rows, rule)
    tags = version_tags(
        plan.best,
        rule,
        slm="models/slm",
        llm="models/llm",
        hidden_size=32,
        iteration=2,
        labels_hash="abc",
        data_version="d41d8cd98f00b204e9800998ecf8427e",
        git_commit="deadbeef",
    )
    assert tags["tau"] == 0.6 and tags["accuracy"] == 0.79 and tags["bytes_moved_rel_llm"] == 0.35
    assert tags["slm"] == "models/slm" and tags["iteration"] == 2 and tags["eval_examples_hash"] == "h"
    assert SelectionRule.model_validate_json(tags["rule"]) == rule
    rec = promotion_record(plan, "7", sweep_rows)
    assert rec == {
        "selected_on": "dev",
        "reported_on": "test",
        "dev_accuracy": 0.79,
        "dev_bytes_moved_rel_llm": 0.35,
        "target_llm_fraction": None,
        "accuracy_ci": None,
        "bytes_ci": None,
        "promoted": 1,
        "reason": plan.decision.reason,
        "version": "7",
        "previous": None,
        "tau": 0.6,
        "accuracy": 0.79,
        "bytes_moved_rel_llm": 0.35,
        "llm_accuracy": 0.80,
    }
    assert json.loads(json.dumps(rec)) == rec  # the record is plain JSON
    none = promotion_record(plan_promotion(sweep_rows, sweep_rows, NONE_MEETS), None, sweep_rows)
    assert none["promoted"] == 0 and none["tau"] is None and none["version"] is None


# ------------------------------------------------------------------------------- gates that keep a worse router out


def _measured(method, correct, qbytes, llm_q=10.0, h="same"):
    """A row with per-question data: ``correct`` (bools) and bytes per question, LLM-only costing ``llm_q`` each."""
    n = len(correct)
    row = SweepRow(
        method,
        0.5,
        sum(correct) / n,
        0.1,
        1,
        float(sum(qbytes)),
        float(sum(qbytes)) / (llm_q * n),
        1e-3,
        llm_accuracy=1.0,
        examples_hash=h,
        n_examples=n,
    )
    row.correct, row.question_bytes = list(correct), list(qbytes)
    return row


def test_too_few_questions_or_no_cheaper_than_llm_is_never_promoted():
    from citer.evaluation.promotion import Guard

    rule = SelectionRule(accuracy_ratio=0.9)
    small = R("citer", 0.5, 0.95, 0.2, llm_acc=1.0, n=50)
    d = decide_promotion(small, None, rule, guard=Guard(min_examples=200))
    assert not d.promoted and "50 questions, fewer than registry.min_eval_examples=200" in d.reason
    # The probe: the champion one question under the bar, the candidate on it at 1.089x LLM-only bytes.
    costly = R("citer", 0.5, 0.98, 1.089, llm_acc=1.0, n=300)
    champ = R("champion", 0.5, 0.977, 0.30, llm_acc=1.0, n=300)
    d = decide_promotion(costly, champ, SelectionRule(accuracy_ratio=0.98), previous="1")
    assert not d.promoted and "not routing is cheaper" in d.reason
    # A bytes interval reaching 1 is not "cheaper" either.
    near = R("citer", 0.5, 0.99, 0.97, llm_acc=1.0, n=300)
    near.bytes_ci = (0.93, 1.01)
    assert not decide_promotion(near, None, rule).promoted
    near.bytes_ci = (0.93, 0.99)
    assert decide_promotion(near, None, rule).promoted


def test_a_win_within_chance_keeps_the_champion():
    rule = SelectionRule(accuracy_ratio=0.98)
    n = 300
    # The champion misses the 98% bar by one question; the candidate meets it with one more correct: not significant.
    champ = _measured("champion", [True] * 293 + [False] * 7, [3.0] * n)
    cand = _measured("citer", [True] * 294 + [False] * 6, [3.0] * n)
    assert objective(champ, rule)[0] == 0.0 and objective(cand, rule)[0] == 1.0
    d = decide_promotion(cand, champ, rule, previous="1")
    assert not d.promoted and "not significant at 95%" in d.reason and "misses the rule" in d.reason
    # Both meet the bar; the candidate is cheaper on 151 questions and dearer on 149: a saving within chance, kept.
    champ = _measured("champion", [True] * n, [3.0] * n)
    cand = _measured("citer", [True] * n, [2.0] * 151 + [4.0] * 149)
    d = decide_promotion(cand, champ, rule, previous="1")
    assert not d.promoted and "not significant" in d.reason
    # A saving on every question is beyond chance: promoted, the difference and its interval stated.
    cand = _measured("citer", [True] * n, [2.5] * 150 + [2.0] * 150)
    d = decide_promotion(cand, champ, rule, previous="1")
    assert d.promoted and "candidate - champion bytes (x LLM-only) -0.0750 [" in d.reason
