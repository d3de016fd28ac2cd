"""Runtime files another local user could plant: a world-writable or foreign runtime dir, a symlinked
lock, a connection file that is not ours. Each is refused with the fix in one line; nothing is
chmod-ed, written through or believed. (The tests run as root in CI, so "another user" is made with
chown to nobody's uid.)"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from llmd.client import Client, load_connection
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.errors import LlmdError
from llmd.paths import CONNECTION_FILE, LOCK_FILE, read_connection_file, runtime_dir

NOBODY = 65534


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def test_a_world_writable_runtime_dir_is_refused_not_chmod_ed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(LlmdError, match=r"open to other users \(mode 0777\).*chmod 700"):
        runtime_dir(run)
    assert stat.S_IMODE(run.stat().st_mode) == 0o777  # left as found: what is inside may be planted
    run.chmod(0o700)
    assert runtime_dir(run) == run


def test_a_runtime_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    run = private_dir(tmp_path / "run")
    os.chown(run, NOBODY, NOBODY)
    with pytest.raises(LlmdError, match="belongs to another user"):
        runtime_dir(run, create=False)


def test_a_runtime_dir_symlinked_by_another_user_is_refused(tmp_path: Path) -> None:
    mine = private_dir(tmp_path / "mine")
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(LlmdError, match="symlink owned by another user"):
        runtime_dir(link)


def test_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    out = subprocess.run([sys.executable, "-m", "llmd", "status", "--socket-dir", str(run)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "chmod 700" in out.stderr


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    run = private_dir(tmp_path / "run")
    target = tmp_path / "important"
    target.write_text("precious\n")
    (run / LOCK_FILE).symlink_to(target)
    files = RuntimeFiles(run)
    with pytest.raises(LlmdError, match="symlink"):
        files.acquire()
    assert target.read_text() == "precious\n"


def test_the_connection_file_is_written_without_following_planted_links(tmp_path: Path) -> None:
    run = private_dir(tmp_path / "run")
    files = RuntimeFiles(run)
    files.acquire()
    try:
        target = tmp_path / "important"
        target.write_text("precious\n")
        (run / f".{CONNECTION_FILE}.{os.getpid()}").symlink_to(target)  # where the temp file goes
        files.write_connection_file({"model": "m"})
        assert target.read_text() == "precious\n"
        info = read_connection_file(run)
        assert info is not None and info["pid"] == os.getpid() and info["model"] == "m"
        assert stat.S_IMODE((run / CONNECTION_FILE).stat().st_mode) == 0o600
    finally:
        files.release()


def _planted(run: Path, endpoint: str) -> Path:
    path = run / CONNECTION_FILE
    path.write_text(json.dumps({"version": 1, "pid": os.getpid(), "key": "11" * 32, "requests": endpoint,
                                "stats": endpoint}))
    return path


@pytest.mark.parametrize("how", ["other_owner", "group_readable", "symlink"])
def test_a_planted_connection_file_is_not_believed(tmp_path: Path, how: str) -> None:
    """Another user's daemon.json pointing at their own server: the client must refuse it, never
    send the prompt there."""
    run = private_dir(tmp_path / "run")
    thief = zmq.Context.instance().socket(zmq.ROUTER)
    thief.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'thief.sock'}"
    thief.bind(endpoint)
    try:
        if how == "symlink":
            elsewhere = private_dir(tmp_path / "elsewhere")
            (run / CONNECTION_FILE).symlink_to(_planted(elsewhere, endpoint))
            match = "symlink"
        else:
            path = _planted(run, endpoint)
            if how == "other_owner":
                path.chmod(0o600)
                os.chown(path, NOBODY, NOBODY)
            else:
                path.chmod(0o640)
            match = "not written by your llmd daemon"
        with pytest.raises(LlmdError, match=match):
            load_connection(run)
        with pytest.raises(LlmdError, match=match):
            Client(run)
        assert not thief.poll(300)  # nothing reached the other user's server
    finally:
        thief.close(0)
