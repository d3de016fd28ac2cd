"""The daemon for real: `llmd start` in a temp runtime dir on a tiny model, clients in other
processes, faults injected from outside."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_helpers import (
    client_process, daemon_env, fault_env, start_daemon, stop_daemon, wait_for, wait_gone,
)
from tiny_models import make_hf_model, save_hf_model

from llmd.client import Client, DaemonNotRunningError, ServerError
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model
from llmd.daemon.quantization import QuantConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("daemon")


@pytest.fixture(scope="module")
def model_dir(tmp: Path) -> Path:
    # A long context so a stream can run for seconds (to be killed or stopped mid-way).
    return save_hf_model(make_hf_model("llama", max_position_embeddings=4096), tmp / "model", with_tokenizer=True)


@pytest.fixture(scope="module")
def env(tmp: Path) -> dict[str, str]:
    return daemon_env(tmp)


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp: Path, env: dict[str, str]):
    socket_dir = tmp / "run"
    conn = start_daemon(model_dir, socket_dir, "--max-num-seqs", "32", env=env)
    yield socket_dir, conn
    stop_daemon(socket_dir, env)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    # The daemon's default --quant auto holds this float checkpoint as INT4 g32: so must the reference.
    gen = Generator(load_model(resolve_model(model_dir), quant=QuantConfig("auto")).model)

    def greedy(ids: list[int], n: int) -> list[int]:
        return list(gen.stream(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    return greedy


def prompt(i: int) -> list[int]:
    return [(i * 37 + k * 11) % 250 for k in range(5 + 3 * i)]


def stats(socket_dir: Path) -> dict:
    with Client(socket_dir) as c:
        return c.stats()


def test_files_are_private_and_no_inet_listener(daemon) -> None:
    import psutil

    socket_dir, conn = daemon
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((socket_dir / "daemon.json").stat().st_mode) == 0o600
    assert psutil.Process(conn["pid"]).net_connections(kind="inet") == []
    assert conn["requests"].startswith("ipc://") and "tcp_requests" not in conn


def test_status_command(daemon, env) -> None:
    socket_dir, conn = daemon
    out = subprocess.run([sys.executable, "-m", "llmd", "status", "--json", "--socket-dir", str(socket_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0
    status = json.loads(out.stdout)
    assert status["running"] and status["pid"] == conn["pid"] and status["stats"]["num_blocks"] > 0
    assert status["device"] == "cpu" and status["attention"] == "cpu"
    assert status["stats"]["rss_bytes"] > 0 and status["kv_cache_bytes"] > 0
    out = subprocess.run([sys.executable, "-m", "llmd", "status", "--socket-dir", str(socket_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    pool = status["kv_cache_bytes"] / 2**20
    assert f"MiB resident; the KV pool reserves {pool:.0f} MiB, resident as its blocks fill" in out.stdout


def test_stream_matches_in_process(daemon, reference) -> None:
    socket_dir, _ = daemon
    with Client(socket_dir) as c:
        stream = c.generate(token_ids=prompt(3), max_tokens=20, temperature=0, ignore_eos=True)
        tokens = [t for d in stream for t in d.token_ids]
        assert stream.result.finish_reason == "length" and stream.result.usage["completion_tokens"] == 20
        assert tokens == reference(prompt(3), 20)
        whole = c.generate(token_ids=prompt(3), max_tokens=20, temperature=0, ignore_eos=True, stream=False)
        assert whole.token_ids == tokens


def test_sixteen_client_processes_get_their_own_tokens(daemon, reference, env) -> None:
    socket_dir, _ = daemon
    procs = [client_process(socket_dir, prompt(i), 24, env) for i in range(16)]
    outs = [p.communicate(timeout=120) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == reference(prompt(i), 24)


def test_killed_client_has_its_blocks_freed(daemon, env) -> None:
    socket_dir, _ = daemon
    victim = client_process(socket_dir, prompt(1), 3500, env)
    assert victim.stdout.readline().startswith("delta")  # it is streaming
    assert stats(socket_dir)["num_running"] == 1
    with Client(socket_dir) as other:
        stream = other.generate(token_ids=prompt(2), max_tokens=3000, temperature=0, ignore_eos=True)
        it = iter(stream)
        next(it)
        victim.kill()
        victim.wait()
        assert wait_for(lambda: stats(socket_dir)["num_running"] == 1, timeout=5), "victim not aborted"
        other.cancel(stream.request_id)
    assert wait_for(lambda: stats(socket_dir)["num_blocks_used"] == 0, timeout=5)


def test_stopped_client_does_not_stall_others(daemon, reference, env) -> None:
    socket_dir, _ = daemon
    sleeper = client_process(socket_dir, prompt(4), 3500, env)
    try:
        assert sleeper.stdout.readline().startswith("delta")
        os.kill(sleeper.pid, signal.SIGSTOP)
        start = time.monotonic()
        with Client(socket_dir) as c:
            result = c.generate(token_ids=prompt(5), max_tokens=40, temperature=0, ignore_eos=True, stream=False)
        assert result.token_ids == reference(prompt(5), 40)
        assert time.monotonic() - start < 20
    finally:
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.wait()
    assert wait_for(lambda: stats(socket_dir)["num_blocks_used"] == 0, timeout=5)


def test_cancel_mid_stream_frees_blocks(daemon) -> None:
    socket_dir, _ = daemon
    with Client(socket_dir) as c:
        stream = c.generate(token_ids=prompt(6), max_tokens=3000, temperature=0, ignore_eos=True)
        it = iter(stream)
        for _ in range(3):
            next(it)
        assert c.stats()["num_blocks_used"] > 0
        c.cancel(stream.request_id)
        assert c.stats()["num_blocks_used"] == 0
        with pytest.raises(ServerError, match="unknown_request"):
            c.cancel(stream.request_id)


def test_clients_cannot_touch_each_others_requests(daemon) -> None:
    socket_dir, _ = daemon
    with Client(socket_dir) as a, Client(socket_dir) as b:
        stream = a.generate(token_ids=prompt(7), max_tokens=2000, temperature=0, ignore_eos=True, request_id="shared")
        it = iter(stream)
        next(it)
        with pytest.raises(ServerError, match="unknown_request"):
            b.cancel("shared")
        # b may use the same request id for its own request without disturbing a's.
        own = b.generate(token_ids=prompt(8), max_tokens=5, temperature=0, request_id="shared", stream=False)
        assert len(own.token_ids) >= 1
        next(it)
        a.cancel("shared")


def test_too_long_and_bad_params_are_typed_errors(daemon) -> None:
    socket_dir, _ = daemon
    with Client(socket_dir) as c:
        with pytest.raises(ServerError, match="too_long"):
            c.generate(token_ids=[1] * 4000, max_tokens=200, stream=False)
        with pytest.raises(ServerError, match="bad_request"):
            c.generate(token_ids=[1, 2], temperature=-1, stream=False)
        with pytest.raises(ServerError, match="bad_request"):
            c.generate(token_ids=[1, 99999], stream=False)  # out of vocabulary
        with pytest.raises(ServerError, match="bad_request"):
            c.generate(token_ids=[1, 2], no_such_param=1, stream=False)
        for priority in (11, True, "1"):
            with pytest.raises(ServerError, match=r"priority must be an integer from -10 to 10.*\(bad_request\)"):
                c.generate(token_ids=[1, 2], priority=priority, stream=False)
        assert c.generate(token_ids=[1, 2], max_tokens=3, stream=False).finish_reason in ("stop", "length")


def test_context_limit_fits_max_tokens_and_detokenize(daemon, model_dir) -> None:
    socket_dir, _ = daemon
    with Client(socket_dir) as c:
        # max_tokens as large as the context: lowered to what fits after the 20-token prompt
        r = c.generate(token_ids=prompt(5), max_tokens=4096, context_limit=30, temperature=0, ignore_eos=True,
                       stream=False)
        assert r.finish_reason == "length" and r.usage["completion_tokens"] == 30 - len(prompt(5))
        with pytest.raises(ServerError, match=r"context holds 10.*\(too_long\)"):
            c.generate(token_ids=prompt(5), context_limit=10, stream=False)
        for bad in (1, True, "30"):
            with pytest.raises(ServerError, match=r"context_limit must be an integer >= 2.*\(bad_request\)"):
                c.generate(token_ids=[1, 2], context_limit=bad, stream=False)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = tok.encode("héllo <|im_start|>")
        assert c.detokenize(ids) == [tok.decode([t]) for t in ids]
        assert "".join(c.detokenize(ids)) != "" and len(c.detokenize(ids)) == len(ids)
        for bad in ([], [-1], [1.5], list(range(5000))):
            with pytest.raises(ServerError, match="bad_request"):
                c.detokenize(bad)


def test_second_daemon_is_refused(daemon, model_dir, env) -> None:
    socket_dir, conn = daemon
    proc = subprocess.run([sys.executable, "-m", "llmd", "start", "--model", str(model_dir), "--socket-dir",
                           str(socket_dir), "--foreground"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert f"already running (pid {conn['pid']}" in proc.stderr
    assert stats(socket_dir)["num_blocks"] > 0  # the first one is untouched


def test_stale_files_are_cleaned_and_sigterm_drains(model_dir, tmp, env) -> None:
    socket_dir = tmp / "stale"
    conn = start_daemon(model_dir, socket_dir, env=env)
    os.kill(conn["pid"], signal.SIGKILL)
    assert wait_gone(conn["pid"])
    assert (socket_dir / "daemon.json").exists()  # left behind by the killed daemon
    with pytest.raises(DaemonNotRunningError):
        Client(socket_dir)
    # A foreground daemon takes over the stale files ...
    proc = subprocess.Popen([sys.executable, "-m", "llmd", "start", "--foreground", "--model", str(model_dir),
                             "--socket-dir", str(socket_dir), "--dtype", "float32", "--quant", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert wait_for(lambda: _pid_in_file(socket_dir) == proc.pid, timeout=120)
    with Client(socket_dir) as c:
        c.health()
        stream = c.generate(token_ids=prompt(2), max_tokens=300, temperature=0, ignore_eos=True)
        it = iter(stream)
        next(it)
        # ... and drains on SIGTERM: the stream still completes (dense weights, so 300 tokens take well
        # under the 10 s drain limit even on a busy machine)
        proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert stream.result is not None and stream.result.finish_reason == "length"
        assert 1 + sum(len(d.token_ids) for d in rest) == 300
    assert proc.wait(timeout=30) == 0
    assert not (socket_dir / "daemon.json").exists()


def _pid_in_file(socket_dir: Path) -> int | None:
    try:
        return json.loads((socket_dir / "daemon.json").read_text())["pid"]
    except (OSError, ValueError):
        return None


def test_overloaded_and_injected_step_failure(model_dir, tmp) -> None:
    socket_dir = tmp / "faulty"
    # NOTE: the fault must come well after the next two requests arrive: at step 40 (~40 ms of tiny-model
    # steps) a loaded CI machine once let it fire first, emptying the queue the overload check needs.
    # And the first request must still run then: with speculation a tiny model's repetitive greedy output
    # took up to 8 tokens a step, and a fresh-clone run once saw its 3000 tokens done before the third
    # request came (no overload). Without it, 3000 tokens are 3000 steps, past the fault at step 1000.
    env = fault_env(daemon_env(tmp), LLMD_TEST_FAULT_STEP="1000")
    start_daemon(model_dir, socket_dir, "--max-num-seqs", "1", "--max-queue-len", "1", "--speculative", "off",
                 env=env)
    try:
        with Client(socket_dir) as c:
            first = iter(c.generate(token_ids=prompt(1), max_tokens=3000, temperature=0, ignore_eos=True))
            next(first)  # running
            queued = c.generate(token_ids=prompt(2), max_tokens=10, temperature=0, ignore_eos=True)  # waiting
            with pytest.raises(ServerError, match="overloaded"):
                c.generate(token_ids=prompt(3), max_tokens=10, stream=False)
            # Step 1000 raises inside the daemon: both in-flight requests get an internal error ...
            with pytest.raises(ServerError, match="internal"):
                list(first)
            with pytest.raises(ServerError, match="internal"):
                list(queued)
            # ... and the daemon recovers.
            assert c.stats()["num_step_failures"] == 1
            assert c.generate(token_ids=prompt(4), max_tokens=5, stream=False).finish_reason in ("stop", "length")
            assert c.stats()["num_blocks_used"] == 0
    finally:
        stop_daemon(socket_dir, env)


def test_async_client_streams_and_subscribes(daemon, reference) -> None:
    import asyncio

    from llmd.client import AsyncClient, Result

    socket_dir, _ = daemon

    async def main() -> tuple[list[int], Result, dict]:
        async with AsyncClient(socket_dir) as c:
            tokens, result = [], None
            async for item in c.generate(token_ids=prompt(9), max_tokens=12, temperature=0, ignore_eos=True):
                if isinstance(item, Result):
                    result = item
                else:
                    tokens.extend(item.token_ids)
            async for s in c.subscribe_stats():
                return tokens, result, s
        raise AssertionError("unreachable")

    tokens, result, published = asyncio.run(asyncio.wait_for(main(), 60))
    assert tokens == reference(prompt(9), 12) and result.finish_reason == "length"
    assert published["num_blocks"] > 0 and "decode_tokens_per_s" in published


def test_async_client_has_the_sync_clients_calls(daemon) -> None:
    """One core, one set of calls: the asyncio client tokenizes, answers ``stream=False`` with the
    Result, and ``cancel`` waits for the request's end, as the blocking one does."""
    import asyncio

    from llmd.client import AsyncClient

    socket_dir, _ = daemon
    with Client(socket_dir) as c:
        want_ids = c.tokenize("Hello world")
        want = c.generate(token_ids=prompt(11), max_tokens=6, temperature=0, ignore_eos=True, stream=False)

    async def main() -> tuple[list[int], object, dict, str]:
        async with AsyncClient(socket_dir) as c:
            ids = await c.tokenize("Hello world")
            result = await c.generate(token_ids=prompt(11), max_tokens=6, temperature=0, ignore_eos=True,
                                      stream=False)
            health = await c.health()
            stream = c.generate(token_ids=prompt(12), max_tokens=3000, ignore_eos=True, request_id="long")
            await stream.__anext__()  # running
            await c.cancel("long")  # returns once it has ended ...
            with pytest.raises(ServerError) as err:  # ... so it is not running any more
                await c.cancel("long")
            await stream.aclose()
            return ids, result, health, err.value.code

    ids, result, health, code = asyncio.run(asyncio.wait_for(main(), 60))
    assert ids == want_ids and result.token_ids == want.token_ids and result.finish_reason == "length"
    assert health["status"] == "ok" and code == "unknown_request"


