"""dvc.yaml follows params.yaml: your own data files and model directories are the stages' dependencies, disabled
stages (synth, bootstrap, finetune) never touch what stands in for them, `dvc exp run --temp` finds them in its copy,
and labels.iterations sets the number of label iterations with no other edit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from test_dvc import dvc_project, run, stages_run  # noqa: F401  (the fixture: a git copy of the project with tiny params)

DVC = [sys.executable, "-m", "dvc"]


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def set_params(root: Path, **changes: object) -> None:
    """``set_params(root, **{"labels.iterations": 3})``: dotted keys into params.yaml."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = params
        for part in parents:
            node = node[part]
        node[key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def status_stages(root: Path, env: dict[str, str]) -> set[str]:
    out = run([*DVC, "status", "--json"], root, env).stdout
    return set(json.loads(out or "{}"))


@pytest.fixture()
def own_project(dvc_project, tiny_pair_dirs):  # noqa: F811
    """The project with your own data (data/own/*.jsonl) and a padded-embedding pair where the embedded models would
    be (models/slm_base, models/llm): synth, bootstrap and finetune off."""
    from citer.config import SynthParams
    from citer.data.synth import synthesize
    from citer.ops.io import write_jsonl

    root, env = dvc_project
    rows = synthesize(SynthParams(seed=3, n_train=40, n_dev=8, n_test=12))
    for split in ("train", "dev", "test"):
        write_jsonl(root / "data" / "own" / f"{split}.jsonl", rows[f"math_{split}"])
    import shutil

    for role, src in zip(("slm_base", "llm"), tiny_pair_dirs, strict=True):
        shutil.copytree(src, root / "models" / role)
    # The paper's pair shape: one tokenizer, the LLM's embedding padded past it (Qwen2-72B: 152,064 vs 151,936 rows).
    from transformers import AutoModelForCausalLM

    llm = AutoModelForCausalLM.from_pretrained(root / "models" / "llm")
    llm.resize_token_embeddings(llm.config.vocab_size + 61, mean_resizing=False)
    llm.save_pretrained(root / "models" / "llm")
    set_params(
        root,
        **{
            "data.train": "data/own/train.jsonl",
            "data.dev": "data/own/dev.jsonl",
            "data.test": "data/own/test.jsonl",
            "synth.enabled": False,
            "bootstrap.enabled": False,
            "finetune.enabled": False,
            "labels.n_examples": 12,
            "sweep.n_examples": 6,
            "eval.n_examples": 6,
        },
    )
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "own data"], root, env)
    return root, env


@pytest.mark.slow
def test_own_models_untouched_data_tracked_and_iterations_follow_params(own_project):
    root, env = own_project
    models = {name: tree_hashes(root / "models" / name) for name in ("slm_base", "llm")}
    data = tree_hashes(root / "data" / "own")

    first = run([*DVC, "repro"], root, env, timeout=1500)
    log = first.stdout + first.stderr
    assert "synth disabled (synth.enabled: false)" in log, log[-3000:]
    assert "bootstrap disabled (bootstrap.enabled: false)" in log, log[-3000:]
    assert "finetune disabled (finetune.enabled: false)" in log, log[-3000:]
    # Byte-identical: DVC neither deleted them before the disabled stages ran nor replaced them from its cache.
    assert {name: tree_hashes(root / "models" / name) for name in models} == models
    assert tree_hashes(root / "data" / "own") == data
    assert not (root / "data" / "embedded").exists()
    assert not list((root / ".dvc" / "cache").rglob("*.safetensors"))  # cache: false, never copied
    promotion = json.loads((root / "reports" / "promotion.json").read_text())
    assert promotion["promoted"] == 1, promotion
    predicted = (root / "outputs" / "predictions.jsonl").read_text().splitlines()
    assert len(predicted) == 12, len(predicted)  # every row of your data.test, not the embedded test file
    assert status_stages(root, env) == set()

    # An experiment in a temp copy, which holds what git and DVC's cache hold: your models (git-ignored, not cached)
    # are linked in from the workspace, and a param of the last stage reruns it, not the label iterations.
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "repro"], root, env)
    params = (root / "params.yaml").read_text()
    exp = run([*DVC, "exp", "run", "--temp", "-S", "inference.max_new_tokens=16"], root, env, timeout=1500)
    log = exp.stdout + exp.stderr
    ran = stages_run(log)
    assert "batch_inference" in ran and "iterate" not in ran, log[-3000:]
    assert "linked models/slm_base from the workspace" in log, log[-3000:]
    assert (root / "params.yaml").read_text() == params  # --temp leaves the workspace alone
    assert {name: tree_hashes(root / "models" / name) for name in models} == models

    # Three label iterations: params only. Iterations 1 and 2 are kept (their inputs did not change).
    set_params(root, **{"labels.iterations": 3})
    third = run([*DVC, "repro"], root, env, timeout=1500)
    log = third.stdout + third.stderr
    for k in (1, 2, 3):
        assert (root / "artifacts" / "labels" / f"iter{k}" / "meta.json").is_file()
        assert (root / "artifacts" / "routers" / f"iter{k}" / "router.json").is_file()
    assert "labels_iter1: unchanged, kept" in log and "labels_iter2: unchanged, kept" in log, log[-3000:]
    assert "labels_iter3: made" in log, log[-3000:]
    report = json.loads((root / "reports" / "router.json").read_text())
    assert [it["iteration"] for it in report["iterations"]] == [1, 2, 3]
    assert "Running stage 'sweep'" in log  # the sweep now reads routers/iter3 (it fails when that is missing)
    assert {name: tree_hashes(root / "models" / name) for name in models} == models

    # Back to two: iteration 3 is removed, not left behind as a stale artifact.
    set_params(root, **{"labels.iterations": 2})
    run([*DVC, "repro", "iterate"], root, env, timeout=1500)
    assert not (root / "artifacts" / "labels" / "iter3").exists()
    assert not (root / "artifacts" / "routers" / "iter3").exists()

    # One changed row of your own train file: exactly the stages that read it are out of date.
    run([*DVC, "commit", "-f"], root, env)
    assert status_stages(root, env) == set()
    train = root / "data" / "own" / "train.jsonl"
    lines = train.read_text().splitlines()
    row = json.loads(lines[0])
    row["problem"] += " "
    train.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    stale = status_stages(root, env)
    assert {"validate", "finetune_slm", "iterate"} <= stale, stale
    assert not stale & {"bootstrap_models", "eval_models", "batch_inference"}, stale


