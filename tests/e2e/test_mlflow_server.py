"""A stage logs to a real MLflow tracking server over HTTP (sqlite backend, proxied artifacts), as a team setup does."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``(url, store_dir)`` of an ``mlflow server`` on loopback; killed with its process group at the end."""
    store = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(exe),
        "server",
        "--backend-store-uri",
        f"sqlite:///{store}/mlflow.db",
        "--artifacts-destination",
        str(store / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = (store / "server.log").open("w")
    env = os.environ | {"MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=store, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # migrations of a fresh sqlite store take a while on 2 busy cores
        while True:
            assert proc.poll() is None, f"mlflow server exited: {(store / 'server.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not become healthy in 120 s"
            time.sleep(0.5)
        yield url, store
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.slow
def test_validate_stage_logs_to_tracking_server(mlflow_server, prefect_server, project, monkeypatch):
    import mlflow

    from flows.validate import validate_flow

    url, store = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    (project / "params.yaml").write_text("registry:\n  experiment: server-test\n", encoding="utf-8")
    data = project / "math.jsonl"
    rows = [{"problem": f"{a} + 1", "solution": f"{a} + 1 = \\boxed{{{a + 1}}}"} for a in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    reports = validate_flow(params_path="params.yaml", files=[(str(data), "math")])
    assert [r["ok"] for r in reports] == [True]

    client = mlflow.MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name("server-test")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`citer.stage` = 'validate'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["n_rows"] == 3 and run.data.metrics["n_errors"] == 0
    assert run.data.metrics["n_files"] == 1
    assert run.data.params["files"] == "['math.jsonl:math']"  # the project records files relative to its root
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["validation.json"]
    # The run lives in the server's own store: it went over HTTP, not into a local file.
    with sqlite3.connect(store / "mlflow.db") as db:
        ids = [r[0] for r in db.execute("SELECT run_uuid FROM runs WHERE status = 'FINISHED'")]
    assert run.info.run_id in ids
    assert not (project / "mlflow.db").exists()
