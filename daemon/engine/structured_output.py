"""Structured output (issue 24): a request's ``response_format`` constrains what it may generate, so that
its output parses: a JSON object ("JSON mode"), JSON matching a schema, a regular expression, one of a
list of strings, or an EBNF grammar.

A well-kept grammar engine does the work: xgrammar (the engine vLLM and SGLang use), which compiles a
constraint against the tokenizer's vocabulary once and then gives, per step, a bitmask of the tokens
that keep the output valid (~12 us a row for the default model's 49,152 tokens on this CPU). Each
constrained request holds a matcher (:class:`Grammar`); the model runner masks the logits of the rows
that carry one before sampling (rows without a constraint pay nothing), and the engine feeds the
matcher each emitted token. A grammar that is complete allows only end-of-sequence, which ends the
request. xgrammar caches the compiled constraints by their text (to a bound).

JSON is generated compact (``{"a":1,"b":[2]}``; by a schema, its properties in the schema's order): a
small model left free to choose whitespace can fill its budget with it.

The daemon compiles a request's constraint on a worker thread before it queues the request, so a
large schema never stalls the engine loop; an error is the request's ``bad_request``.

Speculative decoding: a constrained request's drafts are cut at the first token its grammar refuses,
and each verified position is masked as it would be one token at a time (the drafts before it
accepted), so greedy output is the same and sampling exact. A forced tool call is constrained the same
way (daemon/tool_calls.py).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmd.errors import RequestError

if TYPE_CHECKING:  # torch and xgrammar load where a constraint is compiled, not with SamplingParams
    import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's text
MAX_CHOICES = 256
COMPILE_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """One constraint: ``kind`` in :data:`KINDS` and its ``spec`` (the schema as compact JSON text, its
    key order kept, the regex, the choices as a JSON list, the grammar; empty for ``json_object``);
    ``origin`` names the request field it came from, for errors (``tools``: a forced tool call's)."""

    kind: str
    spec: str = ""
    origin: str = "response_format"

    @classmethod
    def parse(cls, value: Any) -> ResponseFormat | None:
        """From the wire's form (OpenAI's, extended): ``{"type": "text"}`` (no constraint),
        ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": {...}}}``,
        ``{"type": "regex", "regex": "..."}``, ``{"type": "choice", "choice": ["a", "b"]}``,
        ``{"type": "grammar", "grammar": "<EBNF>"}``; a ResponseFormat or None as it is.

        Raises:
            RequestError: anything else, naming the field.
        """
        if value is None or isinstance(value, ResponseFormat):
            return value
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise RequestError('response_format must be a map with a "type" (text, json_object, json_schema, regex, '
                               'choice or grammar)')
        kind = value["type"]
        extra = set(value) - {"type", kind}
        if extra:
            raise RequestError(f"response_format of type {kind!r} takes no {sorted(extra)!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(kind)
        if kind == "json_schema":
            body = value.get("json_schema")
            if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
                raise RequestError('response_format.json_schema must be a map with a "schema" map (a JSON schema)')
            try:
                spec = json.dumps(body["schema"], separators=(",", ":"))  # key order kept: it is the output's
            except (TypeError, ValueError, RecursionError):
                raise RequestError("response_format.json_schema.schema must be JSON (maps, lists, strings, "
                                   "numbers, booleans, null)") from None
        elif kind in ("regex", "grammar"):
            spec = value.get(kind)
            if not isinstance(spec, str) or not spec:
                raise RequestError(f"response_format.{kind} must be a non-empty string")
        elif kind == "choice":
            choices = value.get("choice")
            if (not isinstance(choices, list) or not 0 < len(choices) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choices)):
                raise RequestError(f"response_format.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            spec = json.dumps(choices)
        else:
            raise RequestError(f"response_format.type must be one of text, {', '.join(KINDS)}; got {kind!r}")
        if len(spec) > MAX_SPEC_CHARS:
            raise RequestError(f"response_format's {kind} is {len(spec)} characters; at most {MAX_SPEC_CHARS}")
        return cls(kind, spec)


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens that may come next. NOTE: a finished grammar (its end
        token accepted) has no next token; its row is left as it was rather than fail the step."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (nothing changes then)."""
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The output is complete: its end-of-sequence token was accepted."""
        return self._matcher.is_terminated()

    def valid_prefix(self, draft: list[int]) -> int:
        """How many of ``draft``'s first tokens the grammar allows in a row (speculative decoding:
        the rest are never verified), an end-of-sequence draft excluded (after it no position has a
        mask; the model's own token after the drafts may still end the output); the matcher is left
        as it was."""
        n = 0
        while n < len(draft) and self._matcher.accept_token(draft[n]):
            n += 1
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                n -= 1
                break
        if n:
            self._matcher.rollback(n)
        return n

    def fill_masks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """Rows ``row .. row + len(draft)`` of ``bitmask``: what may come next now, and after each of
        ``draft``'s tokens (a verified span's positions; the drafts are valid, valid_prefix); the
        matcher is left as it was."""
        self.fill_mask(bitmask, row)
        taken = 0
        for i, token in enumerate(draft):
            if not self._matcher.accept_token(token):
                break  # (valid_prefix cut the drafts: not reached) the later rows stay as they were
            taken += 1
            self.fill_mask(bitmask, row + i + 1)
        if taken:
            self._matcher.rollback(taken)


class GrammarCompiler:
    """Compiles constraints against one tokenizer and makes their matchers; on the caller's thread
    (:meth:`grammar`) or on a worker of its own (:meth:`submit`: the daemon's loop waits on a compile
    no longer than the 20 ms it gives any fresh prompt). The tokenizer's vocabulary is read at the
    first compile (~0.25 s for the default model's 49,152 tokens), not before.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the logits' width (a model's vocabulary may be padded past the tokenizer's).
        eos_token_ids: what ends a sequence (a complete grammar allows only these).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._xgr: Any = None
        self._compiler: Any = None
        self._lock = threading.Lock()
        # NOTE: made now, not under the lock: the worker holds the lock while it reads the vocabulary,
        # and the daemon's loop thread submits (an executor starts its thread at the first submit)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmd-grammar")

    def _ready(self) -> Any:
        """The xgrammar compiler, made once (under the lock: two threads may ask first)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=sorted(self._eos) or None)
                # xgrammar keeps the compiled constraints (by their text), to a bound: clients choose them
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_limit_bytes=COMPILE_CACHE_BYTES)
                self._xgr = xgrammar
            return self._compiler

    def grammar(self, fmt: ResponseFormat) -> Grammar:
        """A fresh matcher for ``fmt``.

        Raises:
            RequestError: the schema, regex or grammar does not compile (the message says why).
        """
        compiler = self._ready()
        try:
            compiled = self._compile(compiler, fmt)
        except (RuntimeError, ValueError, TypeError) as e:
            raise RequestError(f"{fmt.origin}: the {fmt.kind} does not compile: {str(e).splitlines()[0]}") from None
        return Grammar(self._xgr.GrammarMatcher(compiled))  # (it can roll back any number of tokens)

    def submit(self, fmt: ResponseFormat) -> Future[Grammar]:
        """:meth:`grammar` on this compiler's worker thread."""
        return self._pool.submit(self.grammar, fmt)

    def _compile(self, c: Any, fmt: ResponseFormat) -> Any:
        if fmt.kind in ("json_object", "json_schema"):
            # JSON mode is an object (xgrammar's builtin JSON grammar takes any value, and whitespace)
            spec = fmt.spec if fmt.kind == "json_schema" else '{"type":"object"}'
            grammar = str(self._xgr.Grammar.from_json_schema(spec, any_whitespace=False, separators=(",", ":")))
            # NOTE: xgrammar 0.2.8 writes strings with a maxLength or minLength as [^"\\\r\n]{m,n},
            # which lets control characters (U+0000-U+001F) in unescaped: not JSON. Its other strings
            # exclude them; so do these, here (tests/test_structured_output.py meets one).
            return c.compile_grammar(grammar.replace(_LAX_STRING_CHAR, _STRING_CHAR))
        if fmt.kind == "regex":
            return c.compile_regex(fmt.spec)
        if fmt.kind == "choice":
            return c.compile_grammar(self._xgr.Grammar.from_regex(
                "|".join(_regex_escape(choice) for choice in json.loads(fmt.spec))))
        return c.compile_grammar(fmt.spec)

    def mask(self, logits: torch.Tensor, grammars: list[Grammar | None],
             drafts: list[list[int]] | None = None) -> None:
        """Set to -inf, in place, the logits of the tokens each grammar does not allow next (rows
        without one are left alone). One row of ``logits`` per grammar; or, with ``drafts`` (a
        verified span per grammar), ``len(drafts[i]) + 1`` rows for the i-th: its positions."""
        if all(g is None for g in grammars):
            return
        drafts = drafts or [[] for _ in grammars]
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)  # all allowed
        row, masked = 0, []
        for g, draft in zip(grammars, drafts):
            if g is not None:
                g.fill_masks(bitmask, row, draft)
                masked.extend(range(row, row + len(draft) + 1))
            row += len(draft) + 1
        import torch  # (not at import: SamplingParams imports this module, and loads no torch)

        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            _sink_cpu(logits, bitmask, masked, self.vocab_size)
        else:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)