def test_dvc_yaml_reads_every_path_from_params():
    """No data file, model directory or artifact directory is spelled out in a stage: they all come from params."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for kind in ("deps", "outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                path = entry if isinstance(entry, str) else next(iter(entry))
                assert path.startswith(("citer/", "flows/", "${")), (name, kind, path)  # code, or from params
    assert "iterate" in stages and not any(name.startswith(("labels_iter", "router_iter")) for name in stages)
    for name in ("synth", "bootstrap_models", "finetune_slm"):
        for out in stages[name]["outs"]:
            (path, flags), *_ = out.items()
            if "reports_dir" not in path:
                assert flags == {"persist": True, "cache": False}, (name, path)


def test_disabled_stage_with_missing_model_names_key_and_path(tmp_path, prefect_server):
    """Bootstrap off and no model where params point: one line naming the key and the path, exit 1."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_LEVEL"}  # the CLI's own quiet default
    env.update(CITER_ROOT=str(tmp_path), PREFECT_API_URL=str(PREFECT_API_URL.value()))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["bootstrap"]["enabled"] = False
    params["models"]["llm"] = "models/mine"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "models" / "slm_base").mkdir(parents=True)
    res = subprocess.run(
        [sys.executable, "-m", "citer.cli", "models", "bootstrap"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: bootstrap.enabled is false but models.llm=models/mine"), err
    assert not (tmp_path / "models" / "mine").exists()


def test_disabled_synth_checks_data_and_touches_nothing(prefect_server, project):
    """synth off: with your data files present it says so in one line and writes no data; without them, one line
    naming the missing key."""
    from typer.testing import CliRunner

    from citer.cli import app

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["synth"]["enabled"] = False
    params["data"].update(train="own/train.jsonl", dev="own/dev.jsonl", test="own/test.jsonl")
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    (project / "own").mkdir()
    for split in ("train", "dev"):
        (project / "own" / f"{split}.jsonl").write_text('{"problem": "1+1?", "solution": "\\\\boxed{2}"}\n')
    res = CliRunner().invoke(app, ["data", "synth"])
    assert res.exit_code == 1 and "data.test=own/test.jsonl does not exist" in res.output, res.output
    (project / "own" / "test.jsonl").write_text((project / "own" / "dev.jsonl").read_text())
    before = tree_hashes(project / "own")
    res = CliRunner().invoke(app, ["data", "synth"])
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines() == [
        "synth disabled (synth.enabled: false): using your data, left untouched: "
        "data.train=own/train.jsonl, data.dev=own/dev.jsonl, data.test=own/test.jsonl"
    ]
    assert tree_hashes(project / "own") == before and not (project / "data").exists()
