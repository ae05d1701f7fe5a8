"""`dvc repro` on a fresh copy of the project (shrunken params): everything runs, a second repro is a no-op, and a
changed param reruns only its dependants (`dvc exp run --temp -S`: tests/e2e/test_dvc_params.py, on your own models)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_tiny_params


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res


def stages_run(output: str) -> set[str]:
    """The stages a ``dvc repro`` or ``dvc exp run`` output says it ran (its ``Running stage 'name':`` lines)."""
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")}


@pytest.fixture()
def dvc_project(tmp_path, prefect_server):
    from prefect.settings import PREFECT_API_URL

    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    root = tmp_path / "proj"
    for f in files:
        if f.startswith("tests/"):
            continue
        dst = root / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst)
    write_tiny_params(root)
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        PREFECT_API_URL=str(PREFECT_API_URL.value()),  # the session's server: no server start per stage
        DVC_NO_ANALYTICS="1",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("CITER_ROOT", None)  # stages run in dvc's working directory (a temp copy under `exp run --temp`)
    run(["git", "init", "-q"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "init"], root, env)
    return root, env


@pytest.mark.slow
def test_dvc_repro_noop_and_a_param_reaches_its_dependants(dvc_project):
    root, env = dvc_project
    dvc = [sys.executable, "-m", "dvc"]
    run([*dvc, "repro"], root, env, timeout=1500)
    for f in ("reports/models.json", "reports/router.json", "reports/sweep.json", "reports/promotion.json"):
        assert (root / f).exists(), f
    lock = (root / "dvc.lock").read_text()

    second = run([*dvc, "repro"], root, env)
    assert "Running stage" not in second.stdout, second.stdout
    assert (root / "dvc.lock").read_text() == lock

    # One changed param: only the stages that read it are out of date (their dependants follow once their outputs
    # change, which a dry run cannot know).
    params = (root / "params.yaml").read_text()
    changed = yaml.safe_load(params)
    changed["router"]["lr"] = 0.002
    (root / "params.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
    dry = run([*dvc, "repro", "--dry"], root, env).stdout
    would = stages_run(dry)
    assert would == {"iterate"}, dry  # the one stage that owns labels and routers; it keeps the label sets
    assert not would & {"synth", "validate", "bootstrap_models", "finetune_slm", "eval_models"}, dry
    (root / "params.yaml").write_text(params)
