"""The server tests' real app on a real socket, and a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable

from citer.serving.local import serving_in_background as serving

__all__ = ["serving", "wait_for"]


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
