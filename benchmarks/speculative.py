"""Speculative decoding on vs off (issue 22): two daemons on the default model, one with
`--speculative off`, one with `--speculative ngram` (or `draft` with `--draft-model`), the same
`llmd bench` workloads in turn.

    .venv/bin/python benchmarks/speculative.py                       # edit and streams, 1 and 16 streams
    .venv/bin/python benchmarks/speculative.py --rounds 5 --requests 8
    .venv/bin/python benchmarks/speculative.py --model BIG --draft-model SMALL   # a draft model
    .venv/bin/python benchmarks/speculative.py --worst-case            # drafts that are always wrong
    .venv/bin/python benchmarks/speculative.py --self-draft 26         # the model's first 26 layers draft

Both daemons stay up; the idle one sleeps. Each round runs every case on both, in turn (which goes
first alternates), with the same prompts: `edit` (chats asking for ~--edit-prompt-tokens of code
rewritten with one name changed: the output repeats the prompt; it ends at end-of-text) and `streams`
(ordinary random prompts, `--output-tokens` ignoring end-of-text). One stream runs --requests
requests one after another (one alone is one prompt's luck), each on both daemons in turn (which
goes first alternating), so the two sides of a comparison run seconds apart: these machines' speed
drifts by tens of per cent within minutes. 16 streams run 16 at once, on one daemon then the other.
Reported per case: output tok/s off and on (the median of the rounds), the ratio on / off of each
round (the median and the range: what drifts least), at one stream the same ratio after each
request's first token (``decode``: the prompt's prefill, the same on and off, left out), and over
all rounds on the speculating daemon the share of draft tokens accepted and the tokens per
verification. The end-to-end ratio is the figure to quote.

``--worst-case`` measures instead what speculation costs when no draft is ever right: in this process
(llmd.LLM), the engine's proposer replaced by one that always guesses token 0, against speculation
off, on random prompts of 128 tokens and --output-tokens new ones, 1 and 16 streams, alternating,
median of --rounds. Besides the measured ratio (these machines' noise is a few per cent) it prints
the drafted share of the tokens and what the cost model (daemon/engine/ngram_proposer.py) says
they cost.

``--self-draft N`` measures the draft-model path where no smaller model shares the default model's
tokenizer (this machine has only the default model): in this process, the model's own first N
layers (with its final norm and head) as the draft model, drafting whatever the engine's cost
estimate says (``draft_pass_cost`` 0), against speculation off, on the `edit` chats at one stream,
alternating, median of --rounds. An untrained early exit guesses poorly: this shows what the
machinery costs and accepts at the default model's size, not a speed-up a real draft model would give.

``--where`` shows where a run's time goes, in this process: the `edit` chats off and on (alternating,
--rounds, one stream running --requests in a row), each step timed, split into the steps that carry
prompt work (prefill, which speculation leaves as it is) and the decode steps (tokens per step,
drafts verified per step, milliseconds per step). The end-to-end ratio is the decode steps' ratio
diluted by the prefill's share of the run: where prefill is slow against decode (the AVX2 profile's
int8 arithmetic, a small model), the same decode speed-up gives a smaller end-to-end one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmd.bench import BenchConfig, BenchReport, kernels_line, run_bench
from llmd.client import Client, load_connection
from llmd.kernels import cpu_profile



def run_case(connection: dict[str, Any], configs: list[BenchConfig]) -> dict[str, float]:
    """Run ``configs`` one after another; their totals."""
    reports: list[BenchReport] = [asyncio.run(run_bench(connection, c)).report for c in configs]
    for r in reports:
        if r.num_failed:
            raise RuntimeError(f"{r.num_failed} requests failed: {r.errors}")
    tokens, seconds = sum(r.output_tokens for r in reports), sum(r.duration_s for r in reports)
    drafted = sum(r.draft_tokens for r in reports)
    accepted = sum(r.accepted_draft_tokens for r in reports)
    verifications = sum(r.verifications for r in reports)
    # a request alone: its tokens after the first, over its time after the first token (the prompt's
    # prefill, which speculation does not change, left out)
    alone = [r for r in reports if r.num_requests == 1 and r.ttft_p50 is not None]
    decode_tokens = sum(r.output_tokens - 1 for r in alone)
    decode_seconds = sum(r.duration_s - r.ttft_p50 for r in alone)
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "drafted": drafted,
            "accepted": accepted, "verifications": verifications, "decode_tokens": decode_tokens,
            "decode_seconds": decode_seconds}


def run_interleaved(connections: dict[str, dict[str, Any]], modes: tuple[str, ...], configs: list[BenchConfig],
                    first: int) -> dict[str, dict[str, float]]:
    """Each of ``configs`` on every daemon in turn (which goes first alternating, mode ``first``
    first), so the two sides of a comparison run seconds apart, not minutes; each daemon's totals."""
    parts: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i, config in enumerate(configs):
        for mode in modes if (i + first) % 2 == 0 else modes[::-1]:
            parts[mode].append(run_case(connections[mode], [config]))
    totals = {}
    for mode, rs in parts.items():
        sums = {k: sum(r[k] for r in rs) for k in ("tokens", "seconds", "drafted", "accepted", "verifications",
                                                    "decode_tokens", "decode_seconds")}
        totals[mode] = {"tok_s": sums["tokens"] / sums["seconds"], **sums}
    return totals


