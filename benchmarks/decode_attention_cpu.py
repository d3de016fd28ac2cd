"""The native decode attention alone (kernels/cpu/paged_attention.c): one row per sequence, or a
verified span of drafts (speculative decoding: consecutive rows of one context), over the default
model's shape (9 query heads, 3 KV heads of 64) and 30 layers' caches, as a decode step reads them.

    .venv/bin/python benchmarks/decode_attention_cpu.py                     # this build
    .venv/bin/python benchmarks/decode_attention_cpu.py --lib OTHER.so      # against another build
    LLMD_CPU=avx2 .venv/bin/python benchmarks/decode_attention_cpu.py --cache float32

Prints milliseconds per step (30 layers; the median over --rounds of the best of 5) per context
length and span size; with --lib, the other build's figure beside it, the two timed in turn (these
machines drift by tens of per cent within minutes, so only figures taken side by side compare). Build
another library with the same flags from other sources to compare kernels: ``gcc -O3 -fopenmp
-shared -fPIC -std=c11 -ffp-contract=off -march=native -o OTHER.so kernels/cpu/*.c -lm``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from llmd.kernels import cpu_profile
from llmd.kernels.decode_cpu import CACHE_KINDS
from llmd.kernels.native import library

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    fn = lib.llmd_paged_decode_attention
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 500, 1000, 4000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows of one context (a span)")
    parser.add_argument("--cache", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--lib", default=None, help="another build of the native library to time beside this one")
    args = parser.parse_args()
    torch.manual_seed(0)
    native = library()
    if native is None:
        raise SystemExit("the native library is not available (no C compiler?)")
    libs = {"this": bind(native)}
    if args.lib:
        libs["other"] = bind(ctypes.CDLL(args.lib))
    dtype = getattr(torch, args.cache)
    threads = torch.get_num_threads()
    print(cpu_profile.machine_line())
    other = "; other = --lib" if args.lib else ""
    print(f"{args.cache} cache, {threads} threads, {LAYERS} layers; ms per step{other}")
    for ctx in args.contexts:
        width = (ctx + max(args.rows)) // BLOCK + 1
        num_blocks = 4 * width + 8  # the sequence's blocks scattered in a pool four times its size
        caches = [tuple((torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM) * 0.5).to(dtype) for _ in range(2))
                  for _ in range(LAYERS)]
        table = torch.randperm(num_blocks - 1)[:width] + 1
        for rows in args.rows:
            tables = torch.stack([table] * rows).contiguous()
            lens = torch.tensor([ctx + r + 1 for r in range(rows)], dtype=torch.int32)
            query, out = torch.randn(rows, HEADS, HEAD_DIM), torch.empty(rows, HEADS, HEAD_DIM)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for rnd in range(args.rounds):
                for name in (list(libs) if rnd % 2 == 0 else list(libs)[::-1]):
                    fn = libs[name].llmd_paged_decode_attention
                    best = float("inf")
                    for _ in range(5):
                        start = time.perf_counter()
                        for k, v in caches:
                            fn(query.data_ptr(), k.data_ptr(), v.data_ptr(), CACHE_KINDS[dtype], tables.data_ptr(),
                               tables.shape[1], lens.data_ptr(), rows, HEADS, KV_HEADS, HEAD_DIM, BLOCK, 0,
                               HEAD_DIM ** -0.5, out.data_ptr(), threads)
                        best = min(best, time.perf_counter() - start)
                    times[name].append(best)
            this = statistics.median(times["this"]) * 1e3
            line = f"context {ctx:5d}, rows {rows}: {this:7.3f} ms"
            if args.lib:
                other = statistics.median(times["other"]) * 1e3
                line += f"   other {other:7.3f} ms   this/other {this / other:.2f}"
            print(line)


if __name__ == "__main__":
    main()
