"""Two builds of the native CPU library side by side in the engine: this checkout's build and another
(``--lib``), swapped request by request in one process, `edit` chats at one stream, with speculation
off and on.

    gcc -O3 -fopenmp -shared -fPIC -std=c11 -ffp-contract=off -march=native -o /tmp/other.so other/*.c -lm
    .venv/bin/python benchmarks/engine_lib_ab.py --lib /tmp/other.so
    LLMD_CPU=avx2 .venv/bin/python benchmarks/engine_lib_ab.py --lib /tmp/other-v3.so   # with -march=x86-64-v3

The kernel benchmarks (quant_matmul_cpu.py, decode_attention_cpu.py) time a kernel with its data
warm in the caches, one call after another; in a served step the weights come from memory after
everything else has run, and a change can win there and lose here (the 512-bit build's pairs of
groups at one row: 1.04-1.2x faster in quant_matmul_cpu.py on a Xeon, 0.92x in the engine on a Zen 5).
These machines drift by tens of per cent within minutes, so the two builds take turns on the same
prompts (which goes first alternating) and the ratio of their times is what to quote. The other
build must come from sources with the same structs (kernels/cpu/decode_step.c's ``llmd_model``) and
entry points; greedy outputs are compared, and differ only if the builds' arithmetic does.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time

import llmd.kernels.quant_cpu as quant_cpu
from llmd import LLM, SamplingParams
from llmd.bench import edit_messages
from llmd.daemon.tokenizer import chat_token_ids
from llmd.kernels import cpu_profile, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", required=True, help="the other build of libllmd_cpu.so")
    parser.add_argument("--modes", nargs="+", default=["off", "ngram"], choices=["off", "ngram"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4, help="edit chats per round")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(prefix_cache=False)  # (a prompt's second run must not hit the first's cache)
    engine = llm.engine
    step = engine.model.decode_step
    if step is None or native.library() is None:
        raise SystemExit("the native decode step does not run here (no C compiler, or LLMD_NATIVE=0)")
    libs = {"this": native.library(), "other": native.load(pathlib.Path(args.lib))}
    library = quant_cpu.library

    def use(name: str) -> None:
        step._lib = libs[name]  # the decode step's calls
        quant_cpu.library = lambda: libs[name]  # the LM head's (PackedWeight.__call__) and the rest

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(cpu_profile.machine_line())
    print(f"this build against {args.lib}; edit chats at one stream, {args.requests} a round, {args.rounds} rounds, "
          "the builds in turn on each")
    try:
        for mode in args.modes:
            engine.config.speculative = mode
            total = {name: 0.0 for name in libs}
            ratios, same = [], True
            for rnd in range(args.rounds):
                rng = random.Random(3000 + rnd)
                prompts = [chat_token_ids(llm.tokenizer, edit_messages(rng, 300)) for _ in range(args.requests)]
                spent = {name: 0.0 for name in libs}
                for i, prompt in enumerate(prompts):
                    outputs = {}
                    for name in (list(libs) if (rnd + i) % 2 == 0 else list(libs)[::-1]):
                        use(name)
                        start = time.perf_counter()
                        outputs[name] = llm.generate([prompt], params)[0].token_ids
                        spent[name] += time.perf_counter() - start
                    same &= outputs["this"] == outputs["other"]
                for name in libs:
                    total[name] += spent[name]
                ratios.append(spent["other"] / spent["this"])
            print(f"{mode:>6}: this {total['this']:.2f} s, other {total['other']:.2f} s: this build "
                  f"{total['other'] / total['this']:.3f}x as fast (rounds {statistics.median(ratios):.3f}, "
                  f"{min(ratios):.2f}-{max(ratios):.2f}); outputs {'the same' if same else 'DIFFER'}")
    finally:
        quant_cpu.library = library
        step._lib = libs["this"]


if __name__ == "__main__":
    main()
