"""xgrammar against llguidance on this CPU, for the default model's tokenizer (49,152 tokens): the
time to compile each of structured_output.py's JSON schemas, and the time to compute one token mask
along a valid output (issue 24: the engine is chosen by measured mask cost).

    .venv/bin/pip install llguidance   # not one of llmd's dependencies: only this comparison needs it
    .venv/bin/python benchmarks/grammar_engines.py

The outputs walked are the same token sequences for both engines: for each schema, a seeded random
walk through the tokens both engines allow (compact JSON, as llmd generates it; llguidance is given
the same separators) until the grammar completes; each complete one is checked to parse. One
thread, as the daemon's loop computes the masks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

from structured_output import SCHEMAS  # noqa: E402


def walk(xgr, compiled, ll, ll_tokenizer, ll_grammar, vocab_size: int, seed: int, max_tokens: int = 200
         ) -> list[int]:
    """A valid output's tokens: random tokens both engines allow (xgrammar lets special tokens such as
    <issue_start> into strings, llguidance does not), EOS once the grammar may end, until it ends."""
    import llguidance.torch
    import torch

    rng = random.Random(seed)
    matcher, ll_matcher = xgr.GrammarMatcher(compiled), ll.LLMatcher(ll_tokenizer, ll_grammar)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    ll_mask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated() and len(tokens) < max_tokens:
        matcher.fill_next_token_bitmask(mask, 0)
        llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_mask, 0)
        logits = torch.zeros(1, vocab_size)
        xgr.apply_token_bitmask_inplace(logits, mask)
        xgr.apply_token_bitmask_inplace(logits, ll_mask[:, :mask.shape[1]])
        allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
        token = rng.choice(allowed)
        if not (matcher.accept_token(token) and ll_matcher.consume_token(token)):
            raise RuntimeError(f"a token both engines allowed was refused: {token}")
        tokens.append(token)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=3, help="outputs walked per schema")
    args = parser.parse_args()

    import llguidance
    import llguidance.hf
    import llguidance.torch
    import torch
    import xgrammar as xgr

    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model(None))
    vocab_size = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = time.perf_counter()
    x_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    x_compiler = xgr.GrammarCompiler(x_info, max_threads=1, cache_enabled=False)
    x_setup = time.perf_counter() - start
    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    ll_setup = time.perf_counter() - start

    compile_s = {"xgrammar": [], "llguidance": []}
    mask_us = {"xgrammar": [], "llguidance": []}
    num_tokens = 0
    for i, schema in enumerate(SCHEMAS):
        text = json.dumps(schema)
        start = time.perf_counter()
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"))
        compiled = x_compiler.compile_grammar(grammar)
        compile_s["xgrammar"].append(time.perf_counter() - start)
        start = time.perf_counter()
        ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        llguidance.LLMatcher(ll_tokenizer, ll_grammar)  # the first matcher compiles the grammar
        compile_s["llguidance"].append(time.perf_counter() - start)
        for w in range(args.walks):
            tokens = walk(xgr, compiled, llguidance, ll_tokenizer, ll_grammar, vocab_size, seed=1000 * i + w)
            if tokens and tokens[-1] == eos:
                body = tokenizer.decode(tokens[:-1])
                json.loads(body)  # the walk is a valid output
            x_matcher = xgr.GrammarMatcher(compiled)
            ll_matcher = llguidance.LLMatcher(ll_tokenizer, ll_grammar)
            x_mask = xgr.allocate_token_bitmask(1, vocab_size)
            ll_mask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
            for token in tokens:
                t0 = time.perf_counter()
                x_matcher.fill_next_token_bitmask(x_mask, 0)
                t1 = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_mask, 0)
                t2 = time.perf_counter()
                mask_us["xgrammar"].append((t1 - t0) * 1e6)
                mask_us["llguidance"].append((t2 - t1) * 1e6)
                if not x_matcher.accept_token(token) or not ll_matcher.consume_token(token):
                    raise RuntimeError(f"schema {i}: token {token} refused on the walk ({ll_matcher.get_error()})")
                num_tokens += 1

    print(f"{len(SCHEMAS)} schemas, {num_tokens} masks along {len(SCHEMAS) * args.walks} valid outputs; "
          f"tokenizer setup: xgrammar {x_setup:.2f} s, llguidance {ll_setup:.2f} s")
    print(f"{'engine':<11} {'compile median':>15} {'compile max':>12} {'mask mean':>10} {'mask p50':>9} "
          f"{'mask p99':>9} {'mask max':>9}")
    for name in ("xgrammar", "llguidance"):
        c, m = compile_s[name], sorted(mask_us[name])
        print(f"{name:<11} {statistics.median(c) * 1e3:>12.1f} ms {max(c) * 1e3:>9.1f} ms "
              f"{statistics.mean(m):>7.1f} us {m[len(m) // 2]:>6.1f} us {m[int(len(m) * 0.99)]:>6.1f} us "
              f"{m[-1]:>6.0f} us")


if __name__ == "__main__":
    main()
