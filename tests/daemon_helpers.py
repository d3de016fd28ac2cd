"""Start and stop real daemons (subprocesses on ipc sockets in a temp dir) for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from llmd.config import OPTIONS
from llmd.protocol import PROTOCOL, REPLY_TYPES, Message, decode, sign

CLIENT_SCRIPT = Path(__file__).with_name("client_proc.py")


def daemon_env(tmp: Path, **extra: str) -> dict[str, str]:
    # NOTE: its own config dir too: module-scoped fixtures copy os.environ before the per-test
    # isolation of conftest.py applies, and a user's config.toml must not reach test daemons.
    env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"), XDG_CONFIG_HOME=str(tmp / "config"),
               PYTHONUNBUFFERED="1", **extra)
    env["LLMD_RUNTIME_DIR"] = str(tmp / "default-run")  # not the developer's daemon (see conftest.py)
    env.pop("LLMD_CONFIG", None)
    for option in OPTIONS.values():
        env.pop(option.env, None)
    return env


FAULT_HOOKS = Path(__file__).parent / "fault_hooks"


def fault_env(env: dict[str, str], **faults: str) -> dict[str, str]:
    """``env`` for a daemon with test-only faults (tests/fault_hooks/sitecustomize.py), e.g.
    ``LLMD_TEST_FAULT_STEP="400"``."""
    path = os.pathsep.join(p for p in (str(FAULT_HOOKS), env.get("PYTHONPATH", "")) if p)
    return {**env, **faults, "PYTHONPATH": path}


def start_daemon(model_dir: Path, socket_dir: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "llmd", "start", "--model", str(model_dir), "--socket-dir", str(socket_dir),
         "--dtype", "float32", *args],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads((socket_dir / "daemon.json").read_text())


def stop_daemon(socket_dir: Path, env: dict[str, str] | None = None) -> None:
    conn_file = socket_dir / "daemon.json"
    if not conn_file.exists():
        return
    pid = json.loads(conn_file.read_text())["pid"]
    subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(socket_dir)],
                   capture_output=True, text=True, timeout=120, env=env)
    wait_gone(pid)


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def client_process(socket_dir: Path, token_ids: list[int], max_tokens: int, env: dict[str, str] | None = None
                   ) -> subprocess.Popen:
    """A separate process that streams one greedy request and prints one line per delta, then
    a final JSON line with all token ids."""
    return subprocess.Popen(
        [sys.executable, str(CLIENT_SCRIPT), str(socket_dir), json.dumps(token_ids), str(max_tokens)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


class Raw:
    """A DEALER socket speaking the protocol by hand, sending frames as given (for hostile tests).

    Args:
        endpoint: ``requests`` or ``tcp_requests``.
        curve: a CURVE client key pair for a TCP endpoint (the daemon's server key comes from ``conn``).
        rcvhwm: this socket's receive queue limit (a slow reader's).
    """

    def __init__(self, conn: dict, endpoint: str = "requests", curve: tuple[bytes, bytes] | None = None,
                 rcvhwm: int | None = None) -> None:
        self.key = bytes.fromhex(conn["key"])
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if curve is not None:
            self.sock.curve_serverkey = conn["curve_server_key"].encode()
            self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.connect(conn[endpoint])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def send(self, msg_type: str, content: object, msg_id: str = "m1") -> None:
        h = msgpack.packb({"v": 1, "id": msg_id, "type": msg_type, "ts": time.time()})
        c = msgpack.packb(content)
        self.send_frames([PROTOCOL, sign(self.key, h, c), h, c])

    def recv(self, timeout: float = 5.0) -> Message | None:
        """The next reply that is not a keepalive, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            msg = decode(self.key, self.sock.recv_multipart(), REPLY_TYPES)
            if msg.type != "keepalive":
                return msg
        return None

    def works(self) -> bool:
        """A valid request right after: does it succeed?"""
        self.send("generate", {"request_id": "ok", "token_ids": [1, 2, 3], "stream": False,
                               "params": {"max_tokens": 3}}, "valid")
        for _ in range(3):
            msg = self.recv(10)
            if msg is not None and msg.type == "done":
                return True
        return False

    def close(self) -> None:
        self.sock.close(0)
