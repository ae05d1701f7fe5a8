"""citer.data.formats: the JSONL reader refuses malformed files with line and field, and accepts the benign quirks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, SHARED_DATA, needs_shared_data

from citer.data import jsonl
from citer.data.jsonl import DataError, iter_lines, iter_raw_lines, read_jsonl
from citer.ops.io import write_jsonl

BAD_DIR = FIXTURES / "bad"
EXPECTED = json.loads((BAD_DIR / "expected.json").read_text(encoding="utf-8"))["files"]

MC_ROW = {
    "question": "Which gas do plants absorb?",
    "choices": {"text": ["oxygen", "CO2"], "label": ["A", "B"]},
}
MC_ROW["answerKey"] = "B"
MATH_ROW = {"problem": "What is 2 + 3?", "solution": "2 + 3 = 5.\n\\boxed{5}"}


def test_every_bad_fixture_is_listed():
    on_disk = {p.name for p in BAD_DIR.glob("*.jsonl")}
    assert on_disk == set(EXPECTED)
    assert len(on_disk) >= 20
    assert {e["format"] for e in EXPECTED.values()} == {"mc", "math"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_read_jsonl_refuses_bad_file(name):
    exp = EXPECTED[name]
    with pytest.raises(DataError) as info:
        read_jsonl(BAD_DIR / name, exp["format"])
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.line, err.field) == (exp["line"], exp["field"]), str(err)
    assert exp["reason"] in err.reason
    # The message names the file, the line and the field.
    where = f"{BAD_DIR / name}:{exp['line']}" if exp["line"] is not None else str(BAD_DIR / name)
    assert str(err).startswith(where + ": ")
    if exp["field"] is not None:
        assert f"field {exp['field']!r}" in str(err)


def test_error_message_format():
    err = DataError("data.jsonl", 12, "choices.label", "duplicate label 'B'")
    assert str(err) == "data.jsonl:12: field 'choices.label': duplicate label 'B'"
    assert str(DataError("d.jsonl", None, None, "no rows")) == "d.jsonl: no rows"


def _write_bytes(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_bytes(data)
    return p


def test_crlf_bom_blank_lines_and_extra_keys_are_accepted(tmp_path):
    row2 = {"id": "q2", "question_concept": "water", **MC_ROW, "question": "What is ice?"}
    data = (
        b"\xef\xbb\xbf"
        + json.dumps(MC_ROW).encode()
        + b"\r\n\r\n   \r\n"
        + json.dumps(row2, ensure_ascii=False).encode()
        + b"\r\n\n"
    )
    rows = read_jsonl(_write_bytes(tmp_path, data), "mc")
    assert rows == [MC_ROW, row2]
    assert rows[1]["id"] == "q2" and rows[1]["question_concept"] == "water"


def test_last_line_without_newline_is_accepted(tmp_path):
    data = (json.dumps(MATH_ROW) + "\n" + json.dumps(MATH_ROW)).encode()
    assert len(read_jsonl(_write_bytes(tmp_path, data), "math")) == 2


def test_several_boxes_and_mc_cot_are_accepted(tmp_path):
    math_row = {"problem": "p", "solution": "First $\\boxed{2}$ then $x = \\boxed{\\frac{1}{\\{2\\}}}$."}
    p = tmp_path / "m.jsonl"
    write_jsonl(p, [math_row])
    assert read_jsonl(p, "math") == [math_row]
    mc_row = {**MC_ROW, "cot": "Plants absorb carbon dioxide. The answer is B."}
    write_jsonl(p, [mc_row])
    assert read_jsonl(p, "mc") == [mc_row]


def test_unicode_and_escaped_control_chars_are_fine(tmp_path):
    row = {"problem": "Janet’s ducks lay 16 eggs\tdaily – ¿cuántos?", "solution": "\\boxed{18}"}
    p = tmp_path / "u.jsonl"
    write_jsonl(p, [row])  # json.dumps escapes the tab, so the line holds no raw control character
    assert read_jsonl(p, "math") == [row]


def test_write_jsonl_failing_midway_keeps_the_old_file(tmp_path):
    """The writer is atomic: a row that cannot be serialised leaves the previous file whole and no temporary."""
    p = tmp_path / "rows.jsonl"
    write_jsonl(p, [MATH_ROW])
    before = p.read_bytes()
    with pytest.raises(TypeError):
        write_jsonl(p, [MATH_ROW, {"problem": object()}])
    assert p.read_bytes() == before
    assert read_jsonl(p, "math") == [MATH_ROW]
    assert [q.name for q in tmp_path.iterdir()] == ["rows.jsonl"]


def test_every_problem_of_a_line_is_reported(tmp_path):
    bad = {"question": "", "choices": {"text": ["a", 3], "label": "AB"}}
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps(MC_ROW) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    parsed = list(iter_lines(p, "mc"))
    assert [x.line for x in parsed] == [1, 2]
    assert parsed[0].row == MC_ROW and not parsed[0].problems
    assert parsed[1].row is None
    fields = {pr.field for pr in parsed[1].problems}
    assert fields == {"question", "answerKey", "choices.text[1]", "choices.label"}


def test_over_long_line_is_refused_and_skipped(tmp_path):
    # A real 9 MiB line against the real 8 MiB limit: reported, skipped, and the next line still read.
    p = tmp_path / "long.jsonl"
    big = json.dumps({"problem": "x" * (9 * 1024 * 1024), "solution": "\\boxed{1}"})
    with p.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps(MATH_ROW) + "\n" + big + "\n" + json.dumps(MATH_ROW) + "\n")
    raws = list(iter_raw_lines(p))
    assert [r.line for r in raws] == [1, 2, 3]
    assert raws[1].text is None and f"longer than {jsonl.MAX_LINE_BYTES} bytes" in (raws[1].problem or "")
    assert raws[2].text == json.dumps(MATH_ROW)
    with pytest.raises(DataError) as info:
        read_jsonl(p, "math")
    assert info.value.line == 2 and "longer than" in info.value.reason


def test_small_line_limit_skips_in_chunks(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text(json.dumps(MATH_ROW) + "\n" + "y" * 1000 + "\n" + json.dumps(MATH_ROW), encoding="utf-8")
    parsed = list(iter_lines(p, "math", max_line_bytes=200))
    assert [(x.line, x.row is None) for x in parsed] == [(1, False), (2, True), (3, False)]


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        read_jsonl(BAD_DIR / "mc_one_choice.jsonl", "csv")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="file not found"):
        read_jsonl(tmp_path / "nope.jsonl", "math")


REAL_FILES = [
    *[(f"mc/{n}", "mc") for n in ("arc_challenge_dev", "csqa_dev", "mmlu_professional_psychology_val")],
    *[(f"math/{n}", "math") for n in ("gsm8k_test", "math500_test")],
    ("citer-reference/cqa_test", "mc"),
    ("citer-reference/gsm8k_test", "math"),
]


@needs_shared_data
@pytest.mark.parametrize(("name", "fmt"), REAL_FILES)
def test_real_files_read(name, fmt):
    path = SHARED_DATA / f"{name}.jsonl"
    rows = read_jsonl(path, fmt)
    with path.open(encoding="utf-8") as fh:
        assert len(rows) == sum(1 for line in fh if line.strip())
    if name == "citer-reference/cqa_test":
        assert {"id", "question_concept"} <= set(rows[0])  # extra keys kept


@pytest.mark.parametrize(("fmt", "other"), [("mc", "math"), ("math", "mc")])
def test_a_file_mixing_both_formats_is_refused_in_one_line(tmp_path, synth_rows, fmt, other):
    """One project routes one format: a row of the other one is named as such, not as a list of missing keys."""
    f = tmp_path / "mixed.jsonl"
    write_jsonl(f, synth_rows[f"{fmt}_train"][:2] + synth_rows[f"{other}_train"][:1])
    with pytest.raises(DataError) as err:
        read_jsonl(f, fmt)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{f}:3: ")
    assert f"{other} row" in msg and "a file holds one format (data.format" in msg
    assert "missing required key" not in msg
