"""Decode steps replayed as CUDA graphs, one per batch-size bucket (``--cuda-graphs``).

A decode step of the default model launches 125 small kernels (llmd.kernels.decode_triton);
replaying a captured graph launches them in one call, so the step runs at the GPU's speed instead
of the host's. What
makes a step capturable: its inputs live in persistent buffers (daemon/engine/decode_inputs.py),
padded to a bucket of rows (1, 2, 4, ... ``max_num_seqs``), and nothing in the model's forward
reads host-side state that changes between steps (tests/test_decode_inputs.py checks this on the
CPU: a step run on buffers refilled for other sequences, with stale host metadata, gives their
fresh result). The attention's split count is fixed at capture for the longest context; the
split-K scratch and the step's intermediate buffers are allocated in the warm-up runs before the
capture and never freed (llmd.kernels.launch).

NOTE: never run on a GPU (none was available to this project): README "GPU status". Off by
default; the Triton attention backend is required (its KV write skips padding rows).
"""

from __future__ import annotations

import logging

import torch

from llmd.daemon.engine.decode_inputs import DecodeInputs

log = logging.getLogger("llmd")


class DecodeGraphs:
    """Args:
        model: the loaded model (on CUDA, Triton attention).
        inputs: the decode steps' persistent buffers (with ``buckets``).
        kv_caches: the KV cache the graphs read and write (captured by address).
        max_seq_len: the longest context, which the attention's split count is chosen for.
    """

    def __init__(self, model: torch.nn.Module, inputs: DecodeInputs, kv_caches: list, max_seq_len: int) -> None:
        self.model, self.inputs, self.kv_caches, self.max_seq_len = model, inputs, kv_caches, max_seq_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def run(self, rows: int) -> torch.Tensor:
        """The final hidden states ``[rows, hidden]`` of the step the buffers hold (captured on
        first use of a bucket: warm-up runs on a side stream, as CUDA requires, then the capture)."""
        if rows not in self._graphs:
            self._graphs[rows] = self._capture(rows)
        graph, out = self._graphs[rows]
        graph.replay()
        return out

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions, meta = self.inputs.views(rows)
        meta.max_seq_len = self.max_seq_len  # the split count for the longest context, baked in
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels; rewrites this step's K/V with the same values
            for _ in range(2):
                self.model(ids, positions, self.kv_caches, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(ids, positions, self.kv_caches, meta)
        self._pool = graph.pool()
        log.info("captured the decode step for %d rows as a CUDA graph", rows)
        return graph, out
