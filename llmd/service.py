"""``llmd service``: run the daemon as a service of the current user, so it starts with the session
and is restarted if it crashes. Linux gets a systemd user unit, macOS a launchd agent, both filled in
from the templates in ``packaging/`` (shipped as ``llmd/service_files``); other systems get a clear error."""

from __future__ import annotations

import argparse
import getpass
import importlib.resources
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from llmd import paths
from llmd.config import runtime_dir
from llmd.errors import LlmdError

UNIT_NAME = "llmd.service"
LAUNCHD_LABEL = "io.llmd.daemon"
UNSUPPORTED = ("llmd service supports systemd (Linux) and launchd (macOS); on this system run `llmd start` "
               "yourself, e.g. from your session's autostart")
NOT_INSTALLED = "llmd service is not installed (install it with `llmd service install`)"
COMMAND_TIMEOUT_S = 120.0  # `disable --now` waits for the daemon to drain and exit
TEMPLATES = importlib.resources.files("llmd").joinpath("service_files")


def _systemd_exec_path(python: str) -> str:
    # NOTE: systemd refuses an executable path holding quotes or backslashes, expands %specifiers in it
    # (but not $VARIABLES: those only in the arguments) and splits it at whitespace unless quoted.
    if any(c in "\"'\\" or not c.isprintable() for c in python):
        raise LlmdError(f"systemd cannot run a program whose path has quotes, backslashes or control characters "
                        f"({python}); install llmd in a virtualenv at a plain path")
    text = python.replace("%", "%%")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def render_systemd_unit(python: str) -> str:
    """The systemd user unit that runs ``python -m llmd start --foreground``.

    Args:
        python: absolute path of the interpreter to run (normally ``sys.executable``).
    """
    return (TEMPLATES / "llmd.service").read_text(encoding="utf-8").replace("@PYTHON@", _systemd_exec_path(python))


def render_launchd_plist(python: str, log_dir: Path) -> str:
    """The launchd agent plist (XML text) that runs ``python -m llmd start --foreground``.

    Args:
        python: absolute path of the interpreter to run (normally ``sys.executable``).
        log_dir: directory for the daemon's log file (``llmd.log``).
    """
    from xml.sax.saxutils import escape  # (here: ~14 ms every command would pay at start)

    text = (TEMPLATES / "llmd.plist").read_text(encoding="utf-8")
    return text.replace("@PYTHON@", escape(python)).replace("@LOG_DIR@", escape(str(log_dir)))


def systemd_unit_path() -> Path:
    """``$XDG_CONFIG_HOME/systemd/user/llmd.service`` (default ``~/.config/systemd/user``)."""
    return paths.config_dir().parent / "systemd" / "user" / UNIT_NAME


def launchd_plist_path() -> Path:
    """``~/Library/LaunchAgents/io.llmd.daemon.plist``."""
    return Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"


def launchd_log_dir() -> Path:
    """``~/Library/Logs/llmd``, where the launchd agent's output goes."""
    return Path.home() / "Library" / "Logs" / "llmd"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a service manager's command (looked up on PATH) and capture its output."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise LlmdError(f"{argv[0]} not found on PATH: llmd service needs it; without it run `llmd start` yourself")
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LlmdError(f"`{' '.join(argv)}` did not finish within {COMMAND_TIMEOUT_S:.0f}s") from None


def _failure(argv: list[str], proc: subprocess.CompletedProcess[str]) -> LlmdError:
    output = (proc.stderr or "").strip() or (proc.stdout or "").strip()
    first = output.splitlines()[0] if output else f"exit status {proc.returncode}"
    if "Failed to connect to bus" in output or "DBUS_SESSION_BUS_ADDRESS" in output:
        return LlmdError(f"no systemd user manager for this session ({first}): run `loginctl enable-linger $USER` "
                         "and log in again, or run `llmd start` yourself")
    return LlmdError(f"`{' '.join(argv)}` failed: {first}")


