"""The local Hugging Face hub cache: where it is, which snapshot of a repo it holds, the GGUF files
in it by quantisation tag (``org/name:Q4_K_M``), and removing a model from it. Only ``llmd pull``
(daemon/model_pull.py) downloads into it; everything else reads it offline (``--model org/name``,
``llmd models``, ``llmd rm``)."""

from __future__ import annotations

import re
from pathlib import Path

from llmd.errors import ModelNotFoundError

# llama.cpp's quantisation names as GGUF files end with them: model-Q4_K_M.gguf, llama-2-7b.Q8_0.gguf,
# qwen2.5-0.5b-instruct-q4_k_m.gguf, gemma-3-1b-it-UD-Q4_K_XL.gguf
_TAG = re.compile(r"(?:^|[-.])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)
# One model in several files (llama.cpp's gguf-split): not served
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, exactly as ``huggingface_hub`` finds it (``HF_HUB_CACHE``, then
    ``HF_HOME/hub``, then ``~/.cache/huggingface/hub``). Importing its ``constants`` takes ~3 ms."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_dirs() -> list[Path]:
    """Every cached model repo's directory (``models--org--name``), sorted."""
    return sorted(hf_cache_dir().glob("models--*"))


def repo_id(repo_dir: Path) -> str:
    """``org/name`` of a directory from :func:`repo_dirs`."""
    return repo_dir.name.removeprefix("models--").replace("--", "/")


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of ``repo_id`` (``org/name``): the one ``refs/main`` names, else the newest.

    Returns:
        The snapshot directory, or ``None`` if the repo is not in the cache. Never downloads.
    """
    return snapshot_of(hf_cache_dir() / ("models--" + repo_id.replace("/", "--")))


def snapshot_of(repo: Path) -> Path | None:
    """The snapshot of the cached repo directory ``repo`` (see :func:`cached_snapshot`)."""
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except OSError:
        ref = ""
    if ref and (snapshots / ref).is_dir():
        return snapshots / ref
    try:
        candidates = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def gguf_tag(filename: str) -> str:
    """The tag a GGUF file is named by after ``org/name:``: its quantisation as its name ends with it
    (upper case: ``Q4_K_M``), else the file's name without ``.gguf``."""
    stem = filename[:-5] if filename.lower().endswith(".gguf") else filename
    match = _TAG.search(stem)
    return match.group(1).upper() if match else stem


def gguf_files(filenames: list[str]) -> list[str]:
    """The servable GGUF files among ``filenames`` (top level, not split in parts), sorted."""
    return sorted(f for f in filenames if f.lower().endswith(".gguf") and "/" not in f and not _SPLIT.search(f))


def pick_gguf(filenames: list[str], tag: str | None, repo_id: str) -> str:
    """The one GGUF file of ``filenames`` that ``tag`` names (its tag or its file name, any case; with
    no tag, the only one).

    Raises:
        ModelNotFoundError: none or several match; the message lists the choices as ``repo:TAG``.
    """
    files = gguf_files(filenames)
    wanted = tag.lower() if tag else None
    found = [f for f in files if wanted is None or wanted in (f.lower(), f[:-5].lower(), gguf_tag(f).lower())]
    if len(found) == 1:
        return found[0]
    choices = ", ".join(f"{repo_id}:{gguf_tag(f)}" for f in files) or "none"
    if any(_SPLIT.search(f) for f in filenames):
        choices += " (split GGUF files, -00001-of-0000N, are not served)"
    if not found and tag:
        raise ModelNotFoundError(f"{repo_id} has no GGUF file tagged {tag!r}; its choices: {choices}")
    if not found:
        raise ModelNotFoundError(f"{repo_id} has no GGUF file llmd can serve; its files: {choices}")
    raise ModelNotFoundError(f"{repo_id} has {len(found)} GGUF files; name one: {choices}")


def remove(repo_id: str, filename: str | None = None) -> int:
    """Delete ``repo_id`` from the cache (its folder: every snapshot and blob), or only ``filename``
    of its snapshots (its blob too, unless another file still points to it). NOTE: not through
    huggingface_hub's cache manager, which deletes revisions by commit hash alone: a duplicated repo
    shares its source's hashes, and would lose its snapshot too.

    Returns:
        The bytes freed.

    Raises:
        ModelNotFoundError: the repo (or that file) is not in the cache.
    """
    import shutil

    repo_dir = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelNotFoundError(f"{repo_id} is not in the local Hugging Face cache ({hf_cache_dir()})")
    if filename is None:
        freed = sum(p.stat().st_size for p in (repo_dir / "blobs").glob("*") if p.is_file())
        shutil.rmtree(repo_dir)
        shutil.rmtree(hf_cache_dir() / ".locks" / repo_dir.name, ignore_errors=True)
        return freed
    links = [p for p in (repo_dir / "snapshots").glob(f"*/{filename}") if p.is_symlink() or p.is_file()]
    if not links:
        raise ModelNotFoundError(f"{repo_id} has no {filename} in the local Hugging Face cache")
    blobs = {p.resolve() for p in links}
    for p in links:
        p.unlink()
    still = {p.resolve() for p in (repo_dir / "snapshots").glob("*/*")}
    freed = 0
    for blob in blobs - still:
        if blob.is_file() and blob.parent.name == "blobs":
            freed += blob.stat().st_size
            blob.unlink()
    return freed
