"""``llmd models``: the models that can be served without a network."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="list the models that can be served without a network",
                            description="The default model, models in the local Hugging Face cache and .gguf files "
                                        "in the models directory (models_dir in the config file); `--model NAME` "
                                        "takes the names shown. Then the remote models of the config file "
                                        "([remote.\"NAME\"]), which requests to the daemon name the same way.")
    models.add_argument("--models-dir", default=None, metavar="DIR", help="look here for .gguf files instead")
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from llmd.config import models_dir, remote_tables
    from llmd.daemon.model_catalog import list_local_models, render_table, to_json

    directory = Path(args.models_dir).expanduser() if args.models_dir else models_dir()
    found = list_local_models(directory)
    remotes = remote_tables()
    print(json.dumps(to_json(found, remotes)) if args.json else render_table(found, directory, remotes))
    return 0
