"""A killed command's processes: every descendant noted while it runs (from /proc), a SIGKILL once a fault point
holds, and which of its processes (or any other running in the project) outlived it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fault_harness import Proc, Proj

from citer.reaper import alive, descendants, pids, stat

GRACE_S = 5.0  # a process of a killed command may outlive it this long (the reaper's poll + SIGTERM grace)


def cmdline(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]


def in_dir(root: Path) -> dict[int, str]:
    """Live processes (not this one, no zombies) whose working directory is ``root`` or below it: pid -> start
    time."""
    out = {}
    for pid in pids():
        if pid == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        st = stat(pid)
        if st is not None and cwd.is_relative_to(root):
            out[pid] = st[1]
    return out


class TreeWatch:
    """Notes every descendant of ``pid`` (and its command line) every 0.1 s while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[str, str]] = {}  # pid -> (start time, its latest command line)
        self._cmds: set[str] = set()  # every command line read, so an exec'd child still matches what it was
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def snapshot(self) -> None:
        # Zombies too: a child that already died still counts as one the command started. A child first seen between
        # fork and exec shows its parent's command line, or none while exec swaps it: read it again each time.
        for pid, start in descendants(self.pid, zombies=True).items():
            cmd = cmdline(pid)
            known = self.seen.get(pid)
            if known is None or (known[0] == start and cmd not in ("", "?")):
                self.seen[pid] = (start, cmd)
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
        os.kill(proc.pid, signal.SIGKILL)
    proj.finish(proc, timeout=30)
    watch.stop()
    deadline = time.monotonic() + GRACE_S
    tracked = {pid: start for pid, (start, _) in watch.seen.items()}
    while time.monotonic() < deadline:
        tracked |= in_dir(proj.root)
        if not any(alive(p, s) for p, s in tracked.items()):
            break
        time.sleep(0.1)
    tracked |= in_dir(proj.root)
    left = [p for p, s in tracked.items() if alive(p, s)]
    survivors = [f"pid {p}: {watch.seen[p][1] if p in watch.seen else cmdline(p)}" for p in left]
    for p in left:  # our own command's processes: stop them so they do not hold the project
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return Kill(fired, round(at, 2), [cmd for _, cmd in watch.seen.values()], survivors)
