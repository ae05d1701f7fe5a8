"""A killed command's processes: every descendant noted while it runs (psutil), a SIGKILL once a fault point holds,
and which of its processes (or any other running in the project) outlived it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from fault_harness import Proc, Proj

from citer.ops.reaper import descendants, running

GRACE_S = 5.0  # a process of a killed command may outlive it this long (the reaper's poll + SIGTERM grace)


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()).strip()[:160]
    except psutil.Error:
        return "?"


def in_dir(root: Path) -> dict[int, psutil.Process]:
    """Live processes (not this one, no zombies) whose working directory is ``root`` or below it."""
    out = {}
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info["cwd"]
        if proc.pid != os.getpid() and cwd and Path(cwd).is_relative_to(root) and running(proc):
            out[proc.pid] = proc
    return out


class TreeWatch:
    """Notes every descendant of ``pid`` (and its command line) every 0.1 s while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[psutil.Process, str]] = {}  # pid -> (the process, its latest command line)
        self._cmds: set[str] = set()  # every command line read, so an exec'd child still matches what it was
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def snapshot(self) -> None:
        # Zombies too: a child that already died still counts as one the command started. A child first seen between
        # fork and exec shows its parent's command line, or none while exec swaps it: read it again each time.
        for proc in descendants(self.pid):
            cmd = cmdline(proc)
            known = self.seen.get(proc.pid)
            if known is None or (known[0] == proc and cmd not in ("", "?")):
                self.seen[proc.pid] = (proc, cmd)
            self._cmds.add(cmd)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.snapshot()
            self._stop.wait(0.1)

    def stop(self) -> None:
        self.snapshot()
        self._stop.set()
        self._thread.join()

    def matching(self, text: str) -> bool:
        return any(text in cmd for cmd in tuple(self._cmds))


@dataclass
class Kill:
    fired: bool  # the fault point was reached (else the command ended or the wait timed out first)
    at_s: float
    seen: list[str]  # command lines of the descendants seen
    survivors: list[str]  # processes still alive GRACE_S after the kill (then stopped by this script)

    def text(self) -> str:
        if not self.survivors:
            return f"no process of it alive {GRACE_S:g} s later ({len(self.seen)} descendant(s) seen)"
        return f"{len(self.survivors)} process(es) alive {GRACE_S:g} s after the kill: {self.survivors}"


def kill_when(proj: Proj, proc: Proc, point: Callable[[TreeWatch], bool], timeout: float) -> Kill:
    """SIGKILL the command once ``point`` holds; then wait GRACE_S for its descendants (and anything else running in
    the project) to go, and stop what is left."""
    watch = TreeWatch(proc.pid)
    fired = False
    while proc.running() and time.monotonic() - proc.t0 < timeout:
        if point(watch):
            fired = True
            break
        time.sleep(0.02)
    watch.snapshot()
    at = time.monotonic() - proc.t0
    if proc.running():
        proc.killed = "fault"
        proc.popen.kill()
    proj.finish(proc, timeout=30)
    watch.stop()
    deadline = time.monotonic() + GRACE_S
    tracked = {pid: p for pid, (p, _) in watch.seen.items()}
    while time.monotonic() < deadline:
        tracked |= in_dir(proj.root)
        if not any(running(p) for p in tracked.values()):
            break
        time.sleep(0.1)
    tracked |= in_dir(proj.root)
    left = [p for p in tracked.values() if running(p)]
    survivors = [f"pid {p.pid}: {watch.seen[p.pid][1] if p.pid in watch.seen else cmdline(p)}" for p in left]
    for p in left:  # our own command's processes: stop them so they do not hold the project
        with contextlib.suppress(psutil.Error):
            p.kill()
    return Kill(fired, round(at, 2), [cmd for _, cmd in watch.seen.values()], survivors)
