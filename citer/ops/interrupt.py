"""Ctrl-C (SIGINT) or SIGTERM stops a ``citer`` command within seconds, with one line and exit code 128 + signal.

Python turns SIGINT into a KeyboardInterrupt that unwinds the stack, and that is tried first: a stage's MLflow run
is closed as ``KILLED`` on the way out (:func:`on_interrupt` callbacks) and locks and temporary files are let go.
But the unwinding can hang: a Ctrl-C reaches the whole process group, Prefect's temporary API server with it, and
Prefect then retries for minutes to report the crash to a server that is gone (measured: 71-150 s, ending in
``ConnectError``). So the handler also starts a deadline: ``grace_s`` later whatever is still open is closed by its
callback, the command's children are stopped, and the process exits at once. A second signal skips the wait.

:func:`install` is called by the console entry only (never on import: a library must not take a host's signals).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GRACE_S = 3.0

_lock = threading.Lock()
_callbacks: dict[int, Callable[[], Any]] = {}
_ids = itertools.count()
_state: dict[str, Any] = {"signum": None, "said": False, "grace_s": GRACE_S}


def on_interrupt(callback: Callable[[], Any]) -> int:
    """Run ``callback`` if the command is interrupted before :func:`done` is called with the returned token."""
    with _lock:
        token = next(_ids)
        _callbacks[token] = callback
    return token


def done(token: int) -> None:
    with _lock:
        _callbacks.pop(token, None)


def interrupted() -> int | None:
    """The signal that interrupted this command (SIGINT or SIGTERM), or None."""
    return _state["signum"]


def exit_code(signum: int | None = None) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM (what shells report for a signalled command)."""
    return 128 + int(signum or _state["signum"] or signal.SIGINT)


def say_once(text: str | None = None) -> None:
    """The one line an interrupted command prints (once, whoever gets there first)."""
    with _lock:
        if _state["said"]:
            return
        _state["said"] = True
    name = signal.Signals(_state["signum"] or signal.SIGINT).name
    print(text or f"interrupted ({name}): stopped", file=sys.stderr, flush=True)


def install(grace_s: float = GRACE_S) -> None:
    """Take SIGINT and SIGTERM for this process (main thread only); see the module docstring."""
    _state["grace_s"] = float(grace_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


def _handler(signum: int, _frame: Any) -> None:
    if _state["signum"] is not None:  # the second signal: stop now
        finish(signum)
    _state["signum"] = signum
    if os.environ.get("CITER_DEBUG", "").strip().lower() not in {"1", "true", "yes", "on"}:
        # What tools say while they fall over (a dead API server, retries) is not the user's to read: one line is.
        logging.disable(logging.CRITICAL)
    threading.Thread(target=_deadline, args=(signum,), name="citer-interrupt", daemon=True).start()
    raise KeyboardInterrupt


def _deadline(signum: int) -> None:
    time.sleep(_state["grace_s"])
    finish(signum)


def run_callbacks() -> None:
    """Close what is still open (each callback once; one that fails does not stop the others)."""
    with _lock:
        pending = list(_callbacks.values())
        _callbacks.clear()
    for cb in pending:
        try:
            cb()
        except Exception:  # noqa: BLE001 - the process is going down; the next start cleans what is left
            pass


def stop_children(grace_s: float = 1.0) -> None:
    """SIGTERM this process's descendants, then SIGKILL those still alive after ``grace_s``."""
    from citer.ops.reaper import descendants, stop

    stop(descendants(), grace_s)


def finish(signum: int) -> None:
    """Close what is open, say so, stop the children and exit now with 128 + ``signum``."""
    _state["signum"] = _state["signum"] or signum
    run_callbacks()
    say_once()
    stop_children()
    os._exit(exit_code(signum))
