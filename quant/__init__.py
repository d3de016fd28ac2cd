"""Weight quantisation: INT8 and INT4 weight-only formats, GGUF block import, quantised Linears.

Layout (gpt-fast style): ``common.py`` holds the shared helpers (grouping; the nibble packing is
the kernels' layout, llmd.kernels.int_layout); each scheme has one file with its quantise/dequantise
functions and its Linear module (``int8.py``, ``int4.py``); ``gguf_import.py`` turns GGUF
Q8_0/Q4_0/Q4_1 blocks into those formats without a dequantise/requantise round trip; ``bnb.py``
wraps bitsandbytes' NF4 and LLM.int8 modules; ``int4_fit.py`` fits INT4 groups to calibration.

This package knows weights, not models: which format each projection of a model takes
(``--quant``) is the runtime's choice (llmd.daemon.quantization), and so is the calibration text
(llmd.daemon.calibration), and the names ``--quant`` takes live in llmd.config.
"""
