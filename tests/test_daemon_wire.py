"""Hostile and documented traffic at a real daemon: bad input of every kind gets a typed error or
is dropped, and the next valid request still works; a client written from docs/protocol.md alone
works."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from daemon_helpers import Raw, daemon_env, start_daemon, stop_daemon
from tiny_models import CHAT_TEMPLATE, make_hf_model, save_hf_model

from llmd.client import Client
from llmd.protocol import PROTOCOL, sign

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("wire")
    model = save_hf_model(make_hf_model("llama"), tmp / "model", with_tokenizer=True)
    # A chat template that raises, as Mistral's and Llama 2's do when roles do not alternate.
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    strict = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations must start with a user "
              "message') }}{% endif %}")
    (model / "chat_template.jinja").write_text(strict + CHAT_TEMPLATE)
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    env = daemon_env(tmp)
    conn = start_daemon(model, tmp / "run", env=env)
    yield tmp / "run", conn
    stop_daemon(tmp / "run", env)


def dropped(socket_dir: Path) -> int:
    with Client(socket_dir) as c:
        return c.stats()["num_dropped_messages"]


@pytest.mark.parametrize("frames", [
    [os.urandom(37)],
    [os.urandom(8), os.urandom(8), os.urandom(8), os.urandom(8), os.urandom(8)],
    [PROTOCOL, b"", msgpack.packb({"v": 1, "id": "x", "type": "health"}), msgpack.packb({})],  # unsigned
    [PROTOCOL, b"0" * 64, msgpack.packb({"v": 1, "id": "x", "type": "health"}), msgpack.packb({})],  # bad sig
])
def test_unauthenticated_or_broken_frames_are_dropped(daemon, frames: list[bytes]) -> None:
    socket_dir, conn = daemon
    raw = Raw(conn)
    before = dropped(socket_dir)
    raw.send_frames(frames)
    assert raw.recv(0.5) is None  # no reply to the unauthenticated
    assert raw.works()
    assert dropped(socket_dir) == before + 1


BAD_GENERATES = [
    {"request_id": 5, "token_ids": [1]},
    {"request_id": "x" * 100, "token_ids": [1]},
    {"request_id": "a"},  # no prompt
    {"request_id": "a", "prompt": "hi", "token_ids": [1]},  # two prompts
    {"request_id": "a", "token_ids": [1, "2"]},
    {"request_id": "a", "token_ids": [-1]},
    {"request_id": "a", "token_ids": [10**9]},
    {"request_id": "a", "token_ids": [1], "params": {"max_tokens": -3}},
    {"request_id": "a", "token_ids": [1], "params": {"max_tokens": 10**12}},
    {"request_id": "a", "token_ids": [1], "params": {"temperature": math.nan}},
    {"request_id": "a", "token_ids": [1], "params": {"temperature": "hot"}},
    {"request_id": "a", "token_ids": [1], "params": {"top_p": 7}},
    {"request_id": "a", "token_ids": [1], "params": {"stop": ["x"] * 100}},
    {"request_id": "a", "token_ids": [1], "params": {"logprobs": 10**6}},
    {"request_id": "a", "token_ids": [1], "params": {"seed": 2**64 - 1}},  # msgpack max; over 2**63
    {"request_id": "a", "token_ids": [1], "params": [1, 2]},
    {"request_id": "a", "token_ids": [1], "stream": "yes"},
    {"request_id": "a", "messages": [{"role": "robot", "content": "hi"}]},
    {"request_id": "a", "messages": [{"role": "user"}]},
    {"request_id": "a", "messages": "hi"},
    {"request_id": "a", "messages": [{"role": "assistant", "content": "hi"}]},  # the template raises
    {"request_id": "a", "token_ids": [1], "params": {"response_format": {"type": "xml"}}},
    {"request_id": "a", "token_ids": [1], "params": {"response_format": {"type": "json_schema"}}},
    {"request_id": "a", "token_ids": [1], "params": {"response_format": {"type": "regex", "regex": "(x"}}},  # compile
]


@pytest.mark.parametrize("content", BAD_GENERATES)
def test_bad_generate_fields_get_typed_errors(daemon, content: dict) -> None:
    _, conn = daemon
    raw = Raw(conn)
    raw.send("generate", content, "bad")
    msg = raw.recv()
    assert msg is not None and msg.type == "error" and msg.parent == "bad"
    assert msg.content["code"] in ("bad_request", "too_long")
    assert raw.works()


def test_signed_but_malformed_messages_get_typed_errors(daemon) -> None:
    _, conn = daemon
    raw = Raw(conn)
    key = raw.key
    for content in (b"\xa2\xff\xfe", b"\xc1", msgpack.packb([1, 2])):  # invalid UTF-8, reserved byte, not a map
        h = msgpack.packb({"v": 1, "id": "mal", "type": "health", "ts": time.time()})
        raw.send_frames([PROTOCOL, sign(key, h, content), h, content])
        msg = raw.recv()
        assert msg is not None and msg.type == "error" and msg.content["code"] == "bad_request"
    raw.send("launch_missiles", {}, "unk")
    msg = raw.recv()
    assert msg.type == "error" and msg.parent == "unk" and "unknown message type" in msg.content["message"]
    assert raw.works()


def test_oversize_message_is_dropped_and_the_client_recovers(daemon) -> None:
    socket_dir, conn = daemon
    raw = Raw(conn)
    raw.send("generate", {"request_id": "big", "prompt": "x" * (5 * 1024 * 1024)}, "big")
    assert raw.recv(1.0) is None
    time.sleep(0.5)  # the DEALER reconnects by itself
    assert raw.works()
    with Client(socket_dir) as c:  # and the daemon serves everyone else
        assert c.health()["status"] == "ok"


def test_a_client_written_from_the_protocol_doc(daemon) -> None:
    socket_dir, conn = daemon
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("raw_protocol_client.py")),
                          str(socket_dir / "daemon.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["health"] == ["health", "h1", "ok"]
    assert seen["types"] == ["accepted", "delta", "done"]
    assert len(seen["tokens"]) == 8 and seen["done"]["finish_reason"] == "length"
    assert seen["done"]["usage"]["completion_tokens"] == 8
    assert seen["cancel"] == ["error", "unknown_request"]
    assert seen["tokenize"] == ["tokens", 2]
    assert seen["stats"][0] == "stats" and seen["stats"][1] > 0


def test_a_response_format_holds_over_the_wire(daemon) -> None:
    socket_dir, _ = daemon
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    with Client(socket_dir) as c:
        result = c.generate("Answer:", stream=False, max_tokens=40, temperature=0.8, seed=3,
                            response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert result.finish_reason == "stop" and 0 <= json.loads(result.text)["n"] <= 99


def test_template_errors_in_tokenize_are_typed_too(daemon) -> None:
    _, conn = daemon
    raw = Raw(conn)
    raw.send("tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, "tok")
    msg = raw.recv()
    assert msg.type == "error" and msg.content["code"] == "bad_request" and "user message" in msg.content["message"]
    raw.send("tokenize", {"messages": [{"role": "user", "content": "x"}]}, "tok2")
    assert raw.recv().type == "tokens"
    assert raw.works()
