"""Where llmd keeps its files, following the XDG base directories: the runtime dir (sockets,
connection file, lock), the config dir (config.toml), the state dir (logs) and the data dir (saved
chats, the models directory). Shared by the daemon and its clients."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmd.errors import LlmdError

CONNECTION_FILE = "daemon.json"
LOCK_FILE = "daemon.lock"
MAX_CONNECTION_FILE_BYTES = 64 * 1024  # far more than a real one; a planted huge file is not read whole


def runtime_dir(override: str | os.PathLike[str] | None = None, create: bool = True,
                configured: Callable[[], str | None] | None = None) -> Path:
    """The per-user runtime directory, created 0700 and checked to be ours.

    Order: ``override`` (``--socket-dir``), ``$LLMD_RUNTIME_DIR``, what ``configured`` returns (the
    config file's ``socket_dir``: llmd.config.runtime_dir passes it; asked only when it decides),
    ``$XDG_RUNTIME_DIR/llmd``, then ``/tmp/llmd-<uid>``.

    Raises:
        LlmdError: the directory exists but belongs to someone else or is open to others; what
            ``configured`` raises (a bad config file: llmd.config.ConfigError).
    """
    if override is not None:
        path = Path(override).expanduser()
    elif os.environ.get("LLMD_RUNTIME_DIR"):
        path = Path(os.environ["LLMD_RUNTIME_DIR"]).expanduser()
    elif configured is not None and (value := configured()) is not None:
        path = Path(value)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "llmd"
    else:
        path = Path("/tmp") / f"llmd-{os.getuid()}"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Refuse a runtime dir someone else could plant files in, as ssh and PostgreSQL do: it must be
    ours, not a symlink someone else made, and closed to group and others. Never chmod and carry on:
    whatever is already inside may have been planted.

    Raises:
        LlmdError: with the fix in one line.
    """
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.getuid():
        raise LlmdError(f"runtime directory {path} is a symlink owned by another user; "
                        "pass --socket-dir with a directory of your own")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LlmdError(f"runtime directory {path} is a dangling symlink; remove it or pass --socket-dir DIR") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LlmdError(f"runtime directory {path} is not a directory; pass --socket-dir DIR")
    if st.st_uid != os.getuid():
        raise LlmdError(f"runtime directory {path} belongs to another user (uid {st.st_uid}); "
                        "pass --socket-dir with a directory of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        # NOTE: the sockets in here accept requests, and clients believe the connection file.
        raise LlmdError(f"runtime directory {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"check nothing in it is foreign, then `chmod 700 {path}`, or pass --socket-dir DIR")


def read_connection_file(run_dir: Path) -> dict[str, Any] | None:
    """The running daemon's connection info, or None if there is no file or its daemon is gone.

    The file is believed only if it is a regular file of ours that nobody else can read or write
    (it holds the key, and names the endpoint clients send their prompts to).

    Raises:
        LlmdError: the file is there but not trustworthy (a symlink, someone else's, or open to others).
    """
    path = run_dir / CONNECTION_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LlmdError(f"{path} is a symlink; llmd never follows one there: remove it") from None
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise LlmdError(f"{path} was not written by your llmd daemon (owner uid {st.st_uid}, mode "
                            f"{stat.S_IMODE(st.st_mode):04o}); remove it")
        data = f.read(MAX_CONNECTION_FILE_BYTES)
    try:
        info = json.loads(data)
    except ValueError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int) or not process_alive(info["pid"]):
        return None
    return info


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has, though kill(0) still finds
    it until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return process_state(pid) != "Z"  # without /proc (macOS) kill(0) is all we know


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, T stopped, Z zombie...); None where there is
    no /proc (macOS) or no such process."""
    try:  # the state follows the parenthesised command name, which may itself hold ")"
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def state_dir() -> Path:
    """``$XDG_STATE_HOME/llmd`` (default ``~/.local/state/llmd``), for the daemon's log."""
    path = _xdg_base("XDG_STATE_HOME", ".local/state") / "llmd"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """``$XDG_DATA_HOME/llmd`` (default ``~/.local/share/llmd``), for saved chats."""
    path = _xdg_base("XDG_DATA_HOME", ".local/share") / "llmd"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def log_file() -> Path:
    return state_dir() / "llmd.log"


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/llmd`` (default ``~/.config/llmd``); not created: the config file is optional."""
    return _xdg_base("XDG_CONFIG_HOME", ".config") / "llmd"


def default_models_dir() -> Path:
    """``$XDG_DATA_HOME/llmd/models``: where ``llmd models`` looks for .gguf files unless the config
    file names another ``models_dir``. Not created: an absent directory simply holds no models."""
    return _xdg_base("XDG_DATA_HOME", ".local/share") / "llmd" / "models"


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/llmd`` (default ``~/.cache/llmd``): what llmd can build again (tokenizer
    snapshots, prepared weights). Not created. (kernels/native.py finds its builds' directory the
    same way on its own: kernels import nothing from llmd but its errors.)"""
    return _xdg_base("XDG_CACHE_HOME", ".cache") / "llmd"


def _xdg_base(variable: str, under_home: str) -> Path:
    """An XDG base directory: ``$variable``, else ``~/under_home``."""
    return Path(os.environ.get(variable) or Path.home() / under_home)
