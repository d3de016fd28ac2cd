"""The ``llmd`` command line: one parser, each command's flags and work in its own module of
llmd/commands/.

Every error a user can cause is an :class:`llmd.errors.LlmdError`; :func:`main` prints it as one
line (``llmd: error: ...``) and exits non-zero. Heavy imports (torch, transformers, the runtime)
happen inside the commands that build the runtime, so ``llmd --help``, ``llmd --version`` and the
commands that talk to a daemon answer at once (tests/test_cli_errors.py checks what they import).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import llmd
from llmd.commands import COMMANDS
from llmd.errors import LlmdError
from llmd.kernels import cpu_profile


class _Version(argparse.Action):
    """``--version``: the version looked up when asked (argparse's own action needs it at build)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"llmd {llmd.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmd",
        description="llmd: a local LLM inference daemon. Run `llmd COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show llmd's version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


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
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "online", False):
        # Offline-first: no library reaches for the network (the machine may have none); `llmd pull`
        # alone downloads. NOTE: set before any command imports huggingface_hub, which reads it once.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
