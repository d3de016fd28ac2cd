"""The part of Ollama's API its clients need to use llmd (the ollama Python and JS clients, VS Code's
Ollama provider, Open WebUI's Ollama connection): ``/api/version``, ``/api/tags``, ``/api/show``,
``/api/ps``, and ``/api/chat`` and ``/api/generate`` streamed as NDJSON. Models are named as Ollama
names them, ``name:latest``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, StreamingResponse

from llmd.client import Delta, Result
from llmd.http.backend import Backend, ModelView
from llmd.http.errors import HTTPError
from llmd.http.streaming import Started, until_disconnect

router = APIRouter()
# The Ollama API level these routes follow. Clients compare it to decide what they may call, and
# llmd's own version number means nothing to them.
OLLAMA_API_VERSION = "0.12.0"
# Ollama's own defaults where llmd's differ (its documented `options`), so an Ollama client samples
# as it would there.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
UNKNOWN_CONTEXT = 1 << 24  # a model not loaded yet: the daemon fits the context limit to the model's


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Options(_Body):
    num_predict: int | None = Field(None, ge=-2)
    num_ctx: int | None = Field(None, ge=2)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class _Generation(_Body):
    model: str
    stream: bool = True
    options: Options = Field(default_factory=Options)
    format: Any = None
    images: list[Any] | None = None
    keep_alive: Any = None  # the daemon's --idle-unload decides; accepted and ignored

    def check(self) -> None:
        if self.images:
            raise HTTPError(400, "images are not supported: this model reads text", "unsupported_content")


    def response_format(self) -> dict[str, Any] | None:
        """Ollama's ``format``: ``"json"`` (any JSON) or a JSON schema, as the daemon's response_format."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"schema": self.format}}
        raise HTTPError(400, 'format must be "json" or a JSON schema', "invalid_value", param="format")


class FunctionCall(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Body):
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's, sent back with their results

    def to_daemon(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}} for c in self.tool_calls]
        return message


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Any] | None = None


class GenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # the older field


def _backend(request: Request) -> Backend:
    return request.app.state.backend


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: Any) -> int:
    return int(float(seconds) * 1e9) if isinstance(seconds, (int, float)) else 0


async def _details(backend: Backend | ModelView) -> dict[str, Any]:
    info = await backend.info()
    quant = str(info.get("quantization") or "")
    return {"format": "gguf" if str(info.get("model_path", "")).endswith(".gguf") else "safetensors",
            "family": info.get("model_type", ""), "families": [info.get("model_type", "")],
            "parameter_size": "", "quantization_level": quant, "parent_model": ""}


async def _entry(backend: ModelView) -> dict[str, Any]:
    info = await backend.info()
    name = f"{await backend.id()}:latest"
    entry = {"name": name, "model": name, "size": int(info.get("weight_bytes") or 0), "digest": "",
             "modified_at": datetime.fromtimestamp(float(info["started"]), timezone.utc).isoformat(),
             "details": await _details(backend)}
    if info.get("remote"):  # as Ollama lists its cloud models: the remote's id and host
        entry.update(remote_model=str(info.get("model")), remote_host=str(info.get("url")))
    return entry


@router.get("/api/version")
async def version() -> dict[str, Any]:
    return {"version": OLLAMA_API_VERSION}


def _views(backend: Backend, info: dict[str, Any], loaded_only: bool) -> list[ModelView]:
    """The default model's view, then the other models the daemon has built (``info``'s ``models``)."""
    others = [m["name"] for m in info.get("models", []) if not m.get("default")
              and (not loaded_only or m.get("state") == "loaded")]
    default = [m for m in info.get("models", []) if m.get("default")]
    first = [] if loaded_only and default and default[0].get("state") != "loaded" else [backend.view()]
    return first + [backend.view(name) for name in others]


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    backend = _backend(request)
    return {"models": [await _entry(v) for v in _views(backend, await backend.info(), loaded_only=False)]}


@router.get("/api/ps")
async def running(request: Request) -> dict[str, Any]:
    backend = _backend(request)
    out = []
    for view in _views(backend, await backend.info(), loaded_only=True):
        info = await view.info()
        out.append({**await _entry(view), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                    "context_length": info["max_model_len"]})
    return {"models": out}


@router.post("/api/show")
async def show(body: ShowRequest, request: Request) -> dict[str, Any]:
    backend = await _backend(request).check_model(body.model or body.name)
    info = await backend.info()
    if info["max_model_len"] is None and not info.get("remote"):
        raise HTTPError(404, f"model {body.model or body.name!r} is not loaded here (a request naming it loads it)",
                        "model_not_found", param="model")
    arch = info.get("model_type", "llama")
    capabilities = ["completion", "tools"] if info.get("tools") else ["completion"]
    return {"license": "", "modelfile": "", "parameters": "", "template": "",
            "details": await _details(backend), "capabilities": capabilities,
            "model_info": {"general.architecture": arch, f"{arch}.context_length": info["max_model_len"]},
            "modified_at": (await _entry(backend))["modified_at"]}


