"""Final answers: pull them out of model text and decide whether two are the same.

math: the answer is the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``); without one, the last "The answer is N"
or "#### N". Equality goes through a cheap string/number normalisation first and only then through ``math-verify``
(LaTeX -> sympy) for symbolic forms.

mc: the answer is the label of the last "answer is B" / "answer: (C)" statement (or a last boxed label); given the
row's choices, a last statement that names a choice's text instead ("The answer is 13.", "answer: a revolving door")
stands for that choice's label; a statement that is exactly a label ("The answer is 3." with labels 1-4) names it.

Grading runs inside Prefect task threads and server threads. math-verify's timeouts use ``signal.alarm``, which only
works on the main thread, so off the main thread it is called without a timeout; :func:`_too_costly` keeps out the
inputs that make sympy run away (huge powers, factorials, very long expressions), on every thread.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from citer.data.formats import Format

# Seconds math-verify may spend on one parse or comparison (main thread only; see the module docstring).
MATH_VERIFY_TIMEOUT_S = 5
# Answers longer than this are compared as normalised strings only: sympy time grows fast with expression size.
MAX_SYMBOLIC_CHARS = 300

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


@dataclass(frozen=True)
class Box:
    """One ``\\boxed{`` occurrence: ``content`` is what its braces enclose, None when they never close."""

    start: int
    content: str | None


def find_boxes(text: str) -> list[Box]:
    """Every ``\\boxed{...}`` / ``\\fbox{...}`` in order; nested and escaped (``\\{``) braces are handled."""
    boxes = []
    for m in _BOX_RE.finditer(text):
        depth, i, end = 1, m.end(), None
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            i += 1
        boxes.append(Box(m.start(), None if end is None else text[m.end() : end]))
    return boxes


def extract_boxed(text: str) -> str | None:
    """The content of the last balanced box, stripped; None when there is none."""
    for box in reversed(find_boxes(text)):
        if box.content is not None:
            return box.content.strip()
    return None


def box_problem(solution: str) -> str | None:
    """Why a reference solution has no final box (None when its last box is balanced; it may be empty)."""
    boxes = find_boxes(solution)
    if not boxes:
        return "no \\boxed{...} final answer"
    last = boxes[-1]
    if last.content is None:
        return f"unbalanced \\boxed{{ at character {last.start + 1} (its brace never closes)"
    return None


def empty_box_problem(solution: str) -> str | None:
    """Why a reference solution's final box holds no answer (None when it holds one, or there is no balanced box)."""
    boxes = find_boxes(solution)
    if boxes and boxes[-1].content is not None and not boxes[-1].content.strip():
        return f"empty \\boxed{{}} at character {boxes[-1].start + 1}: the row has no reference answer"
    return None


# "The answer is B.", "answer is (C)", "Answer: D", "answer is **E**", "the correct answer is option A".
_MC_RE = re.compile(
    r"answer\s*(?:is|:)\s*:?\s*(?:option\s+|choice\s+)?[\(\[\*\s]*([A-Z]|\d{1,2})[\)\]\*]*(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_NUM = r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?"
_MATH_FALLBACK_RE = re.compile(rf"(?:answer\s+is\s*:?|####)\s*({_NUM})", re.IGNORECASE)


# The last "answer is ..." / "answer: ..." statement, for matching a choice's text (mc rows whose choices are known).
_MC_STATED_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*(?:option\s+|choice\s+)?", re.IGNORECASE)


def _choice_by_text(text: str, choices: Mapping[str, Any]) -> str | None:
    """The label of the one choice whose text the last "answer is ..." statement names; None when none or several."""
    found = list(_MC_STATED_RE.finditer(text))
    if not found:
        return None
    tail = text[found[-1].end() :].split("\n", 1)[0].strip()
    labels, texts = list(choices["label"]), [str(t) for t in choices["text"]]
    # The whole rest of the line, then up to the first sentence end ("13. So ..."), each without dressing.
    for cand in (tail, re.split(r"(?<=[^\s])\.(?:\s|$)", tail, maxsplit=1)[0]):
        cand = cand.strip().strip("*()[]").strip().rstrip(".").strip()
        if cand in labels:  # "The answer is 3." with labels 1-4 names the label, whatever the texts say
            return None
        key = normalize_answer(cand).lower()
        if not key:
            continue
        hits = [lab for lab, t in zip(labels, texts, strict=True) if normalize_answer(t).lower() == key]
        if len(hits) == 1:
            return str(hits[0])
    return None


def extract_answer(text: str, fmt: Format, choices: Mapping[str, Any] | None = None) -> str | None:
    """The final answer stated in model text (see the module docstring); None when it states none.

    ``choices`` (an mc row's ``{"text", "label"}``) lets a statement that names a choice's text count as its label.
    """
    if fmt == "mc":
        # The label group must match as written (upper case), while "answer is" may be any case.
        labels = [m.group(1) for m in _MC_RE.finditer(text) if not m.group(1).islower()]
        if choices is not None:
            by_text = _choice_by_text(text, choices)
            if by_text is not None:
                return by_text
        if labels:
            return labels[-1]
        boxed = extract_boxed(text)
        if boxed is not None:
            inner = re.sub(r"\\text\{\s*\(?([A-Z])\)?\s*\}", r"\1", boxed).strip("() ")
            if re.fullmatch(r"[A-Z]", inner):
                return inner
        return None
    if fmt == "math":
        boxed = extract_boxed(text)
        if boxed is not None:
            return boxed
        found = _MATH_FALLBACK_RE.findall(text)
        if found:
            return found[-1].replace("$", "").replace(" ", "")
        return None
    raise ValueError(f"unknown format {fmt!r}; expected 'math' or 'mc'")


_SPACES = re.compile(r"\\\\|\\[,;:!> ]|\\q?quad|~")
_LATEX_THOUSANDS = re.compile(r"(\d),\\!(?=\d{3})")
_UNIT_TAIL = re.compile(
    r"^(.*\d.*?)\s*\\(?:text|textbf|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .\-]*\}(?:\^\{?\d\}?)?\s*$"
)
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")


def _strip_dressing(s: str) -> str:
    """Remove what never changes a value but keep LaTeX intact (spaces matter to it: ``\\pi r``)."""
    s = s.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = _LATEX_THOUSANDS.sub(r"\1", s)  # 1,\!296,\!540 is LaTeX's way of writing 1296540
    # A LaTeX line break (\\\\, matrix rows) is matched first so that its second backslash is not read as "\\ ".
    s = _SPACES.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])\s*", "", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    m = _UNIT_TAIL.match(s)
    if m:
        s = m.group(1)
    s = _TEXT_WRAP.sub(r"\1", s)
    return s.strip().rstrip(".").strip()


def normalize_answer(s: str) -> str:
    """A canonical string for cheap comparison: dressing removed, then every space dropped."""
    return re.sub(r"\s+", "", _strip_dressing(s))


_DEC_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH_RE = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_FRAC_RE = re.compile(r"([+-]?)(\d+)?\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{([+-]?\d+)\}|(\d))")
# "61,328" is a number and "70,110" may be a list of two; as a number it is only tried after the string test.
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _as_number(norm: str) -> Fraction | None:
    """An exact rational for integers, decimals, ``a/b``, ``\\frac{a}{b}`` and mixed ``2\\frac{1}{4}``; else None."""
    if _DEC_RE.fullmatch(norm):
        return Fraction(norm)
    if _THOUSANDS.fullmatch(norm):
        return Fraction(norm.replace(",", ""))
    m = _SLASH_RE.fullmatch(norm)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _FRAC_RE.fullmatch(norm)
    if m:
        num, den = int(m.group(3) or m.group(4)), int(m.group(5) or m.group(6))
        if den == 0:
            return None
        value = Fraction(num, den) + int(m.group(2) or 0)  # a mixed number means whole + fraction
        return -value if m.group(1) == "-" else value
    return None


# A numeral with its base as a subscript, "10000_2" or "A5_{11}": compared only with another such numeral.
_BASED_RE = re.compile(r"([0-9A-Za-z]+)_\{?(\d+)\}?")


def _as_based(norm: str) -> tuple[int, int] | None:
    """(value, base) of a subscripted numeral; None when it is not one or has a digit its base lacks."""
    m = _BASED_RE.fullmatch(norm)
    if not m or not 2 <= int(m.group(2)) <= 36:
        return None
    base = int(m.group(2))
    try:
        return int(m.group(1), base), base
    except ValueError:
        return None


# Exponents of 4+ digits, towers and large factorials make sympy evaluate numbers with millions of digits.
_COSTLY = re.compile(r"\^\s*\{?\s*[+-]?\d{4,}|\^\s*\{[^{}]*\^|\^\s*\d\s*\^|\d{4,}\s*!|!\s*!")


def _too_costly(s: str) -> bool:
    return len(s) > MAX_SYMBOLIC_CHARS or bool(_COSTLY.search(s))


class _DropTimeoutDisabled(logging.Filter):
    """math-verify warns once per process that its timeout is off; off the main thread that is our choice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_FILTER = _DropTimeoutDisabled()
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_FILTER)


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # signal.alarm only works on the main thread; elsewhere the _too_costly guard is the protection.
    t = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_p = parse(f"${gold}$", extraction_config=config, parsing_timeout=t)
    pred_p = parse(f"${pred}$", extraction_config=config, parsing_timeout=t)
    if not gold_p or not pred_p:
        return False
    return bool(verify(gold_p, pred_p, timeout_seconds=t))


def answers_equal(pred: str | None, gold: str | None) -> bool:
    """Whether a predicted final answer equals the reference one (math semantics; see the module docstring)."""
    if pred is None or gold is None:
        return False
    p_norm, g_norm = normalize_answer(pred), normalize_answer(gold)
    if not p_norm or not g_norm:
        return False
    if p_norm == g_norm:
        return True
    p_num, g_num = _as_number(p_norm), _as_number(g_norm)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    p_base, g_base = _as_based(p_norm), _as_based(g_norm)
    if p_base is not None or g_base is not None:
        # math-verify drops the subscript, which would make 10000_2 equal 10000_3.
        return p_base is not None and p_base == g_base
    p_clean, g_clean = _strip_dressing(pred), _strip_dressing(gold)
    if _too_costly(p_clean) or _too_costly(g_clean):
        return False
    return _math_verify_equal(p_clean, g_clean)


def grade(pred_text: str, row: Mapping[str, Any], fmt: Format) -> bool:
    """Whether model text ``pred_text`` answers ``row`` correctly (mc: same label, stated as the label or as the
    choice's text; math: equal final answers)."""
    pred = extract_answer(pred_text, fmt, row.get("choices") if fmt == "mc" else None)
    if fmt == "mc":
        return pred is not None and pred == str(row["answerKey"]).strip()
    gold = extract_boxed(str(row["solution"]))
    if gold is None:
        raise ValueError("math row has no \\boxed{...} answer in its solution")
    return answers_equal(pred, gold)
