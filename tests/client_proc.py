"""Run by tests as a separate client process: stream one greedy request from the daemon."""

import json
import sys

from llmd.client import Client

socket_dir, token_ids, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tokens = []
with Client(socket_dir) as client:
    for delta in client.generate(token_ids=token_ids, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        tokens.extend(delta.token_ids)
        print("delta", len(tokens), flush=True)
print(json.dumps(tokens), flush=True)
