"""The daemon as a process, for the commands that start, stop and look at it: starting it detached
and waiting until it answers, whether the one in a runtime dir still runs (its lock, its pid),
waiting for it to exit, signalling it, and removing what a dead one left."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmd.commands.flags import settings_of
from llmd.config import Settings
from llmd.errors import LlmdError
from llmd.paths import process_state


def start_background(args: argparse.Namespace, settings: Settings | None = None,
                      progress: Callable[[str], None] | None = None) -> int:
    """Start the daemon as a detached process and wait until it answers; ``progress`` gets the
    lines it logs meanwhile (model loading)."""
    import subprocess
    import time

    from llmd.client import Client, DaemonNotRunningError, load_connection
    from llmd.config import OPTIONS, runtime_dir
    from llmd.paths import log_file, read_connection_file

    settings = settings or settings_of(args)
    run_dir = runtime_dir(settings["socket_dir"])
    running = read_connection_file(run_dir)
    if running:
        raise LlmdError(f"llmd is already running (pid {running['pid']}, model {running.get('model')}); "
                        "stop it with `llmd stop`")
    log_path = log_file()
    argv = [sys.executable, "-m", "llmd", "start", "--foreground", "--socket-dir", str(run_dir),
            "--log-file", str(log_path)]
    env = dict(os.environ)
    # NOTE: only the flags given here: the daemon reads the same config file for the rest.
    for name, option in OPTIONS.items():
        value = getattr(args, name, None)
        if value is None or name == "socket_dir":
            continue
        if option.secret:  # never in argv, which every user can read
            env[option.env] = str(value)
        elif isinstance(value, tuple):
            argv += [option.flag, ",".join(value)]
        elif isinstance(value, bool):
            argv.append(option.flag if value else "--no-" + option.flag[2:])
        else:
            argv += [option.flag, str(value)]
    log_start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log_out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
            reason = tail[0].removeprefix("llmd: error: ") if tail else "no reason logged"
            raise LlmdError(f"the daemon failed to start: {reason} (log: {log_path})")
        try:
            connection = load_connection(run_dir)
            if connection.get("pid") == proc.pid:
                with Client(connection=connection) as client:
                    client.health(timeout=2.0)
                    info = client.info()
                break
        except DaemonNotRunningError:
            pass
        if progress is not None:
            log_start = follow_log(log_path, log_start, progress)
        time.sleep(0.05)  # a start takes seconds: a finer poll answers sooner, at no cost
    else:
        raise LlmdError(f"the daemon did not come up within 10 minutes (log: {log_path})")
    print(f"llmd: started (pid {info['pid']}): {info['model']} on {info['device']}, {info['dtype']}, "
          f"quantisation {info['quantization']}, KV cache {info['num_blocks']} blocks x {info['block_size']} tokens"
          f"{' (' + info['kv_cache_dtype'] + ')' if info.get('kv_cache_dtype') else ''}; "
          f"{'HTTP API on ' + info['http'] + '; ' if info.get('http') else ''}log: {log_path}")
    return 0


_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")  # llmd.logs.FORMAT's


def follow_log(path: Path, offset: int, emit: Callable[[str], None]) -> int:
    """Hand the complete lines written to ``path`` after ``offset`` to ``emit``; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1
    for raw in data[:end].splitlines():
        # progress bars rewrite their line with \r: show the latest state only
        line = raw.decode(errors="replace").rsplit("\r", 1)[-1].strip()
        line = _TIMESTAMP.sub("", line)
        if line:
            emit(line)
    return offset + end


def lock_held(run_dir: Path) -> bool | None:
    """Whether a process holds the daemon's lock in ``run_dir``; None when that cannot be told.

    NOTE: a daemon holds an flock on the lock file for its whole life and the kernel drops it when
    the process ends, zombie or not. A free lock means the pid in daemon.json, though alive, is not
    the daemon (it died without cleaning up and the pid was reused), or the daemon has ended but
    is not yet reaped. Probing takes the lock for an instant: a daemon starting in that instant
    would be refused as "already running".
    """
    import fcntl

    from llmd.paths import LOCK_FILE

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing also drops a lock we took
    return False


def running_daemon(run_dir: Path) -> dict[str, Any] | None:
    """The connection info of the daemon running in ``run_dir``, whether it answers or not; None
    if there is none."""
    from llmd.paths import read_connection_file

    info = read_connection_file(run_dir)
    if info is not None and lock_held(run_dir) is False:
        return None
    return info


def exited(pid: int, run_dir: Path) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # the pid is another user's process now
    # NOTE: a zombie (ended, not yet reaped by its parent) still answers kill(pid, 0). Without /proc
    # the lock tells: the kernel dropped it when the process ended.
    state = process_state(pid)
    return state == "Z" if state is not None else lock_held(run_dir) is False


def wait_exit(pid: int, run_dir: Path, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the daemon ``pid`` to end; whether it did."""
    import time

    deadline = time.monotonic() + timeout
    while not exited(pid, run_dir):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it ended meanwhile
    except PermissionError:
        raise LlmdError(f"pid {pid} belongs to another user, so it is not your llmd daemon") from None
