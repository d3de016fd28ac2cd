"""The calibration text: a fixed text every machine has, the docstrings of a list of standard-library
modules, for what llmd measures on a model's activations when it loads (the INT4 requantisation's
importance, llmd.daemon.calibration; an int8 KV cache's key centres, llmd.daemon.engine.key_centres).
Its own module, importing nothing of llmd, so that the engine can read it without the loader's
machinery."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence

CALIBRATION_MODULES = ("abc", "asyncio", "base64", "contextlib", "copy", "csv", "datetime", "decimal", "enum",
                       "fractions", "glob", "hashlib", "heapq", "io", "ipaddress", "operator", "pprint", "queue",
                       "random", "shutil")
CALIBRATION_TOKENS = 512


def stdlib_docstrings(modules: Sequence[str]) -> str:
    """The docstrings of ``modules`` and of their public functions and classes, in a fixed order."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == name:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def calibration_ids(tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The text's first ``num_tokens`` token ids."""
    return [int(t) for t in tokenizer.encode(stdlib_docstrings(CALIBRATION_MODULES))][:num_tokens]
