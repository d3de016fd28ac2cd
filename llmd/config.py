"""The config file, ``~/.config/llmd/config.toml``, and how it meets the command line.

Every daemon setting has one :class:`Option`: its default, how a value is checked, its flag and its
environment variable. The effective value of a setting is the flag if one was given, else the
environment variable (``LLMD_KV_CACHE_MB``...) if set, else the config file's, else the default;
:func:`resolve` also says where each value came from (``llmd config show``).

The file is flat TOML, one key per option (see ``llmd config show`` for the list)::

    model = "SmolLM2-135M-Instruct"   # a name from `llmd models`, a path or a cached repo id
    quant = "int4"
    kv_cache_mb = 2048
    idle_unload = 30                  # minutes

A ``[models."NAME"]`` table holds one model's own settings, used when that model is the one served
(``NAME`` as ``model`` names it; the default model's is ``SmolLM2-135M-Instruct``): the settings of
:data:`MODEL_OPTIONS` over the file's own (flags and environment variables still win), and the
sampling defaults of :data:`SAMPLING_DEFAULTS`, which requests get for what they leave out (as an
Ollama Modelfile's parameters)::

    [models."org/name-GGUF:Q4_K_M"]
    max_model_len = 4096
    kv_cache_dtype = "int8"
    temperature = 0.3
    top_p = 0.95

A ``[remote."NAME"]`` table serves the model ``NAME`` from an OpenAI-compatible server elsewhere (vLLM or
SGLang on a cluster): requests naming it are forwarded there (daemon/remote_model.py). The key is read
from an environment variable or a file, never written in the config file::

    [remote."llama-70b"]
    url = "https://gpu-box.example:8000/v1"   # the server's OpenAI base URL
    model = "meta-llama/Llama-3.3-70B-Instruct" # the id it serves the model under (default: NAME)
    api_key_env = "CLUSTER_API_KEY"           # or api_key_file = "~/.config/llmd/cluster.key"

``$LLMD_CONFIG`` names another file; ``$XDG_CONFIG_HOME`` moves the default one.
A systemd service sees neither the user's shell variables nor flags: the file is how it is set up.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.errors import LlmdError
from llmd import paths
from llmd.paths import config_dir, default_models_dir

CONFIG_ENV = "LLMD_CONFIG"
# What --quant takes (llmd.daemon.quantization builds each; the names live here, torch-free, so the
# CLI and the config file can check them without importing the runtime).
QUANT_SCHEMES = ("auto", "none", "int8", "int4", "nf4", "bnb-int8")
GROUPLESS_QUANT = ("none", "nf4", "bnb-int8")  # the schemes --group-size does not apply to


def check_quant_pair(scheme: str, group_size: int | None) -> None:
    """``--quant`` with ``--group-size``: each is checked by its option; this is the rule between
    them (the runtime's QuantConfig applies it too). Raises ``ValueError``."""
    if group_size is not None and scheme in GROUPLESS_QUANT:
        raise ValueError(f"--group-size does not apply to --quant {scheme}")


class ConfigError(LlmdError):
    """The config file cannot be read, or one of its keys has a bad value."""


def _whole(value: Any, minimum: int, maximum: int | None = None) -> int:
    """``maximum``: far beyond any real use, but a bound, so an absurd value is refused here, not
    after the model loaded (an allocation failing, or an integer msgpack cannot carry in ``info``)."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError("a whole number") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"a whole number >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"a whole number from {minimum} to {maximum}")
    return value


def _number(value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError("a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (low < value if low_open else low <= value) and value <= high):
        raise ValueError(f"a number in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a non-empty string")
    return value


class _Choice:
    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def __call__(self, value: Any) -> str:
        if value not in self.choices:
            raise ValueError("one of " + ", ".join(self.choices))
        return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _path(value: Any) -> str:
    return str(Path(_text(value)).expanduser())


def _file(value: Any) -> str:
    """A file's path, made absolute here: the background daemon does not share the command's directory."""
    return str(Path(_text(value)).expanduser().absolute())


def _tcp(value: Any) -> str:
    host, _, port = _text(value).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError("HOST:PORT, e.g. 127.0.0.1:7860")
    return value


def split_http_address(value: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (an IPv6 host in brackets) -> (host, port); the host defaults to 127.0.0.1,
    port 0 is a free one the system picks (``llmd status`` names it).

    Raises:
        ValueError: no port in 0..65535.
    """
    host, _, port = value.strip().rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError("[HOST:]PORT, e.g. 8000 or 127.0.0.1:8000")
    return host.strip("[]") or "127.0.0.1", int(port)


def _http(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `http = 8000` in the file
    split_http_address(_text(value))
    return value


def _origins(value: Any) -> tuple[str, ...]:
    """Web origins: a list, or the text of one separated by commas."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, str) for o in items):
        raise ValueError("origins like http://localhost:3000, separated by commas (or * for any)")
    origins = tuple(o.strip().rstrip("/") for o in items if o.strip())
    for o in origins:
        if o != "*" and not o.startswith(("http://", "https://", "app://", "tauri://", "chrome-extension://",
                                          "moz-extension://", "vscode-webview://")):
            raise ValueError(f"origins with a scheme (http://host:port), not {o!r}")
    return origins


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host`` (``*``, ``0.0.0.0`` and names that resolve elsewhere cannot)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface or host name: it may face the network


def _group_size(value: Any) -> int:
    size = _whole(value, 1)
    if size not in (32, 64, 128):
        raise ValueError("32, 64 or 128")
    return size


@dataclass(frozen=True, slots=True)
class Option:
    """One setting. ``parse`` checks a value from the file or a flag's text and returns it typed,
    or raises ``ValueError`` naming what it expects."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    metavar: str | None = None
    unset: str = "(not set)"  # what ``llmd config show`` says for a None default
    # Never on a command line (other users can read those): `llmd start` hands it to the daemon in its
    # environment, and `llmd config show` prints it masked.
    secret: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "LLMD_" + self.name.upper()

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.parse.choices if isinstance(self.parse, _Choice) else None


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("model", None, _text, "a name from `llmd models`, a .gguf file, a model directory or a cached repo id "
                                 "(default: SmolLM2-135M-Instruct)", "NAME|PATH", "(the default model)"),
    Option("device", "auto", _Choice("auto", "cpu", "cuda"), "where the model runs"),
    Option("dtype", "auto", _Choice("auto", "float32", "bfloat16", "float16"),
           "compute dtype; auto is bf16 where the CPU multiplies it natively, else fp32 (fp16 on CUDA)"),
    Option("quant", "auto", _Choice(*QUANT_SCHEMES),
           "how the projections are held: auto keeps a GGUF's own Q4_0/Q4_1/Q8_0 blocks and makes other "
           "weights INT4; int4, int8, none, or bitsandbytes' nf4 / bnb-int8"),
    Option("group_size", None, _group_size, "int4/int8 group size (int4 default 32; int8 default per channel)",
           unset="(per scheme)"),
    Option("weights_cache", True, _bool, "keep the weights as the CPU kernels hold them in $XDG_CACHE_HOME/llmd/"
                                         "weights after the first load, so later loads map them instead of "
                                         "converting the file"),
    Option("attention", "auto", _Choice("auto", "torch", "cpu", "triton"),
           "attention kernels: auto is Triton on CUDA, the native cpu kernel on the CPU (torch if it cannot "
           "be built); torch is the reference"),
    Option("kv_cache_mb", None, lambda v: _whole(v, 1, 2**24),  # 16 TiB
           "memory for the KV cache in MiB (default: CPU what max_num_seqs whole contexts need, at most a "
           "quarter of free RAM, reserved, the prefix cache keeping at most 1024 resident; GPU what "
           "gpu_memory_fraction leaves)", "MIB", "(sized at start)"),
    Option("gpu_memory_fraction", 0.8, lambda v: _number(v, 0.0, 1.0, low_open=True),
           "share of the GPU's memory llmd may use; the rest is left to the desktop", "F"),
    Option("kv_cache_dtype", "auto", _Choice("auto", "float32", "bfloat16", "float16", "int8"),
           "how the KV cache stores keys and values: auto is the model's dtype; int8 (a scale per token and head) "
           "holds ~2x the tokens of bf16 in the same memory"),
    Option("max_model_len", None, lambda v: _whole(v, 1, 2**24),
           "the context, prompt and output, in tokens (default and cap: the model's own)", "N", "(the model's)"),
    Option("block_size", 16, lambda v: _whole(v, 1, 1024), "tokens per KV block", "N"),
    # NOTE: per-row decode buffers and block tables are sized by max_num_seqs
    Option("max_num_seqs", 64, lambda v: _whole(v, 1, 4096), "requests running at once", "N"),
    Option("max_batched_tokens", 512, lambda v: _whole(v, 1, 2**20),
           "tokens per engine step, prompt chunks and decodes together", "N"),
    Option("prefix_cache", True, _bool, "reuse the KV blocks of shared prompt prefixes"),
    Option("cuda_graphs", False, _bool, "replay decode steps as CUDA graphs, one per batch size (CUDA with Triton "
                                        "attention; never run on a GPU yet, see README GPU status)"),
    Option("speculative", "ngram", _Choice("off", "ngram", "draft"),
           "speculative decoding: ngram drafts a request's next tokens from its own prompt and output, draft "
           "with --draft-model; verified in one step (off: never)"),
    Option("draft_model", None, _text, "the smaller model that drafts for --speculative draft: it must share the "
                                       "model's tokenizer (a name from `llmd models`, a path or a cached repo id)",
           "NAME|PATH", "(none)"),
    Option("chat_template", None, _file, "a Jinja chat template file to use instead of the model's own (one that "
                                         "renders tools, say)", "FILE", "(the model's)"),
    Option("max_queue_len", 256, lambda v: _whole(v, 1, 1_000_000),
           "waiting requests beyond which new ones are refused as overloaded", "N"),
    Option("max_loaded_models", 2, lambda v: _whole(v, 1, 64),
           "models the daemon holds loaded at once: a request naming another loads it, unloading the least "
           "recently used idle one when this many are loaded", "N"),
    Option("max_models_mb", 0, lambda v: _whole(v, 0, 2**24),
           "memory in MiB the loaded models' weights and KV pools may take in all (a pool counts what its prefix "
           "cache may keep resident, or what running sequences wrote; the least recently used idle one is "
           "unloaded to make room); 0: only max_loaded_models bounds them", "MIB"),
    Option("idle_unload", 0.0, lambda v: _number(v, 0.0, 60.0 * 24 * 365),
           "minutes without requests after which the model and KV cache are freed (reloaded on the next "
           "request); 0 keeps them loaded", "MINUTES"),
    Option("socket_dir", None, _path,
           "runtime directory for sockets and the connection file (default: $XDG_RUNTIME_DIR/llmd or "
           "/tmp/llmd-UID)", "DIR", "(per user)"),
    Option("tcp", None, _tcp, "also serve on TCP HOST:PORT (requests on PORT, stats on PORT+1; CURVE-encrypted "
                              "and signed; loopback only unless --allow-remote)", "HOST:PORT", "(off)"),
    Option("allow_remote", False, _bool, "let --tcp and --http bind an address other machines can reach"),
    Option("http", None, _http, "also serve the OpenAI and Ollama HTTP APIs on [HOST:]PORT (loopback only unless "
                                "--allow-remote)", "[HOST:]PORT", "(off)"),
    Option("api_key", None, _text, "with --http: require Authorization: Bearer KEY (better set as LLMD_API_KEY or "
                                   "in the config file: a flag shows in `ps`)", "KEY", "(none)", secret=True),
    Option("http_origins", (), _origins, "web pages (origins, comma-separated, or *) allowed to call the HTTP API; "
                                         "pages on this machine always are, but only these get CORS",
           "ORIGINS", "(none)"),
    Option("models_dir", None, _path, "where `llmd models` looks for .gguf files (default: "
                                      "$XDG_DATA_HOME/llmd/models)", "DIR", "(per user)"),
)}


