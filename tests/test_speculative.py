"""Speculative decoding with prompt-lookup drafts (issue 22): greedy rows give the same tokens with it
on as off, whatever the batch; sampled rows the same distribution (rejection sampling); rejected drafts
leave no blocks or cached hashes behind; the counts of drafts and acceptances add up."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from tiny_models import make_engine, make_hf_model, run_engine, save_hf_model

from llmd.daemon.engine.engine import EngineConfig
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.kernels import quant_cpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("spec") / "model", with_tokenizer=True)


def repetitive(i: int, n: int = 40) -> list[int]:
    """A prompt that repeats itself, so drafts are proposed (and sometimes right)."""
    unit = [(i * 13 + k * 7) % 250 for k in range(5 + i % 3)]
    return (unit * (n // len(unit) + 1))[:n]


def requests(params: SamplingParams, n: int = 6) -> list[tuple[int, str, list[int], SamplingParams]]:
    return [(i % 3, f"r{i}", repetitive(i), params) for i in range(n)]


@pytest.mark.parametrize("config", [dict(), dict(max_batched_tokens=16), dict(num_blocks=24, block_size=4),
                                    dict(prefix_cache=False)],
                         ids=["default", "small-budget", "preempting", "no-cache"])
def test_greedy_tokens_are_the_same_with_speculation(model_dir, config: dict) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    off = run_engine(make_engine(model_dir, speculative="off", **config), requests(params))
    engine = make_engine(model_dir, speculative="ngram", **config)
    on = run_engine(engine, requests(params))
    assert on == off
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0  # it did speculate, and hit
    assert engine.stats().num_generated_tokens_total == sum(map(len, on.values()))  # accepted drafts counted
    assert engine.kv.pool.num_free_blocks == engine.num_blocks  # nothing leaked, rollbacks included
    if config.get("num_blocks"):
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verified_rows_run_in_the_native_decode_step(model_dir, dtype, monkeypatch) -> None:
    """The served CPU path (INT4, the cpu attention backend, the fused native step): a step of decode
    and verified rows is one call of the native step, each verified token a row of its own, and the
    tokens are the same as without speculation; a sequence alone drafts up to a pass of the native
    matmuls' rows, beside others up to 3."""
    import llmd.daemon.engine.engine as engine_module
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = dict(attention=CpuAttentionBackend(), quant=QuantConfig("int4"), dtype=dtype)
    off = run_engine(make_engine(model_dir, speculative="off", **config), requests(params))
    engine = make_engine(model_dir, speculative="ngram", **config)
    step = engine.runner.model.decode_step
    assert step is not None
    extra_rows: list[int] = []  # per call, rows beyond one per running sequence: verified drafts
    call = type(step).__call__

    def counted(self, x, *args, **kwargs):
        extra_rows.append(x.shape[0] - len(engine.scheduler.running))
        return call(self, x, *args, **kwargs)

    monkeypatch.setattr(type(step), "__call__", counted)
    monkeypatch.setattr(engine_module, "draft_cost", lambda rows: 0.01)  # drafts as long as allowed
    asked: list[tuple[int, int]] = []  # each lookup's most tokens, and how many sequences its step runs
    lookup = engine_module.lookup
    monkeypatch.setattr(engine_module, "lookup", lambda tokens, k: (
        asked.append((k, len(engine.scheduler.running))), lookup(tokens, k))[1])
    assert run_engine(engine, requests(params)) == off
    assert engine.num_accepted_tokens > 0 and max(extra_rows) > 0
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    # a sequence alone drafts up to one pass of the native matmuls' rows less its own token (8 rows
    # in every build); beside others up to 3
    rows = quant_cpu.rows_per_pass()
    assert rows == 8
    assert engine.max_draft == rows - 1
    assert max(k for k, running in asked if running > 1) == 3
    asked.clear()
    assert run_engine(engine, requests(params, 1)) == {k: v for k, v in off.items() if k == "r0"}
    assert max(k for k, _ in asked) == rows - 1


