"""Tool calling (issue 24): a chat request's ``tools`` (OpenAI's function tools) rendered into the
prompt by the model's chat template, and the calls the model makes parsed out of its output.

Which models can: those whose chat template renders a ``tools`` list (:func:`call_style` renders one
and sees whether the prompt changes). A template that does not is refused: the model would never see
the tools. Models write their calls in one of two styles, told apart by the template's text:
``tags``, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes; Qwen 2.5 and 3,
SmolLM3 and many fine-tunes), and ``json``, the output a bare JSON object ``{"name": ...,
"parameters": {...}}`` (Llama 3.x).

``tool_choice``:

* ``auto`` (the default): the model chooses. Its calls are parsed as they come; a call that does not
  parse, or names a tool it was not given, stays the model's text (as vLLM's parsers do): the text
  is what it wrote, not an error.
* ``none``: the tools are left out of the prompt, and the answer is text.
* ``required`` and a named function: the output is constrained (daemon/engine/structured_output.py)
  to calls, the same on every model whatever its own style: ``required``, a JSON list of
  ``{"name", "arguments"}`` objects, each by its tool's parameter schema; a named function, its
  arguments object alone. A forced call always parses (unless ``max_tokens`` cuts it).

Streaming: text that may begin a call is held back until it is known not to; the calls come with the
request's end.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from llmd.daemon.engine.structured_output import ResponseFormat
from llmd.errors import RequestError
from llmd.protocol import TOOL_NAME

STYLES = ("tags", "json")
CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 256 * 1024  # the tools' JSON text: it is rendered into the prompt and compiled
_NAME = re.compile(TOOL_NAME)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|$)", re.S)
_PROBE_TOOL = {"type": "function", "function": {"name": "llmd_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object's text (as OpenAI sends it)."""

    id: str
    name: str
    arguments: str

    def to_wire(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and choice, checked (:meth:`parse`).

    Attributes:
        tools: OpenAI's shape, ``{"type": "function", "function": {"name", "description", "parameters"}}``,
            each ``parameters`` an object schema (``{"type": "object"}`` filled in when absent).
        choice: ``auto``, ``none``, ``required`` or ``function`` (the one named ``function``).
    """

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    function: str | None = None

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None) -> ToolRequest | None:
        """From the wire: ``tools`` a list of function tools, ``tool_choice`` ``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": NAME}}``; None without tools.

        Raises:
            RequestError: anything else, naming the field.
        """
        if tools is None:
            if tool_choice not in (None, "none"):
                raise RequestError("tool_choice needs tools: send the tools it may choose from")
            return None
        if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
            raise RequestError(f"tools must be a list of 1 to {MAX_TOOLS} function tools")
        checked = tuple(_check_tool(i, tool) for i, tool in enumerate(tools))
        names = [t["function"]["name"] for t in checked]
        if len(set(names)) != len(names):
            raise RequestError("tools must have different names")
        if len(json.dumps(checked)) > MAX_TOOLS_CHARS:
            raise RequestError(f"tools are more than {MAX_TOOLS_CHARS} characters of JSON")
        if tool_choice is None or tool_choice in CHOICES:
            return cls(checked, tool_choice or "auto")
        name = None
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and set(tool_choice) <= {
                "type", "function"} and isinstance(tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
        if not isinstance(name, str):
            raise RequestError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                               '"function": {"name": NAME}}')
        if name not in names:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
        return cls(checked, "function", name)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template renders: the tools, none when the choice is ``none``."""
        return None if self.choice == "none" else [dict(t) for t in self.tools]

    def response_format(self) -> ResponseFormat | None:
        """The constraint of a forced call (module docstring); None for ``auto`` and ``none``."""
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.choice == "function":
            schema = schemas[self.function]
        elif self.choice == "required":
            # each tool's schema moves under the list's items: its $defs move to the root with it
            defs: dict[str, Any] = {}
            calls = [{"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": _hoist_defs(params, f"{i}_", defs)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for i, (name, params) in enumerate(schemas.items())]
            schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if defs:
                schema["$defs"] = defs
        else:
            return None
        return ResponseFormat("json_schema", json.dumps(schema, separators=(",", ":")), origin="tools")


def _hoist_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its ``$defs`` (and ``definitions``), which go into ``defs`` named ``prefix +
    name``, its ``#/$defs/name`` references rewritten to match: a schema nested in another resolves
    its references from the outer one's root."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema

    def rewrite(value: Any) -> Any:
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {k: rewrite(v) for k, v in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str):
            for root in ("#/$defs/", "#/definitions/"):
                if ref.startswith(root) and ref[len(root):].split("/")[0] in local:
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
        return out

    for name, body in local.items():
        defs[prefix + name] = rewrite(body)
    return rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise RequestError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, _ . or -")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise RequestError(f"{where}.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise RequestError(f"{where}.function.parameters must be a JSON schema of an object")
    try:
        params = json.loads(json.dumps({"type": "object", **params}))  # plain JSON, a copy
    except (TypeError, ValueError, RecursionError):
        raise RequestError(f"{where}.function.parameters must be JSON (maps, lists, strings, numbers, booleans, "
                           "null)") from None
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def call_style(tokenizer: Any) -> str | None:
    """How the model writes tool calls (:data:`STYLES`), or None when its chat template does not
    render tools: a probe tool rendered, or not, into a one-message chat (a millisecond or so)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" for tools
        template = template.get("tool_use") or template.get("default")
    style = None
    if isinstance(template, str) and template:
        chat = [{"role": "user", "content": "hi"}]
        try:
            plain = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            probed = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                   tokenize=False)
        except Exception:  # a template that cannot render its own probe supports nothing here
            probed = plain = ""
        if probed != plain and "llmd_probe_tool" in probed:
            style = "tags" if _OPEN in template else "json"
    return style


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: an assistant's tool calls as ``{"type": "function",
    "function": {"name", "arguments": {...}}}`` (arguments a map, as transformers documents; text
    that is not a JSON object is left as it is)."""
    out = []
    for m in messages:
        if "tool_calls" not in m:
            out.append(m)
            continue
        calls = []
        for call in m["tool_calls"]:
            fn = call["function"]
            arguments = fn["arguments"]
            if isinstance(arguments, str):
                parsed = _loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
            calls.append({**call, "function": {"name": fn["name"], "arguments": arguments}})
        out.append({**m, "tool_calls": calls})
    return out


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


class ToolCallParser:
    """Splits one request's output into text and calls, as it streams: :meth:`feed` each piece of
    text and send on what it returns; :meth:`finish` at the end gives the text held back and the calls.

    Args:
        request: the request's tools and choice.
        style: the model's (:func:`call_style`); unused when the call is forced.
    """

    def __init__(self, request: ToolRequest, style: str | None) -> None:
        self.request, self.style = request, style
        self._names = {t["function"]["name"] for t in request.tools}
        self._held = ""
        self._holding = request.forced  # forced: all of it is the call
        self._opened = False  # json style: the output's first character seen (it alone decides)

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what came before) that cannot be part of a call."""
        if self.request.choice == "none":
            return text
        self._held += text
        if self._holding:
            return ""
        if self.style == "json":
            if not self._opened:
                stripped = self._held.lstrip()
                if not stripped:
                    return ""
                self._opened = True
                if stripped[0] in "{[":
                    self._holding = True  # an answer that opens like a call waits for its end
                    return ""
            out, self._held = self._held, ""
            return out
        start = self._held.find(_OPEN)
        if start >= 0:
            self._holding = True
        else:  # keep back an end that may be the tag's beginning
            start = len(self._held)
            for k in range(min(len(_OPEN) - 1, len(self._held)), 0, -1):
                if _OPEN.startswith(self._held[-k:]):
                    start = len(self._held) - k
                    break
        out, self._held = self._held[:start], self._held[start:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text held back, and the calls: those parsed, or none and all of it text (module docstring)."""
        held, self._held = self._held, ""
        if self.request.choice == "none":
            return held, []
        if self.request.choice == "function":
            args = _loads(held)
            if isinstance(args, dict):
                return "", [ToolCall(new_call_id(), self.request.function or "", _dumps(args))]
            return held, []
        if self.request.choice == "required" or self.style == "json":
            calls = self._calls(_loads(held))
            return ("", calls) if calls else (held, [])
        calls: list[ToolCall] = []
        for match in _TAGGED.finditer(held):
            found = self._calls(_loads(match.group(1)))
            if not found:
                return held, []
            calls += found
        return (_TAGGED.sub("", held).strip(), calls) if calls else (held, [])

    def _calls(self, value: Any) -> list[ToolCall]:
        """Calls out of a parsed ``{"name", "arguments"}`` (or ``"parameters"``) object or a list of
        them; none unless every one names a tool and has an object of arguments."""
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self._names:
                return []
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(args, dict):
                return []
            calls.append(ToolCall(new_call_id(), item["name"], _dumps(args)))
        return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
