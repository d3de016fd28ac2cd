"""Weight quantisation: INT8 and INT4 weight-only formats, GGUF block import, quantised Linears.

Layout (gpt-fast style): ``common.py`` holds the shared helpers (nibble packing, grouping); each
scheme has one file with its quantise/dequantise functions and its Linear module (``int8.py``,
``int4.py``); ``gguf_import.py`` turns GGUF Q8_0/Q4_0/Q4_1 blocks into those formats without a
dequantise/requantise round trip.

``apply.py`` quantises a loaded model's projections (``--quant int8|int4``). GGUF blocks are not
yet served natively: they are dequantised on load and requantised if asked (see issue 5).
"""
