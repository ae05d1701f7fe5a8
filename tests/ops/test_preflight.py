"""Checks before work: devices, dtypes, model directories and data paths, all named in one line before the first
stage runs (a CUDA device on a machine without one used to fail at model load, minutes in)."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from conftest import REPO

from citer.ops.preflight import PreflightError, preflight
from citer.project import load_project


def _project(root, **blocks):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for block, values in blocks.items():
        params[block].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return load_project(root=root)


def test_the_default_passes_and_a_missing_device_is_named(tmp_path):
    preflight(_project(tmp_path))  # the embedded default on a CPU: nothing to say
    if torch.cuda.device_count() == 0:
        with pytest.raises(
            PreflightError, match=r"models\.device: 'cuda' is not on this machine \(torch sees 0"
        ):
            preflight(_project(tmp_path, models={"device": "cuda"}))
        with pytest.raises(
            PreflightError, match=r"models\.llm_device_map\.lm_head: 1 is not on this machine"
        ):
            preflight(_project(tmp_path, models={"llm_device_map": {"model": "cpu", "lm_head": 1}}))
    n = torch.cuda.device_count()
    with pytest.raises(PreflightError, match=rf"models\.device: 'cuda:{n + 3}' is not on this machine"):
        preflight(_project(tmp_path, models={"device": f"cuda:{n + 3}"}))


def test_missing_models_and_data_are_named_together(tmp_path):
    (tmp_path / "models").mkdir()
    proj = _project(
        tmp_path,
        bootstrap={"enabled": False},
        synth={"enabled": False},
        models={"slm": "models/mine", "llm": "Qwen/Qwen2-72B"},  # a hub id is not a directory to check
        data={"train": "own/train.jsonl", "dev": "own/dev.jsonl", "test": "own/test.jsonl"},
        inference={"input": "own/questions.jsonl"},
    )
    with pytest.raises(PreflightError) as err:
        preflight(proj)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("bootstrap.enabled is false but models.slm=models/mine")
    assert "models.llm" not in msg
    for key in ("data.train=own/train.jsonl", "data.dev=own/dev.jsonl", "data.test=own/test.jsonl"):
        assert f"synth.enabled is false but {key} does not exist" in msg
    assert "inference.input=own/questions.jsonl does not exist" in msg and msg.endswith(
        "before any stage ran)"
    )
    (tmp_path / "models" / "mine").mkdir()
    (tmp_path / "own").mkdir()
    for f in ("train", "dev", "test", "questions"):
        shutil.copy(REPO / "tests" / "fixtures" / "answers_real.jsonl", tmp_path / "own" / f"{f}.jsonl")
    preflight(proj)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without CUDA")
def test_a_pipeline_on_a_missing_device_stops_before_synth(prefect_server, project):
    """`citer pipeline` with models.device: cuda on this CPU machine: one line, and synth never ran."""
    from typer.testing import CliRunner

    from citer.cli import app

    _project(project, models={"device": "cuda"})
    res = CliRunner().invoke(app, ["pipeline"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "error: models.device: 'cuda' is not on this machine (torch sees 0 CUDA device(s)) (params.yaml: checked "
        "before any stage ran)"
    ]
    assert not (project / "data").exists() and not (project / "reports").exists()


def test_an_experiment_copy_links_your_own_inputs_from_the_workspace(tmp_path, monkeypatch):
    """`dvc exp run --temp` runs in a copy under the workspace's .dvc/tmp/exps holding what git and DVC's cache hold:
    your models (bootstrap off) and data (synth off) under git-ignored paths are linked in from the workspace, the
    files hard links to the same bytes; outside such a copy, or for what the copy has, nothing is linked."""
    workspace = tmp_path / "ws"
    own = {"slm": "models/mine", "llm": "models/big"}
    data = {"train": "own/train.jsonl", "dev": "own/dev.jsonl", "test": "own/test.jsonl"}
    for ref in own.values():
        (workspace / ref).mkdir(parents=True)
        (workspace / ref / "config.json").write_text("{}")
    (workspace / "own").mkdir()
    for ref in data.values():
        shutil.copy(REPO / "tests" / "fixtures" / "answers_real.jsonl", workspace / ref)
    copy = workspace / ".dvc" / "tmp" / "exps" / "standalone" / "tmpabc"
    copy.mkdir(parents=True)
    (copy / "own").mkdir()
    (copy / "own" / "test.jsonl").write_text("the copy's own\n")  # committed in git: the copy's stays
    blocks = {"bootstrap": {"enabled": False}, "synth": {"enabled": False}, "models": own, "data": data}

    monkeypatch.delenv("DVC_ROOT", raising=False)
    with pytest.raises(PreflightError, match=r"data\.train=own/train\.jsonl does not exist"):
        preflight(_project(copy, **blocks))  # not known as an experiment's copy: named, not linked
    assert not (copy / "models").exists()

    monkeypatch.setenv("DVC_ROOT", str(workspace))  # what DVC sets for an experiment's stages
    preflight(_project(copy, **blocks))
    for ref in own.values():
        linked, src = copy / ref / "config.json", workspace / ref / "config.json"
        assert linked.stat().st_ino == src.stat().st_ino and not (copy / ref).is_symlink()
    assert (copy / "own" / "train.jsonl").stat().st_ino == (workspace / "own" / "train.jsonl").stat().st_ino
    assert (copy / "own" / "test.jsonl").read_text() == "the copy's own\n"
    assert not list(copy.rglob(".*.tmp"))  # citer.ops.io's temporary siblings, renamed into place

    # The workspace itself, or a directory outside its experiments, is no experiment's copy.
    other = tmp_path / "elsewhere"
    (other / "models").mkdir(parents=True)
    with pytest.raises(PreflightError, match=r"models\.slm=models/mine is not a directory"):
        preflight(_project(other, **blocks))