# What a [models."NAME"] table may set: how that model is loaded and run...
MODEL_OPTIONS = ("dtype", "quant", "group_size", "attention", "kv_cache_mb", "kv_cache_dtype", "max_model_len",
                 "max_num_seqs", "speculative", "draft_model", "chat_template")
# ...and the sampling parameters its requests get unless they say otherwise, checked as requests' are
SAMPLING_DEFAULTS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": lambda v: _whole(v, 1, 2**24), "temperature": lambda v: _number(v, 0.0, 100.0),
    "top_k": lambda v: _whole(v, 0, 2**24), "top_p": lambda v: _number(v, 0.0, 1.0, low_open=True),
    "min_p": lambda v: _number(v, 0.0, 1.0), "repetition_penalty": lambda v: _number(v, 0.0, 100.0, low_open=True),
    "presence_penalty": lambda v: _number(v, -2.0, 2.0), "frequency_penalty": lambda v: _number(v, -2.0, 2.0),
}
DEFAULT_MODEL_TABLE = "SmolLM2-135M-Instruct"  # the default model's table (llmd.daemon.model_source's alias)


@dataclass(frozen=True, slots=True)
class ModelTable:
    """A ``[models."NAME"]`` table: its settings (MODEL_OPTIONS, checked) and sampling defaults."""

    settings: dict[str, Any]
    sampling: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RemoteTable:
    """A ``[remote."NAME"]`` table: a model an OpenAI-compatible server elsewhere serves. Raises
    ``ValueError`` on nonsense (named by its key)."""

    url: str  # the server's OpenAI base URL (``.../v1``), without a trailing slash
    model: str  # the id the server knows the model by
    api_key_env: str | None = None  # the environment variable holding the API key
    api_key_file: str | None = None  # or the file holding it
    connect_timeout: float = 10.0  # seconds to connect
    read_timeout: float = 300.0  # seconds the server may stay silent (a long prompt's prefill on a busy cluster)
    context_length: int | None = None  # what `info` reports as its max_model_len (None: unknown here)

    def __post_init__(self) -> None:
        _remote_url(self.url)
        _text(self.model)
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("api_key_env or api_key_file, not both")
        if self.api_key_env is not None and not self.api_key_env.replace("_", "a").isalnum():
            raise ValueError("api_key_env names an environment variable (letters, digits, _)")
        if not 0 < self.connect_timeout <= 3600 or not 0 < self.read_timeout <= 86400:
            raise ValueError("the timeouts are seconds: connect_timeout in (0, 3600], read_timeout in (0, 86400]")


