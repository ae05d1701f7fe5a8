"""Progress bars for citer's long loops (labels, rollouts, sweep passes, evaluation, router epochs, batch inference).

One switch for all of them: bars show on an interactive stderr, never in logs, unless ``CITER_PROGRESS`` says
otherwise (``1`` forces them on, ``0`` off). Each bar prints its rate, so a user sees how long a stage will take.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def _disable() -> bool | None:
    """tqdm's ``disable`` argument: ``None`` (auto: only on a TTY), or forced by ``CITER_PROGRESS``."""
    flag = os.environ.get("CITER_PROGRESS", "").strip().lower()
    if flag in {"1", "true", "yes", "on"}:
        return False
    if flag in {"0", "false", "no", "off"}:
        return True
    return None


def progress(iterable: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``iterable`` wrapped in a bar labelled ``desc`` showing count, rate and time left."""
    from tqdm.auto import tqdm

    yield from tqdm(
        iterable, desc=desc, total=total, unit=unit, disable=_disable(), dynamic_ncols=True, leave=False
    )


def bar(desc: str, total: int | None = None, unit: str = "it", enabled: bool = True) -> Any:
    """A bar advanced by hand (``with bar(...) as b: b.update(n)``), for loops whose unit is not an item;
    ``enabled=False``: never shown, whatever ``CITER_PROGRESS`` says."""
    from tqdm.auto import tqdm

    off = True if not enabled else _disable()
    return tqdm(desc=desc, total=total, unit=unit, disable=off, dynamic_ncols=True, leave=False)
