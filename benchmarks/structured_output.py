"""Structured output (issue 24) on the default model, in this process: how many answers parse and validate
against their JSON schema, and what the grammar masks cost at 16 streams.

    .venv/bin/python benchmarks/structured_output.py                  # both
    .venv/bin/python benchmarks/structured_output.py --only validity  # or --only cost

Validity: the schemas below (nested objects, arrays with min/max items, enums, bounded numbers,
required and optional properties, strings with patterns and lengths), each asked for in 5 chats,
greedy and sampled (temperature 0.8, seeded). An answer counts as valid when it parses (Python's
strict json.loads) and jsonschema validates it, whatever its finish reason; those that end "length"
(the model looped until the budget, and the engine closed its JSON to fit) are counted too, and shown.

With --max-string N, strings the schema leaves unbounded get maxLength N (the advice for a small
model, which can loop inside such a string until max_tokens: the bound ends the loop sooner).

Cost: 16 chats at once, all constrained to a JSON schema, against the same 16 chats unconstrained;
each request runs to --max-tokens either way (the same rows in every step: what differs is the
masks); output tokens per second, alternating, the median of --rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                 "minItems": 2, "maxItems": 4}}, "required": ["colors"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array",
                                                                           "items": {"type": "string"}},
                                      "published": {"type": "boolean"}}, "required": ["title", "published"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"}}, "required": ["first", "last"]},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["person", "email"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}, "text": {"type": "string", "maxLength": 40}},
        "required": ["n", "text"]}, "minItems": 1, "maxItems": 3}}, "required": ["steps"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                                      "condition": {"enum": ["sunny", "rainy", "cloudy", "snowy"]}},
     "required": ["temperature_c", "condition"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
     "required": ["ok"]},
    {"type": "object", "properties": {"language": {"enum": ["python", "rust", "go", "c"]},
                                      "year": {"type": "integer", "minimum": 1950, "maximum": 2030}},
     "required": ["language", "year"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["apple", "bread", "milk"]},
                                                "minItems": 1, "maxItems": 3}, "total": {"type": "number"}},
     "required": ["items", "total"]},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"]},
    {"type": "object", "properties": {"summary": {"type": "string", "minLength": 5, "maxLength": 80},
                                      "sentiment": {"enum": ["positive", "negative", "neutral"]}},
     "required": ["summary", "sentiment"]},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                                      "stable": {"type": "boolean"}}, "required": ["version", "stable"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "roles": {"type": "array", "items": {"enum": ["admin", "user"]},
                                                           "maxItems": 2}},
        "required": ["id", "roles"]}, "active": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
     "required": ["user", "active"]},
    {"type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "string"},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["q", "a", "confidence"], "additionalProperties": False},
]
PROMPTS = ["Answer in JSON.", "Reply with a JSON value for a small example.",
           "Give me data about your favourite thing, as JSON.", "Make up a plausible record and write it as JSON.",
           "What would you say? Use JSON."]


def bound_strings(schema: object, max_length: int) -> object:
    """``schema`` with a maxLength on every string that has no bound, pattern, enum or const (a copy)."""
    if isinstance(schema, list):
        return [bound_strings(s, max_length) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_strings(v, max_length) for k, v in schema.items()}
    types = schema.get("type")
    if (types == "string" or isinstance(types, list) and "string" in types) and not (
            {"maxLength", "pattern", "enum", "const", "format"} & set(schema)):
        out["maxLength"] = max_length
    return out


def validity(llm, max_tokens: int, max_string: int | None) -> None:
    import jsonschema

    from llmd import SamplingParams

    print(f"validity: {len(SCHEMAS)} schemas x {len(PROMPTS)} chats, greedy and sampled, at most {max_tokens} "
          "tokens each" + (f"; strings without a bound held to {max_string} characters" if max_string else ""))
    for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        chats, params = [], []
        for i, schema in enumerate(SCHEMAS):
            if max_string:
                schema = bound_strings(schema, max_string)
            for j, prompt in enumerate(PROMPTS):
                chats.append([{"role": "user", "content": f"{prompt} The schema: {json.dumps(schema)}"}])
                fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
                params.append(SamplingParams(temperature=temperature, seed=100 * i + j, max_tokens=max_tokens,
                                             response_format=fmt))
        start = time.perf_counter()
        outs = llm.chat(chats, params)
        seconds = time.perf_counter() - start
        valid = closed = 0
        for out, p in zip(outs, params):
            closed += out.finish_reason == "length"
            try:
                jsonschema.validate(json.loads(out.text), json.loads(p.response_format.spec))
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                print(f"  INVALID ({out.finish_reason}): {out.text[:300]!r}: {str(e).splitlines()[0]}")
                continue
            if out.finish_reason == "length":
                print(f"  closed at max_tokens: {out.text[:100]!r}...{out.text[-60:]!r}")
        print(f"  {mode:<8} {valid}/{len(outs)} answers valid ({100 * valid / len(outs):.0f}%), {closed} of them "
              f"ended by max_tokens; {sum(len(o.token_ids) for o in outs) / seconds:.0f} tok/s")


def cost(llm, rounds: int, max_tokens: int) -> None:
    from llmd import SamplingParams

    # NOTE: the same work both ways: every request runs to max_tokens (the unconstrained ones past their
    # end of sequence, the constrained ones asked for more items than fit), so the steps have the same
    # rows and the ratio is the masks' cost, not that of JSON answers ending sooner (fewer rows per step)
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "items": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
        "required": ["name", "qty"]}, "minItems": max_tokens}}, "required": ["title", "items"]}
    chats = [[{"role": "user", "content": f"List {n} things to pack for a trip, as JSON."}] for n in range(3, 19)]
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    kinds = {"plain": dict(ignore_eos=True), "schema": dict(response_format=fmt)}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else reversed(list(kinds)):
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, **kinds[kind])
                      for i in range(len(chats))]
            start = time.perf_counter()
            outs = llm.chat(chats, params)
            rates[kind].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            if any(len(o.token_ids) != max_tokens for o in outs):
                raise RuntimeError(f"{kind}: a request ended before max_tokens: not the same work both ways")
    plain, constrained = (statistics.median(rates[k]) for k in ("plain", "schema"))
    print(f"cost: 16 streams, {max_tokens} tokens each, median of {rounds}: unconstrained {plain:.0f} tok/s, "
          f"every request by a JSON schema {constrained:.0f} tok/s: {constrained / plain:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["validity", "cost"], default=None)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-string", type=int, default=None,
                        help="validity: give each string the schema leaves unbounded this maxLength (a small "
                             "model can loop inside one until max_tokens)")
    args = parser.parse_args()
    from llmd import LLM
    from llmd.kernels import cpu_profile

    llm = LLM()
    print(cpu_profile.machine_line())
    if args.only in (None, "validity"):
        validity(llm, args.max_tokens, args.max_string)
    if args.only in (None, "cost"):
        cost(llm, args.rounds, args.max_tokens)


if __name__ == "__main__":
    main()
