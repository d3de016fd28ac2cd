"""Draft-model speculation (issue 22, ``--speculative draft --draft-model NAME``): a second, smaller
model that shares the target's tokenizer guesses each drafting sequence's next k tokens, greedily,
and the engine verifies them in its next step exactly as it verifies prompt-lookup drafts (greedy
rows by argmax, sampled rows by rejection sampling against the one-hot guess: the output is the
target's distribution whatever the draft model says).

The draft model keeps its own paged KV cache and block pool. Per sequence it remembers the tokens
whose K/V it holds; before drafting it brings them up to the sequence's tokens:

* the common prefix stays; the tail the target rejected is forgotten (only the count: its slots
  are overwritten later, and a block left empty is freed);
* the tokens since then (the whole prompt the first time, afterwards the accepted drafts and the
  target's own token) are one chunk of the first forward pass, whose last row gives the first draft;
* each further draft is a one-token pass over all sequences still drafting: k drafts cost k passes
  of the draft model, batched across sequences (a decode step of the small model, on the CPU its
  fused native step).

The tokens caught up in one step for sequences more than SMALL_CATCH_UP behind (new prompts), all
together, are at most ``max_chunk`` and what the engine's ``catch_up`` allows (the step's room for
drafts, in the draft model's tokens), the fewest first: a sequence not yet caught up does not draft
this step, so new long prompts never stall the step that carries other sequences' tokens (another
request's first one among them). When the pool runs
short, sequences not drafting now give their blocks back first; a sequence that still does not fit
is not drafted this step (it decodes one token at a time), never an error.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from llmd.daemon.attention import AttentionMetadata
from llmd.daemon.device import host_tensor
from llmd.daemon.engine.block_pool import Block, BlockPool
from llmd.daemon.engine.model_runner import bind_decode_step, new_kv_cache
from llmd.daemon.engine.sequence import Sequence
from llmd.daemon.model_config import ModelConfig
from llmd.daemon.models import LlamaForCausalLM

# Tokens caught up per step, all sequences together: bounds what new prompts add to a step (the draft
# model's prefill rides in the target's step).
MAX_CATCH_UP = 512
# A sequence this few tokens behind is brought in whole, outside that bound: what one verification
# adds (its accepted drafts and the model's own token) or the ~32 steps between a non-drafting
# sequence's probes (DraftLength.probe_every). Charged, such rows could take a small step's whole
# catch-up every step, leaving one sequence never caught up and never drafting; new prompts are longer.
SMALL_CATCH_UP = 64


def forward_cost(config: ModelConfig) -> float:
    """Multiply-adds per token of a model (its projections and head), the measure of what one of its
    forward passes costs next to another model's: decode is bound by reading these weights."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return float(config.num_layers * per_layer + h * config.vocab_size)


