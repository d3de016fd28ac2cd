"""Tool calling (issue 24, daemon/tool_calls.py): the request's tools and choice checked, which
templates render tools, the forced calls' constraint (a tiny random model under it writes calls
that parse and match their schemas), and the parser that splits an output into text and calls as
it streams. The HTTP and openai SDK round trips are in test_http.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tiny_models import make_engine, make_hf_model, make_tiny_tokenizer, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.prompt_encoder import PromptEncoder
from llmd.daemon.tool_calls import ToolCallParser, ToolRequest, call_style, template_messages
from llmd.errors import RequestError
from llmd.protocol import ProtocolError, parse_messages

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
PLACE = {"type": "function", "function": {  # as Pydantic writes a schema: its enum in $defs
    "name": "find_place", "parameters": {
        "$defs": {"Kind": {"enum": ["cafe", "park", "museum"], "type": "string"}},
        "type": "object", "properties": {"kind": {"$ref": "#/$defs/Kind"}}, "required": ["kind"],
        "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, PLACE)}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def test_tools_and_choices_are_checked() -> None:
    request = ToolRequest.parse([WEATHER, TIME])
    assert request.choice == "auto" and not request.forced and len(request.template_tools()) == 2
    assert ToolRequest.parse([WEATHER], "none").template_tools() is None
    named = ToolRequest.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "function" and named.function == "get_time" and named.forced
    # a tool without parameters takes an empty object; one with a description-less function is fine
    bare = ToolRequest.parse([{"type": "function", "function": {"name": "ping"}}])
    assert bare.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert ToolRequest.parse(None) is None and ToolRequest.parse(None, "none") is None
    bad = [
        (([],), "tools must be a list of 1 to"),
        (({"type": "function"},), "tools must be a list"),
        (([{"type": "code_interpreter"}],), r"tools\[0\] must be"),
        (([{"type": "function", "function": {"name": "a b"}}],), r"tools\[0\].function.name must be"),
        (([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],),
         "parameters must be a JSON schema of an object"),
        (([{"type": "function", "function": {"name": "f", "description": 3}}],), "description must be a string"),
        (([WEATHER, WEATHER],), "different names"),
        (([WEATHER], "sometimes"), "tool_choice must be"),
        (([WEATHER], {"type": "function", "function": {"name": "get_time"}}), "not among the tools"),
        ((None, "required"), "tool_choice needs tools"),
    ]
    for args, message in bad:
        with pytest.raises(RequestError, match=message):
            ToolRequest.parse(*args)


def test_which_templates_render_tools() -> None:
    assert call_style(make_tiny_tokenizer()) is None  # its template ignores tools
    assert call_style(make_tiny_tokenizer(tools=True)) == "tags"
    json_style = make_tiny_tokenizer()
    json_style.chat_template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert call_style(json_style) == "json"  # a template that renders tools but names no tags


def test_a_model_that_cannot_see_tools_is_refused_and_one_that_can_renders_them() -> None:
    content = {"messages": CHAT}
    plain = PromptEncoder(make_tiny_tokenizer(), 4096)
    with pytest.raises(ProtocolError, match="does not render tools"):
        plain.encode(content, [WEATHER])
    assert plain.encode(content) == plain.encode(content, None)  # without tools: as before
    capable = PromptEncoder(make_tiny_tokenizer(tools=True), 4096)
    with_tools = capable.encode(content, list(ToolRequest.parse([WEATHER]).template_tools()))
    assert len(with_tools) > len(capable.encode(content)) + 100
    assert "get_weather" in capable.tokenizer.decode(with_tools)


def test_calls_sent_back_render_with_their_results() -> None:
    messages = parse_messages([
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ])
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"
    rendered = template_messages(messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    deep = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}]
    assert template_messages(parse_messages(deep))[0]["tool_calls"][0]["function"]["arguments"] == "[" * 100_000
    text = make_tiny_tokenizer(tools=True).apply_chat_template(rendered, tools=[WEATHER], tokenize=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in text
    assert "<tool_response>21 C, sunny</tool_response>" in text
    for bad, message in [
        ({"role": "user", "content": "x", "tool_calls": []}, "only an assistant"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, "tool_calls must be"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, "tool_calls must be"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "only a tool message"),
        ({"role": "tool"}, "each message must be"),
        ({"role": "tool", "content": "21 C"}, "answers the tool_calls of the assistant message before it"),
        ({"role": "assistant", "content": 0, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
         "each message must be"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "a b", "arguments": "{}"}}]}, "tool_calls must"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            parse_messages([bad])


def feed_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, str, list]:
    sent = "".join(parser.feed(p) for p in pieces)
    rest, calls = parser.finish()
    return sent, rest, calls


def test_tagged_calls_are_parsed_as_they_stream() -> None:
    auto = ToolRequest.parse([WEATHER, TIME])
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    # the tag split across pieces: nothing of it is sent as text
    sent, rest, calls = feed_all(ToolCallParser(auto, "tags"), ["Let me check. <to", "ol_c", "all>" + call[:9],
                                                                 call[9:] + "</tool_call>"])
    assert sent == "Let me check. " and rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert all(c.id.startswith("call_") for c in calls)
    # two calls, the second in the list form some models write; the text around them stays
    sent, rest, calls = feed_all(ToolCallParser(auto, "tags"), [
        "<tool_call>" + call + "</tool_call>\n<tool_call>[", '{"name": "get_time", "arguments": {"zone": 1}}]',
        "</tool_call>"])
    assert sent == "" and rest == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    # what only looked like a tag is sent once it is known not to be one
    parser = ToolCallParser(auto, "tags")
    assert parser.feed("a <to") == "a " and parser.feed("p> b") == "<top> b"
    assert parser.finish() == ("", [])
    # a call that does not parse, or names no given tool, stays the model's text
    for body in ('{"name": "get_weather", "arguments": {"city": "Par', '{"name": "launch", "arguments": {}}',
                 '{"name": "get_weather", "arguments": "Paris"}'):
        text = "Sure. <tool_call>" + body + "</tool_call>"
        sent, rest, calls = feed_all(ToolCallParser(auto, "tags"), [text])
        assert calls == [] and sent + rest == text
    # tool_choice none: all of it is text, tags and all
    sent, rest, calls = feed_all(ToolCallParser(ToolRequest.parse([WEATHER], "none"), "tags"),
                                 ["<tool_call>" + call + "</tool_call>"])
    assert calls == [] and sent == "<tool_call>" + call + "</tool_call>"


def test_json_style_and_forced_calls_are_parsed_at_the_end() -> None:
    auto = ToolRequest.parse([WEATHER, TIME])
    sent, rest, calls = feed_all(ToolCallParser(auto, "json"), [' {"name": "get_time", ', '"parameters": {"zone": 3}}'])
    assert sent == "" and rest == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": 3}')]
    sent, rest, calls = feed_all(ToolCallParser(auto, "json"), ["It is ", "sunny."])
    assert (sent, rest, calls) == ("It is sunny.", "", [])
    sent, rest, calls = feed_all(ToolCallParser(auto, "json"), ['{"answer": 42}'])  # JSON, but not a call
    assert (sent, rest, calls) == ("", '{"answer": 42}', [])
    # only the output's opening decides: a later piece that opens with { streams on as text
    parser = ToolCallParser(auto, "json")
    assert parser.feed("Here: ") == "Here: " and parser.feed('{"name": "get_time", "parameters": {}}') != ""
    assert parser.finish() == ("", [])
    named = ToolRequest.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    sent, rest, calls = feed_all(ToolCallParser(named, None), ['{"city":"Oslo",', '"unit":"F"}'])
    assert sent == rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "F"})]
    sent, rest, calls = feed_all(ToolCallParser(named, None), ['{"city":"Os'])  # cut by max_tokens
    assert (sent, rest, calls) == ("", '{"city":"Os', [])
    required = ToolRequest.parse([WEATHER, TIME], "required")
    sent, rest, calls = feed_all(ToolCallParser(required, None), ['[{"name":"get_time","arguments":{"zone":-2}}]'])
    assert sent == rest == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": -2}')]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tools") / "m", with_tokenizer=True,
                         tools=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_call_from_a_random_model_parses_and_matches_its_schema(model_dir, temperature: float) -> None:
    """The constraint of ``required`` and of a named function, through the engine: a tiny random model,
    which left alone writes noise, writes calls that parse, name a given tool and match its schema."""
    engine = make_engine(model_dir, num_blocks=256)
    outputs = {}
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}] * 3):
        request = ToolRequest.parse([WEATHER, TIME, PLACE], choice)  # (PLACE's $defs move to the root)
        params = SamplingParams(temperature=temperature, max_tokens=200, seed=i,
                                response_format=request.response_format())
        engine.add_request(f"r{i}", [3 + (7 * i + k) % 200 for k in range(8)], params,
                           grammar=engine.grammar_compiler.grammar(params.response_format))
        outputs[f"r{i}"] = (request, [])
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id][1].append(delta.text)
            if delta.finished:
                assert delta.finish_reason == "stop", delta.finish_reason
    # the canary: unconstrained, the same model's output is no call
    engine.add_request("free", [3 + k for k in range(8)], SamplingParams(temperature=temperature, max_tokens=60,
                                                                          seed=9))
    free = "".join(d.text for _ in range(200) if engine.has_unfinished() for d in engine.step())
    assert feed_all(ToolCallParser(ToolRequest.parse([WEATHER, TIME, PLACE], "required"), None), [free])[2] == []
    for request, pieces in outputs.values():
        parser = ToolCallParser(request, "tags")
        sent, rest, calls = feed_all(parser, pieces)
        assert sent == rest == "" and calls, "".join(pieces)
        for call in calls:
            assert request.choice == "required" or call.name == "get_time"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_chat_template_file_replaces_the_models_own(tmp_path) -> None:
    """``--chat-template FILE``: read, checked by rendering a chat (a bad one leaves the model's own), used."""
    from tiny_models import TOOL_CHAT_TEMPLATE

    from llmd.daemon.tokenizer import read_chat_template, use_chat_template
    from llmd.errors import InvalidModelError

    tokenizer = make_tiny_tokenizer()
    with pytest.raises(InvalidModelError, match="cannot read the chat template"):
        read_chat_template(tmp_path / "missing.jinja")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(InvalidModelError, match="must be 1 to"):
        read_chat_template(tmp_path / "empty.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    with pytest.raises(InvalidModelError, match="does not render a chat"):
        use_chat_template(tokenizer, read_chat_template(bad), bad)
    assert call_style(tokenizer) is None  # the model's own, still
    good = tmp_path / "tools.jinja"
    good.write_text(TOOL_CHAT_TEMPLATE)
    use_chat_template(tokenizer, read_chat_template(good), good)
    assert call_style(tokenizer) == "tags"


def test_the_smollm2_tools_template_is_the_models_own_without_tools() -> None:
    """docs/templates/smollm2-tools.jinja: the default model's chats render as with its own template, and
    with tools it lists them and takes the calls and results sent back."""
    from pathlib import Path

    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.tokenizer import load_tokenizer, read_chat_template, use_chat_template

    tokenizer = load_tokenizer(resolve_model(None))
    assert call_style(tokenizer) is None
    chats = [CHAT, [{"role": "system", "content": "Be brief."}, *CHAT],
             [*CHAT, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Oslo?"}]]
    own = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=g) for c in chats
           for g in (True, False)]
    path = Path(__file__).parents[1] / "docs" / "templates" / "smollm2-tools.jinja"
    use_chat_template(tokenizer, read_chat_template(path), path)
    assert [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=g) for c in chats
            for g in (True, False)] == own
    assert call_style(tokenizer) == "tags"
    messages = template_messages(parse_messages([*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]))
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tools>" in text and "You are a helpful AI assistant" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>18 C</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
