"""Readers for weight files, and the prepared-weights cache. Each reader validates the file against
its own header before trusting any offset or size in it, and yields ``(hf_name, tensor)`` pairs for
``LlamaForCausalLM.load_weights``; the cache (prepared_cache.py, cache_files.py) reads its own files
as untrusted the same way."""
