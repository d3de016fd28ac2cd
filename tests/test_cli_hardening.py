"""The CLI against what a user can throw at it: prompts that are not UTF-8 or are too large for one
message, integer and float flags outside what the daemon takes, and a daemon that is alive but
does not answer (`llmd status` says so, `llmd stop --force` ends it and its files)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_helpers import daemon_env, start_daemon, stop_daemon, wait_gone
from tiny_models import make_hf_model, save_hf_model

from llmd.cli import main


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmd: error: "), err
    return lines[0]


def llmd(env: dict[str, str], *args: str | bytes, stdin: bytes | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m llmd ARGS` as a user runs it; output as text (undecodable bytes replaced)."""
    proc = subprocess.run([sys.executable, "-m", "llmd", *args], input=stdin, capture_output=True, env=env,
                          timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"),
                                       proc.stderr.decode(errors="replace"))


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return daemon_env(tmp_path)


# ---- A: the prompt must be UTF-8 ----------------------------------------------------------------


def test_stdin_prompt_that_is_not_utf8_is_one_line(env: dict[str, str], tmp_path: Path) -> None:
    # Before: a 38-line UnicodeEncodeError (TypeError in the tokenizer) traceback.
    proc = llmd(env, "generate", "-", "--socket-dir", str(tmp_path / "run"), stdin=b"hello \xff\xfe")
    assert proc.returncode == 1, proc.stderr
    line = error_line(proc.stderr)
    assert "the prompt on stdin is not valid UTF-8 (byte 0xff at offset 6)" in line
    assert "iconv" in line
    assert proc.stdout == ""


