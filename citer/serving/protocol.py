"""The OpenAI wire format as ``citer serve`` speaks it: request models, their validation, prompts and stream pieces.

Kept apart from the app so the rules (what a 400 says, how a chat becomes a prompt, how tokens become stream chunks)
can be read and tested without a server.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from citer.data.prompts import build_prompt

MAX_STOP = 4


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI-style error body with ``status`` (400 unless told)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code
        self.headers = dict(headers or {})


def error_body(exc: RequestError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


class _Common(BaseModel):
    # Clients send fields we do not use (user, presence_penalty, ...); they are ignored, not refused.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool | None = None
    logprobs: int | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    include_usage: bool


def sampling_of(req: CompletionRequest | ChatRequest, max_new_tokens: int) -> Sampling:
    """The decode settings of a request, checked; defaults: greedy, seed 0, the server's max_new_tokens."""
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if req.logprobs:
            raise RequestError("logprobs are not supported", param="logprobs")
        if req.tools:
            raise RequestError("tools are not supported", param="tools")
    else:
        if req.echo:
            raise RequestError("echo is not supported", param="echo")
        if req.logprobs is not None:
            raise RequestError("logprobs are not supported", param="logprobs")
    if max_tokens is None:
        max_tokens = max_new_tokens
    if max_tokens < 1:
        raise RequestError(f"{param} must be >= 1, got {max_tokens}", param=param)
    if max_tokens > max_new_tokens:
        raise RequestError(
            f"{param} must be <= {max_new_tokens} (the server's limit), got {max_tokens}", param=param
        )
    temperature = 0.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"temperature must lie in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must lie in (0, 1], got {top_p}", param="top_p")
    if req.n not in (None, 1):
        raise RequestError(f"n must be 1 (one decode per request), got {req.n}", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise RequestError(f"stop takes at most {MAX_STOP} non-empty strings", param="stop")
    include_usage = bool((req.stream_options or {}).get("include_usage", False))
    return Sampling(max_tokens, temperature, top_p, 0 if req.seed is None else req.seed, stop, include_usage)


def check_size(
    n_prompts: int,
    max_tokens: int | None,
    *,
    max_prompts: int,
    max_total_tokens: int,
    prompt_param: str = "prompt",
    tokens_param: str = "max_tokens",
) -> None:
    """Refuse (400) a request asking for more decoding than one request may: more than ``max_prompts`` prompts, or
    more than ``max_total_tokens`` tokens to generate (prompts x max_tokens). Checked before anything is encoded, so
    a huge request costs the server nothing and never holds the engine. ``max_tokens`` None checks the count only."""
    if n_prompts > max_prompts:
        raise RequestError(
            f"{prompt_param} holds {n_prompts} prompts; this server takes at most {max_prompts} per request "
            "(serve.max_prompts_per_request): split them over several requests",
            param=prompt_param,
            code="too_many_prompts",
        )
    total = n_prompts * (max_tokens or 0)
    if total > max_total_tokens:
        raise RequestError(
            f"{n_prompts} prompt(s) x {tokens_param}={max_tokens} = {total} tokens to generate; this server takes "
            f"at most {max_total_tokens} per request (serve.max_tokens_per_request): send fewer prompts or a "
            f"smaller {tokens_param}",
            param=tokens_param,
            code="too_many_tokens",
        )


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise RequestError(
            f"model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            status=404,
            code="model_not_found",
        )


def _message_text(msg: dict[str, Any], i: int) -> str:
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts carry anything a text model can read
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"messages[{i}].content[{j}]: only text parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


_CHOICE = re.compile(r"\(([A-Za-z0-9])\)\s*")


def _mc_row(text: str) -> dict[str, Any]:
    """``"question\\nChoices: (A) x (B) y"`` -> an mc row, so the prompt is built by the training template."""
    question, sep, rest = text.partition("\nChoices:")
    parts = _CHOICE.split(rest.strip()) if sep else []
    # split gives ['', 'A', 'x ', 'B', 'y']: labels at odd positions, texts after them.
    if len(parts) < 5 or parts[0].strip():
        raise RequestError(
            "mc format: the user message must be 'question\\nChoices: (A) text (B) text ...'",
            param="messages",
        )
    labels = parts[1::2]
    texts = [t.strip() for t in parts[2::2]]
    return {"question": question.strip(), "choices": {"label": labels, "text": texts}}


def chat_prompt(messages: Sequence[dict[str, Any]], fmt: str) -> str:
    """The prompt for a chat: the last user message, through the training template unless ``fmt`` is raw."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            text = _message_text(messages[i], i)
            break
    else:
        raise RequestError("messages hold no message with role 'user'", param="messages")
    if not text.strip():
        raise RequestError(f"messages[{i}].content is empty", param="messages")
    if fmt == "raw":
        return text
    if fmt == "mc":
        return build_prompt(_mc_row(text), "mc")
    return build_prompt({"problem": text.strip()}, "math")


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string (which is not included), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stream_pieces(
    tokenizer: Any, tokens: Sequence[int], from_llm: Sequence[bool], text: str
) -> list[tuple[str, list[bool]]]:
    """``text`` cut into one piece per token (with who wrote it), concatenating exactly to ``text``.

    A token that ends inside a multi-byte character decodes to U+FFFD; it is held back and sent with the next one.
    Pieces are slices of ``text`` itself, so a stop-truncated or normalised final text still streams exactly.
    """
    pieces: list[tuple[str, list[bool]]] = []
    emitted = 0
    pending: list[bool] = []
    for i in range(len(tokens)):
        if emitted >= len(text):
            break
        pending.append(bool(from_llm[i]))
        # Decoding the prefix each step is quadratic, but answers are a few hundred tokens at most.
        prefix = tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
        if prefix.endswith("\ufffd"):
            continue
        end = min(len(prefix), len(text))
        if end > emitted:
            pieces.append((text[emitted:end], pending))
            emitted, pending = end, []
    if emitted < len(text):
        pieces.append((text[emitted:], pending))
    return pieces


def row_stats(row: Any, from_llm: Sequence[bool]) -> dict[str, Any]:
    """The ``citer`` field of one answer, from the engine's RowStats and the per-token LLM flags."""
    n_llm = int(sum(bool(x) for x in from_llm))
    n = len(from_llm)
    return {
        "tokens_by_model": {"slm": n - n_llm, "llm": n_llm},
        "llm_token_fraction": n_llm / n if n else 0.0,
        "llm_calls": int(row.llm_calls),
        "llm_catchup_tokens": int(row.llm_catchup_tokens),
        "bytes_moved": float(row.bytes_moved),
        "projected_seconds": float(getattr(row, "projected_seconds", 0.0)),
    }


def total_stats(rows: list[dict[str, Any]], tau: float | None, wall: float) -> dict[str, Any]:
    slm = sum(r["tokens_by_model"]["slm"] for r in rows)
    llm = sum(r["tokens_by_model"]["llm"] for r in rows)
    out: dict[str, Any] = {
        "tau": tau,
        "tokens_by_model": {"slm": slm, "llm": llm},
        "llm_token_fraction": llm / (slm + llm) if slm + llm else 0.0,
        "llm_calls": sum(r["llm_calls"] for r in rows),
        "llm_catchup_tokens": sum(r["llm_catchup_tokens"] for r in rows),
        "bytes_moved": sum(r["bytes_moved"] for r in rows),
        "projected_seconds": sum(r["projected_seconds"] for r in rows),
        "wall_seconds": round(wall, 4),
    }
    if len(rows) > 1:
        out["per_choice"] = rows
    return out


def sse_event(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_chunks(
    model_name: str,
    pieces: Sequence[tuple[str, list[bool]]],
    finish_reason: str,
    *,
    chat: bool,
    usage: dict[str, int] | None,
    citer: dict[str, Any],
) -> Iterator[str]:
    """An answer as OpenAI stream events: (chat: a role chunk), one chunk per piece, a finish chunk, then a last
    chunk with no choices carrying the routing stats (and usage when asked), then ``data: [DONE]``."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
    }

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    if chat:
        yield sse_event(head | {"choices": [choice("", None, role=True)]})
    for text, flags in pieces:
        # Per chunk: which of its tokens the LLM wrote, so a client can highlight them.
        yield sse_event(head | {"choices": [choice(text, None)], "citer": {"from_llm": flags}})
    yield sse_event(head | {"choices": [choice(None if chat else "", finish_reason)]})
    last = head | {"choices": [], "citer": citer}
    if usage is not None:
        last["usage"] = usage
    yield sse_event(last)
    yield "data: [DONE]\n\n"
