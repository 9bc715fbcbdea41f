"""The K-quant prefill GEMM on one scale per super-block against the per-32 int8 GEMM.

    python benchmarks/superblock_gemm.py            # 2 threads, 128 tokens
    python benchmarks/superblock_gemm.py -t 1 -n 64 -f Q5_K,IQ4_XS

Both kernels run in the same process on the same random K-quant blocks of
Qwen2.5-1.5B's shapes, alternating, median of the repeats: `int8.mm_int8` (one
activation scale per 32 elements; what every other block format's prefill runs) and
`int8.superblock.mm_superblock` (what `qmatvec.matmul` runs for the K-quants and IQ4_XS
on the int8 paths: avx2, vnni, int8), and on AVX-512 VNNI for Q5_K, IQ4_XS, Q3_K and Q2_K
`int8.superblock_bytes.mm_superblock_bytes` (what the vnni path runs for those; "/ sb":
its speed-up over the super-block column). Needs an x86 CPU with AVX2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from edgerun.runtime import numba_env  # noqa: E402

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402

from edgerun.ops import qmatvec as qm  # noqa: E402
from edgerun.quant.formats import QuantTensor, QuantType  # noqa: E402
from edgerun.quant.reference import random_blocks  # noqa: E402

FORMATS = ("Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q3_K", "Q2_K")
# (rows, cols): ffn_gate/up, attn_q/output, ffn_down
SHAPES = [(8960, 1536), (1536, 1536), (1536, 8960)]


def alternate(runs: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Each callable once to compile / warm, then `repeats` alternating rounds: the
    median seconds of each (both sides see the same machine drift)."""
    times: dict[str, list[float]] = {key: [] for key in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for key, f in runs.items():
            t0 = clock()
            f()
            times[key].append(clock() - t0)
    return {key: float(np.median(t)) for key, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("-f", "--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    if qm.kernel_path() not in qm.INT8_PATHS:
        sys.exit(f"needs an int8 kernel path; this CPU runs {qm.kernel_path()!r}")
    from edgerun.ops import int8 as v
    from edgerun.ops.int8 import superblock as sb

    sbb = None  # the byte GEMM of Q5_K, IQ4_XS, Q3_K, Q2_K (vnni only)
    if qm.kernel_path() == "vnni":
        from edgerun.ops.int8 import superblock_bytes as sbb

    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    n = args.tokens
    # one thread: the process's CPU time, which other processes on a shared host barely move
    clock = time.process_time if args.threads == 1 else time.perf_counter
    what = "CPU" if args.threads == 1 else "wall"
    print(f"{args.threads} threads, {n} tokens, median {what} time of {args.repeats} alternating")
    head = f"{'shape':18} {'per-32 ms':>10} {'GMAC/s':>7} {'super-block ms':>15} {'GMAC/s':>7}"
    head += f" {'ratio':>6}"
    if sbb is not None:
        head += f" {'bytes ms':>9} {'GMAC/s':>7} {'/ sb':>6}"
    print(head)
    for fmt, (rows, cols) in ((f, s) for f in args.formats.split(",") for s in SHAPES):
        q = QuantType[fmt]
        t = qm.TRAITS[q]
        w = QuantTensor("w", q, (rows, cols), random_blocks(q, rows, cols, rng))
        data = np.ascontiguousarray(w.data).view(np.uint8).reshape(rows, -1)
        X = rng.standard_normal((n, cols)).astype(np.float32)
        out = np.empty((n, rows), np.float32)
        old, new = (t.gemm_kind, data, X, out), (t.superblock_kind, data, X, out)
        runs = {"old": lambda a=old: v.mm_int8(*a), "new": lambda a=new: sb.mm_superblock(*a)}
        if sbb is not None and t.superblock_kind in sbb.BYTE_KINDS:
            runs["bytes"] = lambda a=new: sbb.mm_superblock_bytes(*a)
        med = alternate(runs, args.repeats, clock)
        to, tn = med["old"], med["new"]
        macs = rows * cols * n
        line = (
            f"{fmt:6} {rows}x{cols:<6} {to * 1e3:>10.1f} {macs / to / 1e9:>7.1f} "
            f"{tn * 1e3:>15.1f} {macs / tn / 1e9:>7.1f} {to / tn:>5.2f}x"
        )
        if "bytes" in med:
            tb = med["bytes"]
            line += f" {tb * 1e3:>9.1f} {macs / tb / 1e9:>7.1f} {tn / tb:>5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