CLIENT_SIDE_IMPORTS = """
import json, sys
from llmd.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "triton")
               or m.startswith(("llmd.daemon", "llmd.quant", "llmd.kernels.")) and m != "llmd.kernels.cpu_profile")
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("command", [["status"], ["generate", "hi", "--raw", "--max-tokens", "3"]], ids=str)
def test_client_commands_never_load_the_runtime(daemon, env, command: list[str]) -> None:
    """`llmd status` and `llmd generate` with a daemon running talk to it and import neither
    torch nor the runtime: they answer in the time of the request, not of an import."""
    socket_dir, _ = daemon
    out = subprocess.run([sys.executable, "-c", CLIENT_SIDE_IMPORTS, *command, "--socket-dir", str(socket_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    report = json.loads(out.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}, out.stderr[-2000:]


def test_generate_command_uses_the_daemon(daemon, env) -> None:
    socket_dir, _ = daemon
    before = stats(socket_dir)["num_generated_tokens_total"]
    out = subprocess.run([sys.executable, "-m", "llmd", "generate", "hello", "--raw", "--max-tokens", "7",
                          "--temperature", "0", "--socket-dir", str(socket_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "no llmd daemon is running" not in out.stderr
    assert stats(socket_dir)["num_generated_tokens_total"] >= before + 1


def test_the_models_config_table_sets_its_context_and_sampling_defaults(model_dir, tmp) -> None:
    """The daemon serves its model with the model's [models."NAME"] table: the context it says and its
    sampling defaults for what a request leaves out (a request's own values win); `llmd generate`
    through it takes them too."""
    env = daemon_env(tmp / "tabled")
    (tmp / "tabled" / "config" / "llmd").mkdir(parents=True)
    (tmp / "tabled" / "config" / "llmd" / "config.toml").write_text(
        f'[models."{model_dir}"]\nmax_model_len = 96\nmax_tokens = 5\ntemperature = 0.0\n'
        'repetition_penalty = 1.3\n')
    socket_dir = tmp / "tabled" / "run"
    conn = start_daemon(model_dir, socket_dir, env=env)
    try:
        assert conn["sampling_defaults"] == {"max_tokens": 5, "temperature": 0.0, "repetition_penalty": 1.3}
        with Client(socket_dir) as c:
            assert c.info()["max_model_len"] == 96
            plain = [c.generate(token_ids=prompt(3), stream=False) for _ in range(2)]
            own = c.generate(token_ids=prompt(3), stream=False, max_tokens=5, temperature=0, repetition_penalty=1.3)
            assert plain[0].token_ids == plain[1].token_ids == own.token_ids and len(own.token_ids) == 5
            assert len(c.generate(token_ids=prompt(3), stream=False, max_tokens=3).token_ids) == 3
            one = c.generate(token_ids=prompt(3), stream=False, repetition_penalty=1.0, ignore_eos=True)
            assert len(one.token_ids) == 5  # its own value for one field, the defaults for the rest
            with pytest.raises(ServerError, match="too_long|96"):
                c.generate(token_ids=list(range(3, 100)), stream=False)
        out = subprocess.run([sys.executable, "-m", "llmd", "generate", "hello", "--raw", "--socket-dir",
                              str(socket_dir)], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and "no llmd daemon is running" not in out.stderr, out.stderr
    finally:
        stop_daemon(socket_dir, env)


def test_commands_without_a_daemon(tmp, env) -> None:
    empty = tmp / "nobody"
    for cmd, code, text in ((["status"], 3, "not running"), (["stop"], 1, "no llmd daemon is running")):
        out = subprocess.run([sys.executable, "-m", "llmd", *cmd, "--socket-dir", str(empty)],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == code and text in (out.stdout + out.stderr)
        assert "Traceback" not in out.stderr


def test_tcp_is_opt_in_loopback_and_signed(model_dir, tmp, env) -> None:
    import socket

    import psutil

    with socket.socket() as s:  # a free port pair
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    socket_dir = tmp / "tcp"
    conn = start_daemon(model_dir, socket_dir, "--tcp", f"127.0.0.1:{port}", env=env)
    try:
        listening = {c.laddr for c in psutil.Process(conn["pid"]).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert {(a.ip, a.port) for a in listening} == {("127.0.0.1", port), ("127.0.0.1", port + 1)}
        with Client(connection=conn, endpoint="tcp_requests") as c:
            assert c.generate(token_ids=[1, 2, 3], max_tokens=4, stream=False).finish_reason in ("stop", "length")
        forged = dict(conn, key="00" * 32)  # right address, wrong key: never answered
        with Client(connection=forged, endpoint="tcp_requests") as c:
            with pytest.raises(DaemonNotRunningError):
                c.health(timeout=1.0)
    finally:
        stop_daemon(socket_dir, env)
