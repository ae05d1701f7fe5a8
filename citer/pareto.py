"""Sweep results: the row type, choosing τ, the promotion decision and the paper's claims (files: citer.sweep_report).

Everything here is pure: rows in, numbers and decisions out. ``citer.sweep`` produces the rows by decoding.

Bytes are compared relative to LLM-only decoding on the same examples (``bytes_moved_rel_llm``), so rows from one
sweep are comparable whatever the model sizes. CITER at τ = 0 never calls the LLM (scores are >= 0), so the SLM-only
point is the τ -> 0 end of the CITER curve; :func:`frontier` uses it as that anchor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from citer.config import SelectionRule
from citer.registry import Decision

# The method names of reports/sweep.json, and its row keys (exactly these, in this order).
METHODS = ("citer", "citer_s", "slm", "llm", "random", "confidence", "query", "speculative")
SWEEP_KEYS = (
    "method",
    "tau",
    "accuracy",
    "llm_token_fraction",
    "llm_calls",
    "bytes_moved",
    "bytes_moved_rel_llm",
    "sec_per_token",
)


class SweepError(ValueError):
    """Rows that cannot be compared or chosen from (missing LLM-only row, different examples)."""


@dataclass
class SweepRow:
    """One operating point of one method on the sweep's examples.

    ``bytes_moved`` and ``llm_calls`` are totals over the examples; ``llm_accuracy`` and ``examples_hash`` tie the row
    to the LLM-only reference it was measured against, so a row alone can be judged under a rule.
    """

    method: str
    tau: float | None
    accuracy: float
    llm_token_fraction: float
    llm_calls: int
    bytes_moved: float
    bytes_moved_rel_llm: float
    sec_per_token: float
    gpu_sec_per_token: float | None = None
    n_examples: int = 0
    n_tokens: int = 0
    llm_accuracy: float | None = None
    examples_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The eight keys of reports/sweep.json."""
        d = asdict(self)
        return {k: d[k] for k in SWEEP_KEYS}

    def to_details(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepRow:
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in SWEEP_KEYS if k not in d]
        if missing:
            raise SweepError(f"sweep row: fields {missing} missing")
        return cls(**{k: v for k, v in d.items() if k in known})


# ----------------------------------------------------------------------------------------------------------------
# Choosing τ and promotion


def _of(rows: Iterable[SweepRow], method: str) -> list[SweepRow]:
    return [r for r in rows if r.method == method]


def llm_reference(rows: Sequence[SweepRow]) -> SweepRow:
    """The LLM-only row (the accuracy every ratio refers to)."""
    llm = _of(rows, "llm")
    if not llm:
        raise SweepError(
            "sweep rows: no 'llm' row (LLM-only accuracy is the reference of the selection rule)"
        )
    return llm[0]


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


def choose_tau(rows: Sequence[SweepRow], rule: SelectionRule, method: str = "citer") -> SweepRow | None:
    """The ``method`` row that best meets ``rule`` (see :func:`objective`); None when no row meets the constraint.

    Ties (same objective) go to the smaller τ, so the choice does not depend on row order.
    """
    llm_acc = llm_reference(rows).accuracy if rule.kind == "min_bytes_at_accuracy" else None
    cands = [(objective(r, rule, llm_acc), r) for r in _of(rows, method)]
    feasible = [(o, r) for o, r in cands if o[0] == 1.0]
    if not feasible:
        return None
    best = max(feasible, key=lambda x: (x[0], -(x[1].tau if x[1].tau is not None else math.inf)))
    return best[1]


def _describe(row: SweepRow) -> str:
    return f"accuracy {row.accuracy:.4f}, bytes {row.bytes_moved_rel_llm:.4f} x LLM-only (tau={row.tau})"


def decide_promotion(
    candidate: SweepRow | None, champion: SweepRow | None, rule: SelectionRule, previous: str | None = None
) -> Decision:
    """Whether the candidate router takes the alias from the champion.

    Both rows must come from the same examples (the flow re-evaluates the champion at its own τ in the same sweep).
    The candidate wins only if its :func:`objective` is strictly larger; an equal score keeps the champion.
    ``previous`` (the champion's version) is carried into the decision for the log.
    """
    if candidate is None:
        return Decision(
            False, f"no tau of the candidate meets the rule {rule.kind}; alias unchanged", previous
        )
    cand_obj = objective(candidate, rule)
    details: dict[str, Any] = {"candidate": candidate.to_json(), "candidate_objective": list(cand_obj)}
    if cand_obj[0] != 1.0:
        reason = f"candidate does not meet the rule {rule.kind} ({_describe(candidate)}); alias unchanged"
        return Decision(False, reason, previous, details)
    if champion is None:
        return Decision(
            True, f"no champion yet; candidate promoted ({_describe(candidate)})", previous, details
        )
    if champion.examples_hash != candidate.examples_hash or champion.n_examples != candidate.n_examples:
        raise SweepError(
            "champion and candidate rows come from different examples "
            f"({champion.n_examples} ex, hash {champion.examples_hash!r} vs {candidate.n_examples} ex, hash "
            f"{candidate.examples_hash!r}); re-evaluate the champion in the same sweep"
        )
    champ_obj = objective(champion, rule, candidate.llm_accuracy)
    details.update(champion=champion.to_json(), champion_objective=list(champ_obj))
    if cand_obj > champ_obj:
        reason = (
            f"candidate ({_describe(candidate)}) beats champion ({_describe(champion)}) under {rule.kind}"
        )
        return Decision(True, reason, previous, details)
    word = "ties with" if cand_obj == champ_obj else "does not beat"
    reason = f"candidate ({_describe(candidate)}) {word} champion ({_describe(champion)}) under {rule.kind}; alias kept"
    return Decision(False, reason, previous, details)


