"""One model the daemon serves: its engine, the encoder of its prompts, what ``info`` says of it, its
requests' sampling defaults, and its life (unloaded when idle or to make room, loaded again when work
arrives: daemon/model_lifecycle.py). The daemon holds one or more (daemon/model_set.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from llmd.daemon.engine.engine import LLMEngine
from llmd.daemon.model_lifecycle import ModelLifecycle
from llmd.daemon.prompt_encoder import PromptEncoder


@dataclass(eq=False)
class ServedModel:
    """Args:
        name: how requests name it (``model`` in ``generate``): the ``--model`` value it was loaded by.
        engine: its engine (loaded, or unloaded with its tokenizer and queue kept).
        info: what ``info`` says of it (name, path, dtype, quantisation, KV cache, the sampling
            defaults its requests get for the parameters they leave out...).
        lifecycle: its unload and reload.
    """

    name: str
    engine: LLMEngine
    info: dict[str, Any]
    lifecycle: ModelLifecycle
    encoder: PromptEncoder = field(init=False)
    last_used: float = field(default_factory=time.monotonic)  # its last request or step: the LRU order

    def __post_init__(self) -> None:
        self.encoder = PromptEncoder(self.engine.tokenizer, self.engine.max_request_tokens)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """What its requests get for the sampling parameters they leave out (its config-file table)."""
        return self.info.get("sampling_defaults") or {}

    @property
    def state(self) -> str:
        """``loaded``, ``unloaded`` or ``loading``."""
        return self.lifecycle.state

    def close(self) -> None:
        self.lifecycle.join()
        self.encoder.close()

    def footprint(self) -> int:
        """What it holds loaded: its weights (``info``) and its KV pool's resident part, at least what
        the prefix cache may make resident (all of a pool whose size was given; a default CPU pool
        reserves more, which only sequences running at once write, and which stays written until
        the idle unload: counted once written)."""
        pool = int(self.info.get("kv_cache_bytes") or 0)
        blocks, target = self.info.get("kv_cache_blocks"), self.info.get("kv_cache_target_blocks")
        if blocks and target:
            pool = pool * max(int(target), self.engine.kv.pool.num_touched) // int(blocks)
        return int(self.info.get("weight_bytes") or 0) + pool

    def describe(self) -> dict[str, Any]:
        """Its entry in ``info``'s and the stats' ``models``."""
        engine = self.engine
        return {"name": self.name, "model": self.info.get("model"), "state": self.state,
                "max_model_len": engine.max_model_len, "num_running": len(engine.scheduler.running),
                "num_waiting": engine.num_waiting, "weight_bytes": self.info.get("weight_bytes"),
                "kv_cache_bytes": self.info.get("kv_cache_bytes")}
