"""Sampler and stop handling: seeds, top-k/top-p/min-p, penalties, logprobs, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_engine, make_hf_model, make_tiny_tokenizer, run_engine, save_hf_model

from llmd.daemon.engine.detokenizer import RequestDetokenizer
from llmd.daemon.engine.sampler import SampleRequest, Sampler
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.reference_generator import Generator
from llmd.errors import RequestError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("smp") / "m", with_tokenizer=True)


def rows(params: SamplingParams, n: int = 1) -> list[SampleRequest]:
    return [SampleRequest(params, [1, 2], []) for _ in range(n)]


def draw(logits: list[float], params: SamplingParams, n: int = 2000) -> set[int]:
    batch = torch.tensor([logits] * n)
    return set(Sampler()(batch, rows(params, n)).token_ids)


def test_filters_bound_what_can_be_drawn() -> None:
    logits = [0.0, 3.0, 2.9, -1.0]  # p = [.025, .507, .459, .009]
    assert draw(logits, SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draw(logits, SamplingParams(temperature=1.0, top_k=1)) == {1}
    assert draw(logits, SamplingParams(temperature=1.0, top_k=2)) == {1, 2}
    assert draw(logits, SamplingParams(temperature=1.0, top_p=0.6)) == {1, 2}
    assert draw(logits, SamplingParams(temperature=1.0, top_p=0.5)) == {1}
    assert draw(logits, SamplingParams(temperature=1.0, min_p=0.06)) == {1, 2}  # .025/.507 < .06 < .459/.507
    assert draw(logits, SamplingParams(temperature=0)) == {1}


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7]))
    tokens = Sampler()(logits.repeat(20000, 1), rows(SamplingParams(temperature=1.0), 20000)).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.015)


def test_mixed_batch_rows_keep_their_own_params() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]] * 3)
    reqs = [SampleRequest(SamplingParams(temperature=0), [], []),
            SampleRequest(SamplingParams(temperature=1.0, top_k=1), [], []),
            SampleRequest(SamplingParams(temperature=5.0, top_k=2), [], [])]
    for _ in range(50):
        a, b, c = Sampler()(logits, reqs).token_ids
        assert a == 1 and b == 1 and c in (1, 2)


def test_penalties() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    rep = SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [])
    assert Sampler()(logits, [rep]).token_ids == [1]  # 2.0/2 < 1.9
    rep_neg = SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), [2], [])
    assert Sampler()(torch.tensor([[-0.5, -0.6, -0.4]]), [rep_neg]).token_ids == [0]  # -0.4*2 < -0.5
    freq = SampleRequest(SamplingParams(temperature=0, frequency_penalty=0.1), [], [0, 0])
    assert Sampler()(logits, [freq]).token_ids == [1]  # 2.0 - 0.2 < 1.9
    pres = SampleRequest(SamplingParams(temperature=0, presence_penalty=0.05), [], [0, 0])
    assert Sampler()(logits, [pres]).token_ids == [0]  # 2.0 - 0.05 > 1.9: presence counts once


def test_penalties_in_a_batch_apply_to_their_own_rows() -> None:
    """Penalties are scattered for all rows at once: each row's own tokens, nobody else's; rows
    without penalties and greedy/sampled rows side by side keep theirs (one argmax for all)."""
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]] * 4)
    reqs = [SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), [0], []),     # -> 1
            SampleRequest(SamplingParams(temperature=0, frequency_penalty=0.3), [], [1, 0, 0]),  # -> 1
            SampleRequest(SamplingParams(temperature=0), [0, 1], [0, 0, 0]),                    # -> 0
            SampleRequest(SamplingParams(temperature=1.0, top_k=1, presence_penalty=2.0), [], [0])]  # -> 1
    for _ in range(20):
        assert Sampler()(logits, reqs).token_ids == [1, 1, 0, 1]


def test_logprobs_of_a_mixed_batch() -> None:
    """Rows that asked for log-probabilities get theirs (their own top-n), the others None."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    reqs = [SampleRequest(SamplingParams(temperature=0, logprobs=1), [], []),
            SampleRequest(SamplingParams(temperature=0), [], []),
            SampleRequest(SamplingParams(temperature=1.0, top_k=1, logprobs=3), [], [])]
    res = Sampler()(logits, reqs)
    assert res.token_ids == [1, 0, 2] and res.logprobs[1] is None
    ref = torch.log_softmax(logits, dim=-1)
    chosen, top = res.logprobs[0]
    assert chosen == pytest.approx(float(ref[0, 1])) and [t for t, _ in top] == [1]
    chosen, top = res.logprobs[2]
    assert chosen == pytest.approx(float(ref[2, 2])) and len(top) == 3 and top[0][0] == 2
    assert top[1][1] == pytest.approx(float(ref[2, 0]))


