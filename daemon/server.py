"""The daemon: one engine behind a ZeroMQ ROUTER socket (requests) and a PUB socket (stats).

One thread does everything, in a loop: take every waiting message, run one engine step, route the
step's deltas to their clients, publish stats now and then. The one exception is reloading the model
after an idle unload (``idle_unload_s``): a worker thread loads it while the loop keeps answering,
and the requests that arrived meanwhile wait in the queue (their queue time includes the load).

Nothing a client sends can stall the loop: prompts are tokenised on a worker thread
(daemon/prompt_encoder.py) and a request joins the engine when its tokens are ready.

Sends never block: a client that reads slowly has its deltas queued (and merged) on our side while
everyone else streams on, and a client that has gone away is noticed on the next send
(``ROUTER_MANDATORY`` reports the peer unreachable), whereupon its requests are aborted and their
KV blocks freed.

Who may talk to us: on the ipc sockets, whoever can open the runtime dir (0700, ours); on ``tcp``,
only a peer holding the client's CURVE key from the connection file (the link is encrypted, and a
ZAP handler admits that one key). Every message is HMAC-signed and accepted once, while fresh
(llmd.protocol.ReplayGuard).
"""

from __future__ import annotations

import errno
import gc
import hmac
import itertools
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, fields
from typing import Any

import zmq
import zmq.auth.thread

from llmd import __version__
from llmd.daemon.engine.engine import LLMEngine
from llmd.daemon.engine.outputs import RequestDelta
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.sequence import MAX_PRIORITY, MIN_PRIORITY
from llmd.daemon.prompt_encoder import PromptEncoder
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.errors import LlmdError, PromptTooLongError, RequestError
from llmd.protocol import (
    MAX_FRAMES, MAX_MESSAGE_BYTES, REQUEST_TYPES, ErrorCode, ProtocolError, ReplayGuard,
    SignatureError, decode, encode, require_str,
)

log = logging.getLogger("llmd.server")

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
MAX_CONSECUTIVE_STEP_FAILURES = 3
KEEPALIVE_INTERVAL_S = 1.0
# Messages ZeroMQ may hold for one client before we keep (and merge) its deltas ourselves: small, so
# a reader that stops costs a bounded queue, not one message per token.
CLIENT_SNDHWM = 64
FRESH_ENCODING_WAIT_S = 0.02  # how long a loop turn waits for the prompts that arrived in it
# NOTE: test hook, read once at start: make engine step number N raise, to test fault handling.
_FAULT_STEP = int(os.environ.get("LLMD_FAULT_STEP", "0") or 0)


@dataclass(slots=True)
class ServerConfig:
    """Daemon limits. Raises ``ValueError`` on nonsense."""

    max_queue_len: int = 256
    stats_interval_s: float = 0.25
    drain_timeout_s: float = 10.0
    tcp: str | None = None  # "host:port": also serve on TCP (requests on port, stats on port + 1), CURVE-encrypted
    idle_unload_s: float = 0.0  # free the model after this long without requests; 0: never

    def __post_init__(self) -> None:
        if self.max_queue_len < 1:
            raise ValueError("max_queue_len must be at least 1")
        if not self.idle_unload_s >= 0:
            raise ValueError("idle_unload_s must be >= 0 (0 keeps the model loaded)")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


