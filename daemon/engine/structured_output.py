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

The budget: a small model can loop inside a string or an array until ``max_tokens`` (or the context)
cuts its JSON short. So each step near the end of its budget, a constrained row plans how to finish
(:class:`Closer`: the shortest completion found, as tokens); once that plan no longer fits with a few
tokens to spare, the row follows it, one forced token a step, then ends. The output parses and its
finish reason is still ``length`` (the model did not end it; its content was cut to fit).

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
# The budget (see the module's doc): a row plans its closing each step once it has this many tokens
# left (a plan is ~0.05 ms; JSON schemas' closings seldom exceed 30 tokens), and follows it once its
# length plus the spare no longer fits. The spare absorbs a token of the model's that lengthens the
# plan (it opens a string or a key) between two plans.
CLOSE_WINDOW = 64
CLOSE_SPARE = 3


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
    """One request's matcher: which tokens may come next, and the tokens that came.

    Args:
        matcher: xgrammar's matcher of the request's constraint.
        closer: plans the output's end when its budget runs low (None: never planned).
    """

    def __init__(self, matcher: Any, closer: Closer | None = None) -> None:
        self._matcher, self._closer = matcher, closer
        self.closing = False  # the row follows its plan to the end: the budget, not the model, ends it
        self._no_plan = False  # no plan was found within the search's bound: not sought again
        # a verified span's (fill_masks): the position its plan fell due at, past the first (None:
        # not in it), and the tokens accepted since, so closing starts when that position's token is
        self._closing_at: int | None = None
        self._span_accepted = 0

    def fill_mask(self, bitmask: torch.Tensor, row: int, budget: int | None = None) -> None:
        """Row ``row`` of ``bitmask``: the tokens that may come next; with ``budget`` (the tokens the
        row may still emit, this one included), only the next of its closing plan once the plan is
        due. NOTE: a finished grammar (its end token accepted) has no next token; its row is left as
        it was rather than fail the step."""
        if self._matcher.is_terminated():
            return
        token = self._closing_token(budget)
        if token is None:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bit = 1 << (token % 32)
            bitmask[row] = 0
            bitmask[row, token // 32] = bit - (1 << 32 if bit >> 31 else 0)  # (the words are int32)

    def _plan(self, budget: int | None) -> list[int] | None:
        """The closing plan if the row is near the end of ``budget`` (None: far from it, no budget,
        or no plan found)."""
        if self._closer is None or budget is None or self._no_plan or (budget > CLOSE_WINDOW and not self.closing):
            return None
        plan = self._closer.plan(self._matcher)
        self._no_plan = plan is None
        return plan

    def _closing_token(self, budget: int | None) -> int | None:
        """The token the row must take now to end within ``budget``, or None (the grammar's mask)."""
        plan = self._plan(budget)
        if plan is None or (not self.closing and len(plan) + CLOSE_SPARE < budget):
            return None
        token = plan[0] if plan else self._closer.stop_token  # (complete: the end)
        self.closing = token is not None
        return token

    def draft_room(self, budget: int) -> int:
        """How many draft tokens the row may verify with ``budget`` tokens left (its own token after
        them included) and still close in time: drafts stop where the closing plan would start."""
        if self.closing:
            return 0
        plan = self._plan(budget)
        return budget - 1 if plan is None else max(0, budget - 2 - len(plan) - CLOSE_SPARE)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (nothing changes then)."""
        if not self._matcher.accept_token(token):
            return False
        self._span_accepted += 1
        if self._closing_at is not None and self._span_accepted > self._closing_at:
            self.closing = True  # the token of the span position its plan fell due at
        return True

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

    def fill_masks(self, bitmask: torch.Tensor, row: int, draft: list[int], budget: int | None = None) -> None:
        """Rows ``row .. row + len(draft)`` of ``bitmask``: what may come next now (by ``budget``:
        fill_mask), and after each of ``draft``'s tokens (a verified span's positions; the drafts are
        valid, valid_prefix), each by what the budget leaves there, as one token at a time would mask
        it: drafts that lengthen the closing plan (an opener each wants a closer) can make it due
        inside the span, where draft_room, reckoned before them, did not see it. The matcher is left
        as it was, and the closing state as the first position leaves it: a later position's holds
        only if its token is accepted (accept)."""
        self.fill_mask(bitmask, row, budget)
        closing, no_plan = self.closing, self._no_plan
        self._closing_at, self._span_accepted = None, 0
        taken = 0
        for i, token in enumerate(draft):
            if not self._matcher.accept_token(token):
                break  # (valid_prefix cut the drafts: not reached) the later rows stay as they were
            taken += 1
            self.fill_mask(bitmask, row + i + 1, None if budget is None else budget - i - 1)
            if self.closing and not closing and self._closing_at is None:
                self._closing_at = i + 1
        if taken:
            self._matcher.rollback(taken)
        self.closing, self._no_plan = closing, no_plan


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
        self._closer: Closer | None = None
        self._lock = threading.Lock()
        # NOTE: made now, not under the lock: the worker holds the lock while it reads the vocabulary,
        # and the daemon's loop thread submits (an executor starts its thread at the first submit)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmd-grammar")

    def _ready(self) -> Any:
        """The xgrammar compiler, made once (under the lock: two threads may ask first)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                # (xgrammar reads transformers' tokenizer; a snapshot makes it, once: it imports transformers)
                hf = self._tokenizer.transformers() if hasattr(self._tokenizer, "transformers") else self._tokenizer
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=sorted(self._eos) or None)
                # xgrammar keeps the compiled constraints (by their text), to a bound: clients choose them
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_limit_bytes=COMPILE_CACHE_BYTES)
                self._closer = Closer(info.decoded_vocab, frozenset(info.special_token_ids), info.stop_token_ids)
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
        # (the matcher can roll back any number of tokens)
        return Grammar(self._xgr.GrammarMatcher(compiled), self._closer)

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
             drafts: list[list[int]] | None = None, budgets: list[int] | None = None) -> None:
        """Set to -inf, in place, the logits of the tokens each grammar does not allow next (rows
        without one are left alone). One row of ``logits`` per grammar; or, with ``drafts`` (a
        verified span per grammar), ``len(drafts[i]) + 1`` rows for the i-th: its positions.
        ``budgets``: the tokens each row may still emit (its closing plan: Grammar.fill_mask)."""
        if all(g is None for g in grammars):
            return
        drafts = drafts or [[] for _ in grammars]
        budgets = budgets or [None] * len(grammars)
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)  # all allowed
        row, masked = 0, []
        for g, draft, budget in zip(grammars, drafts, budgets):
            if g is not None:
                g.fill_masks(bitmask, row, draft, budget)
                masked.extend(range(row, row + len(draft) + 1))
            row += len(draft) + 1
        import torch  # (not at import: SamplingParams imports this module, and loads no torch)

        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            _sink_cpu(logits, bitmask, masked, self.vocab_size)
        else:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)


