"""An LLM at or near chance on the data stops the pipeline after eval_models, in one line (a param overrides)."""

from __future__ import annotations

import pytest
from conftest import write_pair_project

from citer.models.chance import PairCannotDoData, chance_accuracy, check_llm_above_chance


def test_chance_is_what_guessing_scores():
    mc = [{"choices": {"label": list("ABCD")}}, {"choices": {"label": ["A", "B"]}}]
    assert chance_accuracy(mc, "mc") == pytest.approx((0.25 + 0.5) / 2)
    assert chance_accuracy([{"problem": "x"}], "math") == 0.0


def test_an_llm_at_chance_is_refused_unless_the_margin_is_null():
    check_llm_above_chance(0.31, 0.25, 0.05, 200, "m")  # above chance + margin: goes on
    with pytest.raises(PairCannotDoData, match=r"answers 30\.0% of 200 test questions, at or near chance"):
        check_llm_above_chance(0.30, 0.25, 0.05, 200, "m")
    with pytest.raises(PairCannotDoData, match="this pair cannot do this data"):
        check_llm_above_chance(
            0.0, 0.0, 0.0, 12, "m"
        )  # 0% on free-form answers: at chance even with no margin
    check_llm_above_chance(0.0, 0.0, None, 12, "m")  # null: never stops


def test_eval_models_stops_on_an_llm_at_chance(prefect_server, project, tiny_pair_dirs):
    """The tiny random pair answers none of its test questions: `citer eval models` writes reports/models.json,
    then exits 1 with one line; with eval.llm_chance_margin null it goes on."""
    import json

    from typer.testing import CliRunner

    from citer.cli import app

    write_pair_project(
        project, tiny_pair_dirs, {"eval": {"llm_chance_margin": 0.05, "max_new_tokens": 4}}, n=8
    )
    res = CliRunner().invoke(app, ["eval", "models"])
    assert res.exit_code == 1, res.output
    # (this process imported transformers before the CLI could turn its weight-loading bars off)
    lines = [x for x in res.output.splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error: the LLM (models/llm) answers 0.0% of 8"), lines
    assert "this pair cannot do this data" in lines[0]
    assert json.loads((project / "reports" / "models.json").read_text())["llm"]["test_accuracy"] == 0.0

    params = project / "params.yaml"
    params.write_text(params.read_text().replace("llm_chance_margin: 0.05", "llm_chance_margin: null"))
    res = CliRunner().invoke(app, ["eval", "models"])
    assert res.exit_code == 0, res.output
