"""`llmd service`: the rendered systemd unit and launchd plist, and install/uninstall/status driven
against fake `systemctl` / `launchctl` scripts put first on PATH (they record their arguments)."""

from __future__ import annotations

import argparse
import json
import os
import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmd import paths, service
from llmd.errors import LlmdError

RECORD = '#!/bin/bash\necho "$*" >> "$FAKE_CALLS"\n'
FAKE_SYSTEMCTL = RECORD + 'case "$2" in is-enabled) echo enabled;; is-active) echo active;; esac\n'
FAKE_LAUNCHCTL = RECORD + """if [ "$1" = print ]; then
  if [ -n "$FAKE_LOADED" ]; then printf 'gui/501/io.llmd.daemon = {\\n\\tstate = running\\n\\tpid = 4242\\n}\\n'; exit 0; fi
  echo "Could not find service" >&2; exit 113
fi
"""
NO_BUS = RECORD + 'echo "Failed to connect to bus: No medium found" >&2\nexit 1\n'


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME, XDG_CONFIG_HOME and runtime dir, and a bin dir first on PATH for fakes."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("LLMD_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls"))
    monkeypatch.delenv("FAKE_LOADED", raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sys, "platform", "linux")
    return home


def fake(home: Path, name: str, script: str) -> None:
    path = home.parent / "bin" / name
    path.write_text(script)
    path.chmod(0o755)


def calls(home: Path) -> list[str]:
    path = home.parent / "calls"
    return path.read_text().splitlines() if path.exists() else []


def unit_file(home: Path) -> Path:
    return home / ".config" / "systemd" / "user" / "llmd.service"


def test_unit_runs_this_python_attached_and_restarts_on_failure() -> None:
    text = service.render_systemd_unit("/opt/venv/bin/python")
    assert "\nExecStart=/opt/venv/bin/python -m llmd start --foreground\n" in text
    for line in ("Type=exec", "Restart=on-failure", "Nice=10", "StandardError=journal", "WantedBy=default.target",
                 "Environment=PYTHONUNBUFFERED=1"):
        assert f"\n{line}\n" in text
    assert int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1)) > 10  # the daemon drains for 10 s
    assert re.search(r"^MemoryMax=\d+%$", text, re.M) and re.search(r"^MemoryHigh=\d+%$", text, re.M)
    assert "@" not in text


def test_unit_quotes_a_path_with_spaces_and_escapes_percent() -> None:
    text = service.render_systemd_unit("/home/a b/100%/python")
    assert '\nExecStart="/home/a b/100%%/python" -m llmd start --foreground\n' in text


