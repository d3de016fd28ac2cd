"""The daemon's models (daemon/model_set.py) on fakes: builds on demand, at most max_loaded models
and max_bytes of weights and KV pools held, the least recently used idle one unloaded to make room,
busy ones never, and the models with work stepped in turn."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from llmd.daemon.model_set import ModelSet

pytestmark = pytest.mark.profile_independent


@dataclass
class FakeEngine:
    is_loaded: bool = True
    work: int = 0  # requests queued or running

    def has_unfinished(self) -> bool:
        return self.work > 0


@dataclass
class FakeLifecycle:
    engine: FakeEngine
    unloads: list[str] = field(default_factory=list)
    is_loading: bool = False

    @property
    def state(self) -> str:
        return "loaded" if self.engine.is_loaded else "unloaded"

    def unload(self, why: str = "", reclaim: bool = True) -> None:
        assert not reclaim  # (an eviction: the next model takes the memory)
        self.unloads.append(why)
        self.engine.is_loaded = False

    def tick(self, busy: bool, may_load: bool = True) -> None:
        if not self.engine.is_loaded and self.engine.has_unfinished() and may_load:
            self.engine.is_loaded = True  # (a reload, at once)

    def join(self) -> None:
        pass


class FakeModel:
    def __init__(self, name: str, size: int = 10) -> None:
        self.name, self.size = name, size
        self.engine = FakeEngine()
        self.lifecycle = FakeLifecycle(self.engine)
        self.last_used = time.monotonic()

    def footprint(self) -> int:
        return self.size

    def describe(self) -> dict:
        return {"name": self.name, "state": self.lifecycle.state}

    def close(self) -> None:
        pass


def make(max_loaded: int = 2, max_bytes: int = 0, sizes: dict[str, int] | None = None) -> ModelSet:
    sizes = sizes or {}
    return ModelSet(FakeModel("a", sizes.get("a", 10)), load=lambda name: FakeModel(name, sizes.get(name, 10)),
                    check=lambda name: None, max_loaded=max_loaded, aliases=("A model",), max_bytes=max_bytes,
                    estimate=lambda name: sizes.get(name, 10))


def settle(models: ModelSet, busy=lambda m: False) -> list[str]:
    """Tick until the builds asked for are done; the names built."""
    built = []
    for _ in range(200):
        ready, failures = models.tick(busy)
        assert not failures
        built += [m.name for m in ready]
        if not models._building and not models._wanted:
            return built
        time.sleep(0.005)
    return built


def loaded(models: ModelSet) -> set[str]:
    return {m.name for m in models.loaded()}


def test_names_and_builds_on_demand() -> None:
    models = make()
    assert models.get(None) is models.get("a") is models.get("a model") is models.default  # its aliases
    assert models.get("b") is None
    models.want("b")
    models.want("b")  # asked twice: built once
    assert settle(models) == ["b"] and loaded(models) == {"a", "b"}


def test_the_least_recently_used_idle_model_makes_room() -> None:
    models = make(max_loaded=2)
    models.want("b")
    settle(models)
    models.models["a"].last_used = time.monotonic() + 1  # a used after b
    models.want("c")
    assert settle(models) == ["c"] and loaded(models) == {"a", "c"}
    assert "room for another model (at most 2 loaded): b" in models.models["b"].lifecycle.unloads[0]
    # b's request queues in its engine: a (now the least recently used idle one) makes room for its reload
    models.models["c"].last_used = time.monotonic() + 2
    models.models["b"].engine.work = 1
    settle(models)
    assert loaded(models) == {"b", "c"}


def test_a_busy_model_is_never_unloaded_the_load_waits() -> None:
    models = make(max_loaded=1)
    busy = {"a"}
    models.want("b")
    for _ in range(5):
        models.tick(lambda m: m.name in busy)
    assert loaded(models) == {"a"} and models._wanted == ["b"]  # waiting, nothing unloaded
    busy.clear()
    assert settle(models) == ["b"] and loaded(models) == {"b"}


def test_the_byte_budget_counts_weights_and_pools() -> None:
    models = make(max_loaded=8, max_bytes=100, sizes={"a": 60, "b": 30, "c": 50, "huge": 500})
    models.want("b")
    settle(models)
    assert loaded(models) == {"a", "b"}  # 90 of 100
    models.models["b"].last_used = time.monotonic() + 1
    models.want("c")  # 50 more: a (least recently used) goes, b stays: 80
    settle(models)
    assert loaded(models) == {"b", "c"}
    busy = {"b"}
    models.want("huge")  # more than the budget alone: it waits while anything busy holds memory...
    for _ in range(5):
        models.tick(lambda m: m.name in busy)
    assert loaded(models) == {"b", "c"} and models._wanted == ["huge"]  # (c kept: unloading it would not do)
    busy.clear()
    assert settle(models) == ["huge"] and loaded(models) == {"huge"}  # ...and loads alone


def test_models_with_work_are_stepped_in_turn() -> None:
    models = make()
    models.want("b")
    settle(models)
    assert models.next_to_step() is None  # no work anywhere
    models.models["a"].engine.work = models.models["b"].engine.work = 1
    turns = [models.next_to_step().name for _ in range(6)]
    assert sorted(turns) == ["a"] * 3 + ["b"] * 3 and turns[0] != turns[1]
    models.models["b"].engine.work = 0
    assert {models.next_to_step().name for _ in range(3)} == {"a"}


def test_a_failed_build_is_reported_and_its_name_can_be_asked_again() -> None:
    calls = []

    def load(name: str):
        calls.append(name)
        raise RuntimeError("no such weights")

    models = ModelSet(FakeModel("a"), load=load, check=lambda name: None, max_loaded=2)
    models.want("b")
    for _ in range(200):
        _, failures = models.tick(lambda m: False)
        if failures:
            break
        time.sleep(0.005)
    assert [(n, str(e)) for n, e in failures] == [("b", "no such weights")] and models.get("b") is None
    models.want("b")
    for _ in range(200):
        if models.tick(lambda m: False)[1]:
            break
        time.sleep(0.005)
    assert calls == ["b", "b"]
