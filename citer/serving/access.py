"""Who may reach the server and what it shows them: loopback unless an API key is set, no absolute paths."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path, PureWindowsPath
from typing import Any

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from citer.serving.protocol import RequestError

log = logging.getLogger("citer.serving")


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


def bearer_key(key: str) -> Any:
    """A route dependency: ``Authorization: Bearer <key>`` (FastAPI's ``HTTPBearer``), else 401 in OpenAI's error
    shape."""

    async def check(
        given: HTTPAuthorizationCredentials | None = Security(HTTPBearer(auto_error=False)),
    ) -> None:
        if given is None or not hmac.compare_digest(given.credentials.encode(), key.encode()):
            missing = "missing API key: send the header 'Authorization: Bearer <key>'"
            raise RequestError(missing if given is None else "invalid API key", status=401,
                               type_="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    return Security(check)
