"""What the commands that build the runtime in this process share (``start``, ``generate`` and
``bench`` in process): the runtime's checks of settings and the settings as its front door takes
them. Apart from flags.py, so the commands that only talk to a daemon never import the runtime."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmd.config import Settings, check_quant_pair
from llmd.errors import LlmdError


def check_quant(quant: str, group_size: int | None) -> None:
    """``--quant`` with ``--group-size``, checked as the runtime checks them (without importing it:
    ``llmd start`` checks its flags before it starts the daemon)."""
    try:
        check_quant_pair(quant, group_size)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def runtime_settings(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """The runtime's settings (llmd.daemon.engine_args.EngineArgs) as ``llmd.LLM`` keywords: an
    in-process command builds the engine the daemon would."""
    from llmd.daemon.engine_args import EngineArgs

    return dataclasses.asdict(EngineArgs.from_settings(settings.values, **overrides))
