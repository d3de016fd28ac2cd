"""``llmd start``: the daemon, in the background (detached, logging to a file) or, with
``--foreground``, in this process (systemd, debugging)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmd.commands.daemon_process import start_background
from llmd.commands.flags import add_settings_flags, settings_of
from llmd.commands.runtime import check_quant
from llmd.config import Settings
from llmd.errors import LlmdError

if TYPE_CHECKING:
    from llmd.http.front import HttpFront


def register(sub: argparse._SubParsersAction) -> None:
    start = sub.add_parser("start", help="start the daemon in the background",
                           description="Load a model and serve it to local clients over ZeroMQ. Flags override "
                                       "the config file (`llmd config show`).")
    add_settings_flags(start)
    start.add_argument("--foreground", action="store_true", help="stay attached (for systemd and debugging)")
    start.add_argument("--log-file", default=None, metavar="PATH",
                       help="with --foreground: log to this file, rotated, instead of stderr (the background "
                            "start logs to $XDG_STATE_HOME/llmd/llmd.log)")
    start.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # NOTE: the daemon's modules (torch among them, ~2 s) only where it runs: the background start
    # imports what checks its flags, starts the daemon and waits for it to answer
    from llmd.daemon.transport import check_tcp

    settings = settings_of(args)
    check_quant(settings["quant"], settings["group_size"])
    if settings["http"]:
        from llmd.http.front import check_http

        check_http(settings["http"], settings["allow_remote"], settings["api_key"])
    if not args.foreground:  # here too, so the warning reaches this terminal, not only the log
        check_tcp(settings["tcp"], settings["allow_remote"])
    if args.foreground:
        from llmd.daemon.serve import DaemonOptions, serve

        if args.log_file:
            from llmd.logs import log_to_file

            log_to_file(Path(args.log_file))
        try:
            options = DaemonOptions.from_settings(settings.values, log_file=args.log_file,
                                                  sampling_defaults=settings.sampling, remotes=settings.remotes)
        except ValueError as e:
            raise LlmdError(str(e)) from None
        return serve(options, _http_front(settings), _settings_for(args))
    return start_background(args, settings)


def _settings_for(args: argparse.Namespace) -> Any:
    """How the daemon loads another model a request names: this command's flags and the config file,
    with that model's table, as `llmd start --model NAME` would."""
    from llmd.config import OPTIONS, resolve
    from llmd.daemon.engine_args import EngineArgs

    flags = {name: getattr(args, name, None) for name in OPTIONS}

    def settings_for(name: str) -> tuple[EngineArgs, dict[str, Any]]:
        settings = resolve({**flags, "model": name})
        return EngineArgs.from_settings(settings.values), settings.sampling
    return settings_for


def _http_front(settings: Settings) -> HttpFront | None:
    """The HTTP API's server, its port taken now (a taken port fails before the model loads)."""
    if not settings["http"]:
        return None
    from llmd.http.front import HttpFront

    return HttpFront(settings["http"], settings["api_key"], settings["http_origins"]).bind()
