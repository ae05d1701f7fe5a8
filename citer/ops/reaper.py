"""No child outlives a killed ``citer`` command: a watchdog process that reaps its descendants.

A SIGKILL gives a process no chance to stop its children, and Prefect's temporary API server (a uvicorn subprocess,
~200 MB) would keep running. :func:`start_reaper` starts this module as a separate process in its own session: it
notes the command's descendants every ``interval`` seconds (psutil) and, once the command is gone, sends them
SIGTERM, then SIGKILL to any still running two seconds later. A zombie (dead, not yet reaped) counts as gone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def running(proc: psutil.Process) -> bool:
    """``proc`` is still the process it was (not a reused pid) and not a zombie."""
    try:
        return proc.is_running() and proc.status() not in _GONE
    except psutil.Error:
        return False


def start_time(pid: int | None = None) -> str:
    """When ``pid`` (default: this process) started, as text: with the pid, a process's identity; "" if gone."""
    try:
        return repr(psutil.Process(pid).create_time())
    except psutil.Error:
        return ""


def alive(pid: int, start: str) -> bool:
    """``pid`` is still the process that started at ``start`` (:func:`start_time`) and not a zombie."""
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return False
    return repr(proc.create_time()) == start and running(proc)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every descendant of ``pid`` (default: this process), zombies included."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM ``procs``, then SIGKILL those still running ``grace`` s later. (Polled rather than
    ``psutil.wait_procs``, which waits for a zombie that is not our child as for a live process.)"""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(running(p) for p in procs):
        time.sleep(0.05)
    for proc in procs:
        if running(proc):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def watch(target: int, interval: float = 0.5, grace: float = 2.0) -> list[int]:
    """Block until ``target`` exits, then stop the descendants last seen; returns the pids signalled."""
    try:
        proc = psutil.Process(target)
    except psutil.Error:
        return []
    seen: dict[int, psutil.Process] = {}
    while running(proc):
        # Accumulate: a poll landing while the target dies may find its children already handed to init.
        seen.update({p.pid: p for p in descendants(target) if p.pid != os.getpid()})
        time.sleep(interval)
    hit = [p for p in seen.values() if running(p)]
    stop(hit, grace)
    return [p.pid for p in hit]


def ancestor_named(name: str) -> psutil.Process | None:
    """The nearest ancestor of this process whose program is ``name`` (e.g. the ``dvc`` that runs a stage), or
    None."""
    for proc in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if any(Path(a).name == name for a in proc.cmdline()[:2]):
                return proc
    return None


def start_reaper(target: int | None = None) -> subprocess.Popen | None:
    """Start the watchdog for ``target`` (default: this process). None when ``CITER_NO_REAPER=1``."""
    if os.environ.get("CITER_NO_REAPER", "").strip() in {"1", "true", "yes"}:
        return None
    target = os.getpid() if target is None else target
    return subprocess.Popen(
        [sys.executable, "-m", "citer.ops.reaper", str(target)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the command's process group: a Ctrl-C or group kill does not stop it first
        close_fds=True,
    )


if __name__ == "__main__":  # pragma: no cover - the watchdog process itself
    watch(int(sys.argv[1]))
