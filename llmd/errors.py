"""Errors a user can cause, each with a message that says what to do.

The CLI prints ``llmd: error: <message>`` for any :class:`LlmdError` and exits non-zero without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class LlmdError(Exception):
    """Base class for user-facing errors. ``str(err)`` is the one line shown to the user."""

    exit_code: int = 1


class ModelNotFoundError(LlmdError):
    """``--model`` names nothing we can find locally (path, HF cache, default model)."""


class InvalidModelError(LlmdError):
    """The path exists but is not a model llmd can read (missing config, weights or tokenizer)."""


class UnsupportedModelError(LlmdError):
    """The model is well formed but its architecture or one of its features is not implemented."""


class CorruptModelError(LlmdError):
    """A weight file is truncated or its header points outside the file."""


class WeightMismatchError(LlmdError):
    """A tensor's shape (or presence) disagrees with what the model config implies."""


class UnsupportedTensorTypeError(UnsupportedModelError):
    """A GGUF tensor is stored in a type llmd cannot read."""


class RequestError(LlmdError):
    """A request's parameters are invalid (bad sampling values, empty prompt)."""


class PromptTooLongError(RequestError):
    """Prompt plus max_tokens does not fit the model's context."""


class PullError(LlmdError):
    """``llmd pull`` could not fetch a model: the network, the hub's answer, or a file that fails its hash."""
