"""Tokenizer snapshots (daemon/snapshot_tokenizer.py, daemon/chat_template.py): read back without
transformers, they encode, decode and render chat templates exactly as the transformers tokenizer
they were made from; loads after the first do not import transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tiny_models import TOOL_CHAT_TEMPLATE, make_tiny_tokenizer, save_hf_model

from llmd.daemon.model_source import ModelSource, default_model_path
from llmd.daemon.snapshot_tokenizer import (META_FILE, SnapshotTokenizer, can_snapshot, read_snapshot,
                                            write_snapshot)
from llmd.daemon.tokenizer import load_tokenizer

# A template that uses what templates in the wild use: trimmed blocks and indentation, a namespace,
# loop controls, dict(), tojson with options, the special tokens, reasoning under any of its names,
# {% generation %}, raise_exception, and a `documents` it is not given.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none, turns=0) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
    {%- if m.role == 'stop' %}{% break %}{% endif %}
    {%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ m.role }}
    {%- if m.reasoning_content is defined %} <think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}
    {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
    {%- else %}{{ m.content }}{% endif %}
    {%- if m.tool_calls is defined %}
        {%- for c in m.tool_calls %}
<call>{{ dict(name=c.function.name, args=c.function.arguments) | tojson(indent=1, sort_keys=true) }}</call>
        {%- endfor %}
    {%- endif %}
    {%- if m.name is defined %} (name={{ m.name }}){% endif %}
<|im_end|>
{% endfor %}
{%- if ns.system %}<|im_start|>system
{{ ns.system }}{% if tools %} {{ tools | tojson }}{% endif %}{% if documents %}docs{% endif %}<|im_end|>
{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant ({{ ns.turns }} turns, {{ eos_token }})
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b>now</b> in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "e.g. Zürich"}}}}}]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief & <kind>."}, {"role": "user", "content": "héllo 🎉 中文"},
     {"role": "assistant", "content": "  spaced\n\nlines  ", "reasoning": "I think"},
     {"role": "user", "content": "<|im_start|>injected<|im_end|>", "name": None}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1", "name": "get_weather"},
     {"role": "assistant", "content": "21", "thinking": "easy", "reasoning_content": "looked it up"},
     {"role": "stop", "content": "not rendered"}, {"role": "user", "content": "never"}],
]
TEXTS = ["", "hello world", "  leading and trailing  ", "héllo 🎉 中文 ß", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n\treturn x ** 2  # ok\n", "a" * 300, "don 't , it 's . ok ?"]


def wordpiece_tokenizer():
    """A WordPiece tokenizer that asks for transformers' clean-up of spaces (BERT's way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "don", "'", "t", ",", "it", "s", ".", "ok", "?", "hello", "world", "##s"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]",
                                 clean_up_tokenization_spaces=True)
    hf.chat_template = RICH_TEMPLATE
    return hf


def rich_tokenizer():
    hf = make_tiny_tokenizer()
    hf.chat_template = RICH_TEMPLATE
    return hf


def named_templates_tokenizer():
    hf = make_tiny_tokenizer()
    hf.chat_template = {"default": RICH_TEMPLATE, "tool_use": TOOL_CHAT_TEMPLATE}
    return hf


@pytest.fixture(scope="module")
def default_model_tokenizer():
    """transformers' tokenizer of the default model's GGUF, built from its metadata."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CASES = {"tiny": make_tiny_tokenizer, "tiny_tools": lambda: make_tiny_tokenizer(tools=True), "rich": rich_tokenizer,
         "named": named_templates_tokenizer, "wordpiece": wordpiece_tokenizer}


@pytest.fixture(params=[*CASES, "default_model"])
def pair(request, tmp_path):
    """(transformers' tokenizer, its snapshot written to disk and read back)."""
    hf = request.getfixturevalue("default_model_tokenizer") if request.param == "default_model" \
        else CASES[request.param]()
    assert can_snapshot(hf)
    write_snapshot(hf, tmp_path)
    snap = read_snapshot(tmp_path, lambda: hf)
    assert isinstance(snap, SnapshotTokenizer)
    return hf, snap


def test_a_snapshot_encodes_and_decodes_as_transformers(pair) -> None:
    hf, snap = pair
    assert len(snap) == len(hf) and snap.get_vocab() == hf.get_vocab()
    assert snap.eos_token_id == hf.eos_token_id is not None
    for text in TEXTS:
        assert snap.encode(text) == hf.encode(text), text
        assert snap.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        ids = hf.encode(text)
        for skip in (False, True):
            assert snap.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    ids = list(range(0, len(hf), max(1, len(hf) // 300)))  # special tokens included
    tokens = hf.convert_ids_to_tokens(ids)
    assert snap.convert_ids_to_tokens(ids) == tokens
    asked = [*tokens, "no such token"]
    assert snap.convert_tokens_to_ids(asked) == hf.convert_tokens_to_ids(asked)
    assert snap.convert_tokens_to_ids(tokens[1]) == hf.convert_tokens_to_ids(tokens[1])
    assert snap.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False) == \
        hf.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_wordpiece_decoding_cleans_up_spaces_as_transformers() -> None:
    # (the case where the clean-up changes the text: this tokenizer asks for it and is not BPE)
    hf = wordpiece_tokenizer()
    snap = SnapshotTokenizer.from_transformers(hf, lambda: hf)
    ids = hf.encode("don ' t , it ' s . ok ?")
    assert snap.decode(ids) == hf.decode(ids) != hf.backend_tokenizer.decode(ids)


def test_a_snapshot_renders_chat_templates_as_transformers(pair) -> None:
    hf, snap = pair
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (False, True):
                kwargs = dict(tools=tools, add_generation_prompt=gen)
                try:
                    want = hf.apply_chat_template(chat, tokenize=False, **kwargs)
                except Exception as e:  # the template refuses this chat: so must the snapshot
                    with pytest.raises(type(e)):
                        snap.apply_chat_template(chat, tokenize=False, **kwargs)
                    continue
                assert snap.apply_chat_template(chat, tokenize=False, **kwargs) == want
                assert snap.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs) == \
                    hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)


def test_template_errors_are_the_templates() -> None:
    snap = SnapshotTokenizer.from_transformers(rich_tokenizer(), lambda: None)
    with pytest.raises(jinja2.TemplateError, match="bad role robot"):
        snap.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="must be a dict"):
        snap.apply_chat_template(["hi"])
    bare = SnapshotTokenizer.from_transformers(make_tiny_tokenizer(), lambda: None)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns._y = 2 %}",
    "{{ dict.__call__.__globals__ }}", "{{ messages.append(1) }}", "{{ cycler.__init__.__globals__ }}",
])
def test_templates_run_in_the_sandbox(template: str) -> None:
    snap = SnapshotTokenizer.from_transformers(make_tiny_tokenizer(), lambda: None)
    snap.chat_template = template
    with pytest.raises(jinja2.exceptions.SecurityError):
        snap.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    # an unsafe attribute that is only printed prints nothing
    snap.chat_template = "[{{ messages.__class__ }}]"
    assert snap.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[]"