def worst_case(rounds: int, output_tokens: int, streams: list[int]) -> None:
    import random
    import time

    import llmd.daemon.engine.engine as engine_module
    from llmd import LLM, SamplingParams
    from llmd.daemon.engine.ngram_proposer import draft_cost

    llm = LLM()
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(128)] for _ in range(max(streams))]
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    real = engine_module.lookup
    print(cpu_profile.machine_line())
    print(f"{'streams':>7} | {'off tok/s':>9} {'wrong tok/s':>11} {'ratio':>7} | {'drafted/token':>13} "
          f"{'modelled cost':>13}")
    try:
        for n in streams:
            rates: dict[str, list[float]] = {"off": [], "wrong": []}
            drafted = generated = 0
            for rnd in range(rounds):
                for mode in ("off", "wrong") if rnd % 2 == 0 else ("wrong", "off"):
                    engine.config.speculative = "off" if mode == "off" else "ngram"
                    engine_module.lookup = (lambda tokens, k: ([0] * k, 4)) if mode == "wrong" else real
                    batch = [p[:-1] + [1000 + 100 * rnd + i] for i, p in enumerate(prompts[:n])]  # no cache hits
                    before = engine.num_draft_tokens
                    start = time.perf_counter()
                    outs = llm.generate(batch, params)
                    tokens = sum(len(o.token_ids) for o in outs)
                    rates[mode].append(tokens / (time.perf_counter() - start))
                    if mode == "wrong":
                        drafted, generated = drafted + engine.num_draft_tokens - before, generated + tokens
            off, wrong = (sorted(rates[m])[len(rates[m]) // 2] for m in ("off", "wrong"))
            share = drafted / generated
            print(f"{n:>7} | {off:>9.1f} {wrong:>11.1f} {wrong / off:>6.3f}x | {share:>13.3f} "
                  f"{100 * share * draft_cost(n):>12.1f}%")
    finally:
        engine_module.lookup = real


def self_draft(layers: int, rounds: int, requests: int, prompt_tokens: int, output_tokens: int) -> None:
    import dataclasses
    import random
    import time

    from llmd.bench import edit_messages
    from llmd.daemon.engine.engine import LLMEngine
    from llmd.daemon.engine_args import EngineArgs
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.tokenizer import chat_token_ids

    args = EngineArgs(speculative="off")
    resolved = args.resolve()
    runtime = resolved.load()
    draft = resolved.load_model().model  # the same checkpoint, cut to its first layers
    if not 0 < layers < draft.config.num_layers:
        raise SystemExit(f"--self-draft takes 1..{draft.config.num_layers - 1} layers, got {layers}")
    draft.model.layers = draft.model.layers[:layers]
    draft.config = dataclasses.replace(draft.config, num_layers=layers,
                                       sliding_windows=draft.config.sliding_windows[:layers])
    draft.prepare_decode()
    engines = {"off": runtime.engine,
               "draft": LLMEngine(runtime.engine.model, runtime.tokenizer,
                                  dataclasses.replace(args.engine_config(), speculative="draft"),
                                  eos_token_ids=runtime.engine.eos_token_ids, draft_model=draft)}
    estimate, engines["draft"].draft_pass_cost = engines["draft"].draft_pass_cost, 0.0
    params = SamplingParams(temperature=0, max_tokens=output_tokens)
    rates: dict[str, list[float]] = {"off": [], "draft": []}
    for rnd in range(rounds):
        rng = random.Random(rnd)
        prompts = [chat_token_ids(runtime.tokenizer, edit_messages(rng, prompt_tokens)) for _ in range(requests)]
        for mode in ("off", "draft") if rnd % 2 == 0 else ("draft", "off"):
            engine, tokens = engines[mode], 0
            start = time.perf_counter()
            for i, ids in enumerate(prompts):
                engine.add_request(f"{mode}{rnd}.{i}", ids, params)
                while engine.has_unfinished():
                    tokens += sum(len(d.token_ids) for d in engine.step())
            rates[mode].append(tokens / (time.perf_counter() - start))
    d = engines["draft"]
    off, on = (sorted(rates[m])[len(rates[m]) // 2] for m in ("off", "draft"))
    print(cpu_profile.machine_line())
    print(f"draft: the model's first {layers} of {runtime.engine.model.config.num_layers} layers (the engine's cost "
          f"estimate of a draft pass: {estimate:.2f} of a step, at which it would not draft); edit chats, 1 stream, "
          f"{requests} requests in a row, median of {rounds} rounds")
    print(f"off {off:.1f} tok/s, draft {on:.1f} tok/s: {on / off:.2f}x; "
          f"{100 * d.num_accepted_tokens / max(d.num_draft_tokens, 1):.0f}% of {d.num_draft_tokens} drafts accepted, "
          f"{1 + d.num_accepted_tokens / max(d.num_verifications, 1):.2f} tokens per verification")


def where_time(rounds: int, requests: int, streams: list[int], prompt_tokens: int, output_tokens: int) -> None:
    import time

    from llmd import LLM
    from llmd.bench import run_bench_in_process

    llm = LLM(prefix_cache=False)  # both modes run the same prompts: no hits on the other's
    engine = llm.engine
    step, record = engine.step, engine.meter.record
    steps: list[tuple[float, int, int, int]] = []  # seconds, prompt tokens, tokens made, drafts verified
    made: list[tuple[int, int]] = []

    def recorded(start: float, num_prefill: int, num_decode: int) -> None:
        made.append((num_prefill, num_decode))
        record(start, num_prefill, num_decode)

    def timed() -> list[Any]:
        made.clear()
        drafted, start = engine.num_draft_tokens, time.perf_counter()
        deltas = step()
        if made:
            steps.append((time.perf_counter() - start, *made[0], engine.num_draft_tokens - drafted))
        return deltas

    engine.meter.record, engine.step = recorded, timed
    print(cpu_profile.machine_line())
    print(f"edit chats, ~{prompt_tokens} prompt tokens, at most {output_tokens} out; one stream: {requests} in a row; "
          f"{rounds} rounds, off and ngram in turn; sums over the rounds")
    print(f"{'streams':>7} {'mode':>5} | {'tok/s':>6} | {'prefill s':>9} {'share':>5} | {'decode s':>8} {'tok/s':>6} "
          f"{'tok/step':>8} {'drafts/step':>11} {'ms/step':>7}")
    for n in streams:
        # by mode: run seconds, tokens; prefill steps' seconds; decode steps, their seconds, tokens, drafts
        sums = {m: dict.fromkeys(("run_s", "tokens", "prefill_s", "steps", "decode_s", "tok", "drafts"), 0.0)
                for m in ("off", "ngram")}
        for rnd in range(rounds):
            for mode in ("off", "ngram") if rnd % 2 == 0 else ("ngram", "off"):
                engine.config.speculative = mode
                for seed in [1000 * rnd + i for i in range(requests if n == 1 else 1)]:
                    steps.clear()
                    report = run_bench_in_process(llm, BenchConfig(workload="edit", num_streams=n, seed=seed,
                                                                   prompt_tokens=prompt_tokens,
                                                                   output_tokens=output_tokens)).report
                    decode = [(t, tok, d) for t, prompt, tok, d in steps if not prompt]
                    s = sums[mode]
                    s["run_s"] += report.duration_s
                    s["tokens"] += report.output_tokens
                    s["prefill_s"] += sum(t for t, prompt, _, _ in steps if prompt)
                    s["steps"] += len(decode)
                    for key, values in zip(("decode_s", "tok", "drafts"), zip(*decode)):
                        s[key] += sum(values)
        for mode, s in sums.items():
            steps_n = max(s["steps"], 1)
            print(f"{n:>7} {mode:>5} | {s['tokens'] / s['run_s']:>6.1f} | {s['prefill_s']:>9.2f} "
                  f"{100 * s['prefill_s'] / s['run_s']:>4.0f}% | {s['decode_s']:>8.2f} "
                  f"{s['tok'] / s['decode_s']:>6.1f} "
                  f"{s['tok'] / steps_n:>8.2f} {s['drafts'] / steps_n:>11.2f} {1000 * s['decode_s'] / steps_n:>7.1f}")
        off, on = sums["off"], sums["ngram"]
        print(f"{n:>7} ratio | {(on['tokens'] / on['run_s']) / (off['tokens'] / off['run_s']):>5.2f}x | decode steps "
              f"{(on['tok'] / on['decode_s']) / (off['tok'] / off['decode_s']):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5, help="one stream: requests in a row per round")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=["edit", "streams"], choices=["edit", "streams"])
    parser.add_argument("--edit-prompt-tokens", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=256, help="edit: at most; streams: exactly")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--draft-model", default=None, help="compare --speculative draft with it (not ngram)")
    parser.add_argument("--worst-case", action="store_true", help="drafts always wrong, in this process")
    parser.add_argument("--where", action="store_true",
                        help="edit, off and on: prefill and decode steps, in this process")
    parser.add_argument("--self-draft", type=int, metavar="LAYERS",
                        help="the model's first LAYERS layers as its draft model, in this process")
    args = parser.parse_args()
    if args.worst_case:
        worst_case(args.rounds, args.output_tokens, args.streams)
        return
    if args.where:
        where_time(args.rounds, args.requests, args.streams, args.edit_prompt_tokens, args.output_tokens)
        return
    if args.self_draft is not None:
        self_draft(args.self_draft, args.rounds, args.requests, args.edit_prompt_tokens, args.output_tokens)
        return
    modes = ("off", "draft" if args.draft_model else "ngram")
    on_mode = modes[1]
    tmp = tempfile.TemporaryDirectory()
    llmd = [sys.executable, "-m", "llmd"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMD_SPECULATIVE", "LLMD_DRAFT_MODEL"))}
    dirs = {mode: Path(tmp.name) / mode for mode in modes}
    results: dict[tuple[str, int], dict[str, list[dict[str, float]]]] = {}
    try:
        for mode, socket_dir in dirs.items():
            model = ["--model", args.model] if args.model else []
            draft = ["--draft-model", args.draft_model] if mode == "draft" else []
            subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir), "--speculative", mode, *model, *draft],
                           check=True, env=env)
        connections = {mode: load_connection(d) for mode, d in dirs.items()}
        with Client(dirs[on_mode]) as client:
            info = client.info()
        for mode in modes:  # warm-up: first-call costs out of the figures
            run_case(connections[mode], [BenchConfig(num_streams=2, prompt_tokens=16, output_tokens=8)])
        for rnd in range(args.rounds):
            for workload in args.workloads:
                for n in args.streams:
                    prompt = args.edit_prompt_tokens if workload == "edit" else 128
                    seeds = [1000 * rnd + i for i in range(args.requests if n == 1 else 1)]
                    configs = [BenchConfig(workload=workload, num_streams=n, prompt_tokens=prompt,
                                           output_tokens=args.output_tokens, seed=s) for s in seeds]
                    by_mode = results.setdefault((workload, n), {m: [] for m in modes})
                    if len(configs) > 1:  # one stream: request by request, the daemons in turn
                        for mode, total in run_interleaved(connections, modes, configs, rnd).items():
                            by_mode[mode].append(total)
                    else:
                        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                            by_mode[mode].append(run_case(connections[mode], configs))
                    print(f"  round {rnd + 1} {workload} x{n}: " + ", ".join(
                        f"{m} {by_mode[m][-1]['tok_s']:.1f} tok/s" for m in modes), file=sys.stderr)
    finally:
        for socket_dir in dirs.values():
            subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, capture_output=True,
                           env=env)
        tmp.cleanup()
    print(cpu_profile.machine_line())
    drafting = f"; draft model {info.get('draft_model')}" if on_mode == "draft" else ""
    print(f"model {info.get('model')}{drafting}; {info.get('dtype')}, {kernels_line(info.get('kernels', {}))}; "
          f"greedy; median of {args.rounds} rounds; one stream: {args.requests} requests in a row")
    print(f"{'workload':<8} {'streams':>7} | {'off tok/s':>9} {on_mode + ' tok/s':>11} | {'on/off':>6} {'range':>11} | "
          f"{'decode':>6} | {'accepted':>8} {'tok/verify':>10} {'drafted':>8}")
    for (workload, n), by_mode in results.items():
        med = {m: sorted(r["tok_s"] for r in rs)[len(rs) // 2] for m, rs in by_mode.items()}
        ratios = sorted(on["tok_s"] / off["tok_s"] for off, on in zip(by_mode["off"], by_mode[on_mode]))
        # one stream: the same ratio after each request's first token (its prefill left out)
        decode = sorted((on["decode_tokens"] / on["decode_seconds"]) / (off["decode_tokens"] / off["decode_seconds"])
                        for off, on in zip(by_mode["off"], by_mode[on_mode])
                        if off["decode_seconds"] > 0 and on["decode_seconds"] > 0)
        decode_text = f"{decode[len(decode) // 2]:>5.2f}x" if decode else f"{'-':>6}"
        drafted, accepted, verifications = (sum(r[k] for r in by_mode[on_mode])
                                            for k in ("drafted", "accepted", "verifications"))
        print(f"{workload:<8} {n:>7} | {med['off']:>9.1f} {med[on_mode]:>11.1f} | {ratios[len(ratios) // 2]:>5.2f}x "
              f"{ratios[0]:>5.2f}-{ratios[-1]:.2f} | {decode_text} | {100 * accepted / max(drafted, 1):>7.0f}% "
              f"{1 + accepted / max(verifications, 1):>10.2f} {drafted / len(ratios):>8.0f}")


if __name__ == "__main__":
    main()
