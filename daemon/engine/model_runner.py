"""Turns a scheduled batch into the model's flat ragged inputs, runs it and samples.

Inputs, per docs/architecture.md (engine contracts): ``input_ids[T]``, ``positions[T]``,
``slot_mapping[T]``, and per sequence ``query_lens``, ``seq_lens`` and ``block_tables``. No padding
to a rectangle: prompt chunks and decode tokens of different sequences sit side by side. Logits
are computed only for the last token of each sequence that samples in this step, and for the
prompt rows of requests that asked for their prompt's log-probabilities.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.device import host_tensor
from llmd.daemon.engine.cuda_graphs import DecodeGraphs
from llmd.daemon.engine.decode_inputs import DecodeInputs
from llmd.daemon.engine.outputs import Logprob
from llmd.daemon.engine.penalty_counts import uses_counts
from llmd.daemon.engine.sampler import SampleRequest, SampleResult, Sampler, argmax_rows, top_logprobs
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.scheduler import ScheduledBatch
from llmd.daemon.engine.structured_output import Grammar, GrammarCompiler
from llmd.daemon.engine.sequence import Sequence
from llmd.daemon.models import LlamaForCausalLM
from llmd.kernels import kv_format

log = logging.getLogger("llmd")


# Row counts of the warm-up's steps: one in each power-of-two bucket up to 512, as the kernels pick
# their tiles (the GEMV to 16 rows, GEMM tiles of 16..64, the extend kernel's 16..64 query rows,
# the dense path above 128), capped by the step budget.
WARM_UP_ROWS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)


def _graphs_unsupported(model: LlamaForCausalLM, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if model.attn_backend.name != "triton":
        return "CUDA graphs need the Triton attention backend (--attention auto or triton)"
    return None


def kv_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, in a cache of ``dtype`` (int8: its rows'
    scales included, llmd.kernels.kv_format)."""
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv_format.row_bytes(cfg.head_dim, dtype)


def new_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged KV cache for ``model``, not initialised: per layer ``(K, V)``, each ``[num_blocks,
    block_size, kv_heads, row]`` of ``dtype`` (default the model's; a row as llmd.kernels.kv_format
    lays it out), on its device.

    NOTE: ``torch.empty``, not ``zeros``: on the CPU the OS maps a large allocation's pages as they
    are first written, so the pool's resident memory grows with the blocks used (zeros wrote every
    page at start: a 1 GiB pool was 1 GiB resident before the first request). Nothing reads a slot
    before it is written (a recycled block holds stale rows alike); tests fill pools with NaN to hold
    every kernel to that (tests/test_engine_equivalence.py)."""
    cfg = model.config
    dtype = dtype or model.dtype
    shape = (num_blocks, block_size, cfg.num_kv_heads, kv_format.row_width(cfg.head_dim, dtype))
    device = model.model.embed_tokens.weight.device
    return [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


def bind_decode_step(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point the model's fused decode step at its KV cache now; a cache it cannot read (e.g. fp16
    on the CPU) sends decode steps layer by layer instead, with the reason in the log."""
    step = model.decode_step
    if step is None:
        return
    try:
        step.bind_cache(kv_caches)
    except ValueError as e:
        log.info("decode steps run layer by layer: %s", e)
        model.decode_step = None


