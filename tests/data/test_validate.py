"""citer.data.validate: Great Expectations suites find every problem, with lines, and real benchmark files pass."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import FIXTURES, SHARED_DATA, needs_shared_data

from citer.data import jsonl
from citer.data.validate import Finding, ValidationReport, validate_file, write_report

BAD_DIR = FIXTURES / "bad"
EXPECTED = json.loads((BAD_DIR / "expected.json").read_text(encoding="utf-8"))["files"]


def _mc(q: str, key: str = "B") -> dict:
    return {
        "question": q,
        "choices": {"text": ["w", "x", "y", "z"], "label": ["A", "B", "C", "D"]},
        "answerKey": key,
    }


def _lines(path: Path, lines: list[object]) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        for x in lines:
            fh.write((x if isinstance(x, str) else json.dumps(x)) + "\n")
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_file_is_refused_with_its_line_and_field(name):
    exp = EXPECTED[name]
    report = validate_file(BAD_DIR / name, exp["format"])
    assert not report.ok
    hits = [
        f
        for f in report.errors()
        if f.line == exp["line"] and f.field == exp["field"] and exp["reason"] in f.reason
    ]
    assert hits, report.summary()


def test_all_findings_mapped_to_lines(tmp_path):
    # Blank and malformed lines shift DataFrame indexes away from line numbers: every finding must still land right.
    rows = [
        _mc("q1"),  # 1 ok
        "",  # 2 blank
        _mc("q3", key="F"),  # 3 answerKey not a label
        "{not json",  # 4 malformed
        {
            **_mc("q5"),
            "choices": {"text": ["w", "x"], "label": ["A", "A"]},
            "answerKey": "A",
        },  # 5 duplicate label
        _mc("q1"),  # 6 duplicate question of line 1 (warning)
        {**_mc("q7"), "choices": {"text": ["only"], "label": ["A"]}, "answerKey": "A"},  # 7 one choice
        _mc("q8" + "!" * 300),  # 8 long question (warning at max_chars_warning=100)
        _mc("q9"),  # 9 ok
    ]
    report = validate_file(_lines(tmp_path / "mixed.jsonl", rows), "mc", max_chars_warning=100)
    got = {(f.line, f.field, f.severity) for f in report.findings}
    assert got == {
        (3, "answerKey", "error"),
        (4, None, "error"),
        (5, "choices.label", "error"),
        (6, "question", "warning"),
        (7, "choices.text", "error"),
        (8, "question", "warning"),
    }
    assert report.n_rows == 8 and report.n_errors == 4 and report.n_warnings == 2 and not report.ok
    dup = next(f for f in report.findings if f.line == 6)
    assert "same text as line 1" in dup.reason
    assert [f.line for f in report.findings] == sorted(f.line or 0 for f in report.findings)


def test_warnings_do_not_refuse(tmp_path):
    rows = [
        {"problem": "What is 1 + 1?", "solution": "\\boxed{2}"},
        {
            "problem": "What is 1 + 1?",
            "solution": "One plus one is two: \\boxed{1} no, \\boxed{2}",
            "id": "x",
        },
        {"problem": "Long?", "solution": "y" * 500 + " \\boxed{3}"},
    ]
    report = validate_file(_lines(tmp_path / "w.jsonl", rows), "math", max_chars_warning=200)
    assert report.ok and report.n_errors == 0
    assert {(f.line, f.field) for f in report.findings} == {(2, "problem"), (3, "solution")}
    assert all(f.severity == "warning" for f in report.findings)


def test_mc_cot_column_is_checked(tmp_path):
    rows = [
        {**_mc("q1"), "cot": "x is right. The answer is B."},
        {**_mc("q2"), "cot": "So the answer is D."},
        _mc("q3"),
    ]
    report = validate_file(_lines(tmp_path / "c.jsonl", rows), "mc")
    assert [(f.line, f.field) for f in report.errors()] == [(2, "cot")]


def test_report_serialises_and_summarises(tmp_path):
    report = validate_file(BAD_DIR / "mc_duplicate_labels.jsonl", "mc")
    d = report.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["ok"] is False and d["n_rows"] == 2 and d["n_errors"] == 1
    assert d["findings"][0] == {
        "line": 2,
        "field": "choices.label",
        "severity": "error",
        "reason": "duplicate label 'B'",
    }
    text = report.summary()
    assert "REFUSED" in text and "line 2 [error] choices.label: duplicate label 'B'" in text
    out = tmp_path / "reports" / "validate.json"
    write_report(report, out)
    assert json.loads(out.read_text(encoding="utf-8")) == d
    assert [p.name for p in out.parent.iterdir()] == ["validate.json"]  # no temporary left behind


def test_summary_truncates():
    r = ValidationReport("f.jsonl", "math", 3)
    r.findings = [Finding(i, "solution", "error", "x") for i in range(1, 8)]
    text = r.summary(max_findings=3)
    assert text.count("\n") == 4 and "and 4 more findings" in text


def test_over_long_line_is_a_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 1000)
    good = {"problem": "What is 2 + 3?", "solution": "\\boxed{5}"}
    rows = [good, {"problem": "x" * 5000, "solution": "\\boxed{1}"}, {"problem": "p", "solution": "no box"}]
    report = validate_file(_lines(tmp_path / "long.jsonl", rows), "math")
    assert [(f.line, f.field) for f in report.errors()] == [(2, None), (3, "solution")]
    assert "longer than 1000 bytes" in report.errors()[0].reason


def test_missing_file_and_unknown_format(tmp_path):
    report = validate_file(tmp_path / "absent.jsonl", "math")
    assert not report.ok and "file not found" in report.findings[0].reason
    with pytest.raises(ValueError, match="unknown format"):
        validate_file(BAD_DIR / "mc_one_choice.jsonl", "csv")  # type: ignore[arg-type]


def test_validate_from_a_worker_thread():
    out: list[ValidationReport] = []
    th = threading.Thread(target=lambda: out.append(validate_file(BAD_DIR / "math_no_boxed.jsonl", "math")))
    th.start()
    th.join(timeout=120)
    assert out and not out[0].ok and out[0].errors()[0].line == EXPECTED["math_no_boxed.jsonl"]["line"]


def test_empty_box_is_a_warning_only_under_the_bad_row_fraction():
    # One empty box in two rows: a warning when half the rows may be bad, refused at the default share (0.001).
    path = BAD_DIR.parent / "warn" / "math_empty_boxed.jsonl"
    report = validate_file(path, "math", max_bad_row_fraction=0.5)
    assert report.ok
    assert [(f.line, f.severity) for f in report.findings if "empty" in f.reason] == [(3, "warning")]
    refused = validate_file(path, "math")
    assert not refused.ok
    assert [(f.line, f.field) for f in refused.errors()] == [(None, "solution"), (3, "solution")]
    assert "1 of 2 rows" in refused.errors()[0].reason
    assert "validate.max_bad_row_fraction=0.001" in refused.errors()[0].reason


MC_REAL = [
    "mc/arc_challenge_dev",
    "mc/arc_challenge_test",
    "mc/arc_challenge_train",
    "mc/csqa_dev",
    "mc/csqa_train",
    "mc/mmlu_professional_psychology_dev",
    "mc/mmlu_professional_psychology_test",
    "mc/mmlu_professional_psychology_val",
    "citer-reference/cqa_test",
]
MATH_REAL = [
    "math/gsm8k_test",
    "math/gsm8k_train",
    "math/math500_test",
    "math/math_test",
    "math/math_train",
    "citer-reference/gsm8k_test",
]
# Rows of math_train.jsonl whose only \boxed{} is empty (the answer was lost upstream in MATH).
MATH_TRAIN_EMPTY_BOX_LINES = [5530, 5532]


@needs_shared_data
@pytest.mark.parametrize(("name", "fmt"), [(n, "mc") for n in MC_REAL] + [(n, "math") for n in MATH_REAL])
def test_real_files_pass(name, fmt):
    report = validate_file(SHARED_DATA / f"{name}.jsonl", fmt)
    print(report.summary())  # the warnings, listed (pytest -s)
    with (SHARED_DATA / f"{name}.jsonl").open(encoding="utf-8") as fh:
        assert report.n_rows == sum(1 for line in fh if line.strip())
    if name == "math/math_train":
        empty = [f for f in report.findings if "empty \\boxed{}" in f.reason]
        assert [f.line for f in empty] == MATH_TRAIN_EMPTY_BOX_LINES
        assert {f.severity for f in empty} == {"error" if jsonl.EMPTY_BOX_SEVERITY == "error" else "warning"}
        assert report.n_errors == len(empty) * (jsonl.EMPTY_BOX_SEVERITY == "error")
        return
    assert report.ok, report.summary()
    assert all(f.severity == "warning" for f in report.findings)


@needs_shared_data
def test_real_duplicate_questions_are_warnings():
    report = validate_file(SHARED_DATA / "mc/mmlu_professional_psychology_test.jsonl", "mc")
    assert report.ok
    assert [(f.line, f.field) for f in report.findings] == [
        (445, "question"),
        (486, "question"),
        (546, "question"),
    ]
