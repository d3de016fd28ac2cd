"""Prompt lookup's match in the native CPU library (kernels/cpu/ngram.c): one call where numpy
took a dozen, each slow right after a decode step has pushed everything out of the caches.

:func:`llmd.daemon.engine.ngram_proposer.lookup` calls :func:`match` when :func:`usable` says so,
else its numpy code: the reference, which this matches exactly.
"""

from __future__ import annotations

import ctypes

import numpy as np

from llmd.kernels.native import library


def usable() -> bool:
    """Whether the library is built (else the numpy path)."""
    return library() is not None


def match(tokens: np.ndarray, context: int) -> tuple[int, int]:
    """``(end, length)``: the latest position ``end`` before the last of ``tokens`` (contiguous
    int64) holding the last token, of those agreeing with the tokens before the last for longest
    without a break; ``length`` counts the agreeing tokens, the last one included, up to
    ``context``. ``(-1, 0)`` when the last token does not recur."""
    if tokens.dtype != np.int64 or not tokens.flags.c_contiguous:
        raise ValueError("match takes a contiguous int64 array")
    length = ctypes.c_int64()
    end = library().llmd_ngram_match(tokens.ctypes.data, len(tokens), context, ctypes.byref(length))
    return end, length.value
