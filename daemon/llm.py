"""``llmd.LLM``: the engine in-process, for scripts, tests and benchmarks.

    from llmd import LLM, SamplingParams
    llm = LLM()  # the default model
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence as Seq
from typing import Any

from llmd.daemon.engine.outputs import RequestDelta, RequestOutput
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.errors import RequestError

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Load a model and run the engine in this process.

    Args:
        model: ``--model`` value (path, repo id in the HF cache, or None for the default model).
        device: ``auto`` (CUDA when there is a GPU), ``cpu`` or ``cuda``.
        dtype: ``auto`` (on a GPU bf16, or fp16 where bf16 is slow; on the CPU bf16 where it multiplies
            it natively, else fp32), ``float32``, ``bfloat16`` or ``float16``.
        quant: ``auto`` (a GGUF's own blocks, else INT4), ``none``, ``int8``, ``int4``, ``nf4`` or
            ``bnb-int8`` for the projections; ``group_size`` 32/64/128 for int4/int8.
        attention: ``auto`` (Triton kernels on CUDA, the native kernel on the CPU), ``torch``, ``cpu`` or
            ``triton``.
        **engine_args: the other fields of llmd.daemon.engine_args.EngineArgs (``num_blocks``,
            ``block_size``, ``max_batched_tokens``, ``prefix_cache``, ``kv_cache_mb``, ...).
            ``paced`` is off by default here: no client waits on a step, and unpaced steps make
            the results (a perplexity's last digits) the same however busy the machine is.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, device: str = "auto", dtype: str = "auto",
                 quant: str = "auto", group_size: int | None = None, attention: str = "auto",
                 **engine_args: Any) -> None:
        from llmd.daemon.engine_args import EngineArgs

        engine_args.setdefault("paced", False)
        args = EngineArgs(model=None if model is None else str(model), device=device, dtype=dtype, quant=quant,
                          group_size=group_size, attention=attention, **engine_args)
        runtime = args.build()
        self.quant = args.quant_config()
        self.source = runtime.resolved.source
        self.tokenizer = runtime.tokenizer
        self.engine = runtime.engine
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return list(prompt)

    def apply_chat_template(self, messages: Messages) -> list[int]:
        from llmd.daemon.tokenizer import chat_token_ids, has_chat_template

        if not has_chat_template(self.tokenizer):
            raise RequestError("this model has no chat template; use generate() with a plain prompt")
        try:
            return chat_token_ids(self.tokenizer, messages)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion, all batched together; outputs in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.encode(p) for p in prompts], params)

    def chat(self, messages: Messages | Seq[Messages],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Like :meth:`generate` for chat conversations (lists of ``{"role", "content"}``)."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self._run([self.apply_chat_template(m) for m in messages], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestDelta]:
        """Yield the deltas of one request as the engine produces them."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, self.encode(prompt), params or SamplingParams())
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        yield delta
                        if delta.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _run(self, token_ids: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None
             ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_ids)
        if len(params) != len(token_ids):
            raise RequestError(f"{len(params)} sampling params for {len(token_ids)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in token_ids]
        added = []
        try:
            for rid, toks, p in zip(ids, token_ids, params):
                self.engine.add_request(rid, toks, p)
                added.append(rid)
            collected: dict[str, list[RequestDelta]] = {rid: [] for rid in ids}
            done = 0
            while done < len(ids):
                for delta in self.engine.step():
                    if delta.request_id in collected:
                        collected[delta.request_id].append(delta)
                        done += delta.finished
        finally:
            for rid in added:
                self.engine.abort_request(rid)
        return [_join(rid, toks, collected[rid]) for rid, toks in zip(ids, token_ids)]


def _join(request_id: str, prompt_ids: list[int], deltas: list[RequestDelta]) -> RequestOutput:
    last = deltas[-1]
    metrics = last.metrics
    if metrics is None:  # cannot happen for a finished request; keeps the type honest
        raise RuntimeError(f"request {request_id} finished without metrics")
    logprobs = [lp for d in deltas for lp in d.logprobs]
    return RequestOutput(
        request_id=request_id, prompt_token_ids=prompt_ids, text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids], finish_reason=last.finish_reason,
        metrics=metrics, logprobs=logprobs or None, prompt_logprobs=last.prompt_logprobs,
    )

