"""`llmd bench`: a load generator against the running daemon, and its report.

Workloads (all with exact lengths: prompts are sent as token ids, outputs use ``ignore_eos``):

* ``streams``: N requests at once, each ``--prompt-tokens`` in and ``--output-tokens`` out;
* ``prefix``: a shared system prompt of K tokens plus a distinct question per request; one request
  warms the prefix cache first (not counted), then N go at once;
* ``poisson``: ``--requests`` arriving at ``--rate`` per second (exponential gaps), prompt and output
  lengths drawn uniformly from half to one and a half times the given lengths; seeded;
* ``edit``: N chats at once, each asking for a piece of source code (about ``--prompt-tokens`` of
  llmd's own) rewritten with one identifier renamed, the work whose output repeats its prompt (what
  speculative decoding with prompt-lookup drafts is for). These go as chat messages and may end
  before ``--output-tokens`` (end-of-text is honoured), so only their prompt and output counts are
  not exact.

Every token's arrival time is recorded on the client, so TTFT, inter-token latency and end-to-end
latency are what a client sees. The daemon's stats stream gives the peak KV usage (its
`num_blocks_used_peak`, the most blocks any step held); its `stats` before and after give the
preemptions. The prefix-cache hit rate is this run's: cached over prompt tokens of its requests.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

WORKLOADS = ("streams", "prefix", "poisson", "edit")


@dataclass(slots=True)
class BenchConfig:
    """What to run. Raises ``ValueError`` with the fix in the message."""

    workload: str = "streams"
    num_streams: int = 16
    prompt_tokens: int = 128
    output_tokens: int = 128
    prefix_tokens: int = 1000
    rate: float = 4.0
    num_requests: int = 32
    # None: a new random seed per run. A fixed seed repeats the prompts, so a second run finds the
    # first one's prompts in the prefix cache (measured: 44% of a 32-stream run's prompt tokens).
    seed: int | None = None
    ignore_eos: bool | None = None  # None: True, but for ``edit`` (a rewrite ends when it is done)
    slo_ttft: float | None = None  # seconds
    slo_itl: float | None = None  # seconds

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        for name in ("num_streams", "prompt_tokens", "output_tokens", "prefix_tokens", "num_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        if self.seed is None:
            self.seed = random.SystemRandom().randrange(2**31)
        if self.ignore_eos is None:
            self.ignore_eos = self.workload != "edit"
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {self.rate!r}")
        for name in ("slo_ttft", "slo_itl"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, got {value!r}")


@dataclass(slots=True)
class RequestPlan:
    start_s: float  # offset from the start of the run
    prompt: list[int]
    output_tokens: int
    messages: list[dict[str, str]] | None = None  # a chat instead of ``prompt``'s ids (``edit``)


@dataclass(slots=True)
class RequestRecord:
    sent: float
    token_times: list[float] = field(default_factory=list)  # one per token received
    end: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    speculation: tuple[int, int, int] = (0, 0, 0)  # verifications, draft tokens verified, accepted


def plan(config: BenchConfig, vocab_ids: list[int]) -> tuple[list[RequestPlan], RequestPlan | None]:
    """The requests of a run (and a warm-up request for ``prefix``). Prompts are drawn from
    ``vocab_ids`` (ids the model's tokenizer produces), seeded."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> list[int]:
        return [rng.choice(vocab_ids) for _ in range(n)]

    if config.workload == "streams":
        return [RequestPlan(0.0, tokens(config.prompt_tokens), config.output_tokens)
                for _ in range(config.num_streams)], None
    if config.workload == "prefix":
        shared = tokens(config.prefix_tokens)
        warm = RequestPlan(0.0, shared + tokens(config.prompt_tokens), 1)
        return [RequestPlan(0.0, shared + tokens(config.prompt_tokens), config.output_tokens)
                for _ in range(config.num_streams)], warm
    if config.workload == "edit":
        return [RequestPlan(0.0, [], config.output_tokens, edit_messages(rng, config.prompt_tokens))
                for _ in range(config.num_streams)], None
    start, plans = 0.0, []
    for _ in range(config.num_requests):
        start += rng.expovariate(config.rate)
        p = rng.randint(max(1, config.prompt_tokens // 2), config.prompt_tokens * 3 // 2)
        o = rng.randint(max(1, config.output_tokens // 2), config.output_tokens * 3 // 2)
        plans.append(RequestPlan(start, tokens(p), o))
    return plans, None


# The texts of ``edit``: llmd's own source, as installed (a wheel has them as a checkout does).
EDIT_SOURCES = ("protocol.py", "config.py", "client.py", "bench.py", "paths.py", "logs.py")
CHARS_PER_TOKEN = 3.5  # of Python source, roughly, for the usual BPE vocabularies


def edit_messages(rng: random.Random, prompt_tokens: int) -> list[dict[str, str]]:
    """A chat asking for about ``prompt_tokens`` of source rewritten with one identifier renamed."""
    import re
    from importlib.resources import files

    lines = files("llmd").joinpath(rng.choice(EDIT_SOURCES)).read_text(encoding="utf-8").splitlines()
    start = rng.randrange(max(1, len(lines) - 20))
    text, chars = [], int(prompt_tokens * CHARS_PER_TOKEN)
    for line in lines[start:]:
        if sum(len(t) + 1 for t in text) + len(line) > chars:
            text = text or [line[:chars]]
            break
        text.append(line)
    code = "\n".join(text)
    names = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", code))) or ["value"]
    old = rng.choice(names)
    return [{"role": "user", "content": f"Here is some Python code:\n\n```python\n{code}\n```\n\nRewrite it with "
                                        f"`{old}` renamed to `{old}_renamed`. Output the whole code and nothing else."}]


def kv_cache_text(dtype: str | None, tokens: int | None) -> str:
    """The KV cache's format and capacity (``int8, 186368 tokens``), for ``llmd bench`` and ``llmd
    status``; empty when the daemon does not say (an older one)."""
    if not dtype:
        return ""
    return f"{dtype}, {tokens} tokens" if tokens else dtype


def kernels_line(kernels: dict[str, str]) -> str:
    """One line from a model's kernels() report (the daemon's ``info["kernels"]``), for ``llmd
    bench`` and ``llmd status``."""
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in kernels.items() if k != "cpu_profile"]
    if "cpu_profile" in kernels:
        parts.append(f"CPU profile {kernels['cpu_profile']}")
    return "; ".join(parts) or "-"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


@dataclass(slots=True)
class BenchReport:
    workload: str
    seed: int  # --seed repeats this run's prompts and arrivals
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float  # finished requests per second
    output_tokens_per_s: float
    output_tokens: int  # counted from the stream (at least the usage's count per request)
    output_tokens_reported: int  # the daemon's usage.completion_tokens, summed
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_cache_hit_rate: float  # cached / prompt tokens of this run
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    goodput: float | None  # requests per second meeting every SLO given; None without SLOs
    peak_kv_usage: float | None  # the most KV blocks any step held during the run, as a share of the pool
    preemptions: int | None  # None: not measured (another server, over HTTP)
    errors: list[str]
    kernels: dict[str, str] = field(default_factory=dict)  # what served the run (the model's kernels())
    kv_cache: str = ""  # the KV cache's format and capacity (kv_cache_text)
    # speculative decoding over the run: verifications, draft tokens verified, accepted among them
    verifications: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    target: str = ""  # the server measured, when it is not the local daemon (``--url``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        def s(v: float | None, unit: str = "s") -> str:
            return "-" if v is None else (f"{v * 1000:.0f} ms" if unit == "s" and v < 1 else f"{v:.2f} {unit}")

        rows = [
            ("workload", f"{self.workload} (seed {self.seed})"),
            ("requests", f"{self.num_requests - self.num_failed} done, {self.num_failed} failed, "
                         f"in {self.duration_s:.2f} s ({self.request_throughput:.2f} req/s)"),
            ("output", f"{self.output_tokens} tokens, {self.output_tokens_per_s:.1f} tok/s"),
            ("prompt", f"{self.prompt_tokens} tokens, {self.cached_prompt_tokens} from the prefix cache "
                       f"({100 * self.prefix_cache_hit_rate:.1f}%)"),
            ("TTFT", f"p50 {s(self.ttft_p50)}, p90 {s(self.ttft_p90)}, p99 {s(self.ttft_p99)}"),
            ("inter-token", f"p50 {s(self.itl_p50)}, p99 {s(self.itl_p99)}"),
            ("end to end", f"p50 {s(self.e2e_p50)}, p99 {s(self.e2e_p99)}"),
            ("goodput", "-" if self.goodput is None else f"{self.goodput:.2f} req/s within the SLOs"),
            ("KV cache", (f"{self.kv_cache}; " if self.kv_cache else "") + (
                "- (not measured over HTTP)" if self.peak_kv_usage is None else
                f"peak {100 * self.peak_kv_usage:.1f}% in use, {self.preemptions} preemptions")),
            ("speculation", "no drafts verified" if not self.draft_tokens else
             f"{self.accepted_draft_tokens} of {self.draft_tokens} draft tokens accepted "
             f"({100 * self.accepted_draft_tokens / self.draft_tokens:.0f}%), "
             f"{1 + self.accepted_draft_tokens / max(self.verifications, 1):.2f} tokens per verification"),
            ("kernels", kernels_line(self.kernels)),
        ]
        if self.target:
            rows.insert(0, ("server", self.target))
        return "\n".join(f"{name:<12} {value}" for name, value in rows)


@dataclass(slots=True)
class BenchRun:
    """A finished run: its report, and what it was made from (for ``--plot``)."""

    report: BenchReport
    records: list[RequestRecord]
    t0: float  # time.perf_counter() at the start of the measured requests


def summarise(config: BenchConfig, records: list[RequestRecord], duration: float, peak_kv: float | None,
              preemptions: int | None, kernels: dict[str, str] | None = None, target: str = "",
              kv_cache: str = "") -> BenchReport:
    ok = [r for r in records if r.error is None]
    ttfts = [r.token_times[0] - r.sent for r in ok if r.token_times]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2es = [r.end - r.sent for r in ok]
    goodput = None
    if config.slo_ttft is not None or config.slo_itl is not None:
        def meets(r: RequestRecord) -> bool:
            if not r.token_times:
                return False
            ttft = r.token_times[0] - r.sent
            gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
            return ((config.slo_ttft is None or ttft <= config.slo_ttft)
                    and (config.slo_itl is None or not gaps or max(gaps) <= config.slo_itl))
        goodput = sum(meets(r) for r in ok) / duration
    prompt = sum(r.usage.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.usage.get("cached_tokens", 0) for r in ok)
    # a streamed chunk may carry several tokens (over HTTP, where only the arrivals are seen: llmd's
    # accepted drafts); the request's usage counts them all
    counted = sum(max(len(r.token_times), r.usage.get("completion_tokens", 0)) for r in ok)
    return BenchReport(
        workload=config.workload, seed=config.seed, num_requests=len(records), num_failed=len(records) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration, output_tokens_per_s=counted / duration, output_tokens=counted,
        output_tokens_reported=sum(r.usage.get("completion_tokens", 0) for r in ok), prompt_tokens=prompt,
        cached_prompt_tokens=cached, prefix_cache_hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50=_pct(ttfts, 0.5), ttft_p90=_pct(ttfts, 0.9), ttft_p99=_pct(ttfts, 0.99),
        itl_p50=_pct(itls, 0.5), itl_p99=_pct(itls, 0.99), e2e_p50=_pct(e2es, 0.5), e2e_p99=_pct(e2es, 0.99),
        goodput=goodput, peak_kv_usage=peak_kv, preemptions=preemptions,
        errors=sorted({r.error for r in records if r.error is not None}), kernels=kernels or {}, target=target,
        kv_cache=kv_cache,
        verifications=sum(r.speculation[0] for r in ok), draft_tokens=sum(r.speculation[1] for r in ok),
        accepted_draft_tokens=sum(r.speculation[2] for r in ok),
    )


async def _one(client: Any, req: RequestPlan, t0: float, ignore_eos: bool, record: RequestRecord,
               progress: Any) -> None:
    from llmd.client import Result, ServerError

    await asyncio.sleep(max(0.0, t0 + req.start_s - time.perf_counter()))
    record.sent = time.perf_counter()
    source: dict[str, Any] = {"messages": req.messages} if req.messages is not None else {"token_ids": req.prompt}
    try:
        async for item in client.generate(**source, max_tokens=req.output_tokens, temperature=0,
                                          ignore_eos=ignore_eos):
            now = time.perf_counter()
            if isinstance(item, Result):
                record.usage = item.usage
                t = item.timings or {}
                record.speculation = (int(t.get("verifications") or 0), int(t.get("draft_tokens") or 0),
                                      int(t.get("accepted_draft_tokens") or 0))
            else:
                record.token_times.extend([now] * len(item.token_ids))
                if progress is not None:
                    progress.update(len(item.token_ids))
    except ServerError as e:
        record.error = f"{e.code}: {e.message}"
    record.end = time.perf_counter()


async def _peak_kv(client: Any, box: list[float]) -> None:
    async for stats in client.subscribe_stats():
        blocks = stats.get("num_blocks") or 1
        box[0] = max(box[0], stats.get("num_blocks_used_peak", stats.get("num_blocks_used", 0)) / blocks)


async def run_bench(connection: dict[str, Any], config: BenchConfig, show_progress: bool = False) -> BenchRun:
    """Run ``config`` against the daemon of ``connection``."""
    from llmd.client import AsyncClient, Client

    with Client(connection=connection) as sync:
        # ids the model's own tokenizer makes, so any vocabulary size works
        vocab_ids = sorted(set(sync.tokenize(" ".join(f"w{i} alpha beta {i * 7}" for i in range(400)))))
        preemptions_before = sync.stats()["num_preemptions"]
        info = sync.info()
        kernels = info.get("kernels", {})
        kv_cache = kv_cache_text(info.get("kv_cache_dtype"), info.get("kv_cache_tokens"))
    requests, warm = plan(config, vocab_ids)
    total = sum(r.output_tokens for r in requests)
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=total, unit="tok", desc=f"llmd bench {config.workload}", file=sys.stderr, leave=False)
    async with AsyncClient(connection=connection) as client:
        if warm is not None:
            await _one(client, warm, time.perf_counter(), True, RequestRecord(0.0), None)
        peak = [0.0]
        watcher = asyncio.create_task(_peak_kv(client, peak))
        await asyncio.sleep(0.3)  # the stats subscription joins (PUB/SUB drops what comes before)
        records = [RequestRecord(0.0) for _ in requests]
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, r, t0, config.ignore_eos, rec, progress)
                               for r, rec in zip(requests, records)))
        duration = time.perf_counter() - t0
        await asyncio.sleep(0.6)  # the message covering the run's last steps (published 4 times a second)
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass
    if progress is not None:
        progress.close()
    with Client(connection=connection) as sync:
        preemptions = sync.stats()["num_preemptions"] - preemptions_before
    return BenchRun(summarise(config, records, duration, peak[0], preemptions, kernels, kv_cache=kv_cache), records,
                    t0)