# ----------------------------------------------------------------------------------------------------------------
# Frontiers and the paper's claims


def frontier(rows: Sequence[SweepRow], method: str, anchor_slm: bool = True) -> list[tuple[float, float]]:
    """The Pareto frontier (bytes_rel, accuracy) of ``method``, bytes ascending, accuracy strictly ascending.

    For ``citer``/``citer_s`` the SLM-only row is included as the τ = 0 end (``anchor_slm``).
    """
    pts = [(r.bytes_moved_rel_llm, r.accuracy) for r in _of(rows, method)]
    if anchor_slm and method in ("citer", "citer_s"):
        pts += [(r.bytes_moved_rel_llm, r.accuracy) for r in _of(rows, "slm")]
    out: list[tuple[float, float]] = []
    for b, a in sorted(pts, key=lambda p: (p[0], -p[1])):
        if not out or a > out[-1][1]:
            out.append((float(b), float(a)))
    return out


def _best_acc_at(front: Sequence[tuple[float, float]], bytes_rel: float, interpolate: bool) -> float:
    """The frontier's accuracy at ``bytes_rel``: step function, or the segment between two frontier points.

    Interpolation is attainable: answering each question with one of two τ at random (probability λ) costs and
    scores the λ-mix of the two points in expectation.
    """
    best = -math.inf
    for i, (b, a) in enumerate(front):
        if b <= bytes_rel:
            best = max(best, a)
        elif interpolate and i > 0:
            b0, a0 = front[i - 1]
            if b0 <= bytes_rel:
                best = max(best, a0 + (a - a0) * (bytes_rel - b0) / (b - b0))
    return best


def dominance(
    rows: Sequence[SweepRow],
    method: str = "citer",
    baselines: Sequence[str] = ("citer_s", "llm", "random", "confidence", "query", "speculative"),
    interpolate: bool = False,
) -> dict[str, Any]:
    """For every baseline point: is there a ``method`` point with accuracy >= and bytes <= (or, with
    ``interpolate``, does the frontier's segment reach it)? Returns the checks and the violations with their gap."""
    front = frontier(rows, method)
    if not front:
        raise SweepError(f"sweep rows: no {method!r} rows")
    checks = []
    for r in rows:
        if r.method not in baselines:
            continue
        acc_here = _best_acc_at(front, r.bytes_moved_rel_llm, interpolate)
        checks.append(
            {
                "method": r.method,
                "tau": r.tau,
                "accuracy": r.accuracy,
                "bytes_moved_rel_llm": r.bytes_moved_rel_llm,
                "citer_accuracy_at_bytes": None if acc_here == -math.inf else acc_here,
                "dominated": acc_here >= r.accuracy - 1e-12,
            }
        )
    violations = [c for c in checks if not c["dominated"]]
    return {
        "method": method,
        "interpolate": interpolate,
        "dominates_all": not violations,
        "checks": checks,
        "violations": violations,
    }


def bytes_at_accuracy(
    rows: Sequence[SweepRow], method: str, target_acc: float, interpolate: bool = True
) -> float | None:
    """The least bytes_rel at which ``method``'s frontier reaches ``target_acc`` (None when it never does)."""
    front = frontier(rows, method)
    for i, (b, a) in enumerate(front):
        if a >= target_acc - 1e-12:
            if interpolate and i > 0:
                b0, a0 = front[i - 1]
                return b0 + (b - b0) * (target_acc - a0) / (a - a0)
            return b
    return None


def bytes_saving(
    rows: Sequence[SweepRow], method: str = "citer", baseline: str = "citer_s", interpolate: bool = True
) -> dict[str, Any]:
    """``1 - bytes(method) / bytes(baseline)`` at each accuracy the baseline reaches (its frontier points) that
    ``method`` reaches too; ``min``/``mean`` summarise them (None when there is no common accuracy).

    The baseline's own measured points are compared (not the SLM-only anchor, which both curves share)."""
    points = []
    for b_base, acc in frontier(rows, baseline, anchor_slm=False):
        b_m = bytes_at_accuracy(rows, method, acc, interpolate)
        if b_m is None or b_base <= 0:
            continue
        points.append(
            {
                "accuracy": acc,
                f"{method}_bytes_rel": b_m,
                f"{baseline}_bytes_rel": b_base,
                "saving": 1.0 - b_m / b_base,
            }
        )
    savings = [p["saving"] for p in points]
    return {
        "points": points,
        "min": min(savings) if savings else None,
        "mean": sum(savings) / len(savings) if savings else None,
    }


def claims(rows: Sequence[SweepRow], accuracy_ratio: float = 0.98) -> dict[str, Any]:
    """The issue's three checks in one dict: dominance, bytes at ratio x LLM accuracy, saving over CITER-S."""
    llm = llm_reference(rows)
    target = accuracy_ratio * llm.accuracy
    return {
        "llm_accuracy": llm.accuracy,
        "target_accuracy": target,
        "citer_bytes_rel_at_target": bytes_at_accuracy(rows, "citer", target, interpolate=False),
        "citer_bytes_rel_at_target_interpolated": bytes_at_accuracy(rows, "citer", target, interpolate=True),
        "dominance": dominance(rows),
        "dominance_interpolated": dominance(rows, interpolate=True),
        "citer_vs_citer_s": bytes_saving(rows) if _of(rows, "citer_s") else None,
    }
