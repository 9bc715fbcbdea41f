"""Row-interleaved decode kernels (edgerun/ops/qmatvec_rows16.py) against the row
kernels (qmatvec_vnni's mv_* / mvb_*), on a model's matrix shapes, out of cache.

For each (format, rows x cols, count): `count` copies of a random matrix (as a model's
layers stream them, larger than the last-level cache), timed as one pass over all of
them, for 1, 2, 4 and 8 vectors; the two kernel families alternate each round; medians.
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

# Qwen2.5-0.5B's and SmolLM2-135M's block-format shapes (gate/up, attention, head)
DEFAULT = [
    "Q5_0:4864x896x48",
    "Q5_0:896x896x48",
    "Q8_0:151936x896x1",
    "Q4_1:1536x576x60",
    "Q8_0:49152x576x1",
]


def _pass(fn, mats, args) -> float:
    t = time.perf_counter()
    for m in mats:
        fn(m, *args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT, help="FORMAT:ROWSxCOLSxCOUNT")
    ap.add_argument("--vectors", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    import numba

    from edgerun.ops import int8 as v

    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    e2 = np.zeros((0, 1), np.uint8)
    e2.flags.writeable = False
    for spec in args.shapes:
        name, dims = spec.split(":")
        rows, cols, count = (int(t) for t in dims.split("x"))
        qt = QuantType[name]
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        base = quantize(w, qt).reshape(rows, -1)
        raws = [base.copy() for _ in range(count)]
        for r in raws:
            r.flags.writeable = False
        ils = [r16.interleave(qt, r, rows, cols) for r in raws]
        row_mv = getattr(v, f"mv_{name.lower()}")
        row_mvb = getattr(v, f"mvb_{name.lower()}")
        ones: dict[str, float] = {}
        for nv in args.vectors:
            x = rng.standard_normal((nv, cols)).astype(np.float32)
            out = np.zeros((nv, rows), np.float32)
            if nv == 1:
                e1 = np.zeros(0, np.float32)
                a_row = (e2, e2, x[0], out[0], e1, e1)
                fam = {"rows": (row_mv, raws, a_row), "rows16": (TRAITS[qt].mv16, ils, a_row)}
            else:
                e = np.zeros((0, 0), np.float32)
                a = (e2, e2, x, out, e, e)
                fam = {"rows": (row_mvb, raws, a), "rows16": (TRAITS[qt].mvb16, ils, a)}
            times: dict[str, list[float]] = {k: [] for k in fam}
            for fn, mats, a in fam.values():
                _pass(fn, mats, a)  # compile, warm
            for _ in range(args.rounds):
                for k, (fn, mats, a) in fam.items():
                    times[k].append(_pass(fn, mats, a) * 1e3)
            med = {k: statistics.median(t) for k, t in times.items()}
            if nv == 1:
                ones = dict(med)
            rel = "  ".join(f"{k} {med[k] / ones[k]:.2f}x one" for k in med if k in ones)
            print(
                f"{name} {rows}x{cols} x{count} n={nv}: rows {med['rows']:.2f} ms, rows16 "
                f"{med['rows16']:.2f} ms ({med['rows'] / med['rows16']:.2f}x)  [{rel}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
