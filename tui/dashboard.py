"""The dashboard: KV block map, throughput now and over the last minute, the request table, and the
prefix cache, preemptions and model. Fed by the daemon's published stats (docs/protocol.md)."""

from __future__ import annotations

from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Sparkline, Static

from llmd.daemon.engine.live_view import BLOCK_FIRST_OWNER
from llmd.tui.kv_map import KVMap

HISTORY = 240  # stats messages kept for the sparklines: a minute at the daemon's 4 per second
COLUMNS = ("id", "owner", "state", "prompt", "cached", "out", "tok/s", "TTFT")


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def describe_model(info: dict[str, Any]) -> str:
    memory = info.get("weight_bytes")
    weights = f", weights {memory / 2**20:.0f} MiB" if isinstance(memory, (int, float)) else ""
    return (f"{info.get('model', '?')} · {info.get('device', '?')} {info.get('dtype', '')} · "
            f"{info.get('quantization', '?')}{weights}")


class Dashboard(Vertical):
    """Call :meth:`set_info` once and :meth:`update_stats` with each stats message."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefill: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.decode: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Static("", id="model-line")
        yield Static("KV cache", classes="section-title")
        yield KVMap(id="kv-map")
        yield Static("", id="throughput-line")
        yield Sparkline(list(self.decode), id="decode-spark")
        yield Sparkline(list(self.prefill), id="prefill-spark")
        yield Static("", id="cache-line")
        yield DataTable(id="requests", cursor_type="none", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.border_title = "engine"

    def set_info(self, info: dict[str, Any]) -> None:
        self.query_one("#model-line", Static).update(describe_model(info))

    def update_stats(self, stats: dict[str, Any], own_ids: set[str]) -> None:
        """``own_ids``: the public ids of this chat's requests (highlighted)."""
        rows = stats.get("requests") or []
        own = frozenset(BLOCK_FIRST_OWNER + i for i, r in enumerate(rows) if r.get("id") in own_ids)
        block_map = stats.get("block_map")
        if isinstance(block_map, bytes):
            self.query_one(KVMap).update_map(block_map, own)
        prefill = float(stats.get("prefill_tokens_per_s", 0.0))
        decode = float(stats.get("decode_tokens_per_s", 0.0))
        self.prefill.append(prefill)
        self.decode.append(decode)
        self.query_one("#decode-spark", Sparkline).data = list(self.decode)
        self.query_one("#prefill-spark", Sparkline).data = list(self.prefill)
        self.query_one("#throughput-line", Static).update(
            f"decode {decode:7.1f} tok/s  ·  prefill {prefill:7.1f} tok/s  (sparklines: last minute)")
        self.query_one("#cache-line", Static).update(
            f"prefix cache hits {100 * float(stats.get('prefix_cache_hit_rate', 0)):.1f}% · "
            f"preemptions {stats.get('num_preemptions', 0)} · running {stats.get('num_running', 0)} · "
            f"waiting {stats.get('num_waiting', 0)}")
        table = self.query_one(DataTable)
        table.clear()
        for r in rows:
            mine = r.get("id") in own_ids
            cells = [f"{r.get('id')}{' (you)' if mine else ''}", str(r.get("owner")), str(r.get("state")),
                     str(r.get("prompt_tokens")), str(r.get("cached_tokens")), str(r.get("generated_tokens")),
                     _fmt(r.get("tokens_per_s")), _fmt(r.get("ttft"), "s", 2)]
            table.add_row(*cells)