def test_a_verified_span_is_the_same_bits_as_one_token_at_a_time(model_dir) -> None:
    """The native decode step is batch invariant: the hidden states of a span of drafts verified in
    one step, of the same tokens decoded one step each, and of those rows beside another sequence,
    are the same bits. Greedy equality on and off rests on it, and a tiny random model's wide logit
    margins hide a last-bit difference from a token comparison (the default model's do not). On two
    threads (the suite runs on one), with contexts past one attention cell (128 keys)."""
    from llmd.daemon.attention import AttentionMetadata, CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(model_dir, attention=CpuAttentionBackend(), quant=QuantConfig("int4"),
                             dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    runner, g = engine.runner, torch.Generator().manual_seed(5)
    model, caches, bs = runner.model, runner.kv_caches, runner.block_size
    assert model.decode_step is not None
    width = -(-200 // bs)

    def step(rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """One step of one-token rows (sequence, position, token); sequence s owns blocks s*width..."""
        tables = torch.stack([torch.arange(s * width, (s + 1) * width) for s, _, _ in rows])
        slots = torch.tensor([(s * width + p // bs) * bs + p % bs for s, p, _ in rows])
        meta = AttentionMetadata(slot_mapping=slots, query_lens=[1] * len(rows), seq_lens=[p + 1 for _, p, _ in rows],
                                 block_tables=tables)
        return model(torch.tensor([t for *_, t in rows]), torch.tensor([p for _, p, _ in rows]), caches, meta).clone()

    for s, n in enumerate((150, 190)):  # two prompts, written to the cache as a prompt chunk is
        table = torch.arange(s * width, (s + 1) * width)
        meta = AttentionMetadata(slot_mapping=(table[:, None] * bs + torch.arange(bs)).flatten()[:n],
                                 query_lens=[n], seq_lens=[n], block_tables=table[None, :])
        model(torch.randint(3, 250, (n,), generator=g), torch.arange(n), caches, meta)
    drafts = torch.randint(3, 250, (4,), generator=g).tolist()
    span = [(0, 150 + i, t) for i, t in enumerate(drafts)]
    one_at_a_time = torch.cat([step([row]) for row in span])
    assert torch.equal(step(span), one_at_a_time)
    assert torch.equal(step([(1, 190, 7), *span])[1:], one_at_a_time)


def test_a_step_of_verified_and_sampled_rows_reads_the_head_once(model_dir, monkeypatch) -> None:
    """The verified spans' rows and the sampled rows go through the LM head in one call (its
    weights are read once a step), on the served CPU path (INT4, the native step), and the tokens
    are those without speculation."""
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = dict(attention=CpuAttentionBackend(), quant=QuantConfig("int4"), dtype=torch.bfloat16)
    off = run_engine(make_engine(model_dir, speculative="off", **config), requests(params))
    engine = make_engine(model_dir, speculative="ngram", **config)
    runner, model = engine.runner, engine.runner.model
    calls: list[int] = []
    steps: list[tuple[int, bool, bool]] = []  # per step: head calls, verified rows, sampled rows
    compute_logits, run = model.compute_logits, runner.run

    def counted_logits(hidden):
        calls.append(hidden.shape[0])
        return compute_logits(hidden)

    def counted_run(batch, *args, **kwargs):
        calls.clear()
        out = run(batch, *args, **kwargs)
        steps.append((len(calls), bool(out.verified), out.result is not None))
        return out

    monkeypatch.setattr(model, "compute_logits", counted_logits)
    monkeypatch.setattr(runner, "run", counted_run)
    assert run_engine(engine, requests(params)) == off
    assert any(verified and sampled for _, verified, sampled in steps)  # the case this is about
    assert all(n == (verified or sampled) for n, verified, sampled in steps)


def test_acceptance_is_counted_per_request_and_in_total(model_dir) -> None:
    from llmd.commands.status import _speculation_line
    from llmd.tui.dashboard import speculation_part

    # a small pool: preemptions and a tight budget drop drafts unverified, which must not count
    engine = make_engine(model_dir, speculative="ngram", num_blocks=24, block_size=4, max_batched_tokens=16)
    assert engine.stats().draft_acceptance_rate is None and speculation_part(engine.stats().to_dict()) == ""
    metrics = {}
    for _, rid, ids, params in requests(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)):
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        metrics.update((d.request_id, d.metrics) for d in engine.step() if d.finished)
    stats = engine.stats()
    assert stats.num_verifications == sum(m.num_verifications for m in metrics.values()) > 0
    assert stats.num_draft_tokens_total == sum(m.num_draft_tokens for m in metrics.values()) == engine.num_draft_tokens
    assert stats.num_accepted_draft_tokens_total == sum(m.num_accepted_draft_tokens for m in metrics.values()) > 0
    assert stats.draft_acceptance_rate == stats.num_accepted_draft_tokens_total / stats.num_draft_tokens_total
    assert stats.mean_accepted_length == 1 + stats.num_accepted_draft_tokens_total / stats.num_verifications
    m = metrics["r0"]
    assert m.draft_acceptance_rate == m.num_accepted_draft_tokens / m.num_draft_tokens
    shown = stats.to_dict()
    assert f"{100 * stats.draft_acceptance_rate:.0f}% accepted" in speculation_part(shown)
    assert _speculation_line({"speculative": "ngram"}, shown).startswith(
        f"ngram, {100 * stats.draft_acceptance_rate:.0f}% of {stats.num_draft_tokens_total} draft tokens accepted")
    assert _speculation_line({"speculative": "off"}, {"draft_acceptance_rate": None}) == "off"


def test_stops_inside_accepted_drafts_are_exact(model_dir) -> None:
    """max_tokens, stop tokens and stop strings land where they would one token at a time."""
    base = run_engine(make_engine(model_dir, speculative="off"),
                      requests(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    for params in (SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[base["r1"][9]])):
        off = run_engine(make_engine(model_dir, speculative="off"), requests(params))
        engine = make_engine(model_dir, speculative="ngram")
        assert run_engine(engine, requests(params)) == off
        assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_tokens_a_stop_cuts_from_accepted_drafts_are_not_counted(model_dir, monkeypatch) -> None:
    """A stop token among accepted drafts ends the output there; the drafts after it were right but
    are not output, so neither the tokens generated (stats, throughput) nor the accepted drafts count
    them. Canary: counted before the stop was applied, this request of 3 tokens reported 5 generated
    and 3 drafts accepted in 1 verification."""
    import llmd.daemon.engine.engine as engine_module

    prompt = list(range(5, 13))
    off = run_engine(make_engine(model_dir, speculative="off"),
                     [(0, "r", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])["r"]
    stop = next(i for i in range(2, len(off)) if off[i] not in off[:i])  # the first token not seen before

    def right(tokens, k: int) -> tuple[list[int], int]:  # drafts that are the model's own continuation
        done = len(tokens) - len(prompt)
        return off[done:done + k], 4

    monkeypatch.setattr(engine_module, "lookup", right)
    monkeypatch.setattr(engine_module, "draft_cost", lambda num_seqs: 0.01)
    engine = make_engine(model_dir, speculative="ngram")
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[off[stop]]))
    out, metrics = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            out += delta.token_ids
            metrics = delta.metrics if delta.finished else metrics
    assert out == off[:stop + 1] and metrics.num_verifications >= 1
    assert metrics.num_draft_tokens > metrics.num_accepted_draft_tokens  # the cut drafts: tried, not kept
    assert engine.stats().num_generated_tokens_total == len(out) == metrics.num_generated_tokens
    assert metrics.num_accepted_draft_tokens + metrics.num_verifications <= len(out)
    assert engine.stats().num_accepted_draft_tokens_total == metrics.num_accepted_draft_tokens


def test_prompt_log_probabilities_do_not_speculate(model_dir) -> None:
    engine = make_engine(model_dir, speculative="ngram")
    run_engine(engine, [(0, "l", repetitive(3), SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=20))])
    assert engine.num_draft_tokens == 0


# Penalties mild enough that the output still repeats (prompt-lookup drafts accepted), strong enough
# to change it.
PENALTIES = [dict(presence_penalty=0.1), dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["presence", "all"])
def test_penalised_greedy_rows_speculate_token_for_token(model_dir, penalties: dict) -> None:
    """Each drafted position is verified with the penalties it would have one token at a time (the
    drafts before it counted as output): the same tokens as without speculation, drafts accepted."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalties)
    plain = run_engine(make_engine(model_dir, speculative="off"),
                       requests(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    off = run_engine(make_engine(model_dir, speculative="off"), requests(params))
    assert off != plain  # the penalties change the output
    engine = make_engine(model_dir, speculative="ngram")
    assert run_engine(engine, requests(params)) == off
    assert engine.num_accepted_tokens > 0
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=1.0), dict(repetition_penalty=1.5),
                                       dict(presence_penalty=1.0, frequency_penalty=0.5)],
                         ids=["frequency", "repetition", "presence+frequency"])
def test_penalties_count_the_drafts_before_each_position(model_dir, monkeypatch, penalties: dict) -> None:
    """Drafts that are exactly the penalised output (an oracle drafter) are all accepted, which
    needs each drafted position verified with the drafts before it counted as output, and
    nothing else counted (the drafts sit in the sequence's tokens while they are verified)."""
    import llmd.daemon.engine.engine as engine_module

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **penalties)
    off = run_engine(make_engine(model_dir, speculative="off"), requests(params))
    prompts = {rid: prompt for _, rid, prompt, _ in requests(params)}

    def oracle(tokens, k: int) -> tuple[list[int], int]:
        token_ids = list(tokens)  # (the engine passes its array of them: ngram_proposer.TokenHistory)
        (rid,) = [r for r, p in prompts.items() if token_ids[:len(p)] == p]
        done = len(token_ids) - len(prompts[rid])
        return off[rid][done:done + k], 4  # (found by a 4-token suffix)

    monkeypatch.setattr(engine_module, "lookup", oracle)
    engine = make_engine(model_dir, speculative="ngram")
    assert run_engine(engine, requests(params)) == off
    assert engine.num_accepted_tokens == engine.num_draft_tokens > 30  # every draft, several per step


def _tokens_and_logprobs(engine, params: SamplingParams) -> tuple[dict, dict]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    for _, rid, prompt, p in requests(params, n=4):
        engine.add_request(rid, prompt, p)
        tokens[rid], logprobs[rid] = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            logprobs[delta.request_id] += delta.logprobs
    return tokens, logprobs


@pytest.mark.parametrize("stop", [False, True])
def test_log_probabilities_of_accepted_drafts_are_those_of_one_token_at_a_time(model_dir, stop: bool) -> None:
    """A request that asks for log-probabilities speculates, and each token it emits, accepted
    drafts included, carries the log-probability and top-n it would one token at a time (its
    position's raw logits), also when a stop token lands among them."""
    params = SamplingParams(temperature=0, logprobs=3, max_tokens=30, ignore_eos=True)
    if stop:
        first = _tokens_and_logprobs(make_engine(model_dir, speculative="off"), params)[0]
        params = SamplingParams(temperature=0, logprobs=3, max_tokens=30, ignore_eos=True,
                                stop_token_ids=[first["r1"][12]])
    off_tokens, off_logprobs = _tokens_and_logprobs(make_engine(model_dir, speculative="off"), params)
    engine = make_engine(model_dir, speculative="ngram")
    on_tokens, on_logprobs = _tokens_and_logprobs(engine, params)
    assert engine.num_accepted_tokens > 0  # drafts were accepted, several tokens in a step
    assert on_tokens == off_tokens
    for rid, tokens in on_tokens.items():
        assert len(on_logprobs[rid]) == len(tokens) == len(off_logprobs[rid])
        for (chosen, top), (want, want_top), token in zip(on_logprobs[rid], off_logprobs[rid], tokens):
            assert chosen == pytest.approx(want, abs=1e-4) and chosen <= 0
            assert [t for t, _ in top] == [t for t, _ in want_top] and top[0][0] == token  # greedy: its argmax
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.3, seed=7, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.3, seed=11, max_tokens=40, ignore_eos=True, repetition_penalty=1.05,
                   presence_penalty=0.1)], ids=["plain", "penalised"])
def test_sampled_rows_speculate_and_a_seed_repeats_itself(model_dir, params: SamplingParams) -> None:
    """A seeded request's noise is keyed by its position (sampler.py): the same tokens again, and the
    same as without speculation, drafts kept or not."""
    outs = []
    for _ in range(2):
        engine = make_engine(model_dir, speculative="ngram")
        outs.append(run_engine(engine, requests(params)))
        assert engine.num_verifications > 0 and engine.num_accepted_tokens > 0
        assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert outs[0] == outs[1]
    assert run_engine(make_engine(model_dir, speculative="off"), requests(params)) == outs[0]


def _chi_square_z(a: Counter, b: Counter, min_count: int = 10) -> float:
    """The two-sample chi-square test of homogeneity of two samples (counts by outcome; outcomes
    seen fewer than ``min_count`` times in both are pooled), as a z score by Wilson and Hilferty's
    approximation ((X^2 / df)^(1/3) is nearly normal): about N(0, 1) when both come from one
    distribution."""
    na, nb = sum(a.values()), sum(b.values())
    bins = [(a[t], b[t]) for t in sorted(set(a) | set(b)) if a[t] + b[t] >= min_count]
    rest = (na - sum(x for x, _ in bins), nb - sum(y for _, y in bins))
    if sum(rest):
        bins.append(rest)
    k1, k2 = math.sqrt(nb / na), math.sqrt(na / nb)
    x2 = sum((k1 * x - k2 * y) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    return ((x2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.mark.slow
def test_rejection_sampling_keeps_the_distribution(model_dir, monkeypatch) -> None:
    """Sampled rows: the tokens decided by verifying drafts (output positions 1 to 3; position 0 is
    the prompt's own sample) are distributed as sampling one token at a time: 6,000 seeded requests
    each way, a chi-square test per position. The drafts come from a bigram table of the model's own
    outputs (accepted often enough to matter); a verifier whose rejected drafts are replaced by a draw
    from p itself (not p without the draft) must fail the same test by a wide margin."""
    import llmd.daemon.engine.engine as engine_module
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.engine.sampler import Sampler

    def sample(mode: str, first_seed: int) -> tuple[list[Counter], dict[str, list[int]], object]:
        engine = make_engine(model_dir, speculative=mode, attention=CpuAttentionBackend(), max_num_seqs=256)
        params = [SamplingParams(temperature=0.5, seed=first_seed + i, max_tokens=4, ignore_eos=True)
                  for i in range(6000)]
        out = run_engine(engine, [(0, f"s{i}", [13], p) for i, p in enumerate(params)])
        return [Counter(o[j] for o in out.values()) for j in range(4)], out, engine

    off, outputs, _ = sample("off", 0)
    successors: dict[int, Counter] = {}
    for o in outputs.values():
        for a, b in zip([13, *o], o):
            successors.setdefault(a, Counter())[b] += 1
    likeliest = {a: c.most_common(1)[0][0] for a, c in successors.items()}

    def bigram_drafts(tokens, k: int) -> tuple[list[int], int]:
        draft, t = [], tokens[-1]
        while len(draft) < k and t in likeliest:
            t = likeliest[t]
            draft.append(t)
        return draft, 1

    monkeypatch.setattr(engine_module, "lookup", bigram_drafts)
    monkeypatch.setattr(engine_module, "draft_cost", lambda rows: 0.2)  # drafts in a step of 256 rows too
    on, _, engine = sample("ngram", 10**6)
    assert engine.num_accepted_tokens > 2000 and engine.num_draft_tokens > 2 * engine.num_accepted_tokens
    z = [_chi_square_z(off[j], on[j]) for j in range(1, 4)]
    assert max(abs(v) for v in z) < 3.5, z

    def no_residual(self, logits, draft, row):  # wrong: a rejected draft may come back
        k = len(draft)
        probs = self._probabilities(logits, [row] * (k + 1))
        kept = (torch.rand(k) < probs[torch.arange(k), torch.tensor(draft)]).tolist()
        n = kept.index(False) if False in kept else k
        return draft[:n] + [int((probs[n] / torch.empty_like(probs[n]).exponential_()).argmax())]

    monkeypatch.setattr(Sampler, "verify_drafts", no_residual)
    biased, _, _ = sample("ngram", 2 * 10**6)
    assert max(_chi_square_z(off[j], biased[j]) for j in range(1, 4)) > 7  # twice the bar, at least


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="speculative must be one of off, ngram, draft"):
        EngineConfig(speculative="eagle")


@pytest.mark.slow
def test_default_model_fp32_reference_path_is_token_for_token(default_model_path) -> None:
    """The default model on the fp32 reference path (dense, torch attention): chats asking for code
    rewritten (drafts often right) and a question (drafts mostly wrong), the same tokens either way."""
    import random

    from llmd import LLM
    from llmd.bench import edit_messages

    chats = [edit_messages(random.Random(1), 120), [{"role": "user", "content": "Explain what a hash table is."}]]
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM(model=str(default_model_path), dtype="float32", quant="none", attention="torch")
    llm.engine.config.speculative = "off"
    off = [o.token_ids for o in llm.chat(chats, params)]
    llm.engine.config.speculative = "ngram"  # one load for both (the engine reads it per request and step)
    on = [o.token_ids for o in llm.chat(chats, params)]
    assert llm.engine.num_accepted_tokens > 0 and on == off


def test_drafts_take_only_what_prompt_work_leaves(model_dir) -> None:
    """A waiting request's prompt chunk comes before another request's drafts in the step's budget."""
    engine = make_engine(model_dir, speculative="ngram", max_batched_tokens=8)
    engine.add_request("a", repetitive(0, 12), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 2:
        engine.step()
    engine.add_request("b", list(range(100, 130)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    a = engine.scheduler.running[0]
    a.add_drafts([1, 2, 3])  # a has guesses to verify...
    batch = engine.scheduler.schedule()
    grants = dict(zip((s.request_id for s in batch.seqs), batch.num_new_tokens))
    assert grants == {"a": 1, "b": 7} and a.num_draft_tokens == 0  # ...but b's prompt takes the budget first
