"""``llmd logs``: the daemon's log (its rotated file, or the service's journal), and with ``-f``
what it writes next."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmd.commands.flags import add_settings_flags, non_negative_int
from llmd.errors import LlmdError


def register(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser("logs", help="print the daemon's log (-f: and follow it)",
                          description="The log of the daemon `llmd start` started ($XDG_STATE_HOME/llmd/llmd.log, "
                                      "rotated); for the systemd service, its journal.")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    logs.add_argument("-n", "--lines", type=non_negative_int, default=50, help="how many of the last lines (default: 50)")
    add_settings_flags(logs, ["socket_dir"])
    logs.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shutil

    from llmd.config import runtime_dir
    from llmd.logs import follow, last_lines
    from llmd.paths import log_file, read_connection_file

    running = read_connection_file(runtime_dir(args.socket_dir, create=False))
    if running is not None and "log_file" in running and running["log_file"] is None:
        if running.get("journal") and shutil.which("journalctl"):
            argv = ["journalctl", "--user", "-u", "llmd.service", "-n", str(args.lines)] + (["-f"] if args.follow else [])
            os.execvp(argv[0], argv)
        raise LlmdError(f"the running daemon (pid {running['pid']}) logs to its standard error, not to a file: it was "
                        "started with --foreground" + (" by systemd; see `journalctl --user -u llmd`"
                                                       if running.get("journal") else ""))
    path = Path(running["log_file"]) if running is not None and running.get("log_file") else log_file()
    if not path.is_file():
        raise LlmdError(f"no log yet at {path}: `llmd start` writes it")
    lines, end = last_lines(path, args.lines)
    for line in lines:
        print(line)
    if args.follow:
        sys.stdout.flush()
        try:
            follow(path, lambda line: print(line, flush=True), offset=end)
        except KeyboardInterrupt:
            return 0
    return 0
