"""The inputs of a pure decode step (every scheduled sequence adds one token), in buffers allocated
once and refilled each step.

Why: a step then allocates nothing for its inputs (on the CPU the buffers are filled through numpy
views, cheaper than building tensors from lists), and the tensors the model reads are the same
objects every step, which is what a captured CUDA graph needs (daemon/engine/cuda_graphs.py): a
replay reads whatever the buffers hold. With ``buckets`` the rows are padded to the next power of
two (capped at ``max_rows``): a padding row decodes token 0 at position 0 with a context of one
token, from slot -1, which the KV writes skip (its output is never read).

Block tables are ``[rows, max_blocks]``, as wide as the longest sequence can be; each row holds its
sequence's block ids up front (what lies beyond is never read: kernels read the first
``ceil(seq_len / block_size)`` entries).
"""

from __future__ import annotations

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.engine.sequence import Sequence

PAD_SLOT = -1  # a padding row's slot: the KV writes skip negative slots


class DecodeInputs:
    """Args:
        max_rows: the most sequences a step decodes (``max_num_seqs``).
        max_blocks: block-table width (blocks of the longest sequence).
        block_size: tokens per block.
        device: where the model runs; on a GPU host buffers are pinned and copied once per step.
        buckets: pad the rows to powers of two (for CUDA graphs).
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 buckets: bool = False) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.device = device
        self.buckets = buckets
        pin = device.type == "cuda"
        # One buffer, so that a GPU step copies its inputs once: the per-row scalars first (ids,
        # positions and slots int64, then the int32 lengths in the int64 words after them), then
        # the block tables row by row; a step copies the scalars and its rows' tables, one prefix.
        rows = max_rows
        self._scalar_words = 3 * rows + -(-rows // 2)
        self._buffer = torch.zeros(self._scalar_words + rows * max_blocks, dtype=torch.long, pin_memory=pin)
        self._host = self._fields(self._buffer)
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._dev_buffer = self._buffer if device.type == "cpu" else torch.zeros_like(self._buffer, device=device)
        self._dev = self._host if device.type == "cpu" else self._fields(self._dev_buffer)
        # a decode step's query_start_loc is 0, 1, ..., rows: one constant for every step
        self._query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = {}

    def _fields(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, words = self.max_rows, self._scalar_words
        return {"ids": buffer[:rows], "positions": buffer[rows:2 * rows], "slots": buffer[2 * rows:3 * rows],
                "seq_lens": buffer[3 * rows:words].view(torch.int32)[:rows],
                "tables": buffer[words:].view(rows, self.max_blocks)}

    @property
    def num_buffers(self) -> int:
        """The host buffers; on a GPU :meth:`fill` copies each to the device once per step."""
        return 1

    def rows_for(self, num_seqs: int) -> int:
        """Rows a step of ``num_seqs`` sequences runs: itself, or its bucket."""
        if num_seqs < 1 or num_seqs > self.max_rows:
            raise ValueError(f"a decode step takes 1..{self.max_rows} sequences, got {num_seqs}")
        if not self.buckets:
            return num_seqs
        return min(1 << (num_seqs - 1).bit_length(), self.max_rows)

    def fill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write the step's inputs for ``seqs`` (each computing the one token after its computed
        ones) and return ``(input_ids, positions, meta)``: views of the buffers, the same objects
        for every step of the same row count (see :meth:`views`)."""
        rows = self.rows_for(len(seqs))
        bs = self.block_size
        ids, pos, slots, lens, tables = (self._np[k] for k in ("ids", "positions", "slots", "seq_lens", "tables"))
        for i, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            blocks = seq.block_ids
            ids[i] = seq.token_ids[p]
            pos[i] = p
            slots[i] = blocks[p // bs] * bs + p % bs
            lens[i] = p + 1
            tables[i, :len(blocks)] = blocks
        n = len(seqs)
        if rows > n:
            ids[n:rows], pos[n:rows], slots[n:rows], lens[n:rows], tables[n:rows, 0] = 0, 0, PAD_SLOT, 1, 0
        if self.device.type != "cpu":
            used = self._scalar_words + rows * self.max_blocks
            self._dev_buffer[:used].copy_(self._buffer[:used], non_blocking=True)
        input_ids, positions, meta = self.views(rows)
        # the host side of the metadata, for the paths that read it (a captured graph does not)
        meta.seq_lens = lens[:rows].tolist()
        meta.max_seq_len = max(meta.seq_lens)
        return input_ids, positions, meta

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's tensors for ``rows`` rows: created once per row count, then the same objects."""
        if rows not in self._views:
            d = self._dev
            meta = AttentionMetadata(slot_mapping=d["slots"][:rows], query_lens=[1] * rows, seq_lens=[1] * rows,
                                     block_tables=d["tables"][:rows], query_start_loc=self._query_start[:rows + 1],
                                     seq_lens_tensor=d["seq_lens"][:rows])
            self._views[rows] = (d["ids"][:rows], d["positions"][:rows], meta)
        return self._views[rows]
