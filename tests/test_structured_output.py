"""Structured output (issue 24, daemon/engine/structured_output.py): a request's response_format holds
whatever the model is, here a tiny random one that left alone writes noise: JSON that parses and
matches its schema, a regex's match, one of the choices; bad formats are clear errors; rows without
a constraint in the same steps are untouched."""

from __future__ import annotations

import json
import math
import re

import pytest
from tiny_models import make_engine, make_hf_model, save_hf_model

from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.structured_output import ResponseFormat
from llmd.errors import RequestError

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("structured") / "m", with_tokenizer=True)


def texts(engine, params: list[SamplingParams]) -> list[str]:
    """The requests' texts (as the engine detokenizes them: an ending EOS not shown); every second
    request joins a step later."""
    out = {f"r{i}": "" for i in range(len(params))}
    pending = [(i % 2, f"r{i}", [(5 * i + k) % 200 + 3 for k in range(6)], p) for i, p in enumerate(params)]
    step = 0
    while pending or engine.has_unfinished():
        for arrival, rid, ids, p in [r for r in pending if r[0] <= step]:
            engine.add_request(rid, ids, p)
        pending = [r for r in pending if r[0] > step]
        for delta in engine.step():
            out[delta.request_id] += delta.text
        step += 1
    return [out[f"r{i}"] for i in range(len(params))]


def test_outputs_hold_their_format_greedy_and_sampled(model_dir) -> None:
    engine = make_engine(model_dir)
    formats = [
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        {"type": "regex", "regex": r"[0-9]{3}-[a-z]{2}"},
        {"type": "choice", "choice": ["yes", "no", "a (b)?"]},
        {"type": "json_object"},
    ]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=200, response_format=f)
              for i, (f, t) in enumerate((f, t) for f in formats for t in (0.0, 1.0))]
    got = texts(engine, params)
    for text in got[0:2]:
        value = json.loads(text)
        assert set(value) == {"name", "age", "pet"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert value["pet"] in ("cat", "dog") and len(value["name"]) <= 6
        assert list(value) == ["name", "age", "pet"]  # the schema's order
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # compact
    for text in got[2:4]:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    for text in got[4:6]:
        assert text in ("yes", "no", "a (b)?"), text
    for text in got[6:8]:  # any JSON object (closed within the budget if the model would not end it)
        assert isinstance(json.loads(text), dict)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks and not engine._grammars
    # the same requests unconstrained: the noise the constraints held back
    free = texts(make_engine(model_dir), [SamplingParams(temperature=0.0, max_tokens=30)] * 2)
    assert not any(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) or t in ("yes", "no") for t in free)


def finished(engine, params: list[SamplingParams], speculate: bool = False) -> list[tuple[str, str]]:
    """Each request's text and finish reason (the requests join together)."""
    out: dict[str, list[str]] = {f"r{i}": ["", ""] for i in range(len(params))}
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [(7 * i + k) % 200 + 3 for k in range(5)], p)
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id][0] += delta.text
            if delta.finished:
                out[delta.request_id][1] = delta.finish_reason
    return [tuple(out[f"r{i}"]) for i in range(len(params))]


# What a small model loops in until max_tokens: unbounded strings, arrays, a pattern's repeat.
LOOPY = [{"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
             "type": "string"}}, "ok": {"type": "boolean"}}, "required": ["name", "tags", "ok"]},
         {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)+$"},
                                           "inner": {"type": "object", "properties": {"n": {"type": "integer",
                                                                                            "minimum": 1950}},
                                                     "required": ["n"]}}, "required": ["version", "inner"]}]


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_a_constrained_output_closes_within_its_budget(model_dir, monkeypatch, speculative: str) -> None:
    """Near the end of its budget (max_tokens here; the context alike), a constrained row follows a plan
    that completes its grammar: every output parses and validates, whatever the budget, and says
    ``length`` when the budget, not the model, ended it. The canary: with no closing window, the
    same requests are cut mid-JSON."""
    import jsonschema

    from llmd.daemon.engine import structured_output

    def run() -> list[tuple[str, str]]:
        params = [SamplingParams(temperature=t, seed=n, max_tokens=n, response_format={
                      "type": "json_schema", "json_schema": {"schema": schema}})
                  for schema in LOOPY for n in (40, 57, 80, 120) for t in (0.0, 1.0)]
        return finished(make_engine(model_dir, speculative=speculative), params)

    closed = run()
    for (text, reason), (schema, _, _) in zip(closed, [(s, n, t) for s in LOOPY for n in range(4) for t in range(2)]):
        jsonschema.validate(json.loads(text), schema)
        assert reason in ("stop", "length")
    assert sum(reason == "length" for _, reason in closed) >= 8  # the random model loops: most hit the budget
    monkeypatch.setattr(structured_output, "CLOSE_WINDOW", 0)
    cut = run()
    assert sum(not _parses(text) for text, _ in cut) >= 8


