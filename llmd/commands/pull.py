"""``llmd pull REPO[:TAG]``: fetch a model from the Hugging Face Hub (daemon/model_pull.py)."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    pull = sub.add_parser("pull", help="download a model from the Hugging Face Hub",
                          description="Download a model into the local Hugging Face cache, resuming a dropped "
                                      "connection and checking every file against the hub's hashes. org/name:TAG "
                                      "takes one GGUF file of the repo by its quantisation (org/name:Q4_K_M) or "
                                      "file name; org/name a safetensors repo's config, tokenizer and weights. The "
                                      "one command that uses the network (HF_ENDPOINT and HF_TOKEN are honoured).")
    pull.add_argument("model", metavar="REPO[:TAG]", help="a Hugging Face model repo, e.g. org/name or org/name:Q4_K_M")
    pull.set_defaults(func=run, online=True)


def run(args: argparse.Namespace) -> int:
    from llmd.errors import PullError

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise PullError("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it to pull")
    from llmd.daemon.model_catalog import human_size
    from llmd.daemon.model_pull import pull

    pulled = pull(args.model)
    print(f"pulled {pulled.name}: {len(pulled.files)} file{'s' * (len(pulled.files) != 1)}, "
          f"{human_size(pulled.size_bytes)}, in {pulled.snapshot}")
    print(f"run it with: llmd start --model {pulled.name}")
    return 0