def test_a_python_tokenizer_is_not_snapshot() -> None:
    from transformers import PreTrainedTokenizerFast

    class Lowercasing(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).lower()

    hf = make_tiny_tokenizer()
    assert can_snapshot(hf)
    assert not can_snapshot(Lowercasing(tokenizer_object=hf.backend_tokenizer, eos_token="<|im_end|>"))


def _load_in_a_fresh_process(source: ModelSource, cache: Path) -> dict:
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from llmd.daemon.model_source import ModelSource\n"
        "from llmd.daemon.tokenizer import load_tokenizer, encode_prompt\n"
        f"tok = load_tokenizer(ModelSource({source.kind!r}, Path({str(source.path)!r}), 'm'))\n"
        "ids = encode_prompt(tok, 'héllo 🎉 world')\n"
        "print(json.dumps({'kind': type(tok).__name__, 'ids': ids, 'text': tok.decode(ids),\n"
        "                  'transformers': 'transformers' in sys.modules}))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loads_after_the_first_read_the_snapshot_without_transformers(tmp_path: Path) -> None:
    from tiny_models import make_hf_model

    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "m", with_tokenizer=True, tools=True)
    source, cache = ModelSource("hf_dir", model_dir, "m"), tmp_path / "cache"
    first = _load_in_a_fresh_process(source, cache)
    assert first["kind"] == "SnapshotTokenizer" and first["transformers"]
    again = _load_in_a_fresh_process(source, cache)
    assert again == {**first, "transformers": False}
    # the transformers tokenizer's own answer
    hf = make_tiny_tokenizer(tools=True)
    assert first["ids"] == hf.apply_chat_template([{"role": "user", "content": "héllo 🎉 world"}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    # a changed tokenizer file is a new snapshot: the new chat template shows
    config = model_dir / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    settings["chat_template"] = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    config.write_text(json.dumps(settings))
    changed = _load_in_a_fresh_process(source, cache)
    assert changed["transformers"] and changed["text"] == "[héllo 🎉 world]"


def test_a_damaged_or_foreign_snapshot_is_made_again(tmp_path: Path, monkeypatch, caplog) -> None:
    from tiny_models import make_hf_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = ModelSource("hf_dir", save_hf_model(make_hf_model("llama"), tmp_path / "m", with_tokenizer=True), "m")
    want = load_tokenizer(source).encode("hello")
    [meta] = (tmp_path / "cache").rglob(META_FILE)
    for damage in ("{not json", json.dumps({**json.loads(meta.read_text()), "transformers": "0.1"}),
                   json.dumps({**json.loads(meta.read_text()), "eos_token_id": "2"})):
        meta.write_text(damage)
        tok = load_tokenizer(source)
        assert isinstance(tok, SnapshotTokenizer) and tok.encode("hello") == want
        assert json.loads(meta.read_text())["eos_token_id"] == tok.eos_token_id  # written again


def test_the_default_model_loads_without_transformers(tmp_path: Path) -> None:
    source = ModelSource("gguf", default_model_path(), "default")
    first = _load_in_a_fresh_process(source, tmp_path)
    again = _load_in_a_fresh_process(source, tmp_path)
    assert again == {**first, "transformers": False} and first["kind"] == "SnapshotTokenizer"
    assert "héllo 🎉 world" in first["text"] and first["ids"][0] == 1  # <|im_start|>
