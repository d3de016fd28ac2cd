"""Shared fixtures. Tests never touch the network: HF_HUB_OFFLINE is set before transformers loads.
Triton kernels run in the interpreter (TRITON_INTERPRET=1), but in the GPU test set on a GPU."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Every Triton kernel runs in the interpreter on CPU tensors, but for the GPU test set on a machine
# with CUDA (`make gpu-report`: LLMD_GPU_TESTS=1, tests/test_gpu.py). Triton reads this when
# @triton.jit decorates, i.e. when a kernel module is imported, so it is set before any test module
# (or the code under test) imports one; compile-for-a-GPU tests unset it in their subprocess.
if os.environ.get("LLMD_GPU_TESTS") != "1" or not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# A daemon the developer has running must be invisible to the tests: every client and `llmd` command
# without --socket-dir looks here instead of $XDG_RUNTIME_DIR/llmd (test daemons get their own dirs).
os.environ["LLMD_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="llmd-tests-run-")
# Where llmd.kernels.native caches its builds for the user (read before any test moves XDG_CACHE_HOME).
_NATIVE_BUILDS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmd" / "native"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep llmd's caches (e.g. converted tokenizers) out of the user's home, shared per session."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_session_cache(tmp_path_factory)))


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's config file and LLMD_* settings must not steer tests: each sees an empty config dir."""
    from llmd.config import OPTIONS

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    monkeypatch.delenv("LLMD_CONFIG", raising=False)
    for option in OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)


@pytest.fixture(autouse=True)
def _reset_llmd_logging():
    """`llmd.cli.main` puts a handler on the "llmd" logger that writes to the sys.stderr of its call;
    under capsys that stream is closed after the test, so a later test's log line would hit it."""
    yield
    logger = logging.getLogger("llmd")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


_CACHE: list[Path] = []


def _session_cache(factory: pytest.TempPathFactory) -> Path:
    if not _CACHE:
        cache = factory.mktemp("xdg-cache")
        # but the native kernels' builds: keyed by their sources, flags, compiler and CPU
        # (llmd.kernels.native.build), so sharing the user's is safe, and `make setup` has built
        # them there; each pytest-xdist worker otherwise compiled its own (~7 s a build)
        _NATIVE_BUILDS.mkdir(parents=True, exist_ok=True)
        (cache / "llmd").mkdir()
        (cache / "llmd" / "native").symlink_to(_NATIVE_BUILDS, target_is_directory=True)
        _CACHE.append(cache)
    return _CACHE[0]


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from llmd.daemon.model_source import default_model_path

    return default_model_path()
