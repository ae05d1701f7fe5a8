"""Pareto frontiers and the paper's claims over sweep rows: dominance, bytes at an accuracy, savings.

Everything here is pure: rows in, numbers out. CITER at τ = 0 never calls the LLM (scores are >= 0), so the SLM-only
point is the τ -> 0 end of the CITER curve; :func:`frontier` uses it as that anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from citer.evaluation.intervals import aligned, bootstrap_values, ci_bounds, json_safe, summarise
from citer.evaluation.sweep_rows import METHODS, SweepError, SweepRow, llm_reference, rows_of


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


def _bytes_on_front(
    front: Sequence[tuple[float, float]], target_acc: float, interpolate: bool
) -> float | None:
    for i, (b, a) in enumerate(front):
        if a >= target_acc - 1e-12:
            if interpolate and i > 0 and target_acc < a:
                b0, a0 = front[i - 1]
                return b0 + (b - b0) * (target_acc - a0) / (a - a0)
            return b
    return None


def bytes_at_accuracy(
    rows: Sequence[SweepRow], method: str, target_acc: float, interpolate: bool = True
) -> float | None:
    """The least bytes_rel at which ``method``'s frontier reaches ``target_acc`` (None when it never does)."""
    return _bytes_on_front(frontier(rows, method), target_acc, interpolate)


def _saving_points(
    front: Sequence[tuple[float, float]], base_front: Sequence[tuple[float, float]], interpolate: bool
) -> tuple[list[tuple[float, float, float]], list[float]]:
    """(accuracy, method bytes, baseline bytes) at each baseline frontier point ``front`` reaches, and the baseline
    accuracies it never reaches."""
    points, unreached = [], []
    for b_base, acc in base_front:
        b_m = _bytes_on_front(front, acc, interpolate)
        if b_m is None:
            unreached.append(acc)
        elif b_base > 0:
            points.append((acc, b_m, b_base))
    return points, unreached


def bytes_saving(
    rows: Sequence[SweepRow], method: str = "citer", baseline: str = "citer_s", interpolate: bool = True
) -> dict[str, Any]:
    """``1 - bytes(method) / bytes(baseline)`` at each accuracy the baseline reaches (its frontier points) that
    ``method`` reaches too; ``min``/``mean`` summarise them (None when there is no common accuracy).

    The baseline's own measured points are compared (not the SLM-only anchor, which both curves share)."""
    found, _ = _saving_points(frontier(rows, method), frontier(rows, baseline, anchor_slm=False), interpolate)
    points = [
        {
            "accuracy": acc,
            f"{method}_bytes_rel": b_m,
            f"{baseline}_bytes_rel": b_base,
            "saving": 1.0 - b_m / b_base,
        }
        for acc, b_m, b_base in found
    ]
    savings = [p["saving"] for p in points]
    return {
        "points": points,
        "min": min(savings) if savings else None,
        "mean": sum(savings) / len(savings) if savings else None,
    }


# The baselines CITER's bytes saving is claimed against (those present in the rows), and the accuracy bar, as a
# fraction of LLM-only accuracy, of the oracle comparison.
SAVING_BASELINES = (
    "citer_s",
    "citer_iter1",
    "query",
    "speculative",
    "confidence",
    "random",
    "citer_emb",
    "citer_logits",
    "citer_emb_logits",
    "bild",
    "citer",  # for a verified method's claims: does the check beat the plain router
)
ORACLE_ACCURACY_RATIO = 0.99


def _claim_numbers(
    rows: Sequence[SweepRow],
    ratio: float,
    savers: Sequence[str],
    dominated: Sequence[str],
    method: str = "citer",
) -> dict[str, float | None]:
    """Every bootstrapped claim number on one set of rows (the full sample or one resample). "Not reached" is +inf
    bytes (and a -inf saving), so a resample that misses counts against the claim instead of being dropped."""
    llm = llm_reference(rows)
    front = frontier(rows, method)
    out: dict[str, float | None] = {}
    b = _bytes_on_front(front, ratio * llm.accuracy, False)
    out["bytes_at_target"] = math.inf if b is None else b
    oracle = rows_of(rows, "oracle")
    if oracle:
        ob = min(r.bytes_moved_rel_llm for r in oracle)
        for key, r in (("oracle_ratio", ORACLE_ACCURACY_RATIO), ("oracle_ratio_at_target", ratio)):
            cb = _bytes_on_front(front, r * llm.accuracy, False)
            out[key] = None if ob <= 0 else math.inf if cb is None else cb / ob
    for base in savers:
        pts, unreached = _saving_points(front, frontier(rows, base, anchor_slm=False), True)
        out[f"saving:{base}"] = sum(1.0 - bm / bb for _, bm, bb in pts) / len(pts) if pts else -math.inf
        out[f"reached:{base}"] = 0.0 if unreached else 1.0
    for base in dominated:
        out[f"gap:{base}"] = min(
            _best_acc_at(front, r.bytes_moved_rel_llm, False) - r.accuracy for r in rows_of(rows, base)
        )
    return out


