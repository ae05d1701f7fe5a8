"""`citer data validate` end to end: a real Prefect flow run, a real MLflow sqlite store, exit codes."""

import json

import pytest
from conftest import FIXTURES
from typer.testing import CliRunner

from citer.cli import app

BAD = FIXTURES / "bad"
runner = CliRunner()


@pytest.fixture()
def good_file(project):
    f = project / "good.jsonl"
    f.write_text(json.dumps({"problem": "1 + 1?", "solution": "1 + 1 = 2. \\boxed{2}"}) + "\n")
    return f


def test_validate_stage_exit_0_and_tracked(prefect_server, project, good_file):
    (project / "params.yaml").write_text(
        "data: {format: math, train: good.jsonl, dev: good.jsonl, test: good.jsonl}\n"
    )
    res = runner.invoke(app, ["data", "validate"])
    assert res.exit_code == 0, res.output
    report = json.loads((project / "reports" / "validation.json").read_text())
    assert report["files"][0]["ok"] and report["files"][0]["n_rows"] == 1
    assert report["files"][0]["path"] == "good.jsonl"  # relative to the project root, as every record
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["citer"])
    assert list(runs["tags.citer.stage"]) == ["validate"]
    assert str(project) not in runs["params.files"].iloc[0]
    assert runs["metrics.n_rows"].iloc[0] == 3


def test_validate_paths_is_a_quick_untracked_check(project, good_file):
    res = runner.invoke(app, ["data", "validate", str(good_file), "--format", "math"])
    assert res.exit_code == 0, res.output
    assert "1 rows, 0 errors" in res.output
    # no flow, no MLflow store, and the stage's report is not overwritten by an ad-hoc check
    assert not (project / "mlflow.db").exists() and not (project / "reports").exists()
    res = runner.invoke(app, ["data", "validate", str(good_file), "-f", "math", "--report", "check.json"])
    assert json.loads((project / "check.json").read_text())["files"][0]["n_rows"] == 1


def test_validate_bad_file_exit_1(project, good_file):
    bad = BAD / "mc_duplicate_labels.jsonl"
    res = runner.invoke(app, ["data", "validate", str(good_file), str(bad), "--format", "mc"])
    assert res.exit_code == 1
    assert "refused" in res.output


def test_validate_usage_errors_exit_2(project, good_file):
    assert runner.invoke(app, ["data", "validate", str(good_file)]).exit_code == 2
    assert runner.invoke(app, ["data", "validate", str(good_file), "--format", "csv"]).exit_code == 2


def test_bad_params_named(project, good_file):
    (project / "params.yaml").write_text("router:\n  lrr: 1\n")
    res = runner.invoke(app, ["data", "validate", str(good_file), "--format", "math"])
    assert res.exit_code == 1
    assert "router.lrr" in res.output
