"""Markdown from report files: a report read, a share as a percentage, an interval, a table -- what the pipeline's
headline (:mod:`citer.evaluation.headline`) and the bench reports' tables (:mod:`citer.evaluation.bench_tables`) are
written with."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Block = tuple[str, list[str]]  # (markdown, the report files it read, relative to the reports dir)


def load_report(reports: Path, name: str) -> Any:
    """The report ``name`` of the reports directory ``reports``, parsed."""
    return json.loads((reports / name).read_text(encoding="utf-8"))


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def ci(c: list[float | None] | None, fmt: Callable[[float], str]) -> str:
    if not c:
        return ""
    lo, hi = (("–" if v is None else fmt(v)) for v in c)
    return f" [{lo}, {hi}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
