"""Ctrl-C stops a real `citer` command within seconds: SIGINT to the process group (what a terminal sends, Prefect's
temporary server included) during bootstrap and during a pipeline's sweep -> exit 130 and one line, nothing of the
group left alive, and the pipeline's MLflow runs closed (the parent KILLED, none RUNNING). The pipeline's project
first runs to the end without promoting anything: a first run without a champion still exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_pair_project, write_tiny_params

CITER = str(Path(sys.executable).parent / "citer")
LIMIT_S = 10.0  # the bound: exit within 10 s of the signal at any stage


def _interrupt_when(root: Path, args: list[str], marker: str, timeout: float = 600) -> tuple[int, float, str]:
    """Run ``citer args`` in ``root`` (progress bars on, so ``marker`` shows when the stage has begun), send SIGINT
    to its process group once stderr holds ``marker``; returns (exit code, seconds from signal to exit, stderr)."""
    env = dict(
        os.environ, CITER_PROGRESS="1", CITER_ROOT=str(root), PREFECT_HOME=str(root / ".state" / "prefect")
    )
    env.pop("PREFECT_API_URL", None)  # its own temporary server, in its process group: Ctrl-C reaches it too
    env.pop("MLFLOW_TRACKING_URI", None)
    err_path = root / "stderr.log"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [CITER, *args], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while marker not in err_path.read_text(errors="replace"):
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{marker!r} never showed"
            time.sleep(0.2)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        took = time.monotonic() - t0
    gone = time.monotonic() + 3.0  # the group's last members (the API server) are stopped on the way out
    while time.monotonic() < gone and _group_alive(proc.pid):
        time.sleep(0.1)
    assert not _group_alive(proc.pid)  # nothing of the command's group is left
    return rc, took, err_path.read_text(errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _last_line(stderr: str) -> str:
    return stderr.replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.slow  # ~40 s: the CLI's start, then bootstrap until the signal
def test_ctrl_c_during_bootstrap(project):
    from citer.config import SynthParams
    from citer.data.synth import synthesize, write_splits

    write_tiny_params(project)
    text = (project / "params.yaml").read_text().replace("steps: 60", "steps: 100000")
    (project / "params.yaml").write_text(text)
    write_splits(
        project / "data" / "embedded", synthesize(SynthParams(seed=0, n_train=200, n_dev=8, n_test=8))
    )
    rc, took, err = _interrupt_when(project, ["models", "bootstrap"], "pretrain")
    assert rc == 130 and took < LIMIT_S, (rc, took, err[-2000:])
    assert _last_line(err) == "interrupted (SIGINT): stopped" and "error:" not in err, err[-2000:]
    assert not (project / "models" / "llm").exists()  # nothing half-written


@pytest.mark.slow  # ~3 min: a whole pipeline on the answering pair, then a second one up to its sweep
def test_a_first_run_without_a_champion_ends_well_and_ctrl_c_during_a_sweep_closes_its_runs(
    project, answering_pair_dirs
):
    """`citer pipeline` whose sweep promotes nothing (too few test questions for registry.min_eval_examples) exits 0
    with the reason first in its closing table and an empty predictions file saying why; a second run, interrupted
    during its sweep, exits 130 within seconds with its runs closed."""
    import json

    import mlflow

    over = {
        "eval": {"n_examples": 4, "max_new_tokens": 8},
        "labels": {"n_examples": 12, "max_new_tokens": 8},
        "registry": {"min_eval_examples": 100000},
        "sweep": {"n_examples": 0, "max_new_tokens": 48, "decode_batch_size": 8},  # long enough to interrupt
    }
    write_pair_project(project, answering_pair_dirs, over, n=96)
    env = dict(os.environ, CITER_ROOT=str(project), PREFECT_HOME=str(project / ".state" / "prefect"))
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    first = subprocess.run(
        [CITER, "pipeline"], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stderr[-3000:]
    table = first.stdout.split("pipeline finished:\n", 1)[1].splitlines()
    assert table[0].strip().startswith("no champion: candidate evaluated on 96 questions, fewer than"), table
    preds = project / "outputs" / "predictions.jsonl"
    assert preds.read_text() == ""
    assert json.loads(preds.with_name("predictions.jsonl.meta.json").read_text())["status"].startswith(
        "no champion"
    )

    rc, took, err = _interrupt_when(project, ["pipeline"], "sweep ")
    assert rc == 130 and took < LIMIT_S, (rc, took, err[-2000:])
    assert _last_line(err) == "interrupted (SIGINT): stopped" and "error:" not in err, err[-2000:]

    client = mlflow.MlflowClient(f"sqlite:///{project}/mlflow.db")
    runs = client.search_runs(
        [client.get_experiment_by_name("citer").experiment_id], order_by=["start_time DESC"]
    )
    pipelines = [r for r in runs if r.info.run_name == "pipeline"]
    assert [r.info.status for r in pipelines] == ["KILLED", "FINISHED"], [r.info.status for r in pipelines]
    assert "RUNNING" not in {r.info.status for r in runs}
