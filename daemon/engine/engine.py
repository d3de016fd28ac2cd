"""The step loop: requests in, scheduled batches through the model, text deltas out.

The engine is single-threaded and synchronous; whoever owns it (``llmd.LLM``, the daemon's server)
calls :meth:`LLMEngine.step` in a loop and routes the deltas it returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from llmd.config import OPTIONS
from llmd.daemon.calibration_text import calibration_ids
from llmd.daemon.engine.detokenizer import RequestDetokenizer
from llmd.daemon.engine.draft_model import DraftModel, forward_cost
from llmd.daemon.engine.key_centres import CENTRE_TOKENS, measure_key_centres
from llmd.daemon.engine.kv_budget import cpu_kv_pool, measure_gpu_kv_budget
from llmd.daemon.engine.kv_cache_manager import KVCacheManager
from llmd.daemon.engine.live_view import MAX_OWNER_ROWS, RequestRow, block_map, request_rows
from llmd.daemon.engine.model_runner import ModelRunner, bind_decode_step, kv_block_bytes
from llmd.daemon.engine.ngram_proposer import (DraftLength, DraftLengths, TokenHistory, accepted_prefix, draft_cost,
                                               draft_limit, lookup)
from llmd.daemon.engine.outputs import Logprob, RequestDelta, RequestMetrics
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmd.daemon.engine.sequence import FinishReason, Sequence, check_priority
from llmd.daemon.engine.stats import EngineStats, ThroughputMeter
from llmd.daemon.engine.structured_output import Grammar, GrammarCompiler
from llmd.daemon.models import LlamaForCausalLM
from llmd.errors import PromptTooLongError, RequestError
from llmd.kernels.kv_format import KV_CACHE_DTYPES

log = logging.getLogger("llmd")

SPECULATIVE_MODES = OPTIONS["speculative"].choices
KV_CACHE_DTYPE_CHOICES = OPTIONS["kv_cache_dtype"].choices


def _speculates(params: SamplingParams) -> bool:
    """Whether a request's drafts are verified: greedy or sampled (Sampler.verify_drafts), with
    penalties (each drafted position's own, ModelRunner._verify) and log-probabilities or without,
    with a response format or without (its drafts checked against its grammar), but not with prompt
    log-probabilities (such a request computes its whole prompt anyway)."""
    return params.prompt_logprobs is None


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs (the settings of the same names in llmd.config, whose defaults these are).
    Raises ``ValueError`` with the fix in the message.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_mb: memory for the KV pool; default on the CPU: what ``max_num_seqs`` whole contexts
            need, at most a quarter of the available RAM, reserved, of which the prefix cache keeps at
            most 1 GiB resident; on a GPU, what ``gpu_memory_fraction`` leaves (daemon/engine/kv_budget.py).
        gpu_memory_fraction: the share of the GPU's memory llmd may use in all (weights,
            activations, KV pool); the rest stays for the desktop.
        num_blocks: exact pool size (overrides ``kv_cache_mb``; tests use tiny pools).
        max_num_seqs: sequences running at once.
        max_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest sequence (prompt + output); default and cap: the model's context.
        prefix_cache: reuse KV blocks of shared prompt prefixes.
        cuda_graphs: replay decode steps as CUDA graphs, one per batch-size bucket (never run on a
            GPU yet: README "GPU status"; ignored elsewhere).
        speculative: ``ngram`` drafts a request's next tokens (greedy or sampled) from
            its own prompt and output (daemon/engine/ngram_proposer.py) and verifies them in the step
            that computes its next token; ``draft`` drafts them with a second, smaller model (the
            engine's ``draft_model``, daemon/engine/draft_model.py); ``off`` never drafts.
        kv_cache_dtype: the KV cache's dtype: ``auto`` (the model's), ``float32``, ``bfloat16``,
            ``float16`` or ``int8`` (a scale per token and KV head, llmd.kernels.kv_format).
        paced: cut a step's prompt work to end in about the scheduler's step times (the daemon,
            where clients wait on each step); off, a step takes the whole token budget, so which
            tokens share a step, and with them the last bits of every logit, do not depend on how
            fast the machine ran the step before (the offline ``llmd.LLM``).
    """

    block_size: int = OPTIONS["block_size"].default
    kv_cache_mb: int | None = OPTIONS["kv_cache_mb"].default
    num_blocks: int | None = None
    max_num_seqs: int = OPTIONS["max_num_seqs"].default
    max_batched_tokens: int = OPTIONS["max_batched_tokens"].default
    max_model_len: int | None = None
    prefix_cache: bool = OPTIONS["prefix_cache"].default
    gpu_memory_fraction: float = OPTIONS["gpu_memory_fraction"].default
    cuda_graphs: bool = OPTIONS["cuda_graphs"].default
    speculative: str = OPTIONS["speculative"].default
    kv_cache_dtype: str = OPTIONS["kv_cache_dtype"].default
    paced: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        for name in ("kv_cache_mb", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("max_num_seqs", "max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        fraction = self.gpu_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction!r}")
        for name in ("prefix_cache", "cuda_graphs", "paced"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model of ``model_dtype`` (``auto``: the same)."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: RequestDetokenizer
    # per prompt position (the first has none), filled as the prompt is computed
    prompt_logprobs: list[Logprob | None] | None = None
    drafts: DraftLength | DraftLengths | None = None  # how many tokens to draft (draft model | prompt lookup)
    history: TokenHistory | None = None  # prompt lookup's copy of the tokens


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        model: the loaded model.
        tokenizer: its transformers tokenizer (for detokenizing and stop strings).
        config: engine knobs.
        eos_token_ids: tokens that end a generation unless ``ignore_eos``.
    """

    def __init__(self, model: LlamaForCausalLM, tokenizer: Any, config: EngineConfig | None = None,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(),
                 draft_model: LlamaForCausalLM | None = None) -> None:
        self.config = config = config or EngineConfig()
        if (config.speculative == "draft") != (draft_model is not None):
            raise ValueError("--speculative draft needs --draft-model, and --draft-model needs --speculative draft")
        self.model: LlamaForCausalLM | None = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self._num_layers = model.config.num_layers
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        backend = model.attn_backend
        if reason := backend.unsupported(config.block_size, model.config.head_dim, model.dtype):
            raise ValueError(f"{reason}; use --attention torch")
        self.cache_dtype = config.cache_dtype(model.dtype)
        if reason := backend.unsupported_cache(self.cache_dtype, model.dtype):
            raise ValueError(reason)
        # an int8 cache stores keys centred (key_centres.py): measured once, set again on a reloaded model
        self._draft_key_centres: list[torch.Tensor] | None = None
        self._key_centres = self._measure_centres(model, self.cache_dtype)
        if self._key_centres is not None:
            model.centre_keys(self._key_centres)
        self.runner: ModelRunner | None = ModelRunner(model, config.block_size, config.max_num_seqs, self.max_model_len,
                                                        config.cuda_graphs, self.cache_dtype)
        self.num_blocks, resident_target = self._pool_size()
        self._start_runner()
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.prefix_cache, resident_target)
        # --speculative draft: the draft model, its cache as many tokens as the target's, and what one of
        # its passes costs next to a target step (each draft token is one pass; an estimate from the
        # models' shapes, which tests set to 0 to draft whatever it costs)
        self.drafter: DraftModel | None = None
        self.draft_pass_cost = 0.0
        # rows the model's matmuls take per pass over their weights: how long prompt lookup drafts
        self.rows_per_pass = model.rows_per_pass()
        if draft_model is not None:
            self._check_draft(model, draft_model)
            self._draft_key_centres = self._measure_centres(draft_model, config.cache_dtype(draft_model.dtype))
            if self._draft_key_centres is not None:
                draft_model.centre_keys(self._draft_key_centres)
            self.drafter = DraftModel(draft_model, config.block_size, self.num_blocks, self.vocab_size,
                                      cache_dtype=config.cache_dtype(draft_model.dtype))
            self.draft_pass_cost = forward_cost(draft_model.config) / forward_cost(model.config)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_batched_tokens, self.max_model_len,
                            **({} if config.paced else {"step_seconds": None, "lone_step_seconds": None})),
            self.kv,
        )
        self.requests: dict[str, _Request] = {}
        self.meter = ThroughputMeter()
        # speculative decoding, since start: verifications, draft tokens verified, the model's own among them
        self.num_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._peak_blocks_used = 0  # since take_peak_blocks_used() last ran
        # structured output: the compiler (it reads the vocabulary at its first compile) and, by
        # request id, the grammars of the requests that carry a response format
        self.grammar_compiler = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self._grammars: dict[str, Grammar] = {}

    @property
    def max_draft(self) -> int:
        """Prompt lookup's longest draft, for a sequence alone: what one pass of the model's matmuls
        verifies beside its token."""
        return draft_limit(self.rows_per_pass)

    @property
    def is_loaded(self) -> bool:
        """False between :meth:`unload` and :meth:`load`: requests may queue but no step runs."""
        return self.runner is not None

    def unload(self) -> None:
        """Free the model and the KV cache (the daemon's idle unload); the queue, counters and
        block table bookkeeping stay. The cached prefixes are forgotten with their K/V.

        Raises:
            RuntimeError: a request is in flight.
        """
        if self.requests:
            raise RuntimeError(f"cannot unload with {len(self.requests)} requests in flight")
        self.kv.pool.forget_cached()
        self.runner = None
        self.model = None
        if self.drafter is not None:
            self.drafter.unload()

    def load(self, model: LlamaForCausalLM, draft_model: LlamaForCausalLM | None = None) -> None:
        """Take the model (and the draft model, with ``--speculative draft``) back after :meth:`unload`
        (reloaded the same way): a fresh KV cache of the same number of blocks.

        Raises:
            ValueError: ``model`` is not shaped like the one the engine was built for, or the draft
                model is missing or not wanted.
        """
        if model.config.vocab_size != self.vocab_size or model.config.num_layers != self._num_layers:
            raise ValueError("the reloaded model differs from the one the engine was built for")
        if (self.drafter is not None) != (draft_model is not None):
            raise ValueError("the engine " + ("drafts with a draft model: pass it" if self.drafter is not None
                                              else "has no draft model"))
        if draft_model is not None:
            self._check_draft(model, draft_model)
            if self._draft_key_centres is not None:
                draft_model.centre_keys(self._draft_key_centres)
            self.drafter.load(draft_model)
        if self._key_centres is not None:
            model.centre_keys(self._key_centres)
        self.model = model
        self.runner = ModelRunner(model, self.config.block_size, self.config.max_num_seqs, self.max_model_len,
                                  self.config.cuda_graphs, self.cache_dtype)
        self._start_runner()

    def _start_runner(self) -> None:
        """The KV cache, and on a GPU with the Triton kernels a warm-up step of every size class,
        so that serving never stalls on a kernel compile (ModelRunner.warm_up)."""
        self.runner.allocate_kv_cache(self.num_blocks)
        bind_decode_step(self.model, self.runner.kv_caches)
        if self.runner.device.type == "cuda" and self.model.attn_backend.name == "triton":
            self.runner.warm_up(self.config.max_batched_tokens)

    def _measure_centres(self, model: LlamaForCausalLM, cache_dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The key centres an int8 cache stores keys by (None for other caches), on the calibration
        text (or, without a tokenizer, its first tokens' ids). NOTE: other caches leave a model's
        centres as they are: centring is exact for any cache (a model shared by two engines in tests
        and benchmarks keeps them), as long as one cache's keys are all stored one way."""
        if cache_dtype != torch.int8:
            return None
        limit = min(CENTRE_TOKENS, model.config.max_position_embeddings)
        ids = calibration_ids(self.tokenizer, limit) if self.tokenizer is not None else []
        return measure_key_centres(model, ids or list(range(min(limit, model.config.vocab_size))))

    def _check_draft(self, model: LlamaForCausalLM, draft_model: LlamaForCausalLM) -> None:
        """A draft model runs beside the target: same device, a vocabulary at least the target's, a KV
        cache its attention backend reads."""
        if draft_model.model.embed_tokens.weight.device != model.model.embed_tokens.weight.device:
            raise ValueError("the draft model must be on the target's device")
        if reason := draft_model.attn_backend.unsupported_cache(self.config.cache_dtype(draft_model.dtype),
                                                                draft_model.dtype):
            raise ValueError(f"the draft model: {reason}")
        if draft_model.config.vocab_size < self.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is smaller than "
                             f"the model's ({self.vocab_size}): a draft model must share the model's tokenizer")

    def _pool_size(self) -> tuple[int, int]:
        """The KV pool's blocks, and how many of them the prefix cache may make resident (kv_budget)."""
        cfg = self.config
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)  # more is never used
        if cfg.num_blocks:
            return cfg.num_blocks, cfg.num_blocks
        per_block = kv_block_bytes(self.model, cfg.block_size, self.cache_dtype)
        if self.runner.device.type == "cuda":  # memory taken at once: nothing to save by holding back
            budget = measure_gpu_kv_budget(self.runner, cfg.kv_cache_mb, cfg.max_batched_tokens,
                                           cfg.max_num_seqs, cfg.gpu_memory_fraction)
            blocks = max(1, min(budget // per_block, useful))
            return blocks, blocks
        return cpu_kv_pool(cfg.kv_cache_mb, per_block, useful)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can ever hold."""
        return min(self.max_model_len, self.num_blocks * self.config.block_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    owner: Any = None, priority: int = 0, grammar: Grammar | None = None) -> Sequence:
        """Queue a request.

        Args:
            owner: the client that asked (opaque; the scheduler shares each step fairly between owners).
            priority: higher is scheduled sooner, in ``MIN_PRIORITY..MAX_PRIORITY`` (-10..10);
                interactive requests use 1.
            grammar: the matcher of ``params.response_format``, compiled already (off the caller's
                thread: ``self.grammar_compiler.submit``); compiled here when None.

        Raises:
            RequestError: duplicate id, empty prompt, out-of-vocabulary token ids or a bad priority.
            PromptTooLongError: prompt + max_tokens can never fit the context or the KV pool.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        check_priority(priority)
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_request_tokens:
            where = "context" if self.max_request_tokens == self.max_model_len else "KV cache"
            raise PromptTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} "
                f"tokens but the {where} holds {self.max_request_tokens}; shorten the prompt or lower max_tokens"
            )
        if params.response_format is not None and grammar is None:
            grammar = self.grammar_compiler.grammar(params.response_format)
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, owner=owner,
                       priority=priority)
        self.requests[request_id] = _Request(seq, RequestDetokenizer(self.tokenizer, params.stop))
        if grammar is not None:
            self._grammars[request_id] = grammar
        if params.prompt_logprobs is not None:
            self.requests[request_id].prompt_logprobs = [None] * len(prompt_token_ids)
        if self.config.speculative != "off" and _speculates(params):
            req = self.requests[request_id]
            if self.drafter is not None:
                req.drafts = DraftLength()
            else:
                req.drafts, req.history = DraftLengths(self.max_draft), TokenHistory()
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Cancel a request; returns its final delta, or None if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        self._grammars.pop(request_id, None)
        if self.runner is not None:  # unloaded: a queued request has nothing in the runner
            self.runner.release(request_id)
        if self.drafter is not None:
            self.drafter.release(request_id)
        return RequestDelta(request_id, "", [], finished=True, finish_reason=FinishReason.ABORT.value,
                            metrics=RequestMetrics.of(req.seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (their prompts not started)."""
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestDelta]:
        """Schedule, run the model once, sample, and return every request's new output."""
        if self.runner is None:
            raise RuntimeError("the model is unloaded: load() it before stepping")
        if self.config.speculative != "off":
            self._draft()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        # the step's blocks are all allocated now: the most this step holds
        self._peak_blocks_used = max(self._peak_blocks_used, self.kv.pool.num_blocks - self.kv.pool.num_free_blocks)
        start = time.monotonic()
        num_prompt = sum(max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)
                         for seq, n in zip(batch.seqs, batch.num_new_tokens))
        out = self.runner.run(batch, self._grammars, self.grammar_compiler)
        sampled, result = out.sampled, out.result
        accepted = self._accept(batch, out.verified, sampled)
        for row, (first, scored) in out.prompt_logprobs.items():
            req = self.requests.get(batch.seqs[row].request_id)
            if req is not None:
                req.prompt_logprobs[first:first + len(scored)] = scored
        self.scheduler.update(batch, sampled)
        logprobs = iter(result.logprobs if result is not None else ())
        deltas = []
        for row, (seq, token) in enumerate(zip(batch.seqs, sampled)):
            if token is None:
                continue
            if row in out.verified:  # each emitted token's, from the verification (none unless asked)
                lps = out.verified_logprobs.get(row, [])
            else:
                lp = next(logprobs)
                lps = [] if lp is None else [lp]
            req = self.requests.get(seq.request_id)
            if req is None:  # aborted during the step
                continue
            tokens = [*accepted.get(row, []), token]
            deltas.append(self._emit(req, tokens, lps[:len(tokens)]))
        # the tokens output: not those a stop among accepted drafts cut off, nor an aborted request's
        self.meter.record(start, num_prompt, sum(len(d.token_ids) for d in deltas))
        return deltas

    def _draft(self) -> None:
        """Draft tokens for the running requests about to decode that speculate (speculative decoding)."""
        # the more rows a step has, the more a draft token costs next to a sequence's own one; a draft
        # model adds one of its passes per token
        cost = draft_cost(len(self.scheduler.running)) + self.draft_pass_cost
        limit = draft_limit(self.rows_per_pass, len(self.scheduler.running))  # prompt lookup's, this step
        # The draft model's passes run before the step is scheduled: not when prompt work will take
        # the budget and drop the drafts they made, slowing the step that carries another request's
        # first token for nothing. (Prompt lookup costs next to nothing; its drafts get what is left.)
        model_room = self.scheduler.room_for_drafts() if self.drafter is not None else None
        wants: list[tuple[Sequence, int]] = []  # the draft model's: sequences and how many tokens
        found: list[tuple[Sequence, list[int]]] = []  # prompt lookup's: sequences and their drafts
        for seq in self.scheduler.running:
            req = self.requests.get(seq.request_id)
            if req is None or req.drafts is None or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            # the drafts and the model's own token stay within max_tokens and the context
            room = seq.tokens_left(self.max_model_len) - 1
            grammar = self._grammars.get(seq.request_id)
            if grammar is not None:  # a constrained row's drafts end before its closing (structured_output)
                room = min(room, grammar.draft_room(room + 1))
            if isinstance(req.drafts, DraftLengths):
                # prompt lookup: the draft first, then how much of it to verify, by how long a suffix found it
                if room <= 0 or not req.drafts.wanted(cost):
                    continue
                # (limit <= req.drafts.max_draft)
                draft, match = lookup(req.history.view(seq.token_ids), min(room, limit))
                if (k := req.drafts.next(match, cost) if draft else 0) > 0:
                    found.append((seq, draft[:k]))
            elif model_room is not None and model_room.tokens and (
                    k := min(req.drafts.next(cost), room, model_room.for_seq(seq))) > 0:
                wants.append((seq, k))  # (no more passes than the step has room for its drafts)
        if wants:
            # Its catch-up (new prompts through the draft model) runs in this step's time too, which
            # prompt chunks beside it keep: at most what the step's room for drafts costs, in the
            # draft model's tokens. (Its k passes for drafting rows are priced in ``cost`` instead.)
            catch_up = int(model_room.tokens / self.draft_pass_cost) if self.draft_pass_cost > 0 else None
            found += zip([seq for seq, _ in wants], self.drafter.propose(wants, catch_up))
        for seq, draft in found:
            grammar = self._grammars.get(seq.request_id)
            seq.add_drafts(draft if grammar is None else draft[:grammar.valid_prefix(draft)])

    def _accept(self, batch: ScheduledBatch, verified: dict[int, list[int]], sampled: list[int | None]
                ) -> dict[int, list[int]]:
        """Verify the drafted rows: keep the drafts the model agrees with, and its own token after
        them as the row's sampled one. Returns the accepted drafts by row."""
        accepted = {}
        for row, choices in verified.items():
            seq = batch.seqs[row]
            draft = seq.draft_token_ids
            # choices: the model's k + 1 greedy picks, or a sampled row's kept drafts and its own token
            n = min(accepted_prefix(draft, choices), len(choices) - 1)
            req = self.requests.get(seq.request_id)
            if req is not None and req.drafts is not None:
                req.drafts.update(len(draft), n)
            self.num_verifications += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += n
            seq.accept_drafts(n)
            self.kv.trim(seq)  # the rejected drafts' blocks and hashes
            accepted[row] = draft[:n]
            sampled[row] = choices[n]
        return accepted

    def _emit(self, req: _Request, tokens: list[int], logprobs: list[Logprob]) -> RequestDelta:
        """The delta of a sequence's new tokens (more than one when drafts were accepted; all in its
        token ids already) with their log-probabilities if asked (one per token), and its end if
        one of them ends it (:meth:`_check_stop`; the tokens after the one that ends it are
        dropped, with theirs)."""
        seq = req.seq
        pieces: list[str] = []
        reason = None
        grammar = self._grammars.get(seq.request_id)
        for i, token in enumerate(tokens):
            if grammar is not None and not grammar.accept(token):  # masked out: cannot happen
                log.error("request %s: token %d is outside its response format; ending it", seq.request_id, token)
                text, reason = req.detok.flush()[0], FinishReason.STOP
            elif grammar is not None and grammar.is_terminated:  # the output is complete (its EOS came)
                # (closed to fit its budget: max_tokens or the context cut its content, not the model)
                text, reason = req.detok.flush()[0], FinishReason.LENGTH if grammar.closing else FinishReason.STOP
            else:
                text, reason = self._check_stop(req, token, seq.num_output_tokens - (len(tokens) - 1 - i))
            pieces.append(text)
            if reason is not None:
                extra = len(tokens) - 1 - i  # the tokens after this one, in the token ids already
                if extra > 0:
                    del seq.token_ids[len(seq.token_ids) - extra:]
                    del seq.timings.token_times[len(seq.timings.token_times) - extra:]
                    # all of them but the model's own last token were accepted drafts: right, but
                    # never output, so not counted (acceptance stays within the tokens made)
                    seq.num_drafts_accepted -= extra - 1
                    self.num_accepted_tokens -= extra - 1
                tokens, logprobs = tokens[:i + 1], logprobs[:i + 1]
                self.scheduler.finish(seq, reason)
                break
        delta = RequestDelta(seq.request_id, "".join(pieces), tokens, logprobs=logprobs)
        if seq.is_finished:
            delta.finished = True
            delta.finish_reason = seq.finish_reason.value
            delta.metrics = RequestMetrics.of(seq)
            delta.prompt_logprobs = req.prompt_logprobs
            del self.requests[seq.request_id]
            self._grammars.pop(seq.request_id, None)
            self.runner.release(seq.request_id)
            if self.drafter is not None:
                self.drafter.release(seq.request_id)
        return delta

    def _check_stop(self, req: _Request, token: int, num_output: int) -> tuple[str, FinishReason | None]:
        """The text ``token`` adds and whether it ends the request, decided once, here: a stop token
        (EOS unless ignored, or a requested one: its own text is never shown, what was held back is),
        then a stop string in the text, then the length (``max_tokens``, or the context full), the
        held-back text flushed, which may still complete a stop string."""
        seq, params = req.seq, req.seq.params
        if (not params.ignore_eos and token in seq.eos_token_ids) or token in params.stop_token_ids:
            return req.detok.flush()[0], FinishReason.STOP  # the text held back for a stop string, shown
        text, stopped = req.detok.push(token)
        if stopped:
            return text, FinishReason.STOP
        if num_output >= params.max_tokens or seq.num_prompt_tokens + num_output >= self.max_model_len:
            rest, stopped = req.detok.flush()
            return text + rest, FinishReason.STOP if stopped else FinishReason.LENGTH
        return text, None

    def take_peak_blocks_used(self) -> int:
        """The most KV blocks in use at any step since the last call (or now, if more), and reset:
        a sampled `num_blocks_used` misses short bursts."""
        pool = self.kv.pool
        peak = max(self._peak_blocks_used, pool.num_blocks - pool.num_free_blocks)
        self._peak_blocks_used = 0
        return peak

    def live_view(self, max_rows: int = 64) -> tuple[bytes, list[RequestRow]]:
        """The KV block map and the request rows it refers to (daemon/engine/live_view.py)."""
        running, waiting = self.scheduler.running, list(self.scheduler.waiting)
        rows = request_rows(running, waiting, max(max_rows, min(len(running), MAX_OWNER_ROWS)))
        return block_map(self.kv.pool, running), rows

    def stats(self) -> EngineStats:
        usage = self.kv.usage
        prefill_tps, decode_tps = self.meter.rates()
        sched = self.scheduler
        return EngineStats(
            num_blocks=usage.num_blocks,
            block_size=self.config.block_size,
            num_blocks_used=usage.num_used,
            num_blocks_cached_free=usage.num_cached_free,
            num_blocks_free=usage.num_free,
            num_blocks_touched=usage.num_touched,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions,
            prefix_cache_hit_rate=sched.num_prefix_hit_tokens / max(sched.num_prefix_query_tokens, 1),
            prefill_tokens_per_s=prefill_tps,
            decode_tokens_per_s=decode_tps,
            num_prompt_tokens_total=self.meter.num_prefill_total,
            num_generated_tokens_total=self.meter.num_decode_total,
            num_steps=self.meter.num_steps,
            num_verifications=self.num_verifications,
            num_draft_tokens_total=self.num_draft_tokens,
            num_accepted_draft_tokens_total=self.num_accepted_tokens,
        )
