"""Ctrl-C within seconds (citer.ops.interrupt): the deadline that ends a hung unwinding, the runs it closes, and the
runs a SIGKILL left RUNNING, closed at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

HUNG = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from citer.ops import interrupt
    interrupt.install(grace_s=1.0)
    interrupt.on_interrupt(lambda: Path(sys.argv[1]).write_text("closed"))
    ready = False
    while True:  # a library that swallows KeyboardInterrupt and retries (Prefect reporting to a dead server)
        try:
            if not ready:
                ready = print("ready", flush=True) or True
            time.sleep(0.05)
        except KeyboardInterrupt:
            pass
    """
)


def _start(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG, str(tmp_path / "closed.txt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_hung_unwinding_ends_at_the_deadline_with_one_line(tmp_path):
    proc = _start(tmp_path)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5  # 1 s grace, not the library's retries
    assert err.strip() == "interrupted (SIGINT): stopped"
    assert (tmp_path / "closed.txt").read_text() == "closed"  # what was open was closed first


def test_a_second_signal_stops_at_once_and_sigterm_exits_143(tmp_path):
    proc = _start(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 143 and time.monotonic() - t0 < 0.9  # before the 1 s deadline


def test_an_interrupted_stage_run_is_killed_not_running(project):
    import mlflow
    import pytest

    from citer.project import load_project
    from flows.common import stage_run

    proj = load_project(optional=True)
    with pytest.raises(KeyboardInterrupt), stage_run(proj, "pipeline") as parent:
        with stage_run(proj, "sweep", parent_run_id=parent.run_id) as child:
            raise KeyboardInterrupt
    client = mlflow.MlflowClient(proj.tracking_uri)
    assert client.get_run(child.run_id).info.status == "KILLED"
    assert client.get_run(parent.run_id).info.status == "KILLED"
    with pytest.raises(ValueError), stage_run(proj, "sweep") as failed:
        raise ValueError("bad data")
    assert client.get_run(failed.run_id).info.status == "FAILED"


def test_runs_a_sigkill_left_running_are_closed_at_the_next_start(project):
    """A SIGKILLed command cannot close its run; the next command (holding the project lock) marks it KILLED, and
    leaves alone a run whose process is alive."""
    import mlflow

    from citer.ops.reaper import start_time
    from citer.project import load_project
    from flows.common import _owner_tags, close_orphan_runs, ensure_experiment

    proj = load_project(optional=True)
    exp = ensure_experiment(proj)
    client = mlflow.MlflowClient(proj.tracking_uri)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_time(dead.pid)
    dead.wait()
    mine = _owner_tags()
    gone = client.create_run(exp, tags=mine | {"citer.pid": str(dead.pid), "citer.pid_start": start})
    live = client.create_run(exp, tags=mine)  # this process: still running
    assert close_orphan_runs(proj) == [gone.info.run_id]
    assert client.get_run(gone.info.run_id).info.status == "KILLED"
    assert client.get_run(live.info.run_id).info.status == "RUNNING"