def _check(argv: list[str]) -> str:
    """Run ``argv``; its stdout, or an LlmdError carrying the first line of what it said."""
    proc = _run(argv)
    if proc.returncode != 0:
        raise _failure(argv, proc)
    return proc.stdout


def _write_then(path: Path, text: str, steps: Callable[[], None]) -> None:
    """Write ``path``, then run ``steps``; if they fail, a file that is new is removed again."""
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    try:
        steps()
    except BaseException:
        if not existed:
            path.unlink(missing_ok=True)
        raise


def _manual_daemon_warning(is_service_pid: Callable[[int], bool]) -> str | None:
    """A warning if a daemon is already running that the service manager did not start."""
    try:
        info = paths.read_connection_file(runtime_dir(create=False))
    except LlmdError:
        return None
    if info is None or is_service_pid(info["pid"]):
        return None
    return (f"warning: a daemon started by hand is running (pid {info['pid']}); the service's daemon cannot take "
            "the socket until you run `llmd stop`, then restart the service")


def _systemctl(*args: str) -> str:
    return _check(["systemctl", "--user", *args])


def _started_by_systemd(pid: int) -> bool:
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return any(line.endswith("/" + UNIT_NAME) for line in cgroups.splitlines())


def _systemd_install(start: bool) -> str:
    path = systemd_unit_path()
    warning = _manual_daemon_warning(_started_by_systemd)

    def steps() -> None:
        _systemctl("daemon-reload")
        _systemctl("enable", *(["--now"] if start else []), UNIT_NAME)

    _write_then(path, render_systemd_unit(sys.executable), steps)
    lines = [f"llmd service: installed {path}",
             "enabled and started; if it was already running, `systemctl --user restart llmd` applies the new unit"
             if start else "enabled: it starts at your next login (now: `systemctl --user start llmd`)",
             "logs: journalctl --user -u llmd -f"]
    if not (Path("/var/lib/systemd/linger") / getpass.getuser()).exists():
        lines.append("it runs while you are logged in; `loginctl enable-linger $USER` keeps it running after logout")
    return "\n".join([*lines, *([warning] if warning else [])])


def _systemd_uninstall() -> str:
    path = systemd_unit_path()
    if not path.exists():
        raise LlmdError(NOT_INSTALLED)
    _systemctl("disable", "--now", UNIT_NAME)
    path.unlink()
    _systemctl("daemon-reload")
    return f"llmd service: stopped, disabled and removed {path}"


def _systemctl_query(verb: str) -> str:
    # NOTE: is-enabled/is-active exit non-zero for "disabled"/"inactive" yet still answer on stdout;
    # only silence means systemctl itself failed.
    argv = ["systemctl", "--user", verb, UNIT_NAME]
    proc = _run(argv)
    if not proc.stdout.strip():
        raise _failure(argv, proc)
    return proc.stdout.strip().splitlines()[0]


def _systemd_status() -> str:
    path = systemd_unit_path()
    if not path.exists():
        return NOT_INSTALLED
    active = _systemctl_query("is-active")
    lines = [f"llmd service: installed {path}", f"enabled: {_systemctl_query('is-enabled')}", f"active: {active}",
             "logs: journalctl --user -u llmd -f"]
    if active == "failed":
        lines.append("it failed: see `systemctl --user status llmd`")
    return "\n".join(lines)


def _launchd_target() -> str:
    return f"gui/{os.getuid()}/{LAUNCHD_LABEL}"


def _launchd_print() -> str | None:
    """``launchctl print`` of the agent, or None if it is not loaded."""
    proc = _run(["launchctl", "print", _launchd_target()])
    return proc.stdout if proc.returncode == 0 else None


def _launchd_field(printed: str | None, name: str) -> str | None:
    for line in (printed or "").splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep and key == name:
            return value.strip()
    return None


