"""No child outlives a killed ``citer`` command: a watchdog process that reaps its descendants.

A SIGKILL gives a process no chance to stop its children, and Prefect's temporary API server (a uvicorn subprocess,
~200 MB) would keep running. :func:`start_reaper` starts this module as a separate process in its own session: it
notes the command's descendants every ``interval`` seconds and, once the command is gone, sends them SIGTERM, then
SIGKILL to any still alive two seconds later. Linux only (it reads ``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")


def stat(pid: int, zombies: bool = False) -> tuple[int, str] | None:
    """(parent pid, start time) of ``pid`` from /proc, or None when it is gone. A zombie (dead, not yet reaped: its
    children have already been handed to init) counts as gone unless ``zombies``."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # After "pid (comm) ": state, ppid, ..., starttime (the 22nd field of the line).
    fields = text[text.rindex(")") + 2 :].split()
    if not zombies and fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[19]


def pids() -> list[int]:
    """Every process id in /proc."""
    return [int(e.name) for e in PROC.iterdir() if e.name.isdigit()]


def descendants(root: int, zombies: bool = False) -> dict[int, str]:
    """Every live descendant of ``root`` (zombies too with ``zombies``): pid -> start time (to tell a reused pid
    from the same process)."""
    parent = {pid: st for pid in pids() if (st := stat(pid, zombies)) is not None}
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, (ppid, start) in parent.items():
            if ppid == p and child not in out:
                out[child] = start
                frontier.append(child)
    return out


def alive(pid: int, start: str) -> bool:
    """``pid`` is still the process that started at ``start`` and not a zombie."""
    st = stat(pid)
    return st is not None and st[1] == start


def watch(target: int, interval: float = 0.5, grace: float = 2.0) -> list[int]:
    """Block until ``target`` exits, then stop the descendants last seen; returns the pids signalled."""
    me = os.getpid()
    seen: dict[int, str] = {}
    target_start = stat(target)
    while target_start is not None and alive(target, target_start[1]):
        # Accumulate: a poll landing while the target dies may find its children already handed to init.
        seen.update({pid: start for pid, start in descendants(target).items() if pid != me})
        time.sleep(interval)
    hit = [pid for pid, start in seen.items() if alive(pid, start)]
    for pid in hit:
        with_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid, seen[pid]) for pid in hit):
        time.sleep(0.1)
    for pid in hit:
        if alive(pid, seen[pid]):
            with_signal(pid, signal.SIGKILL)
    return hit


def ancestor_named(name: str) -> tuple[int, str] | None:
    """(pid, start time) of the nearest ancestor of this process whose program is ``name`` (e.g. the ``dvc`` that
    runs a stage), or None."""
    pid = os.getppid()
    while pid > 1:
        try:
            argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[:2]
        except OSError:
            return None
        st = stat(pid)
        if st is None:
            return None
        if any(Path(a.decode(errors="replace")).name == name for a in argv):
            return pid, st[1]
        pid = st[0]
    return None


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def start_reaper(target: int | None = None) -> subprocess.Popen | None:
    """Start the watchdog for ``target`` (default: this process). None where /proc is missing, or when
    ``CITER_NO_REAPER=1``."""
    if not PROC.is_dir() or os.environ.get("CITER_NO_REAPER", "").strip() in {"1", "true", "yes"}:
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
