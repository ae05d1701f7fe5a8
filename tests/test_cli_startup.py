"""A `citer` command's start-up (issue #48 item 5): what it starts early, and that results do not change.

- ``citer data validate`` loads Great Expectations in a helper process while it starts Prefect and MLflow: the same
  findings as validating in the process itself.
- Under ``dvc repro`` the first stage command leaves one Prefect server that the later stages use; it stops when the
  ``dvc`` process is gone.
- The console command exits without tearing down the interpreter: its exit codes and output are unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import FIXTURES, REPO

CITER = str(Path(sys.executable).parent / "citer")
FILES = [
    (FIXTURES / "bad" / "mc_duplicate_labels.jsonl", "mc"),
    (FIXTURES / "bad" / "math_no_boxed.jsonl", "math"),
    (FIXTURES / "warn" / "math_empty_boxed.jsonl", "math"),
    (FIXTURES / "bad" / "mc_empty_file.jsonl", "mc"),
]


def test_validation_worker_finds_what_the_process_finds(monkeypatch):
    from citer.data import validate as v

    monkeypatch.setattr(v, "_GX_STATE", {})  # as in a fresh command: GE not loaded here yet
    v.start_worker()
    try:
        assert v._WORKER, "no worker started"

        def here(*_a, **_k):
            raise AssertionError("validated in this process, not in the worker")

        with monkeypatch.context() as m:
            m.setattr(v, "_ge_findings_here", here)
            remote = [v.validate_file(p, fmt, max_bad_row_fraction=0.5).to_dict() for p, fmt in FILES]
        assert v._WORKER, "the worker stopped"
    finally:
        v.stop_worker()
    assert not v._WORKER
    local = [v.validate_file(p, fmt, max_bad_row_fraction=0.5).to_dict() for p, fmt in FILES]
    assert remote == local
    assert any(r["n_errors"] for r in local) and any(r["n_warnings"] for r in local)


def test_validation_falls_back_to_this_process_when_the_worker_dies(monkeypatch):
    from citer.data import validate as v

    monkeypatch.setattr(v, "_GX_STATE", {})
    v.start_worker()
    v._WORKER["proc"].kill()
    v._WORKER["proc"].wait()
    path, fmt = FILES[0]
    try:
        report = v.validate_file(path, fmt)
    finally:
        v.stop_worker()
    assert not report.ok and not v._WORKER


def _console(args, cwd, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CITER_", "PREFECT_API_URL"))}
    return subprocess.run(
        [CITER, *args], cwd=cwd, env=full | env, capture_output=True, text=True, timeout=300
    )


def test_console_exit_codes_and_output(tmp_path):
    """The console command's fast exit keeps what `sys.exit` gave: codes 0/1/2 and every line of output."""
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"problem": "1 + 1?", "solution": "1 + 1 = 2. \\boxed{2}"}) + "\n")
    ok = _console(["data", "validate", str(good), "-f", "math", "--report", "r.json"], tmp_path)
    assert ok.returncode == 0 and "1 rows, 0 errors" in ok.stdout, ok.stderr
    assert json.loads((tmp_path / "r.json").read_text())["files"][0]["n_rows"] == 1
    bad = _console(
        ["data", "validate", str(FIXTURES / "bad" / "mc_duplicate_labels.jsonl"), "-f", "mc"], tmp_path
    )
    assert bad.returncode == 1 and "REFUSED" in bad.stdout and "refused" in bad.stderr, bad.stderr
    assert _console(["data", "validate", str(good)], tmp_path).returncode == 2
    assert _console(["--help"], tmp_path).returncode == 0


_JOIN = """
import json, sys
from citer.cli import prefect_server as ps
ps._join(int(sys.argv[1]), sys.argv[2])
ps.ready()
print(json.dumps({"url": ps._STATE["url"], "keeper": list(ps._STATE["keeper"])}))
"""


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_a_repro_shares_one_server_that_stops_with_dvc(tmp_path):
    from citer.ops.reaper import alive, start_time

    home = tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(["sleep", "300"])  # stands in for the `dvc repro` process
    try:
        args = [sys.executable, "-c", _JOIN, str(owner.pid), start_time(owner.pid)]
        first = json.loads(
            subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
        )
        second = json.loads(
            subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
        )
        assert first == second  # the second stage found the first one's server
        assert _up(first["url"]) and alive(*first["keeper"])
        assert [p.name for p in (home / "citer-server").glob("*.json")] != []
    finally:
        owner.send_signal(signal.SIGTERM)
        owner.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (alive(*first["keeper"]) or _up(first["url"])):
        time.sleep(0.2)
    assert not alive(*first["keeper"]) and not _up(first["url"])
    assert list((home / "citer-server").glob("*")) == []  # unregistered, nothing left behind