def _launchd_install(start: bool) -> str:
    path, log_dir, domain = launchd_plist_path(), launchd_log_dir(), f"gui/{os.getuid()}"
    loaded = _launchd_print()
    warning = _manual_daemon_warning(lambda pid: _launchd_field(loaded, "pid") == str(pid))

    def steps() -> None:
        if loaded is not None:  # a loaded agent keeps its old definition until it is booted out
            _check(["launchctl", "bootout", _launchd_target()])
        _check(["launchctl", "enable", _launchd_target()])
        if start:
            _check(["launchctl", "bootstrap", domain, str(path)])

    log_dir.mkdir(parents=True, exist_ok=True)
    _write_then(path, render_launchd_plist(sys.executable, log_dir), steps)
    later = f"it loads at your next login (now: `launchctl bootstrap {domain} {path}`)"
    lines = [f"llmd service: installed {path}", "loaded and started" if start else later,
             "logs: llmd logs -f"]
    return "\n".join([*lines, *([warning] if warning else [])])


def _launchd_uninstall() -> str:
    path = launchd_plist_path()
    if not path.exists():
        raise LlmdError(NOT_INSTALLED)
    if _launchd_print() is not None:
        _check(["launchctl", "bootout", _launchd_target()])
    path.unlink()
    return f"llmd service: stopped, unloaded and removed {path}"


def _launchd_status() -> str:
    path = launchd_plist_path()
    if not path.exists():
        return NOT_INSTALLED
    printed = _launchd_print()
    lines = [f"llmd service: installed {path}", *(["state: not loaded"] if printed is None else [])]
    for field in ("state", "pid", "last exit code"):
        if (value := _launchd_field(printed, field)) is not None:
            lines.append(f"{field}: {value}")
    lines.append(f"logs: llmd logs -f ({launchd_log_dir() / 'llmd.log'})")
    return "\n".join(lines)


def _manager() -> str:
    if sys.platform.startswith("linux"):
        return "systemd"
    if sys.platform == "darwin":
        return "launchd"
    raise LlmdError(UNSUPPORTED)


def preview() -> str:
    """The unit (Linux) or plist (macOS) that :func:`install` would write; touches nothing."""
    if _manager() == "systemd":
        return render_systemd_unit(sys.executable)
    return render_launchd_plist(sys.executable, launchd_log_dir())


def install(start: bool = True) -> str:
    """Install and enable the service for the current user (and start it unless ``start`` is False).

    Returns:
        What was done, for the user, including a warning if a hand-started daemon holds the socket.
    Raises:
        LlmdError: unsupported system, no service manager reachable, or one of its commands failed.
    """
    return _systemd_install(start) if _manager() == "systemd" else _launchd_install(start)


def uninstall() -> str:
    """Stop, disable and remove the service. Raises LlmdError if it is not installed."""
    return _systemd_uninstall() if _manager() == "systemd" else _launchd_uninstall()


def status() -> str:
    """Whether the service is installed, enabled and running, and where its logs are."""
    return _systemd_status() if _manager() == "systemd" else _launchd_status()


def cmd_service(args: argparse.Namespace) -> int:
    if args.service_command == "install":
        text = preview() if args.print_only else install(start=args.start)
    else:
        text = uninstall() if args.service_command == "uninstall" else status()
    print(text.rstrip("\n"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Register ``llmd service install|uninstall|status`` on the CLI's subcommands."""
    service = sub.add_parser("service", help="run the daemon as a user service (systemd on Linux, launchd on macOS)",
                             description="Install the daemon as a service of the current user: it starts with "
                                         "your session and is restarted if it crashes. Its settings come from "
                                         "~/.config/llmd/config.toml.")
    actions = service.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    inst = actions.add_parser("install", help="install, enable and start the service")
    inst.add_argument("--no-start", dest="start", action="store_false", help="enable it but do not start it now")
    inst.add_argument("--print", dest="print_only", action="store_true",
                      help="print the unit (or plist) that would be installed, and change nothing")
    actions.add_parser("uninstall", help="stop, disable and remove the service")
    actions.add_parser("status", help="is the service installed, enabled and running")
    service.set_defaults(func=cmd_service)
