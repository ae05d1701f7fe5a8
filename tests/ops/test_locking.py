"""The project lock: one writer at a time across processes, re-entrant within one, released when its holder dies;
and the leftovers a killed atomic writer leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from citer.ops.io import atomic_dir, atomic_path
from citer.ops.locking import HOLDER_FILE, ProjectLocked, project_lock, remove_leftovers

HOLD = textwrap.dedent(
    """
    import sys, time
    from citer.ops.locking import project_lock
    with project_lock(sys.argv[1], "holder"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


def _holder(root: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_reentrant_in_one_process(tmp_path):
    with project_lock(tmp_path, "pipeline"), project_lock(tmp_path, "sweep"):
        assert (tmp_path / HOLDER_FILE).read_text().count('"what": "pipeline"') == 1
    with project_lock(tmp_path, "again", wait=False):  # released: free again
        pass


def test_a_second_process_refuses_or_waits(tmp_path):
    proc = _holder(tmp_path, 30)
    try:
        with (
            pytest.raises(ProjectLocked, match=rf"locked by pid {proc.pid} \(holder"),
            project_lock(tmp_path, "sweep", wait=False),
        ):
            pass
        with (
            pytest.raises(ProjectLocked, match="still locked .* after 0.3 s"),
            project_lock(tmp_path, "sweep", timeout_s=0.3),
        ):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_waiting_says_for_whom_and_enters_when_released(tmp_path):
    proc = _holder(tmp_path, 1.0)
    said = []
    t0 = time.monotonic()
    with project_lock(tmp_path, "route", say=said.append):
        waited = time.monotonic() - t0
    proc.wait()
    assert said and f"pid {proc.pid}" in said[0] and waited > 0.3


def test_sigkill_releases_the_lock(tmp_path):
    proc = _holder(tmp_path, 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with project_lock(tmp_path, "after", wait=False):  # the kernel dropped the dead holder's flock
        pass


def test_remove_leftovers_only_touches_tmp_siblings(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "sweep.json").write_text("{}")
    (reports / ".sweep.json.abc.tmp").write_text("half")  # a killed atomic_path
    (reports / "pareto").mkdir()
    (reports / "pareto" / ".citer.csv.x.tmp").write_text("half")
    routers = tmp_path / "routers"
    (routers / ".iter2.k3.tmp").mkdir(parents=True)  # a killed atomic_dir
    (routers / ".iter2.k3.tmp" / "router.json").write_text("{}")
    (routers / ".iter1.old-123").mkdir()
    (routers / "iter1").mkdir()
    (routers / "iter1" / "router.json").write_text("{}")
    gone = remove_leftovers([reports, routers, tmp_path / "absent"])
    assert len(gone) == 4
    assert sorted(p.name for p in reports.rglob("*")) == ["pareto", "sweep.json"]
    assert sorted(p.name for p in routers.iterdir()) == ["iter1"]
    # What the atomic writers leave on success and on an exception: nothing to remove.
    with atomic_path(reports / "a.json") as tmp:
        tmp.write_text("{}")
    with pytest.raises(RuntimeError), atomic_dir(routers / "iter3"):
        raise RuntimeError("killed")
    assert remove_leftovers([reports, routers]) == []


def test_a_stage_inside_a_command_leaves_the_commands_own_writers_alone(project):
    """``citer pipeline`` finetunes the SLM (a stage of its own) while a worker writes the LLM's temporary
    directory: only the command's first stage cleans up, so only a killed run's leftovers go."""
    import shutil

    from flows.common import locked

    shutil.copy(Path(__file__).resolve().parents[2] / "params.yaml", project / "params.yaml")
    models = project / "models"
    models.mkdir()
    killed = models / ".llm.killed.tmp"
    killed.mkdir()
    live = models / ".llm.live.tmp"

    @locked("finetune")
    def inner(params_path: str = "params.yaml") -> bool:
        return live.is_dir()

    @locked("pipeline")
    def outer(params_path: str = "params.yaml") -> bool:
        assert not killed.exists()  # cleaned before the command's work
        live.mkdir()  # the command's own writer, still writing when the inner stage starts
        return inner(params_path)

    assert outer("params.yaml") is True
    assert live.is_dir()
