"""Compile Triton kernels for real GPU targets without a GPU (the triton wheel ships ptxas).

The interpreter runs code the compiler would reject (tile sizes, dot shapes, dtypes), so each kernel
test file also compiles its kernels for NVIDIA targets in a subprocess where TRITON_INTERPRET is
unset: there, ``@triton.jit`` makes real JIT functions. The script gets these helpers:

* ``compile_sm80(fn, signature, constexprs)`` / ``compile_for(fn, signature, constexprs, arch,
  aligned, num_warps)``: the compiled kernel for compute capability ``arch`` (75 Turing ... 90 Hopper);
  ``aligned`` names the arguments the runtime sees 16-aligned (pointers from torch's allocator,
  strides that are multiples of 16), which Triton specialises on: the kernel compiled with them is
  the one that runs.
* ``ARCHS``: the architectures this process compiles for (its share of the four); ``dtypes(arch)``
  the activation dtypes to compile each for.
* ``ptxas_report(kernel)``: ptxas's own count of registers per thread and spill bytes, with the
  shared memory, whether global loads are vectorised (``ld.global.v2/v4``) and whether any loads
  single bytes (``ld.global.u8/b8``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Turing, Ampere (A100; RTX 30), Hopper. Ada (sm_89, RTX 40) is not compiled apart: for these kernels
# (no FP8) it takes sm_86's tensor-core instructions within the same 99 KiB of shared memory, and a fifth
# architecture was ~15 s of `make test`'s budget.
ARCHS = (75, 80, 86, 90)
# Compiling is single-threaded: the architectures are shared out between this many processes, each
# running the whole script over its share (ARCHS inside the script), so both cores work.
SHARDS = min(2, os.cpu_count() or 1)

PRELUDE = """
import contextlib
import io
import os
import re
import subprocess
import tempfile

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

# Triton runs ptxas -v itself, with its own flags, to make the cubin: its log is the report of the
# code that would run, and a second ptxas run (a third of a kernel's compile time) is not needed
knobs.nvidia.dump_ptxas_log = True

_SHARD, _SHARDS = (int(v) for v in os.environ.get("LLMD_COMPILE_SHARD", "0/1").split("/"))
# this process's share: with two, 80 (three dtypes) and 75/86/90 (one each)
ARCHS = tuple(arch for i, arch in enumerate((80, 75, 86, 90)) if min(i, 1) % _SHARDS == _SHARD)


def compile_for(fn, signature, constexprs, arch=80, aligned=(), num_warps=4):
    sig = dict(signature, **dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": num_warps})
    kernel.arch = arch
    kernel.ptxas_log = log.getvalue()  # empty when the kernel came from Triton's cache
    return kernel


def dtypes(arch):
    # bf16 from sm_80 on (what --dtype auto runs there); fp16 on Turing, which has no bf16, and on sm_80,
    # where --dtype float16 is a choice (later generations compile it to bf16's tiles and registers:
    # once is enough); fp32 once, on sm_80 (IEEE dots)
    return {75: ["fp16"], 80: ["bf16", "fp16", "fp32"]}.get(arch, ["bf16"])


def compile_sm80(fn, signature, constexprs):
    return compile_for(fn, signature, constexprs, 80)


def ptxas_report(kernel):
    ptx = kernel.asm["ptx"]
    log = kernel.ptxas_log
    if "Used" not in log:
        with tempfile.TemporaryDirectory() as tmp:
            src = f"{tmp}/k.ptx"
            with open(src, "w") as f:
                f.write(ptx)
            log = subprocess.run([get_ptxas(kernel.arch).path, "-v", "--regAllocOptLevel=2",
                                  f"--gpu-name={sm_arch_from_capability(kernel.arch)}", src, "-o", f"{tmp}/k.o"],
                                 capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0
    return dict(name=kernel.name, arch=kernel.arch, registers=number(r"Used (\\d+) registers"),
                spill_stores=number(r"(\\d+) bytes spill stores"), spill_loads=number(r"(\\d+) bytes spill loads"),
                shared=kernel.metadata.shared, vector_loads=bool(re.search(r"ld\\.global(\\.\\w+)*\\.v[248]", ptx)),
                byte_loads=bool(re.search(r"ld\\.global(\\.(?!v[248]\\b)\\w+)*\\.[usb]8\\b", ptx)))
"""


def compile_for_gpu(script: str, tmp_path: Path) -> str:
    """Run ``script`` (which may use the helpers above, and loops over ``ARCHS``) in fresh,
    non-interpreted processes, each over its share of the architectures; fail with the stderr of
    one that raises. Returns what they printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + script], cwd=tmp_path,
                              env=env | {"LLMD_COMPILE_SHARD": f"{shard}/{SHARDS}"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for shard in range(SHARDS)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-4000:]
    return "".join(out for out, _ in outs)
