"""The daemon's log file: rotation (with stdout/stderr following the current file), `llmd logs`
and `llmd logs -f` across a rotation."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmd.cli import main
from llmd.logs import follow, last_lines


def test_last_lines_reads_from_the_end(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("".join(f"line {i} " + "x" * 100 + "\n" for i in range(3000)))  # ~300 KB
    assert last_lines(path, 3) == ([f"line {i} " + "x" * 100 for i in (2997, 2998, 2999)], path.stat().st_size)
    assert len(last_lines(path, 2500)[0]) == 2500 and last_lines(path, 0)[0] == []
    path.write_text("no newline at the end")
    assert last_lines(path, 5)[0] == ["no newline at the end"]


def test_follow_goes_on_from_an_offset(tmp_path: Path) -> None:
    path = tmp_path / "llmd.log"
    path.write_text("a\nb\n")
    _, end = last_lines(path, 1)
    with open(path, "a") as f:
        f.write("written between the tail and the follow\n")
    seen: list[str] = []
    follow(path, seen.append, offset=end, poll_s=0.01, stop=lambda: bool(seen))
    assert seen == ["written between the tail and the follow"]


def test_follow_survives_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "llmd.log"
    path.write_text("old line, not shown\n")
    seen: list[str] = []
    done = threading.Event()
    worker = threading.Thread(target=follow, args=(path, seen.append, None, 0.02, done.is_set))
    worker.start()
    try:
        time.sleep(0.1)
        with open(path, "a") as f:
            f.write("one\ntwo\n")
        time.sleep(0.1)
        with open(path, "a") as f:
            f.write("three (last of the old file)\n")
        path.rename(tmp_path / "llmd.log.1")  # what a rotation does
        path.write_text("four\n")
        assert _wait(lambda: len(seen) >= 4)
    finally:
        done.set()
        worker.join(5)
    assert seen == ["one", "two", "three (last of the old file)", "four"]


_ROTATING_SCRIPT = """
import logging, os, sys
from pathlib import Path
from llmd.logs import log_to_file
log_to_file(Path(sys.argv[1]), max_bytes=2000, backups=2)
log = logging.getLogger("llmd.test")
logging.getLogger("llmd").setLevel(logging.INFO)
for i in range(200):
    log.info("message %d", i)
os.write(2, b"raw stderr after the rotations\\n")
print("stdout after the rotations", flush=True)
"""


def test_the_daemon_log_rotates_and_stderr_follows(tmp_path: Path) -> None:
    path = tmp_path / "state" / "llmd.log"
    subprocess.run([sys.executable, "-c", _ROTATING_SCRIPT, str(path)], check=True, timeout=60)
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["llmd.log", "llmd.log.1", "llmd.log.2"]  # two backups kept, the rest dropped
    assert all(p.stat().st_size <= 2000 + 200 for p in path.parent.iterdir())
    current = path.read_text()
    assert "message 199" in current
    # fds 1 and 2 point at the current file, not a rotated one.
    assert "raw stderr after the rotations" in current and "stdout after the rotations" in current
    line = current.splitlines()[0]
    assert " llmd: message " in line and line[:4].isdigit()  # timestamped


def test_llmd_logs_prints_the_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("LLMD_RUNTIME_DIR", str(tmp_path / "run"))
    assert main(["logs"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmd: error: no log yet at") and err.count("\n") == 1
    log = tmp_path / "state" / "llmd" / "llmd.log"
    log.write_text("".join(f"{i}\n" for i in range(100)))
    assert main(["logs", "-n", "3"]) == 0
    assert capsys.readouterr().out.split() == ["97", "98", "99"]


def test_llmd_logs_follow_prints_new_lines(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), LLMD_RUNTIME_DIR=str(tmp_path / "run"),
               PYTHONUNBUFFERED="1")
    log = tmp_path / "state" / "llmd" / "llmd.log"
    log.parent.mkdir(parents=True)
    log.write_text("before\n")
    proc = subprocess.Popen([sys.executable, "-m", "llmd", "logs", "-f", "-n", "1"], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert _readline(proc) == "before\n"
        with open(log, "a") as f:
            f.write("after\n")
        assert _readline(proc) == "after\n"
    finally:
        proc.terminate()
        proc.wait(10)


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _readline(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """The next line of ``proc``'s stdout, or "" after ``timeout`` s (a hang fails, not stalls)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""