def _sink_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set to -inf the logits of ``rows`` that ``bitmask`` (xgrammar's: bit j of word i is token
    32 i + j) does not allow. NOTE: xgrammar's CPU kernel (like torch's masked_fill and numpy's where)
    writes -inf token by token, branching on each bit: ~1.8 ms for 16 rows of 49,152 tokens, a tenth
    of a 16-stream sampled step. Here the bits are unpacked and each becomes 0.0 or -inf by integer
    ops alone ((bit - 1) & the bits of -inf), then added: a few vector passes, ~0.4 ms."""
    import numpy as np
    import torch

    index = torch.tensor(rows) if len(rows) < logits.shape[0] else None
    words = (bitmask if index is None else bitmask[index]).numpy()
    allowed = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    bias = allowed.astype(np.int32)
    bias -= 1  # 0 where allowed, all ones where not
    bias &= np.int32(-0x800000)  # 0xFF800000: the bits of float32 -inf
    with torch.inference_mode():  # (the logits are the model's inference tensors)
        if index is None:
            logits[:, :vocab_size] += torch.from_numpy(bias.view(np.float32))
        else:
            logits[index, :vocab_size] += torch.from_numpy(bias.view(np.float32))


_LAX_STRING_CHAR = '[^\\"\\\\\\r\\n]'  # as xgrammar prints it: [^\"\\\r\n]
_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _regex_escape(text: str) -> str:
    """``text`` as a regex matching only itself (the syntax xgrammar's regexes take)."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)
