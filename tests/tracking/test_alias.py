"""The alias fails closed and moves only from the version compared; tampered artifacts are refused; an interrupted
promotion is completed or retired. Against a real MLflow sqlite store."""

from __future__ import annotations

import json

import pytest
import torch

from citer.routing.mlp import MLPRouter, save_router
from citer.tracking.alias import AliasMoved, finish_pending, get_alias, move_alias, set_alias
from citer.tracking.registry import load_router_version, register_router, verified_files
from citer.tracking.store import RegistryError


def _register(client, exp, tmp_path, seed=0):
    torch.manual_seed(seed)
    rdir = save_router(MLPRouter(8).eval(), tmp_path / f"r{seed}", {"slm": "s", "llm": "l", "iteration": 2})
    run = client.create_run(exp).info.run_id
    return register_router(rdir, model_name="m", run_id=run, tags={"slm": "s", "llm": "l", "tau": 0.5}), run


def test_a_dangling_alias_stops_instead_of_reading_as_no_champion(store, tmp_path):
    client, exp = store
    assert get_alias("m", "champion") is None  # no model yet: a first run
    v1, _ = _register(client, exp, tmp_path)
    assert get_alias("m", "champion") is None  # a model, but citer never set the alias
    set_alias("m", "champion", v1.version)
    client.delete_model_version("m", v1.version)  # outside citer: MLflow drops the alias with it
    with pytest.raises(RegistryError, match=r"held v1 \(set by citer\) but the registry no longer has it"):
        get_alias("m", "champion")


def test_an_unreadable_registry_fails_closed(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(RegistryError, match="cannot read alias 'champion'.*nothing promoted"):
        get_alias("m", "champion", tracking_uri="http://127.0.0.1:9")


def test_the_alias_moves_only_from_the_version_compared(store, tmp_path):
    client, exp = store
    v1, _ = _register(client, exp, tmp_path, 0)
    v2, _ = _register(client, exp, tmp_path, 1)
    v3, _ = _register(client, exp, tmp_path, 2)
    move_alias("m", "champion", v1.version, expected=None)
    # Two sweeps both compared against v1; the first to finish moves it, the second is refused (no lost update).
    move_alias("m", "champion", v2.version, expected="1")
    with pytest.raises(AliasMoved, match="moved from v1 to v2") as err:
        move_alias("m", "champion", v3.version, expected="1")
    assert err.value.version == "3" and get_alias("m", "champion").version == "2"


def test_a_tampered_router_is_refused(store, tmp_path):
    client, exp = store
    v1, _ = _register(client, exp, tmp_path)
    assert set(json.loads(v1.tags["router_sha256"])) == {"router.safetensors", "router.json"}
    load_router_version(v1)  # untouched: loads
    with verified_files(v1) as files:
        assert files.quantiles is None  # registered without a quantile table
    art = next((tmp_path / "art").rglob("router.json"))  # the copy in the artifact store
    meta = json.loads(art.read_text())
    meta["dropout"] = 0.5
    art.write_text(json.dumps(meta))
    with pytest.raises(RegistryError, match="router.json .* does not match the sha256 recorded"):
        load_router_version(v1)
    with pytest.raises(RegistryError, match="router.json .* does not match the sha256 recorded"):
        with verified_files(v1):  # what `citer route` checks before it looks at its output
            pass


def test_an_interrupted_promotion_is_completed_or_retired(store, tmp_path):
    client, exp = store
    v1, _ = _register(client, exp, tmp_path, 0)
    set_alias("m", "champion", v1.version)
    pending, record = tmp_path / "pending.json", tmp_path / "promotion.json"
    assert finish_pending(pending, record) is None  # nothing pending
    # Killed after registering v2, before moving the alias: the next sweep completes the decision.
    v2, run2 = _register(client, exp, tmp_path, 1)
    intent = {"model": "m", "alias": "champion", "run_id": run2, "expected": "1", "promote": True}
    pending.write_text(json.dumps(intent | {"record": {"promoted": 1, "reason": "beats v1"}}))
    assert "v2 moved to 'champion'" in finish_pending(pending, record)
    assert get_alias("m", "champion").version == "2" and not pending.exists()
    assert json.loads(record.read_text())["version"] == "2"
    # Killed the same way, but the alias moved meanwhile: the orphan is retired, not promoted.
    v3, run3 = _register(client, exp, tmp_path, 2)
    pending.write_text(json.dumps(intent | {"run_id": run3, "record": {"promoted": 1, "reason": "beats v1"}}))
    assert "v3 retired" in finish_pending(pending, record)
    assert get_alias("m", "champion").version == "2"
    assert "citer.retired" in client.get_model_version("m", "3").tags
    assert json.loads(record.read_text())["promoted"] == 0
