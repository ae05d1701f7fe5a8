"""The two dataset formats of CITER: their names and the shape of a row (keys and types).

- mc: ``{"question": str, "choices": {"text": [str, ...], "label": [str, ...]}, "answerKey": str}``, optional
  ``cot`` (a chain of thought ending in the answer label).
- math: ``{"problem": str, "solution": str}``; the final answer is the solution's last ``\\boxed{...}``.

Rows may carry extra keys (``id``, ``question_concept``, ...); they are kept untouched. This module is the bottom of
``citer.data``: answers, prompts and the JSONL reader all name a format through :data:`Format`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["math", "mc"]

FORMATS: tuple[str, ...] = ("math", "mc")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one line (``field`` is None when the line as a whole is at fault)."""

    field: str | None
    reason: str


def check_format(fmt: str) -> None:
    """Raise ValueError unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")


def _type_name(v: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _need_str(
    obj: Mapping[str, Any], key: str, name: str, out: list[Problem], *, required: bool = True
) -> None:
    if key not in obj:
        if required:
            out.append(Problem(name, "missing required key"))
        return
    v = obj[key]
    if not isinstance(v, str):
        out.append(Problem(name, f"expected a string, got {_type_name(v)}"))
    elif required and not v.strip():
        out.append(Problem(name, "empty string"))


def _need_str_list(choices: Mapping[str, Any], key: str, out: list[Problem]) -> None:
    name = f"choices.{key}"
    if key not in choices:
        out.append(Problem(name, "missing required key"))
        return
    v = choices[key]
    if not isinstance(v, list):
        out.append(Problem(name, f"expected an array of strings, got {_type_name(v)}"))
        return
    for i, item in enumerate(v):
        if not isinstance(item, str):
            out.append(Problem(f"{name}[{i}]", f"expected a string, got {_type_name(item)}"))
        elif not item.strip():
            out.append(Problem(f"{name}[{i}]", "empty string"))


_KEYS = {"math": ("problem", "solution"), "mc": ("question", "choices")}


def _other_format(obj: Mapping[str, Any], fmt: Format) -> Problem | None:
    """A row of the other format (a file mixing both): one problem that says so, instead of its missing keys."""
    other = "mc" if fmt == "math" else "math"
    mine, theirs = _KEYS[fmt], _KEYS[other]
    if any(k in obj for k in mine) or not all(k in obj for k in theirs):
        return None
    article = "an" if other == "mc" else "a"
    return Problem(
        None,
        f"{article} {other} row ({', '.join(theirs)}) in {'an' if fmt == 'mc' else 'a'} {fmt} file: a file holds one format "
        "(data.format; one project routes one format, see README 'Both formats')",
    )


def structural_problems(obj: Any, fmt: Format) -> list[Problem]:
    """Shape and types: an object with the required keys, strings where strings belong, none of them empty."""
    check_format(fmt)
    if not isinstance(obj, dict):
        return [Problem(None, f"row must be a JSON object, got {_type_name(obj)}")]
    other = _other_format(obj, fmt)
    if other is not None:
        return [other]
    out: list[Problem] = []
    if fmt == "math":
        _need_str(obj, "problem", "problem", out)
        _need_str(obj, "solution", "solution", out)
        return out
    _need_str(obj, "question", "question", out)
    _need_str(obj, "answerKey", "answerKey", out)
    _need_str(obj, "cot", "cot", out, required=False)
    if "choices" not in obj:
        out.append(Problem("choices", "missing required key"))
    elif not isinstance(obj["choices"], dict):
        out.append(
            Problem(
                "choices", f"expected an object with 'text' and 'label', got {_type_name(obj['choices'])}"
            )
        )
    else:
        _need_str_list(obj["choices"], "text", out)
        _need_str_list(obj["choices"], "label", out)
    return out


def question_text(row: Mapping[str, Any], fmt: Format) -> str:
    """What a row asks, as a person reads it: the math problem, or the mc question with its choices."""
    if fmt == "math":
        return str(row["problem"])
    ch = row["choices"]
    return f"{row['question']} " + " ".join(
        f"({a}) {b}" for a, b in zip(ch["label"], ch["text"], strict=False)
    )