def test_argv_prompt_that_is_not_utf8_is_one_line(env: dict[str, str], tmp_path: Path) -> None:
    # Python hands such argv bytes over as lone surrogates (surrogateescape).
    proc = llmd(env, "generate", b"ab\xffcd", "--socket-dir", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr
    assert "the prompt is not valid UTF-8 (byte 0xff at character 2)" in error_line(proc.stderr)


def test_not_utf8_in_process(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through main() too (a surrogate str; stdin bytes), before any model is looked for."""
    missing = ["--model", str(tmp_path / "no-such-model"), "--socket-dir", str(tmp_path / "run")]
    assert main(["generate", "x\udcfe", *missing]) == 1
    assert "not valid UTF-8 (byte 0xfe at character 1)" in error_line(capsys.readouterr().err)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xc3(")))
    assert main(["generate", "-", *missing]) == 1
    assert "the prompt on stdin is not valid UTF-8 (byte 0xc3 at offset 0)" in error_line(capsys.readouterr().err)


# ---- C: a prompt larger than one message carries -------------------------------------------------


@pytest.mark.parametrize("data, expected", [
    (b"a" * 5_000_000, "the prompt on stdin is over 4,128,768 bytes; one request to llmd carries at most 1,000,000 "
                       "characters in a 4 MiB message"),
    ("\u00e9".encode() * 1_000_001, "the prompt has 1,000,001 characters; llmd takes at most 1,000,000"),
], ids=["5MB", "1M+1-chars"])
def test_oversized_prompt_is_refused_before_anything_loads(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           data: bytes, expected: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["generate", "-", "--model", str(tmp_path / "no-such-model"),
                 "--socket-dir", str(tmp_path / "run")]) == 1
    assert expected in error_line(capsys.readouterr().err)


def test_oversized_argv_prompt(capsys, tmp_path: Path) -> None:
    assert main(["generate", "x" * 1_000_001, "--model", str(tmp_path / "none"),
                 "--socket-dir", str(tmp_path / "run")]) == 1
    assert "the prompt has 1,000,001 characters; llmd takes at most 1,000,000" in error_line(capsys.readouterr().err)


# ---- B: integer and float flags in the ranges the daemon takes ---------------------------------

_BIG = str(2**64)  # msgpack cannot carry it: an OverflowError traceback when the request is encoded


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--seed", _BIG], "--seed"),
    (["generate", "hi", "--seed", "-1"], "--seed"),
    (["generate", "hi", "--seed", str(2**63)], "--seed"),
    (["generate", "hi", "--max-tokens", _BIG], "--max-tokens"),
    (["generate", "hi", "--top-k", "-1"], "--top-k"),
    (["generate", "hi", "--top-k", _BIG], "--top-k"),
    (["generate", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--top-p", "nan"], "--top-p"),
    (["bench", "--seed", "-1"], "--seed"),
    (["bench", "--output-tokens", _BIG], "--output-tokens"),
    (["bench", "--prompt-tokens", "1000001"], "--prompt-tokens"),
    (["bench", "--prefix-tokens", "1000001"], "--prefix-tokens"),
    (["bench", "--window", "1"], "--window"),
    (["bench", "--rate", "0"], "--rate"),
    (["bench", "--rate", "nan"], "--rate"),
    (["bench", "--slo-ttft", "inf"], "--slo-ttft"),
    (["bench", "--slo-itl", "-1"], "--slo-itl"),
    (["stop", "--timeout", "nan"], "--timeout"),
    (["stop", "--timeout", "-1"], "--timeout"),
    (["logs", "-n", _BIG], "-n/--lines"),
    (["start", "--foreground", "--max-num-seqs", "100000"], "--max-num-seqs"),
    (["start", "--foreground", "--block-size", str(2**30)], "--block-size"),
    (["start", "--foreground", "--kv-cache-mb", _BIG], "--kv-cache-mb"),
    (["start", "--foreground", "--max-batched-tokens", str(2**40)], "--max-batched-tokens"),
    (["start", "--foreground", "--max-queue-len", _BIG], "--max-queue-len"),
    (["config", "show", "--max-num-seqs", "100000"], "--max-num-seqs"),
])
def test_out_of_range_flags_are_usage_errors(capsys, tmp_path: Path, argv: list[str], flag: str) -> None:
    # A missing model and an empty runtime dir: before the fix each of these got past argparse and
    # failed (or not) later, with exit status 1 or a traceback.
    extra = ["--socket-dir", str(tmp_path / "run")] if argv[0] in ("generate", "bench", "stop", "start") else []
    if argv[0] in ("generate", "start"):
        extra += ["--model", str(tmp_path / "no-such-model")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}" in err and "Traceback" not in err, err


def test_seed_bounds_are_the_daemons(capsys, tmp_path: Path) -> None:
    """SamplingParams takes a seed in [0, 2**63): its largest passes argparse (and fails only on the
    model), one more is a usage error."""
    missing = ["--model", str(tmp_path / "none"), "--socket-dir", str(tmp_path / "run")]
    assert main(["generate", "hi", "--seed", str(2**63 - 1), "--top-k", "0", "--top-p", "1", *missing]) == 1
    assert "not found" in error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--seed", str(2**63), *missing])
    assert exc.value.code == 2


# ---- D, E: a daemon that is alive but does not answer --------------------------------------------

FAKE_DAEMON = """
import signal, sys, time
from pathlib import Path
from llmd.daemon.runtime_files import RuntimeFiles

files = RuntimeFiles(Path(sys.argv[1]))
files.acquire()
files.write_connection_file({"model": "fake"})
(files.run_dir / "requests.sock").touch()  # what a daemon killed by SIGKILL leaves next to daemon.json
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def fake_daemon(run_dir: Path, mode: str) -> subprocess.Popen:
    """A process that holds the daemon's lock and connection file like a daemon and never answers."""
    run_dir.mkdir(mode=0o700, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_DAEMON, str(run_dir), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_status_help_documents_its_exit_codes(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 running and answering; 3 not running; 4 running but no answer within 5s" in out


@pytest.mark.slow
def test_hung_daemon_status_then_stop_force(tmp_path: Path, env: dict[str, str]) -> None:
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "model", with_tokenizer=True)
    run_dir = tmp_path / "run"
    pid = start_daemon(model_dir, run_dir, "--quant", "none", env=env)["pid"]
    try:
        assert llmd(env, "status", "--socket-dir", str(run_dir)).returncode == 0
        os.kill(pid, signal.SIGSTOP)
        def timed(*args: str) -> tuple[subprocess.CompletedProcess, float]:
            start = time.monotonic()
            return llmd(env, *args, "--socket-dir", str(run_dir)), time.monotonic() - start

        # the three wait on their real timeouts side by side (make test's time budget): 5 s for status,
        # and stop's answer wait, bounded by its --timeout (15 s without)
        with ThreadPoolExecutor(3) as pool:
            waits = [pool.submit(timed, *args) for args in (["status"], ["status", "--json"],
                                                            ["stop", "--timeout", "6"])]
            (status, status_s), (as_json, _), (stop, stop_s) = (w.result() for w in waits)
        # Before: 15 s of silence, then "not running" and exit status 3.
        assert status_s < 12 and stop_s < 12
        assert status.returncode == 4, status.stdout + status.stderr
        assert status.stdout.strip() == (f"llmd: running (pid {pid}) but not answering within 5s: it is stopped "
                                         f"(`kill -CONT {pid}` resumes it); `llmd stop --force` ends it")
        assert as_json.returncode == 4
        assert json.loads(as_json.stdout) == {"running": True, "answering": False, "pid": pid}
        assert stop.returncode == 1
        assert f"the daemon (pid {pid}) did not answer within 6s; `llmd stop --force` ends it" \
            in error_line(stop.stderr)

        forced = llmd(env, "stop", "--force", "--socket-dir", str(run_dir), timeout=60)
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip() == f"llmd: stopped (pid {pid})"  # SIGCONT let it act on SIGTERM
        assert wait_gone(pid, timeout=10)
        assert not (run_dir / "daemon.json").exists()
        assert llmd(env, "status", "--socket-dir", str(run_dir)).returncode == 3
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        stop_daemon(run_dir, env)


def test_stop_force_kills_a_daemon_that_ignores_sigterm(tmp_path: Path, env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    proc = fake_daemon(run_dir, "ignore-term")
    try:
        assert llmd(env, "status", "--socket-dir", str(run_dir)).returncode == 4
        forced = llmd(env, "stop", "--force", "--timeout", "1", "--socket-dir", str(run_dir), timeout=60)
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip() == f"llmd: killed (pid {proc.pid}) after it did not exit within 1s of SIGTERM"
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not (run_dir / "daemon.json").exists() and not (run_dir / "requests.sock").exists()
    finally:
        proc.kill()
        proc.wait()


def test_stop_force_removes_what_a_dead_daemon_left(tmp_path: Path, env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    dead = fake_daemon(run_dir, "plain")
    dead.kill()
    dead.wait()
    # Its pid now names a live process that is not a daemon (as after pid reuse): never signalled.
    info = json.loads((run_dir / "daemon.json").read_text())
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (run_dir / "daemon.json").write_text(json.dumps({**info, "pid": bystander.pid}))
        start = time.monotonic()
        status = llmd(env, "status", "--socket-dir", str(run_dir))
        assert status.returncode == 3 and "not running" in status.stdout
        assert time.monotonic() - start < 10  # before: 15 s waiting for the bystander to answer
        forced = llmd(env, "stop", "--force", "--socket-dir", str(run_dir))
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip() == f"llmd: not running; removed the files a dead daemon left in {run_dir}"
        assert not (run_dir / "daemon.json").exists() and not (run_dir / "requests.sock").exists()
        assert bystander.poll() is None
        # Nothing left: the same answer as `llmd stop`.
        again = llmd(env, "stop", "--force", "--socket-dir", str(run_dir))
        assert again.returncode == 1 and "no llmd daemon is running" in error_line(again.stderr)
    finally:
        bystander.kill()
        bystander.wait()


# ---- C with a daemon: refused locally, not after 15 s of silence ------------------------------


@pytest.mark.slow
def test_oversized_prompt_with_a_daemon_is_refused_at_once(tmp_path: Path, env: dict[str, str]) -> None:
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "model", with_tokenizer=True)
    run_dir = tmp_path / "run"
    start_daemon(model_dir, run_dir, "--quant", "none", env=env)
    try:
        start = time.monotonic()
        proc = llmd(env, "generate", "-", "--socket-dir", str(run_dir), stdin=b"a" * 5_000_000)
        assert time.monotonic() - start < 10
        assert proc.returncode == 1
        assert "one request to llmd carries at most 1,000,000 characters in a 4 MiB message" in error_line(proc.stderr)
        assert llmd(env, "status", "--socket-dir", str(run_dir)).returncode == 0  # and the daemon is fine
    finally:
        stop_daemon(run_dir, env)
