"""The server tests' engine, their real app on a real socket, and a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conftest import spread_router

from citer.decoding.engine import RoutedEngine
from citer.serving.local import serving_in_background as serving

__all__ = ["serving", "spread_engine", "wait_for"]


def spread_engine(tiny_pair: Any) -> RoutedEngine:
    """The tiny pair routed by the spread router at tau 0.5: both models write tokens."""
    slm, llm, tok = tiny_pair
    return RoutedEngine(
        slm, llm, spread_router(slm.config.hidden_size), tau=0.5, eos_token_id=tok.eos_token_id
    )


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
