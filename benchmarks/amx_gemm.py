"""The prefill GEMMs on AMX tiles against the AVX-512 GEMMs they replace.

    python benchmarks/amx_gemm.py            # 2 threads, 128 tokens
    python benchmarks/amx_gemm.py -t 1 -n 64

Same process, same random blocks, alternating runs, median of the repeats:
- Q4_K / Q6_K on Qwen2.5-1.5B's shapes: `qmatmul_superblock.mm_superblock` (vpdpwssd)
  against `qmatmul_amx.mm_superblock_amx` (int8 tiles, the same integers);
- Q5_0 / Q8_0 / Q4_1 on Qwen2.5-0.5B's and SmolLM2's shapes: `qmatvec_vnni.mm_int8`
  (vpdpbusd, int8 activations) against `qmatmul_amx.mm_bf16_amx` (bf16 tiles).
Needs an x86 CPU with AMX (Intel Xeon 4th generation and newer).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from edgerun.runtime import numba_env  # noqa: E402

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from superblock_gemm import alternate  # noqa: E402

from edgerun.ops import qmatvec as qm  # noqa: E402
from edgerun.quant.formats import QuantType  # noqa: E402
from edgerun.quant.reference import random_blocks  # noqa: E402

SHAPES = [
    ("Q4_K", 8960, 1536),
    ("Q4_K", 1536, 1536),
    ("Q6_K", 1536, 8960),
    ("Q5_0", 4864, 896),
    ("Q5_0", 896, 896),
    ("Q8_0", 896, 896),
    ("Q4_1", 1536, 576),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=7)
    args = ap.parse_args()
    if "vnni" not in qm.available_paths():
        sys.exit("needs a CPU with AVX-512 VNNI and AMX")
    from edgerun.ops import amx
    from edgerun.ops import int8 as v
    from edgerun.ops.int8 import superblock as sb

    if not amx.available():
        sys.exit("this CPU or kernel has no AMX int8 tiles (or EDGERUN_AMX=0)")
    numba.set_num_threads(args.threads)
    parts = 4 * args.threads
    rng = np.random.default_rng(0)
    n = args.tokens
    print(f"{args.threads} threads, {n} tokens, median of {args.repeats} alternating runs")
    print(f"{'shape':16} {'AVX-512 ms':>10} {'GMAC/s':>7} {'AMX ms':>8} {'GMAC/s':>7} {'ratio':>6}")
    for fmt, rows, cols in SHAPES:
        q = QuantType[fmt]
        data = random_blocks(q, rows, cols, rng)
        X = rng.standard_normal((n, cols)).astype(np.float32)
        out = np.empty((n, rows), np.float32)
        a = (data, X, out)
        if q in (QuantType.Q4_K, QuantType.Q6_K):
            k = v.KIND_Q4_K if q == QuantType.Q4_K else v.KIND_Q6_K
            runs = {
                "avx512": lambda k=k, a=a: sb.mm_superblock(k, *a),
                "amx": lambda k=k, a=a: amx.mm_superblock_amx(k, *a, parts),
            }
        else:
            k = qm._MM_INT8[q]
            runs = {
                "avx512": lambda k=k, a=a: v.mm_int8(k, *a),
                "amx": lambda k=k, a=a: amx.mm_bf16_amx(k, *a, parts),
            }
        med = alternate(runs, args.repeats)
        ta, tb = med["avx512"], med["amx"]
        macs = rows * cols * n
        print(
            f"{fmt} {rows}x{cols:<6} {ta * 1e3:>10.2f} {macs / ta / 1e9:>7.0f} "
            f"{tb * 1e3:>8.2f} {macs / tb / 1e9:>7.0f} {ta / tb:>5.2f}x"
        )


if __name__ == "__main__":
    main()
