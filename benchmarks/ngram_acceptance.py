"""How much prompt-lookup speculation could give, before the engine verifies drafts (issue 22): the
model's own greedy outputs, replayed through the draft proposer.

    .venv/bin/python benchmarks/ngram_acceptance.py                 # the default model
    .venv/bin/python benchmarks/ngram_acceptance.py --requests 8 --prompt-tokens 300 --max-tokens 256

For each request (the `edit` workload's chats, and plain questions), the model answers greedily
without speculation. Then the answer is replayed step by step as a speculative engine would run it:
each step drafts up to k tokens from the prompt and the output so far (daemon/engine/ngram_proposer.py;
k from DraftLengths, by the length of the suffix that found the draft), keeps the longest prefix equal
to the answer's next tokens (greedy verification is exact, so these are the tokens the engine would
accept) and adds the model's own next token.
Reported: tokens per step (the ceiling on the speed-up), acceptance (accepted / drafted tokens), the
share of steps that drafted at all, and the speed-up the cost model expects: tokens over steps plus
``--cost`` (what verifying one draft token costs, as a share of a step) times the drafted tokens.
``oracle`` is what the same lookups would give with draft lengths chosen in hindsight: each step
drafts exactly the tokens that will be accepted (up to --max-draft), so nothing is rejected. It
bounds what any draft-length rule can gain over DraftLengths; a better guess of the tokens
themselves (another proposer) is not bounded by it.
"""

from __future__ import annotations

import argparse
import random
import statistics

from llmd.bench import edit_messages
from llmd.daemon.engine.ngram_proposer import DRAFT_COST, MAX_DRAFT, DraftLengths, accepted_prefix, lookup

QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Write a short poem about the sea.",
             "Explain what a hash table is.", "Give me three tips for learning to cook.",
             "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
             "What should I pack for a weekend of hiking?", "Tell me a story about a lost key."]


def replay(prompt: list[int], answer: list[int], max_draft: int, cost: float,
           oracle: bool = False) -> tuple[int, int, int, int]:
    """(steps, drafted tokens, accepted tokens, steps that drafted) for ``answer`` after ``prompt``;
    ``oracle``: every step drafts just the tokens the answer will accept (none rejected)."""
    lengths = DraftLengths(max_draft, cost)
    steps = drafted = accepted = drafting = done = 0
    while done < len(answer):
        rest = answer[done:]
        if oracle:
            draft, _ = lookup(prompt + answer[:done], max_draft)
            draft = draft[:accepted_prefix(draft, rest)]
        else:
            draft, match = lookup(prompt + answer[:done], max_draft) if lengths.wanted() else ([], 0)  # as _draft
            draft = draft[:lengths.next(match) if draft else 0]
        a = accepted_prefix(draft, rest)
        if draft:
            lengths.update(len(draft), a)
            drafted, accepted, drafting = drafted + len(draft), accepted + a, drafting + 1
        done += min(a + 1, len(rest))  # the accepted drafts and the model's own next token
        steps += 1
    return steps, drafted, accepted, drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=250, help="edit: code per request, about")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--max-draft", type=int, default=MAX_DRAFT)
    parser.add_argument("--cost", type=float, default=DRAFT_COST)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from llmd import LLM, SamplingParams

    llm = LLM(model=args.model) if args.model else LLM()
    rng = random.Random(args.seed)
    workloads = {"edit": [edit_messages(rng, args.prompt_tokens) for _ in range(args.requests)],
                 "chat": [[{"role": "user", "content": q}] for q in QUESTIONS[:args.requests]]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"max draft {args.max_draft}, cost {args.cost}; greedy answers of up to {args.max_tokens} tokens")
    print(f"{'workload':<8} {'requests':>8} {'tokens':>7} {'steps':>6} {'tok/step':>8} {'acceptance':>10} "
          f"{'drafting':>8} {'expected':>8} {'oracle':>7}  per request tok/step")
    for name, chats in workloads.items():
        outs = llm.chat(chats, params)
        rows = [(out, replay(list(out.prompt_token_ids), list(out.token_ids), args.max_draft, args.cost)) for out in outs]
        tokens = sum(len(out.token_ids) for out, _ in rows)
        steps = sum(r[0] for _, r in rows)
        drafted, accepted, drafting = (sum(r[i] for _, r in rows) for i in (1, 2, 3))
        per = [len(out.token_ids) / r[0] for out, r in rows if r[0]]
        best = [replay(list(out.prompt_token_ids), list(out.token_ids), args.max_draft, args.cost, oracle=True)
                for out, _ in rows]
        best_cost = sum(r[0] + args.cost * r[1] for r in best)
        print(f"{name:<8} {len(rows):>8} {tokens:>7} {steps:>6} {tokens / steps:>8.2f} "
              f"{accepted / max(drafted, 1):>10.2f} {drafting / steps:>8.2f} "
              f"{tokens / (steps + args.cost * drafted):>7.2f}x {tokens / best_cost:>6.2f}x  "
              f"median {statistics.median(per):.2f}, range {min(per):.2f}-{max(per):.2f}")


if __name__ == "__main__":
    main()
