"""The dashboard: KV block map, throughput now and over the last minute, the request table, and the
prefix cache, preemptions and model. Fed by the daemon's published stats (docs/protocol.md)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from rich.text import Text
from textual.widgets import Sparkline, Static

from llmd.protocol import BLOCK_FIRST_OWNER
from llmd.tui.kv_map import KVMap

HISTORY = 240  # stats messages kept for the sparklines: a minute at the daemon's 4 per second
# NOTE: redraw at most this often. Stats arrive 4 times a second; drawing each one cost the UI
# process ~20% of a core, taken from the daemon on a 2-core machine (benchmarks/stats_cost.py).
REDRAW_INTERVAL_S = 0.5
COLUMNS = (("id", 10), ("owner", 6), ("state", 8), ("prompt", 7), ("cached", 7), ("out", 6), ("tok/s", 7),
           ("TTFT", 7))


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def request_table(rows: list[dict[str, Any]], own_ids: set[str]) -> Text:
    """The requests as fixed-width text (a DataTable redrawn twice a second costs ~50 ms a time)."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("".join(name.ljust(width) for name, width in COLUMNS) + "\n", style="bold")
    for r in rows:
        mine = r.get("id") in own_ids
        marks = ("*" if mine else "") + ("{}" if r.get("format") else "")  # {}: its output has a set form
        cells = [f"{r.get('id')}{marks}", str(r.get("owner")), str(r.get("state")),
                 str(r.get("prompt_tokens")), str(r.get("cached_tokens")), str(r.get("generated_tokens")),
                 _fmt(r.get("tokens_per_s")), _fmt(r.get("ttft"), "s", 2)]
        line = "".join(cell.ljust(width) for cell, (_, width) in zip(cells, COLUMNS))
        text.append(line + "\n", style="bold reverse" if mine else "")
    if not rows:
        text.append("no requests", style="dim")
    else:
        legend = (["* this chat"] if any(r.get("id") in own_ids for r in rows) else []) + \
                 (["{} structured output"] if any(r.get("format") for r in rows) else [])
        if legend:
            text.append("  ".join(legend), style="dim")
    return text


def speculation_part(stats: dict[str, Any]) -> str:
    """`` · drafts 62% accepted, 2.1 tok/verify`` once speculative decoding has verified drafts, else ``""``."""
    rate, length = stats.get("draft_acceptance_rate"), stats.get("mean_accepted_length")
    if not isinstance(rate, (int, float)) or not isinstance(length, (int, float)):
        return ""
    return f" · drafts {100 * rate:.0f}% accepted, {length:.1f} tok/verify"


def describe_model(info: dict[str, Any]) -> str:
    memory = info.get("weight_bytes")
    weights = f", weights {memory / 2**20:.0f} MiB" if isinstance(memory, (int, float)) else ""
    return (f"{info.get('model', '?')} · {info.get('device', '?')} {info.get('dtype', '')} · "
            f"{info.get('quantization', '?')}{weights}")


def models_part(models: list[dict[str, Any]]) -> str:
    """`` · also b (loaded), c (unloaded), d (remote, ok)``: the daemon's other models, when it serves
    several (a remote one with its health)."""
    others = [f"{m.get('name', '?')} (remote, {m.get('health', '?')})" if m.get("remote") else
              f"{m.get('name', '?')} ({m.get('state', '?')})" for m in models if not m.get("default")]
    return " · also " + ", ".join(others) if others else ""


class Dashboard(Vertical):
    """Call :meth:`set_info` once and :meth:`update_stats` with each stats message."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefill: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.decode: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.redraw_interval_s = REDRAW_INTERVAL_S  # tests set 0: every message drawn at once
        self._latest: tuple[dict[str, Any], set[str]] = ({}, set())
        self._model_line = ""
        self._drawn_at = 0.0
        self._draw_scheduled = False

    def compose(self) -> ComposeResult:
        yield Static("", id="model-line")
        yield Static("KV cache", classes="section-title")
        yield KVMap(id="kv-map")
        yield Static("", id="throughput-line")
        with Horizontal(classes="spark-row"):
            yield Static("decode", classes="spark-label")
            yield Sparkline(list(self.decode), id="decode-spark")
        with Horizontal(classes="spark-row"):
            yield Static("prefill", classes="spark-label")
            yield Sparkline(list(self.prefill), id="prefill-spark")
        yield Static("", id="cache-line")
        yield Static("", id="requests")

    def on_mount(self) -> None:
        self.border_title = "engine"

    def set_info(self, info: dict[str, Any]) -> None:
        self._model_line = describe_model(info)
        self.query_one("#model-line", Static).update(self._model_line)
        self.query_one(KVMap).set_capacity(info.get("kv_cache_dtype"), info.get("kv_cache_tokens"))

    def update_stats(self, stats: dict[str, Any], own_ids: set[str]) -> None:
        """Record a stats message; draw it now, or (if drawn less than REDRAW_INTERVAL_S ago) when
        the interval is over, whichever message is the latest then. ``own_ids``: the public ids of
        this chat's requests (highlighted)."""
        self.prefill.append(float(stats.get("prefill_tokens_per_s", 0.0)))
        self.decode.append(float(stats.get("decode_tokens_per_s", 0.0)))
        self._latest = (stats, own_ids)
        wait = self._drawn_at + self.redraw_interval_s - time.monotonic()
        if wait <= 0:
            self._draw()
        elif not self._draw_scheduled:
            self._draw_scheduled = True
            self.set_timer(wait, self._draw)

    def _draw(self) -> None:
        self._draw_scheduled = False
        self._drawn_at = time.monotonic()
        stats, own_ids = self._latest
        rows = stats.get("requests") or []
        own = frozenset(BLOCK_FIRST_OWNER + i for i, r in enumerate(rows) if r.get("id") in own_ids)
        block_map = stats.get("block_map")
        if isinstance(block_map, bytes):
            self.query_one(KVMap).update_map(block_map, own)
        self.query_one("#decode-spark", Sparkline).data = list(self.decode)
        self.query_one("#prefill-spark", Sparkline).data = list(self.prefill)
        self.query_one("#throughput-line", Static).update(
            f"decode {self.decode[-1]:7.1f} tok/s  ·  prefill {self.prefill[-1]:7.1f} tok/s  ·  last minute:")
        self.query_one("#cache-line", Static).update(
            f"prefix cache hits {100 * float(stats.get('prefix_cache_hit_rate', 0)):.1f}% · "
            f"preemptions {stats.get('num_preemptions', 0)} · running {stats.get('num_running', 0)} · "
            f"waiting {stats.get('num_waiting', 0)}" + speculation_part(stats))
        self.query_one("#requests", Static).update(request_table(rows, own_ids))
        if isinstance(stats.get("models"), list) and len(stats["models"]) > 1:
            self.query_one("#model-line", Static).update(self._model_line + models_part(stats["models"]))
