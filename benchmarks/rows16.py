"""Row-interleaved decode kernels (edgerun/ops/int8/rows16.py) against the row
kernels (edgerun/ops/int8's mv_* / mvb_*), on a model's matrix shapes, out of cache.

For each (format, rows x cols, count): `count` copies of a random matrix (as a model's
layers stream them, larger than the last-level cache), timed as one pass over all of
them, for 1, 2, 4 and 8 vectors; every vector count and both kernel families alternate
within each round; medians.
Prints ms a pass, the speedup, and each family's n-vector cost against its one vector.

Usage: python benchmarks/rows16.py [-t 2] [-r 7] [--shapes Q5_0:4864x896x48 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import edgerun  # noqa: F401  (configures Numba before it is imported)
from edgerun.ops.int8 import rows16 as r16
from edgerun.ops.traits import TRAITS
from edgerun.quant.formats import QuantType
from edgerun.quant.quantize import quantize
from edgerun.quant.reference import random_blocks

QUANTIZABLE = {QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q8_0}
QUANTIZABLE |= {QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K}

# Qwen2.5-0.5B's and SmolLM2-135M's block-format shapes (gate/up, attention, head)
DEFAULT = [
    "Q5_0:4864x896x48",
    "Q5_0:896x896x48",
    "Q8_0:151936x896x1",
    "Q4_1:1536x576x60",
    "Q8_0:49152x576x1",
]


def _pass(fn, mats, args, clock=time.perf_counter) -> float:
    t = clock()
    for m in mats:
        fn(m, *args)
    return clock() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT, help="FORMAT:ROWSxCOLSxCOUNT")
    ap.add_argument("--vectors", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU seconds, not wall (on a host shared with other work)",
    )
    args = ap.parse_args()
    import numba

    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    e2 = np.zeros((0, 1), np.uint8)
    e2.flags.writeable = False
    for spec in args.shapes:
        name, dims = spec.split(":")
        rows, cols, count = (int(t) for t in dims.split("x"))
        qt = QuantType[name]
        if qt in QUANTIZABLE:
            w = rng.standard_normal((rows, cols)).astype(np.float32)
            base = quantize(w, qt).reshape(rows, -1)
        else:  # a format this tree cannot quantize to (IQ4_XS): random valid blocks
            base = random_blocks(qt, rows, cols, rng)
        raws = [base.copy() for _ in range(count)]
        for r in raws:
            r.flags.writeable = False
        ils = [r16.interleave(qt, r, rows, cols) for r in raws]
        row_mv, row_mvb = TRAITS[qt].mv3, TRAITS[qt].mvb3
        fams = {}
        for nv in args.vectors:
            x = rng.standard_normal((nv, cols)).astype(np.float32)
            out = np.zeros((nv, rows), np.float32)
            if nv == 1:
                e1 = np.zeros(0, np.float32)
                a_row = (e2, e2, x[0], out[0], e1, e1)
                fams[nv] = {"rows": (row_mv, raws, a_row), "rows16": (TRAITS[qt].mv16, ils, a_row)}
            else:
                e = np.zeros((0, 0), np.float32)
                a = (e2, e2, x, out, e, e)
                fams[nv] = {"rows": (row_mvb, raws, a), "rows16": (TRAITS[qt].mvb16, ils, a)}
            for fn, mats, a in fams[nv].values():
                _pass(fn, mats, a)  # compile, warm
        times = {(nv, k): [] for nv, fam in fams.items() for k in fam}
        clock = time.process_time if args.cpu_time else time.perf_counter
        for _ in range(args.rounds):  # every vector count and family in each round
            for nv, fam in fams.items():
                for k, (fn, mats, a) in fam.items():
                    times[nv, k].append(_pass(fn, mats, a, clock) * 1e3)
        med = {key: statistics.median(t) for key, t in times.items()}
        one = args.vectors[0]
        for nv in fams:
            rel = "  ".join(f"{k} {med[nv, k] / med[one, k]:.2f}x one" for k in fams[nv])
            print(
                f"{name} {rows}x{cols} x{count} n={nv}: rows {med[nv, 'rows']:.2f} ms, rows16 "
                f"{med[nv, 'rows16']:.2f} ms ({med[nv, 'rows'] / med[nv, 'rows16']:.2f}x)  "
                f"[{rel}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
