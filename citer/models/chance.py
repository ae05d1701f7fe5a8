"""Whether the LLM can do the task at all: its test accuracy against what guessing scores on the same rows.

CITER routes the hard tokens to the LLM, so it can never be more accurate than the LLM. A pair whose LLM is at
chance on the data (the embedded pair asked GSM8K questions: 0%) would spend minutes on labels, routers and a sweep
that can only measure noise; the pipeline stops after ``eval_models`` instead, in one line (``eval.llm_chance_margin``
sets how far above chance the LLM must be; null turns the check off).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from citer.data.formats import Format


class PairCannotDoData(ValueError):
    """The LLM answers the test questions at or near chance: routing to it cannot help."""


def chance_accuracy(rows: Sequence[Mapping[str, Any]], fmt: Format) -> float:
    """What guessing scores: the mean of 1 / (number of choices) on mc rows, 0 on free-form math answers."""
    if fmt != "mc" or not rows:
        return 0.0
    return sum(1.0 / max(len(r["choices"]["label"]), 1) for r in rows) / len(rows)


def check_llm_above_chance(
    llm_accuracy: float, chance: float, margin: float | None, n: int, llm: str
) -> None:
    """Raise :class:`PairCannotDoData` when ``llm_accuracy`` is at most ``chance + margin`` (``margin`` None: never)."""
    if margin is None or llm_accuracy > chance + margin:
        return
    raise PairCannotDoData(
        f"the LLM ({llm}) answers {llm_accuracy:.1%} of {n} test questions, at or near chance on this data "
        f"({chance:.1%}, eval.llm_chance_margin {margin:g}): this pair cannot do this data, so routing cannot help; "
        "use an LLM that can (reports/models.json), or set eval.llm_chance_margin: null to go on anyway"
    )
