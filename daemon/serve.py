"""`llmd start --foreground`: load the model, take the runtime dir, serve until stopped."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from llmd.config import OPTIONS, RemoteTable, runtime_dir
from llmd.daemon.engine_args import EngineArgs
from llmd.daemon.quantization import describe, describe_quant, weight_memory
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.daemon.tool_calls import call_style
from llmd.daemon.transport import check_tcp
from llmd.errors import LlmdError

log = logging.getLogger("llmd")


@dataclass(slots=True)
class DaemonOptions:
    """``llmd start``'s settings: the runtime's (:class:`EngineArgs`) and the daemon's own, each
    the option of the same name in llmd.config, with its default."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    socket_dir: str | None = OPTIONS["socket_dir"].default
    tcp: str | None = OPTIONS["tcp"].default
    allow_remote: bool = OPTIONS["allow_remote"].default
    max_queue_len: int = OPTIONS["max_queue_len"].default
    idle_unload: float = OPTIONS["idle_unload"].default  # minutes; 0 keeps the model loaded
    max_loaded_models: int = OPTIONS["max_loaded_models"].default  # models holding their weights at once
    max_models_mb: int = OPTIONS["max_models_mb"].default  # their weights and KV pools in all; 0: no bound
    drain_timeout: float = 10.0  # seconds a stop waits for requests in flight
    log_file: str | None = None  # where the log goes (rotated), None: stderr
    # what requests get for the sampling parameters they leave out (the model's config-file table)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    remotes: dict[str, RemoteTable] = field(default_factory=dict)  # the config file's [remote."NAME"] tables

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], log_file: str | None = None,
                      sampling_defaults: Mapping[str, Any] | None = None,
                      remotes: Mapping[str, RemoteTable] | None = None) -> DaemonOptions:
        """From the effective settings (llmd.config.resolve: its ``values`` and ``sampling``).

        Raises:
            ValueError: a bad value (the settings' own checks pass, so: a combination).
        """
        own = {f.name for f in fields(cls)} - {"engine", "log_file", "sampling_defaults", "remotes"}
        return cls(EngineArgs.from_settings(values), log_file=log_file, sampling_defaults=dict(sampling_defaults or {}),
                   remotes=dict(remotes or {}), **{k: v for k, v in values.items() if k in own})


class Companion(Protocol):
    """A server the daemon's process runs beside the daemon (the HTTP API, :mod:`llmd.http`), as a
    client of it: started once the daemon answers, stopped when it stops."""

    url: str

    def start(self, connection: dict[str, Any]) -> None: ...

    def stop(self) -> None: ...


def serve(opts: DaemonOptions, companion: Companion | None = None,
          settings_for: Callable[[str], tuple[EngineArgs, dict[str, Any]]] | None = None) -> int:
    """Run the daemon in this process; returns the exit code. ``companion`` is started with the
    connection file's fields once the daemon is up, and named in its info (``http``).
    ``settings_for(name)``: how another model a request names is loaded (its EngineArgs and
    sampling defaults, as ``llmd start --model NAME`` would take them); None serves only the one.

    Raises:
        LlmdError: already running, bad model, bad options.
    """
    from llmd.daemon.model_set import ModelSet
    from llmd.daemon.model_source import DEFAULT_MODEL_ALIAS, resolve_model
    from llmd.daemon.remote_model import RemoteModel
    from llmd.daemon.server import Server, ServerConfig

    check_tcp(opts.tcp, opts.allow_remote)
    remotes = [RemoteModel.from_table(n, t) for n, t in opts.remotes.items()]  # (a key unset: said before loading)
    try:
        server_config = ServerConfig(max_queue_len=opts.max_queue_len, drain_timeout_s=opts.drain_timeout,
                                     tcp=opts.tcp, idle_unload_s=60.0 * opts.idle_unload)
        resolved = opts.engine.resolve()  # the model found and the backend checked before the slow load
    except ValueError as e:
        raise LlmdError(str(e)) from None
    files = RuntimeFiles(runtime_dir(opts.socket_dir))
    files.acquire()  # before loading: a second daemon is refused at once
    try:
        start = time.monotonic()
        name = opts.engine.model or DEFAULT_MODEL_ALIAS
        default = _load_served(name, opts.engine, opts.sampling_defaults, server_config.idle_unload_s, resolved)
        info = {**default.info, "log_file": opts.log_file,
                # NOTE: systemd sets INVOCATION_ID for the processes of a unit: stderr is the journal.
                "journal": opts.log_file is None and "INVOCATION_ID" in os.environ,
                "http": companion.url if companion is not None else None}

        def load_other(other: str) -> Any:
            args, sampling = settings_for(other)
            return _load_served(other, args, sampling, server_config.idle_unload_s)

        def check(other: str) -> None:
            resolve_model(other, opts.engine.models_dir)

        def estimate(other: str) -> int:
            args, _ = settings_for(other)
            return _estimate_bytes(resolve_model(other, args.models_dir), args.kv_cache_mb)

        models = ModelSet(default, load_other if settings_for is not None else None, check,
                          opts.max_loaded_models, aliases=("default", default.info["model"])
                          + ((DEFAULT_MODEL_ALIAS,) if opts.engine.model is None else ()),
                          max_bytes=opts.max_models_mb << 20, estimate=estimate)
        server = Server(models, files, info, server_config, remotes)
        connection = files.write_connection_file({**info, **server.connection_fields})
        if companion is not None:
            companion.start(connection)
        engine = default.engine
        # NOTE: what the imports and the default model's load made lives as long as the daemon: frozen
        # out of the garbage collector's way, a full collection (another model's load sets some off)
        # scans only what came after. It scanned it all, holding the GIL ~100 ms: as long a stall
        # for every stream of the models being served.
        gc.freeze()
        log.info("serving %s on %s (%s, %s, %d KV blocks of %d tokens; weights %s) after %.1fs", info["model"],
                 files.requests_endpoint, info["device"], info["dtype"], engine.num_blocks, opts.engine.block_size,
                 describe(info["weight_memory"]), time.monotonic() - start)
        return server.run()
    finally:
        if companion is not None:
            companion.stop()
        files.release()