def claims(
    rows: Sequence[SweepRow],
    accuracy_ratio: float = 0.98,
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    method: str = "citer",
) -> dict[str, Any]:
    """The paper's claims, each with a paired-bootstrap interval (:mod:`citer.evaluation.intervals`), as JSON.

    Point checks (as before): ``llm_accuracy``, ``target_accuracy``, ``citer_bytes_rel_at_target`` (measured
    points) and ``..._interpolated``, ``dominance``, ``dominance_interpolated``, ``citer_vs_citer_s``.

    Claims with intervals: dicts of :func:`intervals.summarise` (``value``, ``ci`` [lo, hi] with a None bound where
    infinite, ``n_valid``, ``n_resamples``, ``level``) plus ``holds_at_95`` (the rule at ``level``; None when there is
    no interval: no per-question data, or a row the claim reads is not aligned, e.g. speculative on a subset) and a
    quotable ``statement``. Every statistic is recomputed on each resample, LLM-only accuracy included.

    - ``bytes_at_target``: CITER's least bytes_rel at a measured point reaching ``accuracy_ratio`` x LLM-only
      accuracy (+inf where not reached; ``reached_fraction`` of resamples reach it). Holds: the upper bound is finite
      (reached on at least (1 + level) / 2 of resamples) and < 1 (fewer bytes than LLM-only).
    - ``oracle_ratio`` / ``oracle_ratio_at_target``: CITER's bytes at 99% (at ``accuracy_ratio``) of LLM-only
      accuracy / the oracle row's bytes_rel; None when there is no oracle row. Holds: the upper bound is finite.
    - ``savings[baseline]``: the mean of ``1 - CITER bytes / baseline bytes`` at the baseline's frontier accuracies
      CITER reaches (interpolated CITER frontier, as :func:`bytes_saving`; -inf when it reaches none), with
      ``unreached`` (baseline accuracies CITER never reaches) and ``all_reached_fraction``. Holds: the lower bound
      is > 0 and CITER reaches all of them on at least (1 + level) / 2 of resamples.
    - ``dominance_at_95[baseline]``: min over the baseline's points of CITER's step-frontier accuracy at that point's
      bytes minus its accuracy, with ``worst_point``. Holds (not worse anywhere): the lower bound is >= 0.
    """
    llm = llm_reference(rows)
    target = accuracy_ratio * llm.accuracy
    present = {r.method for r in rows}
    savers = [m for m in SAVING_BASELINES if m in present and m != method]
    dominated = [m for m in METHODS if m in present and m not in ("slm", "oracle", method)]
    out: dict[str, Any] = {
        "method": method,
        "llm_accuracy": llm.accuracy,
        "target_accuracy": target,
        "citer_bytes_rel_at_target": bytes_at_accuracy(rows, method, target, interpolate=False),
        "citer_bytes_rel_at_target_interpolated": bytes_at_accuracy(rows, method, target, interpolate=True),
        "dominance": dominance(rows, method),
        "dominance_interpolated": dominance(rows, method, interpolate=True),
        "citer_vs_citer_s": bytes_saving(rows, method) if rows_of(rows, "citer_s") else None,
    }
    full = _claim_numbers(rows, accuracy_ratio, savers, dominated, method)
    boot = bootstrap_values(
        rows, lambda rs: _claim_numbers(rs, accuracy_ratio, savers, dominated, method), n_resamples, seed
    )
    ok = aligned(rows)
    paired = {m for m in present if all(a for r, a in zip(rows, ok, strict=True) if r.method == m)}
    core = boot is not None and {"llm", method, "slm"} & present <= paired

    def summary(key: str, *methods: str) -> dict[str, Any]:
        use = core and all(m in paired for m in methods)
        return summarise(full[key], boot[key] if use else None, level, n_resamples)

    def frac(key: str, c: dict[str, Any], finite: bool = True) -> float | None:
        """The share of resamples where CITER reaches the bar (None without an interval)."""
        if c["ci"] is None:
            return None
        return float(np.mean(np.isfinite(boot[key]) if finite else boot[key] == 1.0))

    out["bootstrap"] = {
        "n_resamples": int(n_resamples),
        "seed": int(seed),
        "level": float(level),
        "n_questions": len(llm.correct),
        "paired": bool(core),
    }
    c = summary("bytes_at_target")
    c.update(
        accuracy_ratio=float(accuracy_ratio),
        target_accuracy=float(target),
        reached_fraction=frac("bytes_at_target", c),
    )
    out["bytes_at_target"] = bytes_claim(c, accuracy_ratio, target, level)
    oracle = rows_of(rows, "oracle")
    for key, r in (("oracle_ratio", ORACLE_ACCURACY_RATIO), ("oracle_ratio_at_target", accuracy_ratio)):
        if not oracle:
            out[key] = None
            continue
        ob = min(o.bytes_moved_rel_llm for o in oracle)
        c = summary(key, "oracle")
        cb = _bytes_on_front(frontier(rows, method), r * llm.accuracy, False)
        c.update(
            accuracy_ratio=float(r),
            citer_bytes_rel=cb,
            oracle_bytes_rel=float(ob),
            reached_fraction=frac(key, c),
        )
        out[key] = oracle_claim(c, r, ob)
    out["savings"] = {}
    for base in savers:
        s = bytes_saving(rows, method, base)
        c = summary(f"saving:{base}", base)
        c["value"] = s["mean"]
        _, unreached = _saving_points(frontier(rows, method), frontier(rows, base, anchor_slm=False), True)
        reached = frac(f"reached:{base}", c, finite=False)
        c.update(points=s["points"], min=s["min"], unreached=unreached, all_reached_fraction=reached)
        out["savings"][base] = saving_claim(c, base, level)
    out["dominance_at_95"] = {}
    front = frontier(rows, method)
    for base in dominated:
        c = summary(f"gap:{base}", base)
        worst = min(
            rows_of(rows, base), key=lambda r: _best_acc_at(front, r.bytes_moved_rel_llm, False) - r.accuracy
        )
        at = _best_acc_at(front, worst.bytes_moved_rel_llm, False)
        c["worst_point"] = {
            "tau": worst.tau,
            "accuracy": worst.accuracy,
            "bytes_moved_rel_llm": worst.bytes_moved_rel_llm,
            "citer_accuracy_at_bytes": None if at == -math.inf else at,
        }
        c["n_points"] = len(rows_of(rows, base))
        out["dominance_at_95"][base] = dominance_claim(c, base, level)
    if method != "citer":  # the statements name the method they are about
        for c in (out["bytes_at_target"], out["oracle_ratio"], out["oracle_ratio_at_target"],
                  *out["savings"].values(), *out["dominance_at_95"].values()):  # fmt: skip
            if c is not None:
                c["statement"] = c["statement"].replace("CITER", f"CITER ({method})")
    return json_safe(out)


