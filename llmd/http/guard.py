"""Who may drive the daemon over HTTP: the checks every request passes before any route sees it.

A web page in the user's browser can reach a loopback port. Two attacks follow, and Ollama's
history (OLLAMA_ORIGINS) shows both are real:

- **DNS rebinding**: ``evil.example`` re-resolves to 127.0.0.1, and the page's requests are
  same-origin to its own name. They still carry ``Host: evil.example``: on a loopback address only
  loopback names are accepted.
- **Cross-site requests**: a page POSTs to ``http://127.0.0.1:PORT`` (a "simple" request needs no
  preflight). The browser adds ``Origin``: a request whose ``Origin`` is a web page is refused
  unless ``http_origins`` lists it. Programs (the openai SDK, curl) send no ``Origin``.

Then the bearer token (``api_key``), compared in constant time, and a cap on the body's size. CORS
headers are sent only to the origins ``http_origins`` lists.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from llmd.config import is_loopback
from llmd.http.errors import error_body

Scope = dict[str, Any]


def _host_name(value: str) -> str:
    """``Host`` without its port, lowercased (``[::1]:8080`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def _is_loopback_name(name: str) -> bool:
    """A loopback address, ``localhost``, or a ``*.localhost`` name (which browsers resolve to
    loopback themselves, RFC 6761). NOTE: by address, not prefix: ``127.0.0.1.evil.example`` is a
    name its owner can point anywhere."""
    return is_loopback(name) or name.endswith(".localhost")


class Guard:
    """ASGI middleware.

    Args:
        app: the application it guards.
        bound_host: the address the server listens on; on a loopback one, ``Host`` must name a
            loopback host.
        api_key: when set, every request needs ``Authorization: Bearer <api_key>``.
        origins: the web origins (``scheme://host[:port]``, or ``*``) allowed to call, and sent CORS
            headers. Pages on this machine (loopback origins) are always allowed, but get no CORS.
        max_body_bytes: larger bodies are refused with 413.
    """

    def __init__(self, app: Any, bound_host: str, api_key: str | None, origins: Iterable[str],
                 max_body_bytes: int) -> None:
        self.app = app
        self.check_host = _is_loopback_name(_host_name(bound_host)) or bound_host in ("", "localhost")
        self.api_key = api_key.encode() if api_key else None
        self.origins = {o.rstrip("/").lower() for o in origins}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _send_json(send, *refusal)
            return
        origin = headers.get("origin", "").rstrip("/").lower()
        cors = origin if origin and (origin in self.origins or "*" in self.origins) else None
        if scope["method"] == "OPTIONS" and cors:  # a CORS preflight from an allowed page
            await _send_json(send, 204, None, _cors_headers(cors, preflight=True))
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _send_json(send, 413, error_body(f"the request body is over {self.max_body_bytes} bytes",
                                                   "invalid_request_error", "too_large"))
            return
        body = await self._read_body(receive)
        if body is None:
            await _send_json(send, 413, error_body(f"the request body is over {self.max_body_bytes} bytes",
                                                   "invalid_request_error", "too_large"))
            return
        await self.app(scope, _replay(body, receive), self._with_cors(send, cors))

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
        host = _host_name(headers.get("host", ""))
        if self.check_host and not _is_loopback_name(host):
            return 403, error_body(f"Host {headers.get('host', '')!r} is not this machine: llmd on a loopback "
                                   "address answers only localhost names", "permission_error", "forbidden_host")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin):
            return 403, error_body(f"Origin {origin!r} may not call llmd: add it to http_origins to allow that web "
                                   "page", "permission_error", "forbidden_origin")
        if self.api_key is not None and scope["method"] != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return 401, error_body("missing or wrong API key: send Authorization: Bearer <api_key>",
                                       "authentication_error", "invalid_api_key")
        return None

    def _origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins or "*" in self.origins:
            return True
        parts = urlsplit(origin)
        # A page served from this machine; "null" (a file, a sandboxed frame) and others are refused.
        return parts.scheme in ("http", "https") and _is_loopback_name((parts.hostname or "").lower())

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body (a chunked one has no Content-Length to check first), or None past the cap."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client hung up: the app sees a body that ends here, and its disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body"):
                break
        return b"".join(chunks)

    @staticmethod
    def _with_cors(send: Any, cors: str | None) -> Any:
        if cors is None:
            return send

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(cors)]}
            await send(message)

        return send_with_cors


def _replay(body: bytes, receive: Any) -> Any:
    """``receive`` for the app: the body read already, then the client's own messages (its hang-up)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _cors_headers(origin: str, preflight: bool = False) -> list[tuple[bytes, bytes]]:
    headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
    if preflight:
        headers += [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                    (b"access-control-allow-headers", b"authorization, content-type"),
                    (b"access-control-max-age", b"600")]
    return headers


async def _send_json(send: Any, status: int, body: dict[str, Any] | None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": data})
