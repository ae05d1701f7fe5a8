"""A router trained for other model files under the same names is refused by every loader, in one line naming both
digests: load_champion, route, serve, the MLflow model and the sweep (every method); --allow-pair-mismatch lets it
through with a warning. The project's SLM is re-finetuned in place (new weights, same directory), as a newcomer did."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_qwen2

from citer.routing.iterations import pair_digests
from citer.routing.pair_check import PairMismatch, check_pair, pair_problem, short

MISMATCH = re.compile(
    r"was trained for SLM ([0-9a-f]{12}), LLM ([0-9a-f]{12}); the pair in use is SLM ([0-9a-f]{12})"
)


def _retrain_slm_in_place(root: Path) -> tuple[str, str]:
    """New weights in models/slm (same architecture, tokenizer and name); returns (old, new) SLM digests."""
    slm_dir = root / "models" / "slm"
    old = pair_digests(slm_dir, root / "models" / "llm")["slm_digest"]
    make_qwen2(99, hidden_size=32, num_hidden_layers=1, seed=7).save_pretrained(slm_dir)
    new = pair_digests(slm_dir, root / "models" / "llm")["slm_digest"]
    assert old != new
    return old, new


def _names_both(message: str, old: str, new: str) -> None:
    assert "\n" not in message
    m = MISMATCH.search(message)
    assert m is not None, message
    assert (m.group(1), m.group(3)) == (short(old), short(new))


def test_check_pair_names_both_digests_and_what_changed():
    rec = {"slm_digest": "a" * 24, "llm_digest": "b" * 24}
    assert pair_problem(rec, dict(rec), "router r") is None
    now = {"slm_digest": "c" * 24, "llm_digest": "b" * 24}
    with pytest.raises(PairMismatch) as err:
        check_pair(rec, now, "router r", remedy="retrain it")
    assert str(err.value) == (
        "router r was trained for SLM aaaaaaaaaaaa, LLM bbbbbbbbbbbb; the pair in use is SLM cccccccccccc, LLM "
        "bbbbbbbbbbbb (SLM changed); retrain it"
    )
    with pytest.raises(PairMismatch, match="records no pair digests"):  # a router that cannot be checked
        check_pair({"slm_digest": "a" * 24}, now, "router r", remedy="retrain it")
    said: list[str] = []
    check_pair(rec, now, "router r", remedy="retrain it", allow=True, warn=said.append)
    assert len(said) == 1 and said[0].endswith("used anyway (--allow-pair-mismatch)")


def test_load_champion_and_serve_refuse_a_retrained_slm(champion_project, monkeypatch):
    from citer.project import load_project
    from citer.serving import server
    from citer.serving.champion import load_champion

    assert load_champion(load_project()).info["version"] == "1"  # the pair it was trained with: fine
    old, new = _retrain_slm_in_place(champion_project)
    with pytest.raises(PairMismatch) as err:
        load_champion(load_project())
    _names_both(str(err.value), old, new)
    assert "--allow-pair-mismatch" in str(err.value)

    served: dict = {}
    monkeypatch.setattr(server, "serve", lambda engine, tok, **kw: served.update(kw, engine=engine))
    with pytest.raises(PairMismatch) as err:
        server.serve_champion(load_project())
    _names_both(str(err.value), old, new)
    assert not served  # refused before the server starts
    server.serve_champion(
        load_project(), allow_pair_mismatch=True
    )  # the deliberate case: served, with a warning
    assert served["engine"].tau == 0.5


def test_the_mlflow_model_refuses_a_retrained_slm(champion_project, monkeypatch):
    import mlflow

    from citer.project import load_project

    monkeypatch.setenv("MLFLOW_TRACKING_URI", load_project().tracking_uri)
    cfg = {"project_root": str(champion_project)}
    old, new = _retrain_slm_in_place(champion_project)
    with pytest.raises(Exception) as err:
        mlflow.pyfunc.load_model("models:/citer-router@champion", model_config=cfg)
    _names_both(str(err.value).splitlines()[0], old, new)
    model = mlflow.pyfunc.load_model(
        "models:/citer-router@champion", model_config=cfg | {"allow_pair_mismatch": True}
    )
    assert len(model.predict(["Question: 3\nAnswer:"], params={"max_new_tokens": 2})) == 1


def test_route_refuses_a_retrained_slm_in_one_line(champion_project, prefect_server):
    from typer.testing import CliRunner

    from citer.cli import app

    (champion_project / "q.jsonl").write_text(
        json.dumps({"problem": "1 + 2", "solution": "\\boxed{3}"}) + "\n"
    )
    args = ["route", "--input", "q.jsonl", "--output", "side/out.jsonl"]
    old, new = _retrain_slm_in_place(champion_project)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: champion citer-router v1 was trained for SLM"), (
        lines
    )
    _names_both(lines[0], old, new)
    assert not (champion_project / "side" / "out.jsonl").exists()  # refused before anything was written

    res = CliRunner().invoke(app, [*args, "--allow-pair-mismatch"])
    assert res.exit_code == 0, res.output
    assert "warning: champion citer-router v1 was trained for SLM" in res.output
    assert json.loads((champion_project / "side" / "out.jsonl").read_text())["n_tokens"] >= 1


def test_the_sweep_refuses_any_router_trained_for_another_pair(champion_project):
    """Every method's router is checked, not only the last iteration's: an interrupted iterate leaves citer_s (and
    the ablations, iteration 1) of the previous SLM behind, and the sweep must not compare them."""
    import shutil

    from citer.models.loading import load_model
    from citer.project import load_project
    from citer.routing.mlp import MLPRouter, save_router
    from flows.sweep_and_promote import sweep_routers

    proj = load_project()
    pair = pair_digests(proj.slm_ref, proj.llm_ref)
    slm, tok = load_model(proj.slm_ref)
    iter2 = proj.router_dir(2)
    for d in (proj.router_dir(1), proj.router_dir("citer_s")):
        shutil.copytree(iter2, d)
    routers, meta = sweep_routers.fn(proj, slm, len(tok), pair)
    assert {"citer", "citer_iter1", "citer_s"} <= set(routers) and meta["slm_digest"] == pair["slm_digest"]

    torch.manual_seed(1)
    stale = json.loads((iter2 / "router.json").read_text()) | {"slm_digest": "f" * 24}
    save_router(MLPRouter(32).eval(), proj.router_dir("citer_s"), stale)  # left by the previous SLM
    with pytest.raises(PairMismatch, match=r"router artifacts/routers/citer_s \(citer_s\) was trained for SLM "
                       r"ffffffffffff.*run `citer router iterate`"):  # fmt: skip
        sweep_routers.fn(proj, slm, len(tok), pair)


def test_a_stale_champion_is_replaced_not_kept(champion_project, sweep_rows):
    """The sweep's champion of the same names but other model files cannot be compared and no loader will use it:
    a candidate that passes every other gate takes its alias, and the reason says why."""
    from citer.config import SelectionRule
    from citer.evaluation.promotion import plan_promotion
    from citer.project import load_project
    from citer.tracking.registry import champion_to_compare

    proj = load_project()
    reg = proj.params.registry
    kw = {"slm": "models/slm", "hidden_size": 32, "tracking_uri": proj.tracking_uri, "root": proj.root}
    fresh = champion_to_compare(
        reg.model_name, reg.alias, **kw, pair=pair_digests(proj.slm_ref, proj.llm_ref)
    )
    assert fresh.router is not None and not fresh.stale
    _retrain_slm_in_place(champion_project)
    champ = champion_to_compare(
        reg.model_name, reg.alias, **kw, pair=pair_digests(proj.slm_ref, proj.llm_ref)
    )
    assert champ.stale and champ.router is None and "was trained for SLM" in champ.note

    rule = SelectionRule(kind="min_bytes_at_accuracy", accuracy_ratio=0.98)
    plan = plan_promotion(sweep_rows, sweep_rows, rule, "1", champ.note, champion_stale=True)
    assert plan.decision.promoted and plan.decision.reason.startswith(
        "v1 is stale (champion v1 was trained for"
    )
    kept = plan_promotion(sweep_rows, sweep_rows, rule, "1", champ.note)  # not stale: kept, as before
    assert not kept.decision.promoted and kept.decision.reason.startswith("kept v1")