_CLOSING_FIRST = '"}]' + ',:.-@_/ #+0aAeEfnt[{'  # closers, then what values and patterns often start with


class Closer:
    """Plans how a constrained output can end: a short completion of its grammar from the matcher's
    state, as tokens. NOTE: xgrammar gives masks, not completions; so the plan is a depth-first walk
    over characters, each tried with accept_string and undone with rollback: first the text the
    grammar forces (its jump-forward string), else the characters that close something (quote,
    brace, bracket), then the few that JSON's values and common patterns start with, then the rest of
    printable ASCII. JSON schemas' closings take ~30-100 characters tried (~0.05 ms); the walk gives
    up past MAX_CHARS characters of completion or MAX_TRIES tries (~3 ms).

    Args:
        decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab).
        special_ids: tokens a plan never uses (they are not text).
        stop_tokens: what ends a complete output (the first is the one a plan ends with).
    """

    # (bytes: an output may stop inside a character's UTF-8 bytes; one of these continues any lead byte)
    ALPHABET = [c.encode() for c in _CLOSING_FIRST] + [bytes([i]) for i in range(32, 127)
                                                       if chr(i) not in _CLOSING_FIRST] + [b"\x80", b"\x90", b"\xa0"]
    MAX_CHARS, MAX_TRIES = 256, 4000

    def __init__(self, decoded_vocab: list[bytes], special_ids: frozenset[int], stop_tokens: list[int]) -> None:
        self.stop_token = stop_tokens[0] if stop_tokens else None
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(decoded_vocab):
            if piece and i not in special_ids:
                self._ids.setdefault(piece, i)
        self._longest = max(map(len, self._ids), default=1)

    def plan(self, matcher: Any) -> list[int] | None:
        """The tokens of a completion from ``matcher``'s state ([]: complete already), or None if
        none was found within the bounds; ``matcher`` is left as it was."""
        data = self._completion(matcher)
        if data is None:
            return None
        tokens, at = [], 0
        while at < len(data):  # greedy, longest token first: any split of the bytes is the same text
            n = min(self._longest, len(data) - at)
            while n and data[at:at + n] not in self._ids:
                n -= 1
            if not n:
                return None  # a byte no token spells (a vocabulary without byte tokens)
            tokens.append(self._ids[data[at:at + n]])
            at += n
        if tokens and not matcher.accept_token(tokens[0]):
            return None  # the text's first token means something else to the grammar (a prefix space)
        if tokens:
            matcher.rollback(1)
        return tokens

    def _completion(self, matcher: Any) -> bytes | None:
        pieces: list[bytes] = []
        tries = 0

        def walk(depth: int) -> bool:
            nonlocal tries
            if matcher.is_completed():
                return True
            if depth >= self.MAX_CHARS:
                return False
            forced = matcher.find_jump_forward_string().encode()
            for piece in (forced,) if forced else self.ALPHABET:
                tries += 1
                if tries > self.MAX_TRIES:
                    return False
                if matcher.accept_string(piece):
                    pieces.append(piece)
                    if walk(depth + len(piece)):
                        return True
                    pieces.pop()
                    matcher.rollback(1)
            return False

        found = walk(0)
        if pieces:
            matcher.rollback(len(pieces))
        return b"".join(pieces) if found else None


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
