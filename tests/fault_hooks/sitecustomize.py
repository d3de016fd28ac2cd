"""Faults for the daemons the tests start, kept out of the product: a test puts this folder on the
daemon's PYTHONPATH (tests/daemon_helpers.py: fault_env), so Python imports this module at start-up
in every process of that daemon, and the variables below take effect there.

LLMD_TEST_FAULT_STEP=N: the engine's N-th step raises (the daemon must fail the requests in flight
and recover).
"""

from __future__ import annotations

import os

_FAULT_STEP = int(os.environ.get("LLMD_TEST_FAULT_STEP", "0") or 0)

if _FAULT_STEP:
    from llmd.daemon.engine import engine as _engine  # imports torch: only in a daemon that asked

    _step = _engine.LLMEngine.step
    _calls = [0]

    def _faulty_step(self):  # type: ignore[no-untyped-def]
        _calls[0] += 1
        if _calls[0] == _FAULT_STEP:
            raise RuntimeError("injected fault (LLMD_TEST_FAULT_STEP)")
        return _step(self)

    _engine.LLMEngine.step = _faulty_step
