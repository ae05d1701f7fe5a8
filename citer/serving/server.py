"""An OpenAI-compatible HTTP endpoint in front of the routed decoder.

``/v1/completions`` and ``/v1/chat/completions`` (streamed and not), ``/v1/models`` and ``/health``. Every response
carries the routing stats of its decode in an extra top-level field ``citer`` (streams: in the last chunk before
``data: [DONE]``), so a client sees how much of its answer the LLM wrote and what it cost in bytes moved.

One decode runs at a time: a lock serialises requests around the engine, which keeps a KV cache per call and is not
re-entrant. Streaming decodes the whole answer first and then streams it token by token (the engine has no step API);
the chunks concatenate to exactly the non-streamed text.

Differences from the OpenAI API, all deliberate: ``temperature`` defaults to 0 (greedy, the paper's setting) and
``seed`` to 0, so a request without them is reproducible; ``n > 1``, ``logprobs``, ``echo`` and tool calls are refused
with a 400 rather than ignored.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from citer.decoding.engine import EngineInputError
from citer.project import Project, as_project
from citer.serving.champion import load_champion
from citer.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    Sampling,
    chat_prompt,
    check_model,
    error_body,
    row_stats,
    sampling_of,
    sse_chunks,
    stream_pieces,
    total_stats,
    truncate_at_stop,
)

PromptFormat = Literal["math", "mc", "raw"]
log = logging.getLogger("citer.serving")

__all__ = ["build_app", "serve", "serve_champion", "RequestError", "ServeError"]


class ServeError(ValueError):
    """The server cannot be built (no champion, models gone, router and SLM that do not fit)."""


@dataclass
class _Decoded:
    """One prompt's answer: text after stop handling, its token pieces for streaming, and routing stats."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    pieces: list[tuple[str, list[bool]]]
    stats: dict[str, Any]


class _Server:
    """The engine behind a lock, plus what every endpoint needs to encode, decode and describe it."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_new_tokens: int,
        fmt: PromptFormat,
        context_length: int | None,
        info: Mapping[str, Any],
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ServeError(
                "tokenizer: field eos_token is not set; the server cannot tell when an answer ends"
            )
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.max_new_tokens = max_new_tokens
        self.fmt = fmt
        self.context_length = context_length
        self.info = dict(info)
        self.lock = threading.Lock()
        self.created = int(time.time())

    def encode(self, text: str, param: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if not ids:
            raise RequestError(f"{param} encodes to no tokens", param=param)
        return ids

    def decode(self, prompts: list[list[int]], s: Sampling) -> list[_Decoded]:
        if self.context_length is not None:
            for i, p in enumerate(prompts):
                if len(p) + s.max_tokens > self.context_length:
                    raise RequestError(
                        f"prompt {i} has {len(p)} tokens; with max_tokens={s.max_tokens} it exceeds the model's "
                        f"context of {self.context_length} tokens",
                        param="max_tokens",
                    )
        eos = self.tok.eos_token_id
        with self.lock:
            t0 = time.perf_counter()
            try:
                res = self.engine.generate_batch(
                    prompts,
                    max_new_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    seed=s.seed,
                )
            except EngineInputError as exc:  # the engine's own input checks are the client's fault, not ours
                raise RequestError(str(exc), param="prompt") from exc
            wall = time.perf_counter() - t0
        out = []
        for i, prompt in enumerate(prompts):
            toks, flags = list(res.tokens[i]), list(res.from_llm[i])
            ended = bool(toks) and toks[-1] == eos
            body, body_flags = (toks[:-1], flags[:-1]) if ended else (toks, flags)
            full = self.tok.decode(body, skip_special_tokens=True)
            text, stopped = truncate_at_stop(full, s.stop)
            pieces = stream_pieces(self.tok, body, body_flags, text)
            out.append(
                _Decoded(
                    text=text,
                    finish_reason="stop" if ended or stopped else "length",
                    prompt_tokens=len(prompt),
                    completion_tokens=len(toks),
                    pieces=pieces,
                    stats=row_stats(res.rows[i], flags),
                )
            )
        total = total_stats([d.stats for d in out], getattr(self.engine, "tau", None), wall)
        total.update({k: v for k, v in self.info.items() if k not in total})
        for d in out:
            d.stats = d.stats | {"total": total}
        log.info(
            "decoded %d prompt(s): %d tokens, %.1f%% by the LLM, %d LLM calls, %.3g bytes moved in %.2f s",
            len(prompts),
            sum(d.completion_tokens for d in out),
            100 * total["llm_token_fraction"],
            total["llm_calls"],
            total["bytes_moved"],
            wall,
        )
        return out

    def usage(self, ds: list[_Decoded]) -> dict[str, int]:
        p = sum(d.prompt_tokens for d in ds)
        c = sum(d.completion_tokens for d in ds)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _context_length(engine: Any) -> int | None:
    """The smallest ``max_position_embeddings`` of the engine's models (None when they do not say)."""
    limits = []
    for m in (getattr(engine, "slm", None), getattr(engine, "llm", None)):
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config(decoder=True)
        n = getattr(cfg, "max_position_embeddings", None)
        if isinstance(n, int):
            limits.append(n)
    return min(limits) if limits else None


