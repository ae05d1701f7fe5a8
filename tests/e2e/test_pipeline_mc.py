"""The multiple-choice form end to end: one `citer pipeline` on the embedded mc splits with a pair bootstrapped on
both forms (reduced sizes), then the labels, routers, sweep with intervals, promotion and the graded batch
inference it leaves behind."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import write_tiny_params
from typer.testing import CliRunner

from citer.cli import app

MC = {
    "data": {
        "format": "mc",
        "train": "data/embedded/mc_train.jsonl",
        "dev": "data/embedded/mc_dev.jsonl",
        "test": "data/embedded/mc_test.jsonl",
    },
    "bootstrap": {"formats": ["math", "mc"]},
}


@pytest.mark.slow
def test_pipeline_on_the_mc_form(prefect_server, project):
    path = write_tiny_params(project)
    params = yaml.safe_load(path.read_text())
    params["data"] = MC["data"]
    params["bootstrap"]["formats"] = MC["bootstrap"]["formats"]
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    runner = CliRunner()
    res = runner.invoke(app, ["pipeline"])
    assert res.exit_code == 0, res.output + repr(res.exception)

    rep = project / "reports"
    boot = json.loads((rep / "bootstrap.json").read_text())
    assert boot["n_train_texts"] == 2 * params["synth"]["n_train"]  # the pair learned both forms
    models = json.loads((rep / "models.json").read_text())
    assert {"slm", "llm"} <= set(models) and models["llm"]["params"] > models["slm"]["params"]

    # Labels and routers on mc questions: the shortcut's cases are counted, the routers trained.
    router = json.loads((rep / "router.json").read_text())
    assert [it["iteration"] for it in router["iterations"]] == [1, 2]
    for it in router["iterations"]:
        assert it["n_tokens"] > 0 and it["val_auc"] is not None

    # The sweep on the mc test split: every method with its intervals, chosen on dev.
    sweep = json.loads((rep / "sweep.json").read_text())
    assert {"citer", "citer_s", "oracle", "slm", "llm", "random", "confidence", "query", "speculative"} <= {
        r["method"] for r in sweep
    }
    assert all(r["accuracy_ci"] is not None and r["bytes_ci"] is not None for r in sweep)
    claims = json.loads((rep / "sweep_claims.json").read_text())
    assert claims["protocol"]["selected_on"] == "dev"
    promotion = json.loads((rep / "promotion.json").read_text())
    assert promotion["selected_on"] == "dev" and promotion["promoted"] == 1, promotion["reason"]

    # Batch inference routed the mc test split and graded every answer against its label.
    preds = [json.loads(x) for x in (project / "outputs" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 24 and all("correct" in p and "error" not in p for p in preds)
    test_rows = [json.loads(x) for x in (project / MC["data"]["test"]).read_text().splitlines()]
    from citer.data.answers import grade

    for p, row in zip(preds, test_rows, strict=True):
        assert p["answer"] is None or p["answer"] in row["choices"]["label"] or p["answer"].isdigit()
        assert p["correct"] == grade(p["response"], row, "mc")
