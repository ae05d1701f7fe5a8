"""What a request hands the engine thread (a :class:`Job`) and what it gets back per choice (a :class:`Decoded`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from citer.serving.logprobs import TokenLP
from citer.serving.protocol import Sampling


@dataclass
class Decoded:
    """One choice's answer: text after stop handling, and routing stats; ``logprobs``: one entry per token of
    ``text`` (when asked for)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]
    logprobs: list[TokenLP] | None = None


@dataclass(eq=False)
class Job:
    """One request on its way through the engine; events go to ``events`` on the request's event loop."""

    prompts: list[list[int]]
    s: Sampling
    loop: asyncio.AbstractEventLoop
    score: list[tuple[list[int], list[int]]] | None = None  # a scoring job: (prompt, continuation) pairs
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    keys: dict[int, int] = field(default_factory=dict)  # session key -> choice index (prompt * n + sample)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def rows(self) -> int:
        return 0 if self.score is not None else len(self.prompts) * self.s.n

    def post(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (client and server shut down): nobody listens
            pass


def usage(ds: list[Decoded], n: int = 1) -> dict[str, int]:
    """OpenAI's usage of ``ds`` (``n`` choices per prompt): a prompt counts once, however many choices it has."""
    p = sum(d.prompt_tokens for d in ds[::n])
    c = sum(d.completion_tokens for d in ds)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def deliver(events: list[tuple[Job, tuple[Any, ...]]]) -> None:
    for job, ev in events:
        job.events.put_nowait(ev)
