"""The daemon's log file: written with rotation by the daemon, read by ``llmd logs [-f]``.

A daemon started by ``llmd start`` logs to ``$XDG_STATE_HOME/llmd/llmd.log`` (``llmd.paths.log_file``),
rotated at :data:`MAX_BYTES` with :data:`BACKUPS` old files (``llmd.log.1`` is the newest of them).
One started by systemd (``--foreground``, no log file) logs to stderr, which the journal keeps.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from logging.handlers import RotatingFileHandler
from pathlib import Path

MAX_BYTES = 10 * 2**20
BACKUPS = 3
FORMAT = "%(asctime)s llmd: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _RotatingLog(RotatingFileHandler):
    """Rotates like its base class, and points stdout and stderr at the new file each time.

    NOTE: the process's own output (a C library's warning, a traceback printed before logging is
    set up, the one-line error on exit) goes to file descriptors 1 and 2; aiming them at the
    current file keeps it all in one place, in order."""

    def doRollover(self) -> None:
        super().doRollover()
        self.redirect_std_streams()

    def redirect_std_streams(self) -> None:
        if self.stream is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)


def log_to_file(path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
    """In the daemon: send the ``llmd`` loggers, stdout and stderr to ``path``, rotated."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handler = _RotatingLog(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger = logging.getLogger("llmd")
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    handler.redirect_std_streams()


def last_lines(path: Path, count: int) -> tuple[list[str], int]:
    """The last ``count`` lines of ``path`` and the file's size when they were read (where
    :func:`follow` goes on, so no line written in between is lost). Reads from the end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = pos = f.tell()
        data = b""
        while count > 0 and pos > 0 and data.count(b"\n") <= count:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    return (lines[-count:] if count > 0 else []), size


def follow(path: Path, emit: Callable[[str], None], offset: int | None = None, poll_s: float = 0.25,
           stop: Callable[[], bool] = lambda: False) -> None:
    """Hand each line written to ``path`` after ``offset`` (default: its end) to ``emit`` until
    ``stop()``, across rotations: when the file is renamed away (a new inode at ``path``) or cut
    short, the rest of the old one is read and the new one followed from its start."""
    f = open(path, "rb")
    f.seek(0, os.SEEK_END)
    if offset is not None and offset <= f.tell():
        f.seek(offset)
    pending = b""
    try:
        while not stop():
            chunk = f.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    emit(line.decode("utf-8", errors="replace"))
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell()):
                f.close()
                f = open(path, "rb")
                continue
            time.sleep(poll_s)
    finally:
        f.close()
