"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}`` with the
status the openai SDK maps to its own exception types (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError, 503...). The Ollama routes send
the same body; Ollama's clients read ``error`` as a string or a map alike."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from llmd.client import DaemonNotRunningError, MessageTooLargeError, ServerError
from llmd.protocol import ErrorCode

RETRY_AFTER_S = 1  # a full queue drains in about a step; a stopping daemon is gone for good

# The daemon's error codes (llmd.protocol.ErrorCode) as HTTP statuses and OpenAI error types.
_BY_CODE: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.TOO_LONG: (413, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNKNOWN_REQUEST: (404, "invalid_request_error"),
    ErrorCode.SHUTTING_DOWN: (503, "service_unavailable"),
    ErrorCode.CANCELLED: (503, "service_unavailable"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),  # as OpenAI answers an unknown model
    # a remote model's server failed us: a gateway's statuses (what a proxy in front of it would answer)
    ErrorCode.REMOTE_UNREACHABLE: (502, "server_error"),
    ErrorCode.REMOTE_TIMEOUT: (504, "server_error"),
    ErrorCode.REMOTE_ERROR: (502, "server_error"),
}


class HTTPError(Exception):
    """A refusal the HTTP front makes itself (before the daemon sees the request)."""

    def __init__(self, status: int, message: str, code: str, error_type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.error_type, self.param = status, message, code, error_type, param


def error_body(message: str, error_type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None, error_type: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(error_body(message, error_type, code, param), status_code=status, headers=headers)


def response_for(exc: Exception) -> JSONResponse:
    """The response for an error from the HTTP front or the daemon; anything else is a 500."""
    if isinstance(exc, HTTPError):
        return error_response(exc.status, exc.message, exc.code, exc.error_type, exc.param)
    if isinstance(exc, ServerError):
        status, error_type = _BY_CODE.get(exc.code, (500, "server_error"))
        return error_response(status, exc.message, exc.code, error_type)
    if isinstance(exc, MessageTooLargeError):
        return error_response(413, str(exc), "too_large")
    if isinstance(exc, DaemonNotRunningError):
        return error_response(503, f"the daemon is not answering: {exc}", "unavailable", "service_unavailable")
    return error_response(500, f"{type(exc).__name__}: {exc}", "internal", "server_error")
