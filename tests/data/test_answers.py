"""citer.data.answers: extraction and equivalence on real GSM8K/MATH answer forms, on any thread."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import FIXTURES, SHARED_DATA, needs_shared_data

from citer.data.answers import (
    answers_equal,
    box_problem,
    empty_box_problem,
    extract_answer,
    extract_boxed,
    grade,
    normalize_answer,
)
from citer.data.prompts import reference_answer

# Gold answers copied from /work/shared/data/<source> (file:line, the solution's last box); preds written by hand.
REAL = [json.loads(line) for line in (FIXTURES / "answers_real.jsonl").open(encoding="utf-8")]


def test_fixture_is_large_and_balanced():
    assert len({r["gold"] for r in REAL}) >= 40
    assert sum(r["equal"] for r in REAL) >= 30 and sum(not r["equal"] for r in REAL) >= 30


@needs_shared_data
def test_fixture_golds_are_the_real_answers():
    # Each gold must be exactly what extract_boxed reads from the cited line of the real file.
    cache: dict[str, list[str]] = {}
    for r in REAL:
        name, line = r["source"].rsplit(":", 1)
        if name not in cache:
            cache[name] = (SHARED_DATA / name).read_text(encoding="utf-8").splitlines()
        solution = json.loads(cache[name][int(line) - 1])["solution"]
        assert extract_boxed(solution) == r["gold"], r["source"]


@pytest.mark.parametrize("case", REAL, ids=[f"{r['source']}|{r['pred']}" for r in REAL])
def test_real_answer_forms(case):
    assert answers_equal(case["pred"], case["gold"]) is case["equal"]


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        (
            "\\boxed{1} and later \\boxed{ \\left( 3, \\frac{\\pi}{2} \\right) }",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
        ),
        ("\\fbox{7}", "7"),
        ("\\boxed {42}", "42"),
        ("sets: \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        (
            "matrix \\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
            "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        ),
        ("first \\boxed{3}, then cut off \\boxed{\\frac{1}{", "3"),
        ("no box here, the answer is 5", None),
        ("\\boxed{", None),
        ("\\boxedfoo{3}", None),
    ],
)
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


def test_box_problems():
    assert box_problem("\\boxed{1} then \\boxed{2}") is None
    assert "no \\boxed" in (box_problem("The answer is 5.") or "")
    assert "unbalanced" in (box_problem("\\boxed{1} then \\boxed{2") or "")
    assert box_problem("\\boxed{}") is None and "empty" in (empty_box_problem("$\\boxed{ }$") or "")
    assert empty_box_problem("\\boxed{0}") is None and empty_box_problem("no box") is None


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("Plants absorb carbon dioxide. The answer is B.", "B"),
        ("So the answer is (C)", "C"),
        ("Answer: D", "D"),
        ("the correct answer is **E**.", "E"),
        ("I first thought the answer is A, but the answer is (B).", "B"),
        ("The answer is a revolving door.", None),
        ("The answer is Alice.", None),
        ("Therefore $\\boxed{\\text{(C)}}$", "C"),
        ("nothing stated", None),
    ],
)
def test_extract_mc(text, label):
    assert extract_answer(text, "mc") == label


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        # The CITER reference GSM8K solution form (citer-reference/gsm8k_test.jsonl:1, tail).
        (
            "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market. The answer is \\boxed{18}.",
            "18",
        ),
        # Raw GSM8K answer tail (raw/gsm8k/test.jsonl:147): "#### 2,125".
        (
            "In total, that means Johnny picked up 500+1500+125= <<500+1500+125=2125>>2125 blocks\n#### 2,125",
            "2,125",
        ),
        ("Weng earned 10 dollars. The answer is $10.", "10"),
        ("The answer is -3/4", "-3/4"),
        ("\\boxed{2} ... so the answer is 7", "2"),
        ("no answer at all", None),
    ],
)
def test_extract_math(text, answer):
    assert extract_answer(text, "math") == answer


def test_raw_gsm8k_thousands_grade_against_converted_gold():
    assert answers_equal(extract_answer("#### 2,125", "math"), "2125")


def test_normalize_answer():
    assert normalize_answer(" $\\dfrac{3}{4}$ ") == "\\frac{3}{4}"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("45^{\\circ}") == "45"


def test_none_and_empty_are_never_equal():
    assert not answers_equal(None, "1")
    assert not answers_equal("1", None)
    assert not answers_equal("", "")
    assert not answers_equal("$ $", "0")


def test_grade_mc_and_math():
    mc_row = {"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"}
    assert grade("... The answer is B.", mc_row, "mc")
    assert not grade("... The answer is A.", mc_row, "mc")
    assert not grade("no idea", mc_row, "mc")
    math_row = {"problem": "p", "solution": "We get $\\boxed{\\frac{1}{2}}$."}
    assert grade("so \\boxed{0.5}", math_row, "math")
    assert grade("The answer is 1/2", math_row, "math")
    assert not grade("so \\boxed{0.25}", math_row, "math")
    assert reference_answer(math_row, "math") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="no \\\\boxed"):
        grade("\\boxed{1}", {"problem": "p", "solution": "1"}, "math")


MC_NUMBERS = {
    "question": "q",
    "choices": {"text": ["5", "10", "13", "8"], "label": list("ABCD")},
    "answerKey": "C",
}
MC_WORDS = {
    "question": "q",
    "choices": {"text": ["a revolving door", "Alice", "3.5"], "label": ["1", "2", "3"]},
    "answerKey": "1",
}


@pytest.mark.parametrize(
    ("row", "text", "label", "correct"),
    [
        (MC_NUMBERS, "7 - 1 = 13. 13 is (C). So the answer is C.", "C", True),
        (MC_NUMBERS, "= 13. The answer is 13.", "C", True),  # the choice's text stands for its label
        (MC_NUMBERS, "The answer is (C) 13.", "C", True),
        (MC_NUMBERS, "answer: **13**", "C", True),
        (MC_NUMBERS, "The answer is 10.", "B", False),
        (MC_NUMBERS, "The answer is B. No: the answer is 13", "C", True),  # the last statement counts
        (MC_NUMBERS, "The answer is 13 apples.", "13", False),  # no choice reads "13 apples"
        (MC_WORDS, "The answer is a revolving door.", "1", True),
        (MC_WORDS, "The answer is A revolving door", "1", True),  # case-insensitive text
        (MC_WORDS, "The answer is 3.", "3", False),  # exactly a label: the label, not a text
        (MC_WORDS, "the answer is Alice. Because she said so.", "2", False),
    ],
)
def test_mc_grades_the_label_or_the_choice_text(row, text, label, correct):
    assert extract_answer(text, "mc", row["choices"]) == label
    assert grade(text, row, "mc") is correct


def test_mc_choice_text_needs_one_match():
    row = {"question": "q", "choices": {"text": ["7", "7", "9"], "label": list("ABC")}, "answerKey": "A"}
    assert extract_answer("The answer is 7.", "mc", row["choices"]) == "7"  # two choices read 7: no label
    assert not grade("The answer is 7.", row, "mc")
    assert extract_answer("The answer is 7.", "mc") == "7"  # without choices: as before


# Pairs that go past the fast path into math-verify (sympy), where the signal-based timeout lives.
SYMBOLIC = [
    ("\\sqrt{128}", "8\\sqrt2", True),
    ("(2, 8\\pi/7, 7\\pi/9)", "\\left( 2, \\frac{8 \\pi}{7}, \\frac{7 \\pi}{9} \\right)", True),
    ("6+27x+8x^2+36x^3", "36x^3+8x^2+27x+6", True),
    ("8\\sqrt3", "8\\sqrt2", False),
]


def test_grading_works_off_the_main_thread():
    results: dict[str, object] = {}

    def work() -> None:
        try:
            results["eq"] = [answers_equal(p, g) for p, g, _ in SYMBOLIC]
            results["grade"] = grade(
                "\\boxed{\\sqrt{128}}", {"problem": "p", "solution": "\\boxed{8\\sqrt2}"}, "math"
            )
        except Exception as exc:  # surfaced below: the failure mode is an exception from signal.alarm
            results["error"] = exc

    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive()
    assert "error" not in results, results.get("error")
    assert results["eq"] == [e for _, _, e in SYMBOLIC]
    assert results["grade"] is True
    # Same answers on the main thread, where the timeout is active.
    assert [answers_equal(p, g) for p, g, _ in SYMBOLIC] == results["eq"]


def test_runaway_expressions_are_not_sent_to_sympy():
    out: list[bool] = []
    th = threading.Thread(
        target=lambda: out.extend(
            answers_equal(p, g) for p, g in [("9^{9^{9^9}}", "3"), ("10^{100000000}", "1")]
        )
    )
    t0 = time.perf_counter()
    th.start()
    th.join(timeout=30)
    assert not th.is_alive() and out == [False, False]
    assert time.perf_counter() - t0 < 5.0
    assert answers_equal("9^{9^{9^9}}", "9^{9^{9^9}}")  # identical strings still compare equal


@needs_shared_data
def test_gsm8k_three_answer_forms_agree():
    # Same 1319 problems, same order: raw "#### 1,080", converted "\boxed{1080}", CITER's "The answer is \boxed{N}.".
    def load(name: str) -> list[dict]:
        with (SHARED_DATA / name).open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    raw, conv, ref = (
        load("raw/gsm8k/test.jsonl"),
        load("math/gsm8k_test.jsonl"),
        load("citer-reference/gsm8k_test.jsonl"),
    )
    assert len(raw) == len(conv) == len(ref) == 1319
    for i, (r, c, f) in enumerate(zip(raw, conv, ref, strict=True), start=1):
        assert grade(r["answer"], c, "math"), f"line {i}: {r['answer'][-40:]!r}"
        assert grade(f["solution"], c, "math"), f"line {i}"
        assert not grade(f"#### {extract_boxed(c['solution'])}1", c, "math"), f"line {i}"
