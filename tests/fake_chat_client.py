"""A scripted stand-in for ``llmd.AsyncClient`` for the `llmd chat` tests: answers are streamed word
by word from a script, every request and cancellation is recorded, and stats come from a queue the
test fills (or stops filling, to play a daemon that died)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from llmd.client import Delta, Result, ServerError

INFO = {"model": "SmolLM2-135M-Instruct (Q4_1)", "device": "cpu", "dtype": "bfloat16",
        "quantization": "int4 g32 (GGUF Q4_1 blocks)", "weight_bytes": 117 << 20, "num_blocks": 64, "block_size": 16}


def stats_message(block_map: bytes, requests: list[dict[str, Any]], decode: float = 0.0) -> dict[str, Any]:
    return {"num_blocks": len(block_map), "block_size": 16, "num_running": len(requests), "num_waiting": 0,
            "num_preemptions": 0, "prefix_cache_hit_rate": 0.25, "prefill_tokens_per_s": 2 * decode,
            "decode_tokens_per_s": decode, "block_map": block_map, "requests": requests}


def request_row(public_id: str, owner: int = 1, generated: int = 3) -> dict[str, Any]:
    return {"id": public_id, "owner": owner, "state": "running", "prompt_tokens": 20, "cached_tokens": 16,
            "generated_tokens": generated, "tokens_per_s": 31.5, "ttft": 0.12}


class FakeClient:
    def __init__(self, answers: list[str] | None = None, word_delay: float = 0.0, error: ServerError | None = None):
        self.answers = list(answers or ["Paris is the **capital** of France."])
        self.word_delay = word_delay
        self.error = error
        self.requests: list[dict[str, Any]] = []  # messages + params of each chat request
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.stats: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._ids = 0

    async def info(self) -> dict[str, Any]:
        return dict(INFO)

    async def subscribe_stats(self, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        while True:
            yield await self.stats.get()

    async def chat(self, messages: list[dict[str, str]], on_accepted=None, priority: int = 0, model: str | None = None,
                   **params: Any) -> AsyncIterator[Delta | Result]:
        self._ids += 1
        rid = f"r{self._ids}"
        self.requests.append({"messages": [dict(m) for m in messages], "params": params, "priority": priority,
                              "model": model})
        if self.error is not None:
            raise self.error
        if on_accepted is not None:
            on_accepted({"request_id": rid, "prompt_tokens": 12, "id": rid})
        answer = self.answers[(self._ids - 1) % len(self.answers)]
        words = answer.split(" ")
        done = False
        try:
            for i, word in enumerate(words):
                await asyncio.sleep(self.word_delay)
                yield Delta(rid, word + (" " if i < len(words) - 1 else ""), [i], None)
            done = True
            self.finished.append(rid)
            yield Result(rid, answer, list(range(len(words))), "stop",
                         {"prompt_tokens": 12, "completion_tokens": len(words), "cached_tokens": 0},
                         {"queue_s": 0.0, "ttft_s": 0.05, "e2e_s": 0.2, "decode_tokens_per_s": 40.0})
        finally:
            if not done:
                self.cancelled.append(rid)
