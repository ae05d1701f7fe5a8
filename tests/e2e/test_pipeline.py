"""The whole pipeline, for real, on a shrunken embedded default: one `citer pipeline` (Prefect + MLflow), then the
batch-inference resume and the registry state it leaves behind."""

from __future__ import annotations

import json

import pytest
from conftest import write_tiny_params
from typer.testing import CliRunner

from citer.cli import app


@pytest.mark.slow
def test_pipeline_end_to_end(prefect_server, project):
    write_tiny_params(project)
    runner = CliRunner()
    res = runner.invoke(app, ["pipeline"])
    assert res.exit_code == 0, res.output + repr(res.exception)

    rep = project / "reports"
    models = json.loads((rep / "models.json").read_text())
    assert set(models) == {"slm", "llm"}
    # wall-clock figures are facts of the run, kept apart from the result files (which two runs write alike)
    facts = json.loads((rep / "provenance.json").read_text())["run_facts"]
    assert facts["bootstrap"]["llm_pretrain_seconds"] > 0 and facts["eval_models"]["seconds"] > 0
    assert facts["sweep"]["mlflow_run_id"] and facts["sweep"]["rows"]["test"][0][2]["sec_per_token"] > 0
    for f in ("bootstrap.json", "finetune.json", "models.json", "sweep.json", "sweep_details.json"):
        assert "seconds" not in (rep / f).read_text().replace("gpu_sec_per_token", ""), f
    assert models["llm"]["params"] > models["slm"]["params"]
    router = json.loads((rep / "router.json").read_text())
    assert [it["iteration"] for it in router["iterations"]] == [1, 2]
    for it in router["iterations"]:
        assert {"iteration", "n_tokens", "case_counts", "val_auc", "val_loss"} <= set(it)
    sweep = json.loads((rep / "sweep.json").read_text())
    from citer.evaluation.sweep_rows import SWEEP_KEYS

    assert all(list(r) == list(SWEEP_KEYS) for r in sweep)
    methods = {"citer", "citer_iter1", "citer_s", "oracle", "slm", "llm", "random", "confidence", "query"}
    assert methods | {"speculative"} <= {r["method"] for r in sweep}
    assert all(r["accuracy_ci"] is not None and r["bytes_ci"] is not None for r in sweep)
    assert (rep / "pareto.png").stat().st_size > 0
    dev = json.loads((rep / "sweep_dev.json").read_text())
    details = json.loads((rep / "sweep_details.json").read_text())
    assert {r["examples_hash"] for r in dev}.isdisjoint(
        {r["examples_hash"] for r in details}
    )  # chosen on dev
    claims = json.loads((rep / "sweep_claims.json").read_text())
    assert claims["protocol"]["selected_on"] == "dev" and "oracle_ratio" in claims and "savings" in claims
    # every row and claim priced at the reference pair too; the router width chosen on dev among the grid's
    assert all(r["priced_at"] == "Qwen2-1.5B/Qwen2-72B bf16" and r["bytes_priced_ci"] for r in sweep)
    assert claims["priced"]["oracle_ratio"]["statement"].startswith("Priced at Qwen2-1.5B/Qwen2-72B bf16: ")
    widths = claims["protocol"]["router_layers"]
    assert set(widths["grid"]) == {"citer@w2-1", "citer@w0.5", "citer@w0.25", "citer@linear"}
    assert widths["chosen"] in widths["grid"] and widths["selected_on"] == "dev"
    for tag in ("w0.5", "w0.25", "linear"):
        assert (project / "artifacts" / "routers" / f"layers_{tag}" / "router.json").is_file()
    promotion = json.loads((rep / "promotion.json").read_text())
    assert promotion["selected_on"] == "dev"

    preds = (project / "outputs" / "predictions.jsonl").read_text().splitlines()
    assert len(preds) == 24 and all("response" in json.loads(x) for x in preds)

    # The tiny params' rule (best accuracy under 0.99 x LLM-only bytes) always has a τ, so a fresh project promotes
    # its first version: the resume and tamper checks below need that champion and must not pass without one.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project}/mlflow.db")
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name='citer-router'")
    assert len(versions) == 1 and versions[0].tags["slm"].endswith("models/slm")
    assert promotion["promoted"] == 1, promotion["reason"]
    champion = client.get_model_version_by_alias("citer-router", "champion")
    assert str(champion.version) == str(versions[0].version) == promotion["version"]
    runs = mlflow.search_runs(experiment_names=["citer"])
    parent = runs[runs["tags.citer.stage"] == "pipeline"]
    assert len(parent) == 1
    nested = runs[runs["tags.mlflow.parentRunId"] == parent["run_id"].iloc[0]]
    assert {"validate", "bootstrap_models", "finetune_slm", "labels_iter2", "router_iter2", "sweep"} <= set(
        nested["tags.citer.stage"]
    )

    # The claims across router seeds (a command of its own, after the sweep): both pricings, both seeds.
    res = runner.invoke(app, ["eval", "stability"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    stab = json.loads((rep / "stability.json").read_text())
    assert stab["seeds"] == [0, 1] and stab["passes_reused"] == 0  # one extra seed: nothing to hand back yet
    assert set(stab["claims"]) == {"measured", "priced"} and stab["claims"]["priced"]
    assert set(stab["claims"]["measured"]["citer: oracle_ratio"]["by_seed"]) == {"0", "1"}
    prov = json.loads((rep / "provenance.json").read_text())
    assert prov["files"]["reports/stability.json"]["stage"] == "stability"

    # A rerun of batch inference resumes: nothing left to decode, same file.
    before = (project / "outputs" / "predictions.jsonl").read_bytes()
    res = runner.invoke(app, ["--json", "route"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["n_skipped"] == 24
    assert (project / "outputs" / "predictions.jsonl").read_bytes() == before
    # A champion changed in the artifact store is refused even when nothing is left to decode (fail closed).
    stored = list((project / "mlartifacts").rglob("router.json"))  # the model's copy and its run's
    assert stored
    for art in stored:
        art.write_text(art.read_text().replace("{", '{"tampered": true, ', 1))
    res = runner.invoke(app, ["route"])
    assert res.exit_code == 1 and "sha256" in res.output, res.output
    assert (project / "outputs" / "predictions.jsonl").read_bytes() == before
