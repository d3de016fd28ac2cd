"""The serving engine: sequences, paged KV cache, scheduler, model runner, sampler, detokenizer."""