# The quotable statement of each claim: what its value and interval say, including where CITER does not win. Each
# function takes a claim dict of intervals.summarise (value, ci) plus its own fields, sets holds_at_95 by the claim's
# rule and writes statement.
_EPS = 1e-12  # float slack: a tie is a tie, not a win by rounding


def _ci_text(c: dict[str, Any], pct: bool = False, inf: str = "inf") -> str:
    if c["ci"] is None:
        return " (no interval: no per-question data)"
    lo, hi = ci_bounds(c)
    f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}")
    return f" [{f(lo) if math.isfinite(lo) else '-' + inf}, {f(hi) if math.isfinite(hi) else inf}]"


def bytes_claim(c: dict[str, Any], ratio: float, target: float, level: float) -> dict[str, Any]:
    c["holds_at_95"] = None if c["ci"] is None else c["value"] is not None and ci_bounds(c)[1] < 1.0
    if c["value"] is None:
        c["statement"] = f"CITER does not reach {ratio:.0%} of LLM-only accuracy ({target:.3f}) at any point"
        return c
    text = f"CITER reaches {ratio:.0%} of LLM-only accuracy at {c['value']:.2f}"
    text += f"{_ci_text(c, inf='not reached')} of LLM-only bytes"
    if c["ci"] is not None and math.isinf(ci_bounds(c)[1]):
        text += f"; it misses the target on {1 - c['reached_fraction']:.0%} of resamples: not shown at {level:.0%}"
    elif c["ci"] is not None and not c["holds_at_95"]:
        text += f"; not fewer bytes than LLM-only at {level:.0%}"
    c["statement"] = text
    return c


