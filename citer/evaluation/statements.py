"""The quotable statement of each claim: what its value and interval say, including where CITER does not win.

Each function takes a claim dict of :func:`citer.evaluation.intervals.summarise` (``value``, ``ci``) plus its own
fields, sets ``holds_at_95`` by the claim's rule and writes ``statement``.
"""

from __future__ import annotations

import math
from typing import Any

from citer.evaluation.intervals import ci_bounds

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
