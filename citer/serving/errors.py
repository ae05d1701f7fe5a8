"""Errors as the server returns them: OpenAI's error body, and the OpenAPI declaration of every error status.

Every refusal is a :class:`RequestError` answered as ``{"error": {"message", "type", "param", "code"}}``. The
schema at ``/openapi.json`` declares, per route, each status that route can answer with that body, and not FastAPI's
422 (a body of the wrong shape is a 400 here), so a client generated from the schema, or a schema checker, sees
the statuses the server really returns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


# What each status means on this server; the body is always ErrorResponse.
STATUS_MEANING = {
    400: "invalid request: a bad parameter, a body of the wrong shape, a prompt the models cannot take "
    "(error.param names it)",
    401: "missing or invalid API key (only when the server was started with one)",
    404: "model not found: the request names another model than this server serves",
    429: "the queue is full (serve.max_queued_requests); retry after the Retry-After header's seconds",
    500: "the engine failed while decoding this request",
}


def error_responses(statuses: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` declaring ``statuses`` with OpenAI's error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for s in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": STATUS_MEANING[s]}
        if s == 429:
            entry["headers"] = {
                "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
            }
        out[s] = entry
    return out


def without_validation_422(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI dict) without the 422 FastAPI declares on every route with a body: this server
    answers a body of the wrong shape with a 400 in OpenAI's shape, declared per route."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    comps = schema.get("components", {}).get("schemas", {})
    if "/HTTPValidationError" not in json.dumps(schema.get("paths")):
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
    return schema
