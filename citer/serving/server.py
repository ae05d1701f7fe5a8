"""An OpenAI-compatible HTTP endpoint in front of the routed decoder.

``/v1/completions`` and ``/v1/chat/completions`` (streamed and not), ``/v1/models`` and ``/health``. Every response
carries the routing stats of its decode in an extra top-level field ``citer`` (streams: in the last chunk before
``data: [DONE]``), so a client sees how much of its answer the LLM wrote and what it cost in bytes moved.

Requests share one continuous batch: an engine thread steps a
:class:`~citer.decoding.session.DecodeSession`, a request's rows join it at the next step (up to ``max_batch_rows``
rows in the SLM's batch, rows waiting for the LLM beside them) and leave when they finish, and every token goes to its request as it is chosen -- streams send
each piece of text as it is decoded, and a client that disconnects frees its rows. A row's tokens never depend on
what else is in the batch, so every answer is the one the request would get alone. At most ``max_queued_requests``
wait for room, and one more is answered 429 with ``Retry-After``. What one request may ask is bounded
(``max_prompts_per_request`` prompts, ``max_tokens_per_request`` = prompts x max_tokens; beyond: 400). ``/health``
answers from counters kept outside the engine, at once, however busy it is; it names the models without absolute
paths. ``continuous_batching=False`` decodes one request at a time (the old behaviour, for comparison).

A host other than loopback is refused unless an API key is set (or remote serving without one is allowed
explicitly); with a key, every route but ``/health`` (the schema included) needs ``Authorization: Bearer <key>``
(else 401).

What evaluation tools use works (:mod:`citer.serving.endpoints`): ``n`` > 1, ``logprobs``/``top_logprobs`` from the
model that wrote each token, ``echo`` with the routed policy's prompt log-probs, token-id prompts. ``/v1/models``
says which template a raw completion prompt should follow (:mod:`citer.serving.templates`), and ``/openapi.json``
declares every error status each route returns, in OpenAI's error shape (:mod:`citer.serving.errors`).

Differences from the OpenAI API, all deliberate: ``temperature`` defaults to 0 (greedy, the paper's setting) and
``seed`` to 0, so a request without them is reproducible; tool calls are refused with a 400 rather than ignored.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from citer.project import Project, as_project
from citer.serving.access import ServeError, bearer_key, check_bind, is_loopback, public_info, public_ref
from citer.serving.champion import load_champion
from citer.serving.endpoints import chat_completions as chat_endpoint
from citer.serving.endpoints import completions as completions_endpoint
from citer.serving.errors import (
    RequestError,
    error_body,
    error_responses,
    http_error,
    validation_error,
    without_validation_422,
)
from citer.serving.protocol import ChatRequest, CompletionRequest
from citer.serving.scheduler import (
    MAX_BATCH_ROWS,
    MAX_PROMPTS_PER_REQUEST,
    MAX_QUEUED_REQUESTS,
    MAX_TOKENS_PER_REQUEST,
    PromptFormat,
    _Server,
)
from citer.serving.templates import template_info

log = logging.getLogger("citer.serving")

__all__ = [
    "build_app",
    "check_bind",
    "is_loopback",
    "public_info",
    "public_ref",
    "serve",
    "serve_champion",
    "RequestError",
    "ServeError",
]


def _context_length(engine: Any) -> int | None:
    """The smallest ``max_position_embeddings`` of the engine's models (a llama.cpp model's trained context; None when
    they do not say)."""
    limits = []
    for m in (getattr(engine, "slm", None), getattr(engine, "llm", None)):
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config(decoder=True)
        n = getattr(cfg, "max_position_embeddings", getattr(m, "max_positions", None))
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
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
    max_tokens_per_request: int = MAX_TOKENS_PER_REQUEST,
    max_queued_requests: int = MAX_QUEUED_REQUESTS,
    max_batch_rows: int = MAX_BATCH_ROWS,
    continuous_batching: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (a RoutedEngine) under the OpenAI model id ``model_name``.

    ``fmt`` decides how a chat message becomes a prompt: ``math`` and ``mc`` use :func:`build_prompt` (the training
    template), ``raw`` passes the text as is. Completions always take the prompt as is. ``max_new_tokens`` is the
    default and the ceiling of ``max_tokens``; ``context_length`` (default: the SLM's ``max_position_embeddings``)
    bounds prompt + answer. A request may carry at most ``max_prompts_per_request`` prompts and ask for at most
    ``max_tokens_per_request`` tokens (prompts x max_tokens), else 400; beyond ``max_queued_requests`` requests
    waiting for the engine, a request gets 429 with ``Retry-After``. Up to ``max_batch_rows`` rows step in the SLM's batch (rows waiting for the LLM
    leave it, up to as many again beside it)
    (``continuous_batching=False``: one request at a time). With ``api_key`` set, every route but
    ``/health`` needs ``Authorization: Bearer <api_key>`` (else 401). ``info`` (router version, SLM, LLM) is shown by
    ``/health`` and added to each response's ``citer`` stats, absolute paths cut to their last component.
    """
    if max_new_tokens < 1:
        raise ServeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if fmt not in ("math", "mc", "raw"):
        raise ServeError(f"unknown prompt format {fmt!r}; expected 'math', 'mc' or 'raw'")
    for name, value in (
        ("max_prompts_per_request", max_prompts_per_request),
        ("max_tokens_per_request", max_tokens_per_request),
        ("max_queued_requests", max_queued_requests),
        ("max_batch_rows", max_batch_rows),
    ):
        if value < 1:
            raise ServeError(f"serve.{name} must be >= 1, got {value}")
    if max_tokens_per_request < max_new_tokens:
        raise ServeError(
            f"serve.max_tokens_per_request={max_tokens_per_request} is below serve.max_new_tokens={max_new_tokens}: "
            "a one-prompt request at the default max_tokens would be refused"
        )
    if context_length is None:
        context_length = _context_length(engine)
    srv = _Server(
        engine,
        tokenizer,
        model_name=model_name,
        max_new_tokens=max_new_tokens,
        fmt=fmt,
        context_length=context_length,
        info=public_info(info or {}),
        max_prompts=max_prompts_per_request,
        max_total_tokens=max_tokens_per_request,
        max_queued=max_queued_requests,
        max_rows=max_batch_rows,
        continuous=continuous_batching,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Everything alive now (models, tokenizer, libraries) lives as long as the server: move it out of the cyclic
        # collector's reach. A full collection otherwise rescans that heap and stops every stream for 0.1-0.3 s
        # (measured under 32 clients: every request's first token late by one pause).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # an app built in a longer-lived process (tests, notebooks) leaves its objects collectable
            await run_in_threadpool(srv.close)  # stop the engine thread with the app

    app = FastAPI(
        title="citer",
        description="CITER routed decoding, OpenAI-compatible",
        version="1",
        lifespan=lifespan,
        openapi_url=None if api_key else "/openapi.json",  # with a key, a keyed route below serves the schema
    )
    app.state.citer = srv
    auth = (401,) if api_key else ()
    generate = error_responses((400, *auth, 404, 429, 500))
    sse = {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "the answer, or its stream",
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = without_validation_422(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own shape; OpenAI clients expect 400 and {"error": {...}}.
        return JSONResponse(error_body(validation_error(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404), wrong methods (405) and bodies FastAPI cannot read (400) in OpenAI's shape too.
        err = http_error(request.method, request.url.path, exc.status_code, exc.headers)
        return JSONResponse(error_body(err), status_code=exc.status_code, headers=exc.headers)

    # Every route but /health (a load balancer's probe carries no key) needs the key, the schema included.
    keyed = [bearer_key(api_key)] if api_key else []
    if api_key:
        app.add_api_route("/openapi.json", app.openapi, include_in_schema=False, dependencies=keyed)

    # Every endpoint is async: none holds a worker thread while it waits, so /health and refusals (400, 429) are
    # answered at once however many requests wait for the engine.

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": srv.model_name,
            "tau": getattr(engine, "tau", None),
            **srv.info,
            "queue": srv.queue_state(),
            "limits": {
                "max_new_tokens": srv.max_new_tokens,
                "max_prompts_per_request": srv.max_prompts,
                "max_tokens_per_request": srv.max_total_tokens,
                "max_queued_requests": srv.max_queued,
            },
        }

    @app.get("/v1/models", responses=error_responses(auth), dependencies=keyed)
    async def models() -> dict[str, Any]:
        card = {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "citer"}
        card["citer"] = {"prompts": template_info(srv.fmt, srv.tok), "context_length": srv.context_length}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", responses={200: sse, **generate}, dependencies=keyed)
    async def completions(req: CompletionRequest) -> Any:
        return await completions_endpoint(srv, req)

    @app.post("/v1/chat/completions", responses={200: sse, **generate}, dependencies=keyed)
    async def chat_completions(req: ChatRequest) -> Any:
        return await chat_endpoint(srv, req)

    return app


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
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
    max_tokens_per_request: int = MAX_TOKENS_PER_REQUEST,
    max_queued_requests: int = MAX_QUEUED_REQUESTS,
    max_batch_rows: int = MAX_BATCH_ROWS,
    continuous_batching: bool = True,
    allow_remote_without_key: bool = False,
    api_key_env: str = "CITER_API_KEY",
) -> None:
    """Run the app with uvicorn until interrupted (one worker: the engine lives in this process).

    A non-loopback ``host`` needs ``api_key`` unless ``allow_remote_without_key`` (:func:`check_bind`)."""
    import uvicorn

    _setup_logging(log_level)
    check_bind(host, api_key, allow_remote_without_key=allow_remote_without_key, api_key_env=api_key_env)
    app = build_app(
        engine,
        tokenizer,
        model_name=model_name,
        max_new_tokens=max_new_tokens,
        fmt=fmt,
        api_key=api_key,
        info=info,
        max_prompts_per_request=max_prompts_per_request,
        max_tokens_per_request=max_tokens_per_request,
        max_queued_requests=max_queued_requests,
        max_batch_rows=max_batch_rows,
        continuous_batching=continuous_batching,
    )
    # Access logs off: the per-request INFO line of citer.serving already says what happened.
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def serve_champion(
    project: Project | str | os.PathLike[str] = ".",
    *,
    host: str | None = None,
    port: int | None = None,
    llm_fraction: float | None = None,
    allow_pair_mismatch: bool = False,
) -> None:
    """``citer serve``: the champion engine behind the endpoint, settings from ``serve`` in params (host/port
    override); a champion trained for other model files than params name is refused unless ``allow_pair_mismatch``. The environment variable named by ``serve.api_key_env`` (``CITER_API_KEY``), when set, becomes the
    bearer key the server requires; a non-loopback host without it is refused before any model is loaded, unless
    ``serve.allow_remote_without_key``.
    """
    _setup_logging("info")
    proj = as_project(project)
    s = proj.params.serve
    host, port = host or s.host, port or s.port
    api_key = (os.environ.get(s.api_key_env) or "").strip() or None
    check_bind(host, api_key, allow_remote_without_key=s.allow_remote_without_key, api_key_env=s.api_key_env)
    engine, tok, info = load_champion(
        proj, llm_fraction=llm_fraction, allow_pair_mismatch=allow_pair_mismatch
    )
    fmt = proj.params.data.format if s.prompt_format == "auto" else s.prompt_format
    log.info(
        "serving %s (tau=%s) as %r on http://%s:%d/v1%s",
        info["router"],
        engine.tau,
        s.model_name,
        host,
        port,
        f" (requests need the key in {s.api_key_env})" if api_key else "",
    )
    serve(
        engine,
        tok,
        host=host,
        port=port,
        model_name=s.model_name,
        max_new_tokens=s.max_new_tokens,
        fmt=fmt,
        api_key=api_key,
        info=public_info(info, proj.root),
        max_prompts_per_request=s.max_prompts_per_request,
        max_tokens_per_request=s.max_tokens_per_request,
        max_queued_requests=s.max_queued_requests,
        max_batch_rows=s.max_batch_rows,
        continuous_batching=s.continuous_batching,
        allow_remote_without_key=s.allow_remote_without_key,
        api_key_env=s.api_key_env,
    )
