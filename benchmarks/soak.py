"""A bounded soak test: one daemon under ~10 minutes of mixed, cancelled, killed, stopped and hostile
traffic; it must serve on, leak no KV block and keep its memory.

    .venv/bin/python benchmarks/soak.py                          # 60 s warm-up, then 600 s
    .venv/bin/python benchmarks/soak.py --duration 60 --warmup 20 --seed 3 --keep-daemon-log /tmp/soak.log

A benchmark script, not CI. It starts its own daemon (`llmd start --foreground`, the default model
unless --model, --max-num-seqs 32) in a temporary runtime dir with its own XDG state and config
dirs, and always stops it (and kills every client process it spawned) at the end. The actors, about
seven on 2 cores:

  mixed x2      threads, one Client each: text and chat streams with random prompts, max_tokens
                8-128 and sampling settings (logprobs, stop strings, seeds...), stream=False requests
                (some with prompt_logprobs), a few long prompts (300-1200 words, a pasted document),
                streams broken off after a few deltas, explicit cancel() mid-stream and right after
                `accepted`, tokenize/info calls
  async x1      an AsyncClient with two concurrent chat streams, some closed early (aclose)
  kill -9       a loop of separate client processes (this script with --victim) SIGKILLed before
                their request, mid-stream, or mid-way through a stream=False request
  SIGSTOP       a loop of streaming client processes stopped mid-stream for 5-20 s, then mostly
                resumed (they must then receive every token: ignore_eos, exact count) or killed
  hostile x1    prompts over the context (token ids, text, bytes, max_tokens: too_long), a prompt
                over 1M characters (bad_request), a 5 MiB prompt through Client (MessageTooLargeError
                locally; the Client lives on), a raw 5 MiB frame (the daemon drops that connection;
                also with a request of it in flight, which must be aborted), malformed params and
                messages (bad_request), cancel of an unknown id (unknown_request), unsigned garbage
                and badly signed frames, a replayed message (dropped), a stale ts, a bad version,
                a duplicate request id (bad_request)

Besides, a probe asks for health once a second (its round trips show how long the daemon leaves
a client without an answer under this load) and a monitor samples the daemon's RSS every 2 s.

Phases: the warm-up starts with a peak sweep (a burst of 10 concurrent 128-token requests, two
concurrent longest prompts, each hostile request once: the largest shapes the mix makes, so that
the allocator's high-water marks are reached), then runs the mix for --warmup s; the load stops,
the daemon goes idle, and RSS is taken: the baseline (RSS at a cold start is no fair one: pools
and caches grow in the first minutes). Then the main phase runs the mix for --duration s, the load
stops again, the daemon goes idle, and RSS is taken again. Both RSS figures are of an idle daemon
(no running or waiting request), the median of three samples. Idle means num_running ==
num_waiting == 0; the block leak is num_blocks_used then (waited for up to 10 s: killed clients
are noticed on the next send). A greedy canary completion at both idle points is shown
(informational). Run it on an otherwise quiet machine: another process running llmd's native
kernels on the same 2 cores slows the daemon tenfold and more.

Criteria (exit status 1 if any fails): no KV block leaked, RSS growth <= 5% over the main phase,
no DaemonNotRunningError anywhere (the daemon never stops answering), the daemon alive and
answering health at the end, no unexpected error or outcome (normal traffic gets no errors, each
hostile request its expected one, resumed readers all their tokens), no client hang, no traceback
in the daemon log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from queue import Empty, Queue
from typing import Any

RSS_LIMIT = 0.05
HANG_S = 300.0  # one actor operation longer than this is a hang (the longest real one: ~1 min on a quiet machine)

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find any new work part take get place made live "
         "where after back little only round man year came show every good me give our under name very "
         "river mountain garden kernel daemon socket cache token stream engine matrix vector löwe café naïve "
         "日本語 東京 😀 🚀 Ελλάδα Москва").split()
QUESTIONS = ("Write a short poem about {}.", "Explain {} to a child.", "List three facts about {}.",
             "What is the opposite of {}?", "Tell a story about a {} and a {}.", "Translate '{}' into French.")
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in plain English."
BAD_PARAMS = ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"bogus": 1},
              {"stop": ["x"] * 17}, {"logprobs": 21}, {"seed": -1}, {"presence_penalty": 3.0},
              {"max_tokens": "ten"}, {"temperature": float("nan")}, {"top_k": -1}, {"min_p": 2.0},
              {"repetition_penalty": 0.0}, {"stop_token_ids": [-5]}, {"ignore_eos": "yes"})


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_messages(rng: random.Random) -> list[dict[str, str]]:
    q = rng.choice(QUESTIONS)
    user = q.format(*(rng.choice(WORDS) for _ in range(q.count("{}")))) + " " + words(rng, 0, 30)
    msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.7 else []
    if rng.random() < 0.3:
        msgs += [{"role": "user", "content": words(rng, 2, 10)}, {"role": "assistant", "content": words(rng, 2, 20)}]
    return msgs + [{"role": "user", "content": user}]


def sampling(rng: random.Random, lo: int = 8, hi: int = 128) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
    if rng.random() < 0.5:
        p["ignore_eos"] = True
    if rng.random() < 0.2:
        p["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.2:
        p["top_k"] = rng.choice([5, 40])
    if rng.random() < 0.2:
        p["seed"] = rng.randrange(2**31)
    if rng.random() < 0.1:
        p["stop"] = ["\n\n", "."]
    if rng.random() < 0.1:
        p["logprobs"] = 2
    if rng.random() < 0.1:
        p["repetition_penalty"] = 1.1
    return p


# ---- bookkeeping -----------------------------------------------------------------------------------

class Tally:
    """Counters shared by the actors of one phase."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: Counter[str] = Counter()
        self.kinds: dict[str, Counter[str]] = defaultdict(Counter)  # kind -> outcome -> count
        self.codes: dict[str, Counter[str]] = defaultdict(Counter)  # code -> expected/unexpected -> count
        self.hostile: dict[str, Counter[str]] = defaultdict(Counter)  # op -> ok/unexpected
        self.victims: Counter[str] = Counter()
        self.notes: list[str] = []  # the first unexpected things, with details
        self.busy: dict[str, tuple[str, float]] = {}  # actor -> (operation, since)
        self.hangs: list[str] = []
        self.health_rtts: list[float] = []  # the health probe's round trips, s

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def kind(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.kinds[kind][outcome] += 1

    def code(self, code: str, expected: bool) -> None:
        with self.lock:
            self.codes[code]["expected" if expected else "unexpected"] += 1

    def note(self, text: str) -> None:
        with self.lock:
            self.c["unexpected"] += 1
            if len(self.notes) < 30:
                self.notes.append(f"[{time.strftime('%H:%M:%S')}] {text}")

    def start(self, actor: str, op: str) -> None:
        self.busy[actor] = (op, time.monotonic())

    def end(self, actor: str) -> None:
        self.busy.pop(actor, None)


def client_failure(tally: Tally, kind: str, e: BaseException) -> None:
    """An error in traffic that should have none."""
    from llmd.client import DaemonNotRunningError, MessageTooLargeError, ServerError

    if isinstance(e, ServerError):
        tally.code(e.code, False)
        tally.kind(kind, f"error {e.code}")
    elif isinstance(e, DaemonNotRunningError):
        tally.code("DaemonNotRunningError", False)
        tally.kind(kind, "DaemonNotRunningError")
    elif isinstance(e, MessageTooLargeError):
        tally.code("MessageTooLargeError (local)", False)
        tally.kind(kind, "MessageTooLargeError")
    else:
        tally.code(type(e).__name__, False)
        tally.kind(kind, type(e).__name__)
    tally.note(f"{kind}: {type(e).__name__}: {e}" + ("" if isinstance(e, (ServerError, DaemonNotRunningError))
                                                     else "\n" + traceback.format_exc(limit=6)))


def served(tally: Tally, kind: str, finish_reason: str | None, tokens: int) -> None:
    tally.kind(kind, f"done {finish_reason}")
    tally.add("served")
    tally.add(f"finish {finish_reason}")
    tally.add("tokens received", tokens)


# ---- actors: normal traffic ------------------------------------------------------------------------

def mixed_worker(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally) -> None:
    from llmd.client import Client

    with Client(socket_dir) as client:
        while not stop.is_set():
            kind = rng.choices(list(MIXED_KINDS), list(MIXED_KINDS.values()))[0]
            tally.start(name, kind)
            try:
                one_mixed(client, kind, rng, tally)
            except Exception as e:
                client_failure(tally, kind, e)
            finally:
                tally.end(name)


MIXED_KINDS = {"stream text": 27, "stream chat": 25, "stream=False": 16, "long prompt": 3, "break early": 12,
               "cancel mid-stream": 10, "cancel after accepted": 4, "tokenize/info": 3}
LONG_PROMPT_WORDS = (300, 1200)  # about 1.4 tokens a word: up to ~1700 tokens, a pasted document


def one_mixed(client: Any, kind: str, rng: random.Random, tally: Tally) -> None:
    params = sampling(rng)
    if kind == "long prompt":
        source = {"prompt": words(rng, *LONG_PROMPT_WORDS)}
        params["max_tokens"] = rng.randint(8, 32)
    elif kind == "stream text" or rng.random() < 0.4:
        source = {"prompt": words(rng, 3, 60)}
    else:
        source = {"messages": chat_messages(rng)}
    if kind == "tokenize/info":
        if rng.random() < 0.5:
            client.tokenize(**source)
        else:
            client.info()
        tally.kind(kind, "ok")
        return
    if kind in ("stream=False", "long prompt"):
        if kind == "stream=False" and rng.random() < 0.1:
            params["prompt_logprobs"] = 2
        result = client.generate(**source, stream=False, **params)
        served(tally, kind, result.finish_reason, len(result.token_ids))
        return
    stream = client.generate(**source, stream=True, **params)
    tally.add("streams started")
    if kind == "cancel after accepted":
        client.cancel(stream.request_id)
        tally.kind(kind, "cancelled")
        tally.add("cancels")
        return
    cut = rng.randint(1, 6) if kind in ("break early", "cancel mid-stream") else None
    tokens = 0
    it = iter(stream)
    try:
        for delta in it:
            tokens += len(delta.token_ids)
            if cut is not None and tokens >= cut:
                if kind == "cancel mid-stream":
                    client.cancel(stream.request_id)  # waits for the request's done (abort, or its own end)
                tally.kind(kind, "cancelled")
                tally.add("cancels")
                tally.add("tokens received", tokens)
                return
    finally:
        it.close()  # a stream left early cancels (again, for cancel mid-stream: answered unknown_request)
    served(tally, kind, stream.result.finish_reason if stream.result else None, tokens)


def async_worker(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally) -> None:
    try:
        asyncio.run(_async_main(name, socket_dir, rng, stop, tally))
    except Exception as e:
        client_failure(tally, "async chat", e)


async def _async_main(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally) -> None:
    from llmd.client import AsyncClient

    async with AsyncClient(socket_dir) as client:
        await asyncio.gather(*(_async_loop(f"{name}.{i}", client, random.Random(rng.random()), stop, tally)
                               for i in range(2)))


async def _async_loop(name: str, client: Any, rng: random.Random, stop: threading.Event, tally: Tally) -> None:
    from llmd.client import Result

    while not stop.is_set():
        kind = "async chat (closed early)" if rng.random() < 0.25 else "async chat"
        cut = rng.randint(1, 8) if kind != "async chat" else None
        tally.start(name, kind)
        agen = client.chat(chat_messages(rng), **sampling(rng))
        tokens = 0
        try:
            tally.add("streams started")
            async for item in agen:
                if isinstance(item, Result):
                    served(tally, kind, item.finish_reason, tokens)
                    break
                tokens += len(item.token_ids)
                if cut is not None and tokens >= cut:
                    tally.kind(kind, "cancelled")
                    tally.add("cancels")
                    tally.add("tokens received", tokens)
                    break
        except Exception as e:
            client_failure(tally, kind, e)
        finally:
            await agen.aclose()
            tally.end(name)


# ---- actors: client processes killed or stopped ----------------------------------------------------

def victim_main(socket_dir: str, spec_json: str) -> int:
    """Run as a separate process: one request, reporting on stdout line by line."""
    spec = json.loads(spec_json)
    print("ready", flush=True)
    try:
        from llmd.client import Client, DaemonNotRunningError, ServerError

        with Client(socket_dir) as client:
            if spec["stream"]:
                stream = client.generate(prompt=spec["prompt"], stream=True, **spec["params"])
                print("accepted", flush=True)
                n = 0
                for delta in stream:
                    n += len(delta.token_ids)
                    print("delta", n, flush=True)
                print("done", n, stream.result.finish_reason, flush=True)
            else:
                result = client.generate(prompt=spec["prompt"], stream=False, **spec["params"])
                print("done", len(result.token_ids), result.finish_reason, flush=True)
    except (ServerError, DaemonNotRunningError) as e:
        code = e.code if isinstance(e, ServerError) else "DaemonNotRunningError"
        print("error", code, str(e).replace("\n", " "), flush=True)
        return 3
    return 0


class Victim:
    """A client process of this script (--victim) and what it has reported so far."""

    def __init__(self, socket_dir: Path, spec: dict[str, Any], registry: set[subprocess.Popen]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--victim", str(socket_dir), json.dumps(spec)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL)
        registry.add(self.proc)
        self.registry = registry
        self.lines: Queue[str | None] = Queue()
        self.state = {"ready": False, "accepted": False, "tokens": 0, "done": None, "error": None}
        self.other: list[str] = []  # anything else it printed (a traceback)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.state):
            try:
                line = self.lines.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except Empty:
                if time.monotonic() >= deadline:
                    return False
                continue
            if line is None:
                return predicate(self.state)
            word, _, rest = line.partition(" ")
            if word == "ready":
                self.state["ready"] = True
            elif word == "accepted":
                self.state["accepted"] = True
            elif word == "delta":
                self.state["tokens"] = int(rest)
            elif word == "done":
                n, reason = rest.split(" ", 1)
                self.state["tokens"], self.state["done"] = int(n), reason
            elif word == "error":
                self.state["error"] = rest
            else:
                self.other.append(line)
        return True

    def finished(self, timeout: float) -> bool:
        return self.wait(lambda s: s["done"] is not None or s["error"] is not None, timeout)

    def signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def reap(self, timeout: float = 10.0) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            rc = self.proc.wait(10)
        self.registry.discard(self.proc)
        return rc


def victim_failure(tally: Tally, what: str, v: Victim) -> None:
    err = v.state["error"] or ""
    if err.startswith("DaemonNotRunningError"):
        tally.code("DaemonNotRunningError", False)
    elif err:
        tally.code(err.split(" ", 1)[0], False)
    tally.note(f"{what}: state {v.state}, rc {v.proc.returncode}; other output: {' | '.join(v.other[-8:])}")


def kill9_worker(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally,
                 registry: set[subprocess.Popen]) -> None:
    while not stop.is_set():
        stream = rng.random() < 0.75
        spec = {"stream": stream, "prompt": words(rng, 5, 200),
                "params": {**sampling(rng, 64, 400), "ignore_eos": True}}
        when = rng.choices(["at start", "mid-request"], [1, 9])[0]
        tally.start(name, f"kill -9 ({'stream' if stream else 'stream=False'}, {when})")
        v = Victim(socket_dir, spec, registry)
        try:
            if not v.wait(lambda s: s["ready"], 30):
                victim_failure(tally, "kill -9 victim never started", v)
                continue
            if when == "at start":
                time.sleep(rng.uniform(0, 0.3))
            elif stream:
                k = rng.randint(1, 40)
                v.wait(lambda s: s["tokens"] >= k or s["done"] or s["error"] or stop.is_set(), 60)
            else:
                time.sleep(rng.uniform(0.2, 3.0))
            v.wait(lambda s: False, 0)  # take what it printed so far
            before = v.state["done"] is not None or v.state["error"] is not None
            v.signal(signal.SIGKILL)
            rc = v.reap()
            if v.state["error"] is not None:
                victim_failure(tally, "kill -9 victim failed before its kill", v)
                outcome = "failed before the kill"
            elif before:
                outcome = "finished before the kill"
                tally.add("served")
                tally.add(f"finish {v.state['done']}")
            elif rc != -signal.SIGKILL:
                outcome = f"exited {rc}"
            elif not v.state["accepted"] and stream:
                outcome = "killed before accepted"
            else:
                outcome = "killed mid-stream" if stream else "killed mid stream=False"
            tally.victims[f"kill -9: {outcome}"] += 1
            tally.add("tokens received", v.state["tokens"])
        finally:
            if v.proc.poll() is None:
                v.signal(signal.SIGKILL)
                v.reap()
            tally.end(name)
        time.sleep(rng.uniform(0.1, 1.0))


def sigstop_worker(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally,
                   registry: set[subprocess.Popen]) -> None:
    while not stop.is_set():
        max_tokens = rng.randint(150, 400)
        params = {**sampling(rng), "max_tokens": max_tokens, "ignore_eos": True}
        params.pop("stop", None)  # it must get exactly max_tokens tokens
        spec = {"stream": True, "prompt": words(rng, 5, 100), "params": params}
        hold = rng.uniform(5, 20)
        resume = rng.random() < 0.75
        tally.start(name, f"SIGSTOP {hold:.0f}s then {'SIGCONT' if resume else 'SIGKILL'}")
        v = Victim(socket_dir, spec, registry)
        try:
            k = rng.randint(1, 30)
            if not v.wait(lambda s: s["tokens"] >= k or s["done"] or s["error"], 60):
                victim_failure(tally, "SIGSTOP victim never streamed", v)
                continue
            if v.state["error"]:
                victim_failure(tally, "SIGSTOP victim failed before its stop", v)
                continue
            if v.state["done"]:
                tally.victims["SIGSTOP: finished before the stop"] += 1
                continue
            v.signal(signal.SIGSTOP)
            stopped_at = v.state["tokens"]
            stop.wait(hold)  # cut short when the phase ends
            if not resume:
                v.signal(signal.SIGKILL)
                v.reap()
                tally.victims["SIGSTOP: killed while stopped"] += 1
                continue
            v.signal(signal.SIGCONT)
            # a hang is no progress for a minute (a slow daemon still streams), or ten minutes in all
            resumed_at, progress = time.monotonic(), -1
            while not v.finished(60) and v.state["tokens"] > progress and time.monotonic() - resumed_at < 600:
                progress = v.state["tokens"]
            if v.state["done"] is None and v.state["error"] is None:
                tally.hangs.append(f"a SIGCONTed reader stalled: {v.state} after {time.monotonic() - resumed_at:.0f}s")
                victim_failure(tally, "resumed reader stalled", v)
                continue
            v.reap()
            if v.state["done"] == "length" and v.state["tokens"] == max_tokens and v.proc.returncode == 0:
                tally.victims["SIGSTOP: resumed, got every token"] += 1
                tally.add("served")
                tally.add("finish length")
                tally.add("tokens received", v.state["tokens"])
                tally.add("SIGSTOP tokens merged", v.state["tokens"] - stopped_at)
            else:
                tally.victims["SIGSTOP: resumed, FAILED"] += 1
                victim_failure(tally, f"resumed reader (max_tokens {max_tokens}, stopped at {stopped_at})", v)
        finally:
            if v.proc.poll() is None:
                v.signal(signal.SIGKILL)
                v.signal(signal.SIGCONT)
                v.reap()
            tally.end(name)
        time.sleep(rng.uniform(0.5, 2.0))


# ---- actors: hostile requests ----------------------------------------------------------------------

REPLY_TIMEOUT_S = 30.0  # replies wait for the engine step in progress (and, today, the next one)


class RawPeer:
    """A bare DEALER speaking the wire protocol by hand (docs/protocol.md)."""

    def __init__(self, connection: dict[str, Any]) -> None:
        import zmq

        self.key = bytes.fromhex(connection["key"])
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(connection["requests"])

    def frames(self, msg_type: str, content: Any, ts: float | None = None, v: int = 1) -> list[bytes]:
        import msgpack

        from llmd.protocol import PROTOCOL, new_msg_id, sign

        h = msgpack.packb({"v": v, "id": new_msg_id(), "type": msg_type, "ts": time.time() if ts is None else ts})
        c = content if isinstance(content, bytes) else msgpack.packb(content)
        return [PROTOCOL, sign(self.key, h, c), h, c]

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float) -> tuple[str, dict[str, Any]] | None:
        """The next reply that is not a keepalive, or None after ``timeout`` s of none."""
        from llmd.protocol import REPLY_TYPES, decode

        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            msg = decode(self.key, self.sock.recv_multipart(), REPLY_TYPES)
            if msg.type != "keepalive":
                return msg.type, msg.content
        return None

    def close(self) -> None:
        self.sock.close(0)


def hostile_worker(name: str, socket_dir: Path, rng: random.Random, stop: threading.Event, tally: Tally,
                   info: dict[str, Any]) -> None:
    from llmd.client import Client

    ctx = {"connection": None, "info": info, "rng": rng, "tally": tally}
    with Client(socket_dir) as client:
        ctx["connection"] = client.connection
        while not stop.is_set():
            op = rng.choice(HOSTILE_OPS)
            tally.start(name, op.__name__)
            try:
                hostile_op(op, client, ctx, tally)
            finally:
                tally.end(name)
            stop.wait(rng.uniform(0.3, 1.5))


def hostile_op(op, client: Any, ctx: dict[str, Any], tally: Tally) -> None:
    try:
        expected, got = op(client, ctx)
    except Exception as e:
        expected, got = "?", f"{type(e).__name__}: {e}"
        if "DaemonNotRunningError" in got:
            tally.code("DaemonNotRunningError", False)
    ok = got == expected
    tally.hostile[op.__name__]["as expected" if ok else "unexpected"] += 1
    if not ok:
        tally.note(f"hostile {op.__name__}: expected {expected}, got {got}")


def _outcome(fn) -> str:
    from llmd.client import DaemonNotRunningError, MessageTooLargeError, ServerError

    try:
        fn()
        return "ok"
    except ServerError as e:
        return e.code
    except MessageTooLargeError:
        return "MessageTooLargeError"
    except DaemonNotRunningError as e:
        return f"DaemonNotRunningError: {e}"


def _coded(tally: Tally, expected: str, got: str, detail: str = "") -> tuple[str, str]:
    """Count an error code (expected or not); returns (expected, got), ``detail`` added on a mismatch."""
    if got == expected and got != "ok":
        tally.code(got if got != "MessageTooLargeError" else "MessageTooLargeError (local)", True)
    elif got.startswith("DaemonNotRunningError"):
        tally.code("DaemonNotRunningError", False)
    elif got != "ok" and " " not in got:
        tally.code(got, False)
    return expected, got if got == expected or not detail else f"{got} {detail}"


def too_long_token_ids(client, ctx):
    n = ctx["info"]["max_model_len"] + ctx["rng"].randint(1, 500)
    ids = [ctx["rng"].randrange(100, 20000) for _ in range(n)]
    got = _outcome(lambda: client.generate(token_ids=ids, stream=False, max_tokens=4))
    return _coded(ctx["tally"], "too_long", got)


def too_long_max_tokens(client, ctx):
    m = ctx["info"]["max_model_len"] + ctx["rng"].randint(0, 10000)
    return _coded(ctx["tally"], "too_long", _outcome(lambda: client.generate(prompt="Hello there", max_tokens=m)))


def too_long_text(client, ctx):
    # under the byte bound, so it is tokenised (off the loop) and then refused
    text = words(ctx["rng"], int(ctx["info"]["max_model_len"] * 1.2), int(ctx["info"]["max_model_len"] * 1.5))
    return _coded(ctx["tally"], "too_long", _outcome(lambda: client.generate(prompt=text, stream=False, max_tokens=4)))


def too_long_chat_bytes(client, ctx):
    # near the 1M-character cap: refused by its size alone, before tokenising
    text = "lorem ipsum " * 80_000
    return _coded(ctx["tally"], "too_long",
                  _outcome(lambda: client.chat([{"role": "user", "content": text}], stream=False, max_tokens=4)))


def prompt_over_1m_chars(client, ctx):
    return _coded(ctx["tally"], "bad_request", _outcome(lambda: client.generate(prompt="ab" * 550_000, max_tokens=4)))


def message_too_large(client, ctx):
    got = _outcome(lambda: client.generate(prompt="x" * (5 * 2**20), max_tokens=4))
    if got == "MessageTooLargeError":  # refused locally: the same Client must still work
        alive = _outcome(lambda: client.health())
        if alive != "ok":
            got = f"MessageTooLargeError, then health: {alive}"
    return _coded(ctx["tally"], "MessageTooLargeError", got)


def bad_params(client, ctx):
    params = dict(ctx["rng"].choice(BAD_PARAMS))
    got = _outcome(lambda: client.generate(prompt="Hi", stream=False, **params))
    return _coded(ctx["tally"], "bad_request", got, f"for params {params}")


def bad_prompt(client, ctx):
    kwargs = ctx["rng"].choice([{"messages": [{"role": "wizard", "content": "x"}]}, {"messages": []},
                                {"token_ids": []}, {"token_ids": [10**9]}, {"token_ids": [-1]},
                                {"messages": [{"role": "user", "content": "x", "name": "eve"}]}])
    got = _outcome(lambda: client.generate(stream=False, max_tokens=4, **kwargs))
    return _coded(ctx["tally"], "bad_request", got, f"for {kwargs}")


def cancel_unknown(client, ctx):
    return _coded(ctx["tally"], "unknown_request", _outcome(lambda: client.cancel(f"nope-{ctx['rng'].random()}")))


def garbage_frames(client, ctx):
    """Unsigned or badly signed messages: dropped without a reply, each counted once."""
    rng = ctx["rng"]
    peer = RawPeer(ctx["connection"])
    try:
        n = rng.randint(1, 5)
        for _ in range(n):
            shape = rng.choice(["random", "bad signature", "too many frames", "one frame"])
            if shape == "random":
                frames = [os.urandom(rng.randint(0, 300)) for _ in range(rng.randint(2, 7))]
            elif shape == "bad signature":
                frames = peer.frames("ping", {})
                frames[1] = os.urandom(32).hex().encode()
            elif shape == "too many frames":
                frames = [os.urandom(10) for _ in range(rng.randint(9, 40))]
            else:
                frames = [os.urandom(rng.randint(1, 100))]
            peer.send(frames)
        ctx["tally"].add("garbage messages sent", n)
        # a signed ping after the garbage: its pong must be the first reply (one connection keeps order)
        peer.send(peer.frames("ping", {}))
        reply = peer.recv(REPLY_TIMEOUT_S)
        return "dropped", "dropped" if reply is not None and reply[0] == "pong" else f"first reply {reply}"
    finally:
        peer.close()


def replayed_message(client, ctx):
    peer = RawPeer(ctx["connection"])
    try:
        frames = peer.frames("stats", {})
        peer.send(frames)
        first = peer.recv(REPLY_TIMEOUT_S)
        peer.send(frames)
        peer.send(peer.frames("ping", {}))  # answered first if the replay is dropped
        second = peer.recv(REPLY_TIMEOUT_S)
        ctx["tally"].add("garbage messages sent")  # a replay is dropped and counted too
        ok = first and first[0] == "stats" and second and second[0] == "pong"
        return "answered, then dropped", "answered, then dropped" if ok else f"{first and first[0]}, then {second}"
    finally:
        peer.close()


def stale_or_bad_header(client, ctx):
    peer = RawPeer(ctx["connection"])
    try:
        variant = ctx["rng"].choice(["stale ts", "future ts", "version 2", "content not a map", "unknown type"])
        if variant == "stale ts":
            frames = peer.frames("ping", {}, ts=time.time() - 3600)
        elif variant == "future ts":
            frames = peer.frames("ping", {}, ts=time.time() + 3600)
        elif variant == "version 2":
            frames = peer.frames("ping", {}, v=2)
        elif variant == "content not a map":
            frames = peer.frames("ping", b"\x93\x01\x02\x03")
        else:
            frames = peer.frames("format_disk", {})
        peer.send(frames)
        reply = peer.recv(REPLY_TIMEOUT_S)
        got = str(reply[1].get("code")) if reply and reply[0] == "error" else f"reply {reply}"
        return _coded(ctx["tally"], "bad_request", got, f"for {variant}")
    finally:
        peer.close()


def duplicate_request_id(client, ctx):
    peer = RawPeer(ctx["connection"])
    try:
        content = {"request_id": "dup", "prompt": words(ctx["rng"], 3, 10),
                   "params": {"max_tokens": 200, "ignore_eos": True}}
        peer.send(peer.frames("generate", content))
        peer.send(peer.frames("generate", content))
        codes = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ("accepted" in codes and "bad_request" in codes):
            reply = peer.recv(max(0.1, deadline - time.monotonic()))
            if reply is None:
                break
            codes.append(reply[1].get("code") if reply[0] == "error" else reply[0])
        peer.send(peer.frames("cancel", {"request_id": "dup"}))
        while (reply := peer.recv(10)) is not None and reply[0] != "done":
            pass
        ok = "accepted" in codes and "bad_request" in codes and reply is not None
        if "bad_request" in codes:
            ctx["tally"].code("bad_request", True)
        return "accepted + bad_request, cancelled", ("accepted + bad_request, cancelled" if ok
                                                     else f"{codes}, cancel answered {reply}")
    finally:
        peer.close()


def oversized_frame(client, ctx):
    """A 5 MiB frame: the daemon closes that connection. Half the time the peer has a stream in
    flight first, which the daemon must abort (its blocks are checked at the end)."""
    peer = RawPeer(ctx["connection"])
    try:
        with_stream = ctx["rng"].random() < 0.5
        if with_stream:
            peer.send(peer.frames("generate", {"request_id": "big", "prompt": words(ctx["rng"], 10, 50),
                                               "params": {"max_tokens": 2000, "ignore_eos": True}}))
            first = peer.recv(30)
            second = peer.recv(30)
            if not (first and first[0] == "accepted" and second and second[0] == "delta"):
                return "connection dropped", f"the stream did not start: {first}, {second}"
        peer.send(peer.frames("generate", {"request_id": "huge", "prompt": "y" * (5 * 2**20),
                                           "params": {"max_tokens": 4}}))
        ctx["tally"].add("oversized frames sent")
        # deltas already on their way may still arrive; then nothing (not even an error); a signed
        # ping after the frame would be on the closed connection and is lost with it
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            reply = peer.recv(0.5)
            if reply is not None and reply[0] != "delta":
                return "connection dropped", f"a reply after the oversized frame: {reply[0]} {reply[1]}"
        return "connection dropped", "connection dropped"
    finally:
        peer.close()


HOSTILE_OPS = [too_long_token_ids, too_long_max_tokens, too_long_text, too_long_chat_bytes, prompt_over_1m_chars,
               message_too_large, bad_params, bad_params, bad_prompt, cancel_unknown, garbage_frames,
               replayed_message, stale_or_bad_header, duplicate_request_id, oversized_frame]


# ---- the daemon ------------------------------------------------------------------------------------

class Daemon:
    def __init__(self, tmp: Path, model: str | None, max_num_seqs: int) -> None:
        from llmd.config import OPTIONS

        self.socket_dir = tmp / "run"
        self.log_path = tmp / "daemon.log"
        env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"), XDG_CONFIG_HOME=str(tmp / "config"),
                   LLMD_RUNTIME_DIR=str(tmp / "default-run"), PYTHONUNBUFFERED="1")
        env.pop("LLMD_CONFIG", None)
        for option in OPTIONS.values():
            env.pop(option.env, None)
        self.env = env
        argv = [sys.executable, "-m", "llmd", "start", "--foreground", "--socket-dir", str(self.socket_dir),
                "--max-num-seqs", str(max_num_seqs)] + (["--model", model] if model else [])
        with open(self.log_path, "wb") as log_out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 600) -> dict[str, Any]:
        from llmd.client import Client, DaemonNotRunningError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with Client(self.socket_dir) as client:
                    if client.connection.get("pid") == self.pid:
                        client.health(timeout=2.0)
                        return client.info()
            except (DaemonNotRunningError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the daemon did not come up in {timeout:.0f}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.pid).memory_info().rss

    def resources(self) -> dict[str, int]:
        import psutil

        p = psutil.Process(self.pid)
        return {"fds": p.num_fds(), "threads": p.num_threads()}

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def tracebacks(self) -> list[str]:
        """The tracebacks and ERROR/CRITICAL lines in the log, each with what follows it."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback") or " ERROR " in line or " CRITICAL " in line or "Fatal Python" in line:
                if not out or i > out[-1][0] + 25:
                    out.append((i, "\n".join(lines[i:i + 25])))
        return [text for _, text in out]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            subprocess.run([sys.executable, "-m", "llmd", "stop", "--socket-dir", str(self.socket_dir)],
                           capture_output=True, text=True, timeout=120, env=self.env)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def stats(daemon: Daemon) -> dict[str, Any]:
    from llmd.client import Client

    with Client(daemon.socket_dir) as client:
        return client.stats()


def wait_idle(daemon: Daemon, timeout: float = 120, blocks_timeout: float = 10) -> dict[str, Any]:
    """Wait until nothing runs or waits, then up to ``blocks_timeout`` s for the blocks to be free."""
    start = time.monotonic()
    s = stats(daemon)
    while (s["num_running"] or s["num_waiting"]) and time.monotonic() - start < timeout:
        time.sleep(0.2)
        s = stats(daemon)
    idle_at = time.monotonic()
    while s["num_blocks_used"] and time.monotonic() - idle_at < blocks_timeout:
        time.sleep(0.2)
        s = stats(daemon)
    return {**s, "idle": not (s["num_running"] or s["num_waiting"]), "idle_after_s": idle_at - start,
            "blocks_after_s": time.monotonic() - idle_at}


def idle_rss(daemon: Daemon) -> int:
    time.sleep(1.0)
    samples = []
    for _ in range(3):
        samples.append(daemon.rss())
        time.sleep(0.5)
    return int(statistics.median(samples))


def canary(daemon: Daemon) -> str:
    """A fixed greedy completion, at idle (batch of one)."""
    from llmd.client import Client

    with Client(daemon.socket_dir) as client:
        return client.generate(prompt="The three primary colours are", stream=False, max_tokens=24,
                               temperature=0, ignore_eos=True).text


# ---- phases ----------------------------------------------------------------------------------------

def monitor(daemon: Daemon, stop: threading.Event, tally: Tally, trace: list[tuple[float, int]],
            died: threading.Event) -> None:
    t0 = time.monotonic()
    while not stop.wait(2.0):
        if not daemon.alive():
            died.set()
            tally.note(f"the daemon exited with {daemon.proc.returncode}")
            return
        try:
            trace.append((time.monotonic() - t0, daemon.rss()))
        except Exception:
            pass
        now = time.monotonic()
        for actor, (op, since) in list(tally.busy.items()):
            if now - since > HANG_S and not any(h.startswith(f"{actor}:") for h in tally.hangs):
                tally.hangs.append(f"{actor}: {op} running for {now - since:.0f}s")


def health_probe(daemon: Daemon, stop: threading.Event, tally: Tally) -> None:
    """Asks for health once a second: how long the daemon takes to answer while it is loaded."""
    from llmd.client import SILENCE_TIMEOUT_S, Client, DaemonNotRunningError

    with Client(daemon.socket_dir) as client:
        while not stop.wait(1.0):
            t0 = time.monotonic()
            try:
                client.health(timeout=SILENCE_TIMEOUT_S)
                tally.health_rtts.append(time.monotonic() - t0)
            except DaemonNotRunningError as e:
                tally.health_rtts.append(time.monotonic() - t0)
                client_failure(tally, "health probe", e)


def peak_sweep(daemon: Daemon, info: dict[str, Any], rng: random.Random, tally: Tally) -> float:
    """The warm-up's start: the largest shapes the mix makes (a burst of streams beyond the mix's
    usual concurrency, concurrent long prompts of the longest kind) and every hostile request once, so
    that the allocator's high-water marks are in the RSS baseline."""
    from llmd.client import Client

    def stream(seed: float) -> None:
        r = random.Random(seed)
        with Client(daemon.socket_dir) as client:
            try:
                src = {"prompt": words(r, 60, 60)} if r.random() < 0.5 else {"messages": chat_messages(r)}
                result = client.generate(**src, stream=False, max_tokens=128, ignore_eos=True, logprobs=2)
                served(tally, "peak: burst of 10 streams", result.finish_reason, len(result.token_ids))
            except Exception as e:
                client_failure(tally, "peak: burst of 10 streams", e)

    def long_prompt(seed: float) -> None:
        r = random.Random(seed)
        with Client(daemon.socket_dir) as client:
            try:
                result = client.generate(prompt=words(r, LONG_PROMPT_WORDS[1], LONG_PROMPT_WORDS[1]), stream=False,
                                         max_tokens=32, ignore_eos=True)
                served(tally, "peak: 2 long prompts", result.finish_reason, len(result.token_ids))
            except Exception as e:
                client_failure(tally, "peak: 2 long prompts", e)

    t0 = time.monotonic()
    for fn, n in ((stream, 10), (long_prompt, 2)):
        threads = [threading.Thread(target=fn, args=(rng.random(),), daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
            if t.is_alive():
                tally.hangs.append(f"peak sweep: {fn.__name__} still running after {HANG_S:.0f}s")
    with Client(daemon.socket_dir) as client:
        ctx = {"connection": client.connection, "info": info, "rng": rng, "tally": tally}
        for op in dict.fromkeys(HOSTILE_OPS):
            hostile_op(op, client, ctx, tally)
    return time.monotonic() - t0


def run_phase(label: str, seconds: float, daemon: Daemon, info: dict[str, Any], seed: int,
              registry: set[subprocess.Popen], died: threading.Event, sweep: bool = False
              ) -> tuple[Tally, list, float]:
    tally = Tally()
    stop = threading.Event()
    trace: list[tuple[float, int]] = []
    sd = daemon.socket_dir

    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}-{label}-{name}")

    actors = [
        ("mixed-1", mixed_worker, (sd, rng("mixed-1"), stop, tally)),
        ("mixed-2", mixed_worker, (sd, rng("mixed-2"), stop, tally)),
        ("async", async_worker, (sd, rng("async"), stop, tally)),
        ("kill9", kill9_worker, (sd, rng("kill9"), stop, tally, registry)),
        ("sigstop", sigstop_worker, (sd, rng("sigstop"), stop, tally, registry)),
        ("hostile", hostile_worker, (sd, rng("hostile"), stop, tally, info)),
    ]
    threads = [threading.Thread(target=fn, args=(name, *a), name=name, daemon=True) for name, fn, a in actors]
    mon_stop = threading.Event()
    mon = threading.Thread(target=monitor, args=(daemon, mon_stop, tally, trace, died), daemon=True)
    probe = threading.Thread(target=health_probe, args=(daemon, mon_stop, tally), daemon=True)
    start = time.monotonic()
    mon.start()
    probe.start()
    if sweep:
        took = peak_sweep(daemon, info, rng("peak"), tally)
        print(f"  peak sweep (a burst of 10 streams, 2 long prompts, each hostile request once): {took:.0f}s",
              flush=True)
        start = time.monotonic()
    for t in threads:
        t.start()
    while time.monotonic() - start < seconds and not died.is_set():
        time.sleep(0.5)
    stop.set()
    deadline = time.monotonic() + HANG_S
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
        if t.is_alive():
            op = tally.busy.get(t.name, ("?", 0))[0]
            tally.hangs.append(f"{t.name}: still in {op!r} {HANG_S:.0f}s after the phase ended")
    wall = time.monotonic() - start
    mon_stop.set()
    mon.join(5)
    probe.join(20)
    return tally, trace, wall


# ---- report ----------------------------------------------------------------------------------------

def cpu_line() -> str:
    flags = subprocess.run("grep -o 'avx512[a-z_0-9]*\\|avx2' /proc/cpuinfo | sort -u", shell=True,
                           capture_output=True, text=True).stdout.split()
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    try:
        from llmd.kernels import cpu_profile

        profile = cpu_profile.describe()
    except Exception:
        profile = "?"
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(flags) or '-'}; llmd profile {profile}"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_tally(t: Tally, title: str) -> None:
    print(f"\n-- {title}: requests by kind --")
    print(f"{'kind':<28}{'outcomes'}")
    for kind in sorted(t.kinds):
        print(f"{kind:<28}" + ", ".join(f"{o} {n}" for o, n in sorted(t.kinds[kind].items())))
    if t.victims:
        print(f"\n-- {title}: client processes --")
        for k, n in sorted(t.victims.items()):
            print(f"  {k:<44}{n:>6}")
    if t.hostile:
        print(f"\n-- {title}: hostile requests --")
        print(f"  {'op':<24}{'as expected':>12}{'unexpected':>12}")
        for op, c in sorted(t.hostile.items()):
            print(f"  {op:<24}{c['as expected']:>12}{c['unexpected']:>12}")
    print(f"\n-- {title}: errors by code --")
    print(f"  {'code':<32}{'expected':>10}{'unexpected':>12}")
    for code, c in sorted(t.codes.items()):
        print(f"  {code:<32}{c['expected']:>10}{c['unexpected']:>12}")
    if not t.codes:
        print("  (none)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of the main phase (default 600)")
    parser.add_argument("--warmup", type=float, default=60,
                        help="seconds of the same mix before the RSS baseline (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="the model (default: the daemon's default)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--keep-daemon-log", type=Path, default=None, help="copy the daemon's log here at the end")
    parser.add_argument("--victim", nargs=2, metavar=("SOCKET_DIR", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.victim:
        return victim_main(*args.victim)

    print(cpu_line(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="llmd-soak-"))
    registry: set[subprocess.Popen] = set()
    daemon: Daemon | None = None
    died = threading.Event()
    criteria: list[tuple[bool, str]] = []
    try:
        daemon = Daemon(tmp, args.model, args.max_num_seqs)
        t0 = time.monotonic()
        info = daemon.wait_ready()
        print(f"daemon: pid {info['pid']}, {info['model']} on {info['device']}, {info['dtype']}, quantisation "
              f"{info['quantization']}, attention {info.get('attention')}, KV {info['num_blocks']} blocks x "
              f"{info['block_size']}, max_model_len {info['max_model_len']}, --max-num-seqs {args.max_num_seqs}; "
              f"ready in {time.monotonic() - t0:.1f}s", flush=True)
        rss_cold = daemon.rss()
        print(f"phase warm-up: {args.warmup:.0f}s of the mix (RSS at start, cold: {mib(rss_cold)})", flush=True)
        warm, warm_trace, warm_wall = run_phase("warmup", args.warmup, daemon, info, args.seed, registry, died,
                                                sweep=True)
        idle0 = wait_idle(daemon)
        rss0 = idle_rss(daemon)
        res0 = daemon.resources()
        canary0 = canary(daemon)
        s0 = stats(daemon)
        print(f"  warm-up: {warm.c['served']} served in {warm_wall:.0f}s, {warm.c['unexpected']} unexpected; "
              f"idle after {idle0['idle_after_s']:.1f}s, blocks used {idle0['num_blocks_used']}; "
              f"RSS baseline (idle) {mib(rss0)}", flush=True)

        print(f"phase main: {args.duration:.0f}s of the mix", flush=True)
        main_t, trace, wall = run_phase("main", args.duration, daemon, info, args.seed, registry, died)
        idle1 = wait_idle(daemon) if daemon.alive() else {}
        rss1 = idle_rss(daemon) if daemon.alive() else 0
        res1 = daemon.resources() if daemon.alive() else {}
        canary1 = canary(daemon) if daemon.alive() else "(daemon gone)"
        s1 = stats(daemon) if daemon.alive() else {}

        health = "?"
        try:
            from llmd.client import Client

            with Client(daemon.socket_dir) as client:
                health = client.health().get("status", "?")
        except Exception as e:
            health = f"{type(e).__name__}: {e}"

        print(f"\n== soak: main phase {wall:.0f}s (after a {warm_wall:.0f}s warm-up), seed {args.seed} ==")
        print(f"requests served (done): {main_t.c['served']} "
              f"(finish: " + ", ".join(f"{k.split(' ', 1)[1]} {n}" for k, n in sorted(main_t.c.items())
                                       if k.startswith("finish ")) + ")")
        print(f"streams started {main_t.c['streams started']}, cancelled/broken off {main_t.c['cancels']}, "
              f"tokens received by clients {main_t.c['tokens received']}")
        if s1:
            gen = s1["num_generated_tokens_total"] - s0["num_generated_tokens_total"]
            prompt = s1["num_prompt_tokens_total"] - s0["num_prompt_tokens_total"]
            print(f"daemon: {gen} tokens generated ({gen / wall:.1f}/s), {prompt} prompt tokens, "
                  f"{s1['num_preemptions'] - s0['num_preemptions']} preemptions, "
                  f"{s1['num_step_failures'] - s0['num_step_failures']} step failures, prefix-cache hit rate "
                  f"{s1['prefix_cache_hit_rate']:.2f}")
            print(f"dropped messages: +{s1['num_dropped_messages'] - s0['num_dropped_messages']} "
                  f"(garbage and replays sent: {main_t.c['garbage messages sent']}); oversized frames sent: "
                  f"{main_t.c['oversized frames sent']}")
        print_tally(main_t, "main phase")
        if main_t.notes or warm.notes:
            print("\n-- unexpected --")
            for n in warm.notes:
                print("  (warm-up) " + n)
            for n in main_t.notes:
                print("  " + n)

        print("\n-- memory and resources --")
        print(f"RSS: cold start {mib(rss_cold)}; after warm-up, idle {mib(rss0)}; end, idle {mib(rss1)}; "
              f"growth {100 * (rss1 - rss0) / rss0:+.2f}% (limit {100 * RSS_LIMIT:.0f}%)")
        if trace:
            peak = max(r for _, r in trace)
            marks = [trace[min(len(trace) - 1, int(q * (len(trace) - 1)))] for q in (0, 0.25, 0.5, 0.75, 1)]
            print("RSS under load: " + ", ".join(f"{t:.0f}s {mib(r)}" for t, r in marks) + f"; peak {mib(peak)}")
        print(f"fds {res0.get('fds')} -> {res1.get('fds')}, threads {res0.get('threads')} -> {res1.get('threads')}")
        rtts = sorted(main_t.health_rtts)
        if rtts:
            print(f"health round trip under load ({len(rtts)} probes): p50 {pct(rtts, 0.5):.2f}s, p99 "
                  f"{pct(rtts, 0.99):.2f}s, max {rtts[-1]:.2f}s; over 5 s (Client.health's default timeout): "
                  f"{sum(r > 5 for r in rtts)}")
        if idle1:
            print(f"idle after {idle1['idle_after_s']:.1f}s; KV blocks used then {idle1['num_blocks_used']} "
                  f"(after {idle1['blocks_after_s']:.1f}s more), cached-free {idle1['num_blocks_cached_free']}, "
                  f"clients with requests {idle1['num_clients']}")
        print(f"greedy canary {'unchanged' if canary0 == canary1 else 'CHANGED'}: {canary0!r}"
              + ("" if canary0 == canary1 else f" -> {canary1!r}"))
        tracebacks = daemon.tracebacks()
        if tracebacks:
            print(f"\n-- daemon log: {len(tracebacks)} traceback(s)/error(s) (first 3) --")
            for tb in tracebacks[:3]:
                print(tb)
                print("  ...")

        dnr = sum(t.codes["DaemonNotRunningError"]["unexpected"] for t in (warm, main_t))
        unexpected = warm.c["unexpected"] + main_t.c["unexpected"]
        hangs = warm.hangs + main_t.hangs
        for h in hangs:
            print(f"hang: {h}")
        leak = idle1.get("num_blocks_used", -1) if idle1 else -1
        growth = (rss1 - rss0) / rss0 if rss1 else float("inf")
        criteria = [
            (leak == 0 and idle1.get("idle", False),
             f"block leak == 0 (num_blocks_used {leak} when idle; warm-up {idle0['num_blocks_used']})"),
            (growth <= RSS_LIMIT, f"RSS growth <= {100 * RSS_LIMIT:.0f}% ({mib(rss0)} -> {mib(rss1)}, "
                                  f"{100 * growth:+.2f}%)"),
            (dnr == 0, f"zero DaemonNotRunningError ({dnr})"),
            (daemon.alive() and health == "ok" and not died.is_set(), f"daemon alive and answering health ({health})"),
            (unexpected == 0, f"no unexpected errors or outcomes ({unexpected})"),
            (not hangs, f"no client hang ({len(hangs)})"),
            (not tracebacks, f"no traceback or error in the daemon log ({len(tracebacks)})"),
        ]
    except Exception:
        traceback.print_exc()
        criteria.append((False, "the soak ran to the end"))
        if daemon is not None:
            print("daemon log tail:\n" + daemon.log_tail())
    finally:
        for proc in list(registry):
            try:
                proc.kill()
                proc.send_signal(signal.SIGCONT)
                proc.wait(10)
            except Exception:
                pass
        if daemon is not None:
            rc = daemon.stop()
            print(f"\ndaemon stopped (exit code {rc})")
            if args.keep_daemon_log:
                shutil.copyfile(daemon.log_path, args.keep_daemon_log)
                print(f"daemon log kept at {args.keep_daemon_log}")
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    for ok, text in criteria:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if criteria and all(ok for ok, _ in criteria) else 1


if __name__ == "__main__":
    sys.exit(main())
