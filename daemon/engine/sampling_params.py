"""Per-request sampling parameters, validated on construction.

The same object travels from the client (over the wire, later) to the sampler, so every check a
malformed request needs lives here: a bad value raises :class:`llmd.errors.RequestError` with a
message that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmd.daemon.engine.structured_output import ResponseFormat
from llmd.errors import RequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: new tokens at most.
        temperature: 0 is greedy; higher flattens the distribution.
        top_k: sample among the k likeliest tokens (0: all).
        top_p: nucleus sampling, smallest set reaching probability p (1: all).
        min_p: drop tokens whose probability is below ``min_p`` times the top one's (0: off).
        repetition_penalty: >1 discourages tokens already in the prompt or output (1: off).
        presence_penalty, frequency_penalty: OpenAI-style, over generated tokens (0: off).
        seed: per-request RNG seed; the same seed and params give the same text whatever else is
            in the batch.
        stop: strings that end generation; the text never includes them.
        stop_token_ids: token ids that end generation, in addition to the model's EOS.
        ignore_eos: keep going past EOS (benchmarks want exact lengths).
        logprobs: return this many top log-probabilities per generated token (None: off).
        prompt_logprobs: return the log-probability of every prompt token after the first (and
            this many top alternatives), computed in the prefill (None: off). Such a request
            computes its whole prompt: a cached prefix has no logits to report.
        response_format: what the output must be (structured_output.ResponseFormat, or its wire form,
            OpenAI's: ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, ``json_object``,
            ``regex``, ``choice``, ``grammar``; ``text`` or None: anything).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | dict | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise RequestError(f"each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        self.response_format = ResponseFormat.parse(self.response_format)

    @property
    def greedy(self) -> bool:
        # NOTE: below ~1e-5 dividing logits by the temperature overflows float32; it is greedy anyway.
        return self.temperature < 1e-5
