"""Weight quantisation: INT8 and INT4 weight-only formats, GGUF block import, quantised Linears.

Layout (gpt-fast style): ``common.py`` holds the shared helpers (nibble packing, grouping); each
scheme has one file with its quantise/dequantise functions and its Linear module (``int8.py``,
``int4.py``); ``gguf_import.py`` turns GGUF Q8_0/Q4_0/Q4_1 blocks into those formats without a
dequantise/requantise round trip; ``bnb.py`` wraps bitsandbytes' NF4 and LLM.int8 modules.

``apply.py`` decides the format of every projection (``--quant``), builds the model with them and
reports the memory the weights take. This file stays free of torch imports: the CLI reads the
scheme names from it.
"""

QUANT_SCHEMES = ("auto", "none", "int8", "int4", "nf4", "bnb-int8")
