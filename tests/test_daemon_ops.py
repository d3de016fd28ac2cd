"""The daemon as a desktop service runs it: settings from the config file, a rotated log file that
`llmd logs` reads, and the idle unload (memory handed back, the next request reloads and waits)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from llmd.client import Client, ServerError
from daemon_helpers import daemon_env, start_daemon, stop_daemon, wait_for
from tiny_models import make_hf_model, save_hf_model

pytestmark = pytest.mark.slow

IDLE_MINUTES = 0.05  # 3 s: long enough that a loaded machine does not unload before the first request
PROMPT = [5, 17, 33, 2, 91, 40, 8]


def _greedy(client: Client) -> tuple[list[int], dict]:
    result = client.generate(token_ids=PROMPT, stream=False, temperature=0, max_tokens=12, ignore_eos=True)
    return result.token_ids, result.timings


def _llmd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd", *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def setup(tmp_path: Path):
    # A long context, or the pool would be capped at what max_num_seqs full contexts can use.
    model_dir = save_hf_model(make_hf_model("llama", max_position_embeddings=65536), tmp_path / "model",
                              with_tokenizer=True)
    env = daemon_env(tmp_path)
    config = tmp_path / "config" / "llmd" / "config.toml"
    config.parent.mkdir(parents=True)
    # NOTE: a KV pool far bigger than the whole process, so whether its pages are resident shows in the RSS.
    config.write_text(f"idle_unload = {IDLE_MINUTES}\nkv_cache_mb = 2048\nmax_queue_len = 7\n")
    socket_dir = tmp_path / "run"
    yield model_dir, socket_dir, env, tmp_path
    stop_daemon(socket_dir, env)


def test_idle_unload_frees_memory_and_the_next_request_reloads(setup) -> None:
    """Memory follows use: the KV pool's 2 GiB are reserved, not resident (the whole daemon stays
    under 1 GiB); an idle unload frees the model, and the next request loads it again."""
    model_dir, socket_dir, env, tmp = setup
    conn = start_daemon(model_dir, socket_dir, env=env)
    daemon = psutil.Process(conn["pid"])
    with Client(socket_dir) as client:
        info = client.info()
        assert info["idle_unload_s"] == pytest.approx(60 * IDLE_MINUTES)  # from the config file
        assert info["max_queue_len"] == 7
        # fp32 K and V of 2 layers x 2 KV heads x 16 dims per token: the 2 GiB the config file asks for
        assert info["num_blocks"] * info["block_size"] * (2 * 2 * 2 * 16 * 4) == 2048 * 2**20
        assert info["kv_cache_bytes"] == 2048 * 2**20
        before, _ = _greedy(client)
        rss_loaded = daemon.memory_info().rss
        assert rss_loaded < 2**30, rss_loaded  # (a zeroed pool: over 2 GiB)
        assert client.stats()["rss_bytes"] == pytest.approx(rss_loaded, rel=0.25)
        stats = client.stats()
        # NOTE: counted from here: on a loaded machine the window may already have passed once
        # between the start and the first request (that request then reloaded the model).
        assert stats["model_state"] == "loaded"
        unloads = stats["num_unloads"]
        assert wait_for(lambda: client.stats()["model_state"] == "unloaded", timeout=30, interval=0.2)
        rss_unloaded = daemon.memory_info().rss
        assert rss_unloaded <= rss_loaded, (rss_loaded, rss_unloaded)

        status = _llmd(env, "status", "--socket-dir", str(socket_dir))
        assert f"state       unloaded after {IDLE_MINUTES:g} min without requests" in status.stdout, status.stdout

        after, timings = _greedy(client)
        assert after == before  # the reload is the same model
        stats = client.stats()
        assert stats["model_state"] == "loaded" and stats["num_unloads"] == unloads + 1
        assert timings["queue_s"] > 0.05  # it waited for the reload, and says so
    assert daemon.memory_info().rss < 2**30  # reloaded: the new pool is reserved, not resident, too

    log = _llmd(env, "logs", "-n", "200", "--socket-dir", str(socket_dir))
    assert log.returncode == 0, log.stderr
    assert "unloaded the model and KV cache" in log.stdout and "model loaded again" in log.stdout
    assert str(tmp / "state" / "llmd" / "llmd.log") == json.loads((socket_dir / "daemon.json").read_text())["log_file"]


def test_a_failed_reload_is_a_typed_error_and_the_daemon_stays_up(setup) -> None:
    model_dir, socket_dir, env, tmp = setup
    start_daemon(model_dir, socket_dir, env=env)
    with Client(socket_dir) as client:
        before, _ = _greedy(client)
        assert wait_for(lambda: client.stats()["model_state"] == "unloaded", timeout=30, interval=0.2)
        hidden = model_dir.rename(tmp / "moved")  # the model's files are gone while it is unloaded
        with pytest.raises(ServerError) as err:
            _greedy(client)
        assert err.value.code == "internal" and "reloading the model failed" in str(err.value)
        assert client.stats()["model_state"] == "unloaded"
        hidden.rename(model_dir)
        assert _greedy(client)[0] == before  # the next request tries again


def test_background_start_reports_progress_without_timestamps(setup) -> None:
    """What `llmd chat --start` shows while the daemon loads: the daemon's log lines, as written
    to the rotated log but without their timestamps."""
    model_dir, socket_dir, env, tmp = setup
    # NOTE: in a child process, as `llmd chat` runs it: the daemon must not be a child of pytest,
    # or it would stay a zombie after `llmd stop` until pytest reaps it.
    script = ("import json, sys\nfrom llmd.cli import build_parser\n"
              "from llmd.commands.daemon_process import start_background\nlines = []\n"
              "start_background(build_parser().parse_args(sys.argv[1:]), progress=lines.append)\n"
              "print(json.dumps(lines))\n")
    out = subprocess.run([sys.executable, "-c", script, "start", "--socket-dir", str(socket_dir), "--model",
                          str(model_dir), "--dtype", "float32"], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = json.loads(out.stdout.splitlines()[-1])
    assert lines and all(line.startswith("llmd: ") for line in lines), lines
    log = (tmp / "state" / "llmd" / "llmd.log").read_text()
    assert " llmd: serving " in log  # the file itself keeps them


def test_background_start_checks_its_flags_without_the_runtime() -> None:
    """`llmd start` checks its flags, starts the daemon and waits for it: importing the runtime
    there (torch, transformers) cost ~2 s of every start before the daemon even began its own."""
    code = (
        "import json, sys\n"
        "import llmd.commands.start as start\n"
        "start.start_background = lambda args, settings: print(json.dumps("
        "[m for m in ('torch', 'transformers') if m in sys.modules])) or 0\n"
        "from llmd.cli import main\n"
        "sys.exit(main(['start', '--tcp', '127.0.0.1:7999', '--quant', 'int4', '--group-size', '64']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    bad = subprocess.run([sys.executable, "-m", "llmd", "start", "--quant", "none", "--group-size", "64"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.strip() == "llmd: error: --group-size does not apply to --quant none"