@dataclass(slots=True)
class _Live:
    """A request in flight, as the server sees it."""

    identity: bytes
    request_id: str
    parent: str
    stream: bool
    num_prompt_tokens: int
    public_id: str  # how the stats stream names it (request ids are private to their client)
    params: SamplingParams
    priority: int = 0
    encoding: Future[list[int]] | None = None  # set until the prompt's tokens are ready
    text: list[str] = field(default_factory=list)  # collected for stream=False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class Server:
    """Args:
        engine: the loaded engine.
        files: the runtime dir (key, endpoints).
        info: what ``info`` replies say about the model.
        config: limits.
        load_model: loads the model again the way it was loaded first; needed for
            ``config.idle_unload_s``.
    """

    def __init__(self, engine: LLMEngine, files: RuntimeFiles, info: dict[str, Any],
                 config: ServerConfig | None = None, load_model: Callable[[], Any] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.files = files
        self.key = files.key
        self.info = info
        self.config = config or ServerConfig()
        if self.config.idle_unload_s and load_model is None:
            raise ValueError("idle unload needs a way to load the model again (load_model)")
        self.load_model = load_model
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 10)  # stats are replaceable: drop, never queue
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoints = {"requests": files.requests_endpoint, "stats": files.stats_endpoint}
        self.curve_keys: dict[str, str] = {}  # for the connection file, with --tcp
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        try:
            self.router.bind(files.requests_endpoint)
            self.pub.bind(files.stats_endpoint)
            if self.config.tcp:
                self._bind_tcp(self.config.tcp)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise LlmdError(f"cannot listen ({e}); check --tcp HOST:PORT (port free?) and that --socket-dir "
                            "is a short path (ipc paths are limited to about 100 characters)") from None
        except LlmdError:
            self._close_sockets()
            raise
        self.encoder = PromptEncoder(self.tokenizer, engine.max_request_tokens)
        self.replays = ReplayGuard()
        # Woken through this pipe when an encoding finishes, so the loop can sleep in poll() meanwhile.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._encoding_replies: list[tuple[Future[list[int]], bytes, str]] = []  # `tokenize` requests
        self._fresh: list[Future[list[int]]] = []  # encodings started in this loop turn
        self.live: dict[str, _Live] = {}  # engine request id -> request
        self.outbox: dict[bytes, deque[tuple[str, dict, str]]] = {}
        # per client, per request id: its delta still in the outbox, which later deltas are merged into
        self._unsent_deltas: dict[bytes, dict[str, dict[str, Any]]] = {}
        self.last_sent: dict[bytes, float] = {}
        self.stopping = False
        self.drain_deadline: float | None = None
        self.started = time.time()
        self.num_dropped = 0  # unsigned, badly signed or malformed frames
        self.num_step_failures = 0
        self._consecutive_failures = 0
        self._last_stats = 0.0
        self._num_steps = 0
        self._public_ids = itertools.count(1)
        self._owners: dict[bytes, int] = {}  # client -> its number in the stats stream
        self._owner_numbers = itertools.count(1)
        self.last_active = time.monotonic()  # the last step or request, for the idle unload
        self.num_unloads = 0
        self._loading: threading.Thread | None = None
        self._loaded: list[Any] = []  # the loader thread's result: [model] or [exception]

    def _bind_tcp(self, tcp: str) -> None:
        """Serve on TCP too, CURVE-encrypted, admitting only the client key we publish in the
        connection file. Socket options apply to later binds only, so the ipc endpoints bound
        before stay plain (the runtime dir's permissions guard them)."""
        if not zmq.has("curve"):
            raise LlmdError("this pyzmq was built without CURVE, which --tcp needs; reinstall pyzmq from PyPI")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logging.getLogger("llmd.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("llmd", _OneClientKey(client_public))
        host, port = tcp.rsplit(":", 1)
        if ":" in host:  # IPv6
            host = host if host.startswith("[") else f"[{host}]"
            self.router.setsockopt(zmq.IPV6, 1)
            self.pub.setsockopt(zmq.IPV6, 1)
        for name, sock, p in (("tcp_requests", self.router, int(port)), ("tcp_stats", self.pub, int(port) + 1)):
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"llmd")
            sock.bind(f"tcp://{host}:{p}")
            self.endpoints[name] = f"tcp://{host}:{p}"
        self.curve_keys = {"curve_server_key": server_public.decode(), "curve_public_key": client_public.decode(),
                           "curve_secret_key": client_secret.decode()}

    def _close_sockets(self) -> None:
        self.router.close(0)
        self.pub.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    @property
    def connection_fields(self) -> dict[str, Any]:
        """What the connection file adds to the model's info: endpoints and, with TCP, CURVE keys."""
        return {**self.endpoints, **self.curve_keys}

    # ---- lifecycle -------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        if not self.stopping:
            log.info("stopping: finishing %d in-flight requests (up to %.0fs)", len(self.live),
                     self.config.drain_timeout_s)
        self.stopping = True
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        code = 0
        try:
            while True:
                # NOTE: replies stuck behind a full client pipe only need a retry now and then;
                # counting them as busy would spin the loop at 100% CPU.
                busy = self.engine.has_unfinished() and self.engine.is_loaded
                timeout = 0 if busy else (10 if self.outbox else 100)
                if self.stopping and not self.live:
                    break
                if self.stopping and time.monotonic() > (self.drain_deadline or 0):
                    self._cancel_all(ErrorCode.CANCELLED, "the daemon is shutting down")
                    break
                if poller.poll(timeout):
                    self._drain_incoming()
                self._collect_encoded()
                self._manage_model()
                # NOTE: answers (health, stats, accepted, errors) leave now, not after a step that
                # may take seconds on a CPU with a long context.
                self._flush_outbox()
                if self.engine.has_unfinished() and self.engine.is_loaded:
                    if not self._step():
                        code = 1
                        break
                self._flush_outbox()
                self._keepalive()
                self._publish_stats()
        finally:
            if self._loading is not None:
                self._loading.join()  # a daemon thread mid-load would die with the interpreter
            self._flush_outbox()
            self.encoder.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.router.close(2000)  # give the last replies (done, cancelled) time to leave
            self.pub.close(0)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()
        log.info("stopped")
        return code

    # ---- idle unload -----------------------------------------------------------------------------

    @property
    def model_state(self) -> str:
        """``loaded``, ``unloaded`` (idle) or ``loading`` (a request is waiting for the reload)."""
        if self.engine.is_loaded:
            return "loaded"
        return "loading" if self._loading is not None else "unloaded"

    def _manage_model(self) -> None:
        """Unload after ``idle_unload_s`` without work; start or finish a reload once work waits."""
        now = time.monotonic()
        if self.engine.has_unfinished() or self.live:
            self.last_active = now
        if self._loading is not None and not self._loading.is_alive():
            self._finish_reload()
        if self.engine.is_loaded:
            if self.config.idle_unload_s and not self.live and not self.engine.has_unfinished() \
                    and now - self.last_active >= self.config.idle_unload_s:
                self._unload()
        elif self.engine.has_unfinished() and self._loading is None:
            log.info("a request arrived: loading the model again")
            self._loaded = []
            self._loading = threading.Thread(target=self._reload_worker, name="llmd-reload", daemon=True)
            self._loading.start()

    def _reload_worker(self) -> None:
        start = time.monotonic()
        try:
            self._loaded.append(self.load_model())
            log.info("model loaded again in %.1fs", time.monotonic() - start)
        except BaseException as e:  # handed to the loop, which fails the waiting requests
            self._loaded.append(e)

    def _finish_reload(self) -> None:
        self._loading = None
        result = self._loaded.pop() if self._loaded else RuntimeError("the loader returned nothing")
        if isinstance(result, BaseException):
            log.error("reloading the model failed: %s: %s", type(result).__name__, result)
            self._cancel_all(ErrorCode.INTERNAL, f"reloading the model failed: {type(result).__name__}: {result}")
            return
        self.engine.load(result)

    def _unload(self) -> None:
        rss_before = _rss_bytes()
        self.engine.unload()
        gc.collect()
        _release_memory()
        self.num_unloads += 1
        freed = rss_before - _rss_bytes()
        log.info("idle for %.0fs: unloaded the model and KV cache (%s); the next request loads it again",
                 time.monotonic() - self.last_active,
                 f"{freed / 2**20:.0f} MiB returned" if freed > 0 else "memory kept by the allocator")

    # ---- incoming --------------------------------------------------------------------------------

    def _recv(self) -> list[bytes]:
        """One message's frames (raises ``zmq.Again`` if none waits). A message of more than
        MAX_FRAMES frames is read off frame by frame and comes back empty (dropped)."""
        frames = [self.router.recv(zmq.NOBLOCK)]
        too_many = False
        while self.router.getsockopt(zmq.RCVMORE):
            frame = self.router.recv()
            if len(frames) < MAX_FRAMES:
                frames.append(frame)
            else:
                too_many = True
        return [] if too_many else frames

    def _drain_incoming(self) -> None:
        for _ in range(1000):  # bounded, so a flood cannot starve the engine
            try:
                frames = self._recv()
            except zmq.Again:
                return
            if len(frames) < 2:
                self.num_dropped += 1
                continue
            identity, frames = frames[0], frames[1:]
            try:
                msg = decode(self.key, frames, REQUEST_TYPES)
                self.replays.check(msg, frames[1])
            except SignatureError:
                self.num_dropped += 1
                # NOTE: debug level: a flood of forged messages must not flood the log too.
                log.debug("dropped a message with a bad or missing signature")
                continue
            except ProtocolError as e:
                if e.msg_id is not None:
                    self._error(identity, e.msg_id, e.code, str(e), None)
                else:
                    self.num_dropped += 1
                    log.debug("dropped a malformed message: %s", e)
                continue
            rid = msg.content.get("request_id") if isinstance(msg.content.get("request_id"), str) else None
            try:
                self._handle(identity, msg)
            except ProtocolError as e:
                self._error(identity, msg.msg_id, e.code, str(e), rid)
            except Exception as e:  # a bug must cost one request, never the daemon
                log.exception("failed to handle a %s message", msg.type)
                self._error(identity, msg.msg_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", rid)

    def _handle(self, identity: bytes, msg: Any) -> None:
        c = msg.content
        if msg.type == "generate":
            self._generate(identity, msg)
        elif msg.type == "cancel":
            rid = require_str(c, "request_id")
            live = self.live.get(self._key(identity, rid))
            if live is None:
                raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"no request {rid!r} of yours is running")
            delta = self.engine.abort_request(self._key(identity, rid))
            self._finish(self._key(identity, rid), delta, reason="abort")
        elif msg.type == "stats":
            self._reply(identity, "stats", self._stats(), msg.msg_id)
        elif msg.type == "info":
            self._reply(identity, "info", self._info(), msg.msg_id)
        elif msg.type == "tokenize":
            future = self.encoder.submit(c)
            future.add_done_callback(self._wake)
            self._encoding_replies.append((future, identity, msg.msg_id))
        elif msg.type == "health":
            self._reply(identity, "health", {"status": "stopping" if self.stopping else "ok"}, msg.msg_id)
        elif msg.type == "ping":
            self._reply(identity, "pong", {}, msg.msg_id)
        elif msg.type == "shutdown":
            self._reply(identity, "shutdown", {"status": "stopping"}, msg.msg_id)
            self.request_stop()

    @staticmethod
    def _key(identity: bytes, request_id: str) -> str:
        # NOTE: requests are keyed by client identity too: nobody can reach another's request.
        return f"{identity.hex()}/{request_id}"

    def _generate(self, identity: bytes, msg: Any) -> None:
        """Check the request and start encoding its prompt; :meth:`_collect_encoded` queues it."""
        c = msg.content
        rid = require_str(c, "request_id")
        key = self._key(identity, rid)
        if key in self.live:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"request id {rid!r} is already in use")
        if self.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down; no new requests")
        queued = len(self.engine.scheduler.waiting) + sum(1 for live in self.live.values() if live.encoding)
        if queued >= self.config.max_queue_len:
            raise ProtocolError(ErrorCode.OVERLOADED, f"{queued} requests are queued; try again later")
        stream = c.get("stream", True)
        if not isinstance(stream, bool):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stream must be true or false")
        priority = c.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        raw_params = c.get("params", {})
        if not isinstance(raw_params, dict) or set(raw_params) - _PARAM_FIELDS:
            unknown = sorted(set(raw_params) - _PARAM_FIELDS) if isinstance(raw_params, dict) else raw_params
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"params must be a map of sampling parameters; "
                                                      f"unknown: {unknown!r}")
        try:
            params = SamplingParams(**raw_params)
        except (RequestError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
        live = _Live(identity, rid, msg.msg_id, stream, 0, f"r{next(self._public_ids)}", params, priority)
        live.encoding = self.encoder.submit(c)
        live.encoding.add_done_callback(self._wake)
        self._fresh.append(live.encoding)
        self.live[key] = live
        if identity not in self._owners:
            self._owners[identity] = next(self._owner_numbers)

    def _wake(self, _: Future[list[int]]) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (the loop will look anyway) or closed (shutting down)

    def _collect_encoded(self) -> None:
        """Queue the requests whose prompts are encoded; answer the `tokenize`s that are done."""
        if self._fresh:
            # NOTE: a usual prompt encodes in a millisecond: worth waiting that long for it, since
            # otherwise it misses the next step, which may take a second on a CPU.
            wait(self._fresh, timeout=FRESH_ENCODING_WAIT_S)
            self._fresh.clear()
        try:
            # NOTE: every finished encoding writes a byte after it is done, so no byte, nothing new.
            if not os.read(self._wake_r, 65536):
                return
        except BlockingIOError:
            return
        for key, live in list(self.live.items()):
            if live.encoding is None or not live.encoding.done():
                continue
            future, live.encoding = live.encoding, None
            try:
                ids = future.result()
                self.engine.add_request(key, ids, live.params, owner=live.identity, priority=live.priority)
            except ProtocolError as e:
                self._refuse(key, e.code, str(e))
                continue
            except PromptTooLongError as e:
                self._refuse(key, ErrorCode.TOO_LONG, str(e))
                continue
            except (RequestError, TypeError) as e:
                self._refuse(key, ErrorCode.BAD_REQUEST, str(e))
                continue
            except Exception as e:  # a bug must cost one request, never the daemon
                log.exception("failed to queue a request")
                self._refuse(key, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
                continue
            live.num_prompt_tokens = len(ids)
            self._reply(live.identity, "accepted", {"request_id": live.request_id, "prompt_tokens": len(ids),
                                                    "id": live.public_id}, live.parent)
        pending = []
        for future, identity, parent in self._encoding_replies:
            if not future.done():
                pending.append((future, identity, parent))
                continue
            try:
                self._reply(identity, "tokens", {"token_ids": future.result()}, parent)
            except ProtocolError as e:
                self._error(identity, parent, e.code, str(e), None)
            except Exception as e:
                log.exception("failed to tokenize")
                self._error(identity, parent, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", None)
        self._encoding_replies = pending

    def _refuse(self, key: str, code: str, message: str) -> None:
        live = self.live.pop(key)
        self._error(live.identity, live.parent, code, message, live.request_id)

    # ---- engine ----------------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step; False if the daemon must exit (repeated failures)."""
        try:
            self._num_steps += 1
            if self._num_steps == _FAULT_STEP:
                raise RuntimeError("injected fault (LLMD_FAULT_STEP)")
            deltas = self.engine.step()
        except Exception as e:
            self.num_step_failures += 1
            self._consecutive_failures += 1
            log.exception("model step failed")
            self._cancel_all(ErrorCode.INTERNAL, f"model step failed: {type(e).__name__}: {e}")
            return self._consecutive_failures < MAX_CONSECUTIVE_STEP_FAILURES
        self._consecutive_failures = 0
        for delta in deltas:
            self._route(delta)
        return True

    def _route(self, delta: RequestDelta) -> None:
        live = self.live.get(delta.request_id)
        if live is None:
            return
        if live.stream:
            if delta.text or delta.token_ids:
                content = {"request_id": live.request_id, "text": delta.text, "token_ids": delta.token_ids}
                if delta.logprobs:
                    content["logprobs"] = [[lp, [list(p) for p in top]] for lp, top in delta.logprobs]
                self._queue(live.identity, ("delta", content, live.parent))
        else:
            live.text.append(delta.text)
            live.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                live.logprobs.extend([lp, [list(p) for p in top]] for lp, top in delta.logprobs)
        if delta.finished:
            self._finish(delta.request_id, delta, delta.finish_reason)

    def _finish(self, key: str, delta: RequestDelta | None, reason: str | None) -> None:
        live = self.live.pop(key, None)
        if live is None:
            return
        m = delta.metrics if delta is not None else None
        content: dict[str, Any] = {"request_id": live.request_id, "finish_reason": reason}
        if not live.stream:
            content["text"] = "".join(live.text)
            content["token_ids"] = live.token_ids
            if live.params.logprobs is not None:
                content["logprobs"] = live.logprobs
        content["usage"] = {
            "prompt_tokens": live.num_prompt_tokens,
            "completion_tokens": m.num_generated_tokens if m else 0,
            "cached_tokens": m.num_cached_tokens if m else 0,
        }
        content["timings"] = {
            "queue_s": m.queue_time if m else None, "ttft_s": m.ttft if m else None,
            "e2e_s": m.e2e if m else None, "decode_tokens_per_s": m.decode_tokens_per_s if m else None,
        }
        if delta is not None and delta.prompt_logprobs is not None:
            content["prompt_logprobs"] = [None if lp is None else [lp[0], [list(p) for p in lp[1]]]
                                          for lp in delta.prompt_logprobs]
        self._queue(live.identity, ("done", content, live.parent))

    def _cancel_all(self, code: str, message: str) -> None:
        for key, live in list(self.live.items()):
            self.engine.abort_request(key)
            self.live.pop(key)
            self._queue(live.identity, ("error", {"request_id": live.request_id, "code": code,
                                                  "message": message}, live.parent))
        self._flush_outbox()

    def _abort_identity(self, identity: bytes) -> None:
        """The client is gone: abort what it asked for and forget what we owed it."""
        keys = [k for k, live in self.live.items() if live.identity == identity]
        for key in keys:
            self.engine.abort_request(key)
            self.live.pop(key)
        if keys:
            log.info("client %s went away; aborted %d request(s)", identity.hex(), len(keys))
        self.outbox.pop(identity, None)
        self._unsent_deltas.pop(identity, None)
        self.last_sent.pop(identity, None)

    # ---- outgoing --------------------------------------------------------------------------------

    def _reply(self, identity: bytes, msg_type: str, content: dict[str, Any], parent: str) -> None:
        self._queue(identity, (msg_type, content, parent))

    def _error(self, identity: bytes, parent: str, code: str, message: str, request_id: str | None) -> None:
        content: dict[str, Any] = {"code": code, "message": message}
        if request_id is not None:
            content["request_id"] = request_id
        self._queue(identity, ("error", content, parent))

    def _queue(self, identity: bytes, item: tuple[str, dict, str]) -> None:
        box = self.outbox.setdefault(identity, deque())
        unsent = self._unsent_deltas.setdefault(identity, {})
        msg_type, content, _ = item
        if msg_type == "delta":
            pending = unsent.get(content["request_id"])
            if pending is not None:
                # A slow reader: add to its request's delta still waiting here instead of queueing
                # one more, so the queue holds at most one delta per request, whatever the token count.
                pending["text"] += content["text"]
                pending["token_ids"].extend(content["token_ids"])
                if "logprobs" in content:
                    pending.setdefault("logprobs", []).extend(content["logprobs"])
                return
            content = {**content, "token_ids": list(content["token_ids"])}
            unsent[content["request_id"]] = content
            item = (msg_type, content, item[2])
        elif "request_id" in content:
            unsent.pop(content["request_id"], None)  # its done or error: nothing may be added before it
        box.append(item)

    def _flush_outbox(self) -> None:
        now = time.monotonic()
        for identity in list(self.outbox):
            box = self.outbox.get(identity)
            while box:
                msg_type, content, parent = box[0]
                frames = [identity, *encode(self.key, msg_type, content, parent)]
                try:
                    self.router.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    break  # its pipe is full: keep the rest for later, serve the others
                except zmq.ZMQError as e:
                    if e.errno == errno.EHOSTUNREACH:
                        self._abort_identity(identity)
                        break
                    raise
                box.popleft()
                if msg_type == "delta" and self._unsent_deltas.get(identity, {}).get(content["request_id"]) is content:
                    del self._unsent_deltas[identity][content["request_id"]]
                self.last_sent[identity] = now
            if identity in self.outbox and not self.outbox[identity]:
                del self.outbox[identity]
                self._unsent_deltas.pop(identity, None)

    def _keepalive(self) -> None:
        """Probe clients with requests in flight that we have not written to lately, so one that
        died while its request was queued or not streaming is noticed within a second or two."""
        now = time.monotonic()
        active = {live.identity for live in self.live.values()}
        self.last_sent = {i: t for i, t in self.last_sent.items() if i in active or i in self.outbox}
        for identity in active:
            if now - self.last_sent.get(identity, 0.0) > KEEPALIVE_INTERVAL_S and identity not in self.outbox:
                self._queue(identity, ("keepalive", {}, ""))
                self.last_sent[identity] = now
        self._flush_outbox()

    # ---- stats -----------------------------------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        s = self.engine.stats().to_dict()
        s.update(uptime_s=time.time() - self.started, num_dropped_messages=self.num_dropped,
                 num_step_failures=self.num_step_failures, num_clients=len({l.identity for l in self.live.values()}),
                 stopping=self.stopping, model_state=self.model_state, num_unloads=self.num_unloads,
                 idle_s=time.monotonic() - self.last_active)
        return s

    def _info(self) -> dict[str, Any]:
        return {**self.info, "version": __version__, "pid": os.getpid(), "started": self.started,
                "max_model_len": self.engine.max_model_len, "block_size": self.engine.config.block_size,
                "num_blocks": self.engine.num_blocks, "max_queue_len": self.config.max_queue_len,
                "idle_unload_s": self.config.idle_unload_s}

    def _live_view(self) -> dict[str, Any]:
        """The block map and request table of the published stats (docs/protocol.md)."""
        blocks, rows = self.engine.live_view()
        active = {live.identity for live in self.live.values()}
        self._owners = {i: n for i, n in self._owners.items() if i in active}
        requests = []
        for row in rows:
            live = self.live.get(row.request_id)
            entry = row.to_dict()
            entry["id"] = live.public_id if live else "?"
            entry["owner"] = self._owners.get(live.identity, 0) if live else 0
            del entry["request_id"]  # the client's own id, private to it
            requests.append(entry)
        return {"block_map": blocks, "requests": requests}

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.config.stats_interval_s:
            return
        self._last_stats = now
        try:
            content = {**self._stats(), **self._live_view(),
                       "num_blocks_used_peak": self.engine.take_peak_blocks_used()}
            self.pub.send_multipart([b"stats", *encode(self.key, "stats", content)], zmq.NOBLOCK)
        except zmq.Again:
            pass


class _OneClientKey:
    """The ZAP policy of the TCP sockets: admit the one CURVE client key of our connection file."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public_key)


def _rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _release_memory() -> None:
    """Hand freed memory back to the system: torch's CUDA cache, and glibc's heap, which keeps
    freed blocks below its (adaptive) mmap threshold for reuse otherwise."""
    import ctypes
    import ctypes.util

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name) if libc_name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
