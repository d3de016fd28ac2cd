"""The config file: flags over file over defaults, where each value came from, and one clear line
naming the key when the file is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmd.cli import main
from llmd.config import OPTIONS, ConfigError, config_path, read_config_file, resolve


def write_config(text: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_file_lives_in_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config_path() == tmp_path / "llmd" / "config.toml"
    monkeypatch.setenv("LLMD_CONFIG", str(tmp_path / "other.toml"))
    assert config_path() == tmp_path / "other.toml"


def test_no_file_means_defaults() -> None:
    settings = resolve({})
    assert settings.values == {name: o.default for name, o in OPTIONS.items()}
    assert set(settings.sources.values()) == {"default"}


def test_flags_override_the_file_which_overrides_defaults() -> None:
    path = write_config('model = "tiny"\nkv_cache_mb = 2048\nprefix_cache = false\nidle_unload = 2.5\n'
                        'socket_dir = "~/sockets"\n')
    settings = resolve({"kv_cache_mb": 64, "max_num_seqs": None})
    assert settings["kv_cache_mb"] == 64 and settings.sources["kv_cache_mb"] == "--kv-cache-mb"
    assert settings["model"] == "tiny" and settings.sources["model"] == f"config file {path}"
    assert settings["prefix_cache"] is False and settings["idle_unload"] == 2.5
    assert settings["socket_dir"] == str(Path("~/sockets").expanduser())
    assert settings["max_num_seqs"] == 64 and settings.sources["max_num_seqs"] == "default"


def test_environment_sits_between_the_file_and_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config("max_num_seqs = 8\nblock_size = 32\nprefix_cache = true\n")
    monkeypatch.setenv("LLMD_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("LLMD_BLOCK_SIZE", "")  # empty: not set
    monkeypatch.setenv("LLMD_PREFIX_CACHE", "off")
    monkeypatch.setenv("LLMD_QUANT", "int8")
    settings = resolve({"quant": "int4"})
    assert (settings["max_num_seqs"], settings.sources["max_num_seqs"]) == (12, "$LLMD_MAX_NUM_SEQS")
    assert (settings["block_size"], settings.sources["block_size"]) == (32, f"config file {path}")
    assert (settings["prefix_cache"], settings.sources["prefix_cache"]) == (False, "$LLMD_PREFIX_CACHE")
    assert (settings["quant"], settings.sources["quant"]) == ("int4", "--quant")


@pytest.mark.parametrize("name, text", [("LLMD_KV_CACHE_MB", "lots"), ("LLMD_PREFIX_CACHE", "maybe"),
                                        ("LLMD_DEVICE", "tpu"), ("LLMD_MAX_QUEUE_LEN", "10000000")])
def test_a_bad_variable_is_named(name: str, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=rf"^\${name} must be .*, got '{text}'$"):
        resolve({})


@pytest.mark.parametrize("text, key", [
    ("kv_cache_mb = -5\n", "kv_cache_mb"),
    ('kv_cache_mb = "lots"\n', "kv_cache_mb"),
    ('quant = "int3"\n', "quant"),
    ("prefix_cache = 1\n", "prefix_cache"),
    ("group_size = 48\n", "group_size"),
    ('tcp = "localhost"\n', "tcp"),
    ("gpu_memory_fraction = 0\n", "gpu_memory_fraction"),
    ("max_num_seqs = true\n", "max_num_seqs"),
    ("max_num_seqs = 100000000000000000000000\n", "max_num_seqs"),  # the file is bounded as the flags are
    ("block_size = 1073741824\n", "block_size"),
    ("allow_remote = \"yes\"\n", "allow_remote"),
    ('model = ""\n', "model"),
    ('http = "localhost"\n', "http"),
    ("http = 70000\n", "http"),
    ('http_origins = ["evil.example"]\n', "http_origins"),
    ("http_origins = 3\n", "http_origins"),
])
def test_a_bad_value_names_its_key(text: str, key: str) -> None:
    path = write_config(text)
    with pytest.raises(ConfigError) as err:
        read_config_file()
    message = str(err.value)
    assert str(path) in message and f"{key} must be" in message


def test_an_unknown_key_gets_a_suggestion() -> None:
    write_config("kv_cache_megabytes = 10\n")
    with pytest.raises(ConfigError, match=r"unknown key 'kv_cache_megabytes' \(did you mean 'kv_cache_mb'\?\)"):
        read_config_file()


def test_bad_toml_says_where() -> None:
    write_config("model = \n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*line 1"):
        read_config_file()


def test_a_missing_llmd_config_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file()


def test_config_show_prints_values_and_sources(capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config("max_queue_len = 9\n")
    assert main(["config", "show", "--block-size", "32"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["max_queue_len"].split()[1:] == ["9", "config", "file", str(path)]
    assert lines["block_size"].split()[1:] == ["32", "--block-size"]
    assert lines["max_num_seqs"].split()[1:] == ["64", "default"]
    assert main(["config", "show", "--json", "--no-prefix-cache"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["values"]["prefix_cache"] is False and shown["sources"]["prefix_cache"] == "--prefix-cache"
    assert shown["values"]["max_queue_len"] == 9 and shown["config_file"] == str(path)


def test_config_show_names_the_remote_models_and_where_their_keys_come_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIG_KEY", "sk-never-shown")
    write_config('[remote."big"]\nurl = "https://gpu:8000/v1"\napi_key_env = "BIG_KEY"\nread_timeout = 60\n')
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "remote model big: big at https://gpu:8000/v1, key $BIG_KEY, timeouts 10s to connect, 60s silent" in out
    assert main(["config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["remote"]["big"]["key"] == "$BIG_KEY" and shown["remote"]["big"]["read_timeout"] == 60
    assert "sk-never-shown" not in out + json.dumps(shown)


def test_a_bad_file_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    write_config("max_num_seqs = 0\n")
    assert main(["config", "show"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmd: error: config file") and "max_num_seqs must be a whole number >= 1" in err
    assert "\n" not in err
    # Every command that reads settings fails the same way, before doing anything.
    assert main(["start", "--foreground"]) == 1
    assert "max_num_seqs must be" in capsys.readouterr().err


def test_a_bad_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", "--idle-unload", "-1"])
    assert exit_.value.code == 2
    assert "--idle-unload" in capsys.readouterr().err


def test_socket_dir_of_the_file_is_where_clients_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmd.config import runtime_dir

    monkeypatch.delenv("LLMD_RUNTIME_DIR", raising=False)
    write_config(f'socket_dir = "{tmp_path / "sock"}"\n')
    assert runtime_dir() == tmp_path / "sock"
    assert runtime_dir(tmp_path / "flag") == tmp_path / "flag"  # --socket-dir still wins


def test_http_settings_and_a_hidden_key(capsys: pytest.CaptureFixture[str]) -> None:
    write_config('http = 8000\nhttp_origins = ["http://localhost:3000/", "https://my.app"]\napi_key = "s3cret"\n')
    values = read_config_file()
    assert values["http"] == "8000" and values["http_origins"] == ("http://localhost:3000", "https://my.app")
    assert resolve({"http_origins": OPTIONS["http_origins"].parse("*, https://a.b")})["http_origins"] == ("*", "https://a.b")
    # The key is a secret: `config show` says it is set, never what it is.
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "(set, hidden)" in out and "http://localhost:3000, https://my.app" in out
    assert main(["config", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"]["api_key"] == "(set, hidden)"


def test_a_models_table_applies_to_its_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """[models."NAME"]: its settings over the file's own when NAME is the model served (any case), under
    the environment and the flags; its sampling defaults in Settings.sampling; another model gets none."""
    path = write_config('kv_cache_mb = 300\nquant = "int8"\n'
                        '[models."org/Tiny-GGUF:Q8_0"]\nkv_cache_mb = 100\nmax_model_len = 512\n'
                        'kv_cache_dtype = "int8"\ntemperature = 0.2\nmax_tokens = 64\n'
                        '[models."SmolLM2-135M-Instruct"]\ntop_p = 0.5\n')
    table = f'config file {path} [models."org/tiny-gguf:q8_0"]'
    settings = resolve({"model": "org/tiny-gguf:q8_0", "max_model_len": 256})
    assert (settings["kv_cache_mb"], settings.sources["kv_cache_mb"]) == (100, table)
    assert (settings["kv_cache_dtype"], settings["quant"]) == ("int8", "int8")  # the file's own where it says nothing
    assert (settings["max_model_len"], settings.sources["max_model_len"]) == (256, "--max-model-len")
    assert settings.sampling == {"temperature": 0.2, "max_tokens": 64}
    monkeypatch.setenv("LLMD_KV_CACHE_MB", "50")
    assert resolve({"model": "org/tiny-gguf:q8_0"})["kv_cache_mb"] == 50
    other = resolve({"model": "org/other"})
    assert other["kv_cache_mb"] == 50 and other["max_model_len"] is None and other.sampling == {}
    assert resolve({}).sampling == {"top_p": 0.5}  # the default model's table, by its name


@pytest.mark.parametrize("text, words", [
    ('[models."a"]\ntemperatur = 1\n', ["[models.\"a\"]", "unknown key 'temperatur'", "did you mean 'temperature'"]),
    ('[models."a"]\ntop_p = 0\n', ["[models.\"a\"]", "top_p must be a number in (0, 1], got 0"]),
    ('[models."a"]\nsocket_dir = "/tmp"\n', ["unknown key 'socket_dir'", "a model's table takes"]),
    ('[models."a"]\nkv_cache_dtype = "int4"\n', ["kv_cache_dtype must be one of"]),
    ('models = 3\n', ['models holds tables, one per model: [models."NAME"]']),
])
def test_a_bad_models_table_is_named(text: str, words: list[str]) -> None:
    write_config(text)
    with pytest.raises(ConfigError) as e:
        resolve({})
    for word in words:
        assert word in str(e.value)


def test_config_show_prints_a_models_sampling_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    write_config('[models."m"]\ntemperature = 0.3\nmax_model_len = 128\n')
    assert main(["config", "show", "--model", "m"]) == 0
    out = capsys.readouterr().out
    assert 'sampling defaults of the model (its [models."NAME"] table): temperature = 0.3' in out
    assert 'config file' in out and '[models."m"]' in out
    assert main(["config", "show", "--model", "m", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["sampling_defaults"] == {"temperature": 0.3} and shown["values"]["max_model_len"] == 128