@dataclass(slots=True)
class _Held:
    """What the draft cache holds of one sequence: its blocks and the tokens whose K/V are in them."""

    blocks: list[Block] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    """The draft model, its KV cache and what it holds per sequence.

    Args:
        model: the loaded draft model (same tokenizer as the target, same device).
        block_size: tokens per block of its cache.
        num_blocks: blocks in its pool (the engine gives the target's count: the same tokens).
        vocab_size: the target's vocabulary; drafts are its ids (a draft head padded wider is cut).
        max_chunk: tokens caught up per step, all sequences more than SMALL_CATCH_UP behind together.
        cache_dtype: its KV cache's (default the model's; llmd.kernels.kv_format).
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int, vocab_size: int,
                 max_chunk: int = MAX_CATCH_UP, cache_dtype: torch.dtype | None = None) -> None:
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.block_size, self.num_blocks, self.vocab_size = block_size, num_blocks, vocab_size
        self.max_chunk = max_chunk
        self.cache_dtype = cache_dtype
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._held: dict[str, _Held] = {}
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.load(model)

    def load(self, model: LlamaForCausalLM) -> None:
        """Take the model (at start, and again after an idle unload) with a fresh cache."""
        self.model = model
        self.max_len = model.config.max_position_embeddings
        self.kv_caches = new_kv_cache(model, self.num_blocks, self.block_size, self.cache_dtype)
        bind_decode_step(model, self.kv_caches)

    def unload(self) -> None:
        """Free the model and its cache; what was held is forgotten (its K/V are gone)."""
        for request_id in list(self._held):
            self.release(request_id)
        self.pool.forget_cached()  # the next cache's memory is new: every block fresh again
        self.model, self.kv_caches = None, []

    def release(self, request_id: str) -> None:
        """A finished or aborted request: its blocks go back to the pool."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.pool.free_blocks(reversed(held.blocks))

    @property
    def num_held(self) -> int:
        """Sequences whose tokens the cache holds (tests: none once every request has ended)."""
        return len(self._held)

    def held_block_ids(self) -> list[int]:
        """The blocks the sequences hold, each once per holder (tests check them against the pool)."""
        return [b.block_id for held in self._held.values() for b in held.blocks]

    def propose(self, wants: list[tuple[Sequence, int]], catch_up: int | None = None) -> list[list[int]]:
        """Up to ``k`` draft tokens for each ``(sequence, k)``, in order (an empty list where it could
        not draft this step); ``catch_up``: the most tokens to bring in this step for sequences more
        than SMALL_CATCH_UP behind, all together, if fewer than ``max_chunk``."""
        drafts: list[list[int]] = [[] for _ in wants]
        left = self.max_chunk if catch_up is None else max(0, min(self.max_chunk, catch_up))
        rows: list[tuple[int, _Held, list[int]]] = []  # (index in wants, held, its new tokens)
        drafting = {seq.request_id for seq, _ in wants}
        behind: list[tuple[int, int, _Held]] = []  # (tokens to bring in, index in wants, held)
        for i, (seq, k) in enumerate(wants):
            tokens = seq.token_ids
            if len(tokens) + k - 1 > self.max_len:  # past the draft model's context: it cannot draft here
                self.release(seq.request_id)
                continue
            held = self._held.setdefault(seq.request_id, _Held())
            keep = _common_prefix(held.tokens, tokens)
            if keep == len(tokens):  # the newest token held already (cannot happen with exact verification)
                keep -= 1
            del held.tokens[keep:]  # (only the count: the rejected tail's slots are overwritten)
            behind.append((len(tokens) - keep, i, held))
        # the fewest first: sequences a few tokens behind draft this step whatever the bound; new
        # prompts share what it leaves, the shortest first (which then drafts soonest)
        for num_new, i, held in sorted(behind, key=lambda b: b[0]):
            seq, k = wants[i]
            charged = num_new > min(SMALL_CATCH_UP, self.max_chunk)  # (no row ever more than max_chunk)
            new = seq.token_ids[len(held.tokens):len(held.tokens) + (min(num_new, left) if charged else num_new)]
            if not new:  # this step's catch-up is spent: it drafts in a later one
                continue
            catching_up = len(new) < num_new
            # room for the new tokens and the drafts fed back (all but the last)
            if not self._fit(held, len(held.tokens) + len(new) + (0 if catching_up else k - 1), drafting):
                self.release(seq.request_id)
                continue
            if charged:
                left -= len(new)
            rows.append((-1 if catching_up else i, held, new))
        if not rows:
            return drafts
        # pass 1: every row's new tokens; the drafting rows' last ones give their first draft
        firsts = self._forward([(held, new) for _, held, new in rows], [i >= 0 for i, _, _ in rows])
        active = []
        for (i, held, _), token in zip((r for r in rows if r[0] >= 0), firsts):
            drafts[i].append(token)
            if wants[i][1] > 1:
                active.append((i, held))
        # passes 2..k: the newest draft in, the next one out
        while active:
            nexts = self._forward([(held, [drafts[i][-1]]) for i, held in active], [True] * len(active))
            for (i, _), token in zip(active, nexts):
                drafts[i].append(token)
            active = [(i, held) for i, held in active if len(drafts[i]) < wants[i][1]]
        return drafts

    def _fit(self, held: _Held, total: int, drafting: set[str]) -> bool:
        """Blocks for the first ``total`` tokens of ``held``: blocks past them freed (a rejected tail),
        missing ones taken, first from sequences not drafting now. False if they do not fit."""
        want = -(-total // self.block_size)
        if len(held.blocks) > want:
            self.pool.free_blocks(reversed(held.blocks[want:]))
            del held.blocks[want:]
        need = want - len(held.blocks)
        if need <= 0:
            return True
        for request_id in [r for r in self._held if r not in drafting]:
            if self.pool.num_free_blocks >= need:
                break
            self.release(request_id)
        if self.pool.num_free_blocks < need:
            return False
        held.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def _forward(self, rows: list[tuple[_Held, list[int]]], sample: list[bool]) -> list[int]:
        """One pass of the draft model over ``rows`` (each: what it holds, the tokens to add to it);
        appends the tokens to what each holds and returns the greedy next token of the rows whose
        ``sample`` is set."""
        bs = self.block_size
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        width = max(len(held.blocks) for held, _ in rows)
        for held, new in rows:
            start = len(held.tokens)
            ids.extend(new)
            positions.extend(range(start, start + len(new)))
            block_ids = [b.block_id for b in held.blocks]
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + len(new)))
            query_lens.append(len(new))
            seq_lens.append(start + len(new))
            tables.append(block_ids + [0] * (width - len(block_ids)))
            held.tokens.extend(new)
        dev = self.model.model.embed_tokens.weight.device
        meta = AttentionMetadata(slot_mapping=host_tensor(slots, torch.long, dev), query_lens=query_lens,
                                 seq_lens=seq_lens, block_tables=host_tensor(tables, torch.long, dev))
        hidden = self.model(host_tensor(ids, torch.long, dev), host_tensor(positions, torch.long, dev),
                            self.kv_caches, meta)
        lasts = [end - 1 for end, s in zip(itertools.accumulate(query_lens), sample) if s]
        if not lasts:
            return []
        logits = self.model.compute_logits(hidden[host_tensor(lasts, torch.long, dev)])
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: one comparison in C when the
    shorter is a prefix of the longer (the usual case: only a short tail of drafts ever differs),
    else a binary search over prefixes."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
