"""`llmd bench` briefly against a real daemon on a tiny model: each workload runs, the report has its
fields, and its numbers agree with each other and with what the daemon says it produced."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon_helpers import daemon_env, start_daemon, stop_daemon
from tiny_models import make_hf_model, save_hf_model

from llmd.bench import BenchConfig, RequestRecord, plan
from llmd.bench_plot import throughput_over_time


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("bench")
    model_dir = save_hf_model(make_hf_model("qwen2"), tmp / "model", with_tokenizer=True)
    socket_dir, env = tmp / "run", daemon_env(tmp)
    # an int8 KV cache: the flag through the CLI, the daemon's info and the report (the loads' accounting,
    # prefix hits included, is the same whatever the cache holds)
    start_daemon(model_dir, socket_dir, "--block-size", "4", "--kv-cache-dtype", "int8", env=env)
    yield socket_dir, env
    stop_daemon(socket_dir, env)


def bench(daemon, *args: str) -> dict:
    socket_dir, env = daemon
    out = subprocess.run([sys.executable, "-m", "llmd", "bench", "--socket-dir", str(socket_dir), "--json", *args],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_streams_report_is_self_consistent(daemon) -> None:
    # 4 x 80 tokens: long enough (~1 s) for the 4-per-second stats stream to see the KV blocks in use
    r = bench(daemon, "--streams", "4", "--prompt-tokens", "12", "--output-tokens", "80")
    assert r["workload"] == "streams" and r["num_requests"] == 4 and r["num_failed"] == 0 and r["errors"] == []
    assert isinstance(r["seed"], int)
    # tokens counted on the stream == tokens the daemon reports == what was asked (ignore_eos: exact)
    assert r["output_tokens"] == r["output_tokens_reported"] == 4 * 80
    assert r["prompt_tokens"] == 4 * 12
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    assert r["request_throughput"] == pytest.approx(4 / r["duration_s"])
    assert 0 < r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"] <= r["e2e_p99"] <= r["duration_s"]
    assert 0 <= r["itl_p50"] <= r["itl_p99"] and r["e2e_p50"] <= r["e2e_p99"]
    assert 0 < r["peak_kv_usage"] <= 1 and r["preemptions"] == 0 and r["goodput"] is None
    dtype, tokens = r["kv_cache"].split(", ")
    assert dtype == "int8" and int(tokens.removesuffix(" tokens")) % 4 == 0  # blocks of 4 tokens


def test_prefix_workload_hits_the_cache(daemon) -> None:
    r = bench(daemon, "--workload", "prefix", "--streams", "3", "--prefix-tokens", "40", "--prompt-tokens", "5",
              "--output-tokens", "4")
    assert r["output_tokens"] == r["output_tokens_reported"] == 12 and r["prompt_tokens"] == 3 * 45
    # the warm-up request cached the 40-token prefix: 10 full blocks of 4 per request
    assert r["cached_prompt_tokens"] >= 3 * 40 and r["prefix_cache_hit_rate"] == pytest.approx(
        r["cached_prompt_tokens"] / r["prompt_tokens"])


def test_poisson_with_slos(daemon) -> None:
    r = bench(daemon, "--workload", "poisson", "--requests", "6", "--rate", "20", "--prompt-tokens", "8",
              "--output-tokens", "6", "--slo-ttft", "60", "--slo-itl", "60")
    assert r["num_requests"] == 6 and r["num_failed"] == 0
    assert r["output_tokens"] == r["output_tokens_reported"]
    assert r["goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: every request meets them


def test_plan_is_seeded_and_exact() -> None:
    config = BenchConfig(workload="poisson", num_requests=20, prompt_tokens=10, output_tokens=8, rate=5.0, seed=3)
    a, _ = plan(config, list(range(50)))
    b, _ = plan(config, list(range(50)))
    assert [(r.start_s, r.prompt, r.output_tokens) for r in a] == [(r.start_s, r.prompt, r.output_tokens) for r in b]
    assert all(5 <= len(r.prompt) <= 15 and 4 <= r.output_tokens <= 12 for r in a)
    assert all(x.start_s < y.start_s for x, y in zip(a, a[1:]))
    with pytest.raises(ValueError, match="workload must be one of"):
        BenchConfig(workload="burst")
    with pytest.raises(ValueError, match="rate must be > 0"):
        BenchConfig(rate=0)


def test_edit_workload_asks_for_code_rewritten(daemon) -> None:
    config = BenchConfig(workload="edit", num_streams=3, prompt_tokens=100, output_tokens=12, seed=5)
    plans, warm = plan(config, [])
    assert warm is None and config.ignore_eos is False and len(plans) == 3
    for p in plans:
        text = p.messages[0]["content"]
        old = text.split("with `", 1)[1].split("`", 1)[0]
        code = text.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert old in code and f"`{old}_renamed`" in text and 0 < len(code) <= 100 * 3.5
    assert [p.messages for p in plan(config, [])[0]] == [p.messages for p in plans]  # seeded
    # this tiny model's tokens are bytes, and its context 256: 20 "tokens" of code are ~70 bytes
    # seeded: an unlucky draw of a long identifier made a prompt too long for the 256-byte context (a CI run)
    r = bench(daemon, "--workload", "edit", "--streams", "2", "--prompt-tokens", "20", "--output-tokens", "12",
              "--seed", "5")
    assert r["workload"] == "edit" and r["num_failed"] == 0 and r["num_requests"] == 2, r["errors"]
    assert 2 * 70 < r["prompt_tokens"] and 0 < r["output_tokens_reported"] <= 2 * 12


def test_runs_do_not_reuse_each_others_prompts_unless_seeded(daemon) -> None:
    args = ("--streams", "2", "--prompt-tokens", "20", "--output-tokens", "3")
    first, second = bench(daemon, *args), bench(daemon, *args)
    assert first["seed"] != second["seed"] and second["cached_prompt_tokens"] == 0
    again = bench(daemon, *args, "--seed", str(first["seed"]))  # the same prompts: found in the cache
    assert again["cached_prompt_tokens"] >= 2 * 16


@pytest.mark.parametrize("workload", ["streams", "prefix", "poisson", "edit"])
def test_in_process_report_is_self_consistent(tmp_path, workload: str) -> None:
    """`--in-process`: the same workloads against llmd.LLM, with the same accounting."""
    model_dir = save_hf_model(make_hf_model("qwen2"), tmp_path / "model", with_tokenizer=True)
    out = subprocess.run([sys.executable, "-m", "llmd", "bench", "--in-process", "--model", str(model_dir), "--json",
                          "--workload", workload, "--streams", "3", "--prompt-tokens", "6", "--output-tokens", "20",
                          "--prefix-tokens", "40", "--requests", "4", "--rate", "50"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    n = 4 if workload == "poisson" else 3
    assert r["num_requests"] == n and r["num_failed"] == 0
    assert r["output_tokens"] == r["output_tokens_reported"]
    if workload not in ("poisson", "edit"):  # poisson draws mixed lengths, edit's chats may end early
        assert r["output_tokens"] == n * 20
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    assert 0 < r["ttft_p50"] <= r["ttft_p99"] <= r["e2e_p99"] <= r["duration_s"]
    assert 0 < r["peak_kv_usage"] <= 1
    if workload == "prefix":
        assert r["cached_prompt_tokens"] >= n * 32  # the warm-up cached the prefix's full blocks of 16


def test_plot_draws_the_run(daemon, tmp_path) -> None:
    path = tmp_path / "run.png"
    r = bench(daemon, "--streams", "3", "--prompt-tokens", "8", "--output-tokens", "12", "--plot", str(path))
    assert r["output_tokens"] == 36
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # four drawn panels, not an empty canvas
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 750)


@pytest.mark.parametrize("name,message", [("run.txt", "must end in .png"), ("no-such-dir/run.png", "does not exist")])
def test_a_bad_plot_path_fails_before_the_run(tmp_path, name: str, message: str) -> None:
    # No daemon and no model: the path is checked first, so this fails at once with one line.
    out = subprocess.run([sys.executable, "-m", "llmd", "bench", "--socket-dir", str(tmp_path / "none"),
                          "--plot", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_throughput_over_time_counts_every_token() -> None:
    records = [RequestRecord(sent=10.0, token_times=[10.2, 10.7, 11.0, 12.0], end=12.0),
               RequestRecord(sent=10.5, token_times=[10.9, 11.4], end=11.4)]
    starts, tok_s, in_flight = throughput_over_time(records, t0=10.0, duration=2.0, bin_s=0.5)
    assert starts == [0.0, 0.5, 1.0, 1.5]
    assert sum(v * 0.5 for v in tok_s) == 6  # every token in some bin (12.0, at the very end, in the last)
    assert tok_s == [2.0, 4.0, 4.0, 2.0]
    assert in_flight == [1, 2, 2, 1]
