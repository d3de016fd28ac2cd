"""A model's tokenizer as transformers built it, read back without importing transformers.

Importing transformers costs a daemon's start ~0.8 s and ~22 MiB, for a tokenizer whose work is
done by the ``tokenizers`` library's Rust anyway. So the first load of a model's tokenizer goes
through transformers, and what it made is written to a snapshot: the Rust tokenizer as it stood
after transformers set it up (special tokens added, post-processor set), the named special tokens,
the chat template and whether decoding cleans up spaces. Later loads read the snapshot with
``tokenizers`` and render the template with :mod:`llmd.daemon.chat_template`.

Only tokenizers whose encode and decode are the Rust tokenizer's are snapshot: a transformers
class that overrides them in Python (:func:`can_snapshot`) keeps transformers. A snapshot names the
transformers version that made it; another version makes a new one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from llmd.daemon.chat_template import render_chat

log = logging.getLogger("llmd")

SNAPSHOT_VERSION = 1  # the files' layout; another makes a new snapshot
BACKEND_FILE, META_FILE = "llmd-backend.json", "llmd-tokenizer.json"
# what a tokenizer class must not override for the Rust tokenizer's results to be its own
_ENCODE_DECODE = ("__call__", "encode", "decode", "batch_decode", "_decode", "_encode_plus", "_batch_encode_plus",
                  "apply_chat_template", "get_vocab", "__len__", "convert_ids_to_tokens", "tokenize")


def transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def can_snapshot(hf: Any) -> bool:
    """True when ``hf`` (a transformers tokenizer) encodes and decodes exactly as its Rust tokenizer:
    a fast tokenizer with no Python override of those between its class and transformers' base."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf, PreTrainedTokenizerFast) or getattr(hf, "split_special_tokens", False):
        return False
    for cls in type(hf).__mro__:
        if cls is PreTrainedTokenizerFast:
            return True
        if any(name in vars(cls) for name in _ENCODE_DECODE):
            return False
    return False


def _clean_up(text: str) -> str:
    # transformers' clean_up_tokenization, for tokenizers that ask for it (WordPiece's)
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class SnapshotTokenizer:
    """The parts of a transformers tokenizer llmd uses, over the Rust tokenizer alone.

    Args:
        backend: the ``tokenizers.Tokenizer``.
        meta: the snapshot's metadata (:func:`write_snapshot` says what it holds).
        transformers_tokenizer: makes the transformers tokenizer again, for what needs one
            (xgrammar's vocabulary reader), at each :meth:`transformers` (not kept: ~22 MiB).
    """

    def __init__(self, backend: Any, meta: Mapping[str, Any], transformers_tokenizer: Callable[[], Any]) -> None:
        backend.no_truncation()
        backend.no_padding()
        self.backend_tokenizer = backend
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.special_tokens_map: dict[str, str] = dict(meta["special_tokens"])
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.clean_up_tokenization_spaces: bool = meta["clean_up"]
        self._make_transformers = transformers_tokenizer

    @classmethod
    def from_transformers(cls, hf: Any, transformers_tokenizer: Callable[[], Any]) -> SnapshotTokenizer:
        """The snapshot of ``hf`` (checked by :func:`can_snapshot`), in memory."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(hf.backend_tokenizer.to_str()), _meta(hf), transformers_tokenizer)

    def transformers(self) -> Any:
        """The transformers tokenizer this is a snapshot of, made again (imports transformers: ~1 s)."""
        return self._make_transformers()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        text = self.backend_tokenizer.decode([ids] if isinstance(ids, int) else ids,
                                             skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        return _clean_up(text) if clean else text

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Each token's id; one not in the vocabulary is the unknown token's (None without one)."""
        unk = self.special_tokens_map.get("unk_token")
        unk_id = None if unk is None else self.backend_tokenizer.token_to_id(unk)

        def one(token: str) -> int | None:
            found = self.backend_tokenizer.token_to_id(token)
            return unk_id if found is None else found

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = False,
                            **variables: Any) -> str | list[int] | dict[str, list[int]]:
        """``conversation`` through the chat template (as transformers', for the arguments llmd passes).

        Raises:
            ValueError: no chat template, or a message that is not a dict.
            jinja2.TemplateError: what the template raises.
        """
        text = render_chat(self.chat_template, conversation, tools, add_generation_prompt,
                           **{**self.special_tokens_map, **variables})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)  # the template writes the special tokens
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def _meta(hf: Any) -> dict[str, Any]:
    clean = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    # transformers 5 ignores the clean-up for BPE models unless told it may corrupt their text
    if clean and type(hf.backend_tokenizer.model).__name__ == "BPE" and \
            getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None) is False:
        clean = False
    template = hf.chat_template
    return {"version": SNAPSHOT_VERSION, "transformers": transformers_version(),
            "chat_template": dict(template) if isinstance(template, Mapping) else template,
            "special_tokens": {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)},
            "eos_token_id": None if hf.eos_token_id is None else int(hf.eos_token_id), "clean_up": clean}


def _check_meta(meta: dict[str, Any]) -> None:
    template, special, eos = meta["chat_template"], meta["special_tokens"], meta["eos_token_id"]
    if not (template is None or isinstance(template, str) or
            (isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))):
        raise ValueError("chat_template is not a template")
    if not isinstance(special, dict) or not all(isinstance(v, str) for v in special.values()):
        raise ValueError("special_tokens is not a map of strings")
    if not (eos is None or type(eos) is int) or type(meta["clean_up"]) is not bool:
        raise ValueError("eos_token_id or clean_up has the wrong type")


def write_snapshot(hf: Any, directory: Path) -> None:
    """Write ``hf``'s snapshot (checked by :func:`can_snapshot`) into ``directory``: the Rust
    tokenizer's JSON and the metadata (version, transformers' version, chat template, named special
    tokens, EOS id, clean-up). Each file is written whole or not at all.

    Raises:
        OSError: cannot write there.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in ((BACKEND_FILE, hf.backend_tokenizer.to_str()), (META_FILE, json.dumps(_meta(hf)))):
        part = directory / f"{name}.{os.getpid()}.part"
        part.write_text(text, encoding="utf-8")
        os.replace(part, directory / name)


def read_snapshot(directory: Path, transformers_tokenizer: Callable[[], Any]) -> SnapshotTokenizer | None:
    """The snapshot in ``directory``, or None when there is none, it is unreadable, or another
    layout or transformers version made it."""
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("version") != SNAPSHOT_VERSION:
            return None
        if meta.get("transformers") != transformers_version():
            return None
        _check_meta(meta)
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(directory / BACKEND_FILE))
        return SnapshotTokenizer(backend, meta, transformers_tokenizer)
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged file: OSError, ValueError..., and tokenizers raises a bare Exception
        log.warning("tokenizer snapshot %s is unreadable (%s); rebuilding it", directory, e)
        return None
