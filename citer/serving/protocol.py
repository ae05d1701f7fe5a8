"""The OpenAI wire format as ``citer serve`` speaks it: request models, their validation, prompts and streamed text.

Kept apart from the app so the rules (what a 400 says, how a chat becomes a prompt, how tokens become stream chunks)
can be read and tested without a server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
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


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that could still grow into a stop string (held back from a stream)."""
    best = 0
    for st in stop:
        for k in range(min(len(st) - 1, len(text)), best, -1):
            if text.endswith(st[:k]):
                best = k
                break
    return best


class TextStream:
    """An answer's text as its tokens arrive: :meth:`push` returns the piece now safe to send, with the LLM flags of
    the tokens it covers; the pieces concatenate exactly to :attr:`text`, the non-streamed answer.

    Held back: a token that ends inside a multi-byte character (it decodes to U+FFFD) until the character completes,
    and any end of the text that could still become a stop string. At a stop string the text is cut before it and
    :attr:`stopped` is set; at EOS (not part of the text) :attr:`ended`.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], eos_token_id: int | None) -> None:
        self.tok, self.stop, self.eos = tokenizer, tuple(stop), eos_token_id
        self.tokens: list[int] = []  # every token consumed, EOS included
        self.from_llm: list[bool] = []  # per consumed token: the LLM wrote it
        self.text = ""
        self.stopped = self.ended = False
        self._sent = 0
        self._flags: list[bool] = []  # flags of the tokens not yet covered by a piece
        self._settled = (0, "")  # (n, decode(tokens[:n])) at the last token that ended on a whole character

    @property
    def done(self) -> bool:
        return self.stopped or self.ended

    def push(self, token: int, from_llm: bool) -> tuple[str, list[bool]] | None:
        if self.done:
            return None
        self.tokens.append(int(token))
        self.from_llm.append(bool(from_llm))
        if token == self.eos:
            self.ended = True
            return self._piece(len(self.text))
        self._flags.append(bool(from_llm))
        full = self._decoded()
        if full.endswith("\ufffd"):
            return None
        self.text, self.stopped = truncate_at_stop(full, self.stop)
        return self._piece(
            len(self.text) if self.stopped else len(self.text) - _stop_prefix(self.text, self.stop)
        )

    def _decoded(self) -> str:
        """``decode(tokens)``, decoding only a window after the settled prefix (as vLLM's incremental detokenizer):
        the window starts a few tokens back so a tokenizer that treats a leading token specially (a SentencePiece
        space) decodes the new tokens in context; when the window disagrees with the prefix, decode in full."""
        n, text = self._settled
        start = max(0, n - 4)
        prev = self.tok.decode(self.tokens[start:n], skip_special_tokens=True)
        cur = self.tok.decode(self.tokens[start:], skip_special_tokens=True)
        if cur.startswith(prev) and text.endswith(prev):
            full = text + cur[len(prev) :]
        else:
            full = self.tok.decode(self.tokens, skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            self._settled = (len(self.tokens), full)
        return full

    def finish(self) -> tuple[str, list[bool]] | None:
        """The rest of the text once no token will come (the budget ran out, or EOS/stop already)."""
        return self._piece(len(self.text))

    def _piece(self, end: int) -> tuple[str, list[bool]] | None:
        if end <= self._sent:
            return None
        piece = (self.text[self._sent : end], self._flags)
        self._sent, self._flags = end, []
        return piece


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
        "wait_steps": int(getattr(row, "wait_steps", 0)),
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
        "wait_steps": sum(r["wait_steps"] for r in rows),
        "wall_seconds": round(wall, 4),
    }
    if len(rows) > 1:
        out["per_choice"] = rows
    return out


def sse_event(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
