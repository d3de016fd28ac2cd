"""The model's life in the daemon: unloaded after ``idle_unload_s`` without work, loaded again by
a worker thread when work arrives (the loop keeps answering meanwhile; the requests that arrived
wait in the engine's queue, their queue time including the load)."""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


from llmd.daemon.engine.engine import LLMEngine
from llmd.daemon.process_memory import release_free_memory, rss_bytes

log = logging.getLogger("llmd.server")


class ModelLifecycle:
    """Args:
        engine: the engine whose model this unloads and loads again.
        idle_unload_s: free the model after this long without requests; 0: never.
        load_model: loads the model (and the draft model, or None) again the way they were loaded first
            (needed for an idle unload): ``(model, draft_model)``.
    """

    def __init__(self, engine: LLMEngine, idle_unload_s: float, load_model: Callable[[], Any] | None) -> None:
        if idle_unload_s and load_model is None:
            raise ValueError("idle unload needs a way to load the model again (load_model)")
        self.engine, self.idle_unload_s, self.load_model = engine, idle_unload_s, load_model
        self.last_active = time.monotonic()  # the last step or request
        self.num_unloads = 0
        self._loading: threading.Thread | None = None
        self._loaded: list[Any] = []  # the loader thread's result: [model] or [exception]

    @property
    def state(self) -> str:
        """``loaded``, ``unloaded`` (idle) or ``loading`` (a request is waiting for the reload)."""
        if self.engine.is_loaded:
            return "loaded"
        return "loading" if self._loading is not None else "unloaded"

    def tick(self, busy: bool, may_load: bool = True) -> BaseException | None:
        """Once a loop turn, ``busy`` if any of its requests is in flight: unload after
        ``idle_unload_s`` without work; start a reload once work waits (if ``may_load``: the daemon's
        other models leave room); take a finished reload. Returns why a reload failed (the caller
        fails the waiting requests), else None."""
        now = time.monotonic()
        if busy or self.engine.has_unfinished():
            self.last_active = now
        if self._loading is not None and not self._loading.is_alive():
            failure = self._finish_reload()
            if failure is not None:  # no new attempt before the caller has failed the waiting requests
                return failure
        if self.engine.is_loaded:
            if self.idle_unload_s and not busy and not self.engine.has_unfinished() \
                    and now - self.last_active >= self.idle_unload_s:
                self.unload()
        elif self.engine.has_unfinished() and self._loading is None and may_load:
            log.info("a request arrived: loading the model again")
            self._loaded = []
            self._loading = threading.Thread(target=self._reload_worker, name="llmd-reload", daemon=True)
            self._loading.start()
        return None

    def join(self) -> None:
        """Wait for a reload in flight (a daemon thread mid-load would die with the interpreter)."""
        if self._loading is not None:
            self._loading.join()

    def _reload_worker(self) -> None:
        start = time.monotonic()
        lower_priority()
        try:
            self._loaded.append(self.load_model())
            log.info("model loaded again in %.1fs", time.monotonic() - start)
        except BaseException as e:  # handed to the loop, which fails the waiting requests
            self._loaded.append(e)

    def _finish_reload(self) -> BaseException | None:
        self._loading = None
        result = self._loaded.pop() if self._loaded else RuntimeError("the loader returned nothing")
        if isinstance(result, BaseException):
            log.error("reloading the model failed: %s: %s", type(result).__name__, result)
            return result
        self.engine.load(*result)
        return None

    @property
    def is_loading(self) -> bool:
        return self._loading is not None

    def unload(self, why: str = "", reclaim: bool = True) -> None:
        """Free the model and its KV cache (the engine keeps its tokenizer and queue: work that arrives
        loads it again). ``reclaim``: also collect garbage and hand the allocator's free memory back
        to the system (~0.15 s holding the loop; the weights and the pool are freed without it, by
        reference counting): not when another model is about to take the memory (ModelSet's evictions)."""
        rss_before, start = rss_bytes(), time.monotonic()
        held = [self.engine.runner, self.engine.model]  # (the weights and the KV pool)
        self.engine.unload()
        if reclaim:
            held.clear()
            gc.collect()
            release_free_memory()
        else:
            # NOTE: dropped by a thread of the lowest priority: their frees (~15 ms for the default
            # model) overlap the loop's next step, whose kernels run without the interpreter's lock
            threading.Thread(target=_drop, args=(held,), name="llmd-free", daemon=True).start()
        del held
        self.num_unloads += 1
        freed = rss_before - rss_bytes()
        log.info("%s: unloaded the model and KV cache (%s, in %.0f ms); the next request loads it again",
                 why or f"idle for {time.monotonic() - self.last_active:.0f}s",
                 f"{freed / 2**20:.0f} MiB returned" if freed > 0 else "memory kept by the allocator",
                 1000 * (time.monotonic() - start))


def _drop(held: list[Any]) -> None:
    lower_priority()
    held.clear()


def lower_priority() -> None:
    """This thread's CPU priority, and that of the threads it starts (its OpenMP team for torch's and
    the native kernels' work), lowered to the least: a load shares the cores with the loop, whose
    steps serve the requests in flight and must not wait on it. NOTE: Linux's nice is per thread;
    elsewhere it is per process, so it is left alone."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
