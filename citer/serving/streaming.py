"""Answers streamed as server-sent events in OpenAI's chunk format, piece by piece as the engine decodes them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from citer.serving.protocol import Sampling, sse_event
from citer.serving.scheduler import _Server


class SSE:
    """One answer as OpenAI stream events: (chat: a role chunk), a chunk per piece, a finish chunk, then a last chunk
    with no choices carrying the routing stats (and usage when asked), then ``data: [DONE]``."""

    def __init__(self, model_name: str, *, chat: bool) -> None:
        self.chat = chat
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> str:
        return sse_event(self.head | {"choices": [self._choice("", None, role=True)]}) if self.chat else ""

    def piece(self, text: str, from_llm: list[bool]) -> str:
        # Per chunk: which of its tokens the LLM wrote, so a client can highlight them.
        return sse_event(self.head | {"choices": [self._choice(text, None)], "citer": {"from_llm": from_llm}})

    def end(self, finish_reason: str, citer: dict[str, Any], usage: dict[str, int] | None) -> Iterator[str]:
        yield sse_event(self.head | {"choices": [self._choice(None if self.chat else "", finish_reason)]})
        last = self.head | {"choices": [], "citer": citer}
        if usage is not None:
            last["usage"] = usage
        yield sse_event(last)
        yield "data: [DONE]\n\n"


async def stream_response(
    srv: _Server, text: tuple[str, str], s: Sampling, *, chat: bool
) -> StreamingResponse:
    """A streamed answer; the request is refused (400) rather than streamed when the engine refuses it outright."""
    events = srv.stream(text, s)
    try:
        first = await anext(events)  # waits for the first piece: an error here is still a plain 400
    except BaseException:
        await events.aclose()
        raise
    sse = SSE(srv.model_name, chat=chat)

    async def chunks() -> AsyncIterator[str]:
        try:
            if start := sse.start():
                yield start
            ev = first
            while ev[0] == "piece":
                yield sse.piece(*ev[1])
                ev = await anext(events)
            d = ev[1]
            usage = srv.usage([d]) if s.include_usage else None
            for chunk in sse.end(d.finish_reason, dict(d.stats["total"]), usage):
                yield chunk
        finally:
            await events.aclose()  # a client that went away cancels its rows

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