@dataclass(slots=True)
class StepOutput:
    """What one step produced: per scheduled sequence the sampled token (None while its prompt is
    unfinished), the sampler's result for the sampled rows, for sequences that asked for
    prompt log-probabilities ``{batch row: (position of the first token scored, [Logprob, ...])}``,
    and for rows with draft tokens the model's greedy choices to verify them by
    ``{batch row: [token after the last one, after each draft...]}`` (their ``sampled`` is None),
    with, for those that asked for log-probabilities, each choice's ``{batch row: [Logprob, ...]}``
    (from the raw logits at its position, as a sampled row's)."""

    sampled: list[int | None]
    result: SampleResult | None
    prompt_logprobs: dict[int, tuple[int, list[Logprob]]]
    verified: dict[int, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[int, list[Logprob]] = field(default_factory=dict)


class ModelRunner:
    """Owns the KV cache tensors and the per-request RNGs.

    Args:
        model: the loaded model.
        block_size: tokens per KV block; the pool itself comes with :meth:`allocate_kv_cache`
            (on a GPU its size is known only after :meth:`profile_run`).
        max_num_seqs, max_model_len: the most sequences a step holds and the longest one (they
            size the decode steps' persistent input buffers).
        cuda_graphs: replay decode steps as CUDA graphs (daemon/engine/cuda_graphs.py; CUDA with the
            Triton attention backend only, else ignored with a warning).
        cache_dtype: the KV cache's (default the model's; int8: llmd.kernels.kv_format).
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, max_num_seqs: int,
                 max_model_len: int | None = None, cuda_graphs: bool = False,
                 cache_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.cache_dtype = cache_dtype or model.dtype
        self.device = model.model.embed_tokens.weight.device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler()
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        if cuda_graphs and (reason := _graphs_unsupported(model, self.device)):
            log.warning("--cuda-graphs ignored: %s", reason)
            cuda_graphs = False
        self.cuda_graphs = cuda_graphs
        self.decode_inputs = DecodeInputs(max_num_seqs, -(-self.max_model_len // block_size), block_size, self.device,
                                          buckets=cuda_graphs)
        self._graphs: DecodeGraphs | None = None  # captured lazily, over the KV cache of the moment

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._new_kv_cache(num_blocks)
        self._graphs = None

    def _new_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return new_kv_cache(self.model, num_blocks, self.block_size, self.cache_dtype)

    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """Run the largest step the scheduler can make (``num_tokens`` of prompt, logits and
        top-p sampling for ``num_seqs`` rows) on a throwaway cache, so that the peak activation
        memory is known before the KV pool takes the rest. Changes no state."""
        num_blocks = -(-num_tokens // self.block_size)
        caches, self.kv_caches = self.kv_caches, self._new_kv_cache(num_blocks)
        try:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(num_tokens, device=self.device), query_lens=[num_tokens],
                seq_lens=[num_tokens], block_tables=torch.arange(num_blocks, device=self.device)[None, :])
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), self.kv_caches, meta)
            rows = min(num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[:rows])
            params = SamplingParams(temperature=1.0, top_p=0.9)
            self.sampler(logits, [SampleRequest(params, [], [])] * rows)
        finally:
            self.kv_caches = caches

    def warm_up(self, max_batched_tokens: int) -> None:
        """Run a step of every size class serving can make, once, on the KV cache (no sequence
        holds a block yet; whatever this writes, a sequence overwrites before it reads). On a GPU
        each Triton kernel variant compiles at its first launch (a second or so; from Triton's disk
        cache after the first start): without this, the first step past a threshold (a chunk of 17
        tokens, a 17th sequence, a 65th) would stall mid-serving on a compile. The sizes are the
        row counts where a kernel's tile size changes (powers of two, see WARM_UP_ROWS)."""
        bs = self.block_size
        num_blocks = self.kv_caches[0][0].shape[0]
        chunks = [n for n in WARM_UP_ROWS if n <= min(max_batched_tokens, self.max_model_len, num_blocks * bs)]
        rows = [n for n in WARM_UP_ROWS if n <= min(self.decode_inputs.max_rows, num_blocks)]
        dev = self.device
        params = SamplingParams(temperature=1.0, top_p=0.9)
        for n in chunks:  # a prompt chunk of n tokens (a mixed step's kernels are these too)
            meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev), query_lens=[n], seq_lens=[n],
                                     block_tables=torch.arange(-(-n // bs), device=dev)[None, :])
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev),
                                self.kv_caches, meta)
            self.sampler(self.model.compute_logits(hidden[-1:]), [SampleRequest(params, [], [])])
        for r in rows:  # a decode step of r sequences, each on a block of its own, its second token
            meta = AttentionMetadata(slot_mapping=torch.arange(r, device=dev) * bs + 1, query_lens=[1] * r,
                                     seq_lens=[2] * r, block_tables=torch.arange(r, device=dev)[:, None])
            hidden = self.model(torch.zeros(r, dtype=torch.long, device=dev), torch.ones(r, dtype=torch.long,
                                                                                         device=dev),
                                self.kv_caches, meta)
            self.sampler(self.model.compute_logits(hidden), [SampleRequest(params, [], [])] * r)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def release(self, request_id: str) -> None:
        """Forget a finished request's penalties' counts."""
        self.sampler.release(request_id)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                       list[int], list[tuple[int, int, int]]]:
        """Inputs for ``batch``; also returns the batch rows whose last token is sampled, the
        indices of those tokens in the flat batch, and the prompt rows to score for prompt
        log-probabilities as ``(batch row, first flat index, count)``.

        A pure decode step (one new token per sequence) fills the persistent buffers of
        :class:`DecodeInputs`; other steps build flat tensors on the host, copied once per tensor
        without blocking (host_tensor): preparing step N+1 never waits for the GPU's step N.
        """
        sample_rows: list[int] = []
        sample_tokens: list[int] = []
        scored: list[tuple[int, int, int]] = []
        first = 0  # the row's first token in the flat batch
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if seq.params.prompt_logprobs is not None and start + 1 < seq.num_prompt_tokens:
                # the rows at positions start..end-1 predict tokens start+1..end: the prompt's ones
                scored.append((row, first, min(end, seq.num_prompt_tokens - 1) - start))
            first += num_new
            if end == seq.num_tokens and not seq.num_draft_tokens:
                sample_rows.append(row)
                sample_tokens.append(first - 1)
        if first == len(batch.seqs):  # one token each: a decode step
            ids, positions, meta = self.decode_inputs.fill(batch.seqs)
            return ids, positions, meta, sample_rows, sample_tokens, scored
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        max_blocks = max(len(seq.block_ids) for seq in batch.seqs)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + num_new])
            positions.extend(range(start, start + num_new))
            blocks = seq.block_ids
            slots.extend(blocks[pos // bs] * bs + pos % bs for pos in range(start, start + num_new))
            table = blocks + [0] * (max_blocks - len(blocks))
            if seq.num_draft_tokens:
                # A verified span goes in as one-token rows, each seeing the context up to itself:
                # every backend writes a step's K/V before it attends, so this is the span's causal
                # attention, and a step of decode and verified rows stays a pure decode step (the
                # CPU's fused native step, the GPU's decode kernels).
                query_lens.extend([1] * num_new)
                seq_lens.extend(range(start + 1, start + num_new + 1))
                tables.extend([table] * num_new)
            else:
                query_lens.append(num_new)
                seq_lens.append(start + num_new)
                tables.append(table)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=host_tensor(slots, torch.long, dev), query_lens=query_lens,
                                 seq_lens=seq_lens, block_tables=host_tensor(tables, torch.long, dev))
        return (host_tensor(input_ids, torch.long, dev), host_tensor(positions, torch.long, dev), meta, sample_rows,
                sample_tokens, scored)

    def run(self, batch: ScheduledBatch, grammars: dict[str, Grammar] | None = None,
            compiler: GrammarCompiler | None = None) -> StepOutput:
        """Run one step (see :class:`StepOutput`); the sampled rows of the requests in ``grammars``
        (structured output) choose only what their grammar allows (``compiler`` masks them)."""
        ids, pos, meta, sample_rows, sample_tokens, scored = self.prepare(batch)
        if self.cuda_graphs and sum(batch.num_new_tokens) == len(batch.seqs):  # inputs in decode_inputs
            if self._graphs is None:
                self._graphs = DecodeGraphs(self.model, self.decode_inputs, self.kv_caches, self.max_model_len)
            hidden = self._graphs.run(ids.shape[0])
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)
        sampled: list[int | None] = [None] * len(batch.seqs)
        prompt_logprobs = self._prompt_logprobs(hidden, batch, scored) if scored else {}
        # The verified spans' rows and the sampled rows through the LM head in one call: its weights
        # (tens of MB) are read once a step, not once for each kind of row (a step of 2 sampled rows
        # and 6 verified ones took 1.3 ms against 2.3 ms in two calls, AVX-512, 2 cores).
        spans = self._spans(batch)
        verify_rows = [i for _, first, n in spans for i in range(first, first + n)]
        head_rows = verify_rows + sample_tokens
        if not head_rows:
            return StepOutput(sampled, None, prompt_logprobs, {}, {})
        # (a decode step whose rows are all sampled or all verified: no gather)
        picked = hidden[:len(head_rows)] if head_rows == list(range(len(head_rows))) else \
            hidden[host_tensor(head_rows, torch.long, hidden.device)]
        all_logits = self.model.compute_logits(picked)
        verified, verified_logprobs = self._verify(all_logits[:len(verify_rows)], spans, batch, grammars, compiler)
        if not sample_rows:
            return StepOutput(sampled, None, prompt_logprobs, verified, verified_logprobs)
        logits = all_logits[len(verify_rows):]
        rows = [
            SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.request_id)
            for seq in (batch.seqs[r] for r in sample_rows)
        ]
        seqs = [batch.seqs[r] for r in sample_rows]
        # the tokens each row may still emit, this one included: a constrained row closes within them
        budgets = [seq.tokens_left(self.max_model_len) for seq in seqs] if grammars else None
        own = self._constrain(logits, seqs, grammars, compiler, budgets=budgets) if grammars else None
        result = self.sampler(logits, rows, own)
        for row, token in zip(sample_rows, result.token_ids):
            sampled[row] = token
        return StepOutput(sampled, result, prompt_logprobs, verified, verified_logprobs)

    @staticmethod
    def _constrain(logits: torch.Tensor, seqs: list[Sequence], grammars: dict[str, Grammar] | None,
                   compiler: GrammarCompiler | None, drafts: list[list[int]] | None = None,
                   budgets: list[int] | None = None) -> torch.Tensor:
        """Mask ``logits`` in place by the grammars of ``seqs`` that have one (structured output; one
        row each, or with ``drafts`` a verified span each; ``budgets``: the tokens each row may still
        emit: GrammarCompiler.mask). Returns the model's
        own logits for log-probabilities: a copy from before the mask when a masked step's row asks
        for them, else ``logits``."""
        found = [grammars.get(seq.request_id) for seq in seqs] if grammars and compiler is not None else []
        if not any(g is not None for g in found):
            return logits
        own = logits.clone() if any(seq.params.logprobs is not None for seq in seqs) else logits
        compiler.mask(logits, found, drafts, budgets)
        return own

    @staticmethod
    def _spans(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
        """The verified spans of ``batch`` (speculative decoding: the rows with draft tokens), as
        ``(batch row, first flat index, rows)``."""
        spans, first = [], 0
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.num_draft_tokens:
                spans.append((row, first, num_new))
            first += num_new
        return spans

    def _verify(self, raw: torch.Tensor, spans: list[tuple[int, int, int]], batch: ScheduledBatch,
                grammars: dict[str, Grammar] | None, compiler: GrammarCompiler | None
                ) -> tuple[dict[int, list[int]], dict[int, list[Logprob]]]:
        """For each verified span (``spans``, :meth:`_spans`; ``raw``: the logits of their rows, in
        order): a greedy row's own choice after its last token and after each draft, k + 1 tokens
        (the greedy rows' in one read of the device); a sampled row's accepted drafts and its next
        token (Sampler.verify_drafts), at most k + 1. Then, for the rows that asked, each choice's
        log-probability and top-n at its position: the tokens a row emits are the first of its
        choices (greedy: the drafts it accepts equal its own choices)."""
        if not spans:
            return {}, {}
        logits = raw
        seqs = [batch.seqs[row] for row, _, _ in spans]
        # each position masked as a one-token step would mask it, by the tokens the row may still emit
        # there (as run()'s; the first position's, Sequence.tokens_left); own: for log-probabilities
        budgets = [seq.tokens_left(self.max_model_len) for seq in seqs] if grammars else None
        own = self._constrain(raw, seqs, grammars, compiler, [seq.draft_token_ids for seq in seqs], budgets)
        # Penalties, position by position: after the i-th draft, the output as it would be had the
        # row emitted the drafts before it one token at a time (their own counts, from the lists).
        at = 0
        for row, _, n in spans:
            seq = batch.seqs[row]
            if uses_counts(seq.params):
                if logits is raw:
                    logits = raw.clone()
                draft = seq.draft_token_ids
                output = seq.output_token_ids[:len(seq.output_token_ids) - len(draft)]  # (the drafts are in it)
                positions = [SampleRequest(seq.params, seq.prompt_token_ids, output + draft[:i])
                             for i in range(n)]
                logits[at:at + n] = self.sampler.penalised(raw[at:at + n], positions)
            at += n
        greedy = [batch.seqs[row].params.greedy for row, _, _ in spans]
        choices = argmax_rows(logits) if any(greedy) else []
        out, at = {}, 0
        for (row, _, n), is_greedy in zip(spans, greedy):
            if is_greedy:
                out[row] = choices[at:at + n]
            else:
                seq = batch.seqs[row]
                output = seq.output_token_ids[:len(seq.output_token_ids) - len(seq.draft_token_ids)]
                request = SampleRequest(seq.params, seq.prompt_token_ids, output)
                out[row] = self.sampler.verify_drafts(logits[at:at + n], seq.draft_token_ids, request)
            at += n
        logprobs, at = {}, 0
        for row, _, n in spans:
            k = batch.seqs[row].params.logprobs
            if k is not None:  # the model's own, as a sampled row's: before grammars and penalties
                rows = torch.log_softmax(own[at:at + n].float(), dim=-1)
                logprobs[row] = [top_logprobs(lp, token, k) for lp, token in zip(rows, out[row])]
            at += n
        return out, logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: ScheduledBatch, scored: list[tuple[int, int, int]]
                         ) -> dict[int, tuple[int, list[Logprob]]]:
        """The log-probability of each prompt token the step's rows predict, from the raw logits."""
        out = {}
        for row, first, count in scored:
            seq = batch.seqs[row]
            start = seq.num_computed_tokens
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first:first + count]), dim=-1)
            targets = seq.token_ids[start + 1:start + 1 + count]
            n = seq.params.prompt_logprobs
            out[row] = (start + 1, [top_logprobs(lp, t, n) for lp, t in zip(logprobs, targets)])
        return out
