"""One writer at a time per project, and what a killed writer left behind.

Every stage that writes shared state (the registry and its alias, ``reports/``, a route output) runs inside
:func:`project_lock`: an OS file lock on ``.state/project.lock`` (``flock``: the kernel drops it when the holder dies,
so a SIGKILL never leaves a stale lock). A second run waits, saying for whom, or refuses at once (``lock.wait``).
The lock is re-entrant within a process, so ``citer pipeline`` holds it once across its stages.

Atomic writers (:mod:`citer.ops.io`) write ``.{name}.*.tmp`` siblings and rename them; a killed writer leaves those
behind, and :func:`remove_leftovers` deletes them at the next start, under the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

LOCK_FILE = ".state/project.lock"
HOLDER_FILE = ".state/project.lock.json"


class ProjectLocked(OSError):
    """Another run holds the project lock (and ``lock.wait`` is false, or the wait timed out)."""


def _holder(root: Path) -> str:
    try:
        info = json.loads((root / HOLDER_FILE).read_text(encoding="utf-8"))
        return f"pid {info['pid']} ({info['what']}, since {info['since']})"
    except (OSError, ValueError, KeyError):
        return "another process"


@contextlib.contextmanager
def project_lock(
    root: str | os.PathLike[str],
    what: str,
    *,
    wait: bool = True,
    timeout_s: float = 3600.0,
    say: Callable[[str], Any] | None = None,
) -> Iterator[None]:
    """Hold the project's lock while the block runs. ``what`` (e.g. ``sweep``) names the holder in messages.

    Held already by this process (a stage inside ``citer pipeline``): enters at once. Held elsewhere: with ``wait``
    say so and wait up to ``timeout_s``, else raise :class:`ProjectLocked` naming the holder.
    """
    from filelock import FileLock, Timeout

    root = Path(root)
    path = root / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # One object per path, its count shared by every thread: re-entrant across the stages (and threads) of one run.
    lock = FileLock(str(path), is_singleton=True, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = _holder(root)
        if not wait:
            raise ProjectLocked(
                f"{root}: the project is locked by {holder}; wait for it to finish or set lock.wait: true"
            ) from None
        (say or (lambda _m: None))(f"waiting for the project lock held by {holder} (up to {timeout_s:g} s)")
        try:
            lock.acquire(timeout=timeout_s)
        except Timeout:
            raise ProjectLocked(
                f"{root}: the project is still locked by {holder} after {timeout_s:g} s (lock.timeout_s)"
            ) from None
    try:
        if lock.lock_counter == 1:
            since = time.strftime("%Y-%m-%dT%H:%M:%S")
            info = {"pid": os.getpid(), "what": what, "since": since}
            (root / HOLDER_FILE).write_text(json.dumps(info), encoding="utf-8")
        yield
    finally:
        lock.release()


def remove_leftovers(dirs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Delete what killed atomic writers left in ``dirs`` (recursively): ``.{name}.*.tmp`` files and directories
    and ``.{name}.old-{pid}`` directories. Call it holding the project lock, so no live writer owns them."""
    gone: list[Path] = []
    for d in dirs:
        base = Path(d)
        if not base.is_dir():
            continue
        found = [p for p in base.rglob(".*") if p.name.endswith(".tmp") or ".old-" in p.name]
        for p in sorted(found, key=lambda q: len(q.parts)):  # parents first; their children go with them
            if not p.exists() and not p.is_symlink():
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p)
    return gone
