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
from llmd.daemon.intake import LiveRequest
from llmd.daemon.model_set import ModelSet
from llmd.daemon.request_metrics import RequestMetrics
from llmd.daemon.served_model import ServedModel


class ServerStats:
    """The default model's engine is the one the counters, the block map and ``info``'s fields
    describe (as before a daemon served several); ``models`` lists them all, and the request table
    holds every model's requests.

    Args:
        models: the daemon's models.
        info: what ``info`` replies say about the daemon and its default model (the connection file's fields).
        limits: the daemon's limits ``info`` reports (``max_queue_len``, ``idle_unload_s``...).
    """

    def __init__(self, models: ModelSet, info: dict[str, Any], limits: Mapping[str, Any]) -> None:
        self.models, self.model_info, self.limits = models, info, dict(limits)
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
        s = self.models.default.engine.stats().to_dict()
        s.update(uptime_s=time.time() - self.started, num_clients=len({r.identity for r in live.values()}),
                 **self.requests.to_dict(), models=self.models.describe(), **daemon)
        return s

    def info(self, model: ServedModel | None = None) -> dict[str, Any]:
        """The daemon and its default model; with ``model``, that model instead of the default."""
        model = model or self.models.default
        engine = model.engine
        return {**self.model_info, **model.info, "name": model.name, "version": __version__, "pid": os.getpid(),
                "started": self.started, "max_model_len": engine.max_model_len, "block_size": engine.config.block_size,
                "num_blocks": engine.num_blocks, "speculative": engine.config.speculative,
                "models": self.models.describe(), **self.limits}

    def live_view(self, live: Mapping[str, LiveRequest]) -> dict[str, Any]:
        """The default model's block map and every model's request table (docs/protocol.md)."""
        blocks, _ = self.models.default.engine.live_view()
        active = {r.identity for r in live.values()}
        self._owners = {i: n for i, n in self._owners.items() if i in active}
        requests = []
        for model in self.models.models.values():
            if not model.engine.is_loaded:
                continue
            for row in model.engine.live_view()[1]:
                request = live.get(row.request_id)
                entry = row.to_dict()
                entry["id"] = request.public_id if request else "?"
                entry["owner"] = self._owners.get(request.identity, 0) if request else 0
                entry["model"] = model.name
                del entry["request_id"]  # the client's own id, private to it
                requests.append(entry)
        return {"block_map": blocks, "requests": requests}
