"""Two models on one daemon (issue 25): aggregate throughput with 8 streams on each, against each
alone, and what a load of another model costs the streams of the one serving.

    .venv/bin/python benchmarks/two_models.py [--streams 8] [--tokens 128] [--rounds 2]
    .venv/bin/python benchmarks/two_models.py --rounds 0 --gap-rounds 4     # the load gap alone

The models are the default model twice, under two names (the same GGUF reached by two paths: two
engines, two KV pools, the same size), so that the figures are about sharing, not about the models.
The daemon runs in a temporary runtime dir with its defaults (`--max-loaded-models 2`).

Throughput: ``--streams`` greedy requests of ``--tokens`` tokens each (ignore_eos) on one model, then
the other, then both at once; output tokens per second over the whole phase, the median of
``--rounds``. "Sum alone" is what the two would give on two machines; on one CPU both share its
cores, so the fair bar is the mean of the two alone (each phase already uses every core).

Load gap (``--gap-rounds`` times): ``--streams`` streams on the first model; a second in, a request
for another name (another path to the file: a new engine built by a worker thread) arrives. Each stream's gaps between tokens
are recorded: the largest while the load runs, against the median step (all streams decode in one
step, so a step is a gap).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmd.client import Client
from llmd.daemon.model_source import default_model_path
from llmd.kernels import cpu_profile

PROMPT = ("Here is a list of everyday things, each with a short note on what it is for and where it is "
          "usually kept in a house. Continue the list for as long as you can:\n1. A kettle:")


def stream_times(socket_dir: Path, model: str | None, tokens: int, out: list[list[float]]) -> None:
    """One greedy stream; appends its token arrival times."""
    times = []
    with Client(socket_dir) as c:
        for delta in c.generate(PROMPT, model=model, max_tokens=tokens, temperature=0, ignore_eos=True):
            times.extend([time.monotonic()] * len(delta.token_ids))
    out.append(times)


def phase(socket_dir: Path, models: list[str | None], streams: int, tokens: int) -> float:
    """Output tokens per second of ``streams`` streams on each of ``models`` at once."""
    out: list[list[float]] = []
    threads = [threading.Thread(target=stream_times, args=(socket_dir, m, tokens, out))
               for m in models for _ in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(len(t) for t in out) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gap-rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    gguf = default_model_path()
    a, b = (tmp / name for name in ("model-a.gguf", "model-b.gguf"))
    for link in (a, b):
        link.symlink_to(gguf)
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp / "config"), XDG_STATE_HOME=str(tmp / "state"))
    socket_dir = tmp / "run"
    start = [sys.executable, "-m", "llmd", "start", "--model", str(a), "--socket-dir", str(socket_dir)]
    subprocess.run(start, check=True, env=env, capture_output=True)
    print(cpu_profile.machine_line())
    try:
        with Client(socket_dir) as client:  # b built before any timing
            client.generate(PROMPT, model=str(b), max_tokens=1, stream=False)
        rates: dict[str, list[float]] = {"a": [], "b": [], "both": []}
        for _ in range(args.rounds):
            rates["a"].append(phase(socket_dir, [None], args.streams, args.tokens))
            rates["b"].append(phase(socket_dir, [str(b)], args.streams, args.tokens))
            rates["both"].append(phase(socket_dir, [None, str(b)], args.streams, args.tokens))
        if args.rounds:  # (--rounds 0: the load gap alone)
            ra, rb, both = (statistics.median(rates[k]) for k in ("a", "b", "both"))
            print(f"throughput, {args.streams} streams x {args.tokens} tokens per model, median of {args.rounds}:")
            print(f"  a alone {ra:.0f} tok/s, b alone {rb:.0f} tok/s, both at once {both:.0f} tok/s")
            print(f"  both / (a + b alone) = {both / (ra + rb):.2f}x;  "
                  f"both / mean(a, b alone) = {both / ((ra + rb) / 2):.2f}x")

        # the load gap: another model built while a serves (a new name each time: a fresh build)
        print(f"load gap: {args.streams} streams on a; another model built meanwhile ({args.gap_rounds} times):")
        for i in range(args.gap_rounds):
            other = tmp / f"model-c{i}.gguf"
            other.symlink_to(gguf)
            out: list[list[float]] = []
            threads = [threading.Thread(target=stream_times, args=(socket_dir, None, args.tokens * 2, out))
                       for _ in range(args.streams)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            load_start = time.monotonic()
            with Client(socket_dir) as client:
                client.generate(PROMPT, model=str(other), max_tokens=1, stream=False)
            load_end = time.monotonic()
            for t in threads:
                t.join()
            gaps = [(t1 - t0, t1) for times in out for t0, t1 in zip(times, times[1:]) if t1 > t0]
            step = statistics.median(g for g, _ in gaps)
            during = max((g for g, t1 in gaps if load_start <= t1 <= load_end + step), default=0.0)
            print(f"  built in {load_end - load_start:.1f}s; median step {1000 * step:.0f} ms, largest gap during "
                  f"the load {1000 * during:.0f} ms ({during / step:.1f} steps)")
    finally:
        subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(socket_dir)], env=env,
                       capture_output=True)


if __name__ == "__main__":
    main()
