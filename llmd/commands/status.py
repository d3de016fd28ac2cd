"""``llmd status``: whether the daemon runs and answers, and if so its model, KV cache and load.
Exit status as an init script's: 0 running, 3 not running, 4 running but not answering."""

from __future__ import annotations

import argparse

from llmd.commands.daemon_process import exited, running_daemon
from llmd.commands.flags import add_settings_flags
from llmd.paths import process_state

# `llmd status` exit codes, after the LSB init-script ones: 3 "not running", 4 "status unknown".
STATUS_RUNNING, STATUS_NOT_RUNNING, STATUS_NOT_ANSWERING = 0, 3, 4
STATUS_ANSWER_TIMEOUT_S = 5.0  # the daemon answers between engine steps, which take well under a second


def register(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser(
        "status", help="is the daemon running, and how busy is it",
        description="Whether the daemon runs and answers; if it does, its model, KV cache and load.",
        epilog=f"exit status: {STATUS_RUNNING} running and answering; {STATUS_NOT_RUNNING} not running; "
               f"{STATUS_NOT_ANSWERING} running but no answer within {STATUS_ANSWER_TIMEOUT_S:g}s (hung or "
               "stopped: `llmd stop --force` ends it); 1 any other error")
    add_settings_flags(status, ["socket_dir"])
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from llmd.bench import kernels_line
    from llmd.client import Client, DaemonNotRunningError
    from llmd.config import runtime_dir

    run_dir = runtime_dir(args.socket_dir, create=False)
    connection = running_daemon(run_dir)
    try:
        if connection is None:
            raise DaemonNotRunningError("no daemon")
        with Client(connection=connection) as client:
            # NOTE: a short wait first: a hung daemon is told apart in seconds, not the 15 s of info().
            client.health(timeout=STATUS_ANSWER_TIMEOUT_S)
            info = client.info()
            stats = client.stats()
    except DaemonNotRunningError:
        if connection is not None and not exited(connection["pid"], run_dir):
            pid = connection["pid"]
            print(json.dumps({"running": True, "answering": False, "pid": pid}) if args.json
                  else _not_answering_line(pid))
            return STATUS_NOT_ANSWERING
        print(json.dumps({"running": False}) if args.json else "llmd: not running (start it with `llmd start`)")
        return STATUS_NOT_RUNNING
    if args.json:
        print(json.dumps({"running": True, "answering": True, **info, "stats": stats}))
        return STATUS_RUNNING
    used, cached, total = stats["num_blocks_used"], stats["num_blocks_cached_free"], stats["num_blocks"]
    lines = [
        f"running     pid {info['pid']}, up {stats['uptime_s']:.0f}s, llmd {info['version']}",
        f"model       {info['model']} ({info['model_type']}), {info['device']}, {info['dtype']}, "
        f"{info.get('attention', '?')} attention",
        f"state       {_model_state_line(info, stats)}",
        f"quantised   {info['quantization']}",
        f"kernels     {kernels_line(info.get('kernels', {}))}",
        f"weights     {info.get('weight_bytes', 0) / 2**20:.0f} MiB held: {_weight_memory_line(info)}",
        f"KV cache    {used}/{total} blocks used, {cached} cached, {total - used - cached} free "
        f"({info['block_size']} tokens each{_kv_format(info)})",
        f"memory      {_memory_line(info, stats)}",
        *([f"models      {_models_line(info, stats)}"] if len(stats.get("models") or ()) > 1 else []),
        f"requests    {stats['num_running']} running, {stats['num_waiting']} waiting, "
        f"{stats['num_preemptions']} preemptions",
        f"throughput  {stats['prefill_tokens_per_s']:.1f} prompt tok/s, {stats['decode_tokens_per_s']:.1f} "
        f"generated tok/s",
        f"prefix hits {100 * stats['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"speculation {_speculation_line(info, stats)}",
        f"sockets     {connection['requests']}",
    ]
    if info.get("http"):
        lines.append(f"HTTP API    {info['http']}/v1 (OpenAI), {info['http']}/api (Ollama), {info['http']}/metrics")
    print("\n".join(lines))
    return STATUS_RUNNING


def _models_line(info: dict, stats: dict) -> str:
    """The models the daemon has built, the default first (daemon/model_set.py)."""
    shown = [f"{m['name']} (remote at {m.get('url')}, {m.get('health')})" if m.get("remote") else
             f"{m['name']} ({m['state']}{', default' if m.get('default') else ''})" for m in stats["models"]]
    return ", ".join(shown) + f"; at most {info.get('max_loaded_models', 1)} loaded at once"


def _memory_line(info: dict, stats: dict) -> str:
    """Resident against reserved: the KV pool's pages are taken as its blocks fill."""
    rss, pool = stats.get("rss_bytes") or 0, info.get("kv_cache_bytes")
    text = f"{rss / 2**20:.0f} MiB resident" if rss else "resident size unknown"
    if pool:
        text += f"; the KV pool reserves {pool / 2**20:.0f} MiB, resident as its blocks fill"
        blocks, touched = info.get("kv_cache_blocks"), stats.get("num_blocks_touched")
        if blocks and touched is not None and info.get("device") == "cpu":  # a GPU's pool is taken whole
            text += f" ({pool * touched // blocks / 2**20:.0f} MiB so far)"
    return text


def _kv_format(info: dict) -> str:
    from llmd.bench import kv_cache_text

    text = kv_cache_text(info.get("kv_cache_dtype"), info.get("kv_cache_tokens"))
    return f"; {text}" if text else ""


def _speculation_line(info: dict, stats: dict) -> str:
    mode = info.get("speculative", "off")
    if mode == "draft" and info.get("draft_model"):
        mode = f"draft ({info['draft_model']})"
    rate, length = stats.get("draft_acceptance_rate"), stats.get("mean_accepted_length")
    if rate is None or length is None:
        return f"{mode}, no drafts verified yet" if mode != "off" else "off"
    return (f"{mode}, {100 * rate:.0f}% of {stats.get('num_draft_tokens_total', 0)} draft tokens accepted, "
            f"{length:.2f} tokens per verification")


def _model_state_line(info: dict, stats: dict) -> str:
    state = stats.get("model_state", "loaded")
    idle_unload = info.get("idle_unload_s") or 0
    if state == "unloaded":
        return (f"unloaded after {idle_unload / 60:g} min without requests (the next request loads it again, "
                f"{stats.get('num_unloads', 0)} unloads so far)")
    if state == "loading":
        return "loading the model again for the requests waiting"
    return "loaded" + (f", unloads after {idle_unload / 60:g} min without requests (idle for "
                       f"{stats.get('idle_s', 0):.0f}s)" if idle_unload else "")


def _not_answering_line(pid: int) -> str:
    stopped = process_state(pid) == "T"
    why = f"it is stopped (`kill -CONT {pid}` resumes it)" if stopped else "hung, or busy with a very long step"
    return (f"llmd: running (pid {pid}) but not answering within {STATUS_ANSWER_TIMEOUT_S:g}s: {why}; "
            "`llmd stop --force` ends it")


def _weight_memory_line(info: dict) -> str:
    memory = info.get("weight_memory")
    if not isinstance(memory, dict):
        return "(not reported)"
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(memory.items(), key=lambda kv: -kv[1])
                     if isinstance(v, (int, float)))