def oracle_claim(c: dict[str, Any], ratio: float, oracle_b: float) -> dict[str, Any]:
    c["holds_at_95"] = None if c["ci"] is None else c["value"] is not None and math.isfinite(ci_bounds(c)[1])
    if oracle_b <= 0:
        c["statement"] = "The oracle moves no bytes: no ratio"
    elif c["value"] is None:
        c["statement"] = f"CITER does not reach {ratio:.0%} of LLM-only accuracy: no ratio to the oracle"
    else:
        c["statement"] = (
            f"At {ratio:.0%} of LLM-only accuracy CITER moves {c['value']:.2f}x{_ci_text(c, inf='not reached')}"
            f" the oracle's bytes (oracle: {oracle_b:.2f} of LLM-only)"
        )
    return c


def saving_claim(c: dict[str, Any], base: str, level: float) -> dict[str, Any]:
    lo, hi = ci_bounds(c)
    enough = c["ci"] is not None and c["all_reached_fraction"] >= 1 - (1 - level) / 2 - 1e-12
    c["holds_at_95"] = None if c["ci"] is None else c["value"] is not None and lo > _EPS and enough
    if c["value"] is None:
        c["statement"] = f"CITER does not win against {base}: it reaches none of {base}'s accuracies"
        return c
    text = f"CITER vs {base}: bytes saving {c['value']:.0%}{_ci_text(c, True)} at {base}'s accuracies"
    if c["holds_at_95"]:
        text += f"; CITER moves fewer bytes (significant at {level:.0%})"
    elif c["ci"] is not None and hi < -_EPS:
        text += f"; CITER does not win: it moves more bytes (significant at {level:.0%})"
    elif c["ci"] is not None and lo <= _EPS:
        loses = "CITER does not win, " if c["value"] <= _EPS else ""
        text += f"; {loses}the difference is not significant at {level:.0%}"
    elif c["value"] <= _EPS:
        text += "; CITER does not win"
    if c["unreached"]:
        text += f"; CITER does not reach {base}'s accuracy {', '.join(f'{a:.3f}' for a in c['unreached'])}"
    elif c["ci"] is not None and not enough:
        text += (
            f"; CITER misses some of {base}'s accuracies on {1 - c['all_reached_fraction']:.0%} of resamples"
        )
    if c["ci"] is not None and not c["holds_at_95"] and lo > _EPS:
        text += f": the saving is not shown at {level:.0%}"
    c["statement"] = text
    return c


def dominance_claim(c: dict[str, Any], base: str, level: float) -> dict[str, Any]:
    lo, hi = ci_bounds(c)
    c["holds_at_95"] = None if c["ci"] is None else lo >= -_EPS
    gap = "none (no CITER point at so few bytes)" if c["value"] is None else f"{c['value']:+.3f}"
    text = f"worst accuracy gap CITER - {base} {gap}{_ci_text(c)} at {c['worst_point']['bytes_moved_rel_llm']:.2f} bytes"
    if c["holds_at_95"]:
        head = f"CITER is at least as accurate as {base} at every {base} point ({level:.0%})"
    elif c["ci"] is not None and hi < -_EPS:
        head = f"CITER does not dominate {base} ({base} is more accurate, significant at {level:.0%})"
    elif c["ci"] is not None and (c["value"] is None or c["value"] < -_EPS):
        head = (
            f"CITER does not dominate {base} on this sample; the difference is not significant at {level:.0%}"
        )
    elif c["ci"] is not None:
        head = f"{base} is not shown dominated by CITER at {level:.0%} (the interval reaches below 0)"
    elif c["value"] is not None and c["value"] >= -_EPS:
        head = f"CITER is at least as accurate as {base} on this sample"
    else:
        head = f"CITER does not dominate {base} on this sample"
    c["statement"] = f"{head}: {text}"
    return c
