"""The HTTP application: the OpenAI and Ollama routes, ``/health`` and ``/metrics``, every error
answered in the caller's API's shape, all behind the :class:`~llmd.http.guard.Guard`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from llmd.client import DaemonNotRunningError, MessageTooLargeError, ServerError
from llmd.http import metrics, ollama_api, openai_api
from llmd.http.backend import Backend
from llmd.http.errors import HTTPError, error_response, response_for
from llmd.http.guard import Guard
from llmd.protocol import MAX_MESSAGE_BYTES

# A body the wire could not carry is refused at the door (a prompt is at most 1M characters).
MAX_BODY_BYTES = MAX_MESSAGE_BYTES


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the first bad field, e.g. ``messages.0.role: Input should be 'system', ...``."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg', ''))}", None
    if not loc:
        return "the body must be a JSON object, sent with Content-Type: application/json", None
    field = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{field + ': ' if field else ''}{first.get('msg', 'invalid')}{more}", field


def _ollama_shaped(request: Request, response: JSONResponse) -> JSONResponse:
    """Ollama's clients read ``{"error": "message"}``."""
    if not request.url.path.startswith("/api/"):
        return response
    message = json.loads(response.body)["error"]["message"]
    return JSONResponse({"error": message}, status_code=response.status_code,
                        headers={k: v for k, v in response.headers.items() if k.lower() == "retry-after"})


def build_app(backend: Backend, *, bound_host: str, api_key: str | None = None, origins: Iterable[str] = (),
              max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The ASGI application: ``backend`` is the connection to the daemon; the rest configures the
    :class:`Guard`."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="llmd", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.backend = backend
    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return _ollama_shaped(request, error_response(400, message, "invalid_request", param=field))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return _ollama_shaped(request, error_response(exc.status_code, message, code))

    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _ollama_shaped(request, response_for(exc))

    for exc_type in (HTTPError, ServerError, DaemonNotRunningError, MessageTooLargeError):
        app.add_exception_handler(exc_type, known)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            status = (await backend.client.health())["status"]
        except (DaemonNotRunningError, ServerError) as e:
            return error_response(503, f"the daemon is not answering: {e}", "unavailable", "service_unavailable")
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await backend.client.stats()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return Guard(app, bound_host, api_key, origins, max_body_bytes)
