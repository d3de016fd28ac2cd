"""Several models on one daemon (daemon/model_set.py): a request names its model and the daemon
loads it on demand, serves both models at once, unloads the least recently used idle one when
`max_loaded_models` are loaded, and answers a name it cannot serve with `model_not_found`."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon_helpers import daemon_env, start_daemon, stop_daemon
from tiny_models import make_hf_model, save_hf_model

from llmd.client import Client, ServerError
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.daemon.quantization import QuantConfig
from llmd.daemon.reference_generator import Generator

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"a": save_hf_model(make_hf_model("llama", seed=0), root / "a", with_tokenizer=True),
            "b": save_hf_model(make_hf_model("qwen2", seed=1), root / "b", with_tokenizer=True)}


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[str, list[int]]:
    # The daemon's default --quant auto holds these float checkpoints as INT4 g32: so must the reference.
    out = {}
    for name, d in dirs.items():
        gen = Generator(load_model(resolve_model(d), quant=QuantConfig("auto")).model)
        out[name] = list(gen.stream(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    assert out["a"] != out["b"]
    return out


def greedy(client: Client, model: str | None = None, **kwargs) -> list[int]:
    result = client.generate(token_ids=PROMPT, stream=False, max_tokens=12, temperature=0, ignore_eos=True,
                             model=model, **kwargs)
    return result.token_ids


def states(client: Client) -> dict[str, str]:
    return {m["name"]: m["state"] for m in client.stats()["models"]}


def test_two_models_at_once_and_names_it_cannot_serve(dirs, reference, tmp_path: Path) -> None:
    env = daemon_env(tmp_path)
    socket_dir = tmp_path / "run"
    conn = start_daemon(dirs["a"], socket_dir, "--max-loaded-models", "2", "--http", "127.0.0.1:0", env=env)
    try:
        with Client(socket_dir) as c:
            assert greedy(c) == reference["a"]  # no model named: the default
            assert greedy(c, str(dirs["a"])) == reference["a"]  # named as it was started
            assert states(c) == {str(dirs["a"]): "loaded"}
            b = c.generate(token_ids=PROMPT, stream=False, max_tokens=12, temperature=0, ignore_eos=True,
                           model=str(dirs["b"]))
            assert b.token_ids == reference["b"] and b.timings["queue_s"] > 0  # it waited for the load
            assert states(c) == {str(dirs["a"]): "loaded", str(dirs["b"]): "loaded"}
            info = c.info(model=str(dirs["b"]))
            assert info["model_type"] == "qwen2" and info["name"] == str(dirs["b"])
            assert c.info()["model_type"] == "llama" and c.info()["max_loaded_models"] == 2
            assert c.tokenize("hello", model=str(dirs["b"])) == c.tokenize("hello")  # (the same tiny tokenizer)

            # both at once, from two threads: each its own model's tokens
            got: dict[str, list[int]] = {}

            def run(name: str) -> None:
                with Client(socket_dir) as own:
                    got[name] = [greedy(own, str(dirs[name])) for _ in range(3)]

            threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert got == {"a": [reference["a"]] * 3, "b": [reference["b"]] * 3}

            for bad, words in ((str(tmp_path / "nowhere"), "not found"), ("org/not-cached", "llmd pull"),
                               (42, "model must be a name")):
                with pytest.raises(ServerError) as e:
                    c.generate(token_ids=PROMPT, stream=False, max_tokens=2, model=bad)
                assert e.value.code == ("bad_request" if bad == 42 else "model_not_found") and words in str(e.value)
            with pytest.raises(ServerError, match="not loaded here"):
                c.info(model="org/not-cached")
            assert greedy(c) == reference["a"]  # nothing of that disturbed anyone

        # the HTTP APIs name models the same way: OpenAI's `model`, Ollama's (its ":latest" dropped)
        import httpx
        import openai

        sdk = openai.OpenAI(base_url=conn["http"] + "/v1", api_key="none", max_retries=0)
        ids = [m.id for m in sdk.models.list().data]
        assert len(ids) == 2 and ids[1] == str(dirs["b"])
        out = sdk.completions.create(model=str(dirs["b"]), prompt="Say hi", max_tokens=12, temperature=0)
        assert out.model == str(dirs["b"]) and out.choices[0].text
        with Client(socket_dir) as c:  # the same through the socket: b's answer, not a's
            want = c.generate(prompt="Say hi", stream=False, max_tokens=12, temperature=0, model=str(dirs["b"]))
            other = c.generate(prompt="Say hi", stream=False, max_tokens=12, temperature=0)
        assert out.choices[0].text == want.text != other.text
        with pytest.raises(openai.NotFoundError, match="not found"):
            sdk.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        ps = httpx.get(conn["http"] + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in ps][1:] == [f"{dirs['b']}:latest"]
        reply = httpx.post(conn["http"] + "/api/generate", json={
            "model": f"{dirs['b']}:latest", "prompt": "Say hi", "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 12}}, timeout=60).json()
        assert reply["response"] == want.text
    finally:
        stop_daemon(socket_dir, env)


def test_at_most_max_loaded_models_the_least_recently_used_idle_one_makes_room(dirs, reference,
                                                                               tmp_path: Path) -> None:
    env = daemon_env(tmp_path)
    socket_dir = tmp_path / "run"
    start_daemon(dirs["a"], socket_dir, "--max-loaded-models", "1", env=env)
    a, b = str(dirs["a"]), str(dirs["b"])
    try:
        with Client(socket_dir) as c:
            assert greedy(c, b) == reference["b"]
            assert states(c) == {a: "unloaded", b: "loaded"}  # a made room
            status = subprocess.run([sys.executable, "-m", "llmd", "status", "--socket-dir", str(socket_dir)],
                                    capture_output=True, text=True, timeout=60, env=env).stdout
            assert f"models      {a} (unloaded, default), {b} (loaded); at most 1 loaded at once" in status
            assert greedy(c) == reference["a"]  # a again: loaded back, b unloaded for it
            assert states(c) == {a: "loaded", b: "unloaded"}
            assert greedy(c, b) == reference["b"]
            # `llmd generate --model` through the daemon: it serves b rather than loading b in its own process
            out = subprocess.run([sys.executable, "-m", "llmd", "generate", "hello", "--model", b, "--raw",
                                  "--max-tokens", "6", "--temperature", "0", "--socket-dir", str(socket_dir)],
                                 capture_output=True, text=True, timeout=60, env=env)
            assert out.returncode == 0 and "in this process" not in out.stderr, out.stderr
            want = c.generate(prompt="hello", stream=False, max_tokens=6, temperature=0, model=b)
            assert out.stdout == want.text + "\n"
            # a stream of a in flight: b's request waits for it to finish, then a makes room
            stream = c.generate(token_ids=PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
            deltas = iter(stream)
            first = next(deltas)
            assert first.token_ids
            assert greedy(c, b) == reference["b"]
            assert sum(len(d.token_ids) for d in deltas) + len(first.token_ids) == 200
            assert stream.result.finish_reason == "length" and stream.result.token_ids[:12] == reference["a"]
    finally:
        stop_daemon(socket_dir, env)
