"""A copied project is self-contained: its own store, artifacts, models and champion, and nothing names the original."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

import pytest
from typer.testing import CliRunner

from citer.cli import app


def _mentions(path: Path, needle: str) -> bool:
    """Whether ``needle`` (plain or percent-encoded, as file URIs hold it) occurs in the bytes of ``path``."""
    data = path.read_bytes()
    return needle.encode() in data or quote(needle).encode() in data


@pytest.mark.slow  # a champion project, a Prefect flow (`citer route`) and several model loads: ~30 s
def test_copied_project_uses_its_own_store_models_and_champion(
    champion_project, prefect_server, tmp_path, monkeypatch
):
    import mlflow

    from citer.project import load_project
    from citer.serving.champion import load_champion
    from citer.tracking.alias import get_alias
    from citer.tracking.registry import champion_to_compare
    from citer.tracking.store import open_store
    from flows.common import stage_run

    original = str(champion_project)
    copy = tmp_path / "copy"
    shutil.copytree(champion_project, copy)
    champion_project.rename(tmp_path / "moved-away")  # anything still pointing at the original now fails
    monkeypatch.chdir(copy)
    # A fresh process in the copy: MLflow exports the tracking URI it last used (the original's) to the environment.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    proj = load_project()
    assert proj.tracking_uri == f"sqlite:///{copy}/mlflow.db"

    # The registry records the pair relative to the root; the copy's champion loads the copy's models.
    engine, tok, info = load_champion(proj)
    assert info["slm"] == str(copy / "models" / "slm") and info["llm"] == str(copy / "models" / "llm")
    assert engine.generate(tok.encode("Question: 1\nAnswer:", add_special_tokens=False), 3).tokens[0]

    # The copy's registry entry loads from the copy's artifacts (the original's are gone).
    rv = get_alias(proj.params.registry.model_name, "champion", proj.tracking_uri)
    local = mlflow.artifacts.download_artifacts(
        f"models:/{rv.name}/{rv.version}", dst_path=str(tmp_path / "dl")
    )
    assert (Path(local) / "MLmodel").is_file()

    # A new run logs into the copy's own mlartifacts.
    note = copy / "note.txt"
    note.write_text("hello")
    with stage_run(proj, "portable-check") as run:
        run.artifact(note)
    artifact_uri = mlflow.MlflowClient(proj.tracking_uri).get_run(run.run_id).info.artifact_uri
    assert artifact_uri.startswith((copy / "mlartifacts").as_uri()), artifact_uri
    assert (copy / "mlartifacts" / run.run_id / "artifacts" / "note.txt").is_file()

    # The sweep sees the copy's champion as its own: comparable on the same SLM.
    champ = champion_to_compare(
        proj.params.registry.model_name,
        "champion",
        slm=proj.portable_ref(proj.slm_name),
        hidden_size=32,
        tracking_uri=open_store(proj),
        root=proj.root,
    )
    assert champ.router_and_tau is not None, champ.note

    # `citer route` runs on the copy's champion and writes the copy's predictions.
    (copy / "q.jsonl").write_text(json.dumps({"problem": "1 + 2", "solution": "\\boxed{3}"}) + "\n")
    res = CliRunner().invoke(app, ["route", "--input", "q.jsonl", "--output", "reports/pred.jsonl"])
    assert res.exit_code == 0, res.output
    assert json.loads((copy / "reports" / "pred.jsonl").read_text().splitlines()[0])["n_tokens"] >= 1

    # Nothing the copy recorded names the original: not the store, not a tag, not a report.
    assert not _mentions(copy / "mlflow.db", original)
    with sqlite3.connect(copy / "mlflow.db") as con:
        tags = dict(con.execute("SELECT key, value FROM model_version_tags"))
    assert tags["slm"] == "models/slm" and tags["llm"] == "models/llm"
    for f in (copy / "reports").rglob("*"):
        assert not (f.is_file() and _mentions(f, original)), f


def test_params_naming_another_pair_are_refused_in_one_line(champion_project, tmp_path):
    """route/serve use the champion's pair: params naming other models get one line naming both pairs."""
    import yaml

    from citer.project import load_project
    from citer.serving.champion import load_champion
    from citer.tracking.deployed import ChampionError

    shutil.copytree(champion_project / "models" / "llm", champion_project / "models" / "llm_other")
    params = yaml.safe_load((champion_project / "params.yaml").read_text())
    params["models"]["llm"] = "models/llm_other"
    (champion_project / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ChampionError) as err:
        load_champion(load_project())
    msg = str(err.value)
    assert "\n" not in msg
    assert "champion citer-router v1 was trained for slm=models/slm, llm=models/llm" in msg
    assert "params name slm=models/slm (models.finetuned_slm), llm=models/llm_other (models.llm)" in msg

    # The same directory named absolutely is the same model: no refusal.
    params["models"]["llm"] = str(champion_project / "models" / "llm")
    (champion_project / "params.yaml").write_text(yaml.safe_dump(params))
    assert load_champion(load_project()).info["llm"] == str(champion_project / "models" / "llm")
