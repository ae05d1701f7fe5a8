"""The champion a command deploys, resolved once: the alias read once, its files (router and quantile table) verified
and downloaded once, τ given, from a target LLM fraction, or the version's own; a missing champion says why."""

from __future__ import annotations

import json

import pytest

from citer.ops.io import file_digest
from citer.project import load_project
from citer.tracking.deployed import ChampionError, champion_tau, open_champion, project_champion
from citer.tracking.registry import NoChampion
from citer.tracking.store import RegistryError, RouterVersion

TABLE = [round(f**2, 6) for f in [i / 100 for i in range(101)]]  # dev scores' τ at LLM fractions 0..1


def test_champion_tau_from_a_target_llm_fraction():
    rv = RouterVersion("citer-router", "3", {"tau": "0.25"}, "")
    assert champion_tau(rv, TABLE) == 0.25  # the τ chosen on dev
    assert champion_tau(rv, TABLE, tau=0.7) == 0.7
    assert champion_tau(rv, TABLE, llm_fraction=0.1) == pytest.approx(0.01)
    assert champion_tau(rv, TABLE, llm_fraction=0.105) == pytest.approx((0.01 + 0.0121) / 2)
    with pytest.raises(ChampionError, match="not both"):
        champion_tau(rv, TABLE, tau=0.5, llm_fraction=0.1)
    with pytest.raises(ChampionError, match="no dev score quantiles"):
        champion_tau(rv, None, llm_fraction=0.1)


def test_no_champion_names_the_gate_that_refused(tmp_path, monkeypatch):
    """A project whose sweep ran and promoted nothing says why, not 'run the sweep first'."""
    import shutil

    from conftest import REPO

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("CITER_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    proj = load_project("params.yaml")
    assert proj.root.resolve() == tmp_path.resolve()
    with pytest.raises(NoChampion, match="run the sweep stage first") as err:
        project_champion(proj)  # no sweep yet
    assert err.value.reason == "no sweep has promoted a router yet (run `citer eval sweep`)"
    proj.reports.mkdir(parents=True, exist_ok=True)
    reason = "only 12 test questions; registry.min_eval_examples is 200"
    (proj.reports / "promotion.json").write_text(json.dumps({"promoted": 0, "reason": reason}))
    with pytest.raises(NoChampion, match=f"promoted nothing: {reason} \\(reports/promotion.json\\)") as err:
        project_champion(proj)
    assert err.value.reason == f"{reason} (reports/promotion.json)"


@pytest.mark.slow  # a second registered version and one tiny pair load: ~10 s
def test_the_quantile_table_is_a_file_of_the_version_and_the_champion_is_read_once(
    champion_project, monkeypatch
):
    import mlflow

    from citer.serving.champion import load_champion
    from citer.tracking import registry

    proj = load_project()
    client = mlflow.MlflowClient(tracking_uri=proj.tracking_uri)
    run = client.create_run(client.get_experiment_by_name("api").experiment_id).info.run_id
    reg = proj.params.registry
    rv = registry.publish_router(
        proj.router_dir(2),
        model_name=reg.model_name,
        alias=reg.alias,
        run_id=run,
        tags={"slm": "models/slm", "llm": "models/llm", "tau": 0.5},
        promote=True,
        tracking_uri=proj.tracking_uri,
        quantiles=TABLE,
    )
    logged = next((champion_project / "mlartifacts").rglob("dev_score_quantiles.json"))
    assert (
        json.loads(logged.read_text()) == TABLE and "dev_score_quantiles" not in rv.tags
    )  # a file, not a tag
    assert rv.tags["dev_score_quantiles_sha256"] == file_digest(logged)

    calls = []
    for mod, name in ((registry, "get_alias"), (mlflow.artifacts, "download_artifacts")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    champ = load_champion(proj, llm_fraction=0.1)
    assert champ.engine.tau == pytest.approx(0.01) and champ.info["version"] == rv.version
    assert calls == ["get_alias", "download_artifacts"]  # one lookup, one download, τ from the file

    with open_champion(proj) as dep:
        assert dep.tau == 0.5 and dep.files.quantiles == TABLE  # the version's own τ
    proj.params.serve.llm_fraction = 0.2
    with open_champion(proj) as dep:  # serve's settings apply when the command gives none
        assert dep.tau == pytest.approx(0.04)
    with open_champion(proj, tau=0.7, settings=proj.params.inference) as dep:
        assert dep.tau == 0.7
    logged.write_text(json.dumps([0.0, 1.0]))  # the stored table changed after registration
    with pytest.raises(
        RegistryError, match="dev_score_quantiles.json is missing or does not match the sha256"
    ):
        with open_champion(proj):
            pass
