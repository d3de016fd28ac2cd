"""Remote models (config ``[remote."NAME"]``, issue 27) for real: "the cluster" is llmd's own ``--http``
server on a tiny model (an OpenAI-compatible server like vLLM's), and a deliberately failing fake
server gives the error paths; a second daemon ("the desktop") serves its own tiny model and forwards
the remote ones. Its answers for a remote model are checked against the cluster's own, through the
native client and through the openai SDK on the desktop's HTTP API. No network beyond loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from daemon_helpers import daemon_env, fault_env, start_daemon, stop_daemon, wait_for
from tiny_models import make_hf_model, save_hf_model

from llmd.client import Client, ServerError
from llmd.http.backend import model_id

pytestmark = pytest.mark.slow

CLUSTER_KEY = "cluster-key-5f1e2d3c4b5a"  # the cluster's API key: must never show on the desktop's side
DESKTOP_KEY = "desktop-key-0123456789"
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class FakeCluster(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that fails on purpose, by the model a request names."""

    seen: dict[str, threading.Event] = {}  # "<model>:gone": the client closed a stream mid-answer
    auth: list[str | None] = []  # the Authorization headers received

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "slow"}, {"id": "fail-500"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCluster.auth.append(self.headers.get("Authorization"))
        model = body["model"]
        errors = {"fail-401": (401, "Incorrect API key provided"), "fail-404": (404, "The model does not exist"),
                  "fail-400": (400, "max_tokens must be at most 100"), "fail-429": (429, "Too many requests"),
                  "fail-500": (500, "CUDA out of memory")}
        if model in errors:
            status, message = errors[model]
            if model == "fail-401":  # as some servers do: the header it refused, quoted back
                message += f" ({self.headers.get('Authorization')})"
            return self._json(status, {"error": {"message": message, "type": "error", "code": status}})
        if model == "hang":
            time.sleep(4)
            return self._json(500, {"error": {"message": "too late"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(payload: str) -> None:
            self.wfile.write(f"data: {payload}\n\n".encode())
            self.wfile.flush()

        def chunk(text: str, reason: str | None = None) -> str:
            choice = {"delta": {"content": text}} if self.path.endswith("/chat/completions") else {"text": text}
            return json.dumps({"choices": [{"index": 0, **choice, "finish_reason": reason}]})

        if model == "broken":
            return event("{this is not json")
        if model == "unicode":  # line and paragraph separators raw inside the JSON, as servers send them
            self.wfile.write(("data: " + json.dumps({"choices": [{"index": 0, "text": "a\u2028b\u0085c\u2029d",
                                                                  "finish_reason": "stop"}]}, ensure_ascii=False)
                              + "\n\ndata: [DONE]\n\n").encode())
            return
        if model == "runaway":  # a line that never ends
            self.wfile.write(b"data: " + b"x" * (6 << 20))
            return
        if model == "cut":
            return event(chunk("half an ans"))
        try:  # "slow": a token every 50 ms for 30 s, unless the client goes
            for _ in range(600):
                event(chunk("tick "))
                time.sleep(0.05)
            event(chunk("", "length"))
            event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            FakeCluster.seen.setdefault(f"{model}:gone", threading.Event()).set()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote")


@pytest.fixture(scope="module")
def model_dir(tmp: Path) -> Path:
    return save_hf_model(make_hf_model("llama", max_position_embeddings=1024), tmp / "model", with_tokenizer=True,
                         tools=True)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp: Path):
    """llmd's own HTTP server on the tiny model, with an API key: the stand-in for vLLM on a cluster."""
    # each step 20 ms slower, as a big model's would be, a token a step: a long answer is still running
    # when it is cancelled
    env = fault_env({**daemon_env(tmp / "cluster"), "LLMD_API_KEY": CLUSTER_KEY}, LLMD_TEST_STEP_DELAY_S="0.02")
    socket_dir = tmp / "cluster-run"
    conn = start_daemon(model_dir, socket_dir, "--http", "127.0.0.1:0", "--speculative", "off", env=env)
    yield socket_dir, conn
    stop_daemon(socket_dir, env)


@pytest.fixture(scope="module")
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCluster)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def desktop(model_dir: Path, tmp: Path, cluster, fake: str):
    """The local daemon: its own model, and the remote ones of its config file."""
    socket_dir, conn = cluster
    home = tmp / "desktop"
    (home / "config" / "llmd").mkdir(parents=True)
    key_file = home / "fake.key"
    key_file.write_text("fake-file-key\n")
    closed = _closed_port()
    tables = [f'[remote."big"]\nurl = "{conn["http"]}/v1/"\nmodel = "{model_id(conn["model"])}"\n'
              'api_key_env = "CLUSTER_KEY"\n',
              f'[remote."big-no-key"]\nurl = "{conn["http"]}/v1"\nmodel = "{model_id(conn["model"])}"\n',
              f'[remote."dead"]\nurl = "http://127.0.0.1:{closed}/v1"\n']
    for name in ("fail-401", "fail-404", "fail-400", "fail-429", "fail-500", "broken", "cut", "slow", "unicode",
                 "runaway"):
        tables.append(f'[remote."{name}"]\nurl = "{fake}"\napi_key_file = "{key_file}"\n')
    tables.append(f'[remote."hang"]\nurl = "{fake}"\nread_timeout = 1\n')
    (home / "config" / "llmd" / "config.toml").write_text("\n".join(tables))
    env = {**daemon_env(home), "CLUSTER_KEY": CLUSTER_KEY, "LLMD_API_KEY": DESKTOP_KEY}
    desktop_dir = tmp / "desktop-run"
    info = start_daemon(model_dir, desktop_dir, "--http", "127.0.0.1:0", env=env)
    yield desktop_dir, info, env
    stop_daemon(desktop_dir, env)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again once the with ends: connections to it are refused


def greedy(socket_dir: Path, model: str | None = None, **kwargs) -> tuple[list[str], object]:
    """The streamed pieces and the final result of a greedy request."""
    with Client(socket_dir) as c:
        stream = c.generate(model=model, temperature=0, **kwargs)
        pieces = [d.text for d in stream]
        return pieces, stream.result


def test_a_remote_model_answers_as_its_server_does_streamed(cluster, desktop) -> None:
    for source in ({"messages": MESSAGES}, {"prompt": "Once upon a time"}):
        pieces, result = greedy(desktop[0], "big", max_tokens=24, **source)
        _, direct = greedy(cluster[0], max_tokens=24, **source)
        assert "".join(pieces) == result.text == direct.text  # the cluster's own greedy answer, token for token
        # (streamed as it comes: the slow fake's first piece arrives long before its end, below; a tiny
        # model's whole answer takes milliseconds, so its deltas may merge on the way)
        assert result.usage["prompt_tokens"] == direct.usage["prompt_tokens"] > 0
        assert result.usage["completion_tokens"] == direct.usage["completion_tokens"]
        assert result.finish_reason == direct.finish_reason
        timings = result.timings
        assert 0 < timings["ttft_s"] <= timings["e2e_s"] and timings["decode_tokens_per_s"] > 0
    # a remote name in any case, and the desktop's own model beside it, unchanged
    _, upper = greedy(desktop[0], "BIG", messages=MESSAGES, max_tokens=8)
    _, direct = greedy(cluster[0], messages=MESSAGES, max_tokens=8)
    assert upper.text == direct.text


def test_tool_calls_and_response_formats_reach_the_remote(desktop) -> None:
    with Client(desktop[0]) as c:
        result = c.generate(messages=[{"role": "user", "content": "Weather in Paris?"}], model="big", stream=False,
                            temperature=0, max_tokens=64, tools=TOOLS,
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [call["name"] for call in result.tool_calls] == ["get_weather"]
    assert isinstance(json.loads(result.tool_calls[0]["arguments"]), dict)
    assert result.tool_calls[0]["id"]
    # a response format goes to the server, which constrains its own output
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    with Client(desktop[0]) as c:
        result = c.generate(messages=MESSAGES, model="big", stream=False, temperature=0, max_tokens=64,
                            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert set(json.loads(result.text)) == {"city"}


def test_openai_sdk_streams_a_local_and_a_remote_model_through_one_endpoint(cluster, desktop) -> None:
    _, info, _ = desktop
    sdk = openai.OpenAI(base_url=info["http"] + "/v1", api_key=DESKTOP_KEY, max_retries=0)
    upstream = openai.OpenAI(base_url=cluster[1]["http"] + "/v1", api_key=CLUSTER_KEY, max_retries=0)
    local_id = model_id(info["model"])
    answers = {}
    for name in ("big", local_id):
        stream = sdk.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=16, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
        answers[name] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
        assert chunks[-1].usage.completion_tokens > 0
    direct = upstream.chat.completions.create(model=model_id(cluster[1]["model"]), messages=MESSAGES, temperature=0,
                                              max_tokens=16)
    assert answers["big"] == direct.choices[0].message.content
    listed = {m.id: m.owned_by for m in sdk.models.list()}
    assert listed["big"] == "remote" and listed["dead"] == "remote" and listed[local_id] == "llmd"
    tags = httpx.get(info["http"] + "/api/tags", headers={"Authorization": f"Bearer {DESKTOP_KEY}"}).json()
    big = next(m for m in tags["models"] if m["name"] == "big:latest")
    assert big["remote_host"] == cluster[1]["http"] + "/v1" and big["remote_model"] == model_id(cluster[1]["model"])


def test_ollama_clients_reach_the_remote_model(cluster, desktop) -> None:
    client = ollama.Client(host=desktop[1]["http"], headers={"Authorization": f"Bearer {DESKTOP_KEY}"})
    assert "big:latest" in [m.model for m in client.list().models]
    assert "completion" in client.show("big").capabilities
    streamed = list(client.chat(model="big", messages=MESSAGES, options={"temperature": 0, "num_predict": 10},
                                stream=True))
    _, direct = greedy(cluster[0], messages=MESSAGES, max_tokens=10)
    assert "".join(c.message.content for c in streamed) == direct.text and streamed[-1].done
    assert streamed[-1].eval_count == direct.usage["completion_tokens"]


def test_a_cancel_closes_the_upstream_stream(cluster, desktop) -> None:
    FakeCluster.seen.clear()
    with Client(desktop[0]) as c:
        stream = c.generate(prompt="count", model="slow", max_tokens=1000)
        it = iter(stream)
        assert next(it).text == "tick "
        c.cancel(stream.request_id)
    assert wait_for(lambda: "slow:gone" in FakeCluster.seen, timeout=10)  # the fake saw its client go
    # and the real server: a long answer cancelled after its first piece stops running there
    with Client(desktop[0]) as c, Client(cluster[0]) as upstream:
        stream = c.generate(prompt="Once", model="big", max_tokens=900, ignore_eos=True, temperature=0)
        it = iter(stream)  # (kept: a stream's iterator that is dropped cancels its request)
        next(it)
        assert wait_for(lambda: upstream.stats()["num_running"] == 1, timeout=10)
        c.cancel(stream.request_id)
        assert wait_for(lambda: upstream.stats()["num_running"] == 0, timeout=10)


# (model, llmd error code, HTTP status through the desktop's OpenAI API, a word the message must hold)
ERRORS = [("dead", "remote_unreachable", 502, "cannot be reached"),
          ("big-no-key", "remote_error", 502, "API key"),
          ("fail-401", "remote_error", 502, "API key"),
          ("fail-500", "remote_error", 502, "CUDA out of memory"),
          ("fail-404", "model_not_found", 404, "404"),
          ("fail-400", "bad_request", 400, "max_tokens must be at most 100"),
          ("fail-429", "overloaded", 429, "overloaded"),
          ("hang", "remote_timeout", 504, "read_timeout"),
          ("broken", "remote_error", 502, "not JSON"),
          ("runaway", "remote_error", 502, "line of over"),
          ("cut", "remote_error", 502, "cut")]


@pytest.mark.parametrize("name,code,status,word", ERRORS, ids=[e[0] for e in ERRORS])
def test_upstream_failures_are_typed_errors(desktop, name: str, code: str, status: int, word: str) -> None:
    socket_dir, info, _ = desktop
    with Client(socket_dir) as c:
        with pytest.raises(ServerError) as e:
            c.generate(prompt="hi", model=name, stream=False, max_tokens=4)
    assert e.value.code == code and word in e.value.message
    assert CLUSTER_KEY not in e.value.message and "fake-file-key" not in e.value.message  # (fail-401 quotes it back)
    response = httpx.post(info["http"] + "/v1/chat/completions", json={"model": name, "messages": MESSAGES},
                          headers={"Authorization": f"Bearer {DESKTOP_KEY}"}, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_separators_inside_the_text_do_not_cut_its_lines(desktop) -> None:
    with Client(desktop[0]) as c:
        assert c.generate(prompt="x", model="unicode", stream=False).text == "a\u2028b\u0085c\u2029d"
        assert c.info("big")["remote"] is True and c.info()["name"] != "big"  # (one answer each)


def test_what_a_remote_model_cannot_take_is_refused(desktop) -> None:
    with Client(desktop[0]) as c:
        for kwargs, word in (({"token_ids": [1, 2, 3]}, "token ids"),
                             ({"prompt": "hi", "logprobs": 2}, "logprobs"),
                             ({"prompt": "hi", "stop_token_ids": [2]}, "stop_token_ids")):
            with pytest.raises(ServerError) as e:
                c.generate(model="big", stream=False, **kwargs)
            assert e.value.code == "bad_request" and word in e.value.message
        with pytest.raises(ServerError) as e:
            c.tokenize("hi", model="big")
        assert e.value.code == "bad_request" and "remote" in e.value.message
        assert c.generate(prompt="hi", stream=False, max_tokens=2).finish_reason  # the daemon is fine


def test_local_requests_go_on_while_remote_streams_are_slow(desktop) -> None:
    """Three slow remote streams (30 s each) in flight: a local request starts and ends meanwhile."""
    socket_dir = desktop[0]
    with Client(socket_dir) as c:
        slow = [c.generate(prompt="count", model="slow", max_tokens=1000) for _ in range(3)]
        iterators = [iter(s) for s in slow]  # (kept: a stream's iterator that is dropped cancels its request)
        for it in iterators:
            assert next(it).text == "tick "
        result = c.generate(prompt="Once upon a time", stream=False, temperature=0, max_tokens=16)
        assert result.usage["completion_tokens"] == 16
        stats = c.stats()
        rows = [r for r in _stats_rows(socket_dir) if r.get("model") == "slow"]
        assert len(rows) == 3 and all(r["state"] == "remote" and r["generated_tokens"] >= 1 for r in rows)
        for s in slow:
            c.cancel(s.request_id)
    health = {m["name"]: m for m in stats["models"] if m.get("remote")}
    assert health["big"]["health"] == "ok" and health["slow"]["health"] == "ok"
    assert health["dead"]["health"] == "failing" and "cannot be reached" in health["dead"]["health_detail"]


def _stats_rows(socket_dir: Path) -> list[dict]:
    """The request table of the next published stats (what `llmd chat`'s dashboard draws)."""
    with Client(socket_dir) as c:
        for stats in c.subscribe_stats(timeout=10):
            if stats.get("requests"):
                return stats["requests"]
    return []


def test_listings_show_the_remote_models_never_their_keys(cluster, desktop) -> None:
    socket_dir, info, env = desktop
    run = [sys.executable, "-m", "llmd"]
    models = subprocess.run([*run, "models", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert models.returncode == 0, models.stderr
    remote = {m["name"]: m for m in json.loads(models.stdout) if m["source"] == "remote"}
    assert remote["big"]["url"] == cluster[1]["http"] + "/v1"  # (the trailing / of the table's url dropped)
    assert set(remote) >= {"big", "dead", "slow", "hang"}
    table = subprocess.run([*run, "models"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "remote: " in table and "big" in table
    status = subprocess.run([*run, "status", "--socket-dir", str(socket_dir)], capture_output=True, text=True,
                            env=env, timeout=60).stdout
    assert "big (remote at " in status
    with Client(socket_dir) as c:
        shown = json.dumps([c.info(), c.info("big"), c.stats()])
    log = Path(info["log_file"]).read_text()
    for text in (models.stdout, table, status, shown, log):
        assert CLUSTER_KEY not in text and "fake-file-key" not in text
    assert "Bearer fake-file-key" in FakeCluster.auth  # (the file's key did reach its server)


def test_a_remote_whose_key_is_unset_stops_the_start_in_one_line(model_dir: Path, tmp: Path) -> None:
    home = tmp / "no-key"
    (home / "config" / "llmd").mkdir(parents=True)
    (home / "config" / "llmd" / "config.toml").write_text(
        '[remote."big"]\nurl = "http://127.0.0.1:1/v1"\napi_key_env = "LLMD_TEST_UNSET_KEY"\n')
    proc = subprocess.run([sys.executable, "-m", "llmd", "start", "--foreground", "--model", str(model_dir),
                           "--socket-dir", str(tmp / "no-key-run")], capture_output=True, text=True,
                          env=daemon_env(home), timeout=120)
    assert proc.returncode != 0
    assert "$LLMD_TEST_UNSET_KEY" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.asyncio
async def test_llmd_chat_talks_to_a_remote_model_and_its_dashboard_shows_it(cluster, desktop, tmp_path: Path) -> None:
    """`llmd chat --model big` against the desktop: the cluster's answer streams into the chat, the
    request table shows it as a remote request, and the model line names the remote and its health."""
    from llmd.client import AsyncClient
    from llmd.tui.app import ChatApp
    from llmd.tui.chat_view import ChatMessage, PromptInput
    from llmd.tui.conversation import ChatSettings, ConversationStore
    from llmd.tui.dashboard import Dashboard

    question = "What is the capital of France?"
    _, direct = greedy(cluster[0], messages=[{"role": "user", "content": question}], max_tokens=60, ignore_eos=True)
    async with AsyncClient(socket_dir=desktop[0]) as client:
        app = ChatApp(client, ConversationStore(tmp_path / "chats"), model="big")
        async with app.run_test(size=(160, 48)) as pilot:
            dashboard = app.query_one(Dashboard)
            dashboard.redraw_interval_s = 0
            rows: list[dict] = []
            update = dashboard.update_stats

            def record(stats: dict, own_ids: set[str]) -> None:
                rows.extend(r for r in stats.get("requests") or [] if r.get("id") in own_ids)
                update(stats, own_ids)

            dashboard.update_stats = record
            await _until(pilot, lambda: app.last_stats)  # subscribed
            app.conversation.settings = ChatSettings(temperature=0.0, max_tokens=60, model="big")
            app.client.chat = _no_eos(app.client.chat)
            app.query_one(PromptInput).insert(question)
            await pilot.press("enter")
            await _until(pilot, lambda: app.answer_worker is not None and not app.answer_worker.is_running)
            answer = app.conversation.messages[-1]
            assert answer == {"role": "assistant", "content": direct.text}  # the cluster's own greedy answer
            assert app.query(ChatMessage).last().source == direct.text
            assert rows and all(r["state"] == "remote" and r["model"] == "big" for r in rows)
            assert "big (remote, ok)" in str(app.query_one("#model-line").render())


def _no_eos(chat):
    """The random tiny model may end at once: a fixed length, as the direct request above."""
    def wrapped(messages, **kwargs):
        return chat(messages, ignore_eos=True, **kwargs)
    return wrapped


async def _until(pilot, predicate, timeout: float = 60.0) -> None:
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await pilot.pause(0.02)


def test_llmd_generate_names_a_remote_model(cluster, desktop) -> None:
    socket_dir, _, env = desktop
    argv = [sys.executable, "-m", "llmd", "generate", "--socket-dir", str(socket_dir), "--model", "big",
            "--temperature", "0", "--max-tokens", "12", "--raw", "Once upon a time"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _, direct = greedy(cluster[0], prompt="Once upon a time", max_tokens=12)
    assert proc.stdout == direct.text + "\n"
    # with no daemon to forward it, one line says so
    gone = subprocess.run([*argv[:5], str(socket_dir.parent / "no-daemon"), *argv[6:]], capture_output=True,
                          text=True, env=env, timeout=60)
    assert gone.returncode != 0 and "remote model" in gone.stderr and "Traceback" not in gone.stderr
