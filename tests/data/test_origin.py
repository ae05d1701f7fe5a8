"""Row provenance: read rows know their file and 1-based line, never leak it, and row errors downstream name it."""

from __future__ import annotations

import copy
import json
import re

import pytest

from citer.data.jsonl import read_jsonl
from citer.data.origin import Row, origin, source
from citer.evaluation.passes import encode_prompts, examples_hash
from citer.evaluation.sweep_rows import SweepError
from citer.routing.label_store import LabelsError
from citer.routing.labels import collect_iter1, encode_rows


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_rows_carry_file_and_line_and_nothing_else(tmp_path):
    a = {"problem": "1 + 1?", "solution": "\\boxed{2}"}
    b = {"problem": "2 + 2?", "solution": "\\boxed{4}", "id": "x"}
    path = _write(tmp_path / "d.jsonl", [json.dumps(a), "", "   ", json.dumps(b)])
    rows = read_jsonl(path, "math")
    assert [origin(r) for r in rows] == [f"{path}:1", f"{path}:4"]  # blank lines count
    assert rows == [a, b] and json.dumps(rows[1]) == json.dumps(b) and dict(rows[1]) == b
    assert source(rows) == str(path) and source([a]) == "rows" and source([]) == "rows"
    assert origin(copy.deepcopy(rows[1])) == f"{path}:4"
    assert origin(a, 2) == "row 3"  # rows built in code: 1-based position
    # The examples hash ignores where rows were read: a moved project measures the same examples.
    moved = [Row(dict(r), "/elsewhere/d.jsonl", r.line) for r in rows]
    assert examples_hash([[1]], rows) == examples_hash([[1]], moved) == examples_hash([[1]], [a, b])


def test_labels_and_sweep_errors_name_file_and_line(tmp_path, tiny_pair):
    slm, llm, tok = tiny_pair
    good = json.dumps(
        {"question": "q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
    )
    path = _write(tmp_path / "mc.jsonl", [good, "", good])
    rows = read_jsonl(path, "mc")
    with pytest.raises(
        LabelsError, match=rf"^{re.escape(str(path))}:3: field 'problem' missing for format 'math'"
    ):
        encode_rows(tok, rows[1:], "math")  # a subset keeps each row's own line
    with pytest.raises(SweepError, match=rf"^{re.escape(str(path))}:1: field 'problem' missing"):
        encode_prompts(tok, rows, "math")
    long = json.dumps({"problem": "x" * 600, "solution": "\\boxed{1}"})
    path = _write(tmp_path / "long.jsonl", [json.dumps({"problem": "1?", "solution": "\\boxed{1}"}), long])
    from citer.config import LabelsParams

    with pytest.raises(LabelsError, match=rf"^{re.escape(str(path))}:2: field prompt\+target has \d+ tokens"):
        collect_iter1(
            slm, llm, tok, read_jsonl(path, "math"), "math", LabelsParams(citer_s=True, batch_size=1)
        )
