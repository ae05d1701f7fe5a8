"""Whether a candidate misses the promotion rule on test beyond chance (the gate of :mod:`citer.evaluation.promotion`).

Its point was chosen on dev, where it met the rule; on a few hundred test questions a miss by a question or two is
sampling error, not evidence, so only a significant miss refuses it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from citer.config import SelectionRule
from citer.evaluation.intervals import interval, resample_indices
from citer.evaluation.sweep_rows import SweepRow


def misses_rule_on_test(
    candidate: SweepRow, llm: SweepRow | None, rule: SelectionRule, guard: Any
) -> tuple[bool, str]:
    """Whether a candidate that misses the rule's constraint on test (its point was chosen on dev, where it met it)
    misses it beyond chance; and the figures that say so.

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
