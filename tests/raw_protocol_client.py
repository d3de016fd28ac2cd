"""A client written only from docs/protocol.md: no llmd imports. Run by test_daemon_wire.py.

Usage: raw_protocol_client.py CONNECTION_FILE. Prints one JSON object with what it saw.
"""

import hashlib
import hmac
import json
import sys
import time

import msgpack
import zmq

conn = json.load(open(sys.argv[1]))
key = bytes.fromhex(conn["key"])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(conn["requests"])
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"stats")
sub.connect(conn["stats"])


def send(msg_type, content, msg_id):
    h = msgpack.packb({"v": 1, "id": msg_id, "type": msg_type, "ts": time.time()})
    c = msgpack.packb(content)
    sock.send_multipart([b"llmd/1", hmac.new(key, h + c, hashlib.sha256).hexdigest().encode(), h, c])


def recv(s=sock):
    if not s.poll(15000):
        raise SystemExit("no reply within 15 s")
    frames = s.recv_multipart()
    if s is sub:
        frames = frames[1:]
    proto, sig, h, c = frames
    assert proto == b"llmd/1"
    assert hmac.compare_digest(hmac.new(key, h + c, hashlib.sha256).hexdigest().encode(), sig)
    return msgpack.unpackb(h), msgpack.unpackb(c)


seen = {}
send("health", {}, "h1")
header, content = recv()
seen["health"] = [header["type"], header["parent"], content["status"]]

send("generate", {"request_id": "r1", "token_ids": [5, 6, 7], "params": {"max_tokens": 8, "temperature": 0,
                                                                           "ignore_eos": True}}, "g1")
tokens, types = [], []
while True:
    header, content = recv()
    if header["type"] == "keepalive":
        continue
    types.append(header["type"])
    if header["type"] == "delta":
        tokens += content["token_ids"]
    if header["type"] in ("done", "error"):
        seen["done"] = content
        break
seen["types"] = sorted(set(types))
seen["tokens"] = tokens

send("cancel", {"request_id": "nope"}, "c1")
header, content = recv()
seen["cancel"] = [header["type"], content["code"]]

send("tokenize", {"prompt": "hi"}, "t1")
header, content = recv()
seen["tokenize"] = [header["type"], len(content["token_ids"])]

header, content = recv(sub)
seen["stats"] = [header["type"], content["num_blocks"]]
print(json.dumps(seen))
