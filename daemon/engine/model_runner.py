"""Turns a scheduled batch into the model's flat ragged inputs, runs it and samples.

Inputs, per DESIGN.md: ``input_ids[T]``, ``positions[T]``, ``slot_mapping[T]``, and per sequence
``query_lens``, ``seq_lens`` and ``block_tables``. No padding to a rectangle: prompt chunks and
decode tokens of different sequences sit side by side. Logits are computed only for the last
token of each sequence that samples in this step.
"""

from __future__ import annotations

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.engine.sampler import SampleRequest, SampleResult, Sampler
from llmd.daemon.engine.scheduler import ScheduledBatch
from llmd.daemon.engine.sequence import Sequence
from llmd.daemon.models import LlamaForCausalLM


def kv_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Owns the KV cache tensors and the per-request RNGs.

    Args:
        model: the loaded model.
        num_blocks, block_size: the paged KV pool's shape.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.config
        self.device = model.model.embed_tokens.weight.device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=self.device),
             torch.zeros(shape, dtype=model.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's RNG."""
        self._generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self._generators[seq.request_id] = gen
        return gen

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat inputs for ``batch``; also returns the batch rows whose last token is sampled."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(row)
        max_blocks = max(len(seq.block_ids) for seq in batch.seqs)
        block_tables = torch.tensor([seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in batch.seqs],
                                    dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        seq_index = torch.repeat_interleave(torch.arange(len(batch.seqs), device=self.device),
                                            torch.tensor(query_lens, device=self.device))
        slot_mapping = block_tables[seq_index, pos // self.block_size] * self.block_size + pos % self.block_size
        meta = AttentionMetadata(slot_mapping=slot_mapping, query_lens=query_lens, seq_lens=seq_lens,
                                 block_tables=block_tables)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, pos, meta, sample_rows

    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], SampleResult | None]:
        """Run one step. Returns per scheduled sequence the sampled token (None while its prompt is
        unfinished), and the sampler's result for the sampled rows."""
        ids, pos, meta, sample_rows = self.prepare(batch)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        sampled: list[int | None] = [None] * len(batch.seqs)
        if not sample_rows:
            return sampled, None
        ends = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends[sample_rows]])
        rows = [
            SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, self._generator(seq))
            for seq in (batch.seqs[r] for r in sample_rows)
        ]
        result = self.sampler(logits, rows)
        for row, token in zip(sample_rows, result.token_ids):
            sampled[row] = token
        return sampled, result
