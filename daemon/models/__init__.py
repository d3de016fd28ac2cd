"""Model implementations. Each takes a flat ragged token batch (``input_ids[T]``, ``positions[T]``)
plus :class:`llmd.daemon.attention.AttentionMetadata`, so the paged engine can drive it."""

from llmd.daemon.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