def build_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str,
    max_new_tokens: int,
    fmt: PromptFormat = "math",
    context_length: int | None = None,
    api_key: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (a RoutedEngine) under the OpenAI model id ``model_name``.

    ``fmt`` decides how a chat message becomes a prompt: ``math`` and ``mc`` use :func:`build_prompt` (the training
    template), ``raw`` passes the text as is. Completions always take the prompt as is. ``max_new_tokens`` is the
    default and the ceiling of ``max_tokens``; ``context_length`` (default: the SLM's ``max_position_embeddings``)
    bounds prompt + answer. With ``api_key`` set, requests need ``Authorization: Bearer <api_key>``. ``info`` (router
    version, SLM, LLM) is shown by ``/health`` and added to each response's ``citer`` stats.
    """
    if max_new_tokens < 1:
        raise ServeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if fmt not in ("math", "mc", "raw"):
        raise ServeError(f"unknown prompt format {fmt!r}; expected 'math', 'mc' or 'raw'")
    if context_length is None:
        context_length = _context_length(engine)
    srv = _Server(
        engine,
        tokenizer,
        model_name=model_name,
        max_new_tokens=max_new_tokens,
        fmt=fmt,
        context_length=context_length,
        info=info or {},
    )
    app = FastAPI(title="citer", description="CITER routed decoding, OpenAI-compatible", version="1")
    app.state.citer = srv

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": {...}}.
        e = exc.errors()[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        err = RequestError(
            f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}", param=".".join(loc) or None
        )
        return JSONResponse(error_body(err), status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                err = RequestError(
                    "invalid API key", status=401, type_="authentication_error", code="invalid_api_key"
                )
                return JSONResponse(error_body(err), status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": srv.model_name, "tau": getattr(engine, "tau", None), **srv.info}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "citer"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> Any:
        check_model(req.model, srv.model_name)
        s = sampling_of(req, srv.max_new_tokens)
        texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not texts:
            raise RequestError("prompt is an empty list", param="prompt")
        if req.stream and len(texts) != 1:
            raise RequestError("stream=true takes a single prompt", param="prompt")
        prompts = [
            srv.encode(t, "prompt" if len(texts) == 1 else f"prompt[{i}]") for i, t in enumerate(texts)
        ]
        ds = srv.decode(prompts, s)
        if req.stream:
            return _sse_response(_stream(srv, ds[0], s, chat=False))
        choices = [
            {"index": i, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            for i, d in enumerate(ds)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": srv.model_name,
            "choices": choices,
            "usage": srv.usage(ds),
            "citer": _citer(ds),
        }

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatRequest) -> Any:
        check_model(req.model, srv.model_name)
        s = sampling_of(req, srv.max_new_tokens)
        prompt = srv.encode(chat_prompt(req.messages, srv.fmt), "messages")
        ds = srv.decode([prompt], s)
        if req.stream:
            return _sse_response(_stream(srv, ds[0], s, chat=True))
        d = ds[0]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": srv.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": d.text},
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                }
            ],
            "usage": srv.usage(ds),
            "citer": _citer(ds),
        }

    return app


def _citer(ds: list[_Decoded]) -> dict[str, Any]:
    return dict(ds[0].stats["total"])


def _stream(srv: _Server, d: _Decoded, s: Sampling, *, chat: bool) -> Iterator[str]:
    usage = srv.usage([d]) if s.include_usage else None
    return sse_chunks(
        srv.model_name, d.pieces, d.finish_reason, chat=chat, usage=usage, citer=dict(d.stats["total"])
    )


def _sse_response(chunks: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _setup_logging(level: str) -> None:
    # A no-op when the caller (the CLI, a test) configured logging already.
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(
    engine: Any,
    tokenizer: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "citer",
    max_new_tokens: int = 128,
    fmt: PromptFormat = "math",
    api_key: str | None = None,
    info: Mapping[str, Any] | None = None,
    log_level: str = "info",
) -> None:
    """Run the app with uvicorn until interrupted (one worker: the engine lives in this process)."""
    import uvicorn

    _setup_logging(log_level)
    app = build_app(
        engine,
        tokenizer,
        model_name=model_name,
        max_new_tokens=max_new_tokens,
        fmt=fmt,
        api_key=api_key,
        info=info,
    )
    # Access logs off: the per-request INFO line of citer.serving already says what happened.
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def serve_champion(
    project: Project | str | os.PathLike[str] = ".",
    *,
    host: str | None = None,
    port: int | None = None,
    llm_fraction: float | None = None,
) -> None:
    """``citer serve``: the champion engine behind the endpoint, settings from ``serve`` in params (host/port
    override). ``CITER_API_KEY`` in the environment, when set, becomes the bearer key the server requires.
    """
    _setup_logging("info")
    proj = as_project(project)
    engine, tok, info = load_champion(proj, llm_fraction=llm_fraction)
    s = proj.params.serve
    fmt = proj.params.data.format if s.prompt_format == "auto" else s.prompt_format
    host, port = host or s.host, port or s.port
    log.info(
        "serving %s (tau=%s) as %r on http://%s:%d/v1", info["router"], engine.tau, s.model_name, host, port
    )
    serve(
        engine,
        tok,
        host=host,
        port=port,
        model_name=s.model_name,
        max_new_tokens=s.max_new_tokens,
        fmt=fmt,
        api_key=os.environ.get("CITER_API_KEY") or None,
        info=info,
    )
