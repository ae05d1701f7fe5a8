"""`citer route` as a side run leaves the project alone; as the pipeline's own stage it always ends with an outcome,
a champion or none (an empty predictions file saying why, exit 0, the closing table leading with the reason)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import REPO
from typer.testing import CliRunner

from citer.cli import app

QUESTIONS = [{"problem": "1 + 2", "solution": "\\boxed{3}"}, {"problem": "4 + 1", "solution": "\\boxed{5}"}]


def _files(root: Path) -> dict[str, float]:
    """Every file of the project but tool state, with its modification time."""
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and ".state" not in p.parts
    }


def _runs(root: Path) -> list[str]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("citer")
    return [] if exp is None else [r.info.run_name for r in client.search_runs([exp.experiment_id])]


def test_a_side_run_writes_only_its_output_and_summary(champion_project, prefect_server):
    (champion_project / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QUESTIONS))
    before = _files(champion_project)
    res = CliRunner().invoke(app, ["route", "--input", "q.jsonl", "--output", "mine/out.jsonl"])
    assert res.exit_code == 0, res.output
    after = _files(champion_project)
    changed = {f for f in after if before.get(f) != after[f]}
    assert changed == {"mine/out.jsonl", "mine/out.jsonl.meta.json", "mine/out.jsonl.summary.json"}, changed
    summary = json.loads((champion_project / "mine" / "out.jsonl.summary.json").read_text())
    assert summary["n"] == 2 and summary["router_version"] == "1" and summary["input"].endswith("q.jsonl")
    assert "the run so far" not in res.output and "report" not in res.output  # not the project's headline
    assert "batch_inference" not in _runs(champion_project)

    res = CliRunner().invoke(
        app, ["route", "--input", "q.jsonl"]
    )  # where would it write? not the project's file
    assert res.exit_code == 2 and "--input needs --output" in res.output

    # The embedded pair knows its task only: a question from elsewhere is routed, and named.
    odd = {"problem": "Jane has 3 oranges and eats 2. How many oranges now?", "solution": "\\boxed{1}"}
    (champion_project / "odd.jsonl").write_text(json.dumps(odd) + "\n" + json.dumps(QUESTIONS[0]) + "\n")
    res = CliRunner().invoke(app, ["route", "--input", "odd.jsonl", "--output", "mine/odd.jsonl"])
    assert res.exit_code == 0, res.output
    want = "warning: 1 of 2 questions use words or numbers the embedded task never has (Jane, eats, oranges)"
    assert want in res.output and "outside_task: 1" in res.output


def test_without_a_champion_the_batch_stage_ends_with_an_empty_file_saying_why(project, prefect_server):
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    test = project / "data" / "embedded" / "math_test.jsonl"
    test.parent.mkdir(parents=True)
    test.write_text("".join(json.dumps(r) + "\n" for r in QUESTIONS))
    reports = project / "reports"
    reports.mkdir()
    for f in ("models.json", "sweep.json", "sweep_claims.json"):
        shutil.copy(REPO / "reports" / f, reports / f)
    reason = "no tau of the candidate meets the rule min_bytes_at_accuracy on dev; alias unchanged"
    (reports / "promotion.json").write_text(json.dumps({"promoted": 0, "reason": reason, "accuracy": None}))

    res = CliRunner().invoke(app, ["route"])
    assert res.exit_code == 0, res.output
    status = f"no champion: {reason} (reports/promotion.json)"
    assert f"status: {status}" in res.output
    out = project / "outputs" / "predictions.jsonl"
    assert out.read_text() == ""  # empty and valid: zero rows
    assert json.loads(out.with_name("predictions.jsonl.meta.json").read_text())["status"] == status
    table = res.output.split("the run so far:\n", 1)[1].splitlines()
    assert table[0].strip().startswith(f"no champion: {reason}"), table  # the closing table leads with it
    assert "route" in json.loads((reports / "provenance.json").read_text())["runs"]  # the project's own stage
    assert "batch_inference" in _runs(project)
    assert "no champion" in (reports / "report.html").read_text()
