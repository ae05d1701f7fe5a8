"""Ctrl-C stops a real `citer` command within seconds: SIGINT to the process group (what a terminal sends, Prefect's
temporary server included) during bootstrap and during a pipeline's sweep -> exit 130 and one line, nothing of the
group left alive, and the pipeline's MLflow runs closed (the parent KILLED, none RUNNING)."""

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


@pytest.mark.slow  # ~90 s: validate, eval, labels and routers on the tiny pair, then the sweep until the signal
def test_ctrl_c_during_a_pipelines_sweep_closes_its_runs(project, answering_pair_dirs):
    import mlflow

    over = {
        "eval": {"n_examples": 4, "max_new_tokens": 8},
        "labels": {"n_examples": 12, "max_new_tokens": 8},
        "sweep": {"n_examples": 0, "max_new_tokens": 48, "decode_batch_size": 8},  # long enough to interrupt
    }
    write_pair_project(project, answering_pair_dirs, over, n=96)
    rc, took, err = _interrupt_when(project, ["pipeline"], "sweep ")
    assert rc == 130 and took < LIMIT_S, (rc, took, err[-2000:])
    assert _last_line(err) == "interrupted (SIGINT): stopped" and "error:" not in err, err[-2000:]

    client = mlflow.MlflowClient(f"sqlite:///{project}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("citer").experiment_id])
    status = {r.info.run_name: r.info.status for r in runs}
    assert status["pipeline"] == "KILLED", status
    assert "RUNNING" not in status.values() and {"validate", "eval_models", "router_iter2"} <= set(status), (
        status
    )
