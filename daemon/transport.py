"""The daemon's sockets: a ZeroMQ ROUTER for requests and replies, a PUB for stats.

Who may talk to us: on the ipc sockets, whoever can open the runtime dir (0700, ours); on ``tcp``,
only a peer holding the client's CURVE key from the connection file (the link is encrypted, and a
ZAP handler admits that one key). Every message is HMAC-signed and accepted once, while fresh
(llmd.protocol.ReplayGuard); what fails that is dropped and counted, never answered.

Sends never block: a client that reads slowly has its replies queued on our side (at most one
delta per request: later ones merge into it) while everyone else streams on, and a client that has
gone away is noticed on the next send (``ROUTER_MANDATORY`` reports the peer unreachable).
"""

from __future__ import annotations

import errno
import hmac
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.auth.thread

from llmd.config import OPTIONS, is_loopback
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.errors import LlmdError
from llmd.protocol import (MAX_FRAMES, MAX_MESSAGE_BYTES, REQUEST_TYPES, Message, ProtocolError, ReplayGuard,
                           SignatureError, decode, encode)

log = logging.getLogger("llmd.server")

KEEPALIVE_INTERVAL_S = 1.0
# Messages ZeroMQ may hold for one client before we keep (and merge) its deltas ourselves: small, so
# a reader that stops costs a bounded queue, not one message per token.
CLIENT_SNDHWM = 64
MAX_MESSAGES_PER_TURN = 1000  # read at most this many per loop turn, so a flood cannot starve the engine


def check_tcp(tcp: str | None, allow_remote: bool = False) -> None:
    """Refuse a TCP address other machines could reach unless ``allow_remote``; warn on stderr
    when it is allowed.

    Raises:
        LlmdError: a malformed address, or a non-loopback one without ``allow_remote``.
    """
    if tcp is None:
        return
    try:
        OPTIONS["tcp"].parse(tcp)  # the check the flag and the config file make
    except ValueError:
        raise LlmdError(f"--tcp takes HOST:PORT (e.g. 127.0.0.1:7860), got {tcp!r}") from None
    host = tcp.rpartition(":")[0].strip("[]")
    if is_loopback(host):
        return
    if not allow_remote:
        raise LlmdError(f"--tcp {tcp} would be reachable from other machines; use 127.0.0.1:PORT, or add "
                        "--allow-remote if you mean it")
    print(f"llmd: warning: serving on {tcp}, reachable from other machines (CURVE-encrypted; clients need "
          "the keys in the connection file)", file=sys.stderr, flush=True)


# A reply waiting to be sent: (type, content, parent message id).
Reply = tuple[str, dict[str, Any], str]


class Transport:
    """Args:
        files: the runtime dir (the signing key, the ipc endpoints).
        tcp: ``host:port`` to serve on TCP too (requests on port, stats on port + 1), or None.

    Raises:
        LlmdError: an endpoint cannot be bound (the message says what to check).
    """

    def __init__(self, files: RuntimeFiles, tcp: str | None = None) -> None:
        self.key = files.key
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
            if tcp:
                self._bind_tcp(tcp)
        except zmq.ZMQError as e:
            self.close(0)
            raise LlmdError(f"cannot listen ({e}); check --tcp HOST:PORT (port free?) and that --socket-dir "
                            "is a short path (ipc paths are limited to about 100 characters)") from None
        except LlmdError:
            self.close(0)
            raise
        self.replays = ReplayGuard()
        self.num_dropped = 0  # unsigned, badly signed or malformed frames
        self.outbox: dict[bytes, deque[Reply]] = {}
        # per client, per request id: its delta still in the outbox, which later deltas are merged into
        self._unsent_deltas: dict[bytes, dict[str, dict[str, Any]]] = {}
        self.last_sent: dict[bytes, float] = {}

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

    @property
    def connection_fields(self) -> dict[str, Any]:
        """What the connection file adds to the model's info: endpoints and, with TCP, CURVE keys."""
        return {**self.endpoints, **self.curve_keys}

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets, the requests one after ``linger_ms`` for the last replies to leave."""
        self.router.close(linger_ms)
        self.pub.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

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

    def receive(self) -> Iterator[tuple[bytes, Message | ProtocolError]]:
        """The waiting messages, signed, fresh and well-formed, each with its sender's identity; a
        malformed one that can be answered (signed, with an id) comes as its ProtocolError. Anything
        else is dropped and counted."""
        for _ in range(MAX_MESSAGES_PER_TURN):
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
                    yield identity, e
                else:
                    self.num_dropped += 1
                    log.debug("dropped a malformed message: %s", e)
                continue
            yield identity, msg

    # ---- outgoing --------------------------------------------------------------------------------

    def queue(self, identity: bytes, reply: Reply) -> None:
        """Queue a reply (sent by :meth:`flush`); a delta is merged into the same request's delta
        still waiting, so the queue holds at most one delta per request."""
        box = self.outbox.setdefault(identity, deque())
        unsent = self._unsent_deltas.setdefault(identity, {})
        msg_type, content, parent = reply
        if msg_type == "delta":
            pending = unsent.get(content["request_id"])
            if pending is not None:
                pending["text"] += content["text"]
                pending["token_ids"].extend(content["token_ids"])
                if "logprobs" in content:
                    pending.setdefault("logprobs", []).extend(content["logprobs"])
                return
            content = {**content, "token_ids": list(content["token_ids"])}
            unsent[content["request_id"]] = content
            reply = (msg_type, content, parent)
        elif "request_id" in content:
            unsent.pop(content["request_id"], None)  # its done or error: nothing may be added before it
        box.append(reply)

    def flush(self) -> list[bytes]:
        """Send what is queued, as far as each client's pipe takes it; returns the clients found
        gone (their queues are dropped: :meth:`forget`)."""
        now = time.monotonic()
        gone = []
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
                        gone.append(identity)
                        self.forget(identity)
                        break
                    raise
                box.popleft()
                if msg_type == "delta" and self._unsent_deltas.get(identity, {}).get(content["request_id"]) is content:
                    del self._unsent_deltas[identity][content["request_id"]]
                self.last_sent[identity] = now
            if identity in self.outbox and not self.outbox[identity]:
                del self.outbox[identity]
                self._unsent_deltas.pop(identity, None)
        return gone

    def forget(self, identity: bytes) -> None:
        """Drop what we owed a client that is gone."""
        self.outbox.pop(identity, None)
        self._unsent_deltas.pop(identity, None)
        self.last_sent.pop(identity, None)

    def keepalive(self, active: set[bytes]) -> None:
        """Queue a probe for each client in ``active`` (requests in flight) we have not written to
        lately, so one that died while its request was queued or not streaming is noticed within a
        second or two (the probe's send fails)."""
        now = time.monotonic()
        self.last_sent = {i: t for i, t in self.last_sent.items() if i in active or i in self.outbox}
        for identity in active:
            if now - self.last_sent.get(identity, 0.0) > KEEPALIVE_INTERVAL_S and identity not in self.outbox:
                self.queue(identity, ("keepalive", {}, ""))
                self.last_sent[identity] = now

    def publish(self, content: dict[str, Any]) -> None:
        """Publish a stats message (dropped if the PUB socket is full: the next one replaces it)."""
        try:
            self.pub.send_multipart([b"stats", *encode(self.key, "stats", content)], zmq.NOBLOCK)
        except zmq.Again:
            pass


class _OneClientKey:
    """The ZAP policy of the TCP sockets: admit the one CURVE client key of our connection file."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public_key)
