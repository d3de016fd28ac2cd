"""``llmd pull REPO[:TAG]``: fetch a model from the Hugging Face Hub into the local HF cache, the one
place llmd downloads.

huggingface_hub does the transfer: the HF cache as the store (so other tools share the files), a
connection that drops mid-file resumed with a range request from what was written (up to five times
in a row), a progress bar per file, ``HF_ENDPOINT`` and ``HF_TOKEN`` honoured. NOTE: a pull that is
stopped (Ctrl-C, or five failures) starts its file over the next time: huggingface_hub (2.4 here)
keeps no partial file across processes (its temporary files are per process, for filesystems whose
locks do not hold). It checks only a file's size, so each file is then checked
here against the hash the hub lists for it (an LFS file's sha256, a small file's git blob id); a file
that fails is deleted and the pull fails, so a bad file is never served.

What is fetched:
  - ``org/name:TAG``: one GGUF file of the repo, by its quantisation tag (``:Q4_K_M``) or its file
    name; the choices are listed when the tag names none or the repo has several and no tag is given;
  - ``org/name`` of a safetensors repo: its config, generation config, tokenizer and chat template
    files and its ``.safetensors`` weights (the shards its index names, if it has one); nothing else
    (no ``.bin``, ``.onnx`` or other formats).

The model is then served by its name: ``llmd start --model org/name[:TAG]`` (daemon/model_source.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.daemon import hf_cache
from llmd.errors import LlmdError, ModelNotFoundError, PullError

SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?$")
# The files of a safetensors repo a model needs besides its weights
_SIDE_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
})
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Pulled:
    """What a pull left in the cache: the name to serve it by, its snapshot, and its files' bytes."""

    name: str
    snapshot: Path
    files: tuple[str, ...]
    size_bytes: int


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``org/name[:TAG]`` -> ``(repo_id, tag or None)``.

    Raises:
        PullError: not of that form.
    """
    match = SPEC.match(spec)
    if match is None:
        raise PullError(f"{spec!r} is not a Hugging Face model: write it as org/name, or org/name:TAG for one "
                        "GGUF file of the repo (e.g. org/name:Q4_K_M)")
    return match["repo"], match["tag"]


def pull(spec: str) -> Pulled:
    """Fetch ``spec`` (``org/name[:TAG]``) into the HF cache, verified; files already there and
    intact are not fetched again.

    Raises:
        PullError: the hub cannot be reached or refuses, or a file fails its hash (it is deleted).
        ModelNotFoundError: no such repo, or no file in it that ``TAG`` names (the choices are listed).
    """
    from huggingface_hub import HfApi

    repo, tag = parse_spec(spec)
    info = _hub_call(repo, lambda: HfApi().model_info(repo, files_metadata=True))
    siblings = {s.rfilename: s for s in info.siblings or ()}
    names = list(siblings)
    gguf = tag is not None or (not any(n.endswith(".safetensors") for n in names) and hf_cache.gguf_files(names))
    if gguf:
        files = [hf_cache.pick_gguf(names, tag, repo)]
        name = f"{repo}:{hf_cache.gguf_tag(files[0])}"
    else:
        files = _safetensors_files(repo, names)
        name = repo
    paths = [_fetch(repo, f, siblings[f]) for f in files]
    if _INDEX in files:  # the shards its index names (fetched after it: the index says which)
        shards = _index_shards(repo, paths[files.index(_INDEX)], siblings)
        paths += [_fetch(repo, f, siblings[f]) for f in shards]
        files += shards
    return Pulled(name, paths[0].parent, tuple(files), sum(p.stat().st_size for p in paths))


def _safetensors_files(repo: str, names: list[str]) -> list[str]:
    if "config.json" not in names:
        raise ModelNotFoundError(f"{repo} has no config.json and no GGUF file: not a model llmd can serve")
    weights = [n for n in names if n.endswith(".safetensors") and "/" not in n]
    if not weights:
        raise ModelNotFoundError(f"{repo} has no .safetensors weights (llmd does not read pickled .bin weights); "
                                 "look for a safetensors or GGUF version of it")
    side = sorted(n for n in names if n in _SIDE_FILES)
    if _INDEX in names:
        return [*side, _INDEX]
    return side + sorted(weights)


def _index_shards(repo: str, index: Path, siblings: dict[str, Any]) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise PullError(f"{repo}'s {_INDEX} is not a safetensors index (no weight_map)") from None
    missing = [s for s in shards if s not in siblings]
    if missing or not all(isinstance(s, str) for s in shards):
        raise PullError(f"{repo}'s {_INDEX} names shards the repo does not have: {missing[:3]}")
    return shards


def _fetch(repo: str, filename: str, sibling: Any) -> Path:
    """One file into the cache (a dropped connection resumed), then verified. NOTE: of the main
    branch, as listed (not pinned to the listing's commit): so the cache's refs/main is written, and
    other tools find the model offline by its name; a commit pushed in between fails the hash."""
    from huggingface_hub import hf_hub_download

    path = Path(_hub_call(repo, lambda: hf_hub_download(repo, filename)))
    _verify(repo, filename, path, sibling)
    return path


def _verify(repo: str, filename: str, path: Path, sibling: Any) -> None:
    """``path`` against the hub's hash for it: an LFS file's sha256, else its git blob id. A file that
    fails is deleted (its blob and its link), so that the next pull fetches it again."""
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None:  # (a dict in older huggingface_hub releases)
        expected = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    else:
        expected = getattr(sibling, "blob_id", None)
    if not expected:
        return  # the hub listed no hash (an old or third-party hub): the size check is all there is
    digest = hashlib.sha256() if lfs is not None else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() == expected:
        return
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    kind = "sha256" if lfs is not None else "git blob id"
    raise PullError(f"{repo}: {filename} does not match the hub's {kind} ({digest.hexdigest()[:12]}... against "
                    f"{expected[:12]}...); it was deleted: run `llmd pull` again")


def _hub_call(repo: str, call: Any) -> Any:
    """``call()``, with what the hub and the network can do wrong as one-line errors."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    endpoint = constants.ENDPOINT
    try:
        return call()
    except GatedRepoError:
        raise PullError(f"{repo} is gated: accept its terms on {endpoint}/{repo}, then log in "
                        "(`hf auth login`, or set HF_TOKEN)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        raise ModelNotFoundError(f"{repo} is not on {endpoint} (or is private: log in with `hf auth login`, "
                                 "or set HF_TOKEN)") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise PullError(f"{endpoint} answered HTTP {status} for {repo}; try again later") from None
    except LlmdError:
        raise
    except Exception as e:  # the HTTP client's own errors (httpx, requests), disk errors
        if isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
            reason = " ".join(str(e).split()) or type(e).__name__
            raise PullError(f"could not fetch {repo} from {endpoint}: {reason}; check the network (or "
                            "HF_ENDPOINT) and run `llmd pull` again") from None
        raise
