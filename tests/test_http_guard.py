"""The HTTP front's door (llmd/http/guard.py) on its own: Host, Origin, the key, CORS and the body
cap, against a trivial app, no daemon."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmd.http.guard import Guard


async def _echo(scope, receive, send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def call(guard: Guard, method: str = "GET", headers: dict[str, str] | None = None, content: object = None
         ) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, "/v1/models", headers=headers, content=content)
    return asyncio.run(main())


@pytest.mark.parametrize("host,allowed", [
    ("127.0.0.1:8000", True), ("localhost:8000", True), ("LOCALHOST", True), ("[::1]:8000", True),
    ("app.localhost:8000", True), ("127.0.0.2", True),
    ("evil.example:8000", False), ("127.0.0.1.evil.example:8000", False), ("192.168.1.5:8000", False), ("", False),
])
def test_on_loopback_only_loopback_hosts(host: str, allowed: bool) -> None:
    r = call(Guard(_echo, "127.0.0.1", None, (), 100), headers={"Host": host})
    assert (r.status_code == 200) == allowed, r.text
    if not allowed:
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host"


def test_remote_binding_takes_any_host() -> None:
    assert call(Guard(_echo, "0.0.0.0", None, (), 100), headers={"Host": "my-box.lan:8000"}).status_code == 200


@pytest.mark.parametrize("origin,allowed,cors", [
    ("http://localhost:3000", True, False), ("http://127.0.0.1:8000", True, False),
    ("https://my.app", True, True), ("https://evil.example", False, False), ("null", False, False),
    ("http://127.0.0.1.evil.example", False, False), ("file://", False, False),
])
def test_web_pages_need_http_origins(origin: str, allowed: bool, cors: bool) -> None:
    r = call(Guard(_echo, "127.0.0.1", None, ("https://my.app",), 100), headers={"Origin": origin})
    assert (r.status_code == 200) == allowed and ("access-control-allow-origin" in r.headers) == cors
    if cors:
        assert r.headers["access-control-allow-origin"] == origin


def test_cors_preflight_only_for_listed_origins() -> None:
    guard = Guard(_echo, "127.0.0.1", "k", ("https://my.app",), 100)
    r = call(guard, "OPTIONS", {"Origin": "https://my.app", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204 and "authorization" in r.headers["access-control-allow-headers"]
    assert call(guard, "OPTIONS", {"Origin": "https://evil.example"}).status_code == 403
    star = Guard(_echo, "127.0.0.1", None, ("*",), 100)
    assert call(star, headers={"Origin": "https://any.where"}).headers["access-control-allow-origin"] == \
        "https://any.where"


def test_the_key_is_required_and_compared() -> None:
    guard = Guard(_echo, "127.0.0.1", "s3cret", (), 100)
    for headers in ({}, {"Authorization": "Bearer s3cre"}, {"Authorization": "Bearer s3cret2"},
                    {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
        r = call(guard, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert call(guard, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert call(guard, headers={"Authorization": "bearer s3cret"}).status_code == 200


def test_bodies_over_the_cap_are_refused() -> None:
    guard = Guard(_echo, "127.0.0.1", None, (), 100)
    assert call(guard, "POST", content=b"x" * 100).text == "100"
    r = call(guard, "POST", content=b"x" * 101)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

    async def chunks(n: int):  # no Content-Length: counted as it arrives
        for _ in range(n):
            yield b"x" * 30
    r = call(guard, "POST", content=chunks(4))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert call(guard, "POST", content=chunks(3)).text == "90"
