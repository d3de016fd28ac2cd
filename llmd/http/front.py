"""The HTTP server beside the daemon: uvicorn on a thread of the daemon's process, serving
:func:`~llmd.http.app.build_app`. It is a client of the daemon like any other (one ZeroMQ
connection), so the engine loop never waits on HTTP: a slow HTTP reader backs up in uvicorn and in
the daemon's bounded outbox, as any slow client does.

The port is taken before the model loads (:meth:`HttpFront.bind`), so a port in use fails
``llmd start`` at once with one line, not after the load."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Iterable
from typing import Any

from llmd.config import is_loopback, split_http_address
from llmd.errors import LlmdError

log = logging.getLogger("llmd.http")


def check_http(address: str, allow_remote: bool = False, api_key: str | None = None) -> None:
    """Refuse an address other machines could reach unless ``allow_remote``; warn on stderr when it
    is allowed (as ``--tcp``).

    Raises:
        LlmdError: a non-loopback address without ``allow_remote``.
    """
    host, port = split_http_address(address)
    if is_loopback(host):
        return
    if not allow_remote:
        raise LlmdError(f"--http {address} would be reachable from other machines; use 127.0.0.1:{port}, or add "
                        "--allow-remote if you mean it")
    print(f"llmd: warning: HTTP API on {address}, reachable from other machines: plain HTTP, unencrypted"
          f"{'' if api_key else '; anyone who reaches it can use it: set an api_key'}", file=sys.stderr, flush=True)


class HttpFront:
    """Args:
        address: ``[HOST:]PORT`` to listen on.
        api_key: when set, requests need ``Authorization: Bearer <api_key>``.
        origins: web origins allowed to call (see :mod:`llmd.http.guard`).
    """

    def __init__(self, address: str, api_key: str | None = None, origins: Iterable[str] = ()) -> None:
        self.host, self.port = split_http_address(address)
        self.api_key, self.origins = api_key, tuple(origins)
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def bind(self) -> HttpFront:
        """Take the port now.

        Raises:
            LlmdError: the port is taken or the address is not this machine's.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise LlmdError(f"--http {self.host}:{self.port}: cannot listen there ({e.strerror}); choose another "
                            "port or stop what uses it") from None
        sock.listen(128)
        self.port = sock.getsockname()[1]  # port 0: the one the system picked
        self._sock = sock
        return self

    def start(self, connection: dict[str, Any]) -> None:
        """Serve on a thread, talking to the daemon of ``connection`` (its connection file's fields)."""
        import uvicorn

        from llmd.http.app import build_app
        from llmd.http.backend import Backend

        if self._sock is None:
            self.bind()
        app = build_app(Backend(connection), bound_host=self.host, api_key=self.api_key, origins=self.origins)
        # NOTE: uvicorn's own access log would write a line per request into the daemon's log.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="llmd-http", daemon=True)
        self._thread.start()
        log.info("HTTP API on %s (OpenAI: %s/v1, Ollama: %s/api)", self.url, self.url, self.url)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
