"""Where llmd keeps its files, following the XDG base directories: the runtime dir (sockets,
connection file, lock), the config dir (config.toml), the state dir (logs) and the data dir (saved
chats, the models directory). Shared by the daemon and its clients."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from llmd.errors import LlmdError

CONNECTION_FILE = "daemon.json"
LOCK_FILE = "daemon.lock"


def runtime_dir(override: str | os.PathLike[str] | None = None, create: bool = True) -> Path:
    """The per-user runtime directory, created 0700 and checked to be ours.

    Order: ``override`` (``--socket-dir``), ``$LLMD_RUNTIME_DIR``, ``socket_dir`` of the config file,
    ``$XDG_RUNTIME_DIR/llmd``, then ``/tmp/llmd-<uid>``.

    Raises:
        LlmdError: the directory exists but belongs to someone else or is open to others; the
            config file is bad (llmd.config.ConfigError).
    """
    from llmd.config import setting  # NOTE: here, not at the top: llmd.config imports this module

    if override is not None:
        path = Path(override).expanduser()
    elif os.environ.get("LLMD_RUNTIME_DIR"):
        path = Path(os.environ["LLMD_RUNTIME_DIR"]).expanduser()
    elif (configured := setting("socket_dir")) is not None:
        path = Path(configured)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "llmd"
    else:
        path = Path("/tmp") / f"llmd-{os.getuid()}"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        st = path.stat()
        if st.st_uid != os.getuid():
            raise LlmdError(f"runtime directory {path} belongs to another user; pass --socket-dir DIR")
        if stat.S_IMODE(st.st_mode) & 0o077:
            # NOTE: the sockets in here accept requests; nobody else may reach them.
            os.chmod(path, 0o700)
    return path


def read_connection_file(run_dir: Path) -> dict[str, Any] | None:
    """The running daemon's connection info, or None if there is no file or its daemon is gone."""
    try:
        info = json.loads((run_dir / CONNECTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int) or not _alive(info["pid"]):
        return None
    return info


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


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


def _xdg_base(variable: str, under_home: str) -> Path:
    """An XDG base directory: ``$variable``, else ``~/under_home``."""
    return Path(os.environ.get(variable) or Path.home() / under_home)
