"""`llmd bench --url`: the same workloads against any OpenAI-compatible server (llmd's own HTTP API,
llama-server, vLLM...), so peers are measured by one tool.

Prompts go as token ids to ``/v1/completions`` (exact lengths, no chat template; ``edit``'s chats to
``/v1/chat/completions``), outputs ignore
end-of-text (``ignore_eos``, an extension llmd, llama-server and vLLM share), greedy, streamed. The
ids come from the server's own ``/tokenize`` (llmd and llama-server have it; vLLM too), so any
vocabulary works. Each streamed chunk with text is one arrival: llama-server sends a token per
chunk, llmd a step's tokens (several when drafts were accepted), so the inter-token gaps are
between chunks, and ``usage`` gives the exact counts, which the throughput uses. KV usage and
preemptions are the server's business and are not measured here.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from llmd.bench import BenchConfig, BenchRun, RequestPlan, RequestRecord, plan, summarise
from llmd.errors import LlmdError

WORDS = " ".join(f"w{i} alpha beta {i * 7}" for i in range(400))  # as run_bench's: the same kind of ids


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def base_of(url: str) -> str:
    """``http://host:port[/v1]`` -> the server's root (``/tokenize`` lives there, ``/v1`` below it)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _vocab_ids(client: Any, root: str) -> list[int]:
    r = await client.post(root + "/tokenize", json={"content": WORDS, "prompt": WORDS})
    if r.status_code != 200:
        raise LlmdError(f"{root}/tokenize answered {r.status_code}: the server must have a /tokenize endpoint "
                        "(llmd, llama-server and vLLM do)")
    body = r.json()
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids:
        raise LlmdError(f"{root}/tokenize gave no tokens: {str(body)[:200]}")
    return sorted({t if isinstance(t, int) else t["id"] for t in ids})


async def _model(client: Any, root: str) -> str:
    r = await client.get(root + "/v1/models")
    if r.status_code != 200:
        raise LlmdError(f"{root}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


async def _one(client: Any, root: str, model: str, req: RequestPlan, t0: float, ignore_eos: bool,
               record: RequestRecord, progress: Any) -> None:
    await asyncio.sleep(max(0.0, t0 + req.start_s - time.perf_counter()))
    body = {"model": model, "max_tokens": req.output_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if req.messages is not None:  # a chat (``edit``): the server applies its template
        path, body["messages"] = "/v1/chat/completions", req.messages
    else:
        path, body["prompt"] = "/v1/completions", req.prompt
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", root + path, json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    continue
                if chunk.get("usage"):
                    u = chunk["usage"]
                    record.usage = {"prompt_tokens": u.get("prompt_tokens", 0),
                                    "completion_tokens": u.get("completion_tokens", 0),
                                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
                if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    record.token_times.append(time.perf_counter())
                    if progress is not None:
                        progress.update(1)
    except Exception as e:  # a refused connection, a reset: this request failed, the run goes on
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.end = time.perf_counter()


async def run_bench_http(url: str, config: BenchConfig, api_key: str | None = None,
                         show_progress: bool = False) -> BenchRun:
    """Run ``config`` against the OpenAI-compatible server at ``url``."""
    import httpx

    root = base_of(url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), headers=_headers(api_key),
                                 limits=limits) as client:
        try:
            vocab_ids = await _vocab_ids(client, root)
            model = await _model(client, root)
        except httpx.HTTPError as e:
            raise LlmdError(f"cannot reach {url}: {e}") from None
        requests, warm = plan(config, vocab_ids)
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=sum(r.output_tokens for r in requests), unit="tok",
                            desc=f"llmd bench {config.workload} {root}", file=sys.stderr, leave=False)
        if warm is not None:
            await _one(client, root, model, warm, time.perf_counter(), True, RequestRecord(0.0), None)
        records = [RequestRecord(0.0) for _ in requests]
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, root, model, r, t0, config.ignore_eos, rec, progress)
                               for r, rec in zip(requests, records)))
        duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    report = summarise(config, records, duration, None, None, target=f"{model} at {root}")
    return BenchRun(report, records, t0)
