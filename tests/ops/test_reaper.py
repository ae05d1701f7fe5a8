"""A SIGKILLed command takes its children with it: the reaper stops the descendants it saw."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from citer.ops.reaper import alive, descendants, running, start_time

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="these tests read /proc (Linux)")

PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from citer.ops.reaper import start_reaper
    start_reaper()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands in for a server
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A killed child stays a zombie until reaped by init; a zombie counts as gone.
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z":
            return True
        time.sleep(0.1)
    return False


def test_a_killed_parent_takes_its_child_along():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.5)  # the reaper has seen the child
    assert child in {p.pid for p in descendants(parent.pid)}
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _gone(child, 6.0), "the child outlived its killed parent"


def test_a_killed_parent_left_unreaped_still_takes_its_child_along():
    # The killed command stays a zombie (nobody waits for it): its children are already orphaned.
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.5)
    os.kill(parent.pid, signal.SIGKILL)
    try:
        assert _gone(child, 6.0), "the child outlived its killed (zombie) parent"
    finally:
        parent.wait()


def _state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, Z, ...), None once the pid is reaped."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


def test_a_running_parent_keeps_its_children():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        # Watched over several of the reaper's polls (0.5 s): a child it wrongly stopped turns up as a zombie, since
        # PARENT never waits for it, and os.kill(child, 0) would still succeed on that zombie.
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            state = _state(child)
            assert state not in (None, "Z", "X"), f"the child of a running parent was stopped (state {state})"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()


def test_a_zombie_child_is_a_descendant_but_not_alive():
    # This process does not wait for its child yet: once it exits it is a zombie, still our child in /proc.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_time(child.pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(child.pid, start):
        time.sleep(0.05)
    try:
        assert start and not alive(child.pid, start)
        zombie = next(p for p in descendants(os.getpid()) if p.pid == child.pid)
        assert _state(child.pid) == "Z" and not running(zombie)
    finally:
        child.wait()
    assert start_time(child.pid) == "" and not alive(child.pid, start)


def test_ancestor_named_finds_the_program_that_runs_this_one():
    """How a stage under `dvc repro` finds its dvc (its runs share a tag): the nearest ancestor by program name."""
    import subprocess
    import sys

    code = "from citer.ops.reaper import ancestor_named; print(ancestor_named('sh').pid, ancestor_named('no-such-prog'))"
    out = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{code}"; true'], capture_output=True, text=True
    )
    found, missing = out.stdout.strip().split(" ")
    assert int(found) > 1 and missing == "None", out
