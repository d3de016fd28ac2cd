"""Weight quantisation (INT8 / INT4 formats, GGUF block import, quantised Linear modules).

Empty until the quantisation issue lands; GGUF weights are dequantised to the compute dtype by
``llmd.daemon.weights.gguf_file`` meanwhile.
"""
