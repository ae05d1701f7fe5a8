"""The registry against a real MLflow sqlite store: register a router version, aliases, champion checks."""

import numpy as np
import pytest
import torch

from citer.routing.mlp import MLPRouter, save_router
from citer.tracking.alias import get_alias, set_alias
from citer.tracking.registry import (
    champion_to_compare,
    load_router_version,
    publish_router,
    register_router,
    require_champion,
)
from citer.tracking.store import RegistryError


def _router_dir(tmp_path, slm, llm, seed=0):
    torch.manual_seed(seed)
    r = MLPRouter(8).eval()
    return save_router(r, tmp_path / f"router{seed}", {"slm": str(slm), "llm": str(llm), "iteration": 2}), r


def test_register_load_and_alias(store, tmp_path):
    client, exp = store
    slm, llm = tmp_path / "slm", tmp_path / "llm"
    slm.mkdir()
    llm.mkdir()
    rdir, router = _router_dir(tmp_path, slm, llm)
    run = client.create_run(exp)
    tags = {"slm": str(slm), "llm": str(llm), "tau": 0.4, "hidden_size": 8, "iteration": 2}
    rv = register_router(rdir, model_name="r", run_id=run.info.run_id, tags=tags)
    assert rv.version == "1" and rv.tau == 0.4
    assert get_alias("r", "champion") is None
    with pytest.raises(RegistryError, match="run the sweep stage"):
        require_champion("r", "champion")
    set_alias("r", "champion", rv.version)
    champ = require_champion("r", "champion")
    assert champ.version == "1" and champ.tags["slm"] == str(slm)
    loaded = load_router_version(champ)
    x = torch.randn(5, 8)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), router(x).numpy(), rtol=1e-6)
    # the model artifacts hold no pickle
    import mlflow

    local = mlflow.artifacts.download_artifacts(rv.source)
    from pathlib import Path

    assert not [p for p in Path(local).rglob("*") if p.suffix in (".pkl", ".pickle")]


def test_champion_with_missing_models(store, tmp_path):
    client, exp = store
    slm, llm = tmp_path / "gone_slm", tmp_path / "gone_llm"
    rdir, _ = _router_dir(tmp_path, slm, llm, seed=1)
    run = client.create_run(exp)
    rv = register_router(
        rdir, model_name="m", run_id=run.info.run_id, tags={"slm": str(slm), "llm": str(llm), "tau": 0.5}
    )
    set_alias("m", "champion", rv.version)
    with pytest.raises(RegistryError, match="no longer exists"):
        require_champion("m", "champion")


def test_register_refuses_non_router_dir(store, tmp_path):
    client, exp = store
    run = client.create_run(exp)
    with pytest.raises(RegistryError, match="missing router.safetensors"):
        register_router(tmp_path, model_name="x", run_id=run.info.run_id, tags={})


def test_publish_moves_the_alias_only_when_promoted(store, tmp_path):
    client, exp = store
    rdir, _ = _router_dir(tmp_path, "models/slm", "models/llm")
    tags = {"slm": "models/slm", "llm": "models/llm", "tau": 0.3}

    def publish(promote: bool) -> str:
        run_id = client.create_run(exp).info.run_id
        return publish_router(
            rdir, model_name="p", alias="champion", run_id=run_id, tags=tags, promote=promote
        ).version

    assert publish(False) == "1" and get_alias("p", "champion") is None
    assert publish(True) == "2" and get_alias("p", "champion").version == "2"
    assert publish(False) == "3"
    assert get_alias("p", "champion").version == "2"  # a registered loser leaves the alias where it was


def test_champion_to_compare_only_for_the_same_slm_and_hidden_size(store, tmp_path):
    client, exp = store
    none = champion_to_compare("c", "champion", slm="models/slm", hidden_size=8)
    assert none.version is None and none.router_and_tau is None and none.note == "no champion yet"
    rdir, router = _router_dir(tmp_path, "models/slm", "models/llm")
    tags = {"slm": "models/slm", "llm": "models/llm", "tau": 0.4}
    run = client.create_run(exp).info.run_id
    publish_router(rdir, model_name="c", alias="champion", run_id=run, tags=tags, promote=True)

    same = champion_to_compare("c", "champion", slm="models/slm", hidden_size=8)
    loaded, tau = same.router_and_tau
    assert (
        same.version.version == "1"
        and tau == 0.4
        and "champion v1 re-evaluated: τ chosen on dev" in same.note
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), router(x))

    other_slm = champion_to_compare("c", "champion", slm="models/other", hidden_size=8)
    assert other_slm.version.version == "1" and other_slm.router_and_tau is None
    assert "routes for SLM models/slm, not models/other" in other_slm.note
    other_size = champion_to_compare("c", "champion", slm="models/slm", hidden_size=16)
    assert other_size.router_and_tau is None and "hidden_size 8, the SLM 16" in other_size.note


def test_rebase_store_moves_a_copied_store_onto_its_root(tmp_path):
    """Every stored `<old root>/` prefix becomes the new root; a sibling sharing the name's prefix is untouched."""
    import shutil
    import sqlite3

    import mlflow

    from citer.tracking.store import rebase_store

    old = tmp_path / "proj"
    old.mkdir()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{old}/mlflow.db")
    exp = client.create_experiment("e", artifact_location=(old / "mlartifacts").as_uri())
    run = client.create_run(exp).info.run_id
    client.log_param(run, "input", f"{old}/data/x.jsonl")
    client.log_param(run, "sibling", f"{old}2/data/x.jsonl")  # another project whose name starts the same
    new = tmp_path / "copy with space"
    shutil.copytree(old, new)
    assert rebase_store(new / "mlflow.db", new, "mlartifacts") == [str(old)]
    assert rebase_store(new / "mlflow.db", new, "mlartifacts") == []  # already home: nothing to do
    con = sqlite3.connect(new / "mlflow.db")
    (loc,) = con.execute("SELECT artifact_location FROM experiments WHERE name='e'").fetchone()
    (uri,) = con.execute("SELECT artifact_uri FROM runs").fetchone()
    params = dict(con.execute("SELECT key, value FROM params"))
    con.close()
    assert loc == (new / "mlartifacts").as_uri() and uri.startswith((new / "mlartifacts").as_uri())
    assert params == {"input": f"{new}/data/x.jsonl", "sibling": f"{old}2/data/x.jsonl"}
    data = (new / "mlflow.db").read_bytes()
    assert f"{old}/".encode() not in data  # vacuumed: no stale page keeps the old path
