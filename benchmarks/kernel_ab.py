"""The int8 matvec kernels of a git revision against the working tree's, alternating in
one process (this machine kind's speed moves by up to 1.5x between runs; alternating
calls of both versions is what shows a 10% change).

    python benchmarks/kernel_ab.py --base HEAD~1                  # 1 thread, 512x1536
    python benchmarks/kernel_ab.py --base 6ede5f6 --rows 1536 --formats Q4_K Q6_K -t 2

The base revision's ops/qmatvec_vnni.py is loaded beside the current one as its own
module (its own Numba cache entries); everything else is the working tree's. For each
format, one vector (mv_*) and 2 and 4 batched (mvb_*): medians of --repeats rounds, each
round timing both versions in turn; the ratio is base time / new time (>1: new faster).
Weights are random blocks that fit in the last-level cache: this times the kernels'
compute, not DRAM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba  # noqa: E402
import numpy as np  # noqa: E402

from edgerun.ops import int8 as new_kernels  # noqa: E402
from edgerun.quant.formats import QuantType  # noqa: E402
from edgerun.quant.reference import random_blocks  # noqa: E402
from edgerun.runtime import numba_env  # noqa: E402,F401

KERNELS = "edgerun/ops/qmatvec_vnni.py"


def load_base(rev: str, workdir: str):
    """The revision's kernel module, imported from a copy in workdir."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    src = subprocess.run(
        ["git", "show", f"{rev}:{KERNELS}"], cwd=root, capture_output=True, text=True
    )
    if src.returncode != 0:
        sys.exit(f"git show {rev}:{KERNELS} failed: {src.stderr.strip()}")
    path = os.path.join(workdir, f"qmatvec_vnni_{rev.replace('/', '_').replace('~', '_')}.py")
    with open(path, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("edgerun.ops._kernel_ab_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_pair(fns: dict, repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions alternating each round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t) / calls)
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision of the kernels to compare")
    ap.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, tmp)
        print(
            f"kernel path {new_kernels.DOT}, {args.threads} thread(s), {args.rows}x{args.cols}, "
            f"base {args.base} vs working tree, medians of {args.repeats} alternating rounds"
        )
        for name in args.formats:
            q = QuantType[name]
            data = random_blocks(q, args.rows, args.cols, rng)
            d0 = data[:0]
            line = f"{name:5s}"
            for n in (1, 2, 4):
                x = rng.standard_normal((n, args.cols)).astype(np.float32)
                out = np.zeros((n, args.rows), np.float32)
                e = np.zeros((n, 0), np.float32)
                fns = {}
                for tag, mod in (("base", base), ("new", new_kernels)):
                    if n == 1:
                        mv = getattr(mod, "mv_" + name.lower())
                        fns[tag] = partial(mv, data, d0, d0, x[0], out[0], e[0], e[0])
                    else:
                        mvb = getattr(mod, "mvb_" + name.lower())
                        fns[tag] = partial(mvb, data, d0, d0, x, out, e, e)
                    fns[tag]()  # compile or load
                t = time_pair(fns, args.repeats, args.calls)
                ratio = t["base"] / t["new"]
                line += (
                    f"  N={n}: base {t['base'] * 1e6:7.1f} new {t['new'] * 1e6:7.1f} us "
                    f"({ratio:.2f}x)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
