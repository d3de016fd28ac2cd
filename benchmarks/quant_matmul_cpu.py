"""CPU matmul speed on the default model's projection shapes: the native INT4/INT8 kernels (on int8
activations, weights repacked 8 rows to a vector: ``native i4``/``native i8``, the latter also what
the Q8_0 LM head runs on) against torch's packed int4/int8 kernels (bf16 activations), the reference
path (dequantise + matmul) and dense fp32 / bf16 matmuls. ``LLMD_CPU=avx2`` times the AVX2 build of
ours (no VNNI) on a CPU that has more.

    .venv/bin/python benchmarks/quant_matmul_cpu.py [--rows 1 16 512]
    .venv/bin/python benchmarks/quant_matmul_cpu.py --lib OTHER.so --rows 1 4 16 512   # two builds

Prints microseconds per call (median of repeats) per shape and batch size. Run it alone: other
CPU work on a 2-core machine distorts every number. ``--lib`` times instead the native kernels
against another build of the library (e.g. ``gcc -O3 -fopenmp -shared -fPIC -std=c11
-ffp-contract=off -march=native -o OTHER.so kernels/cpu/*.c -lm`` on other sources), in turn,
several rounds, and prints the ratio other / this per shape and kind (the median of the rounds):
these machines drift by tens of per cent within minutes, so only alternated timings compare.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from llmd.kernels import quant_cpu
from llmd.kernels.quant_cpu import PackedWeight
from llmd.quant.int4 import dequantize_int4, quantize_int4
from llmd.quant.int8 import quantize_int8

# SmolLM2-135M: (name, in_features, out_features); lm_head is the tied embedding (GGUF Q8_0).
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152)]


def timed(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    fn()
    times = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def against(other_path: str, rows: list[int], rounds: int = 6) -> None:
    """The native kernels of this build and of ``other_path``, timed in turn."""
    this = quant_cpu.library()
    if this is None:
        raise SystemExit("the native library is not available (no C compiler?)")
    other = ctypes.CDLL(other_path)
    other.llmd_qgemm.restype = None
    other.llmd_qgemm.argtypes = this.llmd_qgemm.argtypes
    libs = {"this": this, "other": other}
    print(f"threads {torch.get_num_threads()}; microseconds per call, the median of {rounds} alternated rounds")
    print(f"{'shape':>8} {'M':>4} | {'this i4':>8} {'other i4':>8} {'ratio':>6} | {'this i8':>8} {'other i8':>8} "
          f"{'ratio':>6}")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * 0.05
        weights = {"i4": PackedWeight.from_int4(quantize_int4(w, 32)),
                   "i8": PackedWeight.from_int8(quantize_int8(w, 32))}
        for m in rows:
            x = torch.randn(m, k)
            cells = []
            for kind, weight in weights.items():
                times: dict[str, list[float]] = {"this": [], "other": []}
                for rnd in range(rounds):
                    for lib in (list(libs) if rnd % 2 == 0 else list(libs)[::-1]):
                        times[lib].append(timed(lambda: weight(x, libs[lib]), 0.1))
                this_us, other_us = (statistics.median(times[lib]) for lib in ("this", "other"))
                ratio = statistics.median(o / t for t, o in zip(times["this"], times["other"]))
                cells.append(f"{this_us:8.0f} {other_us:8.0f} {ratio:5.2f}x")
            print(f"{name:>8} {m:>4} | {' | '.join(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--lib", default=None, help="another build of the native library to time against this one")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.lib:
        against(args.lib, args.rows)
        return
    native = quant_cpu.library() is not None
    print(f"threads {torch.get_num_threads()}, native kernels {'built' if native else 'UNAVAILABLE'}")
    print(f"{'shape':>8} {'M':>4} | {'native i4':>9} {'native i8':>9} | "
          f"{'torch i4':>9} {'torch i8':>9} | {'deq+mm':>9} {'fp32 mm':>9} {'bf16 mm':>9}   (us)")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * 0.05
        q4 = quantize_int4(w, 32)
        q8 = quantize_int8(w, 32)
        q8c = quantize_int8(w)  # per channel: torch's int8 kernel
        n4, n8 = (PackedWeight.from_int4(q4), PackedWeight.from_int8(q8)) if native else (None, None)
        packed4, sz = quant_cpu.pack_int4_for_cpu(q4)
        sz = sz.to(torch.bfloat16)
        wb = w.bfloat16()
        for m in args.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            cols = {
                "native i4": (lambda: n4(x)) if native else None,
                "native i8": (lambda: n8(x)) if native else None,
                "torch i4": lambda: quant_cpu.int4_mm_cpu(xb, packed4, 32, sz),
                "torch i8": lambda: quant_cpu.int8_mm_cpu(xb, q8c.qweight, q8c.scales[:, 0]),
                "deq+mm": lambda: x @ dequantize_int4(q4).T,
                "fp32 mm": lambda: x @ w.T,
                "bf16 mm": lambda: xb @ wb.T,
            }
            cells = [f"{timed(fn):9.0f}" if fn else f"{'-':>9}" for fn in cols.values()]
            print(f"{name:>8} {m:>4} | {' '.join(cells[:2])} | {cells[2]} {cells[3]} | {' '.join(cells[4:])}")


if __name__ == "__main__":
    main()
