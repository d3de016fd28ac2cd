"""Faults for the daemons the tests start, kept out of the product: a test puts this folder on the
daemon's PYTHONPATH (tests/daemon_helpers.py: fault_env), so Python imports this module at start-up
in every process of that daemon, and the variables below take effect there.

LLMD_TEST_FAULT_STEP=N: the engine's N-th step raises (the daemon must fail the requests in flight
and recover).
LLMD_TEST_STEP_DELAY_S=S: every engine step takes S seconds longer (a slow model: a request then
lasts long enough for the 4-a-second stats to see it, however loaded the machine is).
"""

from __future__ import annotations

import os

_FAULT_STEP = int(os.environ.get("LLMD_TEST_FAULT_STEP", "0") or 0)
_STEP_DELAY_S = float(os.environ.get("LLMD_TEST_STEP_DELAY_S", "0") or 0)

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

if _STEP_DELAY_S:
    import time

    from llmd.daemon.engine import engine as _engine

    _slow_step = _engine.LLMEngine.step

    def _delayed_step(self):  # type: ignore[no-untyped-def]
        time.sleep(_STEP_DELAY_S)
        return _slow_step(self)

    _engine.LLMEngine.step = _delayed_step
