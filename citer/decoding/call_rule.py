"""When the LLM's queue is called: at once, by fixed counts, or by a rule derived from the engine's measured times.

A routed row waits for the LLM without advancing; one call then serves every waiting row. Holding the queue a step
costs the batch about one SLM step (the waiting rows finish a step later) and may let rows routed at the next steps
share the call, each saving the LLM's fixed cost per call (its weights read once more, its launches). So, with
``A`` + ``c`` x tokens the LLM call's seconds (fitted to this engine's calls), ``t_slm`` an SLM step's seconds and
``arrivals`` the rows routed per step (both measured in this engine's recent steps), :class:`MeasuredRule` calls when

- nothing else advances (waiting gains nothing), or
- ``arrivals`` x ``A`` <= ``t_slm``: the calls a step of waiting is expected to merge save less than the step costs, or
- the oldest row has waited as long as the call's fixed part (``A``): a routed token's wait never exceeds the
  weight pass it shares, so a row is never starved for the sake of the batch.

Until it has timed a few calls of each model it calls at once, as the fixed rule's defaults do. The rule moves only
when tokens arrive, never which: every row's tokens are the same as at once (tests/decoding/test_session.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

# Calls and steps the estimates remember: enough to average out one noisy call, few enough to follow a batch that
# grows or shrinks.
_WINDOW = 64
_MIN_CALLS = 3  # LLM calls (of at least two sizes) before the fit is trusted
_MIN_STEPS = 3


@dataclass
class StepTimes:
    """Wall seconds of an engine's recent LLM calls (with their token counts) and SLM steps, and the rows routed per
    step; kept on the engine, so one ``citer route`` batch teaches the next."""

    llm: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    slm: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    routed: deque[int] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def llm_call(self, tokens: int, seconds: float) -> None:
        self.llm.append((tokens, seconds))

    def slm_step(self, seconds: float, routed: int) -> None:
        self.slm.append(seconds)
        self.routed.append(routed)

    def llm_fit(self) -> tuple[float, float] | None:
        """(A, c): the LLM call's fixed seconds and seconds per token, a least-squares line through the recent calls
        (A >= 0, c >= 0); None until :data:`_MIN_CALLS` calls of at least two sizes were timed."""
        if len(self.llm) < _MIN_CALLS:
            return None
        t = np.array([n for n, _ in self.llm], dtype=float)
        s = np.array([x for _, x in self.llm], dtype=float)
        if np.ptp(t) == 0:
            return None
        c, a = np.polyfit(t, s, 1)
        if c < 0:  # noise: a flat line through the mean
            return float(s.mean()), 0.0
        if a < 0:  # no fixed part measurable: the line through the origin
            return 0.0, float((t * s).sum() / (t * t).sum())
        return float(a), float(c)

    def slm_seconds(self) -> float | None:
        """The median SLM step of the recent ones; None until :data:`_MIN_STEPS` were timed."""
        return float(np.median(self.slm)) if len(self.slm) >= _MIN_STEPS else None

    def arrivals(self) -> float:
        """Rows routed to the LLM per step, the recent mean."""
        return float(np.mean(self.routed)) if self.routed else 0.0


@dataclass(frozen=True)
class FixedRule:
    """Call when ``min_rows`` rows wait or the oldest has waited ``max_wait_steps`` steps (1 and 0: at once)."""

    min_rows: int = 1
    max_wait_steps: int = 0

    def due(self, waited: list[int], times: StepTimes) -> bool:
        return len(waited) >= self.min_rows or max(waited) >= self.max_wait_steps


@dataclass(frozen=True)
class MeasuredRule:
    """The rule of the module docstring, on the engine's :class:`StepTimes`."""

    def due(self, waited: list[int], times: StepTimes) -> bool:
        fit, t_slm = times.llm_fit(), times.slm_seconds()
        if fit is None or t_slm is None or t_slm <= 0.0:
            return True
        a = fit[0]
        if times.arrivals() * a <= t_slm:
            return True
        return max(waited) * t_slm >= a


CallRule = FixedRule | MeasuredRule


def call_rule(schedule: str, min_rows: int = 1, max_wait_steps: int = 0) -> CallRule:
    """The rule an engine's ``llm_schedule``, ``llm_min_rows`` and ``llm_max_wait_steps`` name (the params'
    ``engine:`` block), checked (a ValueError names the field): ``"measured"``, or ``"fixed"`` by the two counts."""
    for name, v, low in (("llm_min_rows", min_rows, 1), ("llm_max_wait_steps", max_wait_steps, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if schedule not in ("fixed", "measured"):
        raise ValueError(f"llm_schedule must be 'fixed' or 'measured', got {schedule!r}")
    return MeasuredRule() if schedule == "measured" else FixedRule(min_rows, max_wait_steps)