def _remote_url(value: Any) -> str:
    """An http(s) base URL without credentials, query or fragment (the key goes in api_key_env)."""
    from urllib.parse import urlsplit

    text = _text(value).strip().rstrip("/")
    try:
        parts = urlsplit(text)
        parts.port  # (raises on a bad port)
    except ValueError:
        raise ValueError("an http(s) URL such as https://host:8000/v1") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("an http(s) URL such as https://host:8000/v1")
    if parts.username or parts.password:
        raise ValueError("a URL without credentials (put the key in api_key_env or api_key_file)")
    if parts.query or parts.fragment:
        raise ValueError("a base URL without ?query or #fragment")
    return text


REMOTE_KEYS: dict[str, Callable[[Any], Any]] = {
    "url": _remote_url, "model": _text, "api_key_env": _text, "api_key_file": _path,
    "connect_timeout": lambda v: _number(v, 0.0, 3600.0, low_open=True),
    "read_timeout": lambda v: _number(v, 0.0, 86400.0, low_open=True),
    "context_length": lambda v: _whole(v, 2, 2**24),
}


def config_path() -> Path:
    """``$LLMD_CONFIG``, else ``$XDG_CONFIG_HOME/llmd/config.toml`` (``~/.config/llmd/config.toml``)."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    return config_dir() / "config.toml"


def read_config_file(path: Path | None = None) -> dict[str, Any]:
    """The file's settings, checked and typed; ``{}`` when there is no file.

    Raises:
        ConfigError: unreadable file, bad TOML, an unknown key or a bad value (named in the message).
    """
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if os.environ.get(CONFIG_ENV):
            raise ConfigError(f"config file {path} (from ${CONFIG_ENV}) does not exist") from None
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "models":
            values[key] = _model_tables(value, path)
            continue
        if key == "remote":
            values[key] = _remote_tables(value, path)
            continue
        option = OPTIONS.get(key)
        if option is None:
            close = difflib.get_close_matches(key, [*OPTIONS, "models", "remote"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else \
                f"; known keys: {', '.join(OPTIONS)}, [models.\"NAME\"], [remote.\"NAME\"]"
            raise ConfigError(f"config file {path}: unknown key {key!r}{hint}")
        try:
            values[key] = option.parse(value)
        except ValueError as e:
            raise ConfigError(f"config file {path}: {key} must be {e}, got {value!r}") from None
    return values


def _model_tables(raw: Any, path: Path) -> dict[str, ModelTable]:
    """The file's ``[models."NAME"]`` tables, checked, by NAME folded to lower case.

    Raises:
        ConfigError: not tables, an unknown key, or a bad value (named with its table).
    """
    if not isinstance(raw, dict) or not all(isinstance(t, dict) for t in raw.values()):
        raise ConfigError(f'config file {path}: models holds tables, one per model: [models."NAME"]')
    tables: dict[str, ModelTable] = {}
    for name, table in raw.items():
        where = f'config file {path}: [models."{name}"]'
        settings, sampling = {}, {}
        for key, value in table.items():
            if key in SAMPLING_DEFAULTS or key in MODEL_OPTIONS:
                try:
                    if key in SAMPLING_DEFAULTS:
                        sampling[key] = SAMPLING_DEFAULTS[key](value)
                    else:
                        settings[key] = OPTIONS[key].parse(value)
                except ValueError as e:
                    raise ConfigError(f"{where}: {key} must be {e}, got {value!r}") from None
            else:
                known = (*MODEL_OPTIONS, *SAMPLING_DEFAULTS)
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; a model's table takes {', '.join(known)}"
                raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        tables[name.casefold()] = ModelTable(settings, sampling)
    return tables


def _remote_tables(raw: Any, path: Path) -> dict[str, RemoteTable]:
    """The file's ``[remote."NAME"]`` tables, checked, by NAME (requests match it in any case).

    Raises:
        ConfigError: not tables, a missing url, an unknown key, or a bad value (named with its table).
    """
    if not isinstance(raw, dict) or not all(isinstance(t, dict) for t in raw.values()):
        raise ConfigError(f'config file {path}: remote holds tables, one per model: [remote."NAME"]')
    tables: dict[str, RemoteTable] = {}
    for name, table in raw.items():
        where = f'config file {path}: [remote."{name}"]'
        if not name.strip() or len(name) > 1024:
            raise ConfigError(f"{where}: a remote model's name is 1 to 1024 characters")
        fields_: dict[str, Any] = {}
        for key, value in table.items():
            if key not in REMOTE_KEYS:
                close = difflib.get_close_matches(key, REMOTE_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; a remote table takes {', '.join(REMOTE_KEYS)}"
                raise ConfigError(f"{where}: unknown key {key!r}{hint}")
            try:
                fields_[key] = REMOTE_KEYS[key](value)
            except ValueError as e:
                raise ConfigError(f"{where}: {key} must be {e}, got {value!r}") from None
        if "url" not in fields_:
            raise ConfigError(f'{where}: url is missing (the server\'s OpenAI base URL, e.g. "https://host:8000/v1")')
        try:
            tables[name] = RemoteTable(**{"model": name, **fields_})
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return tables


def remote_tables(path: Path | None = None) -> dict[str, RemoteTable]:
    """The config file's remote models (``[remote."NAME"]``), by name.

    Raises:
        ConfigError: the config file is bad.
    """
    return read_config_file(path).get("remote", {})


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_env() -> dict[str, Any]:
    """The settings given as ``LLMD_<NAME>`` environment variables (empty ones are ignored).

    Raises:
        ConfigError: a variable's value is bad (the variable is named).
    """
    values: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        text = os.environ.get(option.env, "").strip()
        if not text:
            continue
        value: Any = text
        if option.parse is _bool:  # text, not TOML: accept the usual spellings
            value = True if text.lower() in _TRUE else False if text.lower() in _FALSE else text
        try:
            values[name] = option.parse(value)
        except ValueError as e:
            raise ConfigError(f"${option.env} must be {e}, got {text!r}") from None
    return values


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective settings: ``values[name]`` and where each came from (``sources[name]``: the
    flag, ``config file PATH``, its model's table or ``default``); ``sampling``: the served model's
    sampling defaults (its table's); ``remotes``: the file's remote models (``[remote."NAME"]``)."""

    values: dict[str, Any]
    sources: dict[str, str]
    sampling: dict[str, Any] = field(default_factory=dict)
    remotes: dict[str, RemoteTable] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def table(self) -> str:
        width = max(map(len, self.values))
        lines = []
        for name, value in self.values.items():
            option = OPTIONS[name]
            shown = option.unset if value is None else ("(set, hidden)" if option.secret else "true" if value is True
                                                        else "false" if value is False
                                                        else ", ".join(value) or option.unset
                                                        if isinstance(value, tuple) else str(value))
            lines.append(f"{name:<{width}}  {shown:<28} {self.sources[name]}")
        return "\n".join(lines)


