"""Progress for slow steps (loading, converting): a bar on a terminal, a few log lines elsewhere."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("llmd")


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """Yield ``items`` while reporting progress on stderr.

    On a terminal this draws a bar; otherwise it logs ``desc`` at 0%, then every 25%, so log files
    and CI output show that work is moving without a line per item.
    """
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, unit="tensor", leave=False, file=sys.stderr)
        return
    next_mark = 0
    for i, item in enumerate(items):
        percent = 100 * i // max(total, 1)
        if percent >= next_mark:
            log.info("%s: %d%% (%d/%d)", desc, percent, i, total)
            next_mark = percent - percent % 25 + 25
        yield item
    log.info("%s: done (%d/%d)", desc, total, total)