def test_a_budget_too_small_to_close_is_cut_not_failed(model_dir) -> None:
    """No plan fits: the row follows it as far as it goes and ends at max_tokens, as any request."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    ((text, reason),) = finished(make_engine(model_dir), [SamplingParams(
        temperature=0, max_tokens=3, response_format={"type": "json_schema", "json_schema": {"schema": schema}})])
    assert reason == "length" and text.startswith("{") and not _parses(text)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def test_unconstrained_rows_beside_constrained_ones_are_untouched(model_dir) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = texts(make_engine(model_dir), [plain, plain])
    fmt = {"type": "regex", "regex": "[a-c]{20}"}
    mixed = texts(make_engine(model_dir, speculative="ngram"),
                  [plain, plain, SamplingParams(temperature=0.0, max_tokens=30, response_format=fmt)])
    assert mixed[:2] == alone
    assert re.fullmatch("[a-c]{20}", mixed[2])


def test_the_mask_sets_exactly_the_refused_tokens_to_minus_infinity() -> None:
    """The CPU mask (_sink_cpu) against the tokens the matcher accepts one by one: -inf exactly on the
    tokens it refuses (so no temperature or penalty can bring one back), the rest untouched, the
    unconstrained row untouched."""
    import torch
    from tiny_models import make_tiny_tokenizer

    from llmd.daemon.engine.structured_output import GrammarCompiler

    tokenizer = make_tiny_tokenizer()
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    grammar = compiler.grammar(ResponseFormat("regex", "[a-c]x"))
    logits = torch.randn(3, vocab)
    before = logits.clone()
    compiler.mask(logits, [grammar, None, grammar])
    for row in (0, 2):
        refused = torch.isneginf(logits[row])
        allowed = [t for t in range(vocab) if grammar.valid_prefix([t]) == 1]
        assert torch.nonzero(~refused).flatten().tolist() == allowed
        assert torch.equal(logits[row][~refused], before[row][~refused]) and 0 < len(allowed) < 10
    assert torch.equal(logits[1], before[1])


def test_preemption_and_prefix_hits_keep_the_grammar_in_step(model_dir) -> None:
    """A pool small enough to preempt (the preempted requests recompute their tokens, their grammars
    stay where their output is) and shared prefixes: the same texts as with a large pool, each one
    holding its format."""
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    params = [SamplingParams(temperature=0.0, max_tokens=60, response_format=fmt if i % 2 else None,
                             ignore_eos=not i % 2) for i in range(6)]
    roomy = texts(make_engine(model_dir), params)
    engine = make_engine(model_dir, num_blocks=24, block_size=4)
    assert texts(engine, params) == roomy
    assert engine.scheduler.num_preemptions > 0
    for text in roomy[1::2]:
        assert set(json.loads(text)) == {"name", "age", "pet"}


def test_a_format_compiles_on_the_compilers_worker(model_dir) -> None:
    """What the daemon does (daemon/intake.py): compile on the compiler's own thread, then queue the
    request with its matcher; a failed compile is the future's RequestError."""
    import threading

    engine = make_engine(model_dir)
    fmt = {"type": "regex", "regex": "ab+c"}
    threads = []
    real = engine.grammar_compiler.grammar

    def spied(f):
        threads.append(threading.current_thread().name)
        return real(f)

    engine.grammar_compiler.grammar = spied
    grammar = engine.grammar_compiler.submit(ResponseFormat.parse(fmt)).result(timeout=60)
    assert threads and threads[0].startswith("llmd-grammar")
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=20, response_format=fmt), grammar=grammar)
    text = ""
    while engine.has_unfinished():
        text += "".join(d.text for d in engine.step())
    assert re.fullmatch("ab+c", text) and len(threads) == 1  # not compiled again
    with pytest.raises(RequestError, match="does not compile"):
        engine.grammar_compiler.submit(ResponseFormat.parse({"type": "regex", "regex": "(x"})).result(timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_requests_speculate_to_the_same_output(model_dir, temperature: float) -> None:
    """Drafts of a constrained request are cut where its grammar refuses them and each verified
    position is masked as one token at a time: greedy gives the same tokens as speculation off; a
    seeded sampled request (rejection sampling on the masked distributions) repeats itself, and
    holds its format."""
    schema = {"type": "array", "items": {"enum": ["cat", "dog", "cow"]}, "minItems": 12, "maxItems": 12}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=150, response_format=fmt) for i in range(3)]
    engine = make_engine(model_dir, speculative="ngram")
    on = texts(engine, params)
    assert engine.num_accepted_tokens > 10 and not engine._grammars
    want = texts(make_engine(model_dir, speculative="off" if temperature == 0 else "ngram"), params)
    assert on == want
    for text in on:
        assert len(json.loads(text)) == 12


