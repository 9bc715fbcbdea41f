"""Where a decode token's matvecs go: every layer's projections of a real model, timed
one by one in layer order, as decode streams them (a model larger than the last-level
cache reads them from DRAM), summed per role, format and shape, with the GB/s each
reaches. The head is timed after the layers.

This is how the 1.5B's 8960-column down projection showed up at 16-18 GB/s against
~36 GB/s for its gate and up (the reason for the matvec kernels' software prefetch,
`PREFETCH_BYTES` in edgerun/ops/qmatvec_vnni.py).

Usage: python benchmarks/decode_matvecs.py [-m MODEL] [-t THREADS] [-r REPEATS]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=5, help="passes over all layers")
    args = ap.parse_args()

    import numpy as np

    import edgerun
    from edgerun.ops import qmatvec

    model = edgerun.load(args.model, threads=args.threads)
    net = model.transformer
    rng = np.random.default_rng(0)
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    nbytes: dict[str, int] = collections.defaultdict(int)

    def matrices():
        for layer in net.layers:
            ap_, ffn = layer.attn_proj, layer.ffn
            for role in ("q", "k", "v", "o"):
                yield role, getattr(ap_, role)
            for role in ("gate", "up", "down"):
                yield role, getattr(ffn, role)
        yield "head", net.output

    for rep in range(args.repeats + 1):  # the first pass warms the kernels
        total: dict[str, float] = collections.defaultdict(float)
        for role, w in matrices():
            x = rng.standard_normal(w.shape[1]).astype(np.float32)
            t0 = time.perf_counter()
            qmatvec.matvec(w, x)
            key = f"{role:5s} {w.qtype.name:5s} {w.shape[0]}x{w.shape[1]}"
            total[key] += time.perf_counter() - t0
            if rep == 0:
                nbytes[key] += w.data.nbytes
        if rep:
            for key, t in total.items():
                seconds[key].append(t)

    print(f"{args.model}, {args.threads} threads, median of {args.repeats} passes")
    print(f"{'matrix':30s} {'ms/token':>9s} {'MB':>8s} {'GB/s':>6s}")
    whole = 0.0
    for key in sorted(seconds):
        t = statistics.median(seconds[key])
        whole += t
        print(f"{key:30s} {t * 1e3:9.2f} {nbytes[key] / 1e6:8.1f} {nbytes[key] / t / 1e9:6.1f}")
    note = "(one launch each; decode fuses q/k/v and gate/up)"
    print(f"{'all matvecs':30s} {whole * 1e3:9.2f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