def test_unit_refuses_a_path_systemd_cannot_run() -> None:
    with pytest.raises(LlmdError, match="plain path"):
        service.render_systemd_unit('/home/it"s/python')


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("dirname", ["venv", "my venv 100%"])
def test_systemd_analyze_accepts_the_unit(tmp_path: Path, dirname: str) -> None:
    python = tmp_path / dirname / "python"
    python.parent.mkdir()
    python.symlink_to(os.path.realpath(sys.executable))
    unit = tmp_path / "llmd.service"
    unit.write_text(service.render_systemd_unit(str(python)))
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    proc = subprocess.run(["systemd-analyze", "--user", "verify", str(unit)], capture_output=True, text=True,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert proc.returncode == 0, proc.stderr
    assert "llmd.service" not in proc.stderr + proc.stdout  # no "Unknown key ..., ignoring" warnings either


def test_plist_parses_and_runs_this_python(tmp_path: Path) -> None:
    python, log_dir = "/Users/a&b/<venv>/bin/python", Path("/Users/a&b/Library/Logs/llmd")
    plist = plistlib.loads(service.render_launchd_plist(python, log_dir).encode())
    assert plist["Label"] == service.LAUNCHD_LABEL
    assert plist["ProgramArguments"] == [python, "-m", "llmd", "start", "--foreground",
                                         "--log-file", str(log_dir / "llmd.log")]
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    assert plist["Nice"] == 10 and plist["EnvironmentVariables"] == {"PYTHONUNBUFFERED": "1"}
    # launchd's own capture only sees what comes before the daemon opens its rotated log.
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(log_dir / "launchd.log")


def test_linux_install_writes_the_unit_then_reloads_and_enables(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    text = service.install()
    assert unit_file(home).read_text() == service.render_systemd_unit(sys.executable)
    assert calls(home) == ["--user daemon-reload", "--user enable --now llmd.service"]
    assert "journalctl --user -u llmd -f" in text and "warning" not in text


def test_linux_install_no_start_only_enables(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    service.install(start=False)
    assert calls(home) == ["--user daemon-reload", "--user enable llmd.service"]


def test_linux_status(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    assert "not installed" in service.status() and calls(home) == []
    service.install()
    text = service.status()
    assert "enabled: enabled" in text and "active: active" in text and "journalctl --user -u llmd -f" in text
    assert calls(home)[2:] == ["--user is-active llmd.service", "--user is-enabled llmd.service"]


def test_linux_uninstall_disables_and_removes(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    service.install()
    service.uninstall()
    assert not unit_file(home).exists()
    assert calls(home)[2:] == ["--user disable --now llmd.service", "--user daemon-reload"]


def test_uninstall_when_not_installed(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    with pytest.raises(LlmdError, match="llmd service is not installed"):
        service.uninstall()
    assert calls(home) == []


def test_no_user_bus_is_one_line_about_linger_and_leaves_nothing(home: Path) -> None:
    fake(home, "systemctl", NO_BUS)
    with pytest.raises(LlmdError) as err:
        service.install()
    assert "\n" not in str(err.value) and "loginctl enable-linger" in str(err.value)
    assert "Failed to connect to bus" in str(err.value)
    assert not unit_file(home).exists()


def test_failing_systemctl_shows_its_first_line(home: Path) -> None:
    fake(home, "systemctl", RECORD + '[ "$2" = enable ] && { printf "Failed to enable unit: boom\\nmore\\n" >&2; exit 1; }\n'
         "exit 0\n")
    with pytest.raises(LlmdError, match=r"enable --now llmd.service` failed: Failed to enable unit: boom$"):
        service.install()


def test_no_systemctl(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(home.parent / "bin"))
    with pytest.raises(LlmdError, match="systemctl not found"):
        service.install()
    assert not unit_file(home).exists()


def test_install_warns_about_a_daemon_started_by_hand(home: Path) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    run_dir = Path(os.environ["LLMD_RUNTIME_DIR"])
    run_dir.mkdir(mode=0o700)
    (run_dir / paths.CONNECTION_FILE).write_text(json.dumps({"pid": os.getpid()}))
    (run_dir / paths.CONNECTION_FILE).chmod(0o600)  # as the daemon writes it: a file open to others is not believed
    text = service.install()
    assert f"pid {os.getpid()}" in text and "llmd stop" in text
    assert calls(home) == ["--user daemon-reload", "--user enable --now llmd.service"]


def test_macos_install_writes_the_agent_and_bootstraps_it(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    fake(home, "launchctl", FAKE_LAUNCHCTL)
    service.install()
    plist_path = home / "Library" / "LaunchAgents" / "io.llmd.daemon.plist"
    plist = plistlib.loads(plist_path.read_bytes())
    assert plist["ProgramArguments"][0] == sys.executable
    assert plist["ProgramArguments"][-1] == str(home / "Library" / "Logs" / "llmd" / "llmd.log")
    assert (home / "Library" / "Logs" / "llmd").is_dir()
    target = f"gui/{os.getuid()}/io.llmd.daemon"
    assert calls(home) == [f"print {target}", f"enable {target}", f"bootstrap gui/{os.getuid()} {plist_path}"]


def test_macos_reinstall_status_and_uninstall_when_loaded(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    fake(home, "launchctl", FAKE_LAUNCHCTL)
    service.install()
    monkeypatch.setenv("FAKE_LOADED", "1")
    target = f"gui/{os.getuid()}/io.llmd.daemon"
    service.install()
    assert calls(home)[3:6] == [f"print {target}", f"bootout {target}", f"enable {target}"]
    text = service.status()
    assert "state: running" in text and "pid: 4242" in text
    service.uninstall()
    assert calls(home)[-1] == f"bootout {target}"
    assert not (home / "Library" / "LaunchAgents" / "io.llmd.daemon.plist").exists()


@pytest.mark.parametrize("action", [service.install, service.uninstall, service.status, service.preview])
def test_unsupported_platform(home: Path, monkeypatch: pytest.MonkeyPatch, action) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(LlmdError, match=r"systemd \(Linux\) and launchd \(macOS\).*llmd start"):
        action()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    service.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_print_shows_the_unit_and_touches_nothing(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    assert service.cmd_service(parse("service", "install", "--print")) == 0
    assert capsys.readouterr().out == service.render_systemd_unit(sys.executable)
    assert not unit_file(home).exists() and calls(home) == []


def test_cli_install_no_start_and_status(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake(home, "systemctl", FAKE_SYSTEMCTL)
    args = parse("service", "install", "--no-start")
    assert args.func is service.cmd_service and args.start is False
    assert args.func(args) == 0
    assert calls(home)[-1] == "--user enable llmd.service"
    assert service.cmd_service(parse("service", "status")) == 0
    assert "active: active" in capsys.readouterr().out


def test_cli_service_needs_an_action() -> None:
    with pytest.raises(SystemExit) as exc:
        parse("service")
    assert exc.value.code == 2
