"""``llmd config show|path``: the effective settings and where each comes from; the config
file's path."""

from __future__ import annotations

import argparse
from typing import Any

from llmd.commands.flags import add_settings_flags, settings_of
from llmd.config import RemoteTable


def register(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="the effective configuration and where each value comes from",
                            description="Settings come from flags, then LLMD_<KEY> environment variables, then "
                                        "the config file ($LLMD_CONFIG, else $XDG_CONFIG_HOME/llmd/config.toml), "
                                        "then the defaults.")
    config_sub = config.add_subparsers(dest="config_command", metavar="{show,path}", required=True)
    show = config_sub.add_parser("show", help="print every setting, its value and its source; the flags of "
                                              "`llmd start` show their effect")
    add_settings_flags(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=run_show)
    config_sub.add_parser("path", help="print where the config file is (or would be)").set_defaults(func=run_path)


def run_show(args: argparse.Namespace) -> int:
    import json

    from llmd.config import OPTIONS, config_path

    settings = settings_of(args)
    if args.json:
        values = {k: "(set, hidden)" if OPTIONS[k].secret and v is not None else v for k, v in settings.values.items()}
        remotes = {name: _remote(t) for name, t in settings.remotes.items()}
        print(json.dumps({"config_file": str(config_path()), "values": values, "sources": settings.sources,
                          "sampling_defaults": settings.sampling, "remote": remotes}))
        return 0
    path = config_path()
    print(f"config file: {path}{'' if path.exists() else ' (none; every value below is a flag or a default)'}")
    print(settings.table())
    if settings.sampling:
        shown = ", ".join(f"{k} = {v}" for k, v in settings.sampling.items())
        print(f"sampling defaults of the model (its [models.\"NAME\"] table): {shown}")
    for name, table in settings.remotes.items():
        r = _remote(table)
        print(f"remote model {name}: {r['model']} at {r['url']}, key {r['key']}, timeouts {r['connect_timeout']:g}s "
              f"to connect, {r['read_timeout']:g}s silent")
    return 0


def _remote(table: RemoteTable) -> dict[str, Any]:
    """A ``[remote."NAME"]`` table as ``config show`` prints it: where its key comes from, never the key."""
    key = f"${table.api_key_env}" if table.api_key_env else table.api_key_file or "(none)"
    return {"url": table.url, "model": table.model, "key": key, "connect_timeout": table.connect_timeout,
            "read_timeout": table.read_timeout, "context_length": table.context_length}


def run_path(args: argparse.Namespace) -> int:
    from llmd.config import config_path

    print(config_path())
    return 0