def test_logprobs_are_the_models_own() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    res = Sampler()(logits, rows(SamplingParams(temperature=0, logprobs=2)))
    chosen, top = res.logprobs[0]
    ref = torch.log_softmax(logits[0], dim=-1)
    assert chosen == pytest.approx(float(ref[1]))
    assert [t for t, _ in top] == [1, 2] and top[1][1] == pytest.approx(float(ref[2]))


@pytest.mark.parametrize("bad", [
    dict(temperature=float("nan")), dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_tokens=0),
    dict(min_p=2), dict(seed=-1), dict(stop=[""]), dict(stop=["x"] * 17), dict(logprobs=100),
    dict(max_tokens=True), dict(stop_token_ids=[-3]), dict(presence_penalty=9),
])
def test_bad_params_are_rejected(bad: dict) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**bad)


def test_seed_gives_the_same_text_alone_and_in_a_busy_batch(model_dir: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = list(range(30, 50))
    alone = run_engine(make_engine(model_dir, num_blocks=64), [(0, "x", prompt, seeded)])["x"]
    others = [(i % 4, f"o{i}", list(range(i, i + 5 + 3 * i)),
               SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True, seed=i if i % 2 else None))
              for i in range(8)]
    busy = run_engine(make_engine(model_dir, num_blocks=64, max_batched_tokens=16),
                      others + [(2, "x", prompt, seeded)])["x"]
    assert busy == alone
    other_seed = run_engine(make_engine(model_dir, num_blocks=64),
                            [(0, "x", prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24,
                                                             ignore_eos=True))])["x"]
    assert other_seed != alone


def test_top_k_1_equals_greedy(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=64)
    prompt = list(range(5, 25))
    greedy = run_engine(engine, [(0, "g", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))])
    topk = run_engine(engine, [(0, "k", prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=20,
                                                              ignore_eos=True))])
    assert greedy["g"] == topk["k"]


def test_stop_strings_across_token_boundaries(model_dir: Path) -> None:
    """With one token per byte every stop string spans several tokens."""
    engine = make_engine(model_dir, num_blocks=64)
    tok = engine.tokenizer
    prompt = tok.encode("hello")
    free = run_engine(engine, [(0, "a", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))])["a"]
    text = tok.decode(free, skip_special_tokens=True)
    stop = text[12:15]
    assert len(stop) == 3 and len(tok.encode(stop)) >= 3
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    streamed = "".join(d.text for d in deltas)
    assert streamed == text[:text.index(stop)]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert len(deltas) < len(free)  # it stopped early, at the stop string


def test_stop_token_ids_and_eos(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=64)
    prompt = list(range(40, 60))
    free = run_engine(engine, [(0, "a", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))])["a"]
    stop_at = next(i for i in range(2, 20) if free[i] not in free[:i])
    got = run_engine(engine, [(0, "b", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                             stop_token_ids=[free[stop_at]]))])["b"]
    assert got == free[:stop_at + 1]  # the stop token is reported, its text is not