def run_bench_in_process(llm: Any, config: BenchConfig, show_progress: bool = False) -> BenchRun:
    """Run ``config`` against ``llm`` (an :class:`llmd.LLM`) in this process: the engine without the
    daemon, its socket and the client, so the difference to :func:`run_bench` is what they cost."""
    from llmd import SamplingParams

    engine = llm.engine
    vocab_ids = sorted(set(llm.encode(" ".join(f"w{i} alpha beta {i * 7}" for i in range(400)))))
    requests, warm = plan(config, vocab_ids)
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=sum(r.output_tokens for r in requests), unit="tok", desc=f"llmd bench {config.workload}",
                        file=sys.stderr, leave=False)
    if warm is not None:
        llm.generate([warm.prompt], SamplingParams(temperature=0, max_tokens=warm.output_tokens, ignore_eos=True))
    preemptions_before = engine.stats().num_preemptions
    engine.take_peak_blocks_used()  # the run's own peak from here on
    records = {f"bench-{i}": RequestRecord(0.0) for i in range(len(requests))}
    pending = sorted(zip(records, requests), key=lambda item: item[1].start_s)
    t0 = time.perf_counter()
    unfinished = len(requests)
    while unfinished:
        now = time.perf_counter()
        while pending and t0 + pending[0][1].start_s <= now:
            rid, req = pending.pop(0)
            records[rid].sent = now
            ids = llm.apply_chat_template(req.messages) if req.messages is not None else req.prompt
            engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=req.output_tokens,
                                                               ignore_eos=config.ignore_eos))
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + pending[0][1].start_s - time.perf_counter()))
            continue
        for delta in engine.step():
            now = time.perf_counter()
            record = records[delta.request_id]
            record.token_times.extend([now] * len(delta.token_ids))
            if progress is not None:
                progress.update(len(delta.token_ids))
            if delta.finished:
                unfinished -= 1
                record.end = now
                m = delta.metrics
                if m is not None:
                    record.usage = {"prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                                    "completion_tokens": m.num_generated_tokens}
                    record.speculation = (m.num_verifications, m.num_draft_tokens, m.num_accepted_draft_tokens)
    duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    peak = engine.take_peak_blocks_used() / engine.num_blocks
    done = list(records.values())
    kv_cache = kv_cache_text(str(engine.cache_dtype).removeprefix("torch."),
                             engine.num_blocks * engine.config.block_size)
    return BenchRun(summarise(config, done, duration, peak, engine.stats().num_preemptions - preemptions_before,
                              engine.model.kernels(), kv_cache=kv_cache), done, t0)


__all__ = ["BenchConfig", "BenchReport", "BenchRun", "WORKLOADS", "kernels_line", "kv_cache_text", "plan", "run_bench",
           "run_bench_in_process", "summarise"]
