"""The native CPU kernels (``kernels/cpu/*.c``): compiled with the system C compiler on first use,
cached, and loaded with ctypes.

The library is built for the CPU it runs on, as the CPU profile allows (llmd.kernels.cpu_profile:
``-march=native`` by default, ``-march=x86-64-v3`` under ``LLMD_CPU=avx2``, the compiler's x86-64
baseline under ``portable``; the C has a portable path for CPUs without AVX2) and cached under
``$XDG_CACHE_HOME/llmd/native/<key>/``, the key covering the sources, the compiler and the CPU, so a
changed source or a different machine builds anew. ``python -m llmd.kernels.native`` builds it
ahead of time (``make setup`` does).

:func:`library` returns None when there is no compiler, the build fails, or ``LLMD_NATIVE=0``; the
callers then take their torch paths, which compute the same results.

OpenMP: the library links ``libgomp.so.1``, which torch has already loaded under that name, so the
dynamic loader hands it torch's copy and the kernels' threads are torch's threads (no second pool
spinning against the first on a small machine).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from ctypes import c_float, c_int, c_int64, c_void_p
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours, see above)

from llmd.kernels import cpu_profile

log = logging.getLogger("llmd")

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("quant_gemm.c", "paged_attention.c", "decode_step.c", "rope.c", "repack.c", "ngram.c")
LIB_NAME = "libllmd_cpu.so"
# -ffp-contract=off: no fused multiply-adds the C did not ask for (rope.c rounds as torch does).
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off")

# name -> (argument types, result type); void* arguments take tensor.data_ptr().
_SIGNATURES: dict[str, tuple[list, object]] = {
    "llmd_has_avx2": ([], c_int),
    "llmd_has_vnni": ([], c_int),
    "llmd_has_avx512": ([], c_int),
    "llmd_rows_per_pass": ([], c_int),
    "llmd_quantize_q8": ([c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_int], None),
    "llmd_qgemm": ([c_int, c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                    c_int64, c_int64, c_void_p, c_int], None),
    "llmd_qgemm_q8": ([c_int, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_int64,
                       c_int64, c_void_p, c_int], None),
    "llmd_decode_workspace_bytes": ([c_void_p, c_int64], c_int64),
    "llmd_decode_step": ([c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p,
                          c_void_p], c_int),
    "llmd_rope": ([c_void_p, c_int64, c_int64, c_int64, c_int64, c_void_p, c_void_p, c_int, c_int], None),
    "llmd_attention_spans": ([c_void_p, c_int64, c_void_p, c_int64, c_int64, c_int64, c_void_p], c_int64),
    "llmd_attention_spans_size": ([c_int64], c_int64),
    "llmd_paged_decode_attention": ([c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int64, c_void_p, c_int64, c_int64,
                                     c_int64, c_int64, c_int64, c_int64, c_float, c_void_p, c_int], None),
    "llmd_kv_store_rows": ([c_void_p, c_int64, c_int64, c_int, c_void_p], None),
    "llmd_kv_write": ([c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int, c_void_p, c_int], None),
    "llmd_repack_x8": ([c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_void_p, c_int], c_int),
    "llmd_gather_x8_u16": ([c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64, c_void_p, c_int], None),
    "llmd_q8x8_rows": ([c_void_p, c_void_p, c_int64, c_int64, c_int64, c_void_p, c_int64, c_void_p], c_int),
    "llmd_ngram_match": ([c_void_p, c_int64, c_int64, c_void_p], c_int64),
}


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed (the message says which and how)."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``/``gcc``/``clang`` on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def _cpu_signature() -> str:
    # -march=native code is only valid on a CPU with the same instruction sets.
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmd" / "native"


def build(cc: str | None = None, out_dir: Path | None = None, portable: bool = False) -> Path:
    """Compile the library (or find it in the cache); returns its path. ``portable``: for the
    compiler's baseline CPU whatever the profile, which leaves the C's portable path (no AVX2) in (tests).

    Raises:
        NativeBuildError: no compiler, or compiling failed.
    """
    cc = cc or compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (install gcc, or set CC)")
    sources = [SOURCE_DIR / name for name in SOURCES]
    headers = sorted(SOURCE_DIR.glob("*.h"))  # included by the sources: part of the key too
    flags = FLAGS if portable else (*FLAGS, *cpu_profile.march_flags())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in (*sources, *headers)), version.encode(), " ".join(flags).encode(),
                 _cpu_signature().encode()):
        key.update(part)
    target = (out_dir or cache_dir()) / key.hexdigest()[:16] / LIB_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: another process may be building the same key.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, *map(str, sources), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
        raise NativeBuildError(f"compiling the native CPU kernels failed: {' '.join(cmd)}: {first}")
    os.replace(tmp, target)
    log.info("built the native CPU kernels: %s", target)
    return target


def load(path: Path) -> ctypes.CDLL:
    """Load a build of the library and declare its functions' signatures."""
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler, a failed build, or ``LLMD_NATIVE=0``); decided
    once per process."""
    if os.environ.get("LLMD_NATIVE", "1") == "0":
        return None
    try:
        return load(build())
    except (NativeBuildError, OSError) as e:
        log.warning("%s; quantised matmuls and decode attention take the slower torch path", e)
        return None


def main() -> int:
    """``python -m llmd.kernels.native``: build (or find) the library and print where it is."""
    try:
        path = build()
    except NativeBuildError as e:
        print(f"llmd: {e}", file=sys.stderr)
        return 1
    lib = load(path)
    isa = "portable C"
    if lib.llmd_has_avx2():
        isa = "AVX-512+VNNI" if lib.llmd_has_avx512() else "AVX2+FMA+VNNI" if lib.llmd_has_vnni() else "AVX2+FMA"
    print(f"{path} ({isa}; CPU profile {cpu_profile.describe()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
