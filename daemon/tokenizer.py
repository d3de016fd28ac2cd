"""Tokenizers and prompts: load the model's tokenizer, apply its chat template, find stop tokens.

For GGUF files transformers builds the tokenizer from the metadata, which takes seconds; the result
is cached under ``$XDG_CACHE_HOME/llmd/tokenizers`` keyed by the file's real path, size and mtime.
Every tokenizer transformers loads is snapshot there too (llmd/daemon/snapshot_tokenizer.py), so
later starts read it without importing transformers.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from llmd import paths
from llmd.daemon.model_config import ModelConfig
from llmd.daemon.model_source import ModelSource
from llmd.daemon.snapshot_tokenizer import SnapshotTokenizer, can_snapshot, read_snapshot, write_snapshot
from llmd.errors import InvalidModelError

log = logging.getLogger("llmd")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# what a model directory's tokenizer may be read from (its snapshot is made again when one changes)
_TOKENIZER_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")


def _cache_dir() -> Path:
    return paths.cache_home() / "tokenizers"


def load_tokenizer(source: ModelSource) -> Any:
    """The model's tokenizer: a :class:`SnapshotTokenizer` of what transformers builds (read back
    without importing transformers after the first load), or transformers' own where a snapshot
    would not be exact (a class that encodes or decodes in Python).

    Raises:
        InvalidModelError: no usable tokenizer (files, or a GGUF's metadata).
    """
    try:
        directory = _cache_dir() / _cache_key(source)
    except OSError:  # no such file or directory: transformers' load says so in its own words
        return _load_with_transformers(source, _cache_dir() / "unreadable")
    # (the transformers tokenizer, made again only if something needs it: xgrammar reads its vocabulary)
    def again() -> Any:
        return _load_with_transformers(source, directory)

    snapshot = read_snapshot(directory, again)
    if snapshot is not None:
        return snapshot
    hf = _load_with_transformers(source, directory)
    if not can_snapshot(hf):
        return hf
    try:
        write_snapshot(hf, directory)
    except OSError as e:  # a read-only home only costs time
        log.warning("cannot cache the tokenizer in %s: %s", directory, e)
    return SnapshotTokenizer.from_transformers(hf, again)


def _cache_key(source: ModelSource) -> str:
    # keyed by the files themselves, not the names they were found by: the HF cache's snapshot links
    # and any other link to one file share one build
    real = source.path.resolve()
    if source.kind == "gguf":
        st = real.stat()
        return hashlib.sha256(f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    files = sorted(p for p in real.iterdir() if p.suffix in _TOKENIZER_SUFFIXES and p.is_file())
    stats = [f"{p.name}:{st.st_size}:{st.st_mtime_ns}" for p in files for st in (p.stat(),)]
    return "dir-" + hashlib.sha256("\n".join([str(real), *stats]).encode()).hexdigest()[:24]


def _load_with_transformers(source: ModelSource, cached: Path) -> Any:
    """transformers' tokenizer of ``source``; a GGUF's is built from its metadata once and saved
    in ``cached`` (it takes seconds, holding the GIL: a daemon's other models pause)."""
    # (AutoTokenizer is imported only where it is used: its model lookup reads a thousand of
    # transformers' files, 0.6 s a start that a GGUF's cached tokenizer does without)
    if source.kind == "hf_dir":
        from transformers import AutoTokenizer

        if not any((source.path / name).is_file() for name in _TOKENIZER_FILES):
            raise InvalidModelError(
                f"{source.path} has no tokenizer ({' or '.join(_TOKENIZER_FILES)}); copy the model's "
                "tokenizer files next to config.json"
            )
        try:
            return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidModelError(f"{source.path} has no usable tokenizer: {reason}") from None
    if (cached / "tokenizer_config.json").is_file():
        from transformers import PreTrainedTokenizerFast

        try:
            # (the cache holds what a GGUF builds: a fast tokenizer)
            return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError, TypeError):
            log.warning("tokenizer cache %s is unreadable; rebuilding it", cached)
    log.info("building the tokenizer from %s (once; it is cached)", source.path.name)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidModelError(f"{source.path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError as e:  # a read-only home only costs time
        log.warning("cannot cache the tokenizer in %s: %s", cached, e)
    return tokenizer


MAX_TEMPLATE_CHARS = 256 * 1024


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """The chat template in the file ``path`` (``--chat-template``), read before any model loads.

    Raises:
        InvalidModelError: the file cannot be read, or is empty or too large.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise InvalidModelError(f"cannot read the chat template {path}: {reason}") from None
    if not text.strip() or len(text) > MAX_TEMPLATE_CHARS:
        raise InvalidModelError(f"the chat template {path} must be 1 to {MAX_TEMPLATE_CHARS} characters of Jinja")
    return text


def use_chat_template(tokenizer: Any, template: str, path: str | os.PathLike[str]) -> None:
    """Give ``tokenizer`` ``template`` (read from ``path``) instead of its own chat template, checked
    by rendering a chat with it.

    Raises:
        InvalidModelError: the template does not render a chat (the tokenizer keeps its own).
    """
    previous, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        # (a user's message alone: some templates refuse a system role)
        tokenizer.apply_chat_template([{"role": "user", "content": "u"}], add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateError and what the template's own author raises
        tokenizer.chat_template = previous
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidModelError(f"the chat template {path} does not render a chat: {reason}") from None


def stop_token_ids(tokenizer: Any, config: ModelConfig) -> set[int]:
    """Tokens that end a generation: the generation config's EOS ids, else the tokenizer's."""
    ids = set(config.eos_token_ids)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                   ) -> list[int]:
    """The token ids of ``messages`` through the model's chat template, the assistant's turn opened
    (the one place a conversation becomes tokens: the daemon, ``llmd.LLM`` and the CLI call this),
    with ``tools`` for the template to render (daemon/tool_calls.py). The caller checks
    :func:`has_chat_template` first, for its own message.

    Raises:
        ValueError: the template refused the messages (e.g. roles that do not alternate).
    """
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as e:  # templates raise what their authors wrote (jinja2's TemplateError, ...)
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return [int(i) for i in ids]


def encode_prompt(tokenizer: Any, prompt: str, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``: through the chat template when ``chat`` (default: if the model has
    one), else raw text with the tokenizer's usual special tokens."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        if not has_chat_template(tokenizer):
            raise InvalidModelError("this model has no chat template; use --raw")
        try:
            return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
        except ValueError as e:
            raise InvalidModelError(str(e)) from None
    return [int(i) for i in tokenizer.encode(prompt)]
