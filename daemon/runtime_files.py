"""The daemon's files in the runtime dir: the lock, the sockets and the connection file.

The lock is an ``flock`` held for the daemon's whole life. The kernel drops it when the process
dies, however it dies, so a lock file that can be locked again is stale by definition: the next
daemon takes it and clears the sockets and connection file left behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.errors import LlmdError
from llmd.paths import CONNECTION_FILE, LOCK_FILE, read_connection_file


class AlreadyRunningError(LlmdError):
    pass


@dataclass
class RuntimeFiles:
    """Acquire with :meth:`acquire`; always :meth:`release` (removes the files)."""

    run_dir: Path
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    _lock_fd: int | None = None

    @property
    def requests_endpoint(self) -> str:
        return f"ipc://{self.run_dir / 'requests.sock'}"

    @property
    def stats_endpoint(self) -> str:
        return f"ipc://{self.run_dir / 'stats.sock'}"

    def acquire(self) -> None:
        """Take the lock and clear stale files.

        Raises:
            AlreadyRunningError: another daemon holds the lock.
        """
        # NOTE: O_NOFOLLOW: a symlink planted here must not make us write a pid into its target.
        try:
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LlmdError(f"{self.run_dir / LOCK_FILE} is a symlink; llmd never follows one there: "
                                "remove it") from None
            raise LlmdError(f"cannot open the lock file {self.run_dir / LOCK_FILE}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise LlmdError(f"{self.run_dir / LOCK_FILE} is not a file of yours; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = read_connection_file(self.run_dir) or {}
            pid = info.get("pid", "unknown")
            raise AlreadyRunningError(
                f"llmd is already running (pid {pid}, model {info.get('model', '?')}); stop it with `llmd stop`"
            ) from None
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        for name in (CONNECTION_FILE, "requests.sock", "stats.sock"):
            (self.run_dir / name).unlink(missing_ok=True)  # left by a daemon that was killed

    def write_connection_file(self, info: dict[str, Any]) -> dict[str, Any]:
        """Publish endpoints and key, 0600, atomically (clients never see half a file); returns what
        it wrote."""
        data = {
            "version": 1, "pid": os.getpid(), "started": time.time(), "key": self.key.hex(),
            "requests": self.requests_endpoint, "stats": self.stats_endpoint, **info,
        }
        tmp = self.run_dir / f".{CONNECTION_FILE}.{os.getpid()}"
        tmp.unlink(missing_ok=True)  # ours, left by a crash (we hold the lock)
        # NOTE: O_EXCL: a file or symlink that appeared here since is refused, never written through.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.run_dir / CONNECTION_FILE)
        return data

    def release(self) -> None:
        for name in (CONNECTION_FILE, "requests.sock", "stats.sock"):
            (self.run_dir / name).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None
