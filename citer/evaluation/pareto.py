"""Pareto frontiers and the paper's claims over sweep rows: dominance, bytes at an accuracy, savings.

Everything here is pure: rows in, numbers out. CITER at τ = 0 never calls the LLM (scores are >= 0), so the SLM-only
point is the τ -> 0 end of the CITER curve; :func:`frontier` uses it as that anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from citer.evaluation.rows import SweepError, SweepRow, llm_reference, rows_of


def frontier(rows: Sequence[SweepRow], method: str, anchor_slm: bool = True) -> list[tuple[float, float]]:
    """The Pareto frontier (bytes_rel, accuracy) of ``method``, bytes ascending, accuracy strictly ascending.

    For ``citer``/``citer_s`` the SLM-only row is included as the τ = 0 end (``anchor_slm``).
    """
    pts = [(r.bytes_moved_rel_llm, r.accuracy) for r in rows_of(rows, method)]
    if anchor_slm and method in ("citer", "citer_s"):
        pts += [(r.bytes_moved_rel_llm, r.accuracy) for r in rows_of(rows, "slm")]
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
        "citer_vs_citer_s": bytes_saving(rows) if rows_of(rows, "citer_s") else None,
    }
