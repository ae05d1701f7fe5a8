"""Multiple-choice grading by routed log-likelihood: the library call and ``citer eval loglikelihood``."""

from __future__ import annotations

import json

import pytest
from conftest import spread_router
from typer.testing import CliRunner

from citer.data.prompts import build_prompt
from citer.decoding.engine import RoutedEngine
from citer.decoding.scoring import routed_loglikelihood
from citer.evaluation.loglikelihood import choice_continuations, grade_mc

QUESTIONS = ["2 + 2", "7 - 3", "1 + 5", "9 - 9", "3 + 3", "4 + 1"]


def _rows() -> list[dict]:
    return [
        {
            "id": f"q{i}",
            "question": q,
            "choices": {"label": ["A", "B", "C"], "text": ["4", "5", "6"]},
            "answerKey": "A",
        }
        for i, q in enumerate(QUESTIONS)
    ]


def test_the_likeliest_choice_under_the_routed_policy_is_the_answer(tiny_pair):
    slm, llm, tok = tiny_pair
    engine = RoutedEngine(slm, llm, spread_router(slm.config.hidden_size), tau=0.5)
    rows = _rows()
    best = []
    for i, r in enumerate(
        rows
    ):  # the answer each row gets, one choice at a time through the single-text call
        ctx = tok.encode(build_prompt(r, "mc"), add_special_tokens=False)
        totals = [
            routed_loglikelihood(engine, ctx, tok.encode(c, add_special_tokens=False), row_id=i).total
            for c in choice_continuations(r)
        ]
        best.append("ABC"[totals.index(max(totals))])
    for i, r in enumerate(rows):  # half the golds are the likeliest choice, half not
        r["answerKey"] = best[i] if i % 2 else next(lab for lab in "ABC" if lab != best[i])
    out = grade_mc(engine, tok, rows, batch_rows=4)
    assert [p["pred"] for p in out["predictions"]] == best
    assert out["accuracy"] == pytest.approx(0.5) and out["n_examples"] == len(rows)
    assert 0.0 < out["llm_token_fraction"] < 1.0  # both models scored
    assert [p["pred"] for p in grade_mc(engine, tok, rows, batch_rows=1)["predictions"]] == best
    assert choice_continuations(rows[0]) == [" The answer is A.", " The answer is B.", " The answer is C."]


def test_citer_eval_loglikelihood_grades_with_the_champion(champion_project):
    from citer.cli import app

    data = champion_project / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    res = CliRunner().invoke(app, ["eval", "loglikelihood", str(data), "--limit", "4"])
    assert res.exit_code == 0, res.output
    lines = dict(line.split(": ", 1) for line in res.stdout.strip().splitlines())
    assert lines["n_examples"] == "4" and lines["router"].endswith("/1")
    assert 0.0 <= float(lines["accuracy"]) <= 1.0
