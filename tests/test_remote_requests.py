"""A remote model's requests and answers without a server (daemon/remote_model.py): how a
``generate`` becomes an OpenAI body, how streamed chunks read back, what HTTP statuses mean, and the
``[remote."NAME"]`` tables of the config file. The real exchanges: tests/test_remote_models.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from llmd.config import ConfigError, RemoteTable, read_config_file
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.remote_model import RemoteModel, StreamReader
from llmd.daemon.remote_runner import sse_lines
from llmd.daemon.tool_calls import ToolRequest
from llmd.errors import LlmdError
from llmd.protocol import ErrorCode, ProtocolError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def remote(**table) -> RemoteModel:
    return RemoteModel("big", RemoteTable(**{"url": "https://gpu.example:8000/v1", "model": "org/Big-70B", **table}),
                       api_key="sk-secret")


def upstream(content: dict, tools: ToolRequest | None, context_limit: int | None) -> tuple[str, dict]:
    """The request as the intake hands it over: its params checked into SamplingParams."""
    return remote().upstream_request(content, SamplingParams(**content.get("params", {})), tools, context_limit)


def test_a_chat_becomes_a_streamed_chat_completion_with_only_what_was_set() -> None:
    content = {"messages": [{"role": "user", "content": "hi"}],
               "params": {"temperature": 0.2, "top_k": 5, "stop": ["\n"], "max_tokens": 64}}
    path, body = upstream(content, None, None)
    assert path == "/chat/completions"
    assert body == {"model": "org/Big-70B", "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "top_k": 5,
                    "stop": ["\n"], "max_tokens": 64}
    path, body = upstream({"prompt": "Once", "params": {}}, None, None)
    assert path == "/completions" and body["prompt"] == "Once" and "temperature" not in body


def test_a_max_tokens_that_is_the_context_limit_is_left_to_the_server() -> None:
    content = {"prompt": "x", "params": {"max_tokens": 1 << 24}}
    assert "max_tokens" not in upstream(content, None, 1 << 24)[1]  # "until the context is full"
    content = {"prompt": "x", "params": {"max_tokens": 100}}
    assert upstream(content, None, 4096)[1]["max_tokens"] == 100  # asked for: sent


def test_tools_and_the_choice_go_as_openai_names_them() -> None:
    content = {"messages": [{"role": "user", "content": "weather?"}], "params": {}}
    for choice, sent in ((None, "auto"), ("required", "required"),
                         ({"type": "function", "function": {"name": "get_weather"}},
                          {"type": "function", "function": {"name": "get_weather"}})):
        _, body = upstream(content, ToolRequest.parse(TOOLS, choice), None)
        assert body["tool_choice"] == sent and body["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("content,word", [
    ({"token_ids": [1, 2]}, "token ids"),
    ({"prompt": "x", "params": {"logprobs": 1}}, "logprobs"),
    ({"prompt": "x", "params": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"prompt": "x", "params": {"stop_token_ids": [3]}}, "stop_token_ids"),
    ({"prompt": "x", "messages": []}, "exactly one"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
])
def test_what_a_remote_cannot_take_is_a_bad_request(content: dict, word: str) -> None:
    with pytest.raises(ProtocolError) as e:
        upstream(content, None, None)
    assert e.value.code == ErrorCode.BAD_REQUEST and word in str(e.value)


def test_chunks_read_into_text_calls_reason_and_usage() -> None:
    reader = StreamReader(chat=True)
    texts = [reader.feed(json.dumps(c)) for c in (
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "weather",
                                                                                     "arguments": '{"ci'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}},
                                                          {"index": 1, "function": {"name": "f", "arguments": "{}"}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 3}}})]
    assert "".join(texts) == "Hello"
    calls = reader.tool_calls()
    assert calls[0] == {"id": "c1", "name": "get_weather", "arguments": '{"city": 1}'}
    assert calls[1]["name"] == "f" and calls[1]["id"].startswith("call_")  # (an id made up where the server gave none)
    assert reader.finish_reason == "tool_calls"
    assert reader.usage == {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 3}
    completion = StreamReader(chat=False)
    assert completion.feed('{"choices": [{"index": 0, "text": "abc", "finish_reason": "content_filter"}]}') == "abc"
    assert completion.finish_reason == "stop"  # (a reason llmd has no name for ends it as a stop)


@pytest.mark.parametrize("data", ["{not json", "[1, 2]", '{"choices": 3}', '{"error": {"message": "boom"}}',
                                  '{"choices": [{"delta": {"tool_calls": ["x"]}}]}'])
def test_a_malformed_chunk_is_a_remote_error(data: str) -> None:
    with pytest.raises(ProtocolError) as e:
        StreamReader(chat=True).feed(data)
    assert e.value.code == ErrorCode.REMOTE_ERROR


@pytest.mark.parametrize("status,code", [(400, ErrorCode.BAD_REQUEST), (422, ErrorCode.BAD_REQUEST),
                                         (401, ErrorCode.REMOTE_ERROR), (403, ErrorCode.REMOTE_ERROR),
                                         (404, ErrorCode.MODEL_NOT_FOUND), (413, ErrorCode.TOO_LONG),
                                         (429, ErrorCode.OVERLOADED), (500, ErrorCode.REMOTE_ERROR),
                                         (503, ErrorCode.REMOTE_ERROR)])
def test_statuses_map_to_typed_errors_with_the_servers_message(status: int, code: str) -> None:
    error = remote().error_for_status(status, json.dumps({"error": {"message": "the reason"}}).encode())
    assert error.code == code and "the reason" in str(error) and "sk-secret" not in str(error)
    assert "gpu.example:8000" in str(error)


def test_the_key_is_sent_and_shown_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIG_KEY", " sk-from-env\n")
    model = RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m", api_key_env="BIG_KEY"))
    assert model.headers == {"Authorization": "Bearer sk-from-env"}
    assert "sk-from-env" not in repr(model) + json.dumps(model.describe()) + json.dumps(model.info({}))
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    model = RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m", api_key_file=str(key_file)))
    assert model.headers == {"Authorization": "Bearer sk-from-file"}
    assert RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m")).headers == {}
    monkeypatch.delenv("BIG_KEY")
    with pytest.raises(LlmdError, match=r"\$BIG_KEY"):
        RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m", api_key_env="BIG_KEY"))
    with pytest.raises(LlmdError, match="cannot read"):
        RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m", api_key_file=str(tmp_path / "no")))


def test_remote_tables_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[remote."Big-70B"]\nurl = "https://gpu:8000/v1/"\napi_key_env = "K"\nread_timeout = 30\n')
    table = read_config_file(path)["remote"]["Big-70B"]
    assert table == RemoteTable(url="https://gpu:8000/v1", model="Big-70B", api_key_env="K", read_timeout=30.0)
    for text, word in (('url = "ftp://gpu/v1"', "http(s) URL"),
                       ('url = "https://user:pw@gpu/v1"', "without credentials"),
                       ('url = "https://gpu/v1?key=x"', "without ?query"),
                       ('url = "https://gpu/v1"\napi_key = "sk"', "did you mean 'api_key_env'"),
                       ('url = "https://gpu/v1"\napi_key_env = "K"\napi_key_file = "/k"', "not both"),
                       ('url = "https://gpu/v1"\nread_timeout = 0', "read_timeout"),
                       ('model = "m"', "url is missing")):
        path.write_text(f'[remote."big"]\n{text}\n')
        with pytest.raises(ConfigError, match=word.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            read_config_file(path)
    path.write_text('remote = "big"\n')
    with pytest.raises(ConfigError, match="one per model"):
        read_config_file(path)


@pytest.mark.parametrize("key", ["two\nlines", "sk with space", "sk-é"])
def test_a_key_a_header_cannot_carry_is_refused_without_quoting_it(key: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(key)
    with pytest.raises(LlmdError) as e:
        RemoteModel.from_table("big", RemoteTable(url="http://h:1/v1", model="m", api_key_file=str(key_file)))
    assert "printable ASCII" in str(e.value) and key not in str(e.value)


def test_an_error_quoting_the_key_back_is_scrubbed() -> None:
    error = remote().error_for_status(401, b'{"error": {"message": "bad key Bearer sk-secret"}}')
    assert "sk-secret" not in str(error) and "[API key]" in str(error)


def test_sse_lines_split_on_newlines_only_and_bound_a_line() -> None:
    async def parts(*chunks: bytes):
        for chunk in chunks:
            yield chunk

    async def lines(*chunks: bytes) -> list[str]:
        return [line async for line in sse_lines(parts(*chunks))]

    text = 'data: {"t": "a\u2028b\u0085c"}'.encode()
    assert asyncio.run(lines(text[:9], text[9:] + b"\r\n\r\ndata: [DO", b"NE]")) == [
        'data: {"t": "a\u2028b\u0085c"}', "", "data: [DONE]"]
    with pytest.raises(ProtocolError, match="line of over"):
        asyncio.run(lines(*[b"x" * (1 << 20)] * 5))


def test_a_runaway_answer_is_cut() -> None:
    reader = StreamReader(chat=True, max_bytes=10)
    reader.feed('{"choices": [{"delta": {"content": "12345"}}]}')
    with pytest.raises(ProtocolError, match="runaway"):
        reader.feed('{"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "678901"}}]}}]}')


def test_a_daemon_without_remotes_never_imports_httpx() -> None:
    """httpx (~0.1 s with its CLI's click and rich) is imported by the remote runner's methods, so a
    daemon that serves no remote model does not pay for it before its first answer."""
    import subprocess
    import sys

    code = ("import sys, llmd.cli, llmd.daemon.serve, llmd.daemon.server, llmd.daemon.remote_runner\n"
            "print(sorted(m for m in ('httpx', 'click', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
