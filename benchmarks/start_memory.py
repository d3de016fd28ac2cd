"""Start, load and memory, llmd next to llama-server, on the default model and on synthetic GGUFs of
Llama shapes (random Q4_0 projections, a Q8_0 embedding that is also the head; random weights load
like real ones).

    LLAMA_SERVER=$(../shared/anchors/build-llama-server.sh) .venv/bin/python benchmarks/start_memory.py
    .venv/bin/python benchmarks/start_memory.py --models default 1b --no-llama-server

Per model and server, one after the other, each started from nothing (the file is read once first,
so both find it in the page cache: a warm start, what a desktop sees after the first):
  answer   start -> the first one-token answer (llmd: `llmd start --foreground`, a client polling;
           llama-server: /health polled, then /completion); `up` is when it first answered anything
  peak     the process's peak RSS (VmHWM) by then: the load's
  idle     RSS one second later
  16x1k    RSS after 16 concurrent requests of 1,000 prompt tokens and 16 new tokens
llmd starts twice: first with an empty weights cache (the start that writes it: `llmd, first`), then
mapping it (`llmd`, as every later start). llmd only: the idle unload (`--idle-unload`, a few seconds
here), RSS after it, and the reload's time (a one-token request after the unload) against `answer`.
llama-server gets `-np 16` and `-c` = llmd's KV capacity (its info's kv_cache_tokens), or what 16 x 1k
needs where that is more (marked *); `--llama-server-ctx needed`: what 16 x 1k needs, whatever llmd
holds (llama.cpp writes its whole cache at start, so its RSS follows `-c`; llmd's default pool reserves
a quarter of the RAM and writes what is used, so "the same capacity" grows llama-server's side alone).
Synthetic files are written once into ~/.cache/llmd-bench (0.5b: 0.3 GB, 1b: 0.7 GB, 3b: 1.7 GB).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from llmd.kernels import cpu_profile

# name -> (hidden, layers, intermediate, heads, kv heads, vocab): Qwen2.5-0.5B's and Llama 3.2's shapes
SHAPES = {"0.5b": (896, 24, 4864, 14, 2, 151936), "1b": (2048, 16, 8192, 32, 8, 128256),
          "3b": (3072, 28, 8192, 24, 8, 128256)}
STREAMS, PROMPT_TOKENS, NEW_TOKENS = 16, 1000, 16


def synthetic_gguf(name: str) -> Path:
    """A Llama-architecture GGUF of ``SHAPES[name]`` with random blocks, written once."""
    import gguf
    import numpy as np

    path = Path.home() / ".cache" / "llmd-bench" / f"synthetic-llama-{name}-q4_0.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden, layers, inter, heads, kv, vocab = SHAPES[name]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    for key, value in (("block_count", layers), ("context_length", 8192), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv), ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    # a byte-level vocabulary llama-server accepts (transformers builds llmd's tokenizer from it)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + [f"t{i}" for i in range(vocab - 258)]
    w.add_token_list(tokens + ["<s>", "</s>"])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["t 4"])  # llama-server wants at least one
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)

    def blocks(rows: int, cols: int, qtype: Any, block_bytes: int) -> Any:
        raw = rng.integers(0, 256, (rows, cols // 32, block_bytes), dtype=np.uint8)
        scale = rng.uniform(0.002, 0.02, (rows, cols // 32)).astype(np.float16)
        raw[..., :2] = scale.view(np.uint8).reshape(rows, cols // 32, 2)
        return raw.reshape(rows, -1)

    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", blocks(vocab, hidden, q8, 34), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for part, (rows, cols) in (("attn_q", (hidden, hidden)), ("attn_k", (kv * head_dim, hidden)),
                                   ("attn_v", (kv * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                                   ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                                   ("ffn_down", (hidden, inter))):
            w.add_tensor(f"blk.{i}.{part}.weight", blocks(rows, cols, q4, 18), raw_dtype=q4)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".part", path)
    return path


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def read_through(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def prompts(seed: int) -> list[list[int]]:
    """Random token ids (every model here has 49k tokens or more): exact lengths, no shared prefix."""
    rng = random.Random(seed)
    return [[rng.randrange(300, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(STREAMS)]


def in_threads(fn: Any, items: list[Any]) -> None:
    errors: list[BaseException] = []

    def run(item: Any) -> None:
        try:
            fn(item)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def weights_cache_home(tmp: Path) -> Path:
    """An XDG cache directory whose llmd weights cache starts empty, sharing the user's native builds
    and tokenizers (so the first start measured is the one that writes the weights cache, nothing else)."""
    from llmd.paths import cache_home

    home = tmp / "cache"
    user = cache_home()
    (home / "llmd").mkdir(parents=True)
    for name in ("native", "tokenizers"):
        (user / name).mkdir(parents=True, exist_ok=True)
        (home / "llmd" / name).symlink_to(user / name, target_is_directory=True)
    return home


def measure_llmd(model: Path, tmp: Path, idle_unload_s: float, full: bool = True) -> dict[str, Any]:
    """``full``: the 16 streams and the idle unload too, else only the start (up, answer, peak, idle)."""
    from llmd.client import Client
    from llmd.paths import CONNECTION_FILE

    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp / "config"), XDG_STATE_HOME=str(tmp / "state"),
               XDG_CACHE_HOME=str(tmp / "cache"))
    socket_dir = tmp / "run"
    cmd = [sys.executable, "-m", "llmd", "start", "--foreground", "--model", str(model), "--socket-dir",
           str(socket_dir), "--idle-unload", str(idle_unload_s / 60)]
    start = time.monotonic()
    # (its log to a file: a pipe nobody reads while it runs would stall a daemon that logs much)
    log_path = tmp / f"llmd-{start:.0f}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    out: dict[str, Any] = {}
    try:
        while not (socket_dir / CONNECTION_FILE).is_file():
            if proc.poll() is not None:
                raise RuntimeError(f"llmd exited: {log_path.read_text()[-2000:]}")
            time.sleep(0.01)
        with Client(socket_dir) as client:
            client.health()
            out["up"] = time.monotonic() - start
            client.generate(token_ids=[300, 301, 302], max_tokens=1, stream=False)
            out["answer"] = time.monotonic() - start
            out["peak"] = rss_mib(proc.pid, "VmHWM")
            time.sleep(1.0)
            out["idle"] = rss_mib(proc.pid)
            out["kv_tokens"] = client.info()["kv_cache_tokens"]
        if not full:
            return out

        def one(ids: list[int]) -> None:
            with Client(socket_dir) as c:
                c.generate(token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0, stream=False)

        in_threads(one, prompts(1))
        out["16x1k"] = rss_mib(proc.pid)
        with Client(socket_dir) as client:
            deadline = time.monotonic() + idle_unload_s + 60
            while client.stats().get("model_state") != "unloaded" and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            out["unloaded"] = rss_mib(proc.pid)
            t0 = time.monotonic()
            client.generate(token_ids=[300, 301, 302], max_tokens=1, stream=False)
            out["reload"] = time.monotonic() - t0
            out["after_reload"] = rss_mib(proc.pid)
    finally:
        subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(socket_dir)], env=env,
                       capture_output=True)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        # what the loads did (converted and wrote the weights cache, or mapped it), for the report
        out["loads"] = [line.removeprefix("llmd: ")[:160] for line in log_path.read_text().splitlines()
                        if line.startswith(("llmd: loaded ", "llmd: wrote the prepared"))]
    return out


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"llama-server {path}: {resp.status} {data[:300]!r}")
    return json.loads(data)


def measure_llama_server(binary: str, model: Path, ctx: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [binary, "-m", str(model), "-c", str(ctx), "-np", str(STREAMS), "-t", str(os.cpu_count() or 1),
           "--port", str(port), "--host", "127.0.0.1"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                out.setdefault("up", time.monotonic() - start)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        _post(port, "/completion", {"prompt": [300, 301, 302], "n_predict": 1})
        out["answer"] = time.monotonic() - start
        out["peak"] = rss_mib(proc.pid, "VmHWM")
        time.sleep(1.0)
        out["idle"] = rss_mib(proc.pid)
        in_threads(lambda ids: _post(port, "/completion", {"prompt": ids, "n_predict": NEW_TOKENS,
                                                           "ignore_eos": True, "temperature": 0,
                                                           "cache_prompt": False}), prompts(1))
        out["16x1k"] = rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def row(r: dict[str, Any], who: str) -> None:
    print(f"  {who:13}{r['up']:7.2f}{r['answer']:10.2f}{r['peak']:10.0f}{r['idle']:10.0f}{r['16x1k']:11.0f}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["default", "0.5b", "1b", "3b"],
                        choices=["default", *SHAPES])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--llama-server-ctx", choices=["capacity", "needed"], default="capacity",
                        help="llama-server's -c: llmd's KV capacity, or what the 16 requests need")
    parser.add_argument("--idle-unload", type=float, default=6.0, help="seconds (llmd's --idle-unload, in minutes)")
    args = parser.parse_args()
    from llmd.daemon.model_source import default_model_path

    print(cpu_profile.machine_line())
    for name in args.models:
        model = default_model_path() if name == "default" else synthetic_gguf(name)
        size_mib = model.stat().st_size / 2**20
        read_through(model)
        with tempfile.TemporaryDirectory() as tmp:
            weights_cache_home(Path(tmp))
            first = measure_llmd(model, Path(tmp), args.idle_unload, full=False)  # writes the weights cache
            os.sync()  # on disk, as by any later start (not still being written back while the next maps it)
            ours = measure_llmd(model, Path(tmp), args.idle_unload)
        print(f"\n{name}: {model.name}, {size_mib:.0f} MiB; llmd's KV capacity {ours['kv_tokens']} tokens")
        print(f"  {'':13}{'up s':>7}{'answer s':>10}{'peak MiB':>10}{'idle MiB':>10}{'16x1k MiB':>11}")
        row(first | {"16x1k": float("nan")}, "llmd, first")
        row(ours, "llmd")
        for line in first["loads"] + ours["loads"]:
            print(f"    {line}")
        theirs = None
        if args.llama_server and not args.no_llama_server:
            # the same capacity, but never less than the 16 requests need (llama-server splits -c among its
            # slots and refuses a prompt longer than one; llmd queues what its pool cannot hold yet)
            needed = STREAMS * (PROMPT_TOKENS + NEW_TOKENS + 8)
            ctx = needed if args.llama_server_ctx == "needed" else max(ours["kv_tokens"], needed)
            theirs = measure_llama_server(args.llama_server, model, ctx)
            row(theirs, f"llama-server{'*' if ctx > ours['kv_tokens'] else ''}")
            short = ": llmd's pool holds fewer tokens than 16 x 1k" if ctx > ours["kv_tokens"] else ""
            print(f"  llama-server -c {ctx}{short}")
        print(f"  llmd idle unload: RSS {ours['unloaded']:.0f} MiB after it; reload {ours['reload']:.2f} s "
              f"({ours['reload'] / ours['answer']:.2f}x the start's answer), RSS {ours['after_reload']:.0f} MiB")
        if theirs is not None:
            print(f"  ratios llmd/llama-server: answer {ours['answer'] / theirs['answer']:.2f}x, peak "
                  f"{ours['peak'] / theirs['peak']:.2f}x, idle {ours['idle'] / theirs['idle']:.2f}x, 16x1k "
                  f"{ours['16x1k'] / theirs['16x1k']:.2f}x; llmd peak / file {ours['peak'] / size_mib:.2f}x")


if __name__ == "__main__":
    main()
