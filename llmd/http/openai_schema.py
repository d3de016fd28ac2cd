"""The OpenAI API's request bodies, checked: unknown fields are ignored (as OpenAI's server ignores
other servers' extensions), wrong types and out-of-range values are refused with 400. The fields
beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``) are vLLM's and
llama-server's extensions of the same names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmd.http.errors import HTTPError

MAX_N = 1  # choices per request: one (n > 1 is refused, never silently reduced)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API sent it out


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back with their results
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def text(self) -> str:
        """The message's text; a part that is not text (an image...) is refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise HTTPError(400, f"content parts of type {part.type!r} are not supported: this model reads text",
                                "unsupported_content", param="messages")
        return "".join(part.text or "" for part in self.content)


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False

    def params(self, max_tokens: int | None) -> dict[str, Any]:
        """The daemon's sampling params (docs/protocol.md) for the fields that were given."""
        if self.n > MAX_N:
            raise HTTPError(400, f"n={self.n}: llmd returns one choice per request; send n=1 (or several "
                                 "requests)", "unsupported_n", param="n")
        params: dict[str, Any] = {}
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        if self.top_k is not None:
            params["top_k"] = max(self.top_k, 0)  # -1 is "off" in vLLM, 0 in llmd
        if self.seed is not None:
            params["seed"] = self.seed % 2**63  # OpenAI takes any 64-bit seed; llmd's are in [0, 2**63)
        if self.stop:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # checked by the daemon (docs/protocol.md: a bad one is a 400 naming it)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "invalid_value", param="top_logprobs")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the daemon takes them (``developer`` is OpenAI's newer name for ``system``)."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
            if m.role == "tool" and m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    def tool_fields(self) -> dict[str, Any]:
        """``tools`` and ``tool_choice`` for the daemon (an empty list of tools is none)."""
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = self.tools
        if self.tool_choice is not None and (self.tools or self.tool_choice not in ("none", "auto")):
            fields["tool_choice"] = self.tool_choice  # (a forced choice without tools: the daemon's 400)
        return fields

    def sampling(self) -> dict[str, Any]:
        params = self.params(self.max_completion_tokens or self.max_tokens)
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        if self.response_format is not None:  # the daemon checks it (docs/protocol.md: a bad one is a 400)
            params["response_format"] = self.response_format
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self) -> None:
        if self.suffix:
            raise HTTPError(400, "suffix needs a fill-in-the-middle template, which this model does not have",
                            "unsupported_suffix", param="suffix")
        if self.best_of is not None and self.best_of > 1:
            raise HTTPError(400, "best_of > 1 is not supported", "unsupported_best_of", param="best_of")

    def one_prompt(self) -> str | list[int]:
        """The prompt: text or token ids; a batch of several prompts is refused (one choice per request)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise HTTPError(400, f"{len(p)} prompts in one request: send one prompt per request",
                                "unsupported_batch", param="prompt")
            p = p[0]
        if not p:
            raise HTTPError(400, "prompt is empty", "invalid_value", param="prompt")
        return p

    def sampling(self) -> dict[str, Any]:
        params = self.params(self.max_tokens)
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params