def _estimate_bytes(source: Any, kv_cache_mb: int | None) -> int:
    """A model's weights and KV pool before it is loaded: its files' size (what a GGUF holds; a float
    checkpoint shrinks when quantised, so this errs high) and its KV setting (else what the CPU
    default lets the prefix cache hold resident: served_model.footprint counts the same)."""
    from llmd.daemon.engine.kv_budget import cpu_kv_budget_bytes

    path = source.path
    weights = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return weights + cpu_kv_budget_bytes(kv_cache_mb)


def _load_served(name: str, args: EngineArgs, sampling_defaults: Mapping[str, Any], idle_unload_s: float,
                 resolved: Any = None) -> Any:
    """Load the model ``args`` name and build what serves it (daemon/served_model.py).

    Raises:
        LlmdError: the model cannot be loaded (the message says why).
    """
    from llmd.daemon.model_lifecycle import ModelLifecycle
    from llmd.daemon.served_model import ServedModel

    try:
        resolved = resolved or args.resolve()
        runtime = resolved.load()
    except ValueError as e:  # e.g. no GPU memory left for the KV cache, a block size the kernels lack
        raise LlmdError(str(e)) from None
    except torch.OutOfMemoryError:
        raise LlmdError(f"{resolved.source.name} does not fit in GPU memory: choose --quant int4, a smaller "
                        "model, or --device cpu") from None
    engine, source, model = runtime.engine, resolved.source, runtime.engine.model
    memory = weight_memory(model)
    info = {"model": source.name, "model_path": str(source.path), "model_type": model.config.model_type,
            "device": resolved.device, "dtype": str(resolved.dtype).removeprefix("torch."),
            "attention": resolved.attention.name,
            "quantization": describe_quant(model, args.quant_config()),
            "weight_bytes": sum(memory.values()), "weight_memory": memory, "kernels": model.kernels(),
            "kv_cache_blocks": engine.num_blocks,
            "kv_cache_dtype": str(engine.cache_dtype).removeprefix("torch."),
            "kv_cache_tokens": engine.num_blocks * args.block_size,
            # reserved, not resident: its pages are taken as blocks fill (model_runner.new_kv_cache)
            "kv_cache_bytes": sum(t.nbytes for pair in engine.runner.kv_caches for t in pair),
            # the blocks the prefix cache may make resident (kv_budget.cpu_kv_pool); only sequences
            # running at once take more
            "kv_cache_target_blocks": engine.kv.pool.resident_target,
            "draft_model": resolved.draft_source.name if resolved.draft_source is not None else None,
            "chat_template": bool(getattr(runtime.tokenizer, "chat_template", None)),
            "tools": call_style(runtime.tokenizer) is not None,  # its template renders tools
            "sampling_defaults": dict(sampling_defaults)}
    del model  # only the engine holds the model: an unload must be able to free it
    return ServedModel(name, engine, info, ModelLifecycle(engine, idle_unload_s, runtime.reload))
