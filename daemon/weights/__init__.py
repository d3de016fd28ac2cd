"""Readers for weight files. Each validates the file against its own header before trusting any
offset or size in it, and yields ``(hf_name, tensor)`` pairs for ``LlamaForCausalLM.load_weights``."""
