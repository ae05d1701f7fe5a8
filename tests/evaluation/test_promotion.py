"""The promotion rule on hand-made rows: choosing τ, candidate against champion, the registry record."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import sweep_row as R

from citer.config import SelectionRule
from citer.evaluation.promotion import (
    best_row,
    choose_tau,
    decide_promotion,
    objective,
    plan_promotion,
    promotion_record,
    version_tags,
)
from citer.evaluation.sweep_rows import SweepError, SweepRow

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
        "method": "citer",
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


# ---------------------------------------------------------- the exact decision, reason and record (scripts/mutation.py)


def test_objective_takes_the_given_reference_and_ranks_infeasible_rows_toward_the_constraint():
    rule = SelectionRule(accuracy_ratio=0.9)
    row = R("citer", 0.5, 0.6, 0.3, llm_acc=1.0)  # misses 0.9 x its own LLM-only accuracy
    assert objective(row, rule) == (0.0, 0.6, -0.3)
    assert objective(row, rule, llm_accuracy=0.6) == (1.0, -0.3, 0.6)  # the split's LLM-only row decides
    budget = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert objective(R("citer", 0.5, 0.7, 0.3), budget) == (1.0, 0.7, -0.3)  # on the budget is within it
    assert objective(R("citer", 0.5, 0.7, 0.4), budget) == (0.0, -0.4, 0.7)
    unknown = SelectionRule.model_construct(kind="fastest", accuracy_ratio=0.9, bytes_budget_rel_llm=0.3)
    with pytest.raises(SweepError, match="kind='fastest' unknown"):
        objective(row, unknown)


def test_best_row_judges_against_the_split_llm_row_and_ranks_the_infeasible_on_request(sweep_rows):
    rule = SelectionRule(accuracy_ratio=0.9)
    # The rows carry another LLM-only accuracy (1.0); the split's own LLM-only row (0.6) is the reference.
    rows = [
        R("llm", None, 0.6, 1.0, llm_acc=1.0),
        R("citer", 0.3, 0.55, 0.2, llm_acc=1.0),
        R("citer", 0.5, 0.58, 0.4, llm_acc=1.0),
    ]
    assert best_row(rows, rule, "citer").tau == 0.3  # both meet 0.54: the fewer bytes
    strict = SelectionRule(accuracy_ratio=1.0)
    assert best_row(rows, strict, "citer") is None  # feasible only, by default
    assert best_row(rows, strict, "citer", feasible_only=False).tau == 0.5  # the closest to the bar
    # A bytes budget needs no LLM-only row, and rows without a τ (single-model methods) rank too.
    budget = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.3)
    assert best_row(rows[1:], budget, "citer").tau == 0.3
    assert best_row(
        sweep_rows, SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.1), "slm"
    )
    assert best_row(sweep_rows, rule, "slm", feasible_only=False).method == "slm"


def test_paired_difference_pairs_the_draws_and_scales_bytes_to_llm_only():
    from citer.evaluation.intervals import interval, resample_indices
    from citer.evaluation.promotion import Guard, paired_difference

    n = 20
    champ = _measured("champion", [True] * 10 + [False] * 10, [3.0] * n)
    cand = _measured("citer", [True] * 15 + [False] * 5, [2.0] * n)
    # Every question saves 1 of LLM-only's 10 bytes: every resample says -0.1 x LLM-only.
    diff, ci = paired_difference(cand, champ, "bytes", Guard(resamples=200, seed=3))
    assert diff == pytest.approx(-0.1) and ci == pytest.approx((-0.1, -0.1))
    diff, ci = paired_difference(cand, champ, "accuracy", Guard(resamples=200, seed=3))
    assert diff == pytest.approx(0.25) and ci[0] <= 0.25 <= ci[1]
    # Uneven savings: the interval is the seeded paired bootstrap's, at the guard's level.
    cand = _measured("citer", [True] * n, [2.0 + (0.37 * i) % 1.3 for i in range(n)])
    guard = Guard(resamples=300, seed=7, level=0.5)
    diff, ci = paired_difference(cand, champ, "bytes", guard)
    idx = resample_indices(n, 300, 7)
    cand_q = np.asarray(cand.question_bytes)
    saved = cand_q[idx].mean(axis=1) - 3.0
    assert diff == pytest.approx((cand_q.sum() - 60.0) / 200.0)
    assert ci == pytest.approx(interval(saved / 10.0, 0.5))
    # Other questions (another hash), or no per-question data: the point difference alone.
    other = _measured("champion", [True] * n, [3.0] * n, h="other")
    assert paired_difference(cand, other, "bytes", guard)[1] is None
    assert paired_difference(R("citer", 0.5, 0.8, 0.3), R("champion", 0.5, 0.7, 0.3), "accuracy", guard) == (
        pytest.approx(0.1),
        None,
    )


def test_not_cheaper_than_llm_says_by_how_much():
    rule = SelectionRule(accuracy_ratio=0.9)
    at_llm = R("citer", 0.5, 0.99, 1.0, llm_acc=1.0)  # exactly LLM-only's bytes is not fewer
    d = decide_promotion(at_llm, None, rule, previous="3")
    assert d.promoted is False and d.previous == "3"
    assert d.reason == (
        "candidate moves no fewer bytes than LLM-only (accuracy 0.9900, bytes 1.0000 x LLM-only (tau=0.5, "
        "100 questions)): not routing is cheaper; alias unchanged"
    )
    near = R("citer", 0.5, 0.99, 0.97, llm_acc=1.0)
    near.bytes_ci = (0.93, 1.01)
    assert decide_promotion(near, None, rule).reason == (
        "candidate moves no fewer bytes than LLM-only (accuracy 0.9900, bytes 0.9700 x LLM-only (tau=0.5, "
        "100 questions) (95% interval up to 1.0100)): not routing is cheaper; alias unchanged"
    )


def test_every_refusal_carries_the_previous_version_and_the_candidate():
    from citer.evaluation.promotion import Decision, Guard

    rule = SelectionRule(accuracy_ratio=0.9)
    guard = Guard(min_examples=100)
    assert decide_promotion(None, None, rule, previous="3") == Decision(
        False, "no tau of the candidate meets the rule min_bytes_at_accuracy; alias unchanged", "3"
    )
    refused = [
        R("citer", 0.5, 0.78, 0.30, n=99),  # one question short
        R("citer", 0.5, 0.5, 0.1),  # misses the rule
        R("citer", 0.5, 0.9, 1.2),  # dearer than LLM-only
    ]
    for row in refused:
        d = decide_promotion(row, None, rule, previous="3", guard=guard)
        assert d.promoted is False and d.previous == "3", row
        assert d.details == {"candidate": row.to_json(), "candidate_objective": list(objective(row, rule))}
    assert (
        "99 questions, fewer than registry.min_eval_examples=100"
        in decide_promotion(refused[0], None, rule, guard=guard).reason
    )
    enough = R("citer", 0.5, 0.78, 0.30, n=100)
    d = decide_promotion(enough, None, rule, previous="3", guard=guard)
    assert d.promoted is True and d.previous == "3"
    assert d.reason == (
        "no champion yet; candidate promoted (accuracy 0.7800, bytes 0.3000 x LLM-only (tau=0.5, 100 questions))"
    )
    assert d.details == {"candidate": enough.to_json(), "candidate_objective": [1.0, -0.3, 0.78]}


def test_against_a_champion_the_reason_and_details_say_what_was_compared():
    rule = SelectionRule(accuracy_ratio=0.9)  # needs accuracy >= 0.72
    cand = R("citer", 0.5, 0.78, 0.30)
    desc = "accuracy 0.7800, bytes 0.3000 x LLM-only (tau=0.5, 100 questions)"
    for champ, promoted, word, diff in [
        (R("champion", 0.6, 0.79, 0.40), True, "beats", "-0.1000"),
        (R("champion", 0.4, 0.76, 0.20), False, "does not beat", "+0.1000"),
        (R("champion", 0.5, 0.78, 0.30), False, "ties with", "+0.0000"),
    ]:
        d = decide_promotion(cand, champ, rule, previous="3")
        compared = f"candidate - champion bytes (x LLM-only) {diff}"
        assert d.promoted is promoted and d.previous == "3"
        assert d.details == {
            "candidate": cand.to_json(),
            "candidate_objective": [1.0, -0.3, 0.78],
            "champion": champ.to_json(),
            "champion_objective": list(objective(champ, rule)),
            "comparison": compared,
        }
        c = f"accuracy {champ.accuracy:.4f}, bytes {champ.bytes_moved_rel_llm:.4f} x LLM-only (tau={champ.tau}, 100 questions)"
        head = f"candidate ({desc}) {word} champion ({c}) under min_bytes_at_accuracy: {compared}"
        assert d.reason == (head if promoted else head + "; alias kept")
    # The champion is judged against the candidate's LLM-only accuracy, whatever its own row carries.
    champ = R("champion", 0.4, 0.70, 0.20, llm_acc=0.7)  # meets 0.9 x 0.7, misses 0.9 x 0.8
    d = decide_promotion(cand, champ, rule)
    assert d.promoted and d.details["champion_objective"] == [0.0, 0.70, -0.20]
    assert d.details["comparison"] == (
        "candidate - champion accuracy +0.0800 (the champion misses the rule on this sample)"
    )
    with pytest.raises(
        SweepError,
        match=r"^champion and candidate rows come from different examples \(100 ex, hash 'b' vs 100 ex",
    ):
        decide_promotion(R("citer", 0.5, 0.78, 0.3, h="a"), R("champion", 0.5, 0.7, 0.3, h="b"), rule)


def test_under_a_bytes_budget_the_champion_is_beaten_on_accuracy_or_on_the_budget_it_misses():
    rule = SelectionRule(kind="max_accuracy_under_bytes", bytes_budget_rel_llm=0.5)
    cand = R("citer", 0.5, 0.78, 0.40)
    d = decide_promotion(cand, R("champion", 0.4, 0.70, 0.30), rule, previous="2")
    assert d.promoted and d.details["comparison"] == "candidate - champion accuracy +0.0800"
    d = decide_promotion(cand, R("champion", 0.4, 0.80, 0.30), rule, previous="2")
    assert d.promoted is False and d.details["comparison"] == "candidate - champion accuracy -0.0200"
    # A champion over the budget is beaten on bytes by a candidate under it, whatever its accuracy.
    d = decide_promotion(cand, R("champion", 0.9, 0.85, 0.60), rule, previous="2")
    assert d.promoted and d.details["comparison"] == (
        "candidate - champion bytes (x LLM-only) -0.2000 (the champion misses the rule on this sample)"
    )


def test_a_win_within_chance_states_the_interval():
    import re

    from citer.evaluation.promotion import Guard, paired_difference

    rule = SelectionRule(accuracy_ratio=0.98)
    n = 300
    champ = _measured("champion", [True] * 293 + [False] * 7, [3.0] * n)
    cand = _measured("citer", [True] * 294 + [False] * 6, [3.0] * n)
    diff, ci = paired_difference(cand, champ, "accuracy", Guard())
    assert ci[0] < ci[1]  # so the two ends print differently
    d = decide_promotion(cand, champ, rule)
    assert d.details["comparison"] == (
        f"candidate - champion accuracy +0.0033 [{ci[0]:+.4f}, {ci[1]:+.4f}] (the champion misses the rule on this "
        "sample), not significant at 95%"
    )
    # A win beyond chance says so without the caveat.
    cand = _measured("citer", [True] * n, [2.5] * 150 + [2.0] * 150)
    d = decide_promotion(cand, _measured("champion", [True] * n, [3.0] * n), rule)
    assert d.promoted and re.fullmatch(
        r"candidate - champion bytes \(x LLM-only\) -0\.0750 \[-0\.\d{4}, -0\.\d{4}\]",
        d.details["comparison"],
    )


def test_plan_carries_the_note_the_guard_and_the_previous_version(sweep_rows):
    from citer.evaluation.promotion import Guard, test_row_of

    rule = SelectionRule(accuracy_ratio=0.98)
    plan = plan_promotion(sweep_rows, sweep_rows, rule, champion_version="4")
    assert plan.decision.promoted is False
    assert plan.decision.reason == "kept v4; it cannot be compared here"
    with_champ = sweep_rows + [R("champion", 0.7, 0.80, 0.30)]
    plan = plan_promotion(with_champ, with_champ, NONE_MEETS, champion_version="4")
    assert plan.decision.promoted is False and plan.decision.previous == "4"
    assert plan.decision.reason == (
        "no tau of the candidate meets the rule max_accuracy_under_bytes on dev; alias unchanged"
    )
    plan = plan_promotion(sweep_rows, sweep_rows, rule, guard=Guard(min_examples=101))
    assert not plan.decision.promoted and "fewer than registry.min_eval_examples=101" in plan.decision.reason
    # The dev-chosen τ missing from the test rows: no test row.
    assert test_row_of([R("citer", 0.4, 0.7, 0.2)], R("citer", 0.6, 0.7, 0.2)) is None


def test_version_tags_and_record_carry_every_field(sweep_rows):
    from citer.evaluation.promotion import Decision, PromotionPlan

    rule = SelectionRule(accuracy_ratio=0.98)
    best = R("citer", 0.6, 0.79, 0.35)
    best.extra["target_llm_fraction"] = 0.25
    best.accuracy_ci, best.bytes_ci = (0.7, 0.85), (0.3, 0.4)
    common = dict(
        slm="models/slm",
        llm="models/llm",
        hidden_size=32,
        iteration=2,
        labels_hash="abc",
        data_version="d41d",
        git_commit="deadbeef",
    )
    tags = version_tags(best, rule, **common, files={"router_dir": "models/router"})
    assert tags == {
        "router_dir": "models/router",
        **common,
        "tau": 0.6,
        "eval_examples_hash": "h",
        "rule": rule.model_dump_json(),
        "accuracy": 0.79,
        "bytes_moved_rel_llm": 0.35,
        "llm_token_fraction": 0.35,
        "sec_per_token": 1e-3,
        "selected_on": "dev",
        "target_llm_fraction": 0.25,
        "method": "citer",
        "runner": "torch",  # what decoded the passes τ was chosen on
    }  # the dev score quantiles are a file logged with the version (citer.tracking.registry), not a tag
    assert version_tags(best, rule, **common, runner="llama_cpp:Q8_0")["runner"] == "llama_cpp:Q8_0"
    dev = R("citer", 0.6, 0.78, 0.34)
    dev.extra["target_llm_fraction"] = 0.2
    plan = PromotionPlan(best, Decision(False, "kept", "3"), dev)
    rec = promotion_record(plan, None, [r for r in sweep_rows if r.method != "llm"])
    assert rec["target_llm_fraction"] == 0.2 and rec["llm_accuracy"] is None
    assert rec["accuracy_ci"] == [0.7, 0.85] and rec["bytes_ci"] == [0.3, 0.4]
    assert rec["promoted"] == 0 and rec["previous"] == "3" and rec["dev_accuracy"] == 0.78


def test_the_candidate_is_the_best_dev_point_of_any_router_variant_or_verified_setting(sweep_rows):
    """The router's inputs and the verification are choices made on dev: the best feasible point among the
    candidate methods wins, and its test row is the one of the same method, τ and verification."""
    from conftest import sweep_row

    from citer.evaluation.promotion import choose_candidate, point_key, test_row_of

    rule = SelectionRule(accuracy_ratio=0.98)
    v1 = sweep_row("citer_verify", 0.6, 0.80, 0.30)
    v1.extra |= {"verify_rho": 2.0, "verify_window": 0, "verify_final": True}
    v2 = sweep_row("citer_verify", 0.6, 0.80, 0.20)  # same τ, another rho: another point
    v2.extra |= {"verify_rho": 1.0, "verify_window": 0, "verify_final": True}
    bad = sweep_row("citer_logits", 0.5, 0.50, 0.05)  # cheapest, but misses the accuracy the rule asks
    dev = [*sweep_rows, v1, v2, bad]
    best = choose_candidate(dev, rule)
    assert best is v2 and point_key(v1) != point_key(v2)
    t1, t2 = sweep_row("citer_verify", 0.6, 0.7, 0.3), sweep_row("citer_verify", 0.6, 0.8, 0.2)
    t1.extra |= dict(v1.extra)
    t2.extra |= dict(v2.extra)
    assert test_row_of([*sweep_rows, t1, t2], best) is t2
    tags = version_tags(t2, rule, slm="s", llm="l", hidden_size=32, iteration=2, labels_hash="",
                        data_version="", git_commit="")  # fmt: skip
    assert (tags["method"], tags["verify_rho"], tags["verify_window"], tags["verify_final"]) == (
        "citer_verify",
        "1.0",
        "0",
        "true",
    )
    assert choose_candidate(dev, rule, methods=("citer",)).method == "citer"  # only the plain router
