"""Torch threads per stage (citer.ops.threads): one for small models, the free cores for large ones, a fixed count
when params say so; the stage's MLflow run records what it ran on."""

from __future__ import annotations

import shutil

import torch
import yaml
from conftest import REPO

from citer.ops.threads import (
    SMALL_WEIGHT_BYTES,
    choose_threads,
    set_stage_threads,
    stage_weights,
    weight_bytes,
)
from citer.project import load_project


def test_small_models_get_one_thread_large_ones_the_free_cores():
    assert (
        choose_threads(SMALL_WEIGHT_BYTES - 1, free=2.0, usable=2) == 1
    )  # overhead-bound: a second thread spins
    big = SMALL_WEIGHT_BYTES * 100
    assert choose_threads(big, free=2.0, usable=2) == 2
    assert choose_threads(big, free=1.1, usable=2) == 1  # another process holds a core
    assert choose_threads(big, free=0.2, usable=2) == 1  # never zero
    assert choose_threads(big, free=7.6, usable=4) == 4  # never more than this process may use


def _params(root, **blocks):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for block, values in blocks.items():
        params[block].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return load_project(root=root)


def test_the_embedded_default_runs_its_stages_on_one_thread(tmp_path):
    proj = _params(tmp_path)  # nothing on disk yet: bootstrap will write the tiny pair
    assert max(stage_weights(proj)) < SMALL_WEIGHT_BYTES
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert set_stage_threads(proj) == 1 and torch.get_num_threads() == 1
        fixed = _params(tmp_path, runtime={"stage_threads": 3})
        assert set_stage_threads(fixed) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_large_or_unknown_model_is_not_held_to_one_thread(tmp_path, tiny_pair_dirs):
    hub = _params(
        tmp_path, bootstrap={"enabled": False}, models={"slm": "Qwen/Qwen2-1.5B", "llm": "Qwen/Qwen2-72B"}
    )
    assert max(stage_weights(hub)) >= SMALL_WEIGHT_BYTES  # a hub id: its size is unknown, assume large
    for role, src in zip(("slm", "llm"), tiny_pair_dirs, strict=True):
        shutil.copytree(src, tmp_path / "models" / role)
    own = _params(tmp_path, bootstrap={"enabled": False}, models={"slm": "models/slm", "llm": "models/llm"})
    assert max(stage_weights(own)) == weight_bytes(tmp_path / "models" / "llm") < SMALL_WEIGHT_BYTES
    with (tmp_path / "models" / "llm" / "model.safetensors").open("r+b") as fh:
        fh.truncate(SMALL_WEIGHT_BYTES * 2)  # a large checkpoint, without writing it (sparse)
    assert max(stage_weights(own)) >= SMALL_WEIGHT_BYTES
    before = torch.get_num_threads()
    try:
        assert 1 <= set_stage_threads(own) <= torch.get_num_threads() <= 1024
    finally:
        torch.set_num_threads(before)


def test_a_stage_run_records_its_torch_threads(project):
    import mlflow

    from flows.common import stage_run

    proj = load_project(optional=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with stage_run(proj, "router_iter1") as run:
            pass
    finally:
        torch.set_num_threads(before)
    tags = mlflow.MlflowClient(proj.tracking_uri).get_run(run.run_id).data.tags
    assert tags["citer.torch_threads"] == "1"
    assert tags["citer.pid"].isdigit()
