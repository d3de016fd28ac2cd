"""The models one daemon serves (issue 25): the one it started with, the default for requests that
name none, and any other a request names (``model`` in ``generate``: a name from ``llmd models``, a
path, a cached repo id), loaded on demand.

A model not yet served is built by a worker thread (its tokenizer, weights and engine, as
``llmd start --model NAME`` would: its config-file table applies) while the loop goes on serving the
others; the requests for it wait (daemon/intake.py), their queue time including the load. At most
``max_loaded`` models hold their weights at once: to load one more, the least recently used model
with no request in flight is unloaded (its engine keeps its tokenizer and queue; a request for it
loads it again, daemon/model_lifecycle.py). With ``--max-models-mb``, their weights
and KV pools (reserved) must also fit that many MiB (a model not built yet is guessed by its files'
size and its KV setting). A load that must wait for room waits, and is started as soon as a model
falls idle.

Each model has its own engine and KV pool; the loop steps them in turn (one step each, round
robin, among those with work), so two busy models share the machine step for step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from llmd.daemon.model_lifecycle import lower_priority
from llmd.daemon.served_model import ServedModel

log = logging.getLogger("llmd.server")

MAX_MODEL_NAME_CHARS = 1024


class ModelSet:
    """Args:
        default: the model the daemon started with.
        load: builds a :class:`ServedModel` by its name (on a worker thread); None: only the default
            is served.
        check: raises an LlmdError at once when a name names no model (offline: no load).
        max_loaded: how many models may hold their weights at once.
        aliases: other names of the default model (its catalogue name, its display name).
        max_bytes: what the loaded models' weights and KV pools may take in all (0: no bound but
            ``max_loaded``).
        estimate: guesses a model's weights and KV pool before it is built, by its name.
    """

    def __init__(self, default: ServedModel, load: Callable[[str], ServedModel] | None = None,
                 check: Callable[[str], None] | None = None, max_loaded: int = 1,
                 aliases: tuple[str, ...] = (), max_bytes: int = 0,
                 estimate: Callable[[str], int] | None = None) -> None:
        if max_loaded < 1:
            raise ValueError("max_loaded_models must be at least 1")
        if max_bytes < 0:
            raise ValueError("max_models_mb must be >= 0 (0: no bound)")
        self.default, self._load, self._check, self.max_loaded = default, load, check, max_loaded
        self.max_bytes, self._estimate_bytes = max_bytes, estimate
        self._building_bytes: dict[str, int] = {}  # the builds in flight's estimates
        self.models: dict[str, ServedModel] = {default.name: default}
        self._aliases = {a.casefold() for a in (*aliases, default.name)}
        self._wanted: list[str] = []  # names to build, in the order asked
        self._building: dict[str, threading.Thread] = {}
        self._built: dict[str, ServedModel | BaseException] = {}
        self._turn = 0

    # ---- lookups ---------------------------------------------------------------------------------

    def key(self, name: str | None) -> str:
        """The name ``name`` is served under: the default's for None, empty, or one of its names."""
        if not name or name.casefold() in self._aliases:
            return self.default.name
        return name

    def get(self, name: str | None) -> ServedModel | None:
        """The model ``name`` names, if the daemon has built it (loaded or not)."""
        return self.models.get(self.key(name))

    def check(self, name: str) -> None:
        """Raises:
            LlmdError: ``name`` names no model this daemon can serve (said at once, before any load).
        """
        if self._load is None:
            from llmd.errors import ModelNotFoundError

            raise ModelNotFoundError(f"this daemon serves {self.default.name} only (it was started without a way to "
                                     "load others)")
        if self._check is not None:
            self._check(name)

    def want(self, name: str) -> None:
        """Build ``name`` (not served yet) when there is room; :meth:`tick` reports it ready."""
        key = self.key(name)
        if key not in self.models and key not in self._building and key not in self._wanted:
            self._wanted.append(key)

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.engine.is_loaded]

    def describe(self) -> list[dict[str, Any]]:
        """``info``'s and the stats' ``models``: the built ones, then those being built."""
        out = [{**m.describe(), "default": m is self.default} for m in self.models.values()]
        out += [{"name": name, "state": "loading", "default": False} for name in [*self._building, *self._wanted]]
        return out

    # ---- the loop ----------------------------------------------------------------------------------

    def next_to_step(self) -> ServedModel | None:
        """The next loaded model with work, in turn (round robin: a busy model cannot starve another)."""
        ready = [m for m in self.models.values() if m.engine.is_loaded and m.engine.has_unfinished()]
        if not ready:
            return None
        self._turn = (self._turn + 1) % len(ready)
        model = ready[self._turn]
        model.last_used = time.monotonic()
        return model

    def tick(self, busy: Callable[[ServedModel], bool]) -> tuple[list[ServedModel], list[tuple[str, BaseException]]]:
        """Once a loop turn: take finished builds, make room and start the builds and reloads that
        wait for it, run each model's idle unload. ``busy(model)``: a request of it is in flight.

        Returns:
            The models built since the last turn (their waiting requests can start), and the
            failures: ``(name, why)`` for a build or a reload that failed (their requests fail).
        """
        ready, failures = [], []
        for name, result in list(self._built.items()):
            del self._built[name]
            self._building.pop(name).join()
            self._building_bytes.pop(name, None)
            if isinstance(result, BaseException):
                log.error("loading %s failed: %s: %s", name, type(result).__name__, result)
                failures.append((name, result))
            else:
                self.models[name] = result
                ready.append(result)
        for model in self.models.values():
            if busy(model):
                model.last_used = time.monotonic()
        # reloads first (their requests are queued already), then new models, in the order asked
        for model in self.models.values():
            wants_load = not model.engine.is_loaded and model.engine.has_unfinished() and not model.lifecycle.is_loading
            failure = model.lifecycle.tick(busy(model), may_load=not wants_load or self._make_room(busy, model))
            if failure is not None:
                failures.append((model.name, failure))
        while self._wanted and self._make_room(busy, None, self._wanted[0]):
            self._start_build(self._wanted.pop(0))
        return ready, failures

    def close(self) -> None:
        for thread in self._building.values():
            thread.join()
        for model in self.models.values():
            model.close()

    def _make_room(self, busy: Callable[[ServedModel], bool], for_model: ServedModel | None,
                   name: str | None = None) -> bool:
        """Whether ``for_model`` (or the model ``name``, to be built) may load now, unloading least
        recently used idle models to make room: at most ``max_loaded`` models, and with ``max_bytes``
        their weights and KV pools within it. A model too large for the budget alone still loads
        when nothing else holds memory. NOTE: loads in flight count as loaded (their memory is about
        to be taken)."""
        need = for_model.footprint() if for_model is not None else self._estimate(name) if name else 0
        while True:
            holding = [m for m in self.models.values() if m.engine.is_loaded or m.lifecycle.is_loading]
            count = len(holding) + len(self._building)
            used = sum(m.footprint() for m in holding) + sum(self._building_bytes.values())
            fits_bytes = not self.max_bytes or used + need <= self.max_bytes or count == 0
            if count < self.max_loaded and fits_bytes:
                return True
            idle = [m for m in holding if m.engine.is_loaded and m is not for_model and not busy(m)
                    and not m.engine.has_unfinished()]
            rest = count - len(idle)  # (what stays however many idle models go: unload none in vain)
            rest_bytes = used - sum(m.footprint() for m in idle)
            if not idle or rest >= self.max_loaded or (self.max_bytes and rest and rest_bytes + need > self.max_bytes):
                return False
            victim = min(idle, key=lambda m: m.last_used)
            limit = f"at most {self.max_loaded} loaded" + (f", {self.max_bytes >> 20} MiB" if self.max_bytes else "")
            victim.lifecycle.unload(f"room for another model ({limit}): {victim.name}", reclaim=False)

    def _estimate(self, name: str) -> int:
        """What a model not built yet will hold (its weights and KV pool), as ``estimate`` guesses; 0
        without a guess."""
        if self._estimate_bytes is None:
            return 0
        try:
            return self._estimate_bytes(name)
        except Exception:  # (a guess: the build says what is wrong with the model)
            return 0

    def _start_build(self, name: str) -> None:
        load = self._load
        if load is None:  # (check refuses every other name then: not reached)
            raise RuntimeError(f"this daemon serves {self.default.name} only: {name} cannot be built")

        def build() -> None:
            start = time.monotonic()
            lower_priority()
            try:
                self._built[name] = load(name)
                log.info("loaded %s in %.1fs", name, time.monotonic() - start)
            except BaseException as e:  # handed to the loop, which fails the waiting requests
                self._built[name] = e

        log.info("a request names %s: loading it", name)
        self._building_bytes[name] = self._estimate(name)
        self._building[name] = thread = threading.Thread(target=build, name="llmd-load", daemon=True)
        thread.start()
