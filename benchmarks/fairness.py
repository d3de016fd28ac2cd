"""Fairness between clients: one client's long prompts against another client's short request.

    .venv/bin/python benchmarks/fairness.py
    .venv/bin/python benchmarks/fairness.py --long-prompts 4 --long-tokens 7000 --delay 1.0

Starts its own daemon (default model and settings) in a temporary runtime dir with its own XDG
dirs, and stops it at the end. Client 1, one connection and so one owner, sends --long-prompts
prompts of --long-tokens random token ids (max_tokens 16) at once; --delay s later client 2, a
second connection, sends a 4-token prompt (max_tokens 8). Both greedy, ignoring end-of-text.
Printed: client 2's time to first token and end to end (measured by the client, from sending),
client 1's per-request figures as the daemon reports them, what the engine held when client 2
sent, the KV pool against the long prompts, and the CPU. The target (issue 18): client 2's first
token within 2 s and its last within 3 s, whatever client 1 has queued.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def cpu_flags() -> str:
    """What ``grep -o 'avx512[a-z_0-9]*\\|avx2' /proc/cpuinfo | sort -u`` prints, on one line."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = sorted(set(re.findall(r"avx512[a-z_0-9]*|avx2", text)))
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(flags)}"


def isolated_env(tmp: Path) -> dict[str, str]:
    """The daemon's config, state and runtime dirs inside ``tmp``: no user config reaches it."""
    from llmd.config import OPTIONS

    env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"), XDG_CONFIG_HOME=str(tmp / "config"),
               LLMD_RUNTIME_DIR=str(tmp / "default-run"))
    env.pop("LLMD_CONFIG", None)
    for option in OPTIONS.values():
        env.pop(option.env, None)
    return env


def long_client(socket_dir: Path, prompts: list[list[int]], max_tokens: int, sent: threading.Event,
                out: dict[str, Any]) -> None:
    """Client 1: every prompt from one connection, then read the streams to the end."""
    from llmd.client import Client

    with Client(socket_dir) as client:
        start = time.perf_counter()
        streams = [client.generate(token_ids=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                   for p in prompts]
        sent.set()
        for stream in streams:  # the client stashes the others' messages meanwhile
            for _ in stream:
                pass
        out["wall"] = time.perf_counter() - start
        out["results"] = [s.result for s in streams]


def short_request(socket_dir: Path, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Client 2: one streamed request on its own connection, timed from sending."""
    from llmd.client import Client

    with Client(socket_dir) as client:
        start = time.perf_counter()
        stream = client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        ttft = None
        for delta in stream:
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - start
        return {"ttft": ttft, "e2e": time.perf_counter() - start, "result": stream.result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--long-max-tokens", type=int, default=16)
    parser.add_argument("--short-max-tokens", type=int, default=8)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between client 1's sends and client 2's")
    args = parser.parse_args()

    from llmd.client import Client

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        env = isolated_env(tmp)
        socket_dir = tmp / "run"
        llmd = [sys.executable, "-m", "llmd"]
        subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir)], check=True, env=env)
        try:
            with Client(socket_dir) as client:
                info = client.info()
                vocab = sorted(set(client.tokenize(" ".join(f"w{i} alpha beta {i * 7}" for i in range(400)))))
                short = client.tokenize("Name three colours.")[:4]
                # warm-up: the first prefill and decode steps pay one-off costs
                client.generate(token_ids=short, max_tokens=2, stream=False, temperature=0, ignore_eos=True)
                rng = random.Random(0)
                prompts = [[rng.choice(vocab) for _ in range(args.long_tokens)] for _ in range(args.long_prompts)]
                sent, long_out = threading.Event(), {}
                worker = threading.Thread(target=long_client, args=(socket_dir, prompts, args.long_max_tokens, sent,
                                                                    long_out))
                worker.start()
                sent.wait()
                time.sleep(args.delay)
                engine_then = client.stats()
                short_out = short_request(socket_dir, short, args.short_max_tokens)
                worker.join()
                engine_end = client.stats()
        finally:
            subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, capture_output=True, env=env)

    block_size, num_blocks = info["block_size"], info["num_blocks"]
    per_prompt = -(-(args.long_tokens + args.long_max_tokens) // block_size)
    print(cpu_flags())
    print(f"model {info.get('model')}; max_model_len {info['max_model_len']}; KV pool {num_blocks} blocks of "
          f"{block_size} ({num_blocks * block_size} tokens); max_batched_tokens default")
    print(f"client 1: {args.long_prompts} x {args.long_tokens}-token prompts, max_tokens {args.long_max_tokens}: "
          f"{per_prompt} blocks each, {args.long_prompts * per_prompt} in all; the pool holds "
          f"{num_blocks // per_prompt} at once")
    print(f"when client 2 sent ({args.delay:.1f} s later): {engine_then['num_running']} running, "
          f"{engine_then['num_waiting']} waiting, {engine_then['num_blocks_free']} KV blocks free")
    r = short_out["result"]
    print(f"client 2: {len(short)}-token prompt, {r.usage.get('completion_tokens')} tokens: "
          f"TTFT {short_out['ttft']:.2f} s, end to end {short_out['e2e']:.2f} s "
          f"(daemon: queue {r.timings.get('queue_s') or 0:.2f} s, TTFT {r.timings.get('ttft_s') or 0:.2f} s)")
    print(f"client 1: all done in {long_out['wall']:.1f} s; preemptions in all: {engine_end['num_preemptions']}")
    for i, res in enumerate(long_out["results"]):
        t = res.timings
        print(f"  prompt {i}: queue {t.get('queue_s') or 0:.1f} s, TTFT {t.get('ttft_s') or 0:.1f} s, "
              f"end to end {t.get('e2e_s') or 0:.1f} s, {res.usage.get('completion_tokens')} tokens, "
              f"finish {res.finish_reason}")
    met = short_out["ttft"] <= 2.0 and short_out["e2e"] <= 3.0
    print(f"target (client 2: first token <= 2 s, done <= 3 s): {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
