"""The registry's champion as a ready decoder: its SLM, LLM, router and tau, with overrides and refusals."""

from __future__ import annotations

import pytest
from conftest import spread_router


@pytest.mark.slow  # three registered versions and three model loads: ~25 s on 2 busy cores
def test_engine_from_champion(tiny_pair_dirs, tmp_path, monkeypatch):
    """The registry's champion -> its SLM, LLM, router and tau in an engine that decodes; serve.tau overrides tau."""
    import mlflow

    from citer.config import Params
    from citer.project import Project
    from citer.registry import register_router, set_alias
    from citer.routing.mlp import save_router
    from citer.serving.champion import ChampionError, load_champion

    slm_dir, llm_dir = tiny_pair_dirs
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("serve", artifact_location=(tmp_path / "art").as_uri())
    params = Params.model_validate({"registry": {"model_name": "router-serve"}})
    proj = Project(root=tmp_path, params=params)

    def register(hidden: int, tau: float) -> str:
        rdir = save_router(
            spread_router(hidden), tmp_path / f"router{hidden}", {"slm": str(slm_dir), "llm": str(llm_dir)}
        )
        run = client.create_run(exp)
        tags = {"slm": str(slm_dir), "llm": str(llm_dir), "tau": tau}
        rv = register_router(
            rdir, model_name="router-serve", run_id=run.info.run_id, tags=tags, tracking_uri=uri
        )
        set_alias("router-serve", "champion", rv.version, tracking_uri=uri)
        return rv.version

    version = register(32, 0.3)
    engine, tok, info = load_champion(proj)
    assert engine.tau == 0.3 and info["router"] == f"router-serve/{version}" and info["slm"] == str(slm_dir)
    res = engine.generate_batch(
        [tok.encode("Question: 1\nAnswer:", add_special_tokens=False)], max_new_tokens=5
    )
    assert len(res.tokens[0]) >= 1

    params.serve.tau = 0.9
    assert load_champion(proj).engine.tau == 0.9
    assert load_champion(proj, tau=0.2).engine.tau == 0.2

    register(16, 0.5)  # a champion whose router was trained for another SLM
    with pytest.raises(ChampionError, match="hidden_size=16"):
        load_champion(proj)
