"""`llmd start --foreground`: load the model, take the runtime dir, serve until stopped."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from llmd.config import OPTIONS
from llmd.daemon.runtime_files import RuntimeFiles
from llmd.daemon.quantization import QuantConfig, describe, describe_quant, weight_memory
from llmd.errors import LlmdError
from llmd.config import runtime_dir

log = logging.getLogger("llmd")


@dataclass(slots=True)
class DaemonOptions:
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_mb: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    prefix_cache: bool = True
    cuda_graphs: bool = False
    socket_dir: str | None = None
    tcp: str | None = None
    allow_remote: bool = False
    max_queue_len: int = 256
    drain_timeout: float = 10.0
    quant: str = "auto"
    group_size: int | None = None
    attention: str = "auto"
    gpu_memory_fraction: float = 0.8
    idle_unload: float = 0.0  # minutes; 0 keeps the model loaded
    models_dir: str | None = None
    log_file: str | None = None  # where the log goes (rotated), None: stderr


def check_tcp(tcp: str | None, allow_remote: bool = False) -> None:
    """Refuse a TCP address other machines could reach unless ``allow_remote``; warn on stderr
    when it is allowed.

    Raises:
        LlmdError: a malformed address, or a non-loopback one without ``allow_remote``.
    """
    if tcp is None:
        return
    try:
        OPTIONS["tcp"].parse(tcp)  # the check the flag and the config file make
    except ValueError:
        raise LlmdError(f"--tcp takes HOST:PORT (e.g. 127.0.0.1:7860), got {tcp!r}") from None
    host = tcp.rpartition(":")[0].strip("[]")
    if is_loopback(host):
        return
    if not allow_remote:
        raise LlmdError(f"--tcp {tcp} would be reachable from other machines; use 127.0.0.1:PORT, or add "
                        "--allow-remote if you mean it")
    print(f"llmd: warning: serving on {tcp}, reachable from other machines (CURVE-encrypted; clients need "
          "the keys in the connection file)", file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host`` (``*``, ``0.0.0.0`` and names that resolve elsewhere cannot)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface or host name: it may face the network


def serve(opts: DaemonOptions) -> int:
    """Run the daemon in this process; returns the exit code.

    Raises:
        LlmdError: already running, bad model, bad options.
    """
    import torch

    from llmd.daemon.attention import make_attention_backend
    from llmd.daemon.device import resolve_device, resolve_dtype
    from llmd.daemon.engine.engine import EngineConfig, LLMEngine
    from llmd.daemon.loader import load_model
    from llmd.daemon.model_source import resolve_model
    from llmd.daemon.server import Server, ServerConfig
    from llmd.daemon.tokenizer import load_tokenizer, stop_token_ids

    check_tcp(opts.tcp, opts.allow_remote)
    device = resolve_device(opts.device)
    try:
        engine_config = EngineConfig(block_size=opts.block_size, kv_cache_mb=opts.kv_cache_mb,
                                     max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_batched_tokens,
                                     enable_prefix_caching=opts.prefix_cache,
                                     gpu_memory_fraction=opts.gpu_memory_fraction, cuda_graphs=opts.cuda_graphs)
        attention = make_attention_backend(opts.attention, device)
        if reason := attention.unsupported(opts.block_size):  # before the slow load; head_dim is checked after
            raise ValueError(f"{reason}; use --attention torch")
        server_config = ServerConfig(max_queue_len=opts.max_queue_len, drain_timeout_s=opts.drain_timeout,
                                     tcp=opts.tcp, idle_unload_s=60.0 * opts.idle_unload)
        quant = QuantConfig(opts.quant, opts.group_size)
    except ValueError as e:
        raise LlmdError(str(e)) from None
    files = RuntimeFiles(runtime_dir(opts.socket_dir))
    files.acquire()  # before loading: a second daemon is refused at once
    try:
        start = time.monotonic()
        source = resolve_model(opts.model, opts.models_dir)
        dtype = resolve_dtype(opts.dtype, device)

        def load() -> Any:  # the model, loaded the same way at start and after an idle unload
            return load_model(source, dtype=dtype, device=device, quant=quant, attention=attention)

        try:
            loaded = load()
            tokenizer = load_tokenizer(source)
            engine = LLMEngine(loaded.model, tokenizer, engine_config,
                               eos_token_ids=stop_token_ids(tokenizer, loaded.config))
        except ValueError as e:  # e.g. no GPU memory left for the KV cache, a block size the kernels lack
            raise LlmdError(str(e)) from None
        except torch.OutOfMemoryError:
            raise LlmdError(f"{source.name} does not fit in GPU memory: choose --quant int4, a smaller model, "
                            "or --device cpu") from None
        memory = weight_memory(loaded.model)
        info = {"model": source.name, "model_path": str(source.path), "model_type": loaded.config.model_type,
                "device": device, "dtype": str(dtype).removeprefix("torch."),
                "attention": attention.name,
                "quantization": describe_quant(loaded.model, quant), "weight_bytes": sum(memory.values()),
                "weight_memory": memory,
                "kernels": loaded.model.kernels(),
                "kv_cache_blocks": engine.num_blocks,
                "chat_template": bool(getattr(tokenizer, "chat_template", None)),
                "log_file": opts.log_file,
                # NOTE: systemd sets INVOCATION_ID for the processes of a unit: stderr is the journal.
                "journal": opts.log_file is None and "INVOCATION_ID" in os.environ}
        del loaded  # only the engine holds the model: an idle unload must be able to free it
        server = Server(engine, files, info, server_config, load_model=lambda: load().model)
        files.write_connection_file({**info, **server.connection_fields})
        log.info("serving %s on %s (%s, %s, %d KV blocks of %d tokens; weights %s) after %.1fs", source.name,
                 files.requests_endpoint, device, info["dtype"], engine.num_blocks, opts.block_size,
                 describe(memory), time.monotonic() - start)
        return server.run()
    finally:
        files.release()
