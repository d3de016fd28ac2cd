"""Compile Triton kernels for a real GPU target without a GPU (the triton wheel ships ptxas).

The interpreter runs code the compiler would reject (tile sizes, dot shapes, dtypes), so each kernel
test file also compiles its kernels for an A100 (sm_80) in a subprocess where TRITON_INTERPRET is
unset: there, ``@triton.jit`` makes real JIT functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm80(fn, signature, constexprs):
    sig = dict(signature, **dict.fromkeys(constexprs, "constexpr"))
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 80, 32))
"""


def compile_for_gpu(script: str, tmp_path: Path) -> None:
    """Run ``script`` (which may call ``compile_sm80(fn, signature, constexprs)``, returning the
    compiled kernel) in a fresh, non-interpreted process; fail with its stderr if it raises."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", PRELUDE + script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
