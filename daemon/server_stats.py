"""What the daemon reports about itself (docs/protocol.md): ``stats`` replies and the published
stats stream (the engine's counters and the daemon's own), ``info`` replies, and the dashboard's
live view, whose rows name requests by public ids and clients by numbers (a request id is private
to its client)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from typing import Any

from llmd import __version__
from llmd.daemon.engine.engine import LLMEngine
from llmd.daemon.intake import LiveRequest
from llmd.daemon.request_metrics import RequestMetrics


class ServerStats:
    """Args:
        engine: the engine reported on.
        info: what ``info`` replies say about the model (the connection file's fields).
        limits: the daemon's limits ``info`` reports (``max_queue_len``, ``idle_unload_s``).
    """

    def __init__(self, engine: LLMEngine, info: dict[str, Any], limits: Mapping[str, Any]) -> None:
        self.engine, self.model_info, self.limits = engine, info, dict(limits)
        self.started = time.time()
        self._public_ids = itertools.count(1)
        self._owners: dict[bytes, int] = {}  # client -> its number in the stats stream
        self._owner_numbers = itertools.count(1)
        self.requests = RequestMetrics()

    def new_public_id(self, identity: bytes) -> str:
        """The public id of a client's new request; numbers the client if it is new."""
        if identity not in self._owners:
            self._owners[identity] = next(self._owner_numbers)
        return f"r{next(self._public_ids)}"

    def stats(self, live: Mapping[str, LiveRequest], **daemon: Any) -> dict[str, Any]:
        """The engine's counters, uptime, the clients with requests in flight, and ``daemon``'s
        own counters (dropped messages, step failures, stopping, the model's state...)."""
        s = self.engine.stats().to_dict()
        s.update(uptime_s=time.time() - self.started, num_clients=len({r.identity for r in live.values()}),
                 **self.requests.to_dict(), **daemon)
        return s

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {**self.model_info, "version": __version__, "pid": os.getpid(), "started": self.started,
                "max_model_len": engine.max_model_len, "block_size": engine.config.block_size,
                "num_blocks": engine.num_blocks, "speculative": engine.config.speculative, **self.limits}

    def live_view(self, live: Mapping[str, LiveRequest]) -> dict[str, Any]:
        """The block map and request table of the published stats (docs/protocol.md)."""
        blocks, rows = self.engine.live_view()
        active = {r.identity for r in live.values()}
        self._owners = {i: n for i, n in self._owners.items() if i in active}
        requests = []
        for row in rows:
            request = live.get(row.request_id)
            entry = row.to_dict()
            entry["id"] = request.public_id if request else "?"
            entry["owner"] = self._owners.get(request.identity, 0) if request else 0
            del entry["request_id"]  # the client's own id, private to it
            requests.append(entry)
        return {"block_map": blocks, "requests": requests}
