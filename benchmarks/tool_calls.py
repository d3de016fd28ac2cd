"""A transcript of tool calling and a schema-constrained answer through the openai SDK, against
`llmd start --http` on the default model (issue 24's "must show").

    .venv/bin/python benchmarks/tool_calls.py

SmolLM2's own chat template does not render tools, so the daemon starts with
docs/templates/smollm2-tools.jinja (`--chat-template`): the same template with a Hermes-style tools
section. It starts its own daemon in a temporary runtime dir and stops it at the end. Each call's
arguments are checked against the tool's schema (jsonschema), the parsed answer against its Pydantic
model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "docs" / "templates" / "smollm2-tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def show(title: str, value: object) -> None:
    print(f"--- {title}")
    print(json.dumps(value, indent=2, ensure_ascii=False) if not isinstance(value, str) else value)


def main() -> None:
    import jsonschema
    import openai
    from pydantic import BaseModel, Field

    from llmd.client import Client

    socket_dir = Path(tempfile.mkdtemp(prefix="llmd-tools-")) / "run"
    env = {k: v for k, v in os.environ.items() if k != "LLMD_API_KEY"}
    llmd = [sys.executable, "-m", "llmd"]
    subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir), "--http", "0", "--chat-template", str(TEMPLATE)],
                   check=True, env=env)
    try:
        with Client(socket_dir) as c:
            info = c.info()
        client = openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        print(f"model {model}; template {TEMPLATE.relative_to(REPO)}; info.tools = {info['tools']}")
        messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

        show("request: tools get_weather, get_time; tool_choice get_weather (forced); greedy", messages)
        forced = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = forced.choices[0]
        show("response", choice.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        print("arguments valid by the tool's schema: yes")

        show("request: the same, tool_choice required, streamed", messages)
        stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice="required", temperature=0, max_tokens=100, stream=True)
        for chunk in stream:
            delta = chunk.choices[0].delta
            if delta.tool_calls or chunk.choices[0].finish_reason:
                print("chunk:", json.dumps(chunk.choices[0].model_dump(exclude_none=True), ensure_ascii=False))

        call = choice.message.tool_calls[0]
        back = [*messages, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
        show("request: the call and its result sent back; tool_choice auto; greedy", back)
        answer = client.chat.completions.create(model=model, messages=back, tools=[WEATHER, TIME], temperature=0,
                                                max_tokens=60)
        show("response", answer.choices[0].model_dump(exclude_none=True))

        class Weather(BaseModel):
            city: str = Field(max_length=40)
            temperature_c: int = Field(ge=-50, le=60)
            sky: Literal["sunny", "cloudy", "rainy", "snowy"]

        ask = [{"role": "user", "content": "Paris is sunny at 18 degrees Celsius. Give the weather as JSON."}]
        show("request: chat.completions.parse(response_format=Weather); greedy", ask)
        parsed = client.chat.completions.parse(model=model, messages=ask, response_format=Weather, temperature=0,
                                               max_tokens=80)
        show("response", parsed.choices[0].message.content)
        print("parsed:", repr(parsed.choices[0].message.parsed))

        try:
            client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8,
                                           tool_choice={"type": "function", "function": {"name": "launch"}})
        except openai.BadRequestError as e:
            show("a tool_choice naming no given tool", f"{e.status_code}: {e.message}")
    finally:
        subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, env=env)


if __name__ == "__main__":
    main()
