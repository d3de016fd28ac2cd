"""``GET /metrics``: the daemon's ``stats`` (docs/protocol.md) in Prometheus's text format, read at
each scrape, so the figures are the whole daemon's (every client's requests, not only HTTP ones)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


class _Snapshot:
    """A collector over one ``stats`` reply."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        requests = CounterMetricFamily("llmd_requests", "requests ended, by outcome", labels=["outcome"])
        for outcome, n in sorted(s.get("requests_finished", {}).items()):
            requests.add_metric([outcome], n)
        yield requests
        refused = CounterMetricFamily("llmd_requests_refused", "requests refused before they started, by error "
                                      "code", labels=["code"])
        for code, n in sorted(s.get("requests_refused", {}).items()):
            refused.add_metric([code], n)
        yield refused
        yield CounterMetricFamily("llmd_prompt_tokens", "prompt tokens computed or served from the prefix cache",
                                  value=s["num_prompt_tokens_total"])
        yield CounterMetricFamily("llmd_generation_tokens", "tokens generated", value=s["num_generated_tokens_total"])
        yield CounterMetricFamily("llmd_preemptions", "requests preempted for KV blocks (recomputed later)",
                                  value=s["num_preemptions"])
        for key, name, doc in (("ttft_s", "llmd_time_to_first_token_seconds", "time to first token"),
                               ("itl_s", "llmd_inter_token_latency_seconds",
                                "a request's mean time between output tokens")):
            h = s.get(key)
            if h:
                yield HistogramMetricFamily(name, doc, sum_value=h["sum"],
                                            buckets=[(str(float(le)) if le != "+Inf" else "+Inf", n)
                                                     for le, n in h["buckets"]])
        blocks = GaugeMetricFamily("llmd_kv_blocks", "KV cache blocks: used, cached (free, holding a reusable "
                                   "prefix) and free", labels=["state"])
        blocks.add_metric(["used"], s["num_blocks_used"])
        blocks.add_metric(["cached"], s["num_blocks_cached_free"])
        blocks.add_metric(["free"], s["num_blocks_free"] - s["num_blocks_cached_free"])
        yield blocks
        yield GaugeMetricFamily("llmd_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt "
                                "tokens, since start", value=s["prefix_cache_hit_rate"])
        # speculative decoding (vLLM's spec_decode_* counters): acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / verifications
        for key, name, doc in (("num_verifications", "llmd_spec_decode_verifications", "rows whose draft tokens "
                                "were verified"),
                               ("num_draft_tokens_total", "llmd_spec_decode_draft_tokens", "draft tokens verified"),
                               ("num_accepted_draft_tokens_total", "llmd_spec_decode_accepted_tokens",
                                "draft tokens accepted")):
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        yield GaugeMetricFamily("llmd_requests_running", "requests being computed", value=s["num_running"])
        yield GaugeMetricFamily("llmd_requests_waiting", "requests queued", value=s["num_waiting"])


def render(stats: dict[str, Any]) -> bytes:
    """The text exposition of one ``stats`` reply."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats))
    return generate_latest(registry)