def resolve(flags: Mapping[str, Any], path: Path | None = None) -> Settings:
    """Merge ``flags`` (option name -> value, None where the flag was not given) over the
    environment over the config file over the defaults.

    Raises:
        ConfigError: the config file or an ``LLMD_*`` variable is bad.
    """
    path = path or config_path()
    file_values = read_config_file(path)
    env_values = read_env()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, option in OPTIONS.items():
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], option.flag
        elif name in env_values:
            values[name], sources[name] = env_values[name], f"${option.env}"
        elif name in file_values:
            values[name], sources[name] = file_values[name], f"config file {path}"
        else:
            values[name], sources[name] = option.default, "default"
    # the served model's own table: over the file's settings, under the flags and the environment
    model = values["model"] if values["model"] not in (None, "", "default") else DEFAULT_MODEL_TABLE
    table = file_values.get("models", {}).get(str(model).casefold())
    remotes = file_values.get("remote", {})
    if table is None:
        return Settings(values, sources, remotes=remotes)
    for name, value in table.settings.items():
        if flags.get(name) is None and name not in env_values:
            values[name], sources[name] = value, f'config file {path} [models."{model}"]'
    return Settings(values, sources, dict(table.sampling), remotes)


def setting(name: str) -> Any:
    """One setting from the environment, else the config file, else its default (for code without
    flags, e.g. clients looking for the socket dir)."""
    return resolve({}).values[name]


def runtime_dir(override: str | os.PathLike[str] | None = None, create: bool = True) -> Path:
    """llmd.paths.runtime_dir with the config file's (or ``$LLMD_SOCKET_DIR``'s) ``socket_dir`` in
    its order: ``--socket-dir``, ``$LLMD_RUNTIME_DIR``, the setting, ``$XDG_RUNTIME_DIR/llmd``,
    ``/tmp/llmd-<uid>``.

    Raises:
        LlmdError: a directory that is not private to us; a bad config file (ConfigError).
    """
    return paths.runtime_dir(override, create, configured=lambda: setting("socket_dir"))


def models_dir() -> Path:
    """Where .gguf files are looked up by name: the config file's ``models_dir``, else
    ``$XDG_DATA_HOME/llmd/models``."""
    configured = setting("models_dir")
    return Path(configured) if configured is not None else default_models_dir()
