"""The fault matrix's process watch sees what a child became after exec, not only what it was when first seen."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fault_procs import TreeWatch

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="the watch reads /proc (Linux)")

# A child that stays a copy of its parent (the same command line) for a while before it execs: what a watch sees
# between a fork and its exec, stretched so every poll of the old watch saw only the parent's command line.
PARENT = textwrap.dedent(
    """
    import os, time
    pid = os.fork()
    if pid == 0:
        time.sleep(0.6)
        os.execv("/bin/sleep", ["/bin/sleep", "30"])
    time.sleep(30)
    """
)


def test_a_child_first_seen_before_its_exec_matches_what_it_execs():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    watch = TreeWatch(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while not watch.matching("/bin/sleep 30") and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.stop()
        assert watch.matching("/bin/sleep 30"), watch.seen
        # it was seen as the parent's copy first (the case the watch must not stop at)
        assert watch.matching("import os, time"), watch.seen
        assert any(cmd == "/bin/sleep 30" for _, cmd in watch.seen.values()), watch.seen
    finally:
        for pid in watch.seen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
