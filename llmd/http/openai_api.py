"""The OpenAI API: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``,
streamed as server-sent events the way the openai SDK parses them (the role in the first chunk,
``data: [DONE]`` last, the usage chunk with ``stream_options.include_usage``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, StreamingResponse

from llmd.client import Delta, Result
from llmd.http.backend import Backend, ModelView
from llmd.http.errors import HTTPError, response_for
from llmd.http.openai_schema import ChatCompletionRequest, CompletionRequest
from llmd.http.streaming import Started, finish_reason, token_logprobs, until_disconnect

router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's: until the context is full)
UNKNOWN_CONTEXT = 1 << 24  # the context limit sent for a model not loaded yet (the daemon fits it to the model's)


def _backend(request: Request) -> Backend:
    return request.app.state.backend


def _usage(result: Result) -> dict[str, Any]:
    u = result.usage
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))}}


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _limits(backend: Backend | ModelView, params: dict[str, Any], default_max_tokens: int | None) -> int | None:
    """Fills in max_tokens; returns the context_limit to send: without a max_tokens, a chat runs
    until the context is full (the daemon lowers max_tokens to what fits)."""
    if "max_tokens" in params:
        return None
    if default_max_tokens is not None:
        params["max_tokens"] = default_max_tokens
        return None
    # (a model not loaded yet: its context unknown here; the daemon lowers this to what it holds)
    limit = int((await backend.info())["max_model_len"] or UNKNOWN_CONTEXT)
    params["max_tokens"] = limit
    return limit


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The default model, then the others the daemon has loaded (or unloaded to make room), then its
    remote models."""
    backend = _backend(request)
    info = await backend.info()
    data = [{"id": await backend.model_id(), "object": "model", "created": int(info["started"]), "owned_by": "llmd",
             "max_model_len": info["max_model_len"]}]
    # a remote model (config [remote."NAME"]) is owned by its server: "remote" (its url is in `llmd status`)
    data += [{"id": m["name"], "object": "model", "created": int(info["started"]),
              "owned_by": "remote" if m.get("remote") else "llmd", "max_model_len": m.get("max_model_len")}
             for m in info.get("models", []) if not m.get("default")]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    view = await _backend(request).check_model(model_id)
    info = await view.info()
    if info["max_model_len"] is None and not info.get("remote"):
        raise HTTPError(404, f"model {model_id!r} is not loaded here (a request naming it loads it)",
                        "model_not_found", param="model")
    return {"id": await view.id(), "object": "model", "created": int(info["started"]),
            "owned_by": "remote" if info.get("remote") else "llmd", "max_model_len": info["max_model_len"]}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's and llama-server's extension: ``{"prompt" or "content": text}`` -> ``{"tokens": [...]}``
    (what ``llmd bench --url`` draws its prompts from)."""
    try:
        body = await request.json()
    except ValueError:
        raise HTTPError(400, "the body is not valid JSON", "invalid_request") from None
    text = body.get("prompt", body.get("content")) if isinstance(body, dict) else None
    if not isinstance(text, str) or not text:
        raise HTTPError(400, 'send {"prompt": "some text"}', "invalid_request", param="prompt")
    backend = _backend(request)
    tokens = await backend.client.tokenize(text)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": (await backend.info())["max_model_len"]}


# ---- chat ----------------------------------------------------------------------------------------

async def _chat_logprobs(backend: Backend | ModelView, token_ids: list[int], logprobs: list[Any] | None
                         ) -> dict[str, Any]:
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                         "top_logprobs": [{"token": t, "logprob": alp, "bytes": list(t.encode())} for t, alp in top]}
                        for text, lp, top in await token_logprobs(backend, token_ids, logprobs)]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    body.check()
    backend = await _backend(request).check_model(body.model)  # (a view of the model named)
    model = await backend.id()
    messages = body.chat_messages()
    params = body.sampling()
    context_limit = await _limits(backend, params, None)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    client = backend.client
    tools = body.tool_fields()
    if not body.stream:
        result = await until_disconnect(request, client.generate(
            messages=messages, stream=False, context_limit=context_limit, model=backend.model, **tools, **params))
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message = {"role": "assistant", "content": result.text or None, "tool_calls": _tool_calls(result)}
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "logprobs": None, "finish_reason": finish_reason(result.finish_reason)}
        if body.logprobs:
            choice["logprobs"] = await _chat_logprobs(backend, result.token_ids, result.logprobs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [choice], "usage": _usage(result)})
    # Accepted, or refused as an HTTP error before anything is sent.
    started = await Started.start(lambda accepted: client.generate(
        messages=messages, stream=True, context_limit=context_limit, on_accepted=accepted, model=backend.model,
        **tools, **params))

    async def events() -> AsyncIterator[bytes]:
        usage_field = {"usage": None} if body.include_usage else {}

        def chunk(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> bytes:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
                         **usage_field})

        yield chunk({"role": "assistant", "content": ""})
        async for item in started.items(_error_event):
            if isinstance(item, bytes):
                yield item
                return
            if isinstance(item, Delta):
                if item.text or item.logprobs:
                    logprobs = await _chat_logprobs(backend, item.token_ids, item.logprobs) if body.logprobs else None
                    yield chunk({"content": item.text}, logprobs=logprobs)
            else:
                if item.tool_calls:  # whole, in one chunk: the SDK joins a call's pieces by index
                    yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(_tool_calls(item))]})
                yield chunk({}, finish_reason(item.finish_reason))
                if body.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": _usage(item)})
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _tool_calls(result: Result) -> list[dict[str, Any]]:
    """The daemon's calls in OpenAI's shape."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in result.tool_calls or []]


