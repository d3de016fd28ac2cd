"""``llmd bench``: a load against the running daemon (or the engine in this process), reported;
or, with ``--perplexity``, the model's perplexity on a text."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmd.commands.flags import (add_settings_flags, int_in, non_negative_int, positive_float, positive_int,
                                 prompt_tokens, settings_of)
from llmd.commands.runtime import runtime_settings
from llmd.errors import LlmdError
from llmd.protocol import MAX_PROMPT_CHARS


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure the running daemon under load (throughput, latencies)",
                           description="A load generator against the running daemon; prints a report. Lengths are "
                                       "exact: prompts go as token ids, outputs ignore end-of-text.")
    bench.add_argument("--workload", choices=["streams", "prefix", "poisson", "edit"], default="streams",
                       help="streams: N at once; prefix: a shared system prompt + distinct questions; "
                            "poisson: random arrivals at --rate; edit: N chats asking for ~--prompt-tokens of "
                            "code rewritten with a name changed (output repeating the prompt) (default: streams)")
    bench.add_argument("--streams", "-n", type=positive_int, default=16, help="concurrent requests (default: 16)")
    bench.add_argument("--prompt-tokens", type=prompt_tokens, default=128, help="prompt length (default: 128)")
    bench.add_argument("--output-tokens", type=positive_int, default=128, help="output length (default: 128)")
    bench.add_argument("--prefix-tokens", type=prompt_tokens, default=1000,
                       help="shared system prompt of the prefix workload (default: 1000)")
    bench.add_argument("--rate", type=positive_float, default=4.0, help="poisson: requests per second (default: 4)")
    bench.add_argument("--requests", type=positive_int, default=32, help="poisson: how many (default: 32)")
    bench.add_argument("--seed", type=non_negative_int, default=None,
                       help="repeat a run's prompts and arrivals (default: new ones each run, so an earlier run's "
                            "prompts do not hit the prefix cache)")
    bench.add_argument("--perplexity", default=None, metavar="FILE",
                       help="instead of a load: the model's perplexity on a UTF-8 text file (prompt log-probabilities)")
    bench.add_argument("--window", type=int_in(2, MAX_PROMPT_CHARS), default=None,
                       help="--perplexity: tokens scored per request (default: 1024)")
    bench.add_argument("--slo-ttft", type=positive_float, default=None, metavar="S",
                       help="goodput: time to first token")
    bench.add_argument("--slo-itl", type=positive_float, default=None, metavar="S",
                       help="goodput: largest inter-token gap")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw the latency distributions and throughput over time (needs matplotlib)")
    bench.add_argument("--url", default=None, metavar="URL",
                       help="instead of the local daemon: any OpenAI-compatible server (llmd start --http, "
                            "llama-server, vLLM), e.g. http://127.0.0.1:8080/v1; sends the api_key setting if set")
    add_settings_flags(bench, ["socket_dir"])
    bench.add_argument("--in-process", action="store_true",
                       help="run the engine in this process (llmd.LLM) instead of the daemon, to see what the "
                            "daemon and its protocol cost; the runtime's settings below (and the config file's) "
                            "build it as the daemon would")
    add_settings_flags(bench, ["model", "dtype", "quant", "group_size", "attention"])
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from llmd.bench import BenchConfig, run_bench, run_bench_in_process
    from llmd.client import load_connection

    try:
        config = BenchConfig(workload=args.workload, num_streams=args.streams, prompt_tokens=args.prompt_tokens,
                             output_tokens=args.output_tokens, prefix_tokens=args.prefix_tokens, rate=args.rate,
                             num_requests=args.requests, seed=args.seed, slo_ttft=args.slo_ttft,
                             slo_itl=args.slo_itl)
    except ValueError as e:
        raise LlmdError(str(e)) from None
    plot_path = None
    if args.plot is not None:
        from llmd.bench_plot import check_plot_path

        plot_path = check_plot_path(args.plot)
    text = None
    if args.perplexity is not None:
        from llmd.perplexity import read_text

        try:
            text = read_text(args.perplexity)  # before a model loads
        except ValueError as e:
            raise LlmdError(str(e)) from None
    if args.url is not None and (args.in_process or text is not None):
        raise LlmdError("--url measures a server's load; it does not go with --in-process or --perplexity")
    llm = _bench_llm(args) if args.in_process else None
    connection = None if args.in_process or args.url else load_connection(settings_of(args)["socket_dir"])
    if text is not None:
        return _bench_perplexity(args, text, llm, connection)
    if args.url is not None:
        from llmd.bench_http import run_bench_http

        run = asyncio.run(run_bench_http(args.url, config, settings_of(args)["api_key"],
                                         show_progress=sys.stderr.isatty()))
    elif llm is not None:
        run = run_bench_in_process(llm, config, show_progress=sys.stderr.isatty())
    else:
        run = asyncio.run(run_bench(connection, config, show_progress=sys.stderr.isatty()))
    report = run.report
    print(json.dumps(report.to_dict()) if args.json else report.table())
    if plot_path is not None:
        from llmd.bench_plot import plot

        plot(run, plot_path)
        if not args.json:
            print(f"{'plot':<12} {plot_path}")
    return 1 if report.num_failed else 0


def _bench_llm(args: argparse.Namespace) -> Any:
    """``llmd bench --in-process``: the engine in this process, built from the settings as the
    daemon builds it, so the two compare; unpaced for a perplexity (whose last digits would else
    move with the machine's load: llmd.daemon.llm)."""
    from llmd.daemon.llm import LLM

    try:
        return LLM(**runtime_settings(settings_of(args), paced=args.perplexity is None))
    except ValueError as e:
        raise LlmdError(str(e)) from None


def _bench_perplexity(args: argparse.Namespace, text: str, llm: Any, connection: dict | None) -> int:
    import json

    from llmd import perplexity

    window = args.window or perplexity.DEFAULT_WINDOW
    try:
        if llm is not None:
            report = perplexity.measure_in_process(llm, text, args.perplexity, window)
        else:
            report = perplexity.measure(connection, text, args.perplexity, window)
    except ValueError as e:
        raise LlmdError(str(e)) from None
    print(json.dumps(report.to_dict()) if args.json else report.table())
    return 0