async def _params(backend: Backend | ModelView, options: Options, response_format: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], int]:
    """The daemon's sampling params and the request's context limit: ``num_ctx`` is honoured (prompt
    and output within it) or refused when the model holds less, never cut silently."""
    info = await backend.info()
    # (a model not loaded yet: its context unknown here; the daemon fits the limit to the model's)
    max_model_len = int(info["max_model_len"] or UNKNOWN_CONTEXT)
    if options.num_ctx is not None and options.num_ctx > max_model_len:
        raise HTTPError(400, f"num_ctx {options.num_ctx} is more than this model holds ({max_model_len} tokens); "
                             f"use num_ctx <= {max_model_len}", "invalid_value", param="num_ctx")
    limit = options.num_ctx or max_model_len
    # the model's own defaults (its [models."NAME"] table in the config file) over Ollama's
    model_defaults = info.get("sampling_defaults") or {}
    params: dict[str, Any] = OLLAMA_DEFAULTS | model_defaults
    for ours, theirs in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                         ("repetition_penalty", "repeat_penalty"), ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty"), ("stop", "stop")):
        if getattr(options, theirs) is not None:
            params[ours] = getattr(options, theirs)
    if options.seed is not None and options.seed >= 0:  # Ollama's -1: a random seed
        params["seed"] = options.seed % 2**63
    n = options.num_predict
    if n == 0:
        raise HTTPError(400, "num_predict 0 asks for no tokens", "invalid_value", param="num_predict")
    if n is None and "max_tokens" in model_defaults:
        n = min(int(model_defaults["max_tokens"]), limit)
    params["max_tokens"] = limit if n is None or n < 0 else n  # -1: no limit, -2: fill the context
    if response_format is not None:
        params["response_format"] = response_format
    return params, limit


def _ndjson(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, ensure_ascii=False) + "\n").encode()


def _final(model: str, result: Result) -> dict[str, Any]:
    t, u = result.timings, result.usage
    ttft, e2e, queue = (t.get(k) or 0.0 for k in ("ttft_s", "e2e_s", "queue_s"))
    return {"model": model, "created_at": _now(), "done": True,
            "done_reason": "length" if result.finish_reason == "length" else "stop",  # Ollama's, with tools too
            "total_duration": _ns(e2e), "load_duration": 0, "prompt_eval_count": int(u.get("prompt_tokens", 0)),
            "prompt_eval_duration": _ns(max(ttft - queue, 0.0)), "eval_count": int(u.get("completion_tokens", 0)),
            "eval_duration": _ns(max(e2e - ttft, 0.0))}


async def _answer(request: Request, view: ModelView, model: str, source: dict[str, Any], params: dict[str, Any],
                  limit: int, stream: bool, shape: Any) -> JSONResponse | StreamingResponse:
    """Run the request on ``view``'s model; ``shape(text, result)`` is a chunk's body (chat: a message,
    generate: a response; ``result`` at the end, with its tool calls)."""
    client = view.client
    if not stream:
        result = await until_disconnect(request, client.generate(**source, stream=False, context_limit=limit,
                                                                 model=view.model, **params))
        return JSONResponse({**shape(result.text, result), **_final(model, result)})
    started = await Started.start(lambda accepted: client.generate(**source, stream=True, context_limit=limit,
                                                                   on_accepted=accepted, model=view.model,
                                                                   **params))

    async def lines() -> AsyncIterator[bytes]:
        async for item in started.items(lambda e: _ndjson({"error": str(e)})):
            if isinstance(item, bytes):
                yield item
                return
            if isinstance(item, Delta):
                if item.text:
                    yield _ndjson({"model": model, "created_at": _now(), **shape(item.text, None), "done": False})
            else:
                yield _ndjson({**shape("", item), **_final(model, item)})

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/chat", response_model=None)
async def chat(body: ChatRequest, request: Request) -> JSONResponse | StreamingResponse:
    body.check()
    backend = await _backend(request).check_model(body.model)  # (a view of the model named)
    model = await backend.id()
    if not body.messages:  # Ollama's way to load a model: nothing to say, the model is ready
        return JSONResponse({"model": f"{model}:latest", "created_at": _now(),
                             "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
    if any(m.images for m in body.messages):
        raise HTTPError(400, "images are not supported: this model reads text", "unsupported_content")
    params, limit = await _params(backend, body.options, body.response_format())
    source: dict[str, Any] = {"messages": [m.to_daemon() for m in body.messages]}
    if body.tools:
        source["tools"] = body.tools  # the daemon checks them (a bad one is a 400 naming it)
    return await _answer(request, backend, f"{model}:latest", source, params, limit, body.stream, _chat_message)


def _chat_message(text: str, result: Result | None) -> dict[str, Any]:
    """A chat chunk's body: the text, and at the end the calls the model made (arguments as maps)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if result is not None and result.tool_calls:
        message["tool_calls"] = [{"function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                                 for c in result.tool_calls]
    return {"message": message}


@router.post("/api/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> JSONResponse | StreamingResponse:
    body.check()
    backend = await _backend(request).check_model(body.model)  # (a view of the model named)
    model = await backend.id()
    if body.suffix:
        raise HTTPError(400, "suffix needs a fill-in-the-middle template, which this model does not have",
                        "unsupported_suffix", param="suffix")
    if not body.prompt:
        return JSONResponse({"model": f"{model}:latest", "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    params, limit = await _params(backend, body.options, body.response_format())
    info = await backend.info()
    if body.raw or not info.get("chat_template"):
        source: dict[str, Any] = {"prompt": body.prompt}
    else:  # as Ollama does: the model's template around the prompt (and the system message)
        system = [{"role": "system", "content": body.system}] if body.system else []
        source = {"messages": [*system, {"role": "user", "content": body.prompt}]}
    return await _answer(request, backend, f"{model}:latest", source, params, limit, body.stream,
                         lambda text, _: {"response": text})

