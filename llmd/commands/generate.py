"""``llmd generate PROMPT``: one completion to stdout, through the running daemon, or in this
process when none serves the model asked for."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from llmd.commands.flags import (add_settings_flags, non_negative_float, non_negative_int, positive_int,
                                 probability, settings_of)
from llmd.commands.runtime import check_quant, runtime_settings
from llmd.config import Settings
from llmd.errors import LlmdError
from llmd.protocol import MAX_MESSAGE_BYTES, MAX_PROMPT_CHARS

# A prompt's UTF-8 bytes leave 64 KiB of a message (MAX_MESSAGE_BYTES) for the rest of it: ids,
# sampling parameters, msgpack framing.
MAX_PROMPT_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
# What a flag left out samples with, unless the model's [models."NAME"] table in the config file says otherwise
DEFAULTS = {"max_tokens": 256, "temperature": 0.7, "top_k": 40, "top_p": 0.9}
NOT_UTF8_FIX = "llmd takes UTF-8 text: convert it first, e.g. `iconv -f LATIN1 -t UTF-8`"


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion for one prompt",
                         description="Stream a completion for PROMPT to stdout.")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from stdin")
    add_settings_flags(gen, ["model", "dtype", "quant", "group_size"])
    # (defaults None: the model's own from the config file, else DEFAULTS)
    gen.add_argument("--max-tokens", "-n", type=positive_int, default=None,
                     help="stop after this many new tokens (default: 256, or the model's in the config file)")
    gen.add_argument("--temperature", "-t", type=non_negative_float, default=None,
                     help="sampling temperature; 0 is greedy (default: 0.7, or the model's)")
    gen.add_argument("--top-k", type=non_negative_int, default=None,
                     help="sample from the K likeliest tokens; 0 for all (default: 40, or the model's)")
    gen.add_argument("--top-p", type=probability, default=None,
                     help="sample from the smallest set of tokens whose probability reaches P (default: 0.9, "
                          "or the model's)")
    gen.add_argument("--seed", type=non_negative_int, default=None,
                     help="random seed for reproducible sampling, 0 to 2**63-1")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the model's chat template (the default for chat models)")
    mode.add_argument("--raw", dest="chat", action="store_false",
                      help="feed the prompt as plain text, without the chat template")
    add_settings_flags(gen, ["socket_dir"])
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Through the running daemon if it serves the model asked for, else in this process."""
    from llmd.client import DaemonNotRunningError, load_connection

    settings = settings_of(args)
    prompt = _read_prompt(args.prompt)
    try:
        connection = load_connection(settings["socket_dir"])
    except DaemonNotRunningError:
        connection = None
    model = None  # the daemon's default
    remote = args.model is not None and args.model.casefold() in {n.casefold() for n in settings.remotes}
    if remote:  # a remote model (config [remote."NAME"]): the daemon forwards to its server
        if connection is None:
            raise LlmdError(f"{args.model} is a remote model, reached through the daemon: `llmd start` first")
        model = args.model
    elif connection is not None and args.model is not None:
        from llmd.daemon.model_source import resolve_model  # light: no torch

        if str(resolve_model(args.model, settings["models_dir"]).path) != connection.get("model_path"):
            model = args.model  # the daemon loads it (and serves its default model still)
    if connection is None:
        from llmd.daemon.model_source import resolve_model

        check_quant(settings["quant"], settings["group_size"])  # only here: the daemon gets no such flags
        resolve_model(settings["model"], settings["models_dir"])  # a wrong --model is the error to report
        logging.getLogger("llmd").info("no llmd daemon is running: loading the model in this process "
                                       "(`llmd start` keeps it loaded for every request)")
        return _generate_in_process(args, settings, prompt)
    return _generate_with_daemon(args, prompt, connection, model)


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


def _sampling_kwargs(args: argparse.Namespace, model_defaults: dict[str, Any]) -> dict[str, Any]:
    """The flags given, over the model's sampling defaults (its config-file table: ``Settings.sampling``
    in this process, the daemon's ``info`` through it), over :data:`DEFAULTS`."""
    given = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_k", "top_p", "seed")
             if getattr(args, k) is not None}
    return DEFAULTS | model_defaults | given


def _generate_in_process(args: argparse.Namespace, settings: Settings, prompt: str) -> int:
    import torch

    from llmd.daemon.engine.sampling_params import SamplingParams
    from llmd.daemon.llm import LLM
    from llmd.daemon.tokenizer import encode_prompt

    params = SamplingParams(**_sampling_kwargs(args, settings.sampling))
    try:
        # One request: a KV pool for one sequence's context is all it can use (also on a GPU).
        llm = LLM(**runtime_settings(settings, max_num_seqs=1))
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


def _generate_with_daemon(args: argparse.Namespace, prompt: str, connection: dict, model: str | None) -> int:
    """Through the daemon, on its default model or ``model`` (which it loads if it must)."""
    from llmd.client import Client, ServerError

    with Client(connection=connection) as client:
        info = connection
        if model is not None:
            try:
                info = client.info(model)
            except ServerError as e:
                if e.code != "model_not_found":
                    raise
                # not loaded yet: a one-token request loads it (or says why it cannot), then its info
                # tells whether it chats and what it samples with by default
                client.generate(prompt, model=model, stream=False, max_tokens=1)
                info = client.info(model)
        chat = info.get("chat_template", False) if args.chat is None else args.chat
        kwargs = _sampling_kwargs(args, info.get("sampling_defaults") or {})
        if chat:
            stream = client.chat([{"role": "user", "content": prompt}], model=model, **kwargs)
        else:
            stream = client.generate(prompt, model=model, **kwargs)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
