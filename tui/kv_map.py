"""The KV block map: one cell per block (or per group of blocks when the pool is larger than the
widget), coloured by state, with counts. Reads the daemon's ``block_map`` (docs/protocol.md)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from llmd.protocol import BLOCK_CACHED, BLOCK_FIRST_OWNER, BLOCK_FREE, BLOCK_OTHER, BLOCK_SHARED

# Requests cycle through these; this chat's own request is always OWN.
REQUEST_COLOURS = ("#5f87d7", "#d7875f", "#87af5f", "#af5faf", "#5fafaf", "#d7af5f", "#8787d7", "#d75f87")
OWN = "bold #ffffff on #005fd7"
SHARED = "#ffd75f"
CACHED = "#5f8787"
FREE = "#585858"
# A glyph per kind as well as a colour, so the map reads on a monochrome terminal (and in text captures).
FREE_CELL, CACHED_CELL, SHARED_CELL, REQUEST_CELL, OWN_CELL = "·", "□", "▣", "■", "█"
LEGEND_LINES = 2  # counts and legend under the map


def group_state(states: bytes, own: frozenset[int]) -> int:
    """The state a cell shows for a group of blocks: this chat's request first, then any request,
    shared, cached, free (so a single busy block in a large group still shows)."""
    best, rank = BLOCK_FREE, 0
    for s in set(states):
        r = 4 if s in own else 3 if s >= BLOCK_FIRST_OWNER else 2 if s == BLOCK_SHARED else 1 if s == BLOCK_CACHED else 0
        if r > rank:
            best, rank = s, r
    return best


def cell_glyph(state: int, own: frozenset[int]) -> str:
    if state in own:
        return OWN_CELL
    if state >= BLOCK_FIRST_OWNER:
        return REQUEST_CELL
    return {BLOCK_SHARED: SHARED_CELL, BLOCK_CACHED: CACHED_CELL}.get(state, FREE_CELL)


def cell_style(state: int, own: frozenset[int]) -> str:
    if state in own:
        return OWN
    if state == BLOCK_OTHER:
        return REQUEST_COLOURS[-1]
    if state >= BLOCK_FIRST_OWNER:
        return REQUEST_COLOURS[(state - BLOCK_FIRST_OWNER) % len(REQUEST_COLOURS)]
    return {BLOCK_SHARED: SHARED, BLOCK_CACHED: CACHED}.get(state, FREE)


class KVMap(Widget):
    """Call :meth:`update_map` with each stats message; it redraws to fit its size."""

    block_map: reactive[bytes] = reactive(b"", layout=False)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.own: frozenset[int] = frozenset()  # block-map values of this chat's request
        self.capacity = ""  # the cache's format and size in tokens, from the daemon's info (set_capacity)

    def set_capacity(self, dtype: str | None, tokens: int | None) -> None:
        """What the counts line says of the whole cache: ``int8 · 186,368 tokens``."""
        self.capacity = f"{dtype} · {tokens:,} tokens" if dtype and tokens else ""
        self.refresh()

    def update_map(self, block_map: bytes, own: frozenset[int]) -> None:
        self.own = own
        self.block_map = block_map

    def render(self) -> Text:
        states = self.block_map
        n = len(states)
        width = max(1, self.size.width)
        rows = max(1, self.size.height - LEGEND_LINES)
        text = Text(no_wrap=True, overflow="crop")
        if n == 0:
            text.append("no KV cache data yet", style="dim")
            return text
        per_cell = -(-n // (width * rows))
        if per_cell == 1:
            cells = states
        else:
            cells = bytes(group_state(states[i:i + per_cell], self.own) for i in range(0, n, per_cell))
        for start in range(0, len(cells), width):
            line = cells[start:start + width]
            # one span per run of equal cells: a mostly free pool is a few spans, not thousands
            run_start = 0
            for i in range(1, len(line) + 1):
                if i == len(line) or line[i] != line[run_start]:
                    state = line[run_start]
                    text.append(cell_glyph(state, self.own) * (i - run_start), style=cell_style(state, self.own))
                    run_start = i
            text.append("\n")
        cached = states.count(BLOCK_CACHED)
        used = n - cached - states.count(BLOCK_FREE)
        group = f" · 1 cell = {per_cell} blocks" if per_cell > 1 else ""
        capacity = f" · {self.capacity}" if self.capacity else ""
        text.append(f"{used} used · {cached} cached · {n - used - cached} free · {100 * used / n:.1f}% in use{group}"
                    f"{capacity}\n")
        for label, glyph, style in (("yours", OWN_CELL, OWN), ("other requests", REQUEST_CELL, REQUEST_COLOURS[0]),
                                    ("shared", SHARED_CELL, SHARED), ("cached", CACHED_CELL, CACHED),
                                    ("free", FREE_CELL, FREE)):
            text.append(glyph, style=style)
            text.append(f" {label}  ")
        return text
