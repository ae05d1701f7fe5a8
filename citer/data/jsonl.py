"""Dataset files: a JSONL reader that refuses bad input with the line and field at fault, and the row rules.

Reading is line by line from bytes with a bounded ``readline`` so that one enormous line cannot exhaust memory.
:func:`iter_lines` reports every problem of every line (validation wants them all); :func:`read_jsonl` stops at the
first one. The row rules live here, once: validation evaluates the same functions as Great Expectations columns.
The formats themselves (names, row shape) are :mod:`citer.data.formats`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from citer.data.answers import box_problem, empty_box_problem, extract_answer
from citer.data.formats import Format, Problem, check_format, structural_problems
from citer.data.origin import Row

# A JSONL line longer than this is refused (and skipped in chunks of this size, never held whole).
MAX_LINE_BYTES = 8 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"


class DataError(ValueError):
    """A dataset file that cannot be used; ``str(err)`` reads ``data.jsonl:12: field 'choices.label': reason``."""

    def __init__(
        self, path: str | os.PathLike[str], line: int | None, field: str | None, reason: str
    ) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        what = reason if field is None else f"field {field!r}: {reason}"
        super().__init__(f"{where}: {what}")


@dataclass(frozen=True)
class RawLine:
    """A physical line: ``text`` is its decoded content (no line end), or None when ``problem`` says why not."""

    line: int
    text: str | None
    problem: str | None = None
    has_newline: bool = True


@dataclass
class ParsedLine:
    """A non-blank line after parsing: ``row`` is the object when it has no structural problem."""

    line: int
    row: dict[str, Any] | None
    problems: list[Problem] = field(default_factory=list)


def iter_raw_lines(path: str | os.PathLike[str], max_line_bytes: int | None = None) -> Iterator[RawLine]:
    """Every physical line of ``path``, 1-based, decoded as UTF-8 (a leading BOM and CRLF ends are accepted).

    Blank lines are yielded too (``text == ""`` after stripping whitespace is the caller's business). A line over
    ``max_line_bytes`` is reported as a problem and the rest of it is skipped chunk by chunk.
    """
    if max_line_bytes is None:
        max_line_bytes = MAX_LINE_BYTES
    p = Path(path)
    if not p.is_file():
        raise DataError(p, None, None, "file not found")
    with p.open("rb") as fh:
        lineno = 0
        while True:
            chunk = fh.readline(max_line_bytes + 1)
            if not chunk:
                return
            lineno += 1
            if len(chunk) > max_line_bytes and not chunk.endswith(b"\n"):
                # Skip the remainder without keeping it: memory stays bounded by one chunk.
                while chunk and not chunk.endswith(b"\n"):
                    chunk = fh.readline(max_line_bytes + 1)
                yield RawLine(lineno, None, f"line longer than {max_line_bytes} bytes (refused, not read)")
                continue
            has_newline = chunk.endswith(b"\n")
            if lineno == 1 and chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
            body = chunk.rstrip(b"\r\n") if has_newline else chunk
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = body[exc.start : exc.start + 1].hex()
                yield RawLine(
                    lineno, None, f"not valid UTF-8 (byte 0x{bad} at byte {exc.start + 1})", has_newline
                )
                continue
            yield RawLine(lineno, text, None, has_newline)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"duplicate key {key!r} in one object (json would keep only the last)")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _json_problem(raw: RawLine, exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        if exc.msg.startswith("Invalid control character"):
            ch = raw.text[exc.pos] if raw.text is not None and exc.pos < len(raw.text) else "?"
            return f"raw control character U+{ord(ch):04X} inside a string at column {exc.colno} (escape it)"
        # An object cut short fails at its very end, or inside a string that never closes.
        if exc.pos >= len((raw.text or "").rstrip()) or exc.msg.startswith("Unterminated string"):
            tail = "" if raw.has_newline else ", no final newline"
            return f"truncated line: JSON ends early ({exc.msg}; column {exc.colno}{tail})"
        return f"not valid JSON at column {exc.colno}: {exc.msg}"
    return f"not valid JSON: {exc}"


# Row rules that need a structurally sound row. Each returns None when the row is fine, else the reason.
RuleFn = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class Rule:
    """A row rule; only ``severity == "error"`` rules refuse a row (warnings are reported by validation)."""

    name: str
    field: str
    check: RuleFn
    severity: str = "error"


# MATH train has two rows whose only box is empty (math_train.jsonl lines 5530 and 5532, the answers were lost
# upstream). They cannot be graded, but the published file must stay usable: they are reported as warnings and
# grading counts them wrong. "error" would refuse the whole file.
EMPTY_BOX_SEVERITY = "warning"


def _two_choices(row: Mapping[str, Any]) -> str | None:
    n = len(row["choices"]["text"])
    return None if n >= 2 else f"fewer than 2 choices (got {n})"


def _lengths_match(row: Mapping[str, Any]) -> str | None:
    nt, nl = len(row["choices"]["text"]), len(row["choices"]["label"])
    return None if nt == nl else f"choices.text has {nt} entries but choices.label has {nl}"


def _labels_unique(row: Mapping[str, Any]) -> str | None:
    seen: set[str] = set()
    for lab in row["choices"]["label"]:
        if lab in seen:
            return f"duplicate label {lab!r}"
        seen.add(lab)
    return None


def _key_in_labels(row: Mapping[str, Any]) -> str | None:
    labels = row["choices"]["label"]
    key = row["answerKey"]
    return None if key in labels else f"answerKey {key!r} is not among the labels {labels}"


def _cot_ends_in_key(row: Mapping[str, Any]) -> str | None:
    cot = row.get("cot")
    if not cot:
        return None
    got = extract_answer(cot, "mc")
    if got == row["answerKey"]:
        return None
    return f"chain of thought states answer {got!r}, expected answerKey {row['answerKey']!r}"


def _solution_boxed(row: Mapping[str, Any]) -> str | None:
    return box_problem(row["solution"])


def _answer_not_empty(row: Mapping[str, Any]) -> str | None:
    return empty_box_problem(row["solution"])


RULES: dict[str, tuple[Rule, ...]] = {
    "mc": (
        Rule("two_choices", "choices.text", _two_choices),
        Rule("lengths_match", "choices", _lengths_match),
        Rule("labels_unique", "choices.label", _labels_unique),
        Rule("key_in_labels", "answerKey", _key_in_labels),
        Rule("cot_ends_in_key", "cot", _cot_ends_in_key),
    ),
    "math": (
        Rule("solution_boxed", "solution", _solution_boxed),
        Rule("answer_not_empty", "solution", _answer_not_empty, EMPTY_BOX_SEVERITY),
    ),
}


def rule_problems(row: Mapping[str, Any], fmt: Format) -> list[Problem]:
    """Every error-severity row rule of ``fmt`` the (structurally sound) row breaks."""
    check_format(fmt)
    out = []
    for rule in RULES[fmt]:
        if rule.severity != "error":
            continue
        reason = rule.check(row)
        if reason is not None:
            out.append(Problem(rule.field, reason))
    return out


def iter_lines(
    path: str | os.PathLike[str], fmt: Format, max_line_bytes: int | None = None
) -> Iterator[ParsedLine]:
    """Every non-blank line of ``path`` parsed: the row (None when malformed) and its structural problems.

    Row rules are not applied here (validation evaluates them as expectations; :func:`read_jsonl` applies them).
    """
    check_format(fmt)
    for raw in iter_raw_lines(path, max_line_bytes):
        if raw.text is None:
            yield ParsedLine(raw.line, None, [Problem(None, raw.problem or "unreadable line")])
            continue
        if not raw.text.strip():
            continue
        try:
            obj = json.loads(raw.text, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as exc:
            yield ParsedLine(raw.line, None, [Problem(exc.key, str(exc))])
            continue
        except ValueError as exc:  # json.JSONDecodeError
            yield ParsedLine(raw.line, None, [Problem(None, _json_problem(raw, exc))])
            continue
        problems = structural_problems(obj, fmt)
        yield ParsedLine(raw.line, None if problems else obj, problems)


def read_jsonl(path: str | os.PathLike[str], fmt: Format) -> list[Row]:
    """All rows of a JSONL dataset in format ``fmt``; raises :class:`DataError` at the first bad line or field.

    Each row remembers its file and 1-based line (:func:`citer.data.origin.origin`) for later error messages.
    """
    rows: list[Row] = []
    for parsed in iter_lines(path, fmt):
        problems = parsed.problems or rule_problems(parsed.row or {}, fmt)
        if problems:
            first = problems[0]
            raise DataError(path, parsed.line, first.field, first.reason)
        assert parsed.row is not None
        rows.append(Row(parsed.row, str(path), parsed.line))
    if not rows:
        raise DataError(path, None, None, "no rows (the file is empty or holds only blank lines)")
    return rows
