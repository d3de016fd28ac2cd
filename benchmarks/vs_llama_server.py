"""llmd next to llama.cpp's llama-server: the same GGUF, the same prompts, the same cores, in one run.

    LLAMA_SERVER=$(../shared/anchors/build-llama-server.sh) .venv/bin/python benchmarks/vs_llama_server.py
    .venv/bin/python benchmarks/vs_llama_server.py --streams 1 16 --rounds 3 --llama-server PATH

Both servers are started here (llama-server with -t <cores> and one slot per stream of the largest
count, continuous batching; the llmd daemon with its defaults and `--model GGUF`) and stay up; the
idle one sleeps. For each stream count, rounds alternate llama-server / llmd on the same fresh random
prompts (token ids, so lengths are exact and no prefix cache helps), greedy, `--output-tokens` new
tokens ignoring end-of-text, each stream its own connection. Reported per server: aggregate output
tok/s (tokens over the wall time from the first request to the last token, prefill included),
decode tok/s per stream (after its first token; the median stream), TTFT p50/p99, and the ratios
llmd/llama-server (tok/s: higher is better; TTFT: lower is better). The best round of each is
shown, these machines being shared and noisy; the CPU's flags and llmd's CPU profile head the table.
A ratio from one run is the figure to quote: absolute tok/s differ 2x between days here.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_stream(port: int, prompt: list[int], n: int, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
                       "cache_prompt": False})
    start = time.perf_counter()
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
    tokens = 0
    while line := resp.readline():
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if out.get("ttft") is None and event.get("content") is not None and not event.get("stop"):
            out["ttft"] = time.perf_counter() - start
            out["first"] = time.perf_counter()
        if event.get("stop"):
            tokens = event.get("tokens_predicted", 0)
            break
    out["end"], out["tokens"] = time.perf_counter(), tokens
    conn.close()


def llmd_stream(socket_dir: Path, prompt: list[int], n: int, out: dict) -> None:
    from llmd.client import Client

    with Client(socket_dir) as client:
        start = time.perf_counter()
        tokens = 0
        for delta in client.generate(token_ids=prompt, max_tokens=n, temperature=0, ignore_eos=True):
            if out.get("ttft") is None and delta.token_ids:
                out["ttft"] = time.perf_counter() - start
                out["first"] = time.perf_counter()
            tokens += len(delta.token_ids)
    out["end"], out["tokens"] = time.perf_counter(), tokens


def run_round(target, prompts: list[list[int]], n: int) -> dict[str, float]:
    outs = [{} for _ in prompts]
    threads = [threading.Thread(target=target, args=(p, n, o)) for p, o in zip(prompts, outs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("end" not in o for o in outs):
        raise RuntimeError("a stream failed (see above)")
    wall = max(o["end"] for o in outs) - start
    ttfts = [o["ttft"] for o in outs]
    decode = [(o["tokens"] - 1) / (o["end"] - o["first"]) for o in outs if o["tokens"] > 1]
    return {"tok_s": sum(o["tokens"] for o in outs) / wall, "p50": statistics.median(ttfts), "p99": pct(ttfts, 0.99),
            "tokens": sum(o["tokens"] for o in outs), "decode": statistics.median(decode)}


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


def cpu_line() -> str:
    from llmd.kernels import cpu_profile

    flags = sorted(f for f in cpu_profile.machine_flags() if f.startswith("avx512") or f in ("avx2", "fma"))
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(flags)}; llmd profile {cpu_profile.describe()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="the llama-server binary (default: $LLAMA_SERVER)")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if not args.llama_server or not Path(args.llama_server).is_file():
        sys.exit("set LLAMA_SERVER or --llama-server to a llama-server binary "
                 "(../shared/anchors/build-llama-server.sh builds one)")
    from llmd.daemon.model_source import default_model_path

    gguf = Path(args.model or default_model_path())
    slots = max(args.streams)
    ctx_per_slot = args.prompt_tokens + args.output_tokens + 64
    port = free_port()
    llama = subprocess.Popen([args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
                              "--port", str(port), "--host", "127.0.0.1", "-np", str(slots), "-c",
                              str(slots * ctx_per_slot), "--log-disable"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tempfile.TemporaryDirectory()
    socket_dir = Path(tmp.name) / "run"
    llmd = [sys.executable, "-m", "llmd"]
    try:
        wait_http(port, llama)
        subprocess.run([*llmd, "start", "--socket-dir", str(socket_dir), "--model", str(gguf)], check=True)
        from llmd.client import Client

        with Client(socket_dir) as client:
            info = client.info()
            vocab = sorted(set(client.tokenize(" ".join(f"w{i} alpha beta {i * 7}" for i in range(400)))))
        rng = random.Random(0)

        def prompts(n: int) -> list[list[int]]:
            return [[rng.choice(vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]

        for warm in (lambda p, n, o: llama_stream(port, p, n, o), lambda p, n, o: llmd_stream(socket_dir, p, n, o)):
            run_round(warm, prompts(2), 8)
        rows = []
        for n in args.streams:
            best_l = best_d = None
            for _ in range(args.rounds):
                batch = prompts(n)
                lr = run_round(lambda p, k, o: llama_stream(port, p, k, o), batch, args.output_tokens)
                dr = run_round(lambda p, k, o: llmd_stream(socket_dir, p, k, o), batch, args.output_tokens)
                best_l = lr if best_l is None or lr["tok_s"] > best_l["tok_s"] else best_l
                best_d = dr if best_d is None or dr["tok_s"] > best_d["tok_s"] else best_d
                print(f"  {n} streams: llama-server {lr['tok_s']:.1f} tok/s, llmd {dr['tok_s']:.1f} tok/s",
                      file=sys.stderr)
            rows.append((n, best_l, best_d))
    finally:
        subprocess.run([*llmd, "stop", "--socket-dir", str(socket_dir)], check=False, capture_output=True)
        llama.terminate()
        llama.wait(timeout=30)
        tmp.cleanup()
    print(cpu_line())
    from llmd.bench import kernels_line

    print(f"model {gguf.name}; llmd {info.get('dtype')}, {kernels_line(info.get('kernels', {}))}; "
          f"llama-server {args.llama_server}; {args.prompt_tokens} prompt + {args.output_tokens} new tokens per "
          f"stream, greedy; best of {args.rounds} rounds")
    print(f"{'streams':>7} | {'llama tok/s':>11} {'llmd tok/s':>10} {'ratio':>6} | {'decode/stream llama/llmd':>24} "
          f"{'ratio':>6} | {'TTFT p50 llama/llmd':>21} {'ratio':>6} | {'TTFT p99 llama/llmd':>21}")
    for n, lr, dr in rows:
        print(f"{n:>7} | {lr['tok_s']:>11.1f} {dr['tok_s']:>10.1f} {dr['tok_s'] / lr['tok_s']:>5.2f}x | "
              f"{lr['decode']:>12.1f}/{dr['decode']:>11.1f} {dr['decode'] / lr['decode']:>5.2f}x | "
              f"{lr['p50']:>9.3f}s/{dr['p50']:>8.3f}s {dr['p50'] / lr['p50']:>5.2f}x | "
              f"{lr['p99']:>9.3f}s/{dr['p99']:>8.3f}s")


if __name__ == "__main__":
    main()
