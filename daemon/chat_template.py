"""Chat templates rendered as transformers renders them, without importing transformers.

A model's chat template is Jinja its author wrote, so it is untrusted code: it runs in jinja2's
immutable sandbox, with the globals and filters templates are written against (transformers'
``apply_chat_template`` in 5.x: ``tojson`` that does not escape HTML, ``raise_exception``,
``strftime_now``, a ``dict`` and a ``namespace`` that cannot reach Python's internals, and the
``{% generation %}`` tag). tests/test_snapshot_tokenizer.py renders the same chats through both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# a message's reasoning may come under any of these names; templates read the first (transformers aliases them)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training masks;
    rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # (jinja2's own tojson escapes <, >, & and ' for HTML, which a prompt must not have)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` for templates: makes plain dicts, and is not the type (no attribute of it leads out)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` that refuses names starting with ``_`` (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's own signature: `self` may be a key)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the sandbox (cached: a template is compiled once, rendered per request).

    Raises:
        jinja2.TemplateSyntaxError: ``source`` is not a template.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def select_template(template: str | Mapping[str, str] | None, tools: list[Any] | None) -> str:
    """The template to render: a model may name several (``tool_use`` is taken when there are tools).

    Raises:
        ValueError: no template, or named ones with no ``default``.
    """
    if isinstance(template, Mapping):
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError(f"the model has chat templates named {sorted(template)} and none is the default")
    if not template:
        raise ValueError("the model has no chat template")
    return template


def _plain(value: Any) -> Any:
    # what a template sees is rebuilt from plain JSON types (a subclass could carry methods the
    # sandbox does not know of); anything else becomes a placeholder naming its type
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def render_chat(template: str | Mapping[str, str] | None, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                **variables: Any) -> str:
    """``messages`` (and ``tools``, JSON schemas) through the model's chat ``template``, with
    ``variables`` (its special tokens: ``bos_token``...) visible to it.

    Raises:
        ValueError: no template, or a message that is not a dict.
        jinja2.TemplateError: what the template raises (``raise_exception``, a sandbox refusal...).
    """
    compiled = compile_template(select_template(template, tools))
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"a chat message must be a dict, not {type(message).__name__}")
        # keys set to None are left out: templates test for a key, and would render "None"
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    return compiled.render(messages=chat, tools=_plain(tools), documents=None,
                           add_generation_prompt=add_generation_prompt, **_plain(variables))
