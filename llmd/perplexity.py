"""`llmd bench --perplexity FILE`: how well the served model predicts a text, measured through the
public API (``prompt_logprobs``), so any way of serving (kernels, dtype, quantisation, CPU
profile) can be held against a reference on the same text.

The text is tokenised whole and cut into windows of ``window`` tokens, each scored as one prompt:
every token after a window's first gets the log-probability the model gave it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_WINDOW = 1024


@dataclass(slots=True)
class PerplexityReport:
    file: str
    num_tokens: int  # tokens scored
    num_windows: int
    mean_nll: float  # nats per token
    perplexity: float
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [("text", f"{self.file}: {self.num_tokens} tokens scored in {self.num_windows} windows"),
                ("perplexity", f"{self.perplexity:.4f} (mean NLL {self.mean_nll:.4f} nats/token)"),
                ("time", f"{self.duration_s:.2f} s")]
        return "\n".join(f"{name:<12} {value}" for name, value in rows)


def read_text(path: str | Path) -> str:
    """The text of ``path``.

    Raises:
        ValueError: unreadable, not UTF-8, or empty.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path} as UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """``token_ids`` in consecutive windows of at most ``window`` tokens; a last window of one token
    (nothing to score) is dropped."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    return [token_ids[i:i + window] for i in range(0, len(token_ids), window) if len(token_ids) - i > 1]


def report(file: str, scored: list[list[Any]], duration: float) -> PerplexityReport:
    """From the ``prompt_logprobs`` of each window (first entry None)."""
    nll = [-entry[0] for window in scored for entry in window[1:]]
    if not nll:
        raise ValueError("the text has too few tokens to score")
    mean = sum(nll) / len(nll)
    return PerplexityReport(file, len(nll), len(scored), mean, math.exp(mean), duration)


def measure_in_process(llm: Any, text: str, file: str = "-", window: int = DEFAULT_WINDOW) -> PerplexityReport:
    """Score ``text`` with ``llm`` (an :class:`llmd.LLM`)."""
    from llmd import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate(windows(llm.encode(text), window), params)
    return report(file, [o.prompt_logprobs for o in outs], time.perf_counter() - start)


def measure(connection: dict[str, Any], text: str, file: str = "-", window: int = DEFAULT_WINDOW) -> PerplexityReport:
    """Score ``text`` with the daemon of ``connection``."""
    from llmd.client import Client

    start = time.perf_counter()
    with Client(connection=connection) as client:
        scored = [client.generate(token_ids=ids, stream=False, max_tokens=1, temperature=0,
                                  prompt_logprobs=0).prompt_logprobs
                  for ids in windows(client.tokenize(text), window)]
    return report(file, scored, time.perf_counter() - start)