def test_logprobs_through_the_engine(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=64)
    prompt = list(range(60, 75))
    engine.add_request("l", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    first = deltas[0]
    ref = torch.log_softmax(Generator(engine.model).logits(prompt)[-1], dim=-1)
    chosen, top = first.logprobs[0]
    assert top[0][0] == first.token_ids[0]
    assert chosen == pytest.approx(float(ref[first.token_ids[0]]), abs=1e-4)


class _CharTokenizer:
    """One token per character: token i is chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def feed(detok: RequestDetokenizer, text: str) -> tuple[list[str], bool]:
    out = []
    for ch in text:
        delta, stopped = detok.push(ord(ch))
        out.append(delta)
        if stopped:
            return out, True
    return out, False


def test_stop_string_held_back_then_released() -> None:
    detok = RequestDetokenizer(_CharTokenizer(), stop=["END"])
    deltas, stopped = feed(detok, "abEN")
    assert not stopped and "".join(deltas) == "ab"  # "EN" might begin "END": held back
    deltas2, stopped = feed(detok, "Dx")
    assert stopped and "".join(deltas2) == ""
    assert detok.text == "ab"
    detok = RequestDetokenizer(_CharTokenizer(), stop=["END"])
    deltas, stopped = feed(detok, "abENx")
    assert not stopped and "".join(deltas) == "abENx"  # not a stop string after all
    assert detok.flush() == ("", False)


def test_stop_string_overlapping_candidates() -> None:
    detok = RequestDetokenizer(_CharTokenizer(), stop=["aab", "ba"])
    deltas, stopped = feed(detok, "xaaab")
    assert stopped and "".join(deltas) == "xa"


def test_held_back_text_is_flushed_at_the_end() -> None:
    detok = RequestDetokenizer(_CharTokenizer(), stop=["STOP"])
    deltas, _ = feed(detok, "hello ST")
    assert "".join(deltas) == "hello "
    assert detok.flush() == ("ST", False)


def test_emoji_and_cjk_stream_whole_through_request_detokenizer() -> None:
    tok = make_tiny_tokenizer()  # byte-level: every multi-byte character spans tokens
    text = "日本語 😀 ok"
    detok = RequestDetokenizer(tok, stop=["ok"])
    deltas = []
    for t in tok.encode(text):
        d, stopped = detok.push(t)
        deltas.append(d)
        if stopped:
            break
    assert "".join(deltas) == "日本語 😀 "
    assert all("\ufffd" not in d for d in deltas)
    assert any(len(d) == 1 and ord(d) > 0xFFFF for d in deltas)  # the emoji arrived in one piece


def test_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]] * 50)
    assert set(Sampler()(logits, rows(SamplingParams(temperature=1e-30), 50)).token_ids) == {1}


def test_stop_string_on_the_last_allowed_token_reports_stop(model_dir: Path) -> None:
    engine = make_engine(model_dir, num_blocks=64)
    tok = engine.tokenizer
    prompt = tok.encode("hello")
    free = run_engine(engine, [(0, "a", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])["a"]
    text = tok.decode(free, skip_special_tokens=True)
    last = tok.decode(free[-1:], skip_special_tokens=True)
    if not last or last in text[:-len(last)]:
        pytest.skip("the last token's text also occurs earlier")
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[last]))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == text[:-len(last)]


def test_penalty_counts_kept_between_steps_match_counts_from_the_token_lists() -> None:
    """The runner's rows carry a key: their penalties' counts live on the device and take only a
    step's new tokens. Step after step (outputs growing, a request finishing and a new one taking
    its row, more requests than rows at first) the penalised logits equal those counted afresh
    from the token lists, bit for bit."""
    g = torch.Generator().manual_seed(3)
    vocab = 40
    params = [SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(temperature=0, presence_penalty=0.7, repetition_penalty=0.8)]
    live = {f"r{i}": (p, torch.randint(0, vocab + 5, (7,), generator=g).tolist(), []) for i, p in enumerate(params)}
    kept, fresh = Sampler(), Sampler()
    for step in range(12):
        if step == 5:  # r2 finishes, r9 arrives and takes its row, which must come back empty
            kept.release("r2")
            del live["r2"]
            live["r9"] = (SamplingParams(temperature=0, frequency_penalty=1.5), [1, 2, 3], [])
        logits = torch.randn(len(live), vocab, generator=g)
        keyed = [SampleRequest(p, prompt, out, key) for key, (p, prompt, out) in live.items()]
        unkeyed = [SampleRequest(p, prompt, out) for p, prompt, out in live.values()]
        want = fresh._apply_penalties(logits, unkeyed)
        assert torch.equal(kept._apply_penalties(logits, keyed), want), step
        assert not torch.equal(want, logits)
        for _, _, out in live.values():  # one new token each (some past the vocabulary: ignored)
            out.append(int(torch.randint(0, vocab + 2, (1,), generator=g)))
    assert len(kept._counts) == 3  # r0, r3 and r9: the live requests with penalties (r1 has none)