@pytest.mark.parametrize("max_tokens", [15, 16, 17, 18])
def test_drafts_that_lengthen_the_closing_plan_still_close(model_dir, monkeypatch, max_tokens: int) -> None:
    """Each verified position is masked by the budget left there: drafts that open what must be closed
    (here ``x``, each wanting a ``b``) can make the closing plan fall due inside a span, where the
    room reckoned before them did not see it. The output is then what one token at a time gives:
    ``x``s, ``c``, as many ``b``s, ended by the budget (``length``). Served CPU path (INT4, native
    attention), where a lone sequence drafts up to 7. Canary: with only the span's first position
    masked by the budget, drafts of ``x`` ran on and the output was cut mid-grammar (9 ``x``s, 5
    ``b``s at 15 tokens), at every budget here."""
    import llmd.daemon.engine.engine as engine_module
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    fmt = {"type": "grammar", "grammar": 'root ::= "x" root "b" | "c"'}

    def run(speculative: str) -> tuple[str, str | None]:
        engine = make_engine(model_dir, speculative=speculative, attention=CpuAttentionBackend(),
                             quant=QuantConfig("int4"))
        x = engine.tokenizer.encode("x")[0]
        monkeypatch.setattr(engine_module, "lookup", lambda tokens, k: ([x] * k, 4))  # a prompt full of x
        engine.add_request("r", engine.tokenizer.encode("hello world"),
                           SamplingParams(temperature=0, max_tokens=max_tokens, response_format=fmt))
        text, reason = "", None
        while engine.has_unfinished():
            for delta in engine.step():
                text, reason = text + delta.text, delta.finish_reason or reason
        assert speculative == "off" or engine.num_accepted_tokens > 0
        return text, reason

    off, on = run("off"), run("ngram")
    opened, closed = re.fullmatch(r"(x*)c(b*)", off[0]).groups()
    assert len(opened) == len(closed) > 0 and off[1] == "length"
    assert on == off


def test_a_draft_that_ends_the_output_is_not_verified(model_dir) -> None:
    """An end-of-sequence draft would leave the positions after it without a mask (xgrammar refuses
    a finished matcher's mask): drafts stop before it. Prompts that hold the end token (a chat
    template's) give prompt-lookup such drafts; the engine once failed a step on one."""
    engine = make_engine(model_dir, speculative="ngram")
    grammar = engine.grammar_compiler.grammar(ResponseFormat.parse({"type": "choice", "choice": ["ab"]}))
    a, b = engine.tokenizer.convert_tokens_to_ids(["a", "b"])
    eos = min(engine.eos_token_ids)  # the model's end token (the grammar's stop token)
    assert grammar.valid_prefix([a, b, eos, a]) == 2 and grammar.valid_prefix([a, a]) == 1
    assert grammar.valid_prefix([b]) == 0  # the matcher is where it was: nothing taken yet
    assert grammar.accept(a) and grammar.accept(b) and grammar.valid_prefix([eos]) == 0
    # the end token in the prompt, right after what the grammar allows: prompt lookup drafts it
    fmt = {"type": "regex", "regex": "(ab)+"}
    prompt = [a, b, a, b, eos, a, b, a, b, eos, a, b]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, response_format=fmt))
    text = ""
    while engine.has_unfinished():
        text += "".join(d.text for d in engine.step())
    assert re.fullmatch("(ab)+", text), text


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_log_probabilities_are_the_models_own_not_the_masks(model_dir, speculative: str) -> None:
    """Log-probabilities are the model's own (before the grammar's mask, as before penalties): every
    top-n value finite. Masked ones were -inf, which JSON cannot carry (the HTTP API failed with a
    500). The chosen token's equals the unconstrained request's where both chose it."""
    schema = {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 6, "maxItems": 6}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    engine = make_engine(model_dir, speculative=speculative)
    engine.add_request("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=60, logprobs=3, response_format=fmt))
    logprobs = []
    while engine.has_unfinished():
        for delta in engine.step():
            logprobs += delta.logprobs
    assert len(logprobs) > 10
    for chosen, top in logprobs:
        assert math.isfinite(chosen) and len(top) == 3 and all(math.isfinite(v) for _, v in top)
    free = make_engine(model_dir, speculative="off")
    free.add_request("f", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    (first,) = [d for d in free.step() if d.logprobs]
    assert first.logprobs[0][1] == logprobs[0][1]  # the same top-3 at the first position, mask or not


@pytest.mark.parametrize("value,message", [
    ({"type": "json_schema"}, "json_schema must be a map"),
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "choice", "choice": []}, "choice must be a list"),
    ({"type": "regex", "regex": "a", "extra": 1}, "takes no"),
    ("json", "must be a map"),
    ({"type": "json_schema", "json_schema": {"schema": {"a": b"bytes"}}}, "must be JSON"),
])
def test_bad_formats_are_clear_errors(value, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams(response_format=value)


def test_a_format_that_does_not_compile_is_refused_at_admission(model_dir) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(RequestError, match="does not compile"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=8, response_format={"type": "regex",
                                                                                     "regex": "(unclosed"}))
    assert not engine.requests and not engine.has_unfinished()
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    assert SamplingParams(response_format=ResponseFormat("json_object")).response_format.kind == "json_object"
