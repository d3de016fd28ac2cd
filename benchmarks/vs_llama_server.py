"""llmd next to llama.cpp's llama-server, and llmd's HTTP API next to its ZeroMQ socket: the same GGUF,
the same workload, the same cores, in one run, measured by one tool (`llmd bench`'s).

    LLAMA_SERVER=$(../shared/anchors/build-llama-server.sh) .venv/bin/python benchmarks/vs_llama_server.py
    .venv/bin/python benchmarks/vs_llama_server.py --streams 1 16 --rounds 3 --llama-server PATH
    .venv/bin/python benchmarks/vs_llama_server.py --no-llama-server        # the HTTP overhead only

Both servers are started here and stay up; the idle one sleeps: llama-server with -t <cores> and one
slot per stream of the largest count (continuous batching), the llmd daemon with its defaults,
`--model GGUF`, `--http` and `--no-prefix-cache` (below). Three targets, in turn within each round:
llama-server over its OpenAI API (`llmd bench --url`'s driver, llmd/bench_http.py), llmd over the
same API, and llmd over ZeroMQ (`llmd bench`'s, llmd/bench.py). Each round has fresh random prompts
(token ids: exact lengths), the same for the three targets (llmd's prefix cache is off, so its second
target does not reuse the first's prompt work), greedy, `--output-tokens` new tokens ignoring
end-of-text. Reported per target: aggregate output tok/s (tokens over the wall time from the first
request to the last token, prefill included), per-stream decode tok/s (the tokens after the first
over the median time from the first token to the last), TTFT p50/p99; then the ratios llmd-HTTP /
llama-server and llmd-HTTP / llmd-ZeroMQ (the HTTP path's cost). The median round of each is shown.
A ratio from one run is the figure to quote: absolute tok/s differ 2x between days on these machines.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmd.bench import BenchConfig, BenchReport, run_bench
from llmd.bench_http import run_bench_http
from llmd.client import Client, load_connection
from llmd.kernels import cpu_profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("llama-server did not come up")


def figures(r: BenchReport) -> dict[str, float]:
    if r.num_failed:
        raise RuntimeError(f"{r.num_failed} requests failed: {r.errors}")
    # per stream: the tokens after the first over the time after it (medians). Not 1 / the median gap:
    # llmd's accepted drafts arrive together over ZeroMQ, so most of its gaps are 0
    after_first = r.output_tokens / max(r.num_requests, 1) - 1
    decoding = (r.e2e_p50 or 0.0) - (r.ttft_p50 or 0.0)
    return {"tok_s": r.output_tokens_per_s, "decode": after_first / decoding if decoding > 0 else 0.0,
            "p50": r.ttft_p50 or 0.0, "p99": r.ttft_p99 or 0.0}


def median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    return sorted(rounds, key=lambda f: f["tok_s"])[len(rounds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="the llama-server binary (default: $LLAMA_SERVER)")
    parser.add_argument("--no-llama-server", action="store_true", help="llmd over HTTP and ZeroMQ only")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    with_llama = not args.no_llama_server
    if with_llama and (not args.llama_server or not Path(args.llama_server).is_file()):
        sys.exit("set LLAMA_SERVER or --llama-server to a llama-server binary "
                 "(../shared/anchors/build-llama-server.sh builds one), or pass --no-llama-server")
    from llmd.daemon.model_source import default_model_path

    gguf = Path(args.model or default_model_path())
    slots = max(args.streams)
    llama = None
    llama_url = ""
    if with_llama:
        port = free_port()
        llama_url = f"http://127.0.0.1:{port}/v1"
        ctx_per_slot = args.prompt_tokens + args.output_tokens + 64
        llama = subprocess.Popen([args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-tb",
                                  str(args.threads), "--port", str(port), "--host", "127.0.0.1", "-np", str(slots),
                                  "-c", str(slots * ctx_per_slot), "--log-disable"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tempfile.TemporaryDirectory()
    socket_dir = Path(tmp.name) / "run"
    llmd = [sys.executable, "-m", "llmd"]
    env = {k: v for k, v in os.environ.items() if k != "LLMD_API_KEY"}
    rows: list[tuple[int, dict[str, dict[str, float]]]] = []
    try:
        if llama is not None:
            wait_http(port, llama)
        subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir), "--model", str(gguf), "--http", "0",
                        "--no-prefix-cache"], check=True, env=env)
        with Client(socket_dir) as client:
            info = client.info()
        connection = load_connection(socket_dir)
        targets: dict[str, Any] = {}
        if with_llama:
            targets["llama-server"] = lambda c: run_bench_http(llama_url, c)
        targets["llmd HTTP"] = lambda c: run_bench_http(info["http"] + "/v1", c)
        targets["llmd ZeroMQ"] = lambda c: run_bench(connection, c)
        for run in targets.values():  # warm-up: first-call costs out of the figures
            asyncio.run(run(BenchConfig(num_streams=2, prompt_tokens=16, output_tokens=8)))
        for n in args.streams:
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            for rnd in range(args.rounds):
                # the same prompts for every target in a round: with speculation on, how much a random
                # prompt's greedy output repeats itself moves one stream's tok/s up to 2x
                seed = int(time.time() * 1000) % 2**31 + rnd
                for name, run in targets.items():
                    config = BenchConfig(num_streams=n, prompt_tokens=args.prompt_tokens,
                                         output_tokens=args.output_tokens, seed=seed)
                    rounds[name].append(figures(asyncio.run(run(config)).report))
                print(f"  {n} streams: " + ", ".join(f"{name} {r[-1]['tok_s']:.1f} tok/s" for name, r in rounds.items()),
                      file=sys.stderr)
            rows.append((n, {name: median_round(r) for name, r in rounds.items()}))
    finally:
        subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, capture_output=True, env=env)
        if llama is not None:
            llama.terminate()
            llama.wait(timeout=30)
        tmp.cleanup()
    print(cpu_profile.machine_line())
    from llmd.bench import kernels_line

    print(f"model {gguf.name}; llmd {info.get('dtype')}, {kernels_line(info.get('kernels', {}))}; "
          f"{'llama-server ' + args.llama_server + '; ' if with_llama else ''}{args.prompt_tokens} prompt + "
          f"{args.output_tokens} new tokens per stream, greedy; median of {args.rounds} rounds")
    names = list(rows[0][1]) if rows else []
    print(f"{'streams':>7} | " + " | ".join(f"{name + ' tok/s, decode/stream, TTFT p50/p99':<44}" for name in names)
          + " | HTTP/ZeroMQ tok/s, TTFT p50" + (" | llmd HTTP/llama tok/s" if with_llama else ""))
    for n, by in rows:
        cells = [f"{f['tok_s']:>7.1f} {f['decode']:>7.1f} {f['p50']:>8.3f}s {f['p99']:>8.3f}s{'':>11}"
                 for f in by.values()]
        h, z = by["llmd HTTP"], by["llmd ZeroMQ"]
        line = f"{n:>7} | " + " | ".join(cells) + f" | {h['tok_s'] / z['tok_s']:.3f}x, {1000 * (h['p50'] - z['p50']):+.1f} ms"
        if with_llama:
            line += f" | {h['tok_s'] / by['llama-server']['tok_s']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
