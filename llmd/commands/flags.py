"""What the commands' flags share: bounded number types (argparse says what is wrong in one line),
the flags of settings, generated from the option registry (llmd.config.OPTIONS: the same name,
help, choices and checks as the config file's keys and the ``LLMD_*`` variables), and the effective
settings they give."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from llmd.config import OPTIONS, Settings, resolve
from llmd.protocol import MAX_PROMPT_CHARS

# NOTE: msgpack carries signed 64-bit integers at most; a larger one fails while the request is
# being encoded, so every integer flag is bounded here, where argparse can say so in one line.
MAX_WIRE_INT = 2**63 - 1  # also SamplingParams' bound for seed: [0, 2**63)


def float_where(text: str, expected: str, ok: Callable[[float], bool]) -> float:
    """``text`` as a finite float that passes ``ok``, else a usage error saying ``expected``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    return float_where(text, "a finite number >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return float_where(text, "a finite number > 0", lambda v: v > 0)


def probability(text: str) -> float:
    return float_where(text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def int_in(low: int, high: int, high_text: str | None = None) -> Callable[[str], int]:
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


non_negative_int = int_in(0, MAX_WIRE_INT, "2**63-1")
positive_int = int_in(1, MAX_WIRE_INT, "2**63-1")
prompt_tokens = int_in(1, MAX_PROMPT_CHARS)  # token ids go as a list the protocol caps at this length


def add_settings_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """A flag for each setting ``names`` (default: every one) as llmd.config.OPTIONS defines it. Their
    default is None, meaning "not given": the ``LLMD_*`` variables, the config file, then the
    built-in default fill those in (:func:`settings_of`)."""
    for option in (OPTIONS[name] for name in names) if names is not None else OPTIONS.values():
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
        names_ = [option.flag, "-m"] if option.name == "model" else [option.flag]
        parser.add_argument(*names_, **kwargs)


def _flag_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected {e}, got {text!r}") from None
    convert.__name__ = name  # argparse names the type in its messages
    return convert


def settings_of(args: argparse.Namespace) -> Settings:
    """The effective settings: the flags ``args`` has and was given, over the ``LLMD_*`` variables,
    over the config file."""
    return resolve({name: getattr(args, name, None) for name in OPTIONS})
