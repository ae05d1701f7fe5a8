"""Who may reach the server and what it shows them: loopback unless an API key is set, no absolute paths."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path, PureWindowsPath
from typing import Any

from starlette.responses import JSONResponse

from citer.serving.protocol import RequestError, error_body

log = logging.getLogger("citer.serving")
# Paths anyone may reach without a key: a load balancer's health probe carries none.
OPEN_PATHS = frozenset({"/health"})


class ServeError(ValueError):
    """The server cannot be built (no champion, models gone, router and SLM that do not fit)."""


def public_ref(ref: Any, root: str | os.PathLike[str] | None = None) -> Any:
    """How a model is named to clients: a hub id or relative path as is; an absolute path relative to ``root`` when
    it lies inside it, else by its last component (``/srv/models/slm`` -> ``slm``). Never an absolute path."""
    if not isinstance(ref, str | os.PathLike):
        return ref
    text = os.fspath(ref)
    path = Path(text).expanduser() if text.startswith("~") else Path(text)
    if not path.is_absolute():
        if PureWindowsPath(text).is_absolute():
            return PureWindowsPath(text).name or text
        return text
    if root is not None:
        try:
            return path.resolve().relative_to(Path(root).resolve()).as_posix()
        except (OSError, ValueError):
            pass
    return path.name or "/"


def public_info(info: Mapping[str, Any], root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``info`` (router, SLM, LLM, tau...) with every path made safe to show (:func:`public_ref`)."""
    return {k: public_ref(v, root) for k, v in info.items()}


def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(
    host: str,
    api_key: str | None,
    *,
    allow_remote_without_key: bool = False,
    api_key_env: str = "CITER_API_KEY",
) -> None:
    """Refuse, in one line, to bind a non-loopback ``host`` with no API key unless remote serving without one is
    allowed explicitly (``serve.allow_remote_without_key``)."""
    if is_loopback(host) or api_key:
        return
    if allow_remote_without_key:
        log.warning(
            "serving on %s without an API key (serve.allow_remote_without_key): anyone who can reach it may use it",
            host,
        )
        return
    raise ServeError(
        f"refusing to serve on {host!r} without an API key: it is not a loopback address; set {api_key_env} (clients "
        f"then send 'Authorization: Bearer <key>'), or set serve.allow_remote_without_key: true, or serve on 127.0.0.1"
    )


class BearerAuth:
    """ASGI middleware: every HTTP request but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>`` (else 401).

    A plain ASGI callable rather than a ``BaseHTTPMiddleware``: that one relays every streamed chunk through an extra
    task and memory stream, which under many concurrent streams costs the event loop more than the chunks do."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = RequestError(
            "missing API key: send the header 'Authorization: Bearer <key>'"
            if given is None
            else "invalid API key",
            status=401,
            type_="authentication_error",
            code="invalid_api_key",
        )
        response = JSONResponse(error_body(err), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
