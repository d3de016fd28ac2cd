"""The ``llmd`` commands, one module each: ``register(subparsers)`` adds its parser (flags of
settings come from the option registry, llmd/commands/flags.py) with the function that runs it.
The order here is the order of ``llmd --help``."""

from __future__ import annotations

from llmd import service
from llmd.commands import bench, chat, config, generate, logs, models, pull, rm, start, status, stop

COMMANDS = (generate, start, config, stop, chat, bench, service, models, pull, rm, logs, status)
