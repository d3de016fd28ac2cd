"""The local Hugging Face hub cache: where it is and which snapshot of a repo it holds. llmd reads
it, never downloads into it (``--model org/name`` of a cached repo, and ``llmd models``)."""

from __future__ import annotations

from pathlib import Path


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
