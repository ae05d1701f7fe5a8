"""The promotion rule, as pure functions: choose τ, compare candidate and champion, build the registry record.

Rows in, decisions and records out; the MLflow side (:mod:`citer.tracking.registry`) only carries them out. A
candidate takes the alias only when it passes every gate (:func:`decide_promotion`): enough test questions, the rule
met on test (or missed by less than chance), fewer bytes than LLM-only (by its 95% interval where it has one), and a
significant win over the champion re-evaluated on the same questions in the same sweep. Anything else keeps the
alias where it is, and the reason says which gate held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from citer.config import SelectionRule
from citer.decoding.verify import Verification
from citer.evaluation.intervals import interval, resample_indices
from citer.evaluation.sweep_rows import SweepError, SweepRow, llm_reference, rows_of


@dataclass(frozen=True)
class Decision:
    promoted: bool
    reason: str
    previous: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def objective(
    row: SweepRow, rule: SelectionRule, llm_accuracy: float | None = None
) -> tuple[float, float, float]:
    """A lexicographic score, larger is better: (meets the rule's constraint, primary, secondary).

    - ``min_bytes_at_accuracy``: feasible when accuracy >= ratio x LLM-only accuracy; then fewer bytes, then more
      accuracy. Infeasible rows rank by accuracy, then bytes (the closest to feasible first).
    - ``max_accuracy_under_bytes``: feasible when bytes_moved_rel_llm <= budget; then more accuracy, then fewer
      bytes. Infeasible rows rank by bytes, then accuracy.
    ``llm_accuracy`` defaults to the row's own ``llm_accuracy`` (set by the sweep).
    """
    acc, rel = float(row.accuracy), float(row.bytes_moved_rel_llm)
    if rule.kind == "min_bytes_at_accuracy":
        ref = row.llm_accuracy if llm_accuracy is None else llm_accuracy
        if ref is None:
            raise SweepError(f"row {row.method}@{row.tau}: field llm_accuracy is unset; pass llm_accuracy")
        # A tiny slack keeps 0.98 x 0.5 == 0.49 feasible despite binary floating point.
        if acc >= rule.accuracy_ratio * float(ref) - 1e-12:
            return (1.0, -rel, acc)
        return (0.0, acc, -rel)
    if rule.kind == "max_accuracy_under_bytes":
        if rel <= rule.bytes_budget_rel_llm + 1e-12:
            return (1.0, acc, -rel)
        return (0.0, -rel, acc)
    raise SweepError(f"selection rule: field kind={rule.kind!r} unknown")


def best_row(
    rows: Sequence[SweepRow], rule: SelectionRule, method: str, feasible_only: bool = True
) -> SweepRow | None:
    """The ``method`` row with the largest :func:`objective` (ties: the smaller τ); with ``feasible_only``, None when
    no row meets the rule's constraint. Rows of one split, with its LLM-only row."""
    llm_acc = llm_reference(rows).accuracy if rule.kind == "min_bytes_at_accuracy" else None
    cands = [(objective(r, rule, llm_acc), r) for r in rows_of(rows, method)]
    if feasible_only:
        cands = [(o, r) for o, r in cands if o[0] == 1.0]
    if not cands:
        return None
    return max(cands, key=lambda x: (x[0], -(x[1].tau if x[1].tau is not None else math.inf)))[1]


# The methods whose dev-chosen point may become the registered version: CITER's router-input variants (the inputs
# are a choice made on dev) and the verified decoder on top of the dev-chosen router.
CANDIDATES = ("citer", "citer_emb", "citer_logits", "citer_emb_logits", "citer_verify")
VERIFY_KEYS = ("verify_rho", "verify_window", "verify_final")


def point_key(row: SweepRow) -> tuple[Any, ...]:
    """What identifies a row's operating point within its split: method, τ and any verification setting."""
    return (row.method, row.tau, *(row.extra.get(k) for k in VERIFY_KEYS))


def choose_candidate(
    rows: Sequence[SweepRow], rule: SelectionRule, methods: Sequence[str] = CANDIDATES
) -> SweepRow | None:
    """The dev row, among every point of ``methods``, that best meets ``rule``; None when none meets it. Ties go to
    the earlier method in ``methods`` (the simpler decoder), then the smaller τ."""
    best = [(m, best_row(rows, rule, m, feasible_only=True)) for m in methods]
    found = [(i, r) for i, (_, r) in enumerate(best) if r is not None]
    if not found:
        return None
    llm_acc = llm_reference(rows).accuracy if rule.kind == "min_bytes_at_accuracy" else None
    return max(found, key=lambda x: (objective(x[1], rule, llm_acc), -x[0]))[1]


def choose_tau(rows: Sequence[SweepRow], rule: SelectionRule, method: str = "citer") -> SweepRow | None:
    """The ``method`` row that best meets ``rule`` (see :func:`objective`); None when no row meets the constraint.

    Ties (same objective) go to the smaller τ, so the choice does not depend on row order.
    """
    return best_row(rows, rule, method, feasible_only=True)


@dataclass(frozen=True)
class Guard:
    """The gates a candidate must pass besides the rule (``registry.min_eval_examples``; the bootstrap of the
    comparison with the champion: resamples, seed, level)."""

    min_examples: int = 1
    resamples: int = 1000
    seed: int = 0
    level: float = 0.95


def paired_difference(
    a: SweepRow, b: SweepRow, what: str, guard: Guard
) -> tuple[float, tuple[float, float] | None]:
    """``a - b`` in accuracy or in bytes relative to LLM-only (``what``: ``accuracy`` | ``bytes``) on the same
    questions, and its paired-bootstrap interval (None without per-question data)."""
    if what == "accuracy":
        diff = float(a.accuracy) - float(b.accuracy)
        va, vb = a.correct, b.correct
    else:
        diff = float(a.bytes_moved_rel_llm) - float(b.bytes_moved_rel_llm)
        va, vb = a.question_bytes, b.question_bytes
    n = len(va)
    if n == 0 or len(vb) != n or a.examples_hash != b.examples_hash:
        return diff, None
    x, y = np.asarray(va, dtype=np.float64), np.asarray(vb, dtype=np.float64)
    idx = resample_indices(n, guard.resamples, guard.seed)  # (B, n), the same draws for both rows
    d = (x[idx] - y[idx]).mean(axis=1)  # (B,)
    if what == "bytes":  # per-question bytes -> bytes relative to LLM-only (the full-sample scale)
        llm_mean = float(a.bytes_moved) / max(float(a.bytes_moved_rel_llm), 1e-300) / n
        d = d / llm_mean
    return diff, interval(d, guard.level)


def misses_rule_on_test(
    candidate: SweepRow, llm: SweepRow | None, rule: SelectionRule, guard: Guard
) -> tuple[bool, str]:
    """Whether a candidate that misses the rule's constraint on test (its point was chosen on dev, where it met it)
    misses it beyond chance, the gate of :func:`decide_promotion`; and the figures that say so.

    On a few hundred test questions the point estimate alone refuses for noise: 200 questions with the LLM at
    96.5% put a 99% bar at 191 right answers, and a candidate with 190 was refused though one question is well
    inside the sampling error. So the miss must be significant: ``min_bytes_at_accuracy``, the paired-bootstrap
    interval of ``accuracy - ratio x LLM-only accuracy`` over the same questions lies below zero;
    ``max_accuracy_under_bytes``, the lower end of the candidate's bytes interval exceeds the budget. Without
    per-question data the point estimate decides, as before.
    """
    if rule.kind == "min_bytes_at_accuracy":
        same = llm is not None and llm.examples_hash == candidate.examples_hash
        if not (same and candidate.correct and len(candidate.correct) == len(llm.correct)):
            return True, ""
        x = np.asarray(candidate.correct, dtype=np.float64) - rule.accuracy_ratio * np.asarray(
            llm.correct, dtype=np.float64
        )
        idx = resample_indices(len(x), guard.resamples, guard.seed)
        ci = interval(x[idx].mean(axis=1), guard.level)
        text = f"; accuracy - {rule.accuracy_ratio:g} x LLM-only {float(x.mean()):+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"
        if ci[1] < 0.0:
            return True, text + f", below the bar at {guard.level:.0%}"
        return False, text + f", within chance at {guard.level:.0%}"
    lo = candidate.bytes_ci[0] if candidate.bytes_ci else None
    if lo is None:
        return True, ""
    text = f"; bytes interval from {lo:.4f} against the budget {rule.bytes_budget_rel_llm:g}"
    if lo > rule.bytes_budget_rel_llm + 1e-12:
        return True, text + f", over it at {guard.level:.0%}"
    return False, text + f", within chance at {guard.level:.0%}"


def _describe(row: SweepRow) -> str:
    return (
        f"accuracy {row.accuracy:.4f}, bytes {row.bytes_moved_rel_llm:.4f} x LLM-only (tau={row.tau}, "
        f"{row.n_examples} questions)"
    )


def _fmt_ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" [{ci[0]:+.4f}, {ci[1]:+.4f}]"


def _beats_llm(candidate: SweepRow) -> tuple[bool, str]:
    """Fewer bytes than LLM-only, by the upper end of the row's bytes interval when it has one."""
    hi = candidate.bytes_ci[1] if candidate.bytes_ci else candidate.bytes_moved_rel_llm
    if hi < 1.0:
        return True, ""
    ci = f" (95% interval up to {hi:.4f})" if candidate.bytes_ci else ""
    return (
        False,
        f"candidate moves no fewer bytes than LLM-only ({_describe(candidate)}{ci}): not routing is cheaper",
    )


def _significant_win(
    candidate: SweepRow, champion: SweepRow, rule: SelectionRule, guard: Guard
) -> tuple[bool, str]:
    """Does the candidate beat the champion on the rule's primary measure, beyond chance (paired bootstrap)?

    Both meet the rule: fewer bytes (``min_bytes_at_accuracy``) or more accuracy (``max_accuracy_under_bytes``), the
    interval of the difference excluding 0. The champion misses the rule where the candidate meets it: the side the
    champion misses on must differ significantly (a champion one question under the bar is not beaten by chance).
    Without per-question data the point difference decides.
    """
    champ_ok = objective(champion, rule, candidate.llm_accuracy)[0] == 1.0
    if rule.kind == "min_bytes_at_accuracy":
        what, better = ("bytes", -1.0) if champ_ok else ("accuracy", 1.0)
    else:
        what, better = ("accuracy", 1.0) if champ_ok else ("bytes", -1.0)
    diff, ci = paired_difference(candidate, champion, what, guard)
    wins = better * diff > 1e-12 and (ci is None or min(better * ci[0], better * ci[1]) > 0.0)
    measure = "bytes (x LLM-only)" if what == "bytes" else "accuracy"
    text = f"candidate - champion {measure} {diff:+.4f}{_fmt_ci(ci)}"
    if not champ_ok:
        text += " (the champion misses the rule on this sample)"
    if not wins and better * diff > 1e-12:
        text += f", not significant at {guard.level:.0%}"
    return wins, text


def decide_promotion(
    candidate: SweepRow | None,
    champion: SweepRow | None,
    rule: SelectionRule,
    previous: str | None = None,
    guard: Guard | None = None,
    llm: SweepRow | None = None,
) -> Decision:
    """Whether the candidate router takes the alias from the champion; every refusal names the gate that held.

    Gates, in order: the candidate was evaluated on at least ``guard.min_examples`` questions; it meets the rule on
    them, or misses it by less than chance (:func:`misses_rule_on_test`; ``llm``: the LLM-only row of the same
    questions); it moves fewer bytes than LLM-only (by its bytes interval's upper end when it has one); and, with a champion
    (re-evaluated on the same examples in the same sweep, which is checked), it wins on the rule's primary measure by
    :func:`_significant_win`. A tie or a win within chance keeps the champion. ``previous`` (the champion's version)
    is carried into the decision for the log.
    """
    guard = guard or Guard()
    if candidate is None:
        return Decision(
            False, f"no tau of the candidate meets the rule {rule.kind}; alias unchanged", previous
        )
    cand_obj = objective(candidate, rule)
    details: dict[str, Any] = {"candidate": candidate.to_json(), "candidate_objective": list(cand_obj)}
    if candidate.n_examples < guard.min_examples:
        reason = (
            f"candidate evaluated on {candidate.n_examples} questions, fewer than registry.min_eval_examples="
            f"{guard.min_examples}; alias unchanged"
        )
        return Decision(False, reason, previous, details)
    if cand_obj[0] != 1.0:
        missed, how = misses_rule_on_test(candidate, llm, rule, guard)
        if how:
            details["rule_on_test"] = how
        if missed:
            reason = (
                f"candidate does not meet the rule {rule.kind} ({_describe(candidate)}{how}); alias unchanged"
            )
            return Decision(False, reason, previous, details)
    cheaper, why = _beats_llm(candidate)
    if not cheaper:
        return Decision(False, f"{why}; alias unchanged", previous, details)
    if champion is None:
        within = details.get("rule_on_test", "")  # met the rule on test, or missed it by less than chance
        reason = f"no champion yet; candidate promoted ({_describe(candidate)}{within})"
        return Decision(True, reason, previous, details)
    if champion.examples_hash != candidate.examples_hash or champion.n_examples != candidate.n_examples:
        raise SweepError(
            "champion and candidate rows come from different examples "
            f"({champion.n_examples} ex, hash {champion.examples_hash!r} vs {candidate.n_examples} ex, hash "
            f"{candidate.examples_hash!r}); re-evaluate the champion in the same sweep"
        )
    champ_obj = objective(champion, rule, candidate.llm_accuracy)
    details.update(champion=champion.to_json(), champion_objective=list(champ_obj))
    wins, compared = _significant_win(candidate, champion, rule, guard)
    details["comparison"] = compared
    if cand_obj > champ_obj and wins:
        reason = (
            f"candidate ({_describe(candidate)}) beats champion ({_describe(champion)}) under {rule.kind}: "
            f"{compared}"
        )
        return Decision(True, reason, previous, details)
    word = "ties with" if cand_obj == champ_obj else "does not beat"
    reason = (
        f"candidate ({_describe(candidate)}) {word} champion ({_describe(champion)}) under {rule.kind}: {compared}; "
        "alias kept"
    )
    return Decision(False, reason, previous, details)


@dataclass(frozen=True)
class PromotionPlan:
    """What the sweep decided: the candidate's dev-chosen point as measured on test (None when no τ meets the rule on
    dev), the same point's dev row, and the decision."""

    best: SweepRow | None
    decision: Decision
    best_dev: SweepRow | None = None


def test_row_of(test_rows: Sequence[SweepRow], dev_row: SweepRow | None) -> SweepRow | None:
    """The test row of the same operating point as ``dev_row`` (:func:`point_key`)."""
    if dev_row is None:
        return None
    return next((r for r in test_rows if point_key(r) == point_key(dev_row)), None)


def plan_promotion(
    dev_rows: Sequence[SweepRow],
    test_rows: Sequence[SweepRow],
    rule: SelectionRule,
    champion_version: str | None = None,
    champion_note: str = "",
    guard: Guard | None = None,
    champion_stale: bool = False,
) -> PromotionPlan:
    """τ is chosen on dev (the candidate's, and the re-evaluated champion's by the sweep); both are compared on the
    same test examples (:func:`decide_promotion`).

    ``champion_version`` names the version holding the alias (None: no champion yet). A champion that exists but has
    no row here (another SLM, another hidden size: ``champion_note`` says which) is kept: it cannot be compared.
    A ``champion_stale`` one (trained for other weights under the pair's names: no loader decodes with it) is judged
    as no champion: the candidate takes the alias if it passes every other gate.
    """
    best_dev = choose_candidate(dev_rows, rule)
    best = test_row_of(test_rows, best_dev)
    champion_row = next((r for r in test_rows if r.method == "champion"), None)
    if champion_stale and champion_version is not None and best_dev is not None:
        llm = next((r for r in test_rows if r.method == "llm"), None)
        d = decide_promotion(best, None, rule, previous=champion_version, guard=guard, llm=llm)
        why = f"v{champion_version} is stale ({champion_note})"
        reason = d.reason.replace("no champion yet", why) if d.promoted else f"{d.reason} ({why})"
        decision = replace(d, reason=reason)
    elif champion_version is not None and champion_row is None:
        why = f": {champion_note}" if champion_note else ""
        decision = Decision(
            False, f"kept v{champion_version}{why}; it cannot be compared here", champion_version
        )
    elif best_dev is None:
        decision = Decision(
            False,
            f"no tau of the candidate meets the rule {rule.kind} on dev; alias unchanged",
            champion_version,
        )
    else:
        llm = next((r for r in test_rows if r.method == "llm"), None)
        decision = decide_promotion(best, champion_row, rule, previous=champion_version, guard=guard, llm=llm)
    return PromotionPlan(best, decision, best_dev)


def version_tags(
    best: SweepRow,
    rule: SelectionRule,
    *,
    slm: str,
    llm: str,
    hidden_size: int,
    iteration: int,
    labels_hash: str,
    data_version: str,
    git_commit: str,
    files: dict[str, str] | None = None,
    runner: str = "torch",
) -> dict[str, Any]:
    """The tags a registered router version carries: what rebuilds its decoder, where it came from, its metrics;
    ``runner`` (:meth:`~citer.config.serving.EngineParams.runner_name`): what decoded the passes its τ was chosen on.

    ``slm``, ``llm`` and the ``files`` refs (router directory, data files) are recorded as the project records them:
    relative to its root, or hub ids, so a copied project's registry names the copy's own files.
    """
    return (
        dict(files or {})
        | {
            "slm": slm,
            "llm": llm,
            "tau": best.tau,
            "hidden_size": hidden_size,
            "iteration": iteration,
            "labels_hash": labels_hash,
            "data_version": data_version,
            "eval_examples_hash": best.examples_hash,
            "git_commit": git_commit,
            "rule": rule.model_dump_json(),
            "accuracy": best.accuracy,
            "bytes_moved_rel_llm": best.bytes_moved_rel_llm,
            "llm_token_fraction": best.llm_token_fraction,
            "sec_per_token": best.sec_per_token,
            "selected_on": "dev",
            "target_llm_fraction": best.extra.get("target_llm_fraction"),
            "method": best.method,
            "runner": runner,
        }
        | (Verification.from_tags(best.extra).tags() if "verify_rho" in best.extra else {})
    )


def promotion_record(plan: PromotionPlan, version: str | None, rows: Sequence[SweepRow]) -> dict[str, Any]:
    """``reports/promotion.json``: the decision, the version registered by this sweep and the chosen point (τ chosen
    on dev; accuracy and bytes measured on test, with the dev figures beside them)."""
    best = plan.best
    dev = plan.best_dev
    return {
        "selected_on": "dev",
        "reported_on": "test",
        "dev_accuracy": dev.accuracy if dev else None,
        "dev_bytes_moved_rel_llm": dev.bytes_moved_rel_llm if dev else None,
        "target_llm_fraction": dev.extra.get("target_llm_fraction") if dev else None,
        "accuracy_ci": list(best.accuracy_ci) if best and best.accuracy_ci else None,
        "bytes_ci": list(best.bytes_ci) if best and best.bytes_ci else None,
        "promoted": int(plan.decision.promoted),
        "reason": plan.decision.reason,
        "version": version,
        "previous": plan.decision.previous,
        "tau": best.tau if best else None,
        "method": best.method if best else None,
        **({k: best.extra[k] for k in VERIFY_KEYS if k in best.extra} if best else {}),
        "accuracy": best.accuracy if best else None,
        "bytes_moved_rel_llm": best.bytes_moved_rel_llm if best else None,
        "llm_accuracy": next((r.accuracy for r in rows if r.method == "llm"), None),
    }
