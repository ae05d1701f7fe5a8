"""Errors as the server returns them: OpenAI's error body, and the OpenAPI declaration of every error status.

Every refusal is a :class:`RequestError` answered as ``{"error": {"message", "type", "param", "code"}}``. The
schema at ``/openapi.json`` declares, per route, each status that route can answer with that body, and not FastAPI's
422 (a body of the wrong shape is a 400 here), so a client generated from the schema, or a schema checker, sees
the statuses the server really returns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
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


def validation_error(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """A body FastAPI could not validate, as a 400 naming the first bad field; a body that is not JSON says where
    it stops being JSON (FastAPI's own text was ``"32: JSON decode error"``)."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        pos = next((x for x in e.get("loc", ()) if isinstance(x, int)), None)
        why = (e.get("ctx") or {}).get("error", "not JSON")
        at = f", character {pos}" if pos is not None else ""
        return RequestError(f"the request body is not valid JSON ({why}{at})", code="invalid_json")
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    return RequestError(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}", param=".".join(loc) or None)


def http_error(method: str, path: str, status: int, headers: Mapping[str, str] | None = None) -> RequestError:
    """The error a route-level refusal gets (unknown URL, wrong method, a body that cannot be read), as OpenAI's API
    words them."""
    if status == 404:
        return RequestError(
            f"Invalid URL ({method} {path}): this server answers /v1/completions, /v1/chat/completions, "
            "/v1/models and /health",
            status=404,
            code="unknown_url",
        )
    if status == 405:
        allowed = (headers or {}).get("allow", (headers or {}).get("Allow", ""))
        return RequestError(
            f"{method} is not allowed on {path}" + (f" (allowed: {allowed})" if allowed else ""),
            status=405,
            code="method_not_allowed",
        )
    if status == 400:
        return RequestError("the request body could not be read: send UTF-8 JSON", code="invalid_body")
    return RequestError(
        f"{method} {path}: HTTP {status}",
        status=status,
        type_="server_error" if status >= 500 else "invalid_request_error",
    )


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
    404: "model not found: the request names another model than this server serves (or an unknown URL)",
    405: "method not allowed on this route",
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
