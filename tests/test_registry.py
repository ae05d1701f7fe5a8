"""The registry against a real MLflow sqlite store: register a router version, aliases, champion checks."""

import numpy as np
import pytest
import torch

from citer.registry import (
    RegistryError,
    get_alias,
    load_router_version,
    register_router,
    require_champion,
    set_alias,
)
from citer.router import MLPRouter, save_router


@pytest.fixture()
def store(tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    return client, exp


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
