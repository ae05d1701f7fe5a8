"""The OpenAI wire format as ``citer serve`` speaks it: request models, their validation, prompts and streamed text.

Kept apart from the app so the rules (what a 400 says, how a chat becomes a prompt, how tokens become stream chunks)
can be read and tested without a server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from citer.serving.errors import RequestError, error_body
from citer.serving.templates import chat_prompt

__all__ = ["RequestError", "chat_prompt", "error_body"]  # re-exported: the wire format's names in one place

MAX_STOP = 4
MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows


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
    # Text, texts, or token ids (one prompt or several), as OpenAI takes them; evaluation harnesses send ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int  # 0 only with echo: the prompt scored, nothing generated
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no log-probs
    echo: bool = False


def _logprobs_of(req: CompletionRequest | ChatRequest) -> int | None:
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        k, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        k, param = req.logprobs, "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise RequestError(f"{param} must lie in [0, {MAX_LOGPROBS}], got {k}", param=param)
    return k


def sampling_of(req: CompletionRequest | ChatRequest, max_new_tokens: int) -> Sampling:
    """The decode settings of a request, checked; defaults: greedy, seed 0, the server's max_new_tokens."""
    max_tokens = req.max_tokens
    param = "max_tokens"
    echo = False
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if req.tools:
            raise RequestError("tools are not supported", param="tools")
    else:
        echo = bool(req.echo)
    logprobs = _logprobs_of(req)
    if max_tokens is None:
        max_tokens = max_new_tokens
    if max_tokens < (0 if echo else 1):
        raise RequestError(f"{param} must be >= {0 if echo else 1}, got {max_tokens}", param=param)
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
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must lie in [1, {MAX_N}], got {n}", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise RequestError(f"stop takes at most {MAX_STOP} non-empty strings", param="stop")
    include_usage = bool((req.stream_options or {}).get("include_usage", False))
    seed = 0 if req.seed is None else req.seed
    return Sampling(max_tokens, temperature, top_p, seed, stop, include_usage, n, logprobs, echo)


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
        "rolled_back_tokens": int(getattr(row, "rolled_back_tokens", 0)),  # taken back by verified routing
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
        "rolled_back_tokens": sum(r.get("rolled_back_tokens", 0) for r in rows),
        "wall_seconds": round(wall, 4),
    }
    if len(rows) > 1:
        out["per_choice"] = rows
    return out


def sse_event(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
