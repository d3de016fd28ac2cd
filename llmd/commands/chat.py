"""``llmd chat``: the terminal UI (llmd.tui) on the running daemon, starting one first if asked."""

from __future__ import annotations

import argparse
import sys

from llmd.commands.daemon_process import start_background
from llmd.commands.flags import add_settings_flags
from llmd.errors import LlmdError


def register(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with the daemon in a terminal UI, next to a live view of the engine",
                          description="A terminal chat with the running daemon, and a dashboard of what the "
                                      "engine is doing: KV blocks, throughput, requests. Keys: F1.")
    chat.add_argument("--start", action="store_true",
                      help="start the daemon (on --model, default SmolLM2-135M) if none is running, without asking")
    add_settings_flags(chat, ["model", "socket_dir"])
    chat.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmd.config import remote_tables, runtime_dir
    from llmd.paths import read_connection_file

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LlmdError("llmd chat needs a terminal; for one answer without it use `llmd generate PROMPT`")
    run_dir = runtime_dir(args.socket_dir)
    connection = read_connection_file(run_dir)
    # --model on a running daemon, or a remote model (config [remote."NAME"]): the chat's requests name
    # it (the daemon loads it beside its default, or forwards to its server); else the daemon starts on it
    remote = bool(args.model) and args.model.casefold() in {n.casefold() for n in remote_tables()}
    chat_model = args.model if args.model and (connection is not None or remote) else None
    if connection is None:
        if not args.start:
            try:
                answer = input("llmd: no daemon is running. Start one now"
                               f"{' on ' + args.model if args.model else ' on the default model'}? [Y/n] ")
            except EOFError:
                answer = "n"
            if answer.strip().lower() not in ("", "y", "yes"):
                print("llmd: not started; `llmd start` starts it, `llmd chat --start` starts it and opens the chat",
                      file=sys.stderr)
                return 1
        # (the other settings: the config's)
        start = argparse.Namespace(socket_dir=str(run_dir), model=None if remote else args.model)
        start_background(start, progress=lambda line: print(f"  {line}", flush=True))
        connection = read_connection_file(run_dir)
        if connection is None:
            raise LlmdError("the daemon started but its connection file is gone; see `llmd status`")
    from llmd.tui.app import run_chat

    code = run_chat(connection, model=chat_model)
    print("llmd: the daemon keeps running for other clients; `llmd stop` stops it", file=sys.stderr)
    return code
