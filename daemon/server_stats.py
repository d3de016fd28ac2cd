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

import llmd
from llmd.daemon.intake import LiveRequest
from llmd.daemon.model_set import ModelSet
from llmd.daemon.remote_model import RemoteModel
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
        remotes: the remote models (listed in ``models`` after the local ones, with their health).
    """

    def __init__(self, models: ModelSet, info: dict[str, Any], limits: Mapping[str, Any],
                 remotes: list[RemoteModel] | None = None) -> None:
        self.models, self.model_info, self.limits = models, info, dict(limits)
        self.remotes = list(remotes or [])
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
                 **self.requests.to_dict(), models=self.describe_models(), **daemon)
        return s

    def describe_models(self) -> list[dict[str, Any]]:
        """``models``: the local ones (ModelSet.describe), then the remote ones."""
        return self.models.describe() + [r.describe() for r in self.remotes]

    def info(self, model: ServedModel | None = None) -> dict[str, Any]:
        """The daemon and its default model; with ``model``, that model instead of the default."""
        model = model or self.models.default
        engine = model.engine
        return {**self.model_info, **model.info, "name": model.name, "version": llmd.__version__, "pid": os.getpid(),
                "started": self.started, "max_model_len": engine.max_model_len, "block_size": engine.config.block_size,
                "num_blocks": engine.num_blocks, "speculative": engine.config.speculative,
                "models": self.describe_models(), **self.limits}

    def daemon_info(self) -> dict[str, Any]:
        """``info``'s fields of the daemon alone (a remote model's ``info`` adds its own)."""
        own = {k: self.model_info.get(k) for k in ("log_file", "journal", "http")}
        return {**own, "version": llmd.__version__, "pid": os.getpid(), "started": self.started,
                "models": self.describe_models(), **self.limits}

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
        now = time.monotonic()
        for request in live.values():  # a remote model's: no KV blocks here, its times measured here
            remote = request.remote
            if remote is None:
                continue
            rate = None
            if remote.first_text_at is not None and remote.num_chunks > 1 and now > remote.first_text_at:
                rate = (remote.num_chunks - 1) / (now - remote.first_text_at)
            requests.append({"id": request.public_id, "owner": self._owners.get(request.identity, 0), "state": "remote",
                             "prompt_tokens": request.num_prompt_tokens, "cached_tokens": 0,
                             "generated_tokens": remote.num_chunks, "tokens_per_s": rate,
                             "ttft": None if remote.first_text_at is None else remote.first_text_at - remote.sent_at,
                             "format": getattr(request.params.response_format, "kind", None),
                             "model": request.model_name})
        return {"block_map": blocks, "requests": requests}