def _error_event(e: Exception) -> bytes:
    """A failure once the response has begun, as the event the openai SDK raises as an APIError."""
    return _sse(json.loads(response_for(e).body))


# ---- completions ---------------------------------------------------------------------------------

def _completion_logprobs(items: list[tuple[str, float | None, list[tuple[str, float]] | None]], offset: int
                         ) -> dict[str, Any]:
    """The legacy logprobs shape: parallel lists, ``top_logprobs`` as {token text: logprob}."""
    offsets = []
    for text, _, _ in items:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t for t, _, _ in items], "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [None if top is None else dict(top) for _, _, top in items], "text_offset": offsets}


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    body.check()
    backend = await _backend(request).check_model(body.model)  # (a view of the model named)
    model = await backend.id()
    prompt = body.one_prompt()
    params = body.sampling()
    await _limits(backend, params, COMPLETIONS_DEFAULT_MAX_TOKENS)
    client = backend.client
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs and body.stream:
        # NOTE: the prompt's logprobs come with the end of the request, after its echo chunk went out
        raise HTTPError(400, "echo with logprobs is not supported when streaming; send stream: false",
                        "unsupported_echo_logprobs", param="echo")
    if isinstance(prompt, str):
        # echo with logprobs scores the prompt's own tokens: send the ids, so they are known here
        source: dict[str, Any] = ({"token_ids": await client.tokenize(prompt, model=backend.model)} if echo_logprobs
                                  else {"prompt": prompt})
    else:
        source = {"token_ids": prompt}
    if echo_logprobs:
        params["prompt_logprobs"] = body.logprobs
    prompt_text = ""
    if body.echo:
        prompt_text = prompt if isinstance(prompt, str) else "".join(await backend.pieces(source["token_ids"]))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    if not body.stream:
        result = await until_disconnect(request, client.generate(**source, stream=False, model=backend.model,
                                                                 **params))
        text = (prompt_text if body.echo else "") + result.text
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": finish_reason(result.finish_reason)}
        if body.logprobs is not None:
            items: list[Any] = []
            if echo_logprobs:
                items = await _prompt_items(backend, source["token_ids"], result.prompt_logprobs)
            items += await token_logprobs(backend, result.token_ids, result.logprobs)
            choice["logprobs"] = _completion_logprobs(items, 0)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice], "usage": _usage(result)})

    started = await Started.start(lambda accepted: client.generate(**source, stream=True, on_accepted=accepted,
                                                                   model=backend.model, **params))

    async def events() -> AsyncIterator[bytes]:
        usage_field = {"usage": None} if body.include_usage else {}

        def chunk(text: str, reason: str | None = None, logprobs: Any = None) -> bytes:
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}],
                         **usage_field})

        offset = 0
        if body.echo:
            yield chunk(prompt_text)
            offset = len(prompt_text)
        async for item in started.items(_error_event):
            if isinstance(item, bytes):
                yield item
                return
            if isinstance(item, Delta):
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _completion_logprobs(await token_logprobs(backend, item.token_ids, item.logprobs),
                                                    offset)
                offset += len(item.text)
                if item.text or logprobs:
                    yield chunk(item.text, logprobs=logprobs)
            else:
                yield chunk("", finish_reason(item.finish_reason))
                if body.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": _usage(item)})
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _prompt_items(backend: Backend | ModelView, token_ids: list[int], prompt_logprobs: list[Any] | None
                        ) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """The prompt's tokens for echo: the first has no logprob (nothing precedes it)."""
    texts = await backend.pieces(token_ids)
    if not prompt_logprobs:
        return [(t, None, None) for t in texts]
    scored = await token_logprobs(backend, token_ids[1:], prompt_logprobs[1:])
    return [(texts[0], None, None), *((t, lp, top) for t, lp, top in scored)]
