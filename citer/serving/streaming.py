"""Answers streamed as server-sent events in OpenAI's chunk format, piece by piece as the engine decodes them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from citer.serving.jobs import Decoded, usage
from citer.serving.logprobs import TokenLP, chat_logprobs, completion_logprobs
from citer.serving.protocol import Sampling, sse_event
from citer.serving.scheduler import _Server


class SSE:
    """Choices as OpenAI stream events: (chat: a role chunk per choice), a chunk per piece of a choice, a finish
    chunk per choice, then a last chunk with no choices carrying the routing stats (and usage when asked), then
    ``data: [DONE]``. With log-probs each piece carries those of its tokens; completions' ``text_offset`` counts
    from the start of the prompt, so ``offsets`` starts each choice where its text starts."""

    def __init__(
        self, model_name: str, tok: Any, *, chat: bool, n: int, logprobs: bool, offsets: list[int]
    ) -> None:
        self.chat, self.tok, self.n, self.logprobs, self.offsets = chat, tok, n, logprobs, offsets
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def _choice(
        self,
        i: int,
        text: str | None,
        finish: str | None,
        entries: Sequence[TokenLP] = (),
        role: bool = False,
        prompt: bool = False,
    ) -> dict[str, Any]:
        lp = None
        if self.logprobs and entries:
            if self.chat:
                lp = chat_logprobs(self.tok, entries)
            else:
                lp = completion_logprobs(self.tok, entries, self.offsets[i], len(entries) if prompt else 0)
                self.offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if not self.chat:
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def start(self) -> Iterator[str]:
        if self.chat:
            for i in range(self.n):
                yield sse_event(self.head | {"choices": [self._choice(i, "", None, role=True)]})

    def piece(
        self, i: int, text: str, from_llm: list[bool], entries: Sequence[TokenLP] = (), prompt: bool = False
    ) -> str:
        # Per chunk: which of its tokens the LLM wrote, so a client can highlight them.
        choice = self._choice(i, text, None, entries, prompt=prompt)
        return sse_event(self.head | {"choices": [choice], "citer": {"from_llm": from_llm}})

    def end(self, ds: Sequence[Decoded], citer: dict[str, Any], use: dict[str, int] | None) -> Iterator[str]:
        for i, d in enumerate(ds):
            yield sse_event(
                self.head | {"choices": [self._choice(i, None if self.chat else "", d.finish_reason)]}
            )
        last = self.head | {"choices": [], "citer": citer}
        if use is not None:
            last["usage"] = use
        yield sse_event(last)
        yield "data: [DONE]\n\n"


async def stream_response(
    srv: _Server,
    texts: list[tuple[str | list[int], str]],
    s: Sampling,
    *,
    chat: bool,
    prompts: list[list[int]] | None = None,
    shown: list[str] | None = None,
    echo_lp: list[list[TokenLP]] | None = None,
) -> StreamingResponse:
    """A streamed answer; the request is refused (400) rather than streamed when the engine refuses it outright.

    Completions: ``shown`` are the prompts' texts (where each choice's text starts), sent first when ``s.echo``,
    with ``echo_lp``, their log-prob entries, when asked for."""
    events = srv.stream(texts, s, prompts)
    try:
        first = await anext(events)  # waits for the first piece: an error here is still a plain 400
    except BaseException:
        await events.aclose()
        raise
    n_choices = len(texts) * s.n
    offsets = [0 if s.echo or shown is None else len(shown[c // s.n]) for c in range(n_choices)]
    sse = SSE(
        srv.model_name, srv.tok, chat=chat, n=n_choices, logprobs=s.logprobs is not None, offsets=offsets
    )

    async def chunks() -> AsyncIterator[str]:
        try:
            for chunk in sse.start():
                yield chunk
            if s.echo and shown is not None:
                for c in range(n_choices):
                    ents = echo_lp[c // s.n] if echo_lp is not None else ()
                    yield sse.piece(c, shown[c // s.n], [], ents, prompt=True)
            ev = first
            while ev[0] == "piece":
                yield sse.piece(*ev[1])
                ev = await anext(events)
            ds = ev[1]
            use = usage(ds, s.n) if s.include_usage else None
            for chunk in sse.end(ds, dict(ds[0].stats["total"]), use):
                yield chunk
        finally:
            await events.aclose()  # a client that went away cancels its rows

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
