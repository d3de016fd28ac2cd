"""The daemon's loop: its models' engines behind the sockets (daemon/transport.py).

One thread does everything, in a loop: take every waiting message and answer or hand it on
(daemon/intake.py checks requests and encodes their prompts off the loop), run one engine step (the
models with work in turn, daemon/model_set.py), route the step's deltas to their clients, send what
is queued, publish stats now and then (daemon/server_stats.py). A model may be unloaded when idle or
to make room for another, and loaded again (or a new one built) by a worker thread while the loop
keeps answering (daemon/model_lifecycle.py).

A failing step costs the requests in flight an ``internal`` error, never the daemon, unless it
fails MAX_CONSECUTIVE_STEP_FAILURES times in a row.

Requests for remote models (daemon/remote_model.py) have no engine: a thread of their own streams
them from their servers (daemon/remote_runner.py), and the loop routes what comes back, woken
like it is for an encoded prompt.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from llmd.daemon.engine.outputs import RequestDelta, RequestMetrics
from llmd.daemon.intake import Intake, LiveRequest, request_key
from llmd.daemon.process_memory import rss_bytes
from llmd.daemon.model_set import ModelSet
from llmd.daemon.remote_model import RemoteModel
from llmd.daemon.remote_runner import RemoteEvent, RemoteRunner
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.daemon.served_model import ServedModel
from llmd.daemon.server_stats import ServerStats
from llmd.daemon.transport import Reply, Transport
from llmd.protocol import ErrorCode, Message, ProtocolError, require_str

log = logging.getLogger("llmd.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3


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


class Server:
    """Args:
        models: the models it serves (the default one built and loaded).
        files: the runtime dir (key, endpoints).
        info: what ``info`` replies say about the daemon (the default model's fields among them).
        config: limits.
        remotes: the remote models (the config file's ``[remote."NAME"]`` tables).
    """

    def __init__(self, models: ModelSet, files: RuntimeFiles, info: dict[str, Any],
                 config: ServerConfig | None = None, remotes: list[RemoteModel] | None = None) -> None:
        self.models = models
        self.config = config = config or ServerConfig()
        self.transport = Transport(files, config.tcp)
        self.reporter = ServerStats(models, info, {"max_queue_len": config.max_queue_len,
                                                   "idle_unload_s": config.idle_unload_s,
                                                   "max_loaded_models": models.max_loaded}, remotes or [])
        self.live: dict[str, LiveRequest] = {}  # engine request id -> request
        # Woken through this pipe when an encoding finishes, so the loop can sleep in poll() meanwhile.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.remote_runner = RemoteRunner(remotes, lambda: self._wake(None)) if remotes else None
        self.intake = Intake(models, self.live, config.max_queue_len, self.transport.queue, self._wake,
                             self.reporter.new_public_id, self.reporter.requests, self.remote_runner)
        self.stopping = False
        self.drain_deadline: float | None = None
        self.num_step_failures = 0
        self._consecutive_failures = 0
        self._last_stats = 0.0

    @property
    def connection_fields(self) -> dict[str, Any]:
        """What the connection file adds to the model's info: endpoints and, with TCP, CURVE keys."""
        return self.transport.connection_fields

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
        poller.register(self.transport.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        code = 0
        try:
            while True:
                # NOTE: replies stuck behind a full client pipe only need a retry now and then;
                # counting them as busy would spin the loop at 100% CPU.
                busy = any(m.engine.has_unfinished() and m.engine.is_loaded for m in self.models.models.values())
                timeout = 0 if busy else (10 if self.transport.outbox else 100)
                if self.stopping and not self.live:
                    break
                if self.stopping and time.monotonic() > (self.drain_deadline or 0):
                    self._cancel_all(ErrorCode.CANCELLED, "the daemon is shutting down")
                    break
                if poller.poll(timeout):
                    self._drain_incoming()
                self._collect_encoded()
                self._collect_remote()
                self._tick_models()
                # NOTE: answers (health, stats, accepted, errors) leave now, not after a step that
                # may take seconds on a CPU with a long context.
                self._flush()
                if (model := self.models.next_to_step()) is not None:
                    if not self._step(model):
                        code = 1
                        break
                self._flush()
                self.transport.keepalive({live.identity for live in self.live.values()})
                self._flush()
                self._publish_stats()
        finally:
            if self.remote_runner is not None:
                self.remote_runner.close()
            self.models.close()
            self._flush()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.transport.close(2000)  # give the last replies (done, cancelled) time to leave
        log.info("stopped")
        return code

    def _tick_models(self) -> None:
        """Builds and reloads finished or failed, idle unloads (ModelSet.tick)."""
        busy_models = {id(live.model) for live in self.live.values()}
        ready, failures = self.models.tick(lambda m: id(m) in busy_models)
        for model in ready:
            self.intake.start_waiting(model)
        for name, failure in failures:
            model = self.models.get(name)
            if model is None:  # a model a request named, never built
                self.intake.fail_waiting(name, ErrorCode.INTERNAL, f"loading the model {name} failed: "
                                                                   f"{type(failure).__name__}: {failure}")
            else:
                self._cancel_all(ErrorCode.INTERNAL, f"reloading the model failed ({name}): "
                                                     f"{type(failure).__name__}: {failure}", model)

    # ---- incoming --------------------------------------------------------------------------------

    def _drain_incoming(self) -> None:
        for identity, msg in self.transport.receive():
            if isinstance(msg, ProtocolError):  # signed, but malformed: answered
                self._error(identity, msg.msg_id, msg.code, str(msg), None)
                continue
            rid = msg.content.get("request_id") if isinstance(msg.content.get("request_id"), str) else None
            try:
                self._handle(identity, msg)
            except ProtocolError as e:
                if msg.type == "generate":
                    self.reporter.requests.refuse(e.code)
                self._error(identity, msg.msg_id, e.code, str(e), rid)
            except Exception as e:  # a bug must cost one request, never the daemon
                log.exception("failed to handle a %s message", msg.type)
                self._error(identity, msg.msg_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", rid)

    def _handle(self, identity: bytes, msg: Message) -> None:
        c = msg.content
        if msg.type == "generate":
            self.intake.generate(identity, msg, self.stopping)
        elif msg.type == "cancel":
            rid = require_str(c, "request_id")
            key = request_key(identity, rid)
            if key not in self.live:
                raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"no request {rid!r} of yours is running")
            self._finish(key, self._abort(key, self.live[key]), reason="abort")
        elif msg.type == "stats":
            self._reply(identity, ("stats", self._stats(), msg.msg_id))
        elif msg.type == "info":
            name = self.intake.model_name(c)
            if (remote := self.intake.remote_model(name)) is not None:
                self._reply(identity, ("info", remote.info(self.reporter.daemon_info()), msg.msg_id))
            elif name is not None and self.models.get(name) is None:
                raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} is not loaded here: a generate "
                                                              "request naming it loads it")
            else:
                self._reply(identity, ("info", self.reporter.info(self.models.get(name)), msg.msg_id))
        elif msg.type == "tokenize":
            self.intake.tokenize(identity, msg)
        elif msg.type == "detokenize":
            self.intake.detokenize(identity, msg)
        elif msg.type == "health":
            self._reply(identity, ("health", {"status": "stopping" if self.stopping else "ok"}, msg.msg_id))
        elif msg.type == "ping":
            self._reply(identity, ("pong", {}, msg.msg_id))
        elif msg.type == "shutdown":
            self._reply(identity, ("shutdown", {"status": "stopping"}, msg.msg_id))
            self.request_stop()

    def _wake(self, _: Future[Any] | None) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (the loop will look anyway) or closed (shutting down)

    def _collect_encoded(self) -> None:
        """Hand the encoded prompts to the intake (see Intake.wait_for_fresh)."""
        self.intake.wait_for_fresh()
        try:
            # NOTE: every finished encoding writes a byte after it is done, so no byte, nothing new.
            if not os.read(self._wake_r, 65536):
                return
        except BlockingIOError:
            return
        self.intake.collect()

    def _collect_remote(self) -> None:
        """Route what remote models' servers sent (daemon/remote_runner.py) as an engine's deltas."""
        if self.remote_runner is None:
            return
        for event in self.remote_runner.events():
            request = event.request
            live = self.live.get(request.key)
            if live is None or live.remote is not request:
                continue  # (cancelled, or its client gone: the daemon has answered it)
            if event.kind == "accepted":
                self._reply(live.identity, ("accepted", {"request_id": live.request_id, "prompt_tokens": 0,
                                                         "id": live.public_id}, live.parent))
            elif event.kind == "text":
                request.num_chunks += 1
                request.first_text_at = request.first_text_at or event.at
                request.last_text_at = event.at
                self._route(RequestDelta(request.key, event.text, []))
            elif event.kind == "done":
                live.num_prompt_tokens = event.usage.get("prompt_tokens", 0)
                delta = RequestDelta(request.key, "", [], True, event.finish_reason, metrics=_remote_metrics(event))
                self._finish(request.key, delta, event.finish_reason, event.tool_calls)
            elif event.error is not None:
                self.live.pop(request.key)
                self.reporter.requests.failed()
                self._error(live.identity, live.parent, event.error.code, str(event.error), live.request_id)

    def _abort(self, key: str, live: LiveRequest) -> RequestDelta | None:
        """Stop a request in flight: its engine's abort (its last delta), or its remote stream closed."""
        if live.remote is not None and self.remote_runner is not None:
            self.remote_runner.cancel(live.remote)
            return None
        return live.model.engine.abort_request(key) if live.model is not None else None

    # ---- engine ----------------------------------------------------------------------------------

    def _step(self, model: ServedModel) -> bool:
        """One step of ``model``'s engine; False if the daemon must exit (repeated failures)."""
        try:
            deltas = model.engine.step()
        except Exception as e:
            self.num_step_failures += 1
            self._consecutive_failures += 1
            log.exception("model step failed")
            self._cancel_all(ErrorCode.INTERNAL, f"model step failed: {type(e).__name__}: {e}", model)
            return self._consecutive_failures < MAX_CONSECUTIVE_STEP_FAILURES
        self._consecutive_failures = 0
        for delta in deltas:
            self._route(delta)
        return True

    def _route(self, delta: RequestDelta) -> None:
        live = self.live.get(delta.request_id)
        if live is None:
            return
        # a request with tools: text that may be a call is held back (daemon/tool_calls.py)
        text = delta.text if live.tool_parser is None else live.tool_parser.feed(delta.text)
        if live.stream:
            if text or delta.token_ids:
                content = {"request_id": live.request_id, "text": text, "token_ids": delta.token_ids}
                if delta.logprobs:
                    content["logprobs"] = [[lp, [list(p) for p in top]] for lp, top in delta.logprobs]
                self._reply(live.identity, ("delta", content, live.parent))
        else:
            live.text.append(text)
            live.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                live.logprobs.extend([lp, [list(p) for p in top]] for lp, top in delta.logprobs)
        if delta.finished:
            self._finish(delta.request_id, delta, delta.finish_reason)

    def _finish(self, key: str, delta: RequestDelta | None, reason: str | None,
                tool_calls: list[dict[str, str]] | None = None) -> None:
        """``tool_calls``: a remote model's (its server parsed them); a local model's come from its parser."""
        live = self.live.pop(key, None)
        if live is None:
            return
        m = delta.metrics if delta is not None else None
        self.reporter.requests.finished(reason, m.ttft if m else None, m.e2e if m else None,
                                        m.num_generated_tokens if m else 0)
        content: dict[str, Any] = {"request_id": live.request_id, "finish_reason": reason}
        if live.tool_parser is not None and delta is not None:
            rest, calls = live.tool_parser.finish()
            if live.stream and rest:  # what was held back, and was text after all
                self._reply(live.identity, ("delta", {"request_id": live.request_id, "text": rest, "token_ids": []},
                                            live.parent))
            elif rest:
                live.text.append(rest)
            if calls:
                content["tool_calls"] = [call.to_wire() for call in calls]
                if reason == "stop" and live.tool_parser.request.choice != "function":  # (as OpenAI's)
                    content["finish_reason"] = "tool_calls"
        if tool_calls:
            content["tool_calls"] = tool_calls
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
            "verifications": m.num_verifications if m else 0, "draft_tokens": m.num_draft_tokens if m else 0,
            "accepted_draft_tokens": m.num_accepted_draft_tokens if m else 0,
            "draft_acceptance_rate": m.draft_acceptance_rate if m else None,
            "mean_accepted_length": m.mean_accepted_length if m else None,
        }
        if delta is not None and delta.prompt_logprobs is not None:
            content["prompt_logprobs"] = [None if lp is None else [lp[0], [list(p) for p in lp[1]]]
                                          for lp in delta.prompt_logprobs]
        self._reply(live.identity, ("done", content, live.parent))

    def _cancel_all(self, code: str, message: str, model: ServedModel | None = None) -> None:
        """End the requests in flight (of ``model`` only, if given) with an error."""
        for key, live in list(self.live.items()):
            if model is not None and live.model is not model:
                continue
            self._abort(key, live)
            self.live.pop(key)
            self.reporter.requests.failed()
            self._reply(live.identity, ("error", {"request_id": live.request_id, "code": code,
                                                  "message": message}, live.parent))
        self._flush()

    def _abort_identity(self, identity: bytes) -> None:
        """The client is gone: abort what it asked for (the transport forgot what we owed it)."""
        keys = [k for k, live in self.live.items() if live.identity == identity]
        for key in keys:
            live = self.live.pop(key)
            self._abort(key, live)
            self.reporter.requests.failed()
        if keys:
            log.info("client %s went away; aborted %d request(s)", identity.hex(), len(keys))

    # ---- outgoing --------------------------------------------------------------------------------

    def _reply(self, identity: bytes, reply: Reply) -> None:
        self.transport.queue(identity, reply)

    def _error(self, identity: bytes, parent: str, code: str, message: str, request_id: str | None) -> None:
        content: dict[str, Any] = {"code": code, "message": message}
        if request_id is not None:
            content["request_id"] = request_id
        self._reply(identity, ("error", content, parent))

    def _flush(self) -> None:
        for identity in self.transport.flush():
            self._abort_identity(identity)

    # ---- stats -----------------------------------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        default = self.models.default.lifecycle
        return self.reporter.stats(self.live, num_dropped_messages=self.transport.num_dropped,
                                   num_step_failures=self.num_step_failures, stopping=self.stopping,
                                   model_state=default.state, num_unloads=default.num_unloads,
                                   idle_s=time.monotonic() - default.last_active, rss_bytes=rss_bytes())

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.config.stats_interval_s:
            return
        self._last_stats = now
        self.transport.publish({**self._stats(), **self.reporter.live_view(self.live),
                                "num_blocks_used_peak": self.models.default.engine.take_peak_blocks_used()})


def _remote_metrics(event: RemoteEvent) -> RequestMetrics:
    """A remote request's metrics as a local one's: its usage as its server counted it, its times
    as this daemon saw them (the first text's arrival is its TTFT; its tokens are spread evenly
    between the first text and the last for the decode rate)."""
    request, usage = event.request, event.usage
    first, last = request.first_text_at, request.last_text_at
    generated = usage.get("completion_tokens") or request.num_chunks
    times: list[float] = []
    if first is not None and last is not None and 0 < generated <= 1 << 16:  # (the server's count: bounded)
        step = (last - first) / (generated - 1) if generated > 1 else 0.0
        times = [first - request.sent_at + i * step for i in range(generated)]
    return RequestMetrics(num_prompt_tokens=usage.get("prompt_tokens", 0),
                          num_cached_tokens=usage.get("cached_tokens", 0), num_generated_tokens=generated,
                          num_preemptions=0, queue_time=None,
                          ttft=None if first is None else first - request.sent_at, e2e=event.at - request.sent_at,
                          token_times=times)
