"""Draft-model speculation (issue 22, ``--speculative draft``): a second model's greedy guesses,
verified by the target exactly as prompt-lookup drafts are. Greedy rows give the target's own tokens
whatever the draft model says; the draft model's cache follows each sequence through rejections,
preemptions, long prompts caught up in pieces and a full pool, and gives every block back."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import (make_engine, make_hf_model, make_tiny_tokenizer, perturbed_copy, run_engine,
                         save_hf_model)

from llmd.daemon.engine.draft_model import DraftModel
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.loader import load_model
from llmd.daemon.model_source import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target; a draft that agrees with it often but not always (its weights perturbed); a
    one-layer draft of other random weights (nearly never right)."""
    root = tmp_path_factory.mktemp("draft")
    target = make_hf_model("llama")
    return {"target": save_hf_model(target, root / "target", with_tokenizer=True),
            "near": save_hf_model(perturbed_copy(target, 0.03), root / "near", with_tokenizer=True),
            "far": save_hf_model(make_hf_model("llama", seed=5, num_hidden_layers=1), root / "far",
                                 with_tokenizer=True)}


def repetitive(i: int, n: int = 40) -> list[int]:
    unit = [(i * 13 + k * 7) % 250 for k in range(5 + i % 3)]
    return (unit * (n // len(unit) + 1))[:n]


def requests(params: SamplingParams, n: int = 6, length: int = 40) -> list[tuple[int, str, list[int], SamplingParams]]:
    return [(i % 3, f"r{i}", repetitive(i, length), params) for i in range(n)]


def drafting_engine(dirs: dict[str, Path], draft: str = "near", **config):
    engine = make_engine(dirs["target"], speculative="draft", draft_dir=dirs[draft], **config)
    engine.draft_pass_cost = 0.0  # draft whatever a pass of the tiny draft model costs
    return engine


def assert_nothing_held(engine) -> None:
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert engine.drafter.num_held == 0 and engine.drafter.pool.num_free_blocks == engine.drafter.num_blocks


@pytest.mark.parametrize("config", [dict(), dict(max_batched_tokens=16), dict(num_blocks=24, block_size=4),
                                    dict(prefix_cache=False)],
                         ids=["default", "small-budget", "preempting", "no-cache"])
def test_greedy_tokens_are_the_target_s_whatever_the_draft(dirs, config: dict) -> None:
    off = run_engine(make_engine(dirs["target"], speculative="off", **config), requests(GREEDY))
    engine = drafting_engine(dirs, **config)
    assert run_engine(engine, requests(GREEDY)) == off
    # it drafted, some drafts were right and some wrong (rolled back in both caches)
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    assert engine.stats().num_generated_tokens_total == sum(map(len, off.values()))
    assert_nothing_held(engine)
    if config.get("num_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_a_draft_that_is_always_wrong_changes_nothing_and_backs_off(dirs) -> None:
    off = run_engine(make_engine(dirs["target"], speculative="off"), requests(GREEDY))
    engine = drafting_engine(dirs, "far")
    assert run_engine(engine, requests(GREEDY)) == off
    assert engine.num_accepted_tokens <= engine.num_draft_tokens // 4
    # drafts that keep failing stop: far fewer than the 3 per step a draft that is always right gets
    assert engine.num_draft_tokens < len(off) * GREEDY.max_tokens // 2
    assert_nothing_held(engine)


def test_the_served_cpu_path_drafts_and_verifies_in_native_steps(dirs) -> None:
    """INT4, the cpu attention backend and the fused native decode step, for both models: the draft
    model's one-token passes are native decode steps of its own."""
    from llmd.daemon.attention import CpuAttentionBackend
    from llmd.daemon.quantization import QuantConfig

    config = dict(attention=CpuAttentionBackend(), quant=QuantConfig("int4"))
    off = run_engine(make_engine(dirs["target"], speculative="off", **config), requests(GREEDY))
    engine = drafting_engine(dirs, **config)
    assert engine.drafter.model.decode_step is not None
    assert run_engine(engine, requests(GREEDY)) == off
    assert engine.num_accepted_tokens > 0
    assert_nothing_held(engine)


def test_a_long_prompt_is_caught_up_in_pieces(dirs) -> None:
    """A prompt longer than the draft model's catch-up chunk drafts only once the draft model holds it
    all; the tokens are unchanged."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = requests(params, n=2, length=100)
    off = run_engine(make_engine(dirs["target"], speculative="off"), reqs)
    engine = drafting_engine(dirs)
    engine.drafter.max_chunk = 16
    passes: list[list[int]] = []
    forward = engine.drafter._forward

    def recorded(rows, sample):
        passes.append([len(new) for _, new in rows])
        return forward(rows, sample)

    engine.drafter._forward = recorded
    assert run_engine(engine, reqs) == off
    assert max(max(p) for p in passes) == 16  # never more than a chunk at once
    assert engine.num_accepted_tokens > 0
    assert_nothing_held(engine)


class Seq:
    """What DraftModel.propose reads of a Sequence."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.token_ids = rid, tokens


def recording_drafter(dirs: dict[str, Path], num_blocks: int, max_chunk: int = 16) -> tuple[DraftModel, list[list[int]]]:
    """The "near" draft model in a pool of ``num_blocks`` blocks of 4, and the list its passes record
    themselves in: each pass, the number of tokens each row brought in."""
    draft = load_model(resolve_model(dirs["near"])).model
    drafter = DraftModel(draft, block_size=4, num_blocks=num_blocks, vocab_size=draft.config.vocab_size,
                         max_chunk=max_chunk)
    passes: list[list[int]] = []
    forward = drafter._forward
    drafter._forward = lambda rows, sample: passes.append([len(new) for _, new in rows]) or forward(rows, sample)
    return drafter, passes


def test_catch_up_is_bounded_per_step_and_drafting_sequences_go_first(dirs) -> None:
    """The draft model brings in at most ``max_chunk`` tokens a step for all the sequences far behind
    together (new prompts; at most ``catch_up`` when the engine gives less), the fewest first; the
    sequences a few tokens behind (their last verification's tokens, a probe's) come in whole and
    draft whatever the bound. Canary: each sequence had its own ``max_chunk``, so new prompts
    arriving together put all of theirs in one step."""
    drafter, passes = recording_drafter(dirs, num_blocks=256)
    a = Seq("a", repetitive(1, 20))
    assert drafter.propose([(a, 3)]) == [[]] and passes == [[16]]  # caught up 16 of 20: no draft yet
    assert [len(d) for d in drafter.propose([(a, 3)])] == [3]  # the last 4, then its drafts
    a.token_ids = a.token_ids + [7, 8]  # a token accepted, one of the model's own
    b, c = Seq("b", repetitive(2, 30)), Seq("c", repetitive(3, 30))  # new prompts, listed first
    passes.clear()
    drafts = drafter.propose([(b, 3), (c, 3), (a, 3)])
    assert [len(d) for d in drafts] == [0, 0, 3] and passes[0] == [2, 16]  # a's 2 first; 16 of b's; none of c's
    passes.clear()
    drafts = drafter.propose([(b, 3), (c, 3)], catch_up=5)  # b's last 14 whole (it drafts), 5 of c's
    assert [len(d) for d in drafts] == [3, 0] and passes[0] == [14, 5]
    passes.clear()
    assert drafter.propose([(c, 3)], catch_up=0) == [[]] and passes == []  # nothing brought in
    # however small the bound, sequences a few tokens behind draft every step (charged, those few
    # took a small bound whole, and the last sequence listed never caught up)
    for _ in range(3):
        for s in (a, b):
            s.token_ids = s.token_ids + [9]
        assert [len(d) for d in drafter.propose([(a, 2), (b, 2)], catch_up=1)] == [2, 2]
    for rid in "abc":
        drafter.release(rid)
    assert drafter.pool.num_free_blocks == 256


def test_a_sequence_that_does_not_fit_leaves_the_catch_up_to_others(dirs) -> None:
    """A new prompt whose catch-up does not fit the draft pool is dropped without spending the step's
    catch-up: the next one, which fits, takes it. Canary: the budget was charged before the blocks
    were sought, and y brought in nothing."""
    drafter, passes = recording_drafter(dirs, num_blocks=4)
    y = Seq("y", repetitive(2, 3))
    assert [len(d) for d in drafter.propose([(y, 1)])] == [1]  # y holds its 3 tokens: one block
    y.token_ids = repetitive(2, 20)  # 17 behind now
    x = Seq("x", repetitive(4, 17))  # 17 behind: 13 of them need all 4 blocks, 3 are free
    passes.clear()
    assert drafter.propose([(x, 1), (y, 1)], catch_up=13) == [[], []]
    assert passes == [[13]] and drafter.num_held == 1 and drafter.pool.num_free_blocks == 0  # y's 13: 3 blocks
    drafter.release("y")
    assert drafter.pool.num_free_blocks == 4


def test_the_engine_bounds_catch_up_by_the_step_s_room(dirs) -> None:
    """The draft model's catch-up runs in the step's time: the engine lets it bring in what the
    step's room for drafts would cost in its own tokens (room / draft_pass_cost), so a step carrying
    another request's prompt chunk is not stretched by a new sequence's catch-up beside it."""
    engine = drafting_engine(dirs, max_batched_tokens=64)
    engine.draft_pass_cost = 0.25
    seen: list[tuple[int, int | None]] = []
    propose = engine.drafter.propose

    def recorded(wants, catch_up=None):
        seen.append((engine.scheduler.room_for_drafts().tokens, catch_up))
        propose(wants, catch_up)
        return [[] for _ in wants]  # nothing verified: a keeps wanting drafts whatever the tiny draft says

    engine.drafter.propose = recorded
    run_engine(engine, [(0, "a", repetitive(1, 40), GREEDY), (3, "b", repetitive(2, 20), GREEDY)])
    assert seen and all(catch_up == int(room / 0.25) for room, catch_up in seen)
    assert (64 - 1 - 20, (64 - 1 - 20) * 4) in seen  # the step with b's prompt beside a's token: less room
    assert_nothing_held(engine)


def test_a_full_draft_pool_skips_drafts_and_loses_nothing(dirs) -> None:
    """The draft model's pool is too small for every sequence: those that do not fit decode without
    drafts (the others' blocks are taken back first), and nothing fails."""
    draft = load_model(resolve_model(dirs["near"])).model
    target = load_model(resolve_model(dirs["target"])).model
    drafter = DraftModel(draft, block_size=4, num_blocks=14, vocab_size=target.config.vocab_size)

    class Seq:  # what propose reads of a Sequence
        def __init__(self, rid: str, tokens: list[int]) -> None:
            self.request_id, self.token_ids = rid, tokens

    seqs = [Seq(f"s{i}", repetitive(i, 20)) for i in range(4)]  # 20 tokens + 2 drafts fed back: 6 blocks each
    drafts = drafter.propose([(s, 3) for s in seqs])
    assert [len(d) for d in drafts] == [3, 3, 0, 0]  # two fit in 14 blocks
    assert drafter.num_held == 2 and drafter.pool.num_free_blocks == 2
    # the next step drafts for the last two: the first two, not drafting now, give their blocks back
    assert [len(d) for d in drafter.propose([(s, 3) for s in seqs[2:]])] == [3, 3]
    assert drafter.num_held == 2
    for s in seqs:
        drafter.release(s.request_id)
    assert drafter.pool.num_free_blocks == 14


def test_the_draft_model_waits_while_a_prompt_takes_the_budget(dirs) -> None:
    """The draft model's passes come before the step is scheduled: while a new request's prompt will
    take the step's budget (its chunk comes before any drafts), they would be thrown away, so the
    step carrying that prompt runs none; once the prompt is in, drafting resumes. Canary: the draft
    model ran 3 passes in that step, and none of their drafts were verified."""
    engine = drafting_engine(dirs, max_batched_tokens=8)
    engine.add_request("a", list(range(10, 22)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 3:
        engine.step()
    passes: list[int] = []
    forward = engine.drafter._forward
    engine.drafter._forward = lambda rows, sample: (passes.append(len(rows)), forward(rows, sample))[1]
    engine.add_request("b", list(range(100, 160)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.scheduler.room_for_drafts().tokens == 0
    engine.step()  # a's token and 7 of b's prompt
    assert passes == [] and engine.scheduler.running[1].num_computed_tokens == 7
    while engine.scheduler.running[1].num_computed_tokens < 60:
        engine.step()
    verified = engine.num_draft_tokens
    engine.step()  # b's prompt done: a drafts again
    assert passes and engine.num_draft_tokens > verified
    while engine.has_unfinished():
        engine.step()
    assert_nothing_held(engine)


def test_drafts_are_the_draft_model_s_greedy_continuation(dirs) -> None:
    """What the draft model proposes is its own greedy output, through rollbacks: each step's drafts
    equal transformers' greedy continuation of the draft model from the sequence's tokens."""
    from tiny_models import hf_greedy

    from llmd.daemon.attention import TorchAttentionBackend

    hf_draft = perturbed_copy(make_hf_model("llama"), 0.03)  # the "near" draft, in transformers
    draft = load_model(resolve_model(dirs["near"]), attention=TorchAttentionBackend()).model
    drafter = DraftModel(draft, block_size=4, num_blocks=64, vocab_size=draft.config.vocab_size)

    class Seq:
        def __init__(self, tokens: list[int]) -> None:
            self.request_id, self.token_ids = "s", tokens

    tokens = repetitive(2, 30)
    for step in range(6):
        (got,) = drafter.propose([(Seq(tokens), 3)])
        assert got == hf_greedy(hf_draft, tokens, 3)
        # the target keeps one draft and adds a token of its own (rejecting the rest) or keeps them all
        tokens = tokens + (got[:1] + [(got[1] + 1) % 250] if step % 2 else got + [7])
    drafter.release("s")
    assert drafter.pool.num_free_blocks == 64


def test_unload_and_reload_with_a_draft_model(dirs) -> None:
    engine = drafting_engine(dirs)
    before = run_engine(engine, requests(GREEDY, n=2))
    engine.unload()
    assert engine.drafter.model is None and engine.drafter.kv_caches == []
    with pytest.raises(ValueError, match="draft model"):
        engine.load(load_model(resolve_model(dirs["target"])).model)
    engine.load(load_model(resolve_model(dirs["target"])).model, load_model(resolve_model(dirs["near"])).model)
    assert run_engine(engine, requests(GREEDY, n=2)) == before
    assert_nothing_held(engine)


def test_the_settings_are_checked(dirs, tmp_path: Path) -> None:
    from llmd.daemon.engine_args import EngineArgs

    with pytest.raises(ValueError, match="--speculative draft needs --draft-model"):
        EngineArgs(speculative="draft")
    with pytest.raises(ValueError, match="--draft-model needs --speculative draft"):
        EngineArgs(draft_model=str(dirs["near"]))
    # a draft model with another tokenizer is refused before the engine is built
    other = tmp_path / "other"
    save_hf_model(make_hf_model("llama"), other)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|tool|>"]})
    tokenizer.save_pretrained(str(other))
    args = EngineArgs(model=str(dirs["target"]), speculative="draft", draft_model=str(other), device="cpu",
                      dtype="float32", quant="none", attention="torch")
    with pytest.raises(ValueError, match="does not share"):
        args.build()
    # built through the front door, the engine drafts with it
    args = EngineArgs(model=str(dirs["target"]), speculative="draft", draft_model=str(dirs["near"]), device="cpu",
                      dtype="float32", quant="none", attention="torch")
    runtime = args.build()
    assert runtime.engine.drafter is not None and runtime.reload()[1] is not None


def test_status_names_the_draft_model() -> None:
    from llmd.commands.status import _speculation_line

    line = _speculation_line({"speculative": "draft", "draft_model": "tiny-draft"},
                             {"draft_acceptance_rate": 0.5, "mean_accepted_length": 2.0, "num_draft_tokens_total": 8})
    assert line.startswith("draft (tiny-draft), 50% of 8 draft tokens accepted")


def test_past_the_draft_model_s_context_it_does_not_draft(dirs) -> None:
    """A sequence longer than the draft model's context is not caught up, again and again, only to be
    dropped: it is simply not drafted."""
    draft = load_model(resolve_model(dirs["near"])).model
    drafter = DraftModel(draft, block_size=4, num_blocks=256, vocab_size=draft.config.vocab_size, max_chunk=16)
    passes = []
    forward = drafter._forward
    drafter._forward = lambda rows, sample: passes.append(len(rows)) or forward(rows, sample)

    class Seq:
        def __init__(self, tokens: list[int]) -> None:
            self.request_id, self.token_ids = "s", tokens

    too_long = Seq(repetitive(1, draft.config.max_position_embeddings))
    for _ in range(3):
        assert drafter.propose([(too_long, 3)]) == [[]]
    assert passes == [] and drafter.num_held == 0


def test_a_daemon_started_with_a_draft_model(dirs, tmp_path: Path) -> None:
    """`llmd start --speculative draft --draft-model DIR`: the daemon loads both models, names the
    draft in its info and in `llmd status`, and answers a greedy request token for token as the
    same model without speculation does (in process, built by the same front door)."""
    import subprocess
    import sys

    from daemon_helpers import daemon_env, start_daemon, stop_daemon

    from llmd import LLM
    from llmd.client import Client

    env = daemon_env(tmp_path)
    prompt = "abcabcabcabcabcabcabcabc"  # repeats itself: worth drafting
    socket_dir = tmp_path / "run"
    conn = start_daemon(dirs["target"], socket_dir, "--speculative", "draft", "--draft-model", str(dirs["near"]),
                        env=env)
    try:
        with Client(socket_dir) as c:
            served = c.generate(prompt, max_tokens=24, temperature=0, stream=False).token_ids
            assert c.info()["draft_model"] == conn["draft_model"] == "near"
        status = subprocess.run([sys.executable, "-m", "llmd", "status", "--socket-dir", str(socket_dir)],
                                capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0 and "draft (near)" in status.stdout, status.stdout + status.stderr
    finally:
        stop_daemon(socket_dir, env=env)
    alone = LLM(str(dirs["target"]), dtype="float32", speculative="off")
    want = alone.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].token_ids
    assert len(served) == 24 and served == want
